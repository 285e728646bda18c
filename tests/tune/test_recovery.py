"""tune's recovery stage (issue 33 item 3): when no candidate reaches the target, the start
row is equalized (a verified prepare step) and bias-corrected, each a row of its own whose
``recovery`` says what it did, its gains the row's figures minus its source's."""

import math
import re

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import quantize_static

import gen_models
import graphscan_ort.tune.command as tune
from graphscan_ort.shared.metrics import verified
from graphscan_ort.tune.bias import bias_corrected
from graphscan_ort.tune.candidates import keyword_arguments, quiet
from graphscan_ort.tune.progress import Progress
from graphscan_ort.tune.recovery import recover
from graphscan_ort.tune.table import tune_table
from tests.helpers import calibration_reader


def tuned(folder, target):
    """tune on a small residual CNN (Conv->Relu->Conv pairs, a Gemm head with a bias)."""
    onnx.save(gen_models.build_cnn(2, 32, 16, 0), folder / "cnn.onnx")
    rng = np.random.default_rng(33)
    files = []
    for k in range(5):
        files.append(str(folder / f"s{k}.npz"))
        np.savez(files[-1], x=rng.standard_normal((1, 3, 16, 16)).astype(np.float32))
    answer = tune.tune(
        str(folder / "cnn.onnx"),
        calibrate=files[:3],
        inputs=files[3:],
        out=str(folder / "out"),
        target=target,
        runs=1,
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


def test_a_reached_target_tries_no_recovery(tmp_path):
    answer = tuned(tmp_path, -1000.0)["answer"]
    assert answer["reached"]
    assert all(c["recovery"] is None for c in answer["candidates"])
    assert "equalize" not in [s["step"] for s in answer["prepare"]]


def test_the_table_says_what_each_recovery_did(unreachable):
    text = " ".join(tune_table(unreachable["answer"], None).split())  # the notes are wrapped
    for step in ("equalize", "bias_correction"):
        (row,) = recovered(unreachable["answer"], step)
        gain = row["recovery"]["sqnr_gain_db"]
        assert f"candidate {row['id']}: {step} of candidate {row['recovery']['from']} (" in text
        assert f"{gain:+.3g} dB" in text


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
    trials = NoTrials()
    assert recover(trials, 25.0, None, [], Progress()) == []
    assert len(trials.rows) == 1
