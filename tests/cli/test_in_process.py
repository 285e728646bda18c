"""The suite's in-process run of graphscan.py is the process, byte for byte.

Most tests call ``run_graphscan``, which runs ``graphscan.main`` in the test's own
process (tests/helpers.py, ``run_in_process``) because a separate Python costs about
0.3 s before graphscan starts. That is only honest while both give the same exit
code, stdout and stderr: here each way an answer leaves graphscan (JSON, a table, DOT,
--help, a written model), each command that runs models, and each class of error (usage,
a missing or damaged file, inputs that cannot be made, a broken budget) run both ways
and are compared whole. Each case costs a process, so the cases are chosen, not
multiplied. Runs whose answer holds a timing (``runtime --time``, tune's latency) are
left out: they differ between any two runs.
"""

import shutil

import numpy as np
import pytest

from tests.helpers import describe, run_graphscan_process, run_in_process


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_lab):
    """The lab's models, a damaged file, a folder, samples and a saved answer, under relative names."""
    where = tmp_path_factory.mktemp("in_process")
    for variant in ("fp32", "full", "matmul_only"):
        shutil.copy(default_lab[variant], where / f"{variant}.onnx")
    (where / "damaged.onnx").write_bytes((where / "full.onnx").read_bytes()[:200])
    (where / "a_folder").mkdir()
    rng = np.random.default_rng(0)
    np.savez(where / "sample.npz", x=rng.standard_normal((2, 16)).astype(np.float32))
    np.savez(where / "nan.npz", x=np.full((2, 16), np.nan, np.float32))
    (where / "islands.json").write_bytes(run_graphscan_process(["islands", "matmul_only.onnx"], cwd=where).stdout)
    return where


CASES = {
    "nodes": ["nodes", "full.onnx"],
    "boundary top": ["boundary", "matmul_only.onnx", "--format", "table", "--top", "1"],
    "qdq table": ["qdq", "full.onnx", "--format", "table"],
    "diff": ["diff", "full.onnx", "matmul_only.onnx"],
    "dot": ["dot", "matmul_only.onnx"],
    "fuse": ["fuse", "fp32.onnx"],
    "trace": ["trace", "fp32.onnx", "full.onnx", "--inputs", "sample.npz"],
    "runtime table": ["runtime", "full.onnx", "--format", "table"],
    "impact": ["impact", "fp32.onnx", "full.onnx", "--inputs", "sample.npz", "--target-sqnr", "40"],
    "check broken": ["check", "full.onnx", "--float", "fp32.onnx", "--inputs", "sample.npz", "--min-sqnr", "90"],
    "table": ["table", "islands.json"],
    "report": ["report", "islands.json", "--out", "islands.html"],
    "help": ["--help"],
    "unknown option": ["nodes", "full.onnx", "--frob"],
    "missing file": ["qdq", "missing.onnx"],
    "damaged": ["boundary", "damaged.onnx"],
    "NaN samples": ["impact", "fp32.onnx", "full.onnx", "--inputs", "nan.npz"],
    "unreadable shape": ["trace", "fp32.onnx", "full.onnx", "--shape", "x=a,b"],
    "tune usage": ["tune", "fp32.onnx", "--calibrate", "a_folder", "--out", "out", "--level", "disabled"],
}


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_the_in_process_run_gives_the_process_bytes(folder, argv):
    process = run_graphscan_process(argv, cwd=folder)
    here = run_in_process(argv, cwd=folder)
    assert (here.returncode, here.stdout, here.stderr) == (process.returncode, process.stdout, process.stderr), (
        f"process: {describe(process)}\nin process: {describe(here)}"
    )


def test_the_cases_cover_every_package_command_and_every_exit_code_they_can(folder):
    import graphscan

    covered = {argv[0] for argv in CASES.values() if argv}
    assert {name for name, entry in graphscan._COMMANDS.items() if entry.package} <= covered
    codes = {run_in_process(argv, cwd=folder).returncode for argv in CASES.values()}
    assert {0, 2, 3, 4, 7, 8} <= codes, codes


def test_an_escape_from_main_is_a_traceback_and_exit_1(folder, monkeypatch):
    """What the interpreter does with an exception main() lets through, so that a test
    which would see a traceback from the process sees one here too."""
    import graphscan

    def escaping(argv):
        raise RuntimeError("escaped")

    monkeypatch.setattr(graphscan, "main", escaping)
    done = run_in_process(["nodes", "full.onnx"], cwd=folder)
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr.decode().startswith("Traceback") and b"RuntimeError: escaped" in done.stderr
