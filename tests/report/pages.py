"""A page read back by the standard library's HTML parser (no code shared with the report):
its sections, its tables' cells, the marks of its SVG groups and every link it holds."""

import re
from html.parser import HTMLParser


class Page(HTMLParser):
    """What the tests read of a page: ``sections`` (ids, in order), ``tables`` (each a list
    of rows of cell texts, ``by_id`` for those with an id, ``in_section`` by the section that
    holds them), ``marks`` (``{group id: [(x, y, style)]}``: each ``<use>`` marker drawn in
    an SVG group), ``links`` (every href and src), ``scripts`` and ``meta``."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.sections, self.tables, self.by_id, self.in_section = [], [], {}, {}
        self.marks, self.links, self.scripts, self.meta, self.titles = {}, [], 0, [], {}
        self.paths = {}  # group id: the numbers of each path drawn in it (M x y L x y ...)
        self.text_of = {}  # section id: its text
        self._groups, self._row, self._cell, self._section, self._title = [], None, None, None, None
        self._stack = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag in ("div", "li", "br", "p") and self._cell is not None:  # a line of its own in the cell
            self._cell += "\n"
        self.links += [value for key, value in attrs if key in ("href", "src", "xlink:href") and value]
        if tag == "section":
            self._section = attributes.get("id")
            self.sections.append(self._section)
            self.text_of[self._section] = ""
        elif tag == "table":
            self.tables.append([])
            self.in_section.setdefault(self._section, []).append(self.tables[-1])
            if attributes.get("id"):
                self.by_id[attributes["id"]] = self.tables[-1]
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "script":
            self.scripts += 1
        elif tag == "meta":
            self.meta.append(attributes)
        elif tag == "g":
            self._groups.append(attributes.get("id"))
        elif tag == "path" and "d" in attributes:
            numbers = [float(v) for v in re.findall(r"-?[\d.]+(?:e-?\d+)?", attributes["d"])]
            for group in self._groups:
                if group is not None:
                    self.paths.setdefault(group, []).append(numbers)
        elif tag == "use":
            for group in self._groups:
                if group is not None:
                    self.marks.setdefault(group, []).append(
                        (float(attributes["x"]), float(attributes["y"]), attributes.get("style", ""))
                    )
        elif tag == "title" and self._groups:
            self._title = ""

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag == "g":
            self._groups.pop()

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._row is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None
        elif tag == "g" and self._groups:
            self._groups.pop()
        elif tag == "title" and self._title is not None:
            group = next((g for g in reversed(self._groups) if g), None)
            self.titles.setdefault(group, self._title)
            self._title = None
        elif tag == "section":
            self._section = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data
        if self._title is not None:
            self._title += data
        if self._section is not None:
            self.text_of[self._section] += data

    def front_marks(self):
        """The marks of tune's front: ``{row id: (x, y, style)}`` of each ``row-<id>`` group."""
        return {int(g[4:]): marks[0] for g, marks in self.marks.items() if g.startswith("row-")}
