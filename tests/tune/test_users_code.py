"""A user's ``--metric FILE.py:FUNCTION`` is code graphscan runs but does not trust (issue 31,
items 1, 9 and 10): whatever it does to its arguments, to file descriptor 1 or to an
interrupt, graphscan's figures, its stdout and its exit code stay graphscan's."""

import json
import math

import numpy as np
import onnx
import pytest

import gen_models
from graphscan_ort.shared import agreement
from tests.helpers import describe, json_answer, run_graphscan, run_graphscan_process, run_onnx

USER_CODE = """
import os, signal, subprocess, sys, time
import numpy as np

def noise(reference, candidate):
    # minus the noise energy, sum (f - q)^2 over every output and sample
    return -float(sum(np.sum((r[k].astype(np.float64) - c[k]) ** 2) for r, c in zip(reference, candidate) for k in r))

def in_place(reference, candidate):
    value = noise(reference, candidate)
    for sample in reference + candidate:  # a softmax with out=: writes into what it was given
        for array in sample.values():
            np.multiply(array, 3.0, out=array)
        sample.clear()
    reference.clear()
    return value

def loud(reference, candidate):
    os.write(1, b"written on descriptor 1\\n")
    subprocess.run([sys.executable, "-c", "print('an evaluator prints')"], check=True)
    return 1.0

def stubborn(reference, candidate):
    try:
        os.kill(os.getpid(), signal.SIG)
        time.sleep(5)
    except:  # noqa: E722 - the user's bare except swallows the interrupt
        pass
    return 1.0
"""


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small CNN (tune takes well under a second on it), a calibration and a held-out
    sample, and the user's metric file: paths as str."""
    folder = tmp_path_factory.mktemp("users_code")
    onnx.save(gen_models.build_cnn(2, channels=16, size=8, seed=0), folder / "cnn.onnx")
    rng = np.random.default_rng(4)
    for name in ("cal", "held"):
        np.savez(folder / f"{name}.npz", x=rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    (folder / "user.py").write_text(USER_CODE)
    return {k: str(folder / v) for k, v in [("float", "cnn.onnx"), ("cal", "cal.npz"), ("held", "held.npz")]} | {
        "user": str(folder / "user.py")
    }


UNSHOWN = 8  # tune's exit on these: one held-out sample can show no target met (no spread to bound by)


def tune_argv(small, out, function):
    return [
        "tune", small["float"], "--calibrate", small["cal"], "--inputs", small["held"], "--out", out,
        "--runs", "1", "--min-speedup", "0", "--metric", f"{small['user']}:{function}", "--target=-1e30",
    ]  # fmt: skip


def test_a_metric_that_writes_into_its_arguments_changes_nothing_the_caller_keeps():
    """Every array, dict and list a user's function is given is its own: after the call the
    caller's are as they were (equal values, equal keys, equal lengths)."""
    reference = [{"y": np.arange(4, dtype=np.float32)}, {"y": np.ones(4, np.float32)}]
    candidate = [{"y": np.zeros(4, np.float32)}, {"y": np.full(4, 2.0, np.float32)}]
    before = [[{k: a.copy() for k, a in s.items()} for s in side] for side in (reference, candidate)]
    chosen = agreement.Metric("user.py:in_place", function=in_place_call)
    # -(0+1+4+9) - (1+1+1+1), the noise energy worked out by hand
    assert chosen.value(reference, candidate) == -18.0
    assert chosen.value(reference, candidate) == -18.0  # the second call sees what the first did
    for side, kept in zip((reference, candidate), before, strict=True):
        assert len(side) == 2 and all(list(s) == ["y"] for s in side)
        for sample, old in zip(side, kept, strict=True):
            np.testing.assert_array_equal(sample["y"], old["y"])


def in_place_call(reference, candidate):
    namespace: dict = {}
    exec(USER_CODE, namespace)  # the very function the metric file of these tests holds
    return namespace["in_place"](reference, candidate)


def test_every_candidate_of_tune_is_measured_on_float_outputs_no_metric_changed(small, tmp_path):
    """A metric that multiplies its arrays in place ran on outputs it had already changed:
    10 of 12 rows wrong. Law: each row's noise energy, the metric here, is the float outputs'
    energy (onnxruntime run directly) over 10^(sqnr_db / 10), the row's own SQNR."""
    answer = json_answer(run_graphscan(tune_argv(small, tmp_path / "o", "in_place")), UNSHOWN)
    held = dict(np.load(small["held"]))
    signal = sum(float(np.sum(np.square(y.astype(np.float64)))) for y in run_onnx(small["float"], held, "all"))
    rows = [c for c in answer["candidates"] if c["error"] is None]
    assert len(rows) >= 8
    for row in rows:
        expected = -signal / 10 ** (row["sqnr_db"] / 10)
        assert math.isclose(row["metric_value"], expected, rel_tol=1e-4), (row["id"], row["metric_value"], expected)


def check_argv(small, function):
    return [
        "check", small["float"], "--float", small["float"], "--inputs", small["held"],
        "--metric", f"{small['user']}:{function}", "--min-metric", "0.5",
    ]  # fmt: skip


@pytest.mark.parametrize("command", ["check", "tune"])
def test_what_a_metric_writes_on_descriptor_1_or_a_subprocess_prints_goes_to_stderr(small, tmp_path, command):
    """stdout is the answer alone: os.write(1, ...) and a child process printing went before
    the JSON. They go to stderr, in the order they were written."""
    argv = check_argv(small, "loud") if command == "check" else tune_argv(small, tmp_path / "o", "loud")
    proc = run_graphscan_process(argv)
    assert proc.returncode == (0 if command == "check" else UNSHOWN), describe(proc)
    answer = json.loads(proc.stdout)  # the whole of stdout is one JSON object
    assert isinstance(answer, dict) and proc.stdout.endswith(b"}\n")
    lines = proc.stderr.decode().splitlines()
    assert lines and set(lines) == {"written on descriptor 1", "an evaluator prints"}, describe(proc)
    assert lines[:2] == ["written on descriptor 1", "an evaluator prints"]


@pytest.mark.parametrize(
    ("signal_name", "code", "line"),
    [
        pytest.param("SIGTERM", 143, b"graphscan: terminated\n", id="sigterm"),
        pytest.param("SIGINT", 130, b"graphscan: interrupted\n", id="ctrl-c"),
    ],
)
@pytest.mark.parametrize("command", ["check", "tune"])
def test_an_interrupt_a_metric_swallows_is_still_acted_on(small, tmp_path, command, signal_name, code, line):
    """A metric with a bare ``except:`` caught the interrupt graphscan raises, and tune went
    on to exit 0 with --out written. The interrupt that arrived is acted on: its exit code,
    its one line, nothing on stdout, no --out and no temporary folder."""
    user = tmp_path / "user.py"
    user.write_text(USER_CODE.replace("signal.SIG)", f"signal.{signal_name})"))
    out = tmp_path / "o"
    argv = check_argv({**small, "user": str(user)}, "stubborn")
    if command == "tune":
        argv = tune_argv({**small, "user": str(user)}, out, "stubborn")
    proc = run_graphscan_process(argv)
    assert (proc.returncode, proc.stdout, proc.stderr) == (code, b"", line), describe(proc)
    assert not out.exists() and list(tmp_path.glob(".graphscan-tune-*")) == []
