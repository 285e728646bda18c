"""In-process calls (``graphscan.check(...)``, the pytest plugin's fixture) refuse what the command
line refuses (issue 31 item 8): ``check(level="bogus")`` was a KeyError, ``seed=-1`` a
ValueError, ``trace(tolerance=nan)`` and ``impact(top=-1)`` were answered. Law: the same exit
code and the same line as the command line's, the keyword (``level=``) where it names the flag."""

import math

import numpy as np
import pytest

import graphscan
import graphscan_pytest
from tests.helpers import ROOT, main_error_line, run_main

FLOAT, QUANT = str(ROOT / "ops" / "fp32.onnx"), str(ROOT / "ops" / "full.onnx")
CHECK = {"float_path": FLOAT, "min_sqnr": -100.0}
CHECK_ARGV = ["check", QUANT, "--float", FLOAT, "--min-sqnr", "-100"]

CASES = [
    pytest.param("check", (QUANT,), CHECK, CHECK_ARGV, "level", "bogus", id="check-level-bogus"),
    pytest.param("check", (QUANT,), CHECK, CHECK_ARGV, "seed", -1, id="check-seed-negative"),
    pytest.param("check", (QUANT,), CHECK, CHECK_ARGV, "seed", 1.5, id="check-seed-not-whole"),
    pytest.param("check", (QUANT,), CHECK, CHECK_ARGV, "threshold", math.inf, id="check-threshold-inf"),
    pytest.param("trace", (FLOAT, QUANT), {}, ["trace", FLOAT, QUANT], "tolerance", math.nan, id="trace-tolerance-nan"),
    pytest.param("trace", (FLOAT, QUANT), {}, ["trace", FLOAT, QUANT], "tolerance", -1.0, id="trace-tolerance-neg"),
    pytest.param("impact", (FLOAT, QUANT), {}, ["impact", FLOAT, QUANT], "top", -1, id="impact-top-negative"),
    pytest.param("runtime", (QUANT,), {}, ["runtime", QUANT], "level", "everything", id="runtime-level-bogus"),
    pytest.param("runtime", (QUANT,), {}, ["runtime", QUANT, "--time"], "runs", 0, id="runtime-runs-zero"),
]


@pytest.mark.parametrize(("name", "paths", "given", "argv", "key", "value"), CASES)
def test_an_in_process_call_refuses_what_the_command_line_refuses_in_its_words(
    capsys, name, paths, given, argv, key, value
):
    flag = "--" + key.replace("_", "-")
    line = main_error_line(capsys, [*argv, flag, str(value)], graphscan.EXIT_USAGE)
    with pytest.raises(graphscan.GraphscanError) as raised:
        getattr(graphscan, name)(*paths, **given, **{key: value})
    assert raised.value.exit_code == graphscan.EXIT_USAGE
    assert f"graphscan: {raised.value}" == line.replace(f"argument {flag}:", f"argument {key}=:")
    assert f"argument {key}=:" in str(raised.value)


def test_tune_refuses_in_process_what_its_command_line_refuses(capsys, tmp_path):
    np.savez(tmp_path / "s.npz", x=np.zeros((1, 4), np.float32))
    argv = ["tune", FLOAT, "--calibrate", str(tmp_path / "s.npz"), "--out", str(tmp_path / "o")]
    for key, value in [("runs", 0), ("threads", 2**31), ("min_speedup", math.inf), ("max_exclude", -2)]:
        flag = "--" + key.replace("_", "-")
        line = main_error_line(capsys, [*argv, flag, str(value)], graphscan.EXIT_USAGE)
        with pytest.raises(graphscan.GraphscanError) as raised:
            graphscan.tune(FLOAT, calibrate=[str(tmp_path / "s.npz")], out=str(tmp_path / "o"), **{key: value})
        assert f"graphscan: {raised.value}" == line.replace(f"argument {flag}:", f"argument {key}=:")
    assert not (tmp_path / "o").exists()


def test_the_plugins_fixture_refuses_as_the_command_line():
    fixture = graphscan_pytest.Graphscan({})
    with pytest.raises(graphscan.GraphscanError) as raised:
        fixture.check(QUANT, float=FLOAT, min_sqnr=-100.0, level="bogus")
    assert raised.value.exit_code == graphscan.EXIT_USAGE and "argument level=: invalid choice" in str(raised.value)


def test_one_path_where_a_list_of_paths_is_taken_is_that_path(tmp_path):
    """``inputs="ev.npz"`` was read as the one-letter paths e, v, ... (exit 3); it is the one file,
    the same answer as ``inputs=["ev.npz"]``. What is neither a path nor a list of them is exit 2."""
    np.savez(tmp_path / "ev.npz", x=np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32))
    one = graphscan.check(QUANT, **CHECK, inputs=str(tmp_path / "ev.npz"))
    listed = graphscan.check(QUANT, **CHECK, inputs=[str(tmp_path / "ev.npz")])
    assert one == listed
    assert graphscan.check(QUANT, **CHECK, inputs=[tmp_path / "ev.npz"]) == listed  # a pathlib.Path too
    for bad in (5, [5], {"x": "ev.npz"}):
        with pytest.raises(graphscan.GraphscanError) as raised:
            graphscan.check(QUANT, **CHECK, inputs=bad)
        assert raised.value.exit_code == graphscan.EXIT_USAGE and "argument inputs=: expected a list" in str(
            raised.value
        )


def sample_folder(folder, count=3):
    """``count`` samples of ops/fp32.onnx's input x [N, 16] in ``folder``, and the files in name order."""
    folder.mkdir()
    rng = np.random.default_rng(7)
    for k in range(count):
        np.savez(folder / f"s{k}.npz", x=rng.standard_normal((2, 16)).astype(np.float32))
    return [str(folder / f"s{k}.npz") for k in range(count)]


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["check", QUANT, "--float", FLOAT, "--min-sqnr", "-100"], id="check"),
        pytest.param(["impact", FLOAT, QUANT], id="impact"),
    ],
)
def test_a_folder_where_several_samples_are_taken_is_its_npz_files_in_name_order(capsys, tmp_path, argv):
    """check --inputs DIR was "not a regular file" (exit 3) while tune took folders: a folder is
    every .npz in it, sorted by name, the same answer as the files given one by one."""
    files = sample_folder(tmp_path / "samples")
    (tmp_path / "samples" / "notes.txt").write_text("not a sample")
    by_folder = run_main(capsys, [*argv, "--inputs", str(tmp_path / "samples")])
    one_by_one = run_main(capsys, [*argv, *[a for f in files for a in ("--inputs", f)]])
    assert by_folder[0] == 0 and by_folder == one_by_one


@pytest.mark.parametrize(
    ("argv", "name", "paths"),
    [
        pytest.param(["trace", FLOAT, QUANT], "trace", (FLOAT, QUANT), id="trace"),
        pytest.param(["runtime", QUANT, "--time", "--runs", "1"], "runtime", (QUANT,), id="runtime"),
        pytest.param(["fuse", FLOAT, "OUT"], "fuse", (FLOAT, "OUT"), id="fuse"),
    ],
)
def test_a_folder_given_where_one_sample_is_taken_is_one_line_exit_7(capsys, tmp_path, argv, name, paths):
    sample_folder(tmp_path / "samples")
    out = str(tmp_path / "fused.onnx")
    argv = [out if a == "OUT" else a for a in argv]
    line = main_error_line(capsys, [*argv, "--inputs", str(tmp_path / "samples")], graphscan.EXIT_INPUTS)
    assert f"--inputs {tmp_path / 'samples'}: a folder" in line and "one sample" in line
    extra = {"timed": True} if name == "runtime" else {}
    given = [out if p == "OUT" else p for p in paths]
    with pytest.raises(graphscan.GraphscanError) as raised:
        getattr(graphscan, name)(*given, inputs=str(tmp_path / "samples"), **extra)
    assert raised.value.exit_code == graphscan.EXIT_INPUTS and f"inputs= {tmp_path / 'samples'}: a folder" in str(
        raised.value
    )
    assert not (tmp_path / "fused.onnx").exists()
