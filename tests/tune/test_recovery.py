"""tune's recovery stage: when no candidate reaches the target, the start
row is equalized (a verified prepare step) and bias-corrected, each a row of its own whose
``recovery`` says what it did, its gains the row's figures minus its source's."""

import math
import re

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import quantize_static

import gen_models
import graphscan
import graphscan_ort.tune.stages as stages
from graphscan_ort.shared.metrics import verified
from graphscan_ort.tune.bias import bias_corrected
from graphscan_ort.tune.candidates import keyword_arguments, quiet
from graphscan_ort.tune.choice import Policy
from graphscan_ort.tune.progress import Progress
from graphscan_ort.tune.recovery import polished
from graphscan_ort.tune.table import tune_table
from tests.helpers import calibration_reader, without_dynamic_candidates


def tuned(folder, target):
    """tune on a small residual CNN (Conv->Relu->Conv pairs, a Gemm head with a bias)."""
    onnx.save(gen_models.build_cnn(2, 32, 16, 0), folder / "cnn.onnx")
    rng = np.random.default_rng(33)
    files = []
    for k in range(5):
        files.append(str(folder / f"s{k}.npz"))
        np.savez(files[-1], x=rng.standard_normal((1, 3, 16, 16)).astype(np.float32))
    answer = graphscan.tune(
        str(folder / "cnn.onnx"),
        calibrate=files[:3],
        inputs=files[3:],
        out=str(folder / "out"),
        target=target,
        runs=3,  # runs to tie speeds by (one run each would let a timing's noise choose)
        min_speedup=0,
        max_trials=0,
    )
    return {"answer": answer, "files": files, "folder": folder}


@pytest.fixture(scope="module")
def unreachable(tmp_path_factory):
    """A target no candidate reaches: the recovery stage runs."""
    return tuned(tmp_path_factory.mktemp("recovery"), 500.0)


def recovered(answer, step):
    return [c for c in answer["candidates"] if c["recovery"] and c["recovery"]["step"] == step]


def test_equalization_is_a_verified_prepare_step_and_a_row_of_its_own(unreachable):
    answer = unreachable["answer"]
    (equalize,) = [s for s in answer["prepare"] if s["step"] == "equalize"]
    assert equalize["ok"] and equalize["detail"].endswith("Conv pairs equalized")
    (row,) = recovered(answer, "equalize")
    base = next(c for c in answer["candidates"] if c["id"] == row["recovery"]["from"])
    assert row["quantize_static"] == base["quantize_static"] and row["id"] > base["id"]


@pytest.mark.parametrize("step", [pytest.param("equalize", id="equalize"), pytest.param("bias_correction", id="bias")])
def test_a_recovery_reports_its_gain_over_its_source_in_db_and_in_the_metric(unreachable, step):
    rows = {c["id"]: c for c in unreachable["answer"]["candidates"]}
    (row,) = recovered(unreachable["answer"], step)
    base = rows[row["recovery"]["from"]]
    assert math.isclose(row["recovery"]["sqnr_gain_db"], row["sqnr_db"] - base["sqnr_db"], abs_tol=1e-9)
    assert math.isclose(row["recovery"]["metric_gain"], row["metric_value"] - base["metric_value"], abs_tol=1e-9)
    assert row["recovery"]["helps"] == (row["metric_value"] > base["metric_value"])


def test_bias_correction_starts_from_the_more_accurate_of_the_row_and_its_equalized_twin(unreachable):
    rows = {c["id"]: c for c in unreachable["answer"]["candidates"]}
    (equalize,) = recovered(unreachable["answer"], "equalize")
    (corrected,) = recovered(unreachable["answer"], "bias_correction")
    start = rows[equalize["recovery"]["from"]]
    expected = equalize if equalize["metric_value"] > start["metric_value"] else start
    assert corrected["recovery"]["from"] == expected["id"]
    assert re.fullmatch(r"[1-9]\d* biases moved, by \S+ on average", corrected["recovery"]["detail"])


def test_the_written_model_is_reproduced_by_its_arguments_and_recovery(unreachable, tmp_path):
    """prepared.onnx is the model the quantizer was given (the equalized one when an
    equalized row is chosen); the chosen row's arguments, then its bias correction if it has
    one, give model.onnx byte for byte."""
    answer, out = unreachable["answer"], unreachable["folder"] / "out"
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    with quiet():
        quantize_static(
            str(out / "prepared.onnx"),
            str(tmp_path / "again.onnx"),
            calibration_reader(unreachable["files"][:3]),
            **keyword_arguments(chosen["quantize_static"]),
        )
    again = onnx.load(tmp_path / "again.onnx")
    if chosen["recovery"] and chosen["recovery"]["step"] == "bias_correction":
        samples = [dict(np.load(p)) for p in unreachable["files"][:3]]
        again, _ = bias_corrected(again, onnx.load(out / "prepared.onnx"), samples, "prepared.onnx")
    assert again.SerializeToString() == onnx.load(out / "model.onnx").SerializeToString()
    _, problem = verified(onnx.load(unreachable["folder"] / "cnn.onnx"), onnx.load(out / "prepared.onnx"), [
        dict(np.load(p)) for p in unreachable["files"][3:]
    ])  # fmt: skip
    assert problem is None, problem


@pytest.fixture(scope="module")
def reachable(tmp_path_factory):
    """A target every candidate reaches: no recovery stage, but the chosen row is corrected."""
    return tuned(tmp_path_factory.mktemp("reached"), -1000.0)


def test_a_reached_target_tries_no_equalization(reachable):
    answer = reachable["answer"]
    assert answer["reached"]
    assert recovered(answer, "equalize") == []
    assert "equalize" not in [s["step"] for s in answer["prepare"]]


def test_a_reached_target_still_corrects_the_chosen_rows_biases_and_writes_it_where_it_helps(reachable):
    """Measured: on this CNN the chosen row reaches the target at 40.5 dB and its biases
    corrected at 44.0 dB (8 biases moved), at the very same speed: the corrected row ranks
    above it."""
    answer = reachable["answer"]
    rows = {c["id"]: c for c in answer["candidates"]}
    (variant,) = recovered(answer, "bias_correction")
    parent = rows[variant["recovery"]["from"]]
    assert not parent["fails"] and parent["metric_bound"] >= -1000.0  # it met the target: the row chosen before
    assert variant["quantize_static"] == parent["quantize_static"] and variant["kept_float"] == parent["kept_float"]
    assert variant["recovery"]["helps"] and variant["metric_value"] > parent["metric_value"]
    # At the very same speed and more accurate, the variant always ranks above its parent: the
    # parent is never written (the final timing may find another row measurably faster still).
    assert answer["chosen"] != parent["id"] and answer["reached"]


def test_a_corrected_row_inherits_its_parents_timing_its_graph_being_the_same(reachable):
    """Its ms, float_ms, speedup and spread are its parent's to the last bit (never timed
    again, so noise cannot choose between them), and ``speed_from`` says so; its own file
    and accuracy are measured."""
    answer = reachable["answer"]
    rows = {c["id"]: c for c in answer["candidates"]}
    (variant,) = recovered(answer, "bias_correction")
    parent = rows[variant["recovery"]["from"]]
    timed = parent["id"] if parent["speed_from"] is None else parent["speed_from"]  # the row that was timed
    assert variant["recovery"]["speed_from"] == variant["speed_from"] == timed and variant["same_as"] is None
    for key in ("ms", "float_ms", "speedup", "speedup_spread"):
        assert variant[key] == parent[key], key
    assert variant["sqnr_db"] != parent["sqnr_db"]


def test_the_recovery_stages_corrected_row_inherits_its_sources_timing_too(unreachable):
    rows = {c["id"]: c for c in unreachable["answer"]["candidates"]}
    (variant,) = recovered(unreachable["answer"], "bias_correction")
    source = rows[variant["recovery"]["from"]]
    assert variant["recovery"]["speed_from"] == (source["id"] if source["speed_from"] is None else source["speed_from"])
    assert variant["speedup"] == source["speedup"] and rows[variant["speed_from"]]["speed_from"] is None


def row(ident, metric, sqnr=None, fails=(), broken=(), source=None):
    """A measured row for the keep rule: ``source`` makes it a bias-corrected one."""
    recovery = None if source is None else {"step": "bias_correction", "from": source}
    return {"id": ident, "metric_value": metric, "metric_bound": metric, "sqnr_db": metric if sqnr is None else sqnr}|{
        "error": None,
        "fails": list(fails), "broken_parts": [{"output": "y", "part": p} for p in broken], "recovery": recovery,
        "quantize_static": {}, "speedup": 2.0}  # fmt: skip


@pytest.mark.parametrize(
    ("variant", "reached", "kept"),
    [
        pytest.param(row(1, 21.0, source=0), True, True, id="metric-higher"),
        pytest.param(row(1, 20.0, sqnr=31.0, source=0), True, True, id="tie-sqnr-higher"),
        pytest.param(row(1, 20.0, sqnr=30.0, source=0), True, False, id="tie-sqnr-tie"),
        pytest.param(row(1, 20.0, sqnr=29.0, source=0), True, False, id="tie-sqnr-lower"),
        pytest.param(row(1, 19.0, sqnr=40.0, source=0), True, False, id="metric-lower"),
        pytest.param(row(1, 21.0, fails=["larger"], source=0), True, False, id="guard"),
        pytest.param(row(1, 21.0, broken=[1], source=0), True, False, id="broken-part"),
        pytest.param(row(1, 21.0, broken=[1], source=0), False, False, id="new-broken-part-short"),
        pytest.param(row(1, 21.0, broken=[0], source=0), False, True, id="same-broken-part-short"),
    ],
)
def test_a_corrected_row_is_written_only_where_it_helps_as_deployed(variant, reached, kept):
    """The parent at 20 (its SQNR 30; short of the target 25 it has part 0 broken): the
    variant wins by the metric, ties by the worst part's SQNR, never with a guard or a part
    its parent holds broken."""
    parent = row(0, 20.0, sqnr=30.0, broken=[] if reached else [0])
    target = 20.0 if reached else 25.0
    trials = NoTrials()
    trials.rows = [parent, variant]
    chosen, now = polished(trials, Policy(target), parent, reached, [], Progress())
    assert chosen is (variant if kept else parent) and now == reached


def test_a_corrected_row_that_reaches_a_target_its_parent_missed_is_reached():
    parent, variant = row(0, 20.0), row(1, 26.0, source=0)
    trials = NoTrials()
    trials.rows = [parent, variant]
    assert polished(trials, Policy(25.0), parent, False, [], Progress()) == (variant, True)


@pytest.mark.parametrize("which", ["dynamic", "corrected", "none"])
def test_rows_never_corrected(which):
    """A dynamic row calibrates nothing and a corrected row is not corrected again: no row is added."""
    trials = NoTrials()
    chosen = None if which == "none" else row(0, 20.0, source=7 if which == "corrected" else None)
    if which == "dynamic":
        chosen["quantize_static"] = None
    trials.rows = [chosen] if chosen else []
    assert polished(trials, Policy(10.0), chosen, True, [], Progress()) == (chosen, True)
    assert len(trials.rows) == (1 if chosen else 0)


def test_the_table_says_what_each_recovery_did(unreachable):
    text = " ".join(tune_table(unreachable["answer"], None).split())  # the notes are wrapped
    for step in ("equalize", "bias_correction"):
        (row,) = recovered(unreachable["answer"], step)
        gain = row["recovery"]["sqnr_gain_db"]
        assert f"candidate {row['id']}: {step} of candidate {row['recovery']['from']} (" in text
        assert f"{gain:+.3g} dB" in text
        inherited = f"the same plan: candidate {row['speed_from']}'s speed, not timed again"
        assert (inherited in text) == (row["speed_from"] is not None)
        assert (row["speed_from"] is not None) or step != "bias_correction"  # a bias correction's graph is its source's


class NoTrials:
    """Trials whose one row already reaches the target: any model recover tried would need
    its files, which it has none of."""

    def __init__(self):
        settings = {"quant_format": "QDQ", "activation_type": "QUInt8", "per_channel": False}
        self.rows = [
            {"id": 0, "quantize_static": settings, "error": None, "fails": [], "broken_parts": []}
            | {"metric_value": 30.0, "sqnr_db": 30.0, "speedup": 2.0, "float_weights": 0, "kept_float": []}
        ]
        self.files = {}


def test_a_target_the_refinements_reached_tries_no_recovery():
    """The pipeline runs a search stage (recovery among them) only while no row meets the
    target: not when one is shown to (met), nor when one meets it by its measured value alone
    (30 dB against 25, no samples to bound it: only more samples could show it)."""
    trials = NoTrials()
    run = stages.Run(trials, Policy(25.0), None, [], {}, (None, None), [], Progress(), [])
    run.target = {"value": 25.0, "source": "user"}
    assert not run.searching()
    trials.rows[0]["metric_value"] = 24.9  # below the target: the search may find a more accurate row
    assert run.searching()
    run.met = True
    assert not run.searching()
    assert not [stage for stage in stages.STAGES if stage.run is stages.recovery and stage.always]


def test_a_corrected_row_whose_graph_differs_is_timed_on_its_own(tmp_path, monkeypatch):
    """A correction that also renamed every node (a stub): neither the same graph nor the
    same plan (onnxruntime's optimized graph keeps the names), so not the same kernels by
    proof: the row is timed like any other and ``speed_from`` is null."""
    import graphscan_ort.tune.recovery as recovery

    def renaming(quantized, *args):
        corrected, done = bias_corrected(quantized, *args)
        for node in corrected.graph.node:
            node.name += "_renamed"
        return corrected, done

    monkeypatch.setattr(recovery, "bias_corrected", renaming)
    answer = tuned(tmp_path, -1000.0)["answer"]
    (variant,) = recovered(answer, "bias_correction")
    parent = next(c for c in answer["candidates"] if c["id"] == variant["recovery"]["from"])
    assert variant["recovery"]["speed_from"] is None and variant["speed_from"] is None and variant["ms"] != parent["ms"]


def test_a_corrected_row_of_a_row_that_carries_a_timing_names_the_row_that_was_timed(tmp_path, monkeypatch):
    """Two grid rows of one plan, Percentile first (timed) then MinMax (more accurate on this
    CNN, so chosen, carrying the Percentile row's timing): the MinMax row's bias correction
    carries that same timing, and its ``speed_from`` (in the row and in ``recovery``) names
    the Percentile row, timed itself, not the MinMax row that carries it."""
    base = {"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8", "per_channel": False}
    without_dynamic_candidates(monkeypatch)
    monkeypatch.setattr(stages, "candidate_settings", lambda: [
        {**base, "calibrate_method": "Percentile"}, {**base, "calibrate_method": "MinMax"},
    ])  # fmt: skip
    rows = {c["id"]: c for c in tuned(tmp_path, -1000.0)["answer"]["candidates"]}
    (variant,) = [c for c in rows.values() if c["recovery"] and c["recovery"]["step"] == "bias_correction"]
    source = rows[variant["recovery"]["from"]]
    assert source["quantize_static"]["calibrate_method"] == "MinMax" and source["speed_from"] == 0
    assert variant["speed_from"] == variant["recovery"]["speed_from"] == 0 and rows[0]["speed_from"] is None
    for key in ("ms", "float_ms", "speedup", "speedup_spread"):
        assert variant[key] == source[key] == rows[0][key], key
