"""tune's calibration overrides (issue 33 item 3, tune/overrides.py): a tensor whose MinMax
range its rare outliers set gets its Percentile range through onnxruntime's
TensorQuantOverrides, every other tensor keeps its MinMax range; a recovery row of its own,
kept only where it helps as deployed."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.quantization import CalibrationMethod, quantize_static
from onnxruntime.quantization.calibrate import TensorsData

import graphscan
import graphscan_ort.tune.stages as tune_stages
from graphscan_ort.tune.candidates import keyword_arguments, quiet
from graphscan_ort.tune.choice import Policy
from graphscan_ort.tune.overrides import OUTLIER_FACTOR, STEP, outlier_overrides
from graphscan_ort.tune.progress import Progress
from tests.helpers import calibration_reader, undisturbed_timings
from tests.tune.outliers import outlier_model, outlier_samples
from tests.tune.test_recovery import tuned as recovery_run


def tensors(method, ranges):
    """A calibration cache's ranges as onnxruntime keeps them (float32 arrays)."""
    return TensorsData(method, {k: (np.float32(lo), np.float32(hi)) for k, (lo, hi) in ranges.items()})


def test_specs_worked_example():
    minmax = tensors(CalibrationMethod.MinMax, {"x": (-4.2, 96.0), "r": (0.0, 6.2)})
    percentile = tensors(CalibrationMethod.MinMax, {"x": (-4.1, 4.3), "r": (0.0, 5.9)})
    found = outlier_overrides(minmax, percentile)
    assert list(found) == ["x"]  # 100.2 / 8.4 = 11.9 times; r: 6.2 / 5.9 = 1.05
    assert found["x"] == [{"rmin": float(np.float32(-4.1)), "rmax": float(np.float32(4.3))}]


@pytest.mark.parametrize(
    ("high", "overridden"),
    [
        pytest.param(2.0 * OUTLIER_FACTOR * 1.001, True, id="just-above"),
        pytest.param(2.0 * OUTLIER_FACTOR, False, id="at"),
    ],
)
def test_the_factor_is_on_the_widths_with_zero_included(high, overridden):
    """Percentile [0.5, 2] is 2 wide once 0 is in (onnxruntime's scales always hold 0)."""
    minmax = tensors(CalibrationMethod.MinMax, {"t": (0.5, high)})
    percentile = tensors(CalibrationMethod.MinMax, {"t": (0.5, 2.0)})
    assert bool(outlier_overrides(minmax, percentile)) == overridden


def test_a_percentile_range_of_width_zero_is_never_an_override():
    minmax = tensors(CalibrationMethod.MinMax, {"t": (0.0, 5.0)})
    percentile = tensors(CalibrationMethod.MinMax, {"t": (0.0, 0.0)})
    assert outlier_overrides(minmax, percentile) == {}


def worst_sqnr(float_path, quant_path, samples):
    """The lowest per-output SQNR over the samples pooled, in numpy (each output here is one part)."""
    sessions = [ort.InferenceSession(p, providers=["CPUExecutionProvider"]) for p in (float_path, quant_path)]
    pairs = [[s.run(None, sample) for s in sessions] for sample in samples]
    values = []
    for k in range(len(pairs[0][0])):
        signal = sum(float(np.sum(np.square(f[k].astype(np.float64)))) for f, _ in pairs)
        noise = sum(float(np.sum(np.square(f[k].astype(np.float64) - q[k]))) for f, q in pairs)
        values.append(10 * np.log10(signal / noise))
    return min(values)


@pytest.fixture(scope="module")
def outliers(tmp_path_factory):
    """tune, at a target no row reaches, on a model whose input x has one outlier in the
    calibration samples (MinMax wastes x's levels) and whose input y has rare peaks that are
    the signal (Percentile and Entropy clip them)."""
    folder = tmp_path_factory.mktemp("overrides")
    outlier_model(folder / "m.onnx")
    calibration = outlier_samples(folder, 8, 1, True)
    evaluation = outlier_samples(folder, 4, 2, False)
    with pytest.MonkeyPatch.context() as patch:
        undisturbed_timings(patch)
        answer = tuned_at_500(folder, calibration, evaluation)
    return {"answer": answer, "folder": folder, "calibration": calibration, "evaluation": evaluation}


def tuned_at_500(folder, calibration, evaluation):
    return graphscan.tune(
        str(folder / "m.onnx"),
        calibrate=calibration,
        inputs=evaluation,
        out=str(folder / "out"),
        target=500.0,
        runs=1,
        min_speedup=0,
        max_trials=0,
    )


def overrides_rows(answer):
    return [c for c in answer["candidates"] if c["recovery"] and c["recovery"]["step"] == STEP]


def test_the_outlier_dominated_tensors_are_overridden_and_the_others_keep_minmax(outliers):
    (row,) = overrides_rows(outliers["answer"])
    settings = row["quantize_static"]
    assert settings["calibrate_method"] == "MinMax"
    found = settings["extra_options"]["TensorQuantOverrides"]
    # x and the Convs' outputs it reaches; y's peaks (1.6 against 1.0) are within the factor
    assert sorted(found) == ["a", "a1", "x"]
    assert row["recovery"]["detail"].startswith("3 tensors given their Percentile range (MinMax up to ")


def test_the_override_helps_as_deployed_by_an_independent_computation(outliers, tmp_path):
    """The written model (the overrides row, rebuilt from its arguments byte for byte) against
    the row it came from, rebuilt too: numpy's SQNR of each, on the held-out samples, says the
    gain the row reports; it beats every row without overrides."""
    answer, out = outliers["answer"], outliers["folder"] / "out"
    (row,) = overrides_rows(answer)
    assert answer["chosen"] == row["id"] and row["recovery"]["helps"]
    base = next(c for c in answer["candidates"] if c["id"] == row["recovery"]["from"])
    rebuilt = {}
    for name, candidate in (("row", row), ("base", base)):
        rebuilt[name] = str(tmp_path / f"{name}.onnx")
        with quiet():
            quantize_static(
                str(out / "prepared.onnx"),
                rebuilt[name],
                calibration_reader(outliers["calibration"]),
                **keyword_arguments(candidate["quantize_static"]),
            )
    assert onnx.load(rebuilt["row"]).SerializeToString() == onnx.load(out / "model.onnx").SerializeToString()
    samples = [dict(np.load(p)) for p in outliers["evaluation"]]
    float_path = str(outliers["folder"] / "m.onnx")
    mine, theirs = worst_sqnr(float_path, rebuilt["row"], samples), worst_sqnr(float_path, rebuilt["base"], samples)
    assert mine == pytest.approx(row["sqnr_db"], abs=0.01)
    assert mine - theirs == pytest.approx(row["recovery"]["sqnr_gain_db"], abs=0.01)
    # Every row but this one and its own bias-corrected variant (the chosen row's, tried at the end).
    others = [
        c["sqnr_db"]
        for c in answer["candidates"]
        if c["error"] is None and c is not row and (c["recovery"] or {}).get("from") != row["id"]
    ]
    assert mine > max(others) + 3.0  # 32.0 dB against 26.3 (the equalized MinMax moving-average row)


def test_without_an_outlier_dominated_tensor_no_row_is_added(tmp_path):
    """A small CNN on standard normal samples: every MinMax range within the factor of its
    Percentile range, so the recovery stage adds its two rows and no third."""
    answer = recovery_run(tmp_path, 500.0)["answer"]  # the recovery tests' unreachable scenario
    steps = [c["recovery"]["step"] for c in answer["candidates"] if c["recovery"]]
    assert sorted(steps) == ["bias_correction", "equalize"]
    assert all("extra_options" not in (c["quantize_static"] or {}) or "TensorQuantOverrides" not in
               c["quantize_static"]["extra_options"] for c in answer["candidates"])  # fmt: skip


class ReachedTrials:
    """Trials whose one row already reaches the target: an overrides row would need its
    files, which it has none of."""

    def __init__(self):
        settings = {"quant_format": "QDQ", "activation_type": "QUInt8", "per_channel": False}
        self.rows = [
            {"id": 0, "quantize_static": settings, "error": None, "fails": [], "broken_parts": [], "recovery": None}
            | {"metric_value": 30.0, "sqnr_db": 30.0, "speedup": 2.0, "float_weights": 0, "kept_float": []}
        ]
        self.files = {}


def test_a_reached_target_tries_no_overrides():
    """The overrides are a search stage: the pipeline runs it only while no row meets the target."""
    (stage,) = [stage for stage in tune_stages.STAGES if stage.name == "overrides"]
    assert not stage.always
    run = tune_stages.Run(ReachedTrials(), Policy(25.0), None, [], {}, (None, None), [], Progress(), [])
    run.target, run.met = {"value": 25.0, "source": "user"}, True
    assert not run.searching()
