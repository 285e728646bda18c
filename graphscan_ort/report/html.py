"""The report's HTML: text escaped by default, a few blocks (sections, tables, lists) and
the one self-contained document around them (its style inline, no script, nothing fetched)."""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Iterable, Sequence


class Html(str):
    """Markup that is already HTML (a chart's SVG, a block built here): never escaped again."""

    __slots__ = ()


def text(value: object) -> Html:
    """``value`` as HTML text: escaped, None as an em dash, a float to 4 significant digits."""
    if isinstance(value, Html):
        return value
    if value is None:
        return Html("&mdash;")
    if isinstance(value, bool):
        return Html("yes" if value else "no")
    if isinstance(value, float):
        return Html(f"{value:.4g}")
    return Html(html.escape(str(value)))


def join(parts: Iterable[object]) -> Html:
    return Html("".join(text(part) for part in parts))


def tag(name: str, body: object = "", **attributes: object) -> Html:
    """``<name attributes>body</name>``; ``class_`` is ``class``, a None attribute left out."""
    shown = "".join(
        f' {key.rstrip("_").replace("_", "-")}="{html.escape(str(value), quote=True)}"'
        for key, value in attributes.items()
        if value is not None
    )
    return Html(f"<{name}{shown}>{text(body)}</{name}>")


def paragraph(*parts: object, class_: str | None = None) -> Html:
    return tag("p", join(parts), class_=class_)


def bullets(items: Iterable[object]) -> Html:
    listed = [tag("li", item) for item in items]
    return tag("ul", join(listed)) if listed else Html("")


def code(value: object) -> Html:
    return tag("code", value)


def pre(value: str) -> Html:
    return tag("pre", value)


def details(summary: object, body: object) -> Html:
    return tag("details", join([tag("summary", summary), body]))


def table(
    header: Sequence[str],
    rows: Iterable[Sequence[object]],
    row_classes: Sequence[str | None] = (),
    id_: str | None = None,
) -> Html:
    """A table of ``rows`` under ``header``; numbers right-aligned; ``row_classes`` style rows
    (``chosen``, ``refused``)."""
    head = tag("tr", join(tag("th", title) for title in header))
    lines = []
    for k, row in enumerate(rows):
        cells = [tag("td", cell, class_="num" if isinstance(cell, (int, float)) else None) for cell in row]
        lines.append(tag("tr", join(cells), class_=row_classes[k] if k < len(row_classes) else None))
    return tag("table", join([tag("thead", head), tag("tbody", join(lines))]), id=id_)


def figure(svg: str, caption: object) -> Html:
    """A chart (inline SVG) with its caption."""
    return tag("figure", join([Html(svg), tag("figcaption", caption)]))


@dataclasses.dataclass(frozen=True)
class Section:
    """One section of a page: its id (what a test or a link finds), its title and body."""

    id: str
    title: str
    body: Html

    def html(self) -> Html:
        return tag("section", join([tag("h2", self.title), self.body]), id=self.id)


STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 1.5em auto;
  max-width: 72em; padding: 0 1em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 2em; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 0.15em 0.5em; text-align: left; vertical-align: top; }
td { white-space: nowrap; }
td:last-child { white-space: normal; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.chosen td { background: #fde0dd; font-weight: bold; }
tr.refused td { color: #777; }
tr.failed td, span.failed { color: #b2182b; font-weight: bold; }
span.passed, tr.passed span.outcome { color: #1a7f37; }
span.skipped, span.not-run, tr.not-run td { color: #777; }
figure { margin: 0.8em 0; }
figure svg { max-width: 100%; height: auto; }
div.map { max-height: 50em; overflow: auto; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #555; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; font-size: 0.8em; max-height: 30em; }
p.note { color: #555; font-size: 0.9em; }
code { font-size: 0.9em; }
nav a { margin-right: 1em; }
"""


POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def document(title: str, intro: Html, sections: Sequence[Section]) -> str:
    """The whole page: one file, its style inline, no script and no link outside itself."""
    links = tag("nav", join(tag("a", s.title, href=f"#{s.id}") for s in sections)) if len(sections) > 1 else ""
    body = join([tag("h1", title), intro, links, *(s.html() for s in sections)])
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        # Nothing is fetched, whatever the page holds: the browser refuses every request.
        f'<meta http-equiv="Content-Security-Policy" content="{POLICY}">\n'
        f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )
