"""Levels: how many quantization steps a part of a tensor spans.

The *levels* of a part (shared/parts.py) at a quantized tensor are ``(max - min of the part's
float values) / the tensor's scale``: how many distinct int8 values the part can take. One
scale over a Concat of box pixels (0..320) and class probabilities (0..1) has a step of about
1.27, so the probabilities span 0.79 levels: every one becomes 0 or 1.27. A part below a
handful of levels has lost what it says, whatever the SQNR of the whole.

A part whose float values are all equal carries nothing to resolve and is left out; the
levels of a tensor are those of its worst part. A Q with a per-axis scale quantizes each
channel with its own step: a part spans ``(max - min of its values in channel c) / scale[c]``
there, and its levels are the fewest over the channels where it varies. A tensor that several
Qs read has the fewest levels any of them gives.

The float values are reduced inside onnxruntime: one copy of the float model takes every
tensor's sum and each of its parts' min and max right after the tensor is made, so a run holds
what the float model holds, plus scalars, one sample at a time. A tensor whose Q is per axis,
whose element type shape inference does not know, or whose values on a sample are not all
finite (its sum is not) is fetched and reduced in numpy instead, a few tensors per run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from graphscan import DEQUANTIZE, QUANTIZE
from graphscan_ort.engines.combined import added_as_soon_as_ready
from graphscan_ort.shared.graph import QDQ_SUFFIX, constant_arrays, element_types, with_outputs
from graphscan_ort.shared.parts import PASS_THROUGH, TensorParts
from graphscan_ort.shared.sessions import each_sample_outputs, session_options, shared_arena

# Below this many levels, tune warns that a part of the model it writes has lost its values.
LEVELS_FLOOR = 16.0
# Tensors fetched per run of a model where they are reduced in numpy (levels' ranges, impact's value statistics).
TENSORS_PER_RUN = 64
# Element types reduced inside onnxruntime, and the type they are reduced in (exact: a float16
# or bfloat16 value is a float32 value too).
REDUCED_IN: dict[int, int] = {
    TensorProto.FLOAT: TensorProto.FLOAT,
    TensorProto.DOUBLE: TensorProto.DOUBLE,
    TensorProto.FLOAT16: TensorProto.FLOAT,
    TensorProto.BFLOAT16: TensorProto.FLOAT,
}

# A float tensor, and the axis its ranges are taken per channel of (None: over all of it).
Key = tuple[str, int | None]
# A part's (min, max): floats over the whole tensor, float64 arrays per channel along an axis
# (a channel without a finite value: +inf, -inf). None: the part has no finite value.
Range = tuple[Any, Any]


@dataclasses.dataclass(frozen=True)
class Step:
    """The scale a QuantizeLinear gives a tensor: one (``axis`` None), or one per channel along ``axis``."""

    scale: tuple[float, ...]
    axis: int | None = None


@dataclasses.dataclass(frozen=True)
class TensorLevels:
    """A quantized tensor's worst part: its levels, its id and the node its values come from."""

    tensor: str
    levels: float
    part: int
    node: str | None


def quantized_activations(quant_model: onnx.ModelProto) -> dict[str, tuple[Step, ...]]:
    """``{tensor: steps}`` of every tensor a QuantizeLinear reads that is not a constant, its
    scale a constant: the largest per-tensor scale (the fewest levels) and each per-axis one."""
    constants = constant_arrays(quant_model.graph)
    per_tensor: dict[str, float] = {}
    per_axis: dict[str, list[Step]] = {}
    for node in quant_model.graph.node:
        if node.op_type != QUANTIZE or len(node.input) < 2 or node.input[0] in constants:
            continue
        scale = constants.get(node.input[1])
        if scale is None or scale.array.size == 0:
            continue
        magnitudes = np.abs(scale.array.astype(np.float64))
        tensor = node.input[0]
        per_tensor.setdefault(tensor, 0.0)
        if magnitudes.ndim == 1 and magnitudes.size > 1 and not attribute(node, "block_size", 0):
            per_axis.setdefault(tensor, []).append(Step(tuple(magnitudes.tolist()), attribute(node, "axis", 1)))
            continue
        value = float(np.max(magnitudes))  # a blocked scale: its largest block's
        if value > 0 and math.isfinite(value):
            per_tensor[tensor] = max(value, per_tensor[tensor])
    found = {}
    for tensor, largest in per_tensor.items():
        steps = ([Step((largest,))] if largest > 0 else []) + per_axis.get(tensor, [])
        if steps:
            found[tensor] = tuple(dict.fromkeys(steps))
    return found


def attribute(node: onnx.NodeProto, name: str, default: int) -> int:
    """An integer attribute of ``node``, or ``default`` when it has none."""
    return next((a.i for a in node.attribute if a.name == name and a.type == onnx.AttributeProto.INT), default)


def part_ranges(
    float_model: onnx.ModelProto, tensors: list[str], samples: list[dict[str, np.ndarray]], path: str
) -> tuple[dict[str, list[tuple[float, float] | None]], dict[str, list[str | None]]]:
    """Per tensor of ``float_model``, per part, ``(min, max)`` of its finite float values
    over ``samples`` (None: no finite value); and per tensor the node each part comes from."""
    ranges, sources = measured_ranges(float_model, [(t, None) for t in tensors], samples, path)
    return {t: ranges[(t, None)] for t in tensors}, sources


def measured_ranges(
    float_model: onnx.ModelProto,
    keys: list[Key],
    samples: list[dict[str, np.ndarray]],
    path: str,
    arena: bool = False,
) -> tuple[dict[Key, list[Range | None]], dict[str, list[str | None]]]:
    """Per key of ``keys``, per part of its tensor, the range of its finite float values over
    ``samples``; and per tensor the node each part comes from. Reduced inside onnxruntime where
    it can be (``Reductions``, in the process's shared arena with ``arena``), else in numpy."""
    types = element_types(float_model)
    reduced = [t for t, axis in dict.fromkeys(keys) if axis is None and types.get(t) in REDUCED_IN]
    parts = TensorParts(float_model, reduced)
    ranges: dict[Key, list[Range | None]] = {(t, None): [None] * len(parts.sources[t]) for t in reduced}
    unfinite: set[str] = set()
    if reduced:
        reductions = Reductions(float_model, reduced, parts, types, arena)
        for values in each_sample_outputs(reductions.model, samples, path, reductions.outputs, reductions.options):
            unfinite.update(reductions.widen(ranges, values))
    fetched = [k for k in dict.fromkeys(keys) if k not in ranges or k[0] in unfinite]
    found, sources = fetched_ranges(float_model, fetched, samples, path)
    ranges.update(found)
    return ranges, {**parts.sources, **sources}


class Reductions:
    """A copy of the float model that reduces ``tensors`` to their sum (finite only when every
    value is) and each part's min and max, each right after the tensor is made: onnxruntime
    runs the nodes in the order given (PRIORITY_BASED) and frees a tensor after its last reader.
    The session is impact's (the graph as written, no pre-packing: the float values are the ones
    impact and check see); with ``arena``, it allocates from onnxruntime's shared arena, which
    trace's combined model reuses after it, instead of leaving freed pages to the C heap."""

    def __init__(
        self, model: onnx.ModelProto, tensors: list[str], parts: TensorParts, types: Mapping[str, int], arena: bool
    ) -> None:
        self.pool = onnx.GraphProto()
        self.pool.node.extend(parts.nodes)  # the part ids of the tensors a Concat joined
        self.prefix = parts.name("levels/")
        self.outputs: list[str] = []
        self.layout: list[tuple[str, int]] = []  # per tensor: its name and number of parts
        for tensor in tensors:
            trace = parts.traces[tensor]
            self.reduce(tensor, REDUCED_IN[types[tensor]], types[tensor], trace.label, len(trace.sources))
        self.model = added_as_soon_as_ready(model, self.pool, self.outputs)
        config = {"session.disable_prepacking": "1"}
        if arena and shared_arena():
            config["session.use_env_allocators"] = "1"
        self.options = session_options(config=config, arena=False)
        self.options.execution_order = ort.ExecutionOrder.PRIORITY_BASED

    def node(self, op_type: str, inputs: list[str], **attributes: int) -> str:
        output = f"{self.prefix}{len(self.pool.node)}/{op_type}"
        node = helper.make_node(op_type, inputs, [output], name=output)
        node.attribute.extend(helper.make_attribute(key, value) for key, value in attributes.items())
        self.pool.node.append(node)
        return output

    def constant(self, value: float | int, elem_type: int) -> str:
        name = f"{self.prefix}constant/{len(self.pool.initializer)}"
        self.pool.initializer.append(helper.make_tensor(name, elem_type, [], [value]))
        return name

    def reduce(self, tensor: str, reduced_in: int, elem_type: int, label: str | None, count: int) -> None:
        """The nodes of one tensor: its sum, then (min, max) of each of its ``count`` parts."""
        values = tensor
        if reduced_in != elem_type:
            # onnxruntime runs a 16-bit op in float32 between Casts of its own and would merge
            # its Cast back to 16 bits with this one, skipping the rounding: the Identity keeps
            # the tensor as the model holds it (combined.py's as_double does the same).
            values = self.node("Cast", [self.node("Identity", [tensor])], to=reduced_in)
        self.outputs.append(self.node("ReduceSum", [values], keepdims=0))
        for part in range(count):
            if label is None:
                low, high = values, values
            else:  # the other parts' values made +inf for the min, -inf for the max
                mask = self.node("Equal", [label, self.constant(part, TensorProto.INT64)])
                low = self.node("Where", [mask, values, self.constant(math.inf, reduced_in)])
                high = self.node("Where", [mask, values, self.constant(-math.inf, reduced_in)])
            self.outputs += [self.node("ReduceMin", [low], keepdims=0), self.node("ReduceMax", [high], keepdims=0)]
        self.layout.append((tensor, count))

    def widen(self, ranges: dict[Key, list[Range | None]], values: list[np.ndarray]) -> list[str]:
        """Widen ``ranges`` by one sample's reductions; the tensors whose values were not all finite."""
        unfinite, at = [], 0
        for tensor, count in self.layout:
            total, extremes = float(values[at]), values[at + 1 : at + 1 + 2 * count]
            at += 1 + 2 * count
            if not math.isfinite(total):  # a min and max that onnxruntime took over NaN may be wrong
                unfinite.append(tensor)
                continue
            found = ranges[(tensor, None)]
            for part in range(count):
                lo, hi = float(extremes[2 * part]), float(extremes[2 * part + 1])
                if lo <= hi:  # else the part is empty: +inf, -inf
                    old = found[part]
                    found[part] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        return unfinite


def fetched_ranges(
    float_model: onnx.ModelProto, keys: list[Key], samples: list[dict[str, np.ndarray]], path: str
) -> tuple[dict[Key, list[Range | None]], dict[str, list[str | None]]]:
    """``measured_ranges`` in numpy: the tensors fetched TENSORS_PER_RUN per run of the float model."""
    tensors = list(dict.fromkeys(t for t, _ in keys))
    if not tensors:
        return {}, {}
    parts = TensorParts(float_model, tensors)
    ranges: dict[Key, list[Range | None]] = {k: [None] * len(parts.sources[k[0]]) for k in keys}
    axes: dict[str, list[int | None]] = {}
    for tensor, axis in keys:
        axes.setdefault(tensor, []).append(axis)
    for start in range(0, len(tensors), TENSORS_PER_RUN):
        chunk = tensors[start : start + TENSORS_PER_RUN]
        copy = with_outputs(float_model, chunk)
        for sample, values in zip(samples, each_sample_outputs(copy, samples, path, chunk), strict=True):
            labels = parts.labels(sample)
            for tensor, value in zip(chunk, values, strict=True):
                for axis in axes[tensor]:
                    widen(ranges[(tensor, axis)], np.asarray(value), labels[tensor], axis)
    return ranges, parts.sources


def widen(ranges: list[Range | None], values: np.ndarray, labels: np.ndarray | None, axis: int | None = None) -> None:
    """Widen each part's range by ``values`` (``labels``: their part ids; None: one part),
    per channel along ``axis`` when given."""
    if values.dtype.kind not in "f" or values.size == 0:
        return
    if axis is not None and not -values.ndim <= axis < values.ndim:
        return  # no such axis: no channel to measure
    finite = np.isfinite(values)
    for k in range(len(ranges)):
        chosen = finite if labels is None else (labels == k) & finite
        if axis is None:
            picked = values[chosen]
            if picked.size == 0:
                continue
            lo, hi = float(picked.min()), float(picked.max())
            old = ranges[k]
            ranges[k] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        else:
            channels = np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1).astype(np.float64)
            inside = np.moveaxis(np.broadcast_to(chosen, values.shape), axis, 0).reshape(channels.shape)
            if not inside.any():
                continue
            lows = np.where(inside, channels, math.inf).min(axis=1)
            highs = np.where(inside, channels, -math.inf).max(axis=1)
            old = ranges[k]
            ranges[k] = (lows, highs) if old is None else (np.minimum(old[0], lows), np.maximum(old[1], highs))


def worst_levels(ranges: list[Range | None], step: Step) -> tuple[float, int] | None:
    """``(levels, part)`` of the part spanning the fewest steps of ``step``; None when no
    part varies (per channel: in no channel of a valid scale)."""
    if step.axis is None:
        spans = [(hi - lo, k) for k, found in enumerate(ranges) if found is not None for lo, hi in [found] if hi > lo]
        if not spans:
            return None
        span, part = min(spans)  # over all: floats
        return span / step.scale[0], part
    scales = np.asarray(step.scale, dtype=np.float64)
    found_levels = []
    for k, found in enumerate(ranges):
        if found is None or np.shape(found[0]) != scales.shape:
            continue
        lo, hi = found
        varies = (hi > lo) & (scales > 0) & np.isfinite(scales)
        if varies.any():
            found_levels.append((float(np.min((hi - lo)[varies] / scales[varies])), k))
    return min(found_levels, default=None)


class FloatRanges:
    """The float model's values by part at its tensors on some samples, measured once per
    tensor (tune asks again for every candidate, whose scales differ, never its ranges)."""

    def __init__(
        self, float_model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], path: str, arena: bool = False
    ) -> None:
        self.model, self.samples, self.path, self.arena = float_model, samples, path, arena
        held = {o for node in float_model.graph.node for o in node.output}
        self.held = held | {i.name for i in float_model.graph.input}
        self.ranges: dict[Key, list[Range | None]] = {}
        self.sources: dict[str, list[str | None]] = {}

    def levels(
        self, steps: Mapping[str, Sequence[Step]], named: Mapping[str, str | None] | None = None
    ) -> dict[str, TensorLevels]:
        """Per tensor of ``steps`` (a quantized model's name: its steps), the levels of its
        worst part; ``named``: each one's float tensor (default: the same name, or without
        onnxruntime's suffix, ``float_name``). Tensors the float model does not hold, or whose
        parts never vary, are left out."""
        if named is None:
            named = {t: float_name(t, self.held) for t in steps}
        wanted = {(tensor, step.axis) for t, tensor in named.items() if tensor is not None for step in steps[t]}
        missing = sorted(wanted - self.ranges.keys(), key=lambda key: (key[0], -1 if key[1] is None else key[1]))
        if missing:
            ranges, sources = measured_ranges(self.model, missing, self.samples, self.path, self.arena)
            self.ranges.update(ranges)
            self.sources.update(sources)
        found: dict[str, TensorLevels] = {}
        for quantized, tensor in named.items():
            if tensor is None:
                continue
            measured = [worst_levels(self.ranges[(tensor, step.axis)], step) for step in steps[quantized]]
            worst = min((m for m in measured if m is not None), default=None)
            if worst is not None:
                found[quantized] = TensorLevels(quantized, worst[0], worst[1], self.sources[tensor][worst[1]])
        return found


def tensor_levels(
    float_model: onnx.ModelProto,
    steps: Mapping[str, Sequence[Step]],
    samples: list[dict[str, np.ndarray]],
    path: str,
    named: Mapping[str, str | None] | None = None,
    arena: bool = False,
) -> dict[str, TensorLevels]:
    """Per tensor of ``steps`` (its name in the quantized model: its steps), the levels of
    its worst part in ``float_model`` on ``samples`` (``FloatRanges.levels``)."""
    return FloatRanges(float_model, samples, path, arena).levels(steps, named)


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
