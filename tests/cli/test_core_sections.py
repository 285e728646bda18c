"""graphscan.py reads top to bottom: sections under banners, each short, in dependency order.

A section starts at a banner, a line of dashes (``# ----...``) followed by its title
(``# Loading``); the lines before the first banner are the head (the docstring, the
imports, ``__all__``, the errors and exit codes). Every section, the head included, holds
at most MAX_SECTION_LINES lines. A function of a section calls only what the sections
above it (or its own) define, but for the few late calls listed in LATE_CALLS, each with
its reason: the file is one reading order, not a web.
"""

import ast
import re

import pytest

import graphscan
from tests.helpers import ROOT

CORE = ROOT / "graphscan.py"
MAX_SECTION_LINES = 450
BANNER = re.compile(r"# -{20,}")

# (user, what it uses, why): a definition using something defined in a later section. Named
# by the objects themselves, so a rename reaches this list too.
LATE_CALLS = [
    (graphscan._answer_command, graphscan._COMMANDS, "table reads any command's answer, and is in the registry"),
    (graphscan._answer_command, graphscan._load_command, "table renders any command's answer, and is in the registry"),
]


def core_name(value):
    """The one top-level name graphscan.py binds ``value`` to."""
    (name,) = [name for name, bound in vars(graphscan).items() if bound is value]
    return name


def sections(source):
    """``[(title, first line, line count)]``: the head, then one per banner (lines from 1)."""
    lines = source.splitlines()
    banners = [k for k, line in enumerate(lines) if BANNER.fullmatch(line)]
    for k in banners:
        assert k + 1 < len(lines) and re.fullmatch(r"# \S.*", lines[k + 1]), f"banner at line {k + 1} has no title"
    starts = [0, *banners]
    ends = [*banners, len(lines)]
    titles = ["(the head)"] + [lines[k + 1][2:] for k in banners]
    return [(title, start + 1, end - start) for title, start, end in zip(titles, starts, ends, strict=True)]


def section_of(line, found):
    """The position in ``found`` of the section holding ``line``."""
    return max(k for k, (_, first, _) in enumerate(found) if line >= first)


def local_names(function):
    """Names bound inside ``function`` (a def or lambda): its parameters and every name it assigns,
    imports or defines; nested functions included, which only makes the reading stricter."""
    arguments = function.args
    bound = {
        arg.arg
        for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
        if arg is not None
    }
    for statement in function.body if isinstance(function.body, list) else [function.body]:
        for node in ast.walk(statement):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                bound.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return bound


def top_level_names(tree):
    """``{name: its top-level statement}`` for every def, class and assigned name."""
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.setdefault(node.name, node)
        elif isinstance(node, ast.Assign):
            defined.update((t.id, node) for t in node.targets if isinstance(t, ast.Name) and t.id not in defined)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.setdefault(node.target.id, node)
    return defined


def late_calls(source):
    """``{(user, name)}``: a top-level definition using a top-level ``name`` defined in a later
    section. Annotations are left out (they are never evaluated: ``from __future__ import
    annotations``), and so are names a function binds itself."""
    tree, found = ast.parse(source), sections(source)
    defined = {name: section_of(node.lineno, found) for name, node in top_level_names(tree).items()}
    late = set()

    def visit(node, scopes, top):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            for child in [*getattr(node, "decorator_list", []), *arguments.defaults, *arguments.kw_defaults]:
                if child is not None:
                    visit(child, scopes, top)
            inner = [*scopes, local_names(node)]
            for statement in node.body if isinstance(node.body, list) else [node.body]:
                visit(statement, inner, top)
        elif isinstance(node, ast.ClassDef):
            for child in [*node.decorator_list, *node.bases, *node.body]:
                visit(child, scopes, top)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                visit(node.value, scopes, top)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            local = any(node.id in scope for scope in scopes)
            if not local and defined.get(node.id, -1) > section_of(top.lineno, found):
                late.add((getattr(top, "name", None) or top.targets[0].id, node.id))
        else:
            for child in ast.iter_child_nodes(node):
                visit(child, scopes, top)

    for node in tree.body:
        visit(node, [], node)
    return late


CORE_SECTIONS = sections(CORE.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    ("title", "first", "count"),
    [pytest.param(*s, id=f"{k:02d}-{s[0].split(':')[0]}") for k, s in enumerate(CORE_SECTIONS)],
)
def test_every_section_of_the_core_is_short(title, first, count):
    assert count <= MAX_SECTION_LINES, f"graphscan.py's section {title!r} (line {first}) holds {count} lines"


def test_the_core_is_cut_into_sections_with_titles_of_their_own():
    titles = [title for title, _, _ in CORE_SECTIONS]
    assert len(titles) > 1
    assert len(set(titles)) == len(titles), titles


def test_every_section_uses_only_the_sections_above_it_but_the_listed_late_calls():
    found = late_calls(CORE.read_text(encoding="utf-8"))
    listed = {(core_name(user), core_name(used)) for user, used, _ in LATE_CALLS}
    unlisted = sorted(found - listed)
    stale = sorted(listed - found)
    assert unlisted == [], f"move the definition up, or list the late call with its reason: {unlisted}"
    assert stale == [], f"listed late calls that are gone: {stale}"


HEAD = '"""A module."""\nimport os\n\n\n'
ONE = "# " + "-" * 30 + "\n# One\n\n\n"
TWO = "# " + "-" * 30 + "\n# Two\n\n\n"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param(
            HEAD + ONE + "def early():\n    return later()\n\n\n" + TWO + "def later():\n    return early()\n",
            {("early", "later")},
            id="a-call-down-the-file-is-late",
        ),
        pytest.param(
            HEAD + ONE + "def early(later):\n    return later\n\n\n" + TWO + "def later():\n    return 1\n",
            set(),
            id="a-parameter-of-that-name-is-not",
        ),
        pytest.param(
            HEAD + ONE + "def early():\n    later = 2\n    return later\n\n\n" + TWO + "later = 1\n",
            set(),
            id="a-local-of-that-name-is-not",
        ),
        pytest.param(
            HEAD + ONE + "def early() -> Later:\n    return None\n\n\n" + TWO + "class Later:\n    pass\n",
            set(),
            id="an-annotation-is-not",
        ),
        pytest.param(
            HEAD + ONE + "TABLE = {'a': lambda: A}\n\n\n" + TWO + "A = 1\n",
            {("TABLE", "A")},
            id="a-lambda-in-a-constant-is-late",
        ),
        pytest.param(
            HEAD + ONE + "class C:\n    def m(self):\n        return later()\n\n\n" + TWO + "def later():\n    pass\n",
            {("C", "later")},
            id="a-method-is-read-too",
        ),
    ],
)
def test_the_reader_finds_late_calls_and_only_those(source, expected):
    assert late_calls(source) == expected


def test_the_reader_counts_every_line_in_one_section():
    source = HEAD + ONE + "x = 1\n" + TWO + "y = 2\n"
    found = sections(source)
    assert [title for title, _, _ in found] == ["(the head)", "One", "Two"]
    assert sum(count for _, _, count in found) == len(source.splitlines())
    assert [first for _, first, _ in found] == [1, 5, 10]
