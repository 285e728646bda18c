"""check's budgets that run the model: the int8 share (runtime), the output SQNR and the
``--metric`` agreement (shared.agreement)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import onnx

from graphscan import NO_METRIC, MetricChoice, Samples, load_with_weights
from graphscan_ort.engines.classify import classify
from graphscan_ort.engines.levels import lowest_levels, quantized_activations, tensor_levels
from graphscan_ort.shared.agreement import Metric, metric, paired_value
from graphscan_ort.shared.inputs import check_same_inputs, model_samples, parse_shapes
from graphscan_ort.shared.kernels import int8_fraction
from graphscan_ort.shared.metrics import PairedOutputs, output_pairs, paired_outputs
from graphscan_ort.shared.sessions import deployed_options, inputs_hint


def measurements(
    path: str,
    names: list[str],
    float_path: str | None,
    samples: Samples,
    level: str = "all",
    model: onnx.ModelProto | None = None,
    chosen: MetricChoice = NO_METRIC,
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The value of each budget in ``names`` (``min_int8``, ``min_sqnr``, ``min_levels``, ``min_metric``)
    for the quantized model at ``path`` (``model``: that model, when the caller already
    read it with its weights), and what each budget's row says beside its value
    (min_metric's metric described, min_sqnr's pooled SQNR and worst part); ``level``: the
    optimization level min_sqnr and min_metric run at."""
    values = {}
    described: dict[str, dict[str, Any]] = {}
    # The metric is checked before any model runs: a bad --metric is exit 2 at once.
    agreement = metric(chosen.name, chosen.threshold, chosen.blank) if "min_metric" in names else None
    if "min_int8" in names:
        model = load_with_weights(path) if model is None else model
        values["min_int8"] = int8_fraction(classify(model, path).counts["classes"])
    if {"min_sqnr", "min_levels", "min_metric"} & set(names):
        assert float_path is not None, "the core checks that the budgets that run --float come with it"
        model = load_with_weights(path) if model is None else model
        found, more = float_measurements(path, model, float_path, names, samples, level, agreement)
        values.update(found)
        described.update(more)
    if agreement is not None:
        described["min_metric"] = {"metric": agreement.describe()}
    return values, described


def float_measurements(
    path: str,
    model: onnx.ModelProto,
    float_path: str,
    names: list[str],
    samples: Samples,
    level: str,
    agreement: Metric | None,
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """min_sqnr, min_levels and min_metric: the budgets that run the float model too."""
    float_model = load_with_weights(float_path)
    runs = checked_samples(float_model, model, float_path, path, samples)
    values: dict[str, float] = {}
    described: dict[str, dict[str, Any]] = {}
    if "min_levels" in names:
        values["min_levels"], described["min_levels"] = lowest_levels_budget(float_model, model, runs, float_path)
    if {"min_sqnr", "min_metric"} & set(names):
        outputs = deployed_outputs(float_model, model, float_path, path, runs, level)
        if "min_sqnr" in names:
            values["min_sqnr"] = measured_sqnr(outputs)
            figures = outputs.figures()
            pooled = math.inf if figures.exact else figures.pooled_db
            described["min_sqnr"] = {
                "pooled_sqnr_db": pooled if pooled is not None and math.isfinite(pooled) else None,
                "worst_part": figures.worst_part,
            }
        if agreement is not None:
            value = paired_value(outputs, agreement)
            values["min_metric"] = math.nan if value is None else value
    return values, described


@dataclasses.dataclass
class CheckSamples:
    """The samples both models run on: the ``--inputs`` ones, or one seeded sample (generated)."""

    samples: list[dict]
    generated: bool


def checked_samples(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, float_path: str, quant_path: str, given: Samples
) -> CheckSamples:
    """The ``--inputs`` samples or one seeded sample, both models' inputs checked alike."""
    check_same_inputs(float_model, quant_model, float_path, quant_path)
    samples, _ = model_samples(float_model, given.inputs, parse_shapes(given.shape), given.seed or 0, 1)
    return CheckSamples(samples, not given.inputs)


def deployed_outputs(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    float_path: str,
    quant_path: str,
    runs: CheckSamples,
    level: str = "all",
) -> PairedOutputs:
    """Both models' outputs as users run them (a session at ``level``, onnxruntime's
    default "all"), paired as impact pairs them: run once for min_sqnr and min_metric alike."""
    pairs = output_pairs(float_model, quant_model, float_path, quant_path)
    with inputs_hint(runs.generated, 1, [float_path, quant_path]):
        options = deployed_options(level)
        return paired_outputs(float_model, quant_model, float_path, quant_path, runs.samples, pairs, options)


def lowest_levels_budget(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, runs: CheckSamples, float_path: str
) -> tuple[float, dict[str, Any]]:
    """min_levels' value (``inf`` when no quantized tensor has a part that varies) and what its
    row names: the tensor, its worst part and the node that part comes from."""
    with inputs_hint(runs.generated, 1, [float_path]):
        found = lowest_levels(tensor_levels(float_model, quantized_activations(quant_model), runs.samples, float_path))
    if found is None:
        return math.inf, {"tensor": None, "part": None}
    return found.levels, {"tensor": found.tensor, "part": {"part": found.part, "node": found.node}}


def measured_sqnr(outputs: PairedOutputs) -> float:
    """The quantized model's output SQNR against the float one by impact's definition
    (``metrics.OutputNoise``): ``inf`` when the outputs are equal, ``nan`` when the SQNR
    is undefined (NaN or Inf in the outputs, all-zero float outputs, an empty sample)."""
    sqnr, exact = outputs.sqnr()
    if outputs.reference.noise.empty:  # an empty sample verifies nothing: the budget does not hold
        return math.nan
    if exact:
        return math.inf
    return math.nan if sqnr is None else sqnr
