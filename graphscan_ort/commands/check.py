"""check's budgets that run the model: the int8 share (runtime), the output SQNR and the
``--metric`` agreement (shared.agreement)."""

from __future__ import annotations

import math
from typing import Any

import onnx

from graphscan import NO_METRIC, MetricChoice, Samples, load_with_weights
from graphscan_ort.engines.classify import classify
from graphscan_ort.shared.agreement import metric, paired_value
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
    """The value of each budget in ``names`` (``min_int8``, ``min_sqnr``, ``min_metric``)
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
    if {"min_sqnr", "min_metric"} & set(names):
        assert float_path is not None, "the core checks that --min-sqnr and --min-metric come with --float"
        float_model = load_with_weights(float_path)
        model = load_with_weights(path) if model is None else model
        outputs = deployed_outputs(float_model, model, float_path, path, samples, level)
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
    if agreement is not None:
        described["min_metric"] = {"metric": agreement.describe()}
    return values, described


def deployed_outputs(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    float_path: str,
    quant_path: str,
    given: Samples,
    level: str = "all",
) -> PairedOutputs:
    """Both models' outputs as users run them (a session at ``level``, onnxruntime's
    default "all"), on the ``--inputs`` samples or one seeded sample, paired as impact
    pairs them: run once for min_sqnr and min_metric alike."""
    check_same_inputs(float_model, quant_model, float_path, quant_path)
    pairs = output_pairs(float_model, quant_model, float_path, quant_path)
    samples, _ = model_samples(float_model, given.inputs, parse_shapes(given.shape), given.seed or 0, 1)
    with inputs_hint(not given.inputs, 1, [float_path, quant_path]):
        return paired_outputs(float_model, quant_model, float_path, quant_path, samples, pairs, deployed_options(level))


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
