"""The layout users rely on: graphscan.py alone, the graphscan_ort package beside it,
onnxruntime missing, and `pip install .` giving a `graphscan` command.

Every expectation is what the issue promises a user: the counting commands need
only onnx; the commands that run models say in one line what they need (exit 2),
never an internal error; the console script answers what `python graphscan.py` does.
"""

import dataclasses
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import graphscan
from tests.helpers import (
    ROOT,
    error_line,
    install_into_fresh_venv,
    json_answer,
    main_error_line,
    main_runs_in_one_process,
    run_graphscan,
    run_main,
)

MODEL_COMMANDS = [
    pytest.param(["fuse", "{fp32}", "{out}"], id="fuse"),
    pytest.param(["trace", "{fp32}", "{full}"], id="trace"),
    pytest.param(["runtime", "{full}"], id="runtime"),
    pytest.param(["impact", "{fp32}", "{full}"], id="impact"),
    pytest.param(["check", "{full}", "--min-int8", "0.5"], id="check-min-int8"),
    pytest.param(["check", "{full}", "--float", "{fp32}", "--min-sqnr", "10"], id="check-min-sqnr"),
    pytest.param(["dot", "{full}", "--runtime"], id="dot-runtime"),
]
COUNTING = [
    pytest.param(["nodes", "{full}"], id="nodes"),
    pytest.param(["qdq", "{full}"], id="qdq"),
    pytest.param(["islands", "{full}"], id="islands"),
    pytest.param(["boundary", "{full}"], id="boundary"),
    pytest.param(["diff", "{fp32}", "{full}"], id="diff"),
    pytest.param(["check", "{full}", "--max-float", "3"], id="check-structural"),
]
# Makes `import onnxruntime` fail in the process graphscan.py runs in, as on a
# machine where only onnx is installed.
WITHOUT_ORT = (
    "import sys, runpy; sys.modules['onnxruntime'] = None; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def filled(argv, folder):
    paths = {"fp32": ROOT / "ops" / "fp32.onnx", "full": ROOT / "ops" / "full.onnx", "out": folder / "out.onnx"}
    return [str(a).format(**{k: str(v) for k, v in paths.items()}) for a in argv]


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """graphscan.py copied alone into an empty folder, as a user drops it next to models."""
    folder = tmp_path_factory.mktemp("alone")
    shutil.copy2(ROOT / "graphscan.py", folder / "graphscan.py")
    return folder / "graphscan.py"


@pytest.mark.parametrize("argv", COUNTING)
def test_counting_commands_answer_with_graphscan_py_alone(alone, argv, tmp_path, capsys):
    argv = filled(argv, tmp_path)
    alone_answer = json_answer(run_graphscan(argv, cwd=tmp_path, script=str(alone)))
    code, out, _ = run_main(capsys, argv)  # the same command in this process, package beside it
    assert code == 0 and alone_answer == json.loads(out)


@pytest.mark.parametrize("argv", MODEL_COMMANDS)
def test_model_commands_with_graphscan_py_alone_say_what_they_need(alone, argv, tmp_path):
    line = error_line(run_graphscan(filled(argv, tmp_path), cwd=tmp_path, script=str(alone)), 2)
    assert "graphscan_ort" in line and "onnxruntime" in line, line
    assert not (tmp_path / "out.onnx").exists()


def run_without_onnxruntime(argv, folder):
    """graphscan.py run as a process in which ``import onnxruntime`` fails."""
    command = [sys.executable, "-c", WITHOUT_ORT, str(ROOT / "graphscan.py"), *filled(argv, folder)]
    return subprocess.run(command, capture_output=True, cwd=folder, timeout=120)


@pytest.mark.parametrize("argv", MODEL_COMMANDS)
def test_model_commands_without_onnxruntime_say_what_they_need(argv, tmp_path):
    line = error_line(run_without_onnxruntime(argv, tmp_path), 2)
    assert "onnxruntime" in line, line


def test_counting_commands_never_import_onnxruntime(tmp_path):
    """Every counting command in turn in one process in which ``import onnxruntime`` fails,
    the package beside graphscan.py: each answers, and onnxruntime is never imported."""
    runs = main_runs_in_one_process(
        [filled(param.values[0], tmp_path) for param in COUNTING],
        cwd=tmp_path,
        prelude="sys.modules['onnxruntime'] = None",
        after_each="sorted(m for m in sys.modules if m.startswith('onnxruntime'))",
    )
    assert [(code, err, imported) for code, _, err, imported in runs] == [(0, "", ["onnxruntime"])] * len(COUNTING)


def test_package_errors_are_one_class_when_graphscan_py_is_main(tmp_path):
    """Run as a script, graphscan.py is ``__main__``; the package imports it as
    ``graphscan``. A user error raised inside the package (exit 7 here: the models'
    inputs differ) must still be caught as one, not reported as an internal error."""
    proc = run_graphscan(["trace", ROOT / "ops" / "fp32.onnx", ROOT / "ops" / "gemm.onnx", "--shape", "nope=1,2"])
    assert error_line(proc, 7)
    proc = run_graphscan(["impact", ROOT / "ops" / "fp32.onnx", ROOT / "ops" / "full.onnx", "--shape", "x=1,2,3"])
    assert error_line(proc, 7)


def test_every_command_is_a_function_of_graphscan_that_runs_its_declaration(monkeypatch):
    """``graphscan.trace`` & co. stay importable as plain functions; each runs what its
    declaration (the module the registry names) runs, with the paths given and the keywords
    built into its groups as the command line's are. A core command without option groups (the
    counts, dot) is its function."""
    calls = []
    given = {"check": {"max_float": 1}, "tune": {"calibrate": ["c.npz"]}}
    for name, entry in graphscan._COMMANDS.items():
        function, command = getattr(graphscan, name), graphscan._load_command(name)
        assert callable(function) and command.name == name, name
        if entry.package:
            assert command.run.__module__.startswith("graphscan_ort."), name
        if not entry.package and not command.groups:
            assert function is command.run, name
            continue
        recorded = dataclasses.replace(command, run=lambda *a, name=name, **k: calls.append((name, a, k)))
        monkeypatch.setitem(graphscan._COMMANDS, name, dataclasses.replace(entry, declared=lambda c=recorded: c))
        paths = [f"{path}.onnx" for path in command.paths]
        function(*paths, **given.get(name, {}))
        built = graphscan._in_process_keywords(command, given.get(name, {}))
        assert calls[-1] == (name, tuple(paths), built), name
        assert {group.keyword for group in command.groups} <= set(built), name
    assert [name for name, _, _ in calls] == ["fuse", "trace", "runtime", "check", "impact", "tune", "report"]
    with pytest.raises(AttributeError):
        graphscan.no_such_command  # noqa: B018


# --------------------------------------------------------------------------
# One definition of --inputs, --shape and --seed


def sample_option_settings():
    """``{command: {flag: (type, action)}}`` for every command that takes sample options."""
    settings = {}
    for name in graphscan._COMMANDS:
        options = graphscan._load_command(name).flat_options()
        flags = {
            flag: (s.get("type"), s.get("action")) for flag, s in options if flag in ("--inputs", "--shape", "--seed")
        }
        if flags:
            settings[name] = flags
    return settings


def test_sample_options_parse_alike_in_every_command():
    settings = sample_option_settings()
    assert set(settings) == {"fuse", "trace", "runtime", "impact", "check", "tune"}
    first = settings["trace"]
    assert set(first) == {"--inputs", "--shape", "--seed"}
    for command, flags in settings.items():  # tune takes --inputs only: it never generates inputs
        assert all(flags[flag] == first[flag] for flag in flags), command


@pytest.mark.parametrize("command", ["fuse", "trace", "runtime", "impact", "check"])
def test_a_negative_seed_is_a_usage_error_everywhere(command, tmp_path, capsys):
    paths = {"fuse": ["{fp32}", "{out}"], "trace": ["{fp32}", "{full}"], "impact": ["{fp32}", "{full}"]}
    extra = {"check": ["--max-float", "9"], "runtime": ["--time"]}
    argv = filled([command, *paths.get(command, ["{full}"]), *extra.get(command, []), "--seed", "-1"], tmp_path)
    assert "--seed" in main_error_line(capsys, argv, 2)


@pytest.mark.parametrize("command", ["fuse", "trace", "runtime"])
def test_one_sample_commands_refuse_two_inputs_files(command, tmp_path, capsys):
    import numpy as np

    sample = tmp_path / "x.npz"
    np.savez(sample, x=np.zeros((1, 16), np.float32))
    paths = {"fuse": ["{fp32}", "{out}"], "trace": ["{fp32}", "{full}"], "runtime": ["{full}", "--time"]}[command]
    argv = filled([command, *paths, "--inputs", sample, "--inputs", sample], tmp_path)
    assert "--inputs" in main_error_line(capsys, argv, 2)


# --------------------------------------------------------------------------
# Exit codes: one table


def test_help_lists_every_exit_code_from_the_one_table():
    proc = run_graphscan(["--help"])
    text = " ".join(proc.stdout.decode().split())
    for code, meaning in graphscan.EXIT_CODES.items():
        assert f"{code} {meaning}" in text, (code, meaning)


# --------------------------------------------------------------------------
# pip install .


def assert_console_script_is_graphscan_py(bin_dir, tmp_path):
    console = str(bin_dir / "graphscan")
    for argv in (
        ["nodes", ROOT / "ops" / "full.onnx"],
        ["islands", ROOT / "ops" / "excluded.onnx", "--format", "table"],
        ["trace", ROOT / "ops" / "fp32.onnx", ROOT / "ops" / "full.onnx"],
        ["impact", ROOT / "ops" / "fp32.onnx", ROOT / "ops" / "full.onnx", "--top", "2"],
    ):
        installed = subprocess.run([console, *map(str, argv)], capture_output=True, cwd=tmp_path, timeout=300)
        assert installed.returncode == 0, installed.stderr
        assert installed.stdout == run_graphscan(argv, cwd=tmp_path).stdout, argv
    broken = subprocess.run([console, "nodes", "missing.onnx"], capture_output=True, cwd=tmp_path, timeout=60)
    assert error_line(broken, 3)


@pytest.mark.install
@pytest.mark.skipif(os.name != "posix", reason="venv layout with bin/")
def test_pip_install_gives_a_graphscan_command_equal_to_the_script(fresh_install, tmp_path):
    assert_console_script_is_graphscan_py(fresh_install, tmp_path)


@pytest.mark.install
@pytest.mark.skipif(os.name != "posix", reason="venv layout with bin/")
@pytest.mark.parametrize(
    "argv", [pytest.param(["--help"], id="help"), pytest.param(["tune", "--help"], id="tune-help")]
)
def test_help_names_the_program_as_it_was_invoked(fresh_install, argv, tmp_path):
    """``graphscan --help`` (the console script) says ``usage: graphscan``, ``python
    graphscan.py --help`` says ``usage: graphscan.py``: what the user typed."""
    for command, name in [
        ([str(fresh_install / "graphscan")], "graphscan"),
        ([sys.executable, ROOT / "graphscan.py"], "graphscan.py"),
    ]:
        proc = subprocess.run([*map(str, command), *argv], capture_output=True, cwd=tmp_path, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.decode().startswith(f"usage: {name} "), proc.stdout[:80]


def test_pip_install_resolves_the_ml_dtypes_the_pins_chose():
    """requirements.txt pins ml_dtypes 0.6.0 because 0.7.0 makes every process 0.8 s slower;
    ``pip install .`` (pyproject's dependencies) must admit the pin and refuse 0.7.0 too."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    wanted = [Requirement(d) for d in dependencies if canonicalize_name(Requirement(d).name) == "ml-dtypes"]
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    pins = [Requirement(line) for line in lines if line]
    pinned = [str(next(iter(r.specifier)).version) for r in pins if canonicalize_name(r.name) == "ml-dtypes"]
    assert len(wanted) == 1 and len(pinned) == 1
    assert wanted[0].specifier.contains(pinned[0]) and not wanted[0].specifier.contains("0.7.0")


def test_every_pin_is_admitted_by_pyproject_and_by_the_other_pinned_packages():
    """requirements.txt pins everything transitively (sympy brings mpmath, which sympy 1.14 wants
    below 1.4): each pin is inside pyproject's range for it, and inside the range every other
    pinned package, as installed here, declares for it."""
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    pins = {
        canonicalize_name(r.name): str(next(iter(r.specifier)).version) for r in map(Requirement, filter(None, lines))
    }
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    wanted = [(Requirement(d), "pyproject") for d in dependencies]
    for name in pins:
        wanted += [(Requirement(d), name) for d in importlib.metadata.requires(name) or [] if "extra ==" not in d]
    for requirement, by in wanted:
        name = canonicalize_name(requirement.name)
        assert name not in pins or requirement.specifier.contains(pins[name]), (by, str(requirement), pins[name])
    assert {"sympy", "mpmath"} <= set(pins)  # onnxruntime's symbolic shape inference, and sympy's own


@pytest.mark.slow
def test_pip_install_from_the_registry_in_a_fresh_venv(tmp_path):
    """The README's install on a fresh machine: dependencies from the registry (slow, run by hand)."""
    assert_console_script_is_graphscan_py(install_into_fresh_venv(tmp_path, index=True), tmp_path)
