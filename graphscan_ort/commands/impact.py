"""impact: which operator's quantization costs the output, and what to exclude.

One derived model answers every "what if X stayed float" question: the
quantized model with Where(on, alternative, DQ(Q(t))) on exactly the edges a
variant changes, each Where with its own boolean input. It runs as a chain of
segment sessions (segments.py); no session per variant.
"""

from __future__ import annotations

from graphscan import (
    EXIT_USAGE,
    GraphscanError,
    load_with_weights,
)
from graphscan_ort.engines.attribution import measure
from graphscan_ort.shared.inputs import check_same_inputs, inputs_answer, model_samples, parse_shapes
from graphscan_ort.shared.sessions import inputs_hint

IMPACT_SYMBOLIC_DIM_SIZE = 1


def impact(
    a: str,
    b: str,
    inputs: list[str] | None = None,
    seed: int = 0,
    shape: list[str] | None = None,
    target_sqnr: float | None = None,
    max_exclude: int | None = None,
    top: int | None = None,
    min_gain: float | None = None,
) -> dict:
    """Per operator and per activation tensor of ``b`` (quantized): the output
    SQNR against ``a`` (float) if it stayed float; optionally what to exclude."""
    with inputs_hint(not inputs, IMPACT_SYMBOLIC_DIM_SIZE, [a, b]):
        return impact_answer(a, b, inputs, seed, shape, target_sqnr, max_exclude, top, min_gain)


def impact_answer(a, b, inputs, seed, shape, target_sqnr, max_exclude, top, min_gain):
    """``impact``'s work, every argument as given."""
    if max_exclude is not None and target_sqnr is None:
        raise GraphscanError("usage: --max-exclude needs --target-sqnr", EXIT_USAGE)
    if min_gain is not None and target_sqnr is None:
        raise GraphscanError("usage: --min-gain needs --target-sqnr", EXIT_USAGE)
    float_model, quant_model = load_with_weights(a), load_with_weights(b)
    check_same_inputs(float_model, quant_model, a, b)
    samples, defaulted = model_samples(float_model, inputs, parse_shapes(shape), seed, IMPACT_SYMBOLIC_DIM_SIZE)
    body = measure(float_model, quant_model, samples, a, b, target_sqnr, max_exclude, top, min_gain)
    return {"a": a, "b": b, "inputs": inputs_answer(samples), "defaulted": defaulted, **body}
