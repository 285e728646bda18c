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

from graphscan import DEQUANTIZE, QUANTIZE
from graphscan_ort.shared.graph import QDQ_SUFFIX, constant_arrays, with_outputs
from graphscan_ort.shared.parts import PASS_THROUGH, TensorParts
from graphscan_ort.shared.sessions import each_sample_outputs

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
        for sample, values in zip(samples, each_sample_outputs(copy, samples, path, chunk), strict=True):
            labels = parts.labels(sample)
            for tensor, value in zip(chunk, values, strict=True):
                widen(ranges[tensor], np.asarray(value), labels[tensor])
    return ranges, parts.sources


def widen(ranges: list[tuple[float, float] | None], values: np.ndarray, labels: np.ndarray | None) -> None:
    """Widen each part's ``(min, max)`` by ``values`` (``labels``: their part ids; None: one part)."""
    if values.dtype.kind not in "f" or values.size == 0:
        return
    finite = np.isfinite(values)
    for k in range(len(ranges)):
        chosen = values[finite] if labels is None else values[(labels == k) & finite]
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


class FloatRanges:
    """The float model's values by part at its tensors on some samples, measured once per
    tensor (tune asks again for every candidate, whose scales differ, never its ranges)."""

    def __init__(self, float_model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], path: str) -> None:
        self.model, self.samples, self.path = float_model, samples, path
        held = {o for node in float_model.graph.node for o in node.output}
        self.held = held | {i.name for i in float_model.graph.input}
        self.ranges: dict[str, list[tuple[float, float] | None]] = {}
        self.sources: dict[str, list[str | None]] = {}

    def levels(self, scales: dict[str, float]) -> dict[str, TensorLevels]:
        """Per tensor of ``scales`` (a quantized model's name: its scale), the levels of its
        worst part; tensors the float model does not hold, or whose parts never vary, are
        left out."""
        named = {t: float_name(t, self.held) for t in scales}
        missing = sorted({f for f in named.values() if f is not None and f not in self.ranges})
        if missing:
            ranges, sources = part_ranges(self.model, missing, self.samples, self.path)
            self.ranges.update(ranges)
            self.sources.update(sources)
        found: dict[str, TensorLevels] = {}
        for quantized, tensor in named.items():
            if tensor is None:
                continue
            worst = worst_levels(self.ranges[tensor], scales[quantized])
            if worst is not None:
                found[quantized] = TensorLevels(quantized, worst[0], worst[1], self.sources[tensor][worst[1]])
        return found


def tensor_levels(
    float_model: onnx.ModelProto,
    scales: dict[str, float],
    samples: list[dict[str, np.ndarray]],
    path: str,
) -> dict[str, TensorLevels]:
    """Per tensor of ``scales`` (its name in the quantized model: its scale), the levels of
    its worst part in ``float_model`` on ``samples`` (``FloatRanges.levels``)."""
    return FloatRanges(float_model, samples, path).levels(scales)


def output_tensors(quant_model: onnx.ModelProto) -> dict[str, str]:
    """``{quantized tensor: graph output}``: the tensors whose Q→DQ reaches a graph output
    directly or through the operators that only move elements."""
    producer = {out: node for node in quant_model.graph.node for out in node.output if out}
    found: dict[str, str] = {}
    for output in quant_model.graph.output:
        pending, seen = [output.name], set()
        while pending:
            tensor = pending.pop()
            node = producer.get(tensor)
            if node is None or tensor in seen:
                continue
            seen.add(tensor)
            if node.op_type == DEQUANTIZE:
                q = producer.get(node.input[0])
                if q is not None and q.op_type == QUANTIZE:
                    found.setdefault(q.input[0], output.name)
            elif node.op_type in PASS_THROUGH and node.domain in ("", "ai.onnx"):
                pending += [x for x in node.input if x] if node.op_type == "Concat" else node.input[:1]
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
