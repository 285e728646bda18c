"""The suite's in-process run of graphscan.py is the process, byte for byte.

Most tests call ``run_graphscan``, which runs ``graphscan.main`` in the test's own
process (tests/helpers.py, ``run_in_process``) because a separate Python costs about
0.3 s before graphscan starts. That is only honest while both give the same exit
code, stdout and stderr: here every command, its table, its usage errors and its
refusals run both ways and are compared whole. Runs whose answer holds a timing
(``runtime --time``, tune's latency) are left out: they differ between any two runs.
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
    "qdq table": ["qdq", "full.onnx", "--format", "table"],
    "islands": ["islands", "matmul_only.onnx"],
    "boundary table": ["boundary", "matmul_only.onnx", "--format", "table", "--top", "1"],
    "diff": ["diff", "full.onnx", "matmul_only.onnx"],
    "dot": ["dot", "matmul_only.onnx"],
    "fuse": ["fuse", "fp32.onnx"],
    "trace": ["trace", "fp32.onnx", "full.onnx", "--inputs", "sample.npz"],
    "runtime table": ["runtime", "full.onnx", "--format", "table"],
    "impact": ["impact", "fp32.onnx", "full.onnx", "--inputs", "sample.npz", "--target-sqnr", "40"],
    "check broken": ["check", "full.onnx", "--float", "fp32.onnx", "--inputs", "sample.npz", "--min-sqnr", "90"],
    "table": ["table", "islands.json"],
    "help": ["--help"],
    "command help": ["tune", "--help"],
    "no command": [],
    "unknown command": ["frobnicate", "full.onnx"],
    "unknown option": ["nodes", "full.onnx", "--frob"],
    "missing file": ["qdq", "missing.onnx"],
    "folder": ["islands", "a_folder"],
    "damaged": ["boundary", "damaged.onnx"],
    "samples that measure nothing": ["impact", "fp32.onnx", "full.onnx", "--inputs", "nan.npz"],
    "tune usage": ["tune", "fp32.onnx", "--calibrate", "a_folder", "--out", "out", "--level", "disabled"],
    "tune quantized float": ["tune", "full.onnx", "--calibrate", "a_folder", "--out", "out"],
}


@pytest.mark.parametrize("argv", CASES.values(), ids=CASES.keys())
def test_the_in_process_run_gives_the_process_bytes(folder, argv):
    process = run_graphscan_process(argv, cwd=folder)
    here = run_in_process(argv, cwd=folder)
    assert (here.returncode, here.stdout, here.stderr) == (process.returncode, process.stdout, process.stderr), (
        f"process: {describe(process)}\nin process: {describe(here)}"
    )


def test_the_cases_cover_every_command_and_several_exit_codes(folder):
    import graphscan

    covered = {argv[0] for argv in CASES.values() if argv}
    assert set(graphscan.COMMANDS) <= covered
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
