"""check's budgets that run the model: the int8 share (runtime) and the output SQNR."""

from __future__ import annotations

import math

import onnx

from graphscan import Samples, load_with_weights
from graphscan_ort.engines.classify import classify
from graphscan_ort.shared.inputs import check_same_inputs, model_samples, parse_shapes
from graphscan_ort.shared.kernels import int8_fraction
from graphscan_ort.shared.metrics import output_pairs, output_sqnr
from graphscan_ort.shared.sessions import deployed_options, inputs_hint


def measurements(
    path: str,
    names: list[str],
    float_path: str | None,
    samples: Samples,
    level: str = "all",
    model: onnx.ModelProto | None = None,
) -> dict[str, float]:
    """The value of each budget in ``names`` (``min_int8``, ``min_sqnr``) for the
    quantized model at ``path`` (``model``: that model, when the caller already
    read it with its weights); ``level``: the optimization level min_sqnr runs at."""
    values = {}
    if "min_int8" in names:
        model = load_with_weights(path) if model is None else model
        values["min_int8"] = int8_fraction(classify(model, path).counts["classes"])
    if "min_sqnr" in names:
        assert float_path is not None, "the core checks that --min-sqnr comes with --float"
        float_model = load_with_weights(float_path)
        model = load_with_weights(path) if model is None else model
        values["min_sqnr"] = measured_sqnr(float_model, model, float_path, path, samples, level)
    return values


def measured_sqnr(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    float_path: str,
    quant_path: str,
    given: Samples,
    level: str = "all",
) -> float:
    """The quantized model's output SQNR against the float one as users run
    them (both in a session at ``level``, onnxruntime's default "all"), by
    impact's definition and pairing: ``inf`` when the outputs are equal, ``nan``
    when the SQNR is undefined (NaN or Inf in the outputs, all-zero float
    outputs, an empty sample)."""
    check_same_inputs(float_model, quant_model, float_path, quant_path)
    pairs = output_pairs(float_model, quant_model, float_path, quant_path)
    samples, _ = model_samples(float_model, given.inputs, parse_shapes(given.shape), given.seed or 0, 1)
    options = deployed_options(level)
    with inputs_hint(not given.inputs, 1, [float_path, quant_path]):
        sqnr, exact, empty = output_sqnr(float_model, quant_model, samples, pairs, float_path, quant_path, options)
    if empty:  # an empty sample verifies nothing: the budget does not hold
        return math.nan
    if exact:
        return math.inf
    return math.nan if sqnr is None else sqnr
