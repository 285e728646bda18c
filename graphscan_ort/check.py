"""check's budgets that run the model: the int8 share (runtime) and the output SQNR."""

from __future__ import annotations

import math

from graphscan import load_with_weights
from graphscan_ort.common import deployed_options, inputs_hint, output_pairs, output_sqnr
from graphscan_ort.inputs import check_same_inputs, model_samples, parse_shapes
from graphscan_ort.runtime import int8_fraction, runtime


def measurements(
    path: str,
    names: list[str],
    float_path: str | None,
    inputs: list[str] | None,
    shape: list[str] | None,
    seed: int,
    level: str = "all",
) -> dict[str, float]:
    """The value of each budget in ``names`` (``min_int8``, ``min_sqnr``) for the
    model at ``path``; ``level``: the optimization level min_sqnr runs at."""
    values = {}
    if "min_int8" in names:
        values["min_int8"] = int8_fraction(runtime(path)["classes"])
    if "min_sqnr" in names:
        values["min_sqnr"] = measured_sqnr(float_path, path, inputs, shape, seed, level)
    return values


def measured_sqnr(
    float_path: str,
    quant_path: str,
    inputs: list[str] | None,
    shape: list[str] | None,
    seed: int,
    level: str = "all",
) -> float:
    """The quantized model's output SQNR against the float one as users run
    them (both in a session at ``level``, onnxruntime's default "all"), by
    impact's definition and pairing: ``inf`` when the outputs are equal, ``nan``
    when the SQNR is undefined (NaN or Inf in the outputs, all-zero float
    outputs, an empty sample)."""
    float_model, quant_model = load_with_weights(float_path), load_with_weights(quant_path)
    check_same_inputs(float_model, quant_model, float_path, quant_path)
    pairs = output_pairs(float_model, quant_model, float_path, quant_path)
    samples, _ = model_samples(float_model, inputs, parse_shapes(shape), seed, 1)
    options = deployed_options(level)
    with inputs_hint(not inputs, 1, [float_path, quant_path]):
        sqnr, exact, empty = output_sqnr(float_model, quant_model, samples, pairs, float_path, quant_path, options)
    if empty:  # an empty sample verifies nothing: the budget does not hold
        return math.nan
    if exact:
        return math.inf
    return math.nan if sqnr is None else sqnr
