"""tune --cpu (issue 34, item 5): accuracy and kernels from a CPU target, speed natively.

These tests need no target installed: the option's usage errors, ``native`` as today's
answer, the one target call per candidate (run on ``native`` through the same path), and
the answer and guards of an emulated target with its interpreter replaced by this one.
The runs on real targets are tests/targets/test_tune_on_targets.py (marker ``targets``).
"""

import json
import platform
import re

import numpy as np
import onnx
import pytest

import graphscan
import graphscan_ort.tune.command as tune
import graphscan_ort.tune.deployed as deployed
from graphscan import Session
from graphscan_ort.shared import targets
from graphscan_ort.shared.options import Named, Timing
from graphscan_ort.tune.guards import failed_guards
from tests.helpers import main_error_line, point_estimates, run_main, small_cnn
from tests.targets.test_targets import INSTALL, empty_bin, fake_tools

FLOAT, QUANT = "ops/fp32.onnx", "ops/full.onnx"


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A small residual CNN (16 channels: int8 is smaller than float), two calibration samples, one held-out."""
    fp32, files = small_cnn(tmp_path_factory.mktemp("tune_cpu"), 1, 3, seed=5)
    return {"float": str(fp32), "calibrate": files[:2], "inputs": files[2:]}


def argv_of(cnn, out, *more):
    argv = ["tune", cnn["float"], "--out", str(out), "--runs", "1", "--max-trials", "0"]
    return argv + [a for p in cnn["calibrate"] for a in ("--calibrate", p)] + ["--inputs", cnn["inputs"][0], *more]


def fixed_speed(speedup):
    """latency_figures replaced by fixed ones: the answers become comparable byte for byte."""

    def figures(reference, candidates, *args, **kwargs):
        return [{"ms": 1.0, "float_ms": speedup, "speedup": speedup, "speedup_spread": [speedup, speedup]}] * len(
            candidates
        )

    return figures


def test_an_unknown_cpu_is_a_usage_error(cnn, tmp_path, capsys):
    line = main_error_line(capsys, argv_of(cnn, tmp_path / "out", "--cpu", "sparc"), graphscan.EXIT_USAGE)
    assert "--cpu" in line and "sparc" in line
    with pytest.raises(graphscan.GraphscanError) as caught:  # the function refuses it as the command line does
        graphscan.tune(cnn["float"], calibrate=cnn["calibrate"], out=str(tmp_path / "out"), cpu="sparc")
    assert caught.value.exit_code == graphscan.EXIT_USAGE and all(t in str(caught.value) for t in targets.TARGETS)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("target", "tools", "what"),
    [
        pytest.param("arm64", ["qemu-aarch64"], "the arm64 Python is not installed", id="arm64-not-installed"),
        pytest.param("x86-avx2", [], "qemu-x86_64 is not installed", id="x86-avx2-without-qemu"),
    ],
)
def test_a_missing_target_is_one_line_naming_the_install_command_before_any_work(
    cnn, tmp_path, capsys, monkeypatch, target, tools, what
):
    monkeypatch.setenv("GRAPHSCAN_TARGETS", str(tmp_path / "none"))
    folder = empty_bin(tmp_path)
    fake_tools(folder, *tools)
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(tune, "check_out", lambda out: pytest.fail("work began before the target was checked"))
    line = main_error_line(capsys, argv_of(cnn, tmp_path / "out", "--cpu", target), graphscan.EXIT_USAGE)
    assert re.fullmatch(rf"graphscan: usage: CPU target {target}: {what}.*\(install it: {INSTALL}\)", line), line


def test_native_is_the_answer_without_cpu_byte_for_byte(cnn, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(deployed, "latency_figures", fixed_speed(1.5))
    plain = run_main(capsys, argv_of(cnn, tmp_path / "plain"))
    native = run_main(capsys, argv_of(cnn, tmp_path / "native", "--cpu", "native"))
    assert plain[0] in (0, 8) and plain[2] == ""
    assert plain == (native[0], native[1].replace(str(tmp_path / "native"), str(tmp_path / "plain")), native[2])
    answer = json.loads(plain[1])
    assert "cpu" not in answer and list(answer["latency"]) == ["inputs", "samples", "first_runs", "runs", "min_speedup"]
    assert answer["latency"]["min_speedup"] == 1.0


def test_the_slower_guard_is_off_on_an_emulated_target_unless_min_speedup_is_given():
    slow = {"speedup": 0.5, "bytes": 10, "float_weights": 0}
    native, arm64, x86 = (graphscan.CpuTarget(name) for name in ("native", "arm64", "x86-avx2"))
    assert tune.speedup_guard(None, native) == 1.0
    assert tune.speedup_guard(None, arm64) is None and tune.speedup_guard(None, x86) is None
    assert tune.speedup_guard(2, arm64) == 2.0 and tune.speedup_guard(0.0, native) == 0.0
    assert failed_guards(slow, 100, None) == [] and failed_guards({**slow, "speedup": None}, 100, None) == []
    assert failed_guards(slow, 100, 1.0) == ["slower"] and failed_guards({**slow, "bytes": 200}, 100, None) == [
        "larger"
    ]


def candidates(folder):
    """Two quantized models of ops/fp32.onnx: the repository's own, and a copy of it."""
    copy = folder / "copy.onnx"
    onnx.save(onnx.load(QUANT), copy)
    return [Named(graphscan.load_with_weights(p), str(p)) for p in (QUANT, copy)]


def test_on_a_target_the_float_model_runs_once_and_each_candidate_once_with_the_same_figures(tmp_path, monkeypatch):
    """deployed.OnTarget on ``native`` (the same calls an emulated target answers): the float
    model's outputs in one call for the run, one call per candidate for its outputs and kernels,
    and every figure but the time equal to the native measurement's."""
    reference = Named(graphscan.load_with_weights(FLOAT), FLOAT)
    rng = np.random.default_rng(0)
    samples = [{"x": rng.standard_normal((2, 16)).astype(np.float32)} for _ in range(2)]
    monkeypatch.setattr(deployed, "latency_figures", fixed_speed(1.0))
    calls = []
    runner = graphscan.CpuTarget("native").runner()
    ran = runner.call
    monkeypatch.setattr(runner, "call", lambda function, *args: calls.append(function.__name__) or ran(function, *args))
    on = deployed.OnTarget(runner, str(tmp_path), samples, Session())
    for candidate in candidates(tmp_path):
        natively = deployed.measure_candidate(reference, candidate, samples, Session(), Timing(1))
        there = deployed.measure_candidate(reference, candidate, samples, Session(), Timing(1), on)
        assert there == natively
    assert calls == ["float_on_target", "candidate_on_target", "candidate_on_target"]
    assert runner.facts is not None and runner.facts["name"] == "native"


class NativeAsArm64(targets.Worker):
    """A worker that calls in this process and answers as arm64: an emulated target's answer
    shape without emulation."""

    def __init__(self, target):
        self.target = target

    def run(self, function, args=None, kwargs=None):
        reply = targets.run(targets.NATIVE, function, args, kwargs)
        reply["cpu"] = {**reply["cpu"], "name": self.target, "machine": "aarch64"}
        return reply

    def close(self):
        pass


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(targets, "require", lambda target: None)
    monkeypatch.setattr(targets, "Worker", NativeAsArm64)
    monkeypatch.setattr(deployed, "latency_figures", fixed_speed(0.5))  # every candidate slower than float


def test_an_emulated_target_labels_the_speed_native_and_guards_it_only_with_min_speedup(cnn, tmp_path, emulated):
    given = {"calibrate": cnn["calibrate"], "inputs": cnn["inputs"], "runs": 1}
    # Every candidate is slower than float here (natively: nothing written, test_guards.py).
    answer = graphscan.tune(cnn["float"], out=str(tmp_path / "b"), cpu="arm64", **given)
    assert list(answer)[:3] == ["model", "environment", "cpu"]
    assert answer["cpu"] == {"name": "arm64", "onnxruntime": answer["environment"]["onnxruntime"], "machine": "aarch64"}
    assert answer["latency"]["min_speedup"] is None
    assert answer["latency"]["cpu"] == {**targets.native_facts(), "name": "native"}
    assert all("slower" not in c["fails"] for c in answer["candidates"] if c["error"] is None)
    assert answer["reached"] is True and answer["written"] == ["model.onnx", "prepared.onnx"]
    said = [w for w in answer["warnings"] if "arm64" in w]
    assert len(said) == 2 and "timed natively" in said[0] and "no latency" in said[0]
    assert "slower guard is off" in said[1] and "--min-speedup" in said[1]
    guarded = graphscan.tune(cnn["float"], out=str(tmp_path / "c"), cpu="arm64", min_speedup=1.0, **given)
    assert guarded["latency"]["min_speedup"] == 1.0 and guarded["chosen"] is None
    assert all(c["fails"] == ["slower"] for c in guarded["candidates"] if c["error"] is None)
    assert not any("slower guard is off" in w for w in guarded["warnings"])
    assert "cpu arm64" in re.sub(r" +", " ", graphscan.render_table("tune", guarded))


def test_on_an_emulated_target_tune_chooses_by_the_targets_kernels_first(cnn, tmp_path, emulated, monkeypatch):
    """Wired through tune: the target reports more int8 kernels the less accurate a candidate is
    (a stand-in for a CPU whose kernels differ from this one's), every speed is the same here
    and every candidate meets the target (0 dB). The one with the most kernels there is chosen,
    the least accurate, where this machine's rule (speed, then the metric) takes the most accurate."""
    point_estimates(monkeypatch)  # two samples: the rule's mechanics on point figures
    measured = deployed.OnTarget.measure

    def fewer_kernels_the_more_accurate(self, reference, candidate, pairs):
        outputs, kernels = measured(self, reference, candidate, pairs)
        return outputs, {**kernels, "int8_kernels": 10**9 - round(10**6 * outputs.figures().worst_db)}

    monkeypatch.setattr(deployed.OnTarget, "measure", fewer_kernels_the_more_accurate)
    given = {"calibrate": cnn["calibrate"], "inputs": cnn["inputs"], "runs": 1, "max_trials": 0, "target": 0.0}
    answer = graphscan.tune(cnn["float"], out=str(tmp_path / "o"), cpu="arm64", **given)
    rows = {c["id"]: c for c in answer["candidates"]}
    chosen = rows[answer["chosen"]]
    if (chosen["recovery"] or {}).get("step") == "bias_correction":  # written in its row's place where it helps
        chosen = rows[chosen["recovery"]["from"]]
    made = [c for c in rows.values() if c["error"] is None and not c["fails"] and c["recovery"] is None]
    assert answer["reached"] and min(c["sqnr_db"] for c in made) < max(c["sqnr_db"] for c in made)  # rules differ
    assert chosen["int8_kernels"] == max(c["int8_kernels"] for c in made)
    assert chosen["sqnr_db"] == min(c["sqnr_db"] for c in made)
