"""The map stays true: the package's layers, its imports and docs/DESIGN.md's layout section.

The package has four layers (graphscan_ort/__init__.py): ``shared`` at the
bottom, then ``engines``, then the ``commands`` and the ``tune`` pipeline.
Imports go down, never up, never sideways between commands, and no module pip
installs (the core, the plugin's modules, the package) is in an import circle;
every module is named in DESIGN.md's layout section.
"""

import ast
import re
import tomllib

import pytest

from tests.helpers import ROOT

PACKAGE = ROOT / "graphscan_ort"
LAYERS = {"shared": 0, "engines": 1, "report": 1, "commands": 2, "tune": 2}
DOOR = "graphscan_ort.extension"  # the core's one way into the package, above every layer
MAX_MODULE_LINES = 800


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
# The plugin's modules: what pip installs beside the core, outside the package.
PLUGIN = {name: ROOT / f"{name}.py" for name in SETUPTOOLS["py-modules"] if name != "graphscan"}


# Every module pip installs, by its import name: the core, the plugin's modules and the package.
PRODUCT = {"graphscan": ROOT / "graphscan.py", **PLUGIN, **MODULES}


def imported_names(path):
    """Every name ``path`` imports absolutely, at any depth of its code (an import inside a
    function or under ``if TYPE_CHECKING:`` too: a type checker and a reader follow them):
    ``a.b`` for ``import a.b``, ``a`` and ``a.b`` for ``from a import b``."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    return imported


NAMES = {module: imported_names(path) for module, path in PRODUCT.items()}


def layer(module):
    """``(layer name, rank)`` of a module below graphscan_ort (None for the package's __init__);
    the door sits above every layer."""
    if module == DOOR:
        return "door", max(LAYERS.values()) + 1
    parts = module.split(".")
    return (parts[1], LAYERS[parts[1]]) if len(parts) > 2 else (None, None)


# The package modules each package module imports (the package's own __init__ left out).
IMPORTS = {module: {name for name in NAMES[module] if name in MODULES and "." in name} for module in MODULES}


def test_every_module_lives_in_a_layer():
    for module in MODULES:
        parts = module.split(".")
        assert module in ("graphscan_ort", DOOR) or parts[1] in LAYERS, module


def core_imports_of_the_package():
    """``(line, module)`` of every import in graphscan.py that reaches into graphscan_ort,
    at any depth of its code (the lazy imports sit inside functions)."""
    found = []
    for node in ast.walk(ast.parse((ROOT / "graphscan.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "graphscan_ort"]
    return found


def test_the_core_enters_the_package_by_one_door():
    """graphscan.py imports the package's extension module and nothing else of it: every
    ``import graphscan_ort...`` and ``from graphscan_ort... import`` names the door."""
    found = core_imports_of_the_package()
    assert found, "graphscan.py no longer imports the package at all: is the door still used?"
    beside = [(line, name) for line, name in found if name != DOOR and not name.startswith(DOOR + ".")]
    assert beside == [], f"graphscan.py imports the package beside its door: {beside}"


def test_nothing_in_the_package_imports_the_door():
    """The door is the core's: a package module importing it would close a circle through the core."""
    assert [module for module, imported in IMPORTS.items() if DOOR in imported] == []


def test_the_door_declares_every_package_command_of_the_registry():
    """The core's registry knows a package command by its name and summary alone; the door
    declares exactly those, each under its own name."""
    import graphscan
    from graphscan_ort import extension

    package = [name for name, entry in graphscan._COMMANDS.items() if entry.declared is None]
    assert sorted(extension.DECLARED) == sorted(package)
    assert [extension.command(name).name for name in package] == package


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_imports_go_down_never_sideways_between_commands(module):
    kind, rank = layer(module)
    for imported in sorted(IMPORTS[module]):
        other, other_rank = layer(imported)
        if other is None:
            continue
        assert other_rank <= rank, f"{module} imports {imported}, a layer above it"
        if kind in ("commands", "tune") and other in ("commands", "tune"):
            assert other == kind == "tune", f"{module} imports the command module {imported} (sideways)"


# The one import that goes up: the core calls its door when a package command runs, and the
# package below the door imports the core.
UPWARD = {("graphscan", DOOR)}


def import_circle(imports):
    """The first circle of ``imports`` (``{module: the modules it imports}``) a depth-first
    search finds, as the list of modules from one back to itself; None when there is none."""
    state = {}

    def visit(module, path):
        state[module] = "open"
        for imported in sorted(imports[module]):
            if imported == module or imported not in imports:
                continue
            if state.get(imported) == "open":
                return [*path, module, imported]
            if imported not in state:
                found = visit(imported, [*path, module])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in sorted(imports):
        if module not in state:
            found = visit(module, [])
            if found:
                return found
    return None


def test_no_import_circle_among_the_modules_pip_installs():
    """No module reaches itself by the imports of the core, the plugin's modules and the
    package, but by the core's door (UPWARD)."""
    imports = {
        module: {name for name in names if name in PRODUCT and (module, name) not in UPWARD}
        for module, names in NAMES.items()
    }
    circle = import_circle(imports)
    assert circle is None, " -> ".join(circle)


def test_the_circle_search_sees_two_modules_that_import_each_other(tmp_path):
    """Two modules beside the core, one importing the other for its types alone: a circle."""
    (tmp_path / "a.py").write_text("from b import f\n", encoding="utf-8")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a import G\n")
    (tmp_path / "c.py").write_text("def f():\n    import a\n", encoding="utf-8")
    imports = {name: imported_names(tmp_path / f"{name}.py") & {"a", "b", "c"} for name in ("a", "b", "c")}
    assert imports == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert import_circle(imports) == ["a", "b", "a"]
    assert import_circle({**imports, "b": set()}) is None


def layout_section():
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    match = re.search(r"^## Layout\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "docs/DESIGN.md has no '## Layout' section"
    return match.group(1)


@pytest.mark.parametrize("module", sorted({**MODULES, **PLUGIN}))
def test_design_md_names_every_module(module):
    path = {**MODULES, **PLUGIN}[module].relative_to(ROOT).as_posix()
    if path.endswith("__init__.py"):
        path = path[: -len("/__init__.py")] + "/"
    assert f"`{path}`" in layout_section(), f"docs/DESIGN.md's layout section does not name `{path}`"


def test_every_top_level_module_is_installed_and_type_checked():
    """A module beside the core (a part split out of the plugin) is one pip installs and mypy
    reads: else ``pip install .`` gives a plugin that fails to import."""
    mypy = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]["files"]
    beside = sorted(path.stem for path in ROOT.glob("graphscan*.py"))
    assert sorted(SETUPTOOLS["py-modules"]) == beside
    assert sorted(name.removesuffix(".py") for name in mypy if name.endswith(".py")) == beside


@pytest.mark.parametrize("module", sorted({**MODULES, **PLUGIN}))
def test_no_module_outgrows_itself(module):
    lines = {**MODULES, **PLUGIN}[module].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_MODULE_LINES, f"{module}: {lines} lines"


def test_no_docstring_or_comment_tells_history():
    """Code says what is, not which issue brought it: issue numbers belong in the history."""
    for path in [ROOT / "graphscan.py", *MODULES.values(), *PLUGIN.values()]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not re.search(r"\bissue \d+", line, re.I), f"{path.name}:{number}: {line.strip()}"


# The core's in-process API: the package's commands as functions of graphscan
# (graphscan.trace(a, b)) and render_table; nothing in the core calls them.
CORE_API = {"check", "fuse", "trace", "runtime", "impact", "tune", "report", "render_table"}
# A helper the package alone uses that still lives here, with its reason.
CORE_VOCABULARY = {"output_chain": "input_chain's mirror: the graph's Q/DQ vocabulary in one place"}


def test_the_core_holds_only_what_it_uses_itself():
    """Copied alone, graphscan.py is the onnx-only core: a top-level function, class or
    constant that only the package uses belongs in the package (graphscan_ort/shared)."""
    tree = ast.parse((ROOT / "graphscan.py").read_text(encoding="utf-8"))
    defined = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            defined[node.targets[0].id] = node
    unused = []
    for name, definition in defined.items():
        elsewhere = (part for node in tree.body if node is not definition for part in ast.walk(node))
        if not any(getattr(part, "id", None) == name or getattr(part, "attr", None) == name for part in elsewhere):
            unused.append(name)
    assert sorted(unused) == sorted(CORE_API | set(CORE_VOCABULARY))


# --------------------------------------------------------------------------
# The core's declared surface: the package and the plugin use only its __all__

BOUND_BY_ALL = [*MODULES.values(), *PLUGIN.values()]  # tests, bench/ and the scripts are free


def core_names_used(path):
    """``(line, name)`` of every name of the core that ``path`` uses: ``from graphscan import
    NAME``, and ``M.NAME`` (or ``getattr(M, "NAME")``) where M is the module itself: a name bound
    by ``import graphscan``, a call of a function that returns it (the plugin's lazy
    ``graphscan_core()``), or a name bound to such a call."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = list(ast.walk(tree))
    module = {
        alias.asname or "graphscan"
        for n in nodes
        if isinstance(n, ast.Import)
        for alias in n.names
        if alias.name == "graphscan"
    }

    def returns_the_core(function):
        return any(
            isinstance(r, ast.Return) and isinstance(r.value, ast.Name) and r.value.id in module
            for r in ast.walk(function)
        )

    getters = {n.name for n in nodes if isinstance(n, ast.FunctionDef) and returns_the_core(n)}

    def is_getter_call(value):
        return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in getters

    bound = {
        target.id
        for n in nodes
        if isinstance(n, ast.Assign) and is_getter_call(n.value)
        for target in n.targets
        if isinstance(target, ast.Name)
    }

    def is_core(value):
        return (isinstance(value, ast.Name) and value.id in module | bound) or is_getter_call(value)

    used = []
    for n in nodes:
        if isinstance(n, ast.ImportFrom) and n.module == "graphscan" and n.level == 0:
            used += [(n.lineno, alias.name) for alias in n.names]
        elif isinstance(n, ast.Attribute) and is_core(n.value):
            used.append((n.lineno, n.attr))
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "getattr"
            and is_core(n.args[0])
            and isinstance(n.args[1], ast.Constant)
        ):
            used.append((n.lineno, n.args[1].value))
    return used


def test_every_name_of_the_core_surface_exists():
    import graphscan

    assert len(set(graphscan.__all__)) == len(graphscan.__all__), "a name twice in graphscan.__all__"
    assert [name for name in graphscan.__all__ if not hasattr(graphscan, name)] == []


@pytest.mark.parametrize("path", BOUND_BY_ALL, ids=lambda path: path.relative_to(ROOT).as_posix())
def test_the_package_and_the_plugin_use_only_the_core_surface(path):
    """A module of graphscan_ort/ or the plugin importing a core name outside ``graphscan.__all__``
    fails: what the core declares is what it may change only with its users."""
    import graphscan

    outside = [(line, name) for line, name in core_names_used(path) if name not in graphscan.__all__]
    assert outside == [], f"{path.name} uses names of graphscan.py outside its __all__: {outside}"


def test_the_surface_reader_sees_every_way_in(tmp_path):
    """The reader above finds a name by each way the package and the plugin reach the core."""
    source = tmp_path / "user.py"
    source.write_text(
        "from graphscan import a\n"
        "import graphscan as g\n"
        "def core():\n    import graphscan\n\n    return graphscan\n"
        "def f():\n    g.b\n    core().c\n    m = core()\n    m.d\n    getattr(m, 'e')\n    other.f\n",
        encoding="utf-8",
    )
    assert sorted(name for _, name in core_names_used(source)) == ["a", "b", "c", "d", "e"]


def test_the_plugins_fixture_reaches_each_command_in_the_readers_sight():
    """The fixture calls each command of the core's registry as ``graphscan_core().NAME``, never
    by a name it holds: the reader above checks each against ``__all__``."""
    import graphscan

    used = {name for _, name in core_names_used(ROOT / "graphscan_pytest_fixture.py")}
    assert set(graphscan._COMMANDS) <= used
