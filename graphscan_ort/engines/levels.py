"""Levels: how many quantization steps a part of a tensor spans.

The *levels* of a part (shared/parts.py) at a quantized tensor are ``(max - min of the part's
float values) / the tensor's scale``: how many distinct int8 values the part can take. One
scale over a Concat of box pixels (0..320) and class probabilities (0..1) has a step of about
1.27, so the probabilities span 0.79 levels: every one becomes 0 or 1.27. A part below a
handful of levels has lost what it says, whatever the SQNR of the whole.

A part whose float values are all equal carries nothing to resolve and is left out; the
levels of a tensor are those of its worst part. A per-channel scale is taken at its largest.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
from onnx import helper

from graphscan import QUANTIZE
from graphscan_ort.shared.graph import QDQ_SUFFIX, constant_arrays
from graphscan_ort.shared.parts import TensorParts
from graphscan_ort.shared.sessions import model_outputs

# Below this many levels, tune warns that a part of the model it writes has lost its values.
LEVELS_FLOOR = 16.0
# Tensors fetched per run of the float model: bounds the memory of a model with many.
TENSORS_PER_RUN = 64


@dataclasses.dataclass(frozen=True)
class TensorLevels:
    """A quantized tensor's worst part: its levels, its id and the node its values come from."""

    tensor: str
    levels: float
    part: int
    node: str | None


def quantized_activations(quant_model: onnx.ModelProto) -> dict[str, float]:
    """``{tensor: scale}`` of every tensor a QuantizeLinear reads that is not a constant,
    its scale a constant (the largest of a per-channel one)."""
    constants = constant_arrays(quant_model.graph)
    found: dict[str, float] = {}
    for node in quant_model.graph.node:
        if node.op_type != QUANTIZE or len(node.input) < 2 or node.input[0] in constants:
            continue
        scale = constants.get(node.input[1])
        if scale is None or scale.array.size == 0:
            continue
        value = float(np.max(np.abs(scale.array.astype(np.float64))))
        if value > 0 and math.isfinite(value):
            found[node.input[0]] = max(value, found.get(node.input[0], 0.0))
    return found


def part_ranges(
    float_model: onnx.ModelProto, tensors: list[str], samples: list[dict[str, np.ndarray]], path: str
) -> tuple[dict[str, list[tuple[float, float] | None]], dict[str, list[str | None]]]:
    """Per tensor of ``float_model``, per part, ``(min, max)`` of its finite float values
    over ``samples`` (None: no finite value); and per tensor the node each part comes from."""
    parts = TensorParts(float_model, tensors)
    ranges: dict[str, list[tuple[float, float] | None]] = {t: [None] * len(parts.sources[t]) for t in tensors}
    for start in range(0, len(tensors), TENSORS_PER_RUN):
        chunk = tensors[start : start + TENSORS_PER_RUN]
        copy = with_outputs(float_model, chunk)
        for sample, values in zip(samples, model_outputs(copy, samples, path, chunk), strict=True):
            labels = parts.labels(sample)
            for tensor, value in zip(chunk, values, strict=True):
                widen(ranges[tensor], np.asarray(value), labels[tensor])
    return ranges, parts.sources


def with_outputs(model: onnx.ModelProto, tensors: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose outputs are ``tensors`` (inner tensors included)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.output[:]
    copy.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in tensors)
    return copy


def widen(ranges: list[tuple[float, float] | None], values: np.ndarray, labels: np.ndarray | None) -> None:
    """Widen each part's ``(min, max)`` by ``values`` (``labels``: their part ids; None: one part)."""
    if values.dtype.kind not in "f" or values.size == 0:
        return
    ids = np.zeros(values.shape, np.int64) if labels is None else labels
    finite = np.isfinite(values)
    for k in range(len(ranges)):
        chosen = values[(ids == k) & finite] if labels is not None else values[finite]
        if chosen.size == 0:
            continue
        lo, hi = float(chosen.min()), float(chosen.max())
        old = ranges[k]
        ranges[k] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))


def worst_levels(ranges: list[tuple[float, float] | None], scale: float) -> tuple[float, int] | None:
    """``(levels, part)`` of the part spanning the fewest steps of ``scale``; None when no
    part varies."""
    spans = [(hi - lo, k) for k, found in enumerate(ranges) if found is not None for lo, hi in [found] if hi > lo]
    if not spans:
        return None
    span, part = min(spans)
    return span / scale, part


def tensor_levels(
    float_model: onnx.ModelProto,
    scales: dict[str, float],
    samples: list[dict[str, np.ndarray]],
    path: str,
) -> dict[str, TensorLevels]:
    """Per tensor of ``scales`` (its name in ``float_model``: its quantization scale), the
    levels of its worst part on ``samples``; tensors the float model does not hold, or whose
    parts never vary, are left out."""
    held = {o for node in float_model.graph.node for o in node.output} | {i.name for i in float_model.graph.input}
    named = {float_name(t, held): t for t in scales}  # the float model's name: the quantized model's
    tensors = [t for t in named if t is not None]
    if not tensors:
        return {}
    ranges, sources = part_ranges(float_model, tensors, samples, path)
    found: dict[str, TensorLevels] = {}
    for tensor in tensors:
        quantized = named[tensor]
        worst = worst_levels(ranges[tensor], scales[quantized])
        if worst is not None:
            found[quantized] = TensorLevels(quantized, worst[0], worst[1], sources[tensor][worst[1]])
    return found


def float_name(tensor: str, held: set[str]) -> str | None:
    """``tensor``'s name in the float model: the same, or without the suffix onnxruntime's
    quantizer adds when it renames a graph output's producer (``y_QuantizeLinear_Input``)."""
    if tensor in held:
        return tensor
    plain = QDQ_SUFFIX.sub("", tensor)
    return plain if plain in held else None


def lowest_levels(levels: dict[str, TensorLevels]) -> TensorLevels | None:
    """The tensor whose worst part spans the fewest levels (None: none measured)."""
    return min(levels.values(), key=lambda found: (found.levels, found.tensor), default=None)
