"""Installed means running: a CPU target whose files are damaged or stale, or that does not
start, reads as not installed; every command that needs it is exit 2 naming the install
command; the install command repairs it, and leaves a whole one alone.

Without qemu: the arm64 folder is a fake one in tmp_path (``fake_arm64``), the tools are fake
executables that fail when run, and a target that must start is this interpreter standing in
for the emulated one (the worker's protocol is the same). The shared install is never touched:
``GRAPHSCAN_TARGETS`` points into tmp_path; the ``targets`` test at the end damages a copy of
it made of links.
"""

import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

import graphscan
from graphscan_ort.shared import targets
from tests.helpers import main_error_line
from tests.targets.test_targets import INSTALL, empty_bin, fake_arm64, fake_tools, needs

PINS = {name: importlib.metadata.version(name) for name in targets.PINNED}
# What an interpreter whose onnxruntime cannot load says before it ends.
BROKEN = "ImportError: libonnxruntime.so.1: cannot open shared object file"
# A target's interpreter that answers every call with its facts as targets.serve does,
# without importing onnxruntime (the status and install tests start many): argv[1], the
# onnxruntime version it says it runs.
ANSWERS_FACTS = """
import json, sys
facts = {"name": "native", "onnxruntime": sys.argv[1], "machine": "x86_64"}
print("ready", flush=True)
for line in sys.stdin:
    request, answer = json.loads(line)
    with open(answer, "w") as f:
        json.dump({"cpu": facts, "result": facts}, f)
    print(flush=True)
"""


@pytest.fixture
def host(monkeypatch, tmp_path):
    """An x86-64 host whose targets' folder is ``tmp_path/targets``, with only fake qemu-user,
    unshare and apt tools on the PATH: a target started through them fails at once."""
    monkeypatch.setenv("GRAPHSCAN_TARGETS", str(tmp_path / "targets"))
    tools = empty_bin(tmp_path)
    fake_tools(tools, "qemu-x86_64", "qemu-aarch64", "unshare", "apt-get", "apt-cache", "dpkg")
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    return tmp_path / "targets"


def stand_in(monkeypatch, starts, serves=False):
    """Every target's interpreter is this one, which starts when ``starts()`` says so (and
    runs graphscan's own ``serve`` when ``serves``, else ANSWERS_FACTS with this environment's
    onnxruntime), and otherwise ends at once as one whose onnxruntime cannot load."""

    def command(target, argv):
        env = dict(os.environ, PYTHONPATH=str(targets.repository()))
        if not starts():
            return [sys.executable, "-c", f"import sys; sys.exit({BROKEN!r})"], env
        return [sys.executable, *(argv if serves else ["-c", ANSWERS_FACTS, PINS["onnxruntime"]])], env

    monkeypatch.setattr(targets, "command", command)


def fake_builder(monkeypatch, mark=None):
    """``build_arm64`` replaced by one that lays a whole fake folder (and ``mark`` in it):
    the calls it got."""
    built = []

    def build(work):
        built.append(work)
        fake_arm64(work / "arm64")
        if mark:
            (work / "arm64" / mark).touch()

    monkeypatch.setattr(targets, "build_arm64", build)
    return built


# -- damaged or stale: not installed, and commands name the install command


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        pytest.param(f"sysroot/{targets.ARM64_PYTHON}", "damaged: no sysroot/usr/bin/python3.11", id="no-interpreter"),
        pytest.param("cpuinfo", "damaged: no cpuinfo", id="no-cpuinfo"),
        pytest.param(f"site/onnxruntime-{PINS['onnxruntime']}.dist-info", "'onnxruntime': None", id="no-onnxruntime"),
        pytest.param(targets.STAMP, "not installed", id="unfinished"),
    ],
)
def test_an_arm64_folder_with_a_part_missing_is_not_installed_and_commands_name_the_install(
    capsys, host, damage, words
):
    """Its stamp says nothing of its parts: each must be there for the target to read as installed."""
    folder = fake_arm64(host / "arm64")
    part = folder / damage
    shutil.rmtree(part) if part.is_dir() else part.unlink()
    state = targets.status()["targets"]["arm64"]
    assert state["installed"] is False and words in state["missing"], state
    line = main_error_line(capsys, ["runtime", "ops/full.onnx", "--cpu", "arm64"], graphscan.EXIT_USAGE)
    assert re.fullmatch(rf"graphscan: usage: CPU target arm64: .*{re.escape(words)}.*\(install it: {INSTALL}\)", line)


def stale_install(folder, package):
    """A whole fake arm64 folder holding ``package`` at 0.0.1, its stamp saying this
    environment's pins (a stamp that has not followed what was installed since)."""
    fake_arm64(folder, {**PINS, package: "0.0.1"})
    (folder / targets.STAMP).write_text(json.dumps({"pins": PINS}))
    return folder


@pytest.mark.parametrize("package", targets.PINNED)
def test_an_install_whose_pinned_versions_are_stale_is_not_installed(capsys, host, package):
    """The versions are those installed in the target (its packages' metadata), whatever its
    stamp says: another version of any pinned package answers for another release."""
    stale_install(host / "arm64", package)
    problem = targets.missing("arm64")
    assert problem is not None and f"'{package}': '0.0.1'" in problem and f"'{package}': '{PINS[package]}'" in problem
    line = main_error_line(capsys, ["runtime", "ops/full.onnx", "--cpu", "arm64"], graphscan.EXIT_USAGE)
    assert "0.0.1" in line and line.endswith(f"(install it: {targets.INSTALL_COMMAND})")


def test_install_repairs_an_install_whose_pinned_versions_are_stale(monkeypatch, host):
    folder = stale_install(host / "arm64", "numpy")
    stand_in(monkeypatch, starts=lambda: True)
    built = fake_builder(monkeypatch)
    answer = targets.install()
    assert len(built) == 1 and answer["targets"]["arm64"] == {"installed": True, "missing": None}
    assert targets.site_versions(folder / "site")["numpy"] == PINS["numpy"]


# -- whole files, but it does not start: the install is blamed, and repaired


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["runtime", "ops/full.onnx"], id="runtime"),
        pytest.param(["check", "ops/full.onnx", "--min-int8", "0.1"], id="check"),
    ],
)
def test_a_target_that_does_not_start_is_not_installed_and_commands_blame_its_install(capsys, monkeypatch, host, argv):
    """Its files look whole; its interpreter ends before it is ready: exit 2 naming the install
    command, with its last words (a crash in the middle of a call stays exit 5)."""
    fake_arm64(host / "arm64")
    stand_in(monkeypatch, starts=lambda: False)
    assert targets.missing("arm64") is None  # nothing its files show
    state = targets.status()["targets"]["arm64"]
    start = f"it does not start: its interpreter was stopped (exit 1) before it was ready: {BROKEN}"
    assert state == {"installed": False, "missing": start}
    line = main_error_line(capsys, [*argv, "--cpu", "arm64"], graphscan.EXIT_USAGE)
    assert line == f"graphscan: usage: CPU target arm64: {start} (install it: {targets.INSTALL_COMMAND})"


def test_status_says_installed_when_each_target_answers_a_trivial_call(monkeypatch, host):
    fake_arm64(host / "arm64")
    stand_in(monkeypatch, starts=lambda: True, serves=True)
    assert targets.status()["targets"] == {name: {"installed": True, "missing": None} for name in targets.TARGETS}


def test_install_repairs_a_target_that_does_not_start_and_then_leaves_it_alone(monkeypatch, host):
    """Whole files but no start: rebuilt once; installing again, it runs, so nothing is rebuilt."""
    fake_arm64(host / "arm64")
    stand_in(monkeypatch, starts=lambda: (host / "arm64" / "rebuilt").exists())
    built = fake_builder(monkeypatch, mark="rebuilt")
    first = targets.install()
    assert len(built) == 1 and first["targets"]["arm64"] == {"installed": True, "missing": None}
    assert targets.install() == first and len(built) == 1


def test_an_install_that_still_does_not_run_is_one_line_exit_2(capsys, monkeypatch, host):
    fake_builder(monkeypatch)
    stand_in(monkeypatch, starts=lambda: False)
    assert targets.main(["install"]) == graphscan.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("graphscan: targets: x86-avx2 still does not run after the install: it does not")


# -- the install command's own errors: one line


def test_install_into_a_cache_folder_that_cannot_be_made_is_one_line_exit_3_naming_it(capsys, monkeypatch, host):
    """``XDG_CACHE_HOME`` is a file: the targets' folder under it cannot be made."""
    monkeypatch.delenv("GRAPHSCAN_TARGETS")
    cache = host.parent / "cache"
    cache.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert targets.main(["install"]) == graphscan.EXIT_NO_FILE
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"{cache}/graphscan/targets" in captured.err and "Not a directory" in captured.err


def test_the_usage_line_names_the_module_users_type():
    """Run as ``python -m``, the module's own name is __main__: the line must not say that."""
    done = subprocess.run(
        [sys.executable, "-m", "graphscan_ort.shared.targets", "remove"],
        capture_output=True,
        text=True,
        cwd=targets.repository(),
    )
    assert done.returncode == graphscan.EXIT_USAGE and done.stdout == ""
    module = "graphscan_ort.shared.targets"
    assert done.stderr == f"graphscan: usage: python -m {module} install | python -m {module} status\n"


# -- on the real install (pytest -m targets)


@pytest.mark.targets
@needs("arm64")
def test_a_real_arm64_install_whose_onnxruntime_does_not_load_is_blamed_and_not_installed(
    capsys, monkeypatch, tmp_path
):
    """A copy of the real install (links: the shared one is never written) without
    onnxruntime's compiled module: its files look whole, its interpreter under qemu ends
    before it is ready."""
    copy = tmp_path / "targets"
    shutil.copytree(targets.root(), copy, symlinks=True, copy_function=os.link)
    capi = copy / "arm64" / "site" / "onnxruntime" / "capi"
    for library in capi.glob("onnxruntime_pybind11_state*.so"):
        library.unlink()
    monkeypatch.setenv("GRAPHSCAN_TARGETS", str(copy))
    assert targets.missing("arm64") is None
    problem = targets.probed(["arm64"])["arm64"]
    assert problem is not None and problem.startswith("it does not start: its interpreter was stopped"), problem
    line = main_error_line(capsys, ["runtime", "ops/full.onnx", "--cpu", "arm64"], graphscan.EXIT_USAGE)
    assert line == f"graphscan: usage: CPU target arm64: {problem} (install it: {targets.INSTALL_COMMAND})"
