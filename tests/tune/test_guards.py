"""tune never writes a model worse than float: the guards (faster, no larger, integer
weights), the choice they shape, exit 8 when the target is not met, and the metric,
target and latency options that say what "better" means."""

import json
import math
import os
import re

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnxruntime.quantization import quantize_static

import gen_models
import graphscan
import graphscan_ort.tune.command as tune
import graphscan_ort.tune.deployed as deployed
import graphscan_ort.tune.stages as tune_stages
import graphscan_ort.tune.trials as tune_trials
from graphscan_ort.shared.agreement import DEFAULT_TARGET_FLOOR_DB, POOR_SQNR_DB, metric
from graphscan_ort.tune.candidates import SampleReader, quiet
from graphscan_ort.tune.choice import Policy
from graphscan_ort.tune.guards import failed_guards, file_bytes, float_weight_nodes
from tests.helpers import main_error_line, point_estimates, run_main, small_cnn, without_structural_seeds


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A 16-channel residual CNN (int8 is smaller than float), two calibration samples
    and two held-out ones."""
    folder = tmp_path_factory.mktemp("guards")
    fp32, files = small_cnn(folder, 2, 4, seed=9)
    return {"float": str(fp32), "calibrate": files[:2], "inputs": files[2:], "folder": folder}


def run_tune(cnn, out, **options):
    options = {"runs": 2, "min_speedup": 0, **options}
    return graphscan.tune(cnn["float"], calibrate=cnn["calibrate"], inputs=cnn["inputs"], out=str(out), **options)


def constant_weight_model(path):
    """Conv whose weight is a Constant node (as PP-OCR ships its weights), then a MatMul
    of two activations (no weight at all)."""
    w = np.random.default_rng(0).standard_normal((8, 3, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w, "w"), name="cw"),
        helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["y"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "r"], ["z"], name="activations"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", 1, [1, 3, 8, 8])], [helper.make_tensor_value_info("z", 1, None)]
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


ONES = {"x": np.ones((1, 3, 8, 8), np.float32)}  # one calibration sample


def test_a_weight_quantized_at_run_time_from_a_constant_is_a_float_weight(tmp_path):
    constant_weight_model(tmp_path / "f.onnx")
    with quiet():
        quantize_static(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), SampleReader([ONES]))
    quantized = onnx.load(tmp_path / "q.onnx")
    assert float_weight_nodes(quantized) == ["conv"]  # Q then DQ of the Constant, in the graph
    assert float_weight_nodes(quantized, ["conv"]) == []  # excluded nodes apart
    # The same weight as an initializer is stored as int8 by the quantizer: an integer weight.
    model = onnx.load(tmp_path / "f.onnx")
    constant = model.graph.node[0]
    model.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(constant.attribute[0].t), "w"))
    model.graph.node.remove(constant)
    onnx.save(model, tmp_path / "f2.onnx")
    with quiet():
        quantize_static(
            str(tmp_path / "f2.onnx"),
            str(tmp_path / "q2.onnx"),
            SampleReader([ONES]),
        )
    assert float_weight_nodes(onnx.load(tmp_path / "q2.onnx")) == []
    assert float_weight_nodes(model) == ["conv"]  # the float model itself: every weight float


def test_the_guards_are_named_in_their_order():
    row = {"speedup": 1.0, "bytes": 101, "float_weights": 2}
    assert failed_guards(row, 100, 1.0) == ["slower", "larger", "float_weights"]  # 1.0 is not faster
    assert failed_guards({"speedup": 1.01, "bytes": 100, "float_weights": 0}, 100, 1.0) == []
    assert failed_guards({"speedup": None, "bytes": 10, "float_weights": 0}, 100, 0.0) == ["slower"]
    assert failed_guards({"speedup": 0.5, "bytes": 10, "float_weights": 0}, 100, 0.0) == []


def test_file_bytes_counts_external_data(tmp_path):
    model = gen_models.build_cnn(1, channels=16, size=8, seed=0)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="m.data", size_threshold=0)
    loaded = onnx.load(tmp_path / "m.onnx", load_external_data=False)
    total = (tmp_path / "m.onnx").stat().st_size + (tmp_path / "m.data").stat().st_size
    assert file_bytes(str(tmp_path / "m.onnx"), loaded) == total


def test_the_choice_never_takes_a_row_that_breaks_a_guard():
    rows = [
        {"id": 0, "speedup": 3.0, "metric_value": 40.0, "fails": ["larger"], "error": None},
        {"id": 1, "speedup": 2.0, "metric_value": 30.0, "fails": ["float_weights"], "error": None},
        {"id": 2, "speedup": 0.9, "metric_value": 50.0, "fails": ["slower"], "error": None},
        {"id": 3, "speedup": 1.2, "metric_value": 20.0, "fails": [], "error": None},
        {"id": 4, "speedup": 1.1, "metric_value": 25.0, "fails": [], "error": None},
    ]
    for row in rows:  # bounds as the rows' values: figures that show themselves exactly
        row["metric_bound"] = row["metric_value"]
    assert Policy(10.0).chosen(rows) == (rows[3], True)  # the fastest of those passing
    assert Policy(22.0).chosen(rows) == (rows[4], True)
    assert Policy(45.0).chosen(rows) == (rows[4], False)  # not met: the most accurate passing
    assert Policy(10.0).chosen(rows[:3]) == (None, False)  # none passes: nothing chosen
    assert Policy(None).chosen(rows) == (rows[4], False)  # an undefined target is never met


def slow(reference, candidates, *args, **kwargs):
    """Timings where every candidate is twice as slow as float."""
    return [{"ms": 2.0, "float_ms": 1.0, "speedup": 0.5, "speedup_spread": [0.5, 0.5]}] * len(candidates)


def test_when_every_candidate_is_slower_only_prepared_onnx_is_written_and_exit_8(cnn, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(deployed, "latency_figures", slow)
    out = tmp_path / "out"
    argv = ["tune", cnn["float"], "--out", str(out), "--runs", "1"]
    argv += [a for p in cnn["calibrate"] for a in ("--calibrate", p)] + [
        a for p in cnn["inputs"] for a in ("--inputs", p)
    ]
    code, text, err = run_main(capsys, argv)
    answer = json.loads(text)
    assert code == 8 and err == ""
    assert answer["chosen"] is None and answer["reached"] is False and answer["written"] == ["prepared.onnx"]
    assert sorted(p.name for p in out.iterdir()) == ["prepared.onnx"]
    assert all(c["fails"] == ["slower"] for c in answer["candidates"])
    assert any("only prepared.onnx" in w for w in answer["warnings"])
    assert "chosen -" in graphscan.render_table("tune", answer)


def test_a_target_out_of_reach_writes_the_most_accurate_passing_model_and_exits_8(cnn, tmp_path, monkeypatch):
    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *args, **kwargs: [])  # no exclusion to try
    answer = run_tune(cnn, tmp_path / "out", target=500.0)
    assert answer["reached"] is False and answer["target"] == {"value": 500.0, "source": "user"}
    passing = [c for c in answer["candidates"] if c["fails"] == []]
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    assert chosen["metric_value"] == max(c["metric_value"] for c in passing)
    assert answer["written"] == ["model.onnx", "prepared.onnx"]
    assert tune.COMMAND.exit_code(answer) == 8


def test_an_agreement_metric_aims_at_floats_own_and_is_recomputed_by_check(cnn, tmp_path):
    answer = run_tune(cnn, tmp_path / "out", metric="cosine", target=0.99)
    assert answer["metric"] == {"name": "cosine"} and answer["target_sqnr_db"] is None
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    budget = graphscan.check(
        str(tmp_path / "out" / "model.onnx"),
        float_path=cnn["float"],
        inputs=cnn["inputs"],
        metric="cosine",
        min_metric=0,
    )
    assert chosen["metric_value"] == pytest.approx(budget["budgets"][0]["value"], abs=1e-9)
    default = run_tune(cnn, tmp_path / "out2", metric="top1", runs=1)
    assert default["target"] == {"value": 1.0, "source": "float"}


def test_a_poor_default_target_is_the_floor_and_an_undefined_one_a_warning():
    """Issue 33: a default target is never a broken model: onnxruntime's defaults below the
    poor line make the target that line, said in a warning naming their worst part."""
    goal = tune.Goal(metric("sqnr"), None, math.inf)
    part = {"output": "output0", "part": 1, "node": "cls_sigmoid"}
    target, warnings = goal.target({"sqnr_db": 3.5, "error": None, "worst_part": part})
    assert target == {"value": DEFAULT_TARGET_FLOOR_DB, "source": "floor"} and "poor" in warnings[0]
    assert "3.50 dB on output0 part 1 (from cls_sigmoid)" in warnings[0]
    # Poor but above the floor: theirs, never lowered to the floor.
    target, warnings = goal.target({"sqnr_db": 12.5, "error": None, "worst_part": part})
    assert target == {"value": 12.5, "source": "defaults"} and "poor" in warnings[0] and "12.50 dB" in warnings[0]
    assert DEFAULT_TARGET_FLOOR_DB < 12.5 < POOR_SQNR_DB
    assert goal.target({"sqnr_db": 31.0, "error": None}) == ({"value": 31.0, "source": "defaults"}, [])
    target, warnings = goal.target({"sqnr_db": None, "error": None})
    assert target["value"] is None and "undefined" in warnings[0]
    target, warnings = goal.target(None)  # the defaults were refused by the quantizer
    assert target["value"] is None and warnings


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--target", "1", "--target-sqnr", "1"], "not both"),
        (["--metric", "iou", "--target-sqnr", "1"], "--target-sqnr is the target of --metric sqnr"),
        (["--metric", "top1", "--threshold", "0.3"], "--threshold: only with --metric iou"),
        (["--metric", "nope.py:f"], "no such file"),
        (["--min-speedup", "-1"], "--min-speedup"),
        (["--metric", "ctc"], "ctc needs 2 or more"),
    ],
    ids=["both-targets", "sqnr-alias", "threshold", "missing-file", "negative-speedup", "shape"],
)
def test_usage_errors_before_any_work(cnn, tmp_path, capsys, extra, words):
    path = cnn["float"]
    if "ctc" in extra:  # a scalar output: ctc needs [..., time, classes]
        path = str(tmp_path / "flat.onnx")
        model = onnx.helper.make_model(
            onnx.helper.make_graph(
                [onnx.helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
                "g",
                [onnx.helper.make_tensor_value_info("x", 1, [2, 3])],
                [onnx.helper.make_tensor_value_info("y", 1, [])],
            ),
            opset_imports=[onnx.helper.make_opsetid("", 13)],
        )
        onnx.save(model, path)
        np.savez(tmp_path / "c.npz", x=np.ones((2, 3), np.float32))
        calibrate = [str(tmp_path / "c.npz")]
    else:
        calibrate = cnn["calibrate"]
    argv = ["tune", path, "--out", str(tmp_path / "o"), *[a for p in calibrate for a in ("--calibrate", p)], *extra]
    assert words in main_error_line(capsys, argv, 2)
    assert not (tmp_path / "o").exists() and list(tmp_path.glob(".graphscan-tune-*")) == []


def test_latency_is_measured_at_the_deployed_shape_and_named(tmp_path, build_case):
    """The lab's MLP has a symbolic batch: --inputs mix batch sizes (the metric pools them),
    and the speedup is timed at the --latency-inputs batch, which the header names."""
    from tests.lab import Case

    lab = build_case(Case(3, ("N",), "fc2_matmul", dim=64))
    rng = np.random.default_rng(3)
    files = []
    for k, batch in enumerate([4, 4, 2, 7, 32]):
        files.append(str(tmp_path / f"s{k}.npz"))
        np.savez(files[-1], x=rng.standard_normal((batch, 64)).astype(np.float32))
    answer = graphscan.tune(
        lab["fp32"],
        calibrate=files[:2],
        inputs=files[2:4],
        latency_inputs=files[4:],
        out=str(tmp_path / "o"),
        runs=2,
        min_speedup=0,
    )
    assert answer["evaluation"]["inputs"] == {"x": [[2, 64], [7, 64]]}
    assert answer["latency"] == {
        "inputs": {"x": [32, 64]},
        "samples": 1,
        "first_runs": 2,
        "runs": 2,
        "min_speedup": 0.0,
    }
    assert "latency at x 32x64" in graphscan.render_table("tune", answer)
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    budget = graphscan.check(
        str(tmp_path / "o" / "model.onnx"), float_path=lab["fp32"], inputs=files[2:4], min_sqnr=-100
    )
    assert chosen["sqnr_db"] == pytest.approx(budget["budgets"][0]["value"], abs=1e-6)  # both samples pooled


def test_when_every_metric_is_undefined_the_target_is_never_reached(cnn, tmp_path, monkeypatch):
    """The ruling: an undefined target (here the defaults' SQNR) is never reached, and tune
    says why; exit 8, never a "reached" over nothing."""
    for name in ("measure_candidate", "accuracy_figures"):  # the latter: a row that inherits its timing
        measured = getattr(tune_trials, name)

        def undefined(*args, measured=measured, **kwargs):
            return {**measured(*args, **kwargs), "sqnr_db": None, "metric_value": None}

        monkeypatch.setattr(tune_trials, name, undefined)
    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *args, **kwargs: [])
    answer = run_tune(cnn, tmp_path / "out", runs=1)
    assert answer["target"] == {"value": None, "source": "defaults"} and answer["reached"] is False
    assert any("undefined" in w for w in answer["warnings"])
    assert any("every candidate's sqnr is undefined" in w for w in answer["warnings"])
    assert tune.COMMAND.exit_code(answer) == 8


def test_a_trial_onnxruntime_refuses_is_a_row_never_the_end_of_tune(cnn, tmp_path, monkeypatch):
    without_structural_seeds(monkeypatch)
    measured = tune_trials.measure_candidate

    def refuse_exclusions(reference, candidate, *args, **kwargs):
        if float_weight_nodes(candidate.model) == ["b1_conv1"]:  # the trial that keeps b1_conv1 float
            raise graphscan.GraphscanError(f"{candidate.path}: model does not run in onnxruntime (invalid)", 5)
        return measured(reference, candidate, *args, **kwargs)

    monkeypatch.setattr(tune_trials, "measure_candidate", refuse_exclusions)
    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *a, **k: [{"node": "b1_conv1", "gain_db": 1.0}])
    answer = run_tune(cnn, tmp_path / "out", target=500.0, max_trials=1)
    (row,) = [c for c in answer["candidates"] if c["trial"] is not None]
    assert row["error"].startswith("onnxruntime: ") and row["fails"] is None and row["sqnr_db"] is None
    assert answer["chosen"] is not None and answer["chosen"] != row["id"]


def test_the_search_stops_as_soon_as_the_target_is_met(cnn, tmp_path, monkeypatch):
    """A stubbed metric: every model with an exclusion meets the target (point figures: the
    search's mechanics, not its statistics). One trial, then stop."""
    without_structural_seeds(monkeypatch)
    point_estimates(monkeypatch)
    measured = tune_trials.measure_candidate

    def exclusions_meet_it(reference, candidate, *args, **kwargs):
        row = measured(reference, candidate, *args, **kwargs)
        return {**row, "metric_value": 1000.0} if float_weight_nodes(candidate.model) else row

    monkeypatch.setattr(tune_trials, "measure_candidate", exclusions_meet_it)
    ranking = [{"node": name, "gain_db": 1.0} for name in ("b1_conv1", "b1_conv2", "b2_conv1")]
    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *a, **k: ranking)
    answer = run_tune(cnn, tmp_path / "out", target=500.0, max_trials=5)
    trials = [c for c in answer["candidates"] if c["trial"] is not None]
    assert len(trials) == 1 and answer["reached"] is True and answer["chosen"] == trials[0]["id"]


def test_an_exclusion_onnxruntime_still_runs_int8_is_never_kept(cnn, tmp_path, monkeypatch):
    """The first block's node is reported int8 even after float_inputs (a stub of honoured):
    however much it helps, the next trial does not build on it."""
    without_structural_seeds(monkeypatch)
    monkeypatch.setattr(tune_stages, "recover", lambda *args: [])  # the exclusions start from the grid's best
    real = tune_trials.honoured

    def first_stays_int8(model, path, level, excluded, given, optimized=None):
        fixed, status, applied = real(model, path, level, excluded, given, optimized)
        if "b1_conv1" in status:
            status = {**status, "b1_conv1": "int8"}
        return fixed, status, applied

    monkeypatch.setattr(tune_trials, "honoured", first_stays_int8)
    ranking = [{"node": "b1_conv1", "gain_db": 5.0}, {"node": "b2_conv1", "gain_db": 1.0}]
    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *a, **k: ranking)
    answer = run_tune(cnn, tmp_path / "out", target=500.0, max_trials=2, max_exclude=1)
    trials = sorted((c for c in answer["candidates"] if c["trial"] is not None), key=lambda c: c["id"])
    assert trials[0]["quantize_static"]["nodes_to_exclude"] == ["b1_conv1"]
    assert trials[0]["excluded"] == {"b1_conv1": "int8"}
    assert len(trials) == 2 and "b1_conv1" not in trials[1]["quantize_static"]["nodes_to_exclude"]


def test_a_trial_onnxruntime_cannot_optimize_is_a_row_never_the_end_of_tune(cnn, tmp_path, monkeypatch):
    """The exclusions are checked in a deployed session (fallback.honoured) before they are
    measured: a model onnxruntime refuses there ("Attempt to replace the existing tensor")
    ended tune with exit 5 naming graphscan's own temporary file. It is a row with its error."""
    without_structural_seeds(monkeypatch)
    real = tune_trials.honoured

    def refuses(model, path, level, excluded, given, optimized=None):
        if excluded == ["b1_conv1"]:
            raise graphscan.GraphscanError(f"{path}: model does not run in onnxruntime (Attempt to replace)", 5)
        return real(model, path, level, excluded, given, optimized)

    monkeypatch.setattr(tune_trials, "honoured", refuses)
    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *a, **k: [{"node": "b1_conv1", "gain_db": 1.0}])
    answer = run_tune(cnn, tmp_path / "out", target=500.0, max_trials=1)
    (row,) = [c for c in answer["candidates"] if c["trial"] is not None]
    assert row["error"].startswith("onnxruntime: ") and "graphscan's prepared copy" in row["error"]
    assert ".graphscan-tune-" not in row["error"] and row["sqnr_db"] is None
    assert answer["chosen"] is not None and answer["chosen"] != row["id"]


def rows_carried(answer, timed):
    """Whether the chosen row carries the timing of a row in ``timed`` (one of its plan)."""
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    return chosen["speed_from"] in timed


DISTURBED = 2  # a grid row timed itself (QUInt8 per channel MinMax): row 3, its Percentile twin, runs its plan


def disturbed_timer(disturbed_times):
    """A stub of deployed.latency_figures and the candidates it timed: candidate k (its file's
    number) runs in 1.3 ms against float's 2.4 + 0.05 k ms, except that float runs take 15 ms
    the first ``disturbed_times`` times candidate DISTURBED is timed (a busy moment: speedup 11.5)."""
    timed, calls = [], []

    def figures(reference, candidates, latency, session, timing, opened=None, stop=None):
        found = []
        calls.append([])
        for candidate in candidates:
            k = int(re.search(r"candidate-(\d+)\.onnx$", candidate.path).group(1))
            timed.append(k)
            calls[-1].append(k)
            float_ms = 15.0 if k == DISTURBED and timed.count(k) <= disturbed_times else 2.4 + 0.05 * k
            speedup = float_ms / 1.3
            spread = [0.95 * speedup, 1.05 * speedup]
            found.append({"ms": 1.3, "float_ms": float_ms, "speedup": speedup, "speedup_spread": spread})
        return found

    return figures, calls


def test_a_float_time_far_off_the_runs_is_timed_again_and_then_its_own(cnn, tmp_path, monkeypatch):
    """Candidate 2's float time, 15 ms where the other rows' lie at 2.4-2.75 ms, is timed again
    once (the fifth row timed makes five to judge by) and the second timing, 2.5 ms, is its
    row's, and the rows' that run its plan: speedup 2.5 / 1.3. No other row is timed twice
    and nothing is said."""
    figures, calls = disturbed_timer(1)
    monkeypatch.setattr(deployed, "latency_figures", figures)
    answer = run_tune(cnn, tmp_path / "out", target=500.0, max_trials=1)  # out of reach: rows of more plans
    rows = {c["id"]: c for c in answer["candidates"]}
    timed = [k for call in calls[:-1] for k in call]  # the last: the chosen row and its rivals timed together
    assert timed.count(DISTURBED) == 2 and all(timed.count(k) == 1 for k in set(timed) - {DISTURBED})
    assert answer["chosen"] in calls[-1] or rows_carried(answer, calls[-1])
    carriers = [c for c in rows.values() if c["speed_from"] == DISTURBED]
    assert carriers  # its Percentile twin runs its plan
    for row in [rows[DISTURBED], *carriers]:
        assert row["float_ms"] == pytest.approx(2.5) and row["speedup"] == pytest.approx(2.5 / 1.3)
    assert not any("far off" in w for w in answer["warnings"])


def test_a_float_time_that_stays_far_off_is_flagged_and_never_ranked_by_its_speed(cnn, tmp_path, monkeypatch):
    """Timed again and still 15 ms: the row keeps its times, its speedup and spread are null (so
    it is neither listed first nor chosen for a speed of 11.5, and the slower guard fails it), a
    warning names it, and its keys are every row's (the answer's schema is unchanged)."""
    figures, calls = disturbed_timer(2)
    monkeypatch.setattr(deployed, "latency_figures", figures)
    answer = run_tune(cnn, tmp_path / "out", target=500.0, max_trials=1)  # out of reach: rows of more plans
    rows = {c["id"]: c for c in answer["candidates"]}
    row = rows[DISTURBED]
    timed = [k for call in calls[:-1] for k in call]
    assert timed.count(DISTURBED) == 2
    assert (row["float_ms"], row["ms"], row["speedup"], row["speedup_spread"]) == (15.0, 1.3, None, None)
    assert row["fails"] == ["slower"] and answer["chosen"] != DISTURBED and answer["candidates"][0]["id"] != DISTURBED
    assert all(list(c) == list(row) for c in rows.values())
    said = [w for w in answer["warnings"] if "far off" in w]
    assert len(said) == 1 and said[0].startswith(f"candidate {DISTURBED}'s float time")
    assert "15 ms, then 15 ms" in said[0]


@pytest.mark.parametrize(
    ("value", "others", "far"),
    [
        pytest.param(15.0, [2.4, 2.5, 2.6, 2.7, 2.9], True, id="busy-moment"),  # median 2.6, 1.4826 * MAD 0.148
        pytest.param(3.2, [2.4, 2.5, 2.6, 2.7, 2.9], False, id="beyond-3-mads-within-2-times"),
        pytest.param(5.5, [2.4, 2.5, 2.6, 2.7, 2.9], True, id="just-beyond-2-times"),
        # A busy machine only slows a run: a time far below the others says they were disturbed.
        pytest.param(1.2, [2.4, 2.5, 2.6, 2.7, 2.9], False, id="a-fast-time-is-no-disturbance"),
        pytest.param(21.6, [59.0, 58.0, 60.0, 59.5, 21.0], False, id="the-others-busy-throughout"),
        pytest.param(7.0, [1.0, 2.0, 3.0, 4.0, 5.0], False, id="within-3-mads-of-a-noisy-run"),  # 4 < 4.45
        pytest.param(2.6, [2.6] * 5, False, id="equal-times"),
        pytest.param(6.0, [2.4, 2.5, 2.6, 2.7, 15.0], True, id="another-disturbed-row-widens-no-spread"),  # SD 4.9
    ],
)
def test_a_time_is_far_off_above_3_scaled_mads_and_a_factor_of_2(value, others, far):
    from graphscan_ort.engines.timing import far_off

    assert far_off(value, others) is far


class RetimedRows:
    """Trials with scripted rows for its steady rule alone: each row's float time as given, its
    ms 1.0, and a second timing (Measure.timed) that gives ``retimed_ms`` as float time."""

    def __init__(self, tmp_path, retimed_ms):
        from types import SimpleNamespace

        self.calls = []

        def timed(model, path):
            self.calls.append(model)
            return {"ms": 1.0, "float_ms": retimed_ms, "speedup": retimed_ms, "speedup_spread": [retimed_ms] * 2}

        measure = SimpleNamespace(float_bytes=10**9, min_speedup=1.0, models={}, timed=timed)
        self.trials = tune_trials.Trials(str(tmp_path), None, measure)

    def add(self, float_ms, same_as=None, inherits=None):
        """A row timed at ``float_ms`` (``same_as``: a twin, its figures copied; ``inherits``: a
        row whose timing it takes, bias.same_graph's), then steady."""
        trials = self.trials
        k = len(trials.rows)
        figures = {"ms": 1.0, "float_ms": float_ms, "speedup": float_ms, "speedup_spread": [float_ms] * 2}
        figures |= {"bytes": 1, "float_weights": 0, "fails": []}
        row = tune_trials.candidate_row(k, "quantize_static", {}, False, [], None, same_as=same_as, figures=figures)
        files = (f"candidate-{k}.onnx", "prepared.onnx", "cache")
        trials.book(tune_trials.Record(row, tune_trials.Origin(), files=files, speed_from=inherits), row)
        trials.measure.models[f"candidate-{k}.onnx"] = k
        trials.steady()
        return trials.rows[-1]


def test_five_rows_timed_are_enough_to_judge_a_float_time_by(tmp_path):
    """Four rows at 2.4-2.7 ms, then a fifth at 15 ms: five rows timed themselves, so the
    fifth is judged at once (far off: beyond 3 scaled MADs and 2 times) and timed again."""
    rows = RetimedRows(tmp_path, retimed_ms=2.55)
    for float_ms in (2.4, 2.5, 2.6, 2.7):
        rows.add(float_ms)
    assert rows.calls == []  # four rows: nothing judged yet
    fifth = rows.add(15.0)
    assert rows.calls == [4] and (fifth["float_ms"], fifth["speedup"]) == (2.55, 2.55)


def test_a_twin_of_a_row_timed_again_takes_its_new_speed(tmp_path):
    """Row 3 at 15 ms has a twin (the quantizer made the same model: same_as 3, its figures
    copied, never timed itself); the fifth row that timed itself makes row 3 timed again, at
    2.55 ms, and its twin says so too."""
    rows = RetimedRows(tmp_path, retimed_ms=2.55)
    for float_ms in (2.4, 2.5, 2.6):
        rows.add(float_ms)
    rows.add(15.0)
    twin = rows.add(15.0, same_as=3)
    assert rows.calls == []  # the twin is no timing of its own: four rows timed
    rows.add(2.7)
    assert rows.calls == [3] and (twin["float_ms"], twin["speedup"]) == (2.55, 2.55)
    assert twin["fails"] == [] and rows.trials.rows[3]["float_ms"] == 2.55


def test_a_twin_of_a_row_that_carries_a_retimed_rows_speed_takes_the_new_speed_too(tmp_path):
    """Row 4 runs row 3's plan (speed_from 3) and row 5 is row 4's twin (same_as 4): when
    row 3 is timed again, both take its new figures, the twin through the row it copies."""
    rows = RetimedRows(tmp_path, retimed_ms=2.55)
    for float_ms in (2.4, 2.5, 2.6):
        rows.add(float_ms)
    rows.add(15.0)
    carrier = rows.add(15.0, inherits=3)
    twin = rows.add(15.0, same_as=4)
    rows.add(2.7)
    assert rows.calls == [3]
    for row in (rows.trials.rows[3], carrier, twin):
        assert (row["float_ms"], row["speedup"], row["fails"]) == (2.55, 2.55, [])


def test_a_row_still_far_off_is_timed_again_once_flagged_and_fails_the_slower_guard(tmp_path):
    """Timed again at 15 ms too: its speedup and spread are null, so the slower guard (1.0)
    fails it, one warning names it, and the rows after it never time it a third time."""
    rows = RetimedRows(tmp_path, retimed_ms=15.0)
    for float_ms in (2.4, 2.5, 2.6, 2.7):
        rows.add(float_ms)
    fifth = rows.add(15.0)
    rows.add(2.8)
    rows.add(2.9)
    assert rows.calls == [4]
    assert (fifth["float_ms"], fifth["speedup"], fifth["speedup_spread"], fifth["fails"]) == (
        15.0,
        None,
        None,
        ["slower"],
    )
    assert len(rows.trials.disturbed) == 1 and rows.trials.disturbed[0].startswith("candidate 4's float time")


def test_a_row_that_inherits_another_rows_timing_is_no_timing_of_its_own(tmp_path):
    """Three rows at 2.4-2.6 ms, a fourth at 15, and a fifth that takes row 0's timing (a
    bias-corrected model of the same graph): four rows timed themselves, too few to judge by."""
    rows = RetimedRows(tmp_path, retimed_ms=2.55)
    for float_ms in (2.4, 2.5, 2.6, 15.0):
        rows.add(float_ms)
    rows.add(2.4, inherits=0)
    assert rows.calls == []
    rows.add(2.7)
    assert rows.calls == [3]


def test_a_row_is_timed_again_on_the_samples_its_first_timing_used(tmp_path, monkeypatch):
    """Measure.timed, Trials.steady's second timing, times on --latency-inputs when given (as
    the first timing did), else on the first evaluation sample."""
    from graphscan import Session
    from graphscan_ort.shared.options import Named, Timing

    path = tmp_path / "m.onnx"
    onnx.save(gen_models.build_mlp(1, 4, 0, ("N",)), path)
    model = onnx.load(path)
    evaluation = [{"x": np.full((1, 4), v, np.float32)} for v in (1.0, 2.0)]
    latency = [{"x": np.full((1, 4), 3.0, np.float32)}]
    used = []
    monkeypatch.setattr(
        deployed, "latency_figures", lambda reference, candidates, samples, *rest: [used.append(samples)]
    )
    for given, expected in ((latency, latency), (None, evaluation[:1])):
        measure = tune_trials.Measure(Named(model, str(path)), evaluation, Session("all", 1), Timing(2), latency=given)
        measure.timed(model, str(path))
        assert used.pop() == expected


def test_every_row_is_first_timed_on_5_runs_and_the_written_row_and_its_rivals_on_runs(cnn, tmp_path, monkeypatch):
    """--runs 9: each latency session tune opens (every row's first timing) takes 5 runs, but
    the retime stage's last one, which times the written row (and the rows speed-tied with
    it) on 9; the answer says both, and the written row's figures are that session's."""
    sessions = []
    timer = deployed.latency_figures

    def recording(reference, candidates, samples, session, timing, opened=None, stop=None):
        found = timer(reference, candidates, samples, session, timing, opened, stop)
        sessions.append((timing.runs, [c.path for c in candidates], found))
        return found

    monkeypatch.setattr(deployed, "latency_figures", recording)
    answer = run_tune(cnn, tmp_path / "o", runs=9)
    assert answer["latency"]["first_runs"] == 5 and answer["latency"]["runs"] == 9
    *first, (runs, paths, found) = sessions
    timed_itself = [c for c in answer["candidates"] if (c["speed_from"], c["same_as"], c["error"]) == (None,) * 3]
    assert {r for r, _, _ in first} == {5} and len(first) >= len(timed_itself) and runs == 9
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    timed_as = chosen["id"] if chosen["speed_from"] is None else chosen["speed_from"]
    assert paths[0].endswith(f"candidate-{timed_as}.onnx")
    assert len(found[0]["speedup_runs"]) == 9 and chosen["speedup"] == found[0]["speedup"]


def test_a_plan_lends_its_first_timed_rows_figures_unless_that_rows_speedup_was_nulled(tmp_path):
    """timed_alike gives the latency figures of the row first timed on a plan, naming it; a
    plan no row was timed on gives none, and so does a row whose speedup steady nulled (its
    float time stayed far off): the next row of that plan is timed itself."""
    rows = RetimedRows(tmp_path, retimed_ms=2.55)
    first = rows.add(2.4)
    rows.trials.timed_plans["plan-a"] = first["id"]
    lent = rows.trials.timed_alike("plan-a")
    assert lent == {"ms": 1.0, "float_ms": 2.4, "speedup": 2.4, "speedup_spread": [2.4, 2.4], "speed_from": 0}
    assert rows.trials.timed_alike("plan-b") is None
    first["speedup"] = first["speedup_spread"] = None
    assert rows.trials.timed_alike("plan-a") is None


def int8_activations(model):
    """Whether ``model`` quantizes its activations to int8 (a QuantizeLinear of a tensor no
    initializer holds, its zero point int8)."""
    constants = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and node.input[0] not in constants and len(node.input) > 2:
            return constants[node.input[2]].data_type == onnx.TensorProto.INT8
    return False


def int8_activations_slow(slow_runs, slow=int8_activations, slow_float_ms=1.0):
    """A stub of deployed.latency_figures, its runs included: models of int8 activations (or
    what ``slow`` says is slow) run at ``slow_runs``' speedups, the others at about 2x; the
    float model beside a slow one takes ``slow_float_ms``, beside the others 1 ms."""

    def figures(reference, candidates, *rest):
        found = []
        for candidate in candidates:
            is_slow = slow(candidate.model)
            runs = list(slow_runs) if is_slow else [2.0, 2.1, 1.9, 2.0, 2.05]
            middle = sorted(runs)[len(runs) // 2]
            spread = [min(runs), max(runs)]
            float_ms = slow_float_ms if is_slow else 1.0
            found.append({"ms": float_ms / middle, "float_ms": float_ms, "speedup": middle, "speedup_spread": spread})
            found[-1]["speedup_runs"] = runs
        return found

    return figures


def test_grid_rows_far_slower_than_float_are_raced_on_their_first_timing_rounds(cnn, tmp_path, monkeypatch):
    """int8 activations run at half float's speed, in onnxruntime's own timing of each row
    (deployed.latency_figures; its runs stubbed): each grid row of int8 activations timed
    itself (but onnxruntime's defaults' own) is raced on speed after RACE_FIRST_RUNS rounds,
    its answer on those rounds; every other row timed runs those rounds and then the rest of
    --runs' first 5, with no second warm-up."""
    models, timed = {}, []
    measured_session = deployed.measured_session

    def recorded(candidate, session):
        opened, graph = measured_session(candidate, session)
        models[id(opened)] = candidate.model
        return opened, graph

    def interleaved(sessions, feeds, runs, warm=True):
        slow = [int8_activations(models[id(s)]) if id(s) in models else False for s in sessions[1:]]
        timed.append((id(sessions[-1]), runs, warm))
        speeds = [0.5, 0.52, 0.49, 0.51, 0.5][:runs]
        return [[1e-3] * runs] + [[1e-3 / (v if s else 2.0) for v in speeds] for s in slow]

    monkeypatch.setattr(deployed, "measured_session", recorded)
    monkeypatch.setattr(deployed, "interleaved_runs", interleaved)
    answer = run_tune(cnn, tmp_path / "out", min_speedup=1.0, runs=5)
    grid = [c for c in answer["candidates"] if c["id"] < 16 and c["quantize_static"] and not c["kept_float"]]
    slow_rows = [c for c in grid if c["quantize_static"]["activation_type"] == "QInt8" and c["speed_from"] is None]
    raced = [c for c in slow_rows if c["raced"] is not None]
    assert raced and all(f"({deployed.RACE_FIRST_RUNS} runs)" in c["raced"] for c in raced)
    assert all(len(c["speedup_spread"]) == 2 and c["speedup"] <= 0.52 for c in raced)
    stretches: dict[int, list] = {}
    for session, runs, warm in timed:
        stretches.setdefault(session, []).append((runs, warm))
    first, rest = (deployed.RACE_FIRST_RUNS, True), (5 - deployed.RACE_FIRST_RUNS, False)
    shapes = [tuple(s) for s in stretches.values()]
    assert set(shapes) == {(first,), (first, rest), ((5, True),)}  # raced, kept, the retime's
    assert shapes.count((first,)) == len(raced)


def test_grid_rows_shown_slower_than_the_guard_are_raced_out_unmeasured(cnn, tmp_path, monkeypatch):
    """int8 activations run at half float's speed: once a row passes every guard, each grid row
    of int8 activations (but onnxruntime's defaults' own, whose accuracy may be the target) is
    timed, shown not above --min-speedup 1, and never measured for accuracy: its accuracy
    figures null, ``raced`` says why, it fails ``slower`` and it is not among the rows compared.
    Every other row is measured."""
    monkeypatch.setattr(deployed, "latency_figures", int8_activations_slow([0.5, 0.52, 0.49, 0.51, 0.5]))
    measured = []
    accuracy_figures = deployed.accuracy_figures
    monkeypatch.setattr(
        deployed,
        "accuracy_figures",
        lambda ref, candidate, *a: measured.append(candidate.path) or accuracy_figures(ref, candidate, *a),
    )
    answer = run_tune(cnn, tmp_path / "out", min_speedup=1.0)
    grid = [c for c in answer["candidates"] if c["quantize_static"] and not c["kept_float"] and not c["recovery"]]
    grid = [c for c in grid if not c["trial"] and c["id"] < 16]
    for row in grid:
        settings = row["quantize_static"]
        defaults = settings["activation_type"] == "QInt8" and not settings["per_channel"]
        defaults = defaults and settings["calibrate_method"] == "MinMax" and not row["rewrites"]
        if settings["activation_type"] == "QInt8" and not defaults:
            assert row["raced"] is not None and "--min-speedup 1" in row["raced"], row["id"]
            assert row["sqnr_db"] is None and row["metric_value"] is None and row["metric_bound"] is None
            assert row["fails"] == ["slower"] and row["speedup"] == 0.5 and not row["pareto"]
        else:
            assert row["raced"] is None and row["sqnr_db"] is not None, row["id"]
    raced = [c for c in answer["candidates"] if c["raced"] is not None]
    files = {os.path.basename(path) for path in measured}
    assert raced and not files & {f"candidate-{c['id']}.onnx" for c in raced}  # never run on the samples
    assert {f"candidate-{c['id']}.onnx" for c in grid if c["raced"] is None and c["same_as"] is None} <= files
    assert answer["evaluation"]["rows_compared"] == sum(
        c["error"] is None and c["raced"] is None for c in answer["candidates"]
    )
    assert answer["chosen"] not in {c["id"] for c in raced}
    said = " ".join(graphscan.render_table("tune", answer).split())  # the table says which were raced, once
    assert f"candidates {', '.join(str(k) for k in sorted(c['id'] for c in raced))}: raced out on speed" in said


@pytest.mark.parametrize(
    ("slow_runs", "min_speedup"),
    [([0.5, 0.52, 0.49, 0.51, 0.5], 0.0), ([0.5, 1.6, 0.4, 1.5, 0.45], 1.0), ([0.5], 1.0)],
    ids=["no_guard", "runs_that_cannot_show_it", "one_run"],
)
def test_no_row_is_raced_out_without_a_guard_or_runs_that_show_it_slower(
    cnn, tmp_path, monkeypatch, slow_runs, min_speedup
):
    """Raced out only where the ``slower`` guard is on and the runs' upper bound lies at or
    below it: --min-speedup 0, runs whose spread reaches above 1x, and a single run (no bound)
    race no row: every row is measured."""
    monkeypatch.setattr(deployed, "latency_figures", int8_activations_slow(slow_runs))
    answer = run_tune(cnn, tmp_path / "out", min_speedup=min_speedup)
    assert all(c["raced"] is None for c in answer["candidates"])
    assert all(c["sqnr_db"] is not None for c in answer["candidates"] if c["error"] is None)


def test_no_row_is_raced_out_before_a_row_passes_every_guard(cnn, tmp_path, monkeypatch):
    """Every model runs at half float's speed: no row passes, so none is raced (the most
    accurate is still wanted: prepared.onnx is its), and every row is measured."""
    every_model = int8_activations_slow([0.5, 0.52, 0.49, 0.51, 0.5], slow=lambda model: True)
    monkeypatch.setattr(deployed, "latency_figures", every_model)
    answer = run_tune(cnn, tmp_path / "out", min_speedup=1.0)
    assert answer["chosen"] is None
    assert all(c["raced"] is None and c["sqnr_db"] is not None for c in answer["candidates"] if c["error"] is None)


def test_a_raced_row_never_passes_nor_is_chosen_even_timed_again_faster():
    """A raced row has no accuracy: where a later timing lifts its speed above the guard (no
    ``fails`` left), it still does not pass, is not compared, and the choice never takes it,
    not even when every measured row's metric is undefined."""
    from graphscan_ort.tune.choice import compared, passing

    raced = {"id": 0, "speedup": 3.0, "metric_value": None, "fails": [], "error": None, "raced": "not measured"}
    measured = {"id": 1, "speedup": 1.5, "metric_value": None, "fails": [], "error": None, "raced": None}
    for row in (raced, measured):
        row["metric_bound"] = None
    assert not passing(raced) and not compared(raced) and passing(measured) and compared(measured)
    assert Policy(10.0).chosen([raced, measured]) == (measured, False)
    assert Policy(10.0).chosen([raced]) == (None, False)


def test_no_row_is_raced_out_on_a_busy_machine(cnn, tmp_path, monkeypatch):
    """The float model's own times spread 3 times over the run (1 ms, then 3 ms beside the slow
    rows: a busy machine, whose bursts could make a fast row look slow): no row is raced, and
    every row is measured; the answer says the machine was busy."""
    monkeypatch.setattr(deployed, "latency_figures", int8_activations_slow([0.5] * 5, slow_float_ms=3.0))
    answer = run_tune(cnn, tmp_path / "out", min_speedup=1.0)
    assert all(c["raced"] is None and c["sqnr_db"] is not None for c in answer["candidates"] if c["error"] is None)
    assert any("the machine was busy" in w for w in answer["warnings"])


def test_the_float_timing_session_is_kept_between_timings_but_never_beside_a_calibration(cnn, tmp_path, monkeypatch):
    """The float model's timing session (Measure.float_timing) is opened once for many rows,
    fewer times than rows are timed, yet it is never open while a calibration, a bias
    correction or the exclusions' ranking holds its own tensors (release_float)."""
    import graphscan_ort.tune.bias as bias
    import graphscan_ort.tune.candidates as candidates
    import graphscan_ort.tune.overrides as overrides
    import graphscan_ort.tune.requantize as requantize

    measures, opened, timed, beside = [], [], [], []
    real_timing, real_latency = tune_trials.Measure.float_timing, deployed.latency_figures

    def float_timing(self):
        measures.append(self)
        if self.float_session is None:
            opened.append(1)
        return real_timing(self)

    def latency_figures(*args, **kwargs):
        timed.append(1)
        return real_latency(*args, **kwargs)

    def watching(name, real):
        def called(*args, **kwargs):
            beside.extend(name for m in measures if m.float_session is not None)
            return real(*args, **kwargs)

        return called

    monkeypatch.setattr(tune_trials.Measure, "float_timing", float_timing)
    monkeypatch.setattr(deployed, "latency_figures", latency_figures)
    for module in (candidates, overrides, requantize):  # where calibrate is called
        monkeypatch.setattr(module, "calibrate", watching("calibrate", module.calibrate))
    monkeypatch.setattr(bias, "mean_errors", watching("bias", bias.mean_errors))
    monkeypatch.setattr(tune_stages, "ranked_ops", watching("ranking", tune_stages.ranked_ops))
    answer = run_tune(cnn, tmp_path / "out", target=500.0, max_trials=2)
    steps = {c["recovery"]["step"] for c in answer["candidates"] if c["recovery"]}
    assert "bias_correction" in steps and any(c["trial"] for c in answer["candidates"])  # each step ran
    assert 1 <= len(opened) < len(timed) and beside == []
