"""Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization"): a prepare step.

Two Convs joined by an activation that commutes with a positive per-channel scale,
``Conv1 -> Relu -> Conv2``, compute the same function when output channel ``i`` of Conv1
(its weight row and bias) is divided by ``s_i`` and input channel ``i`` of Conv2 is
multiplied by ``s_i``. With ``r1_i`` the largest ``|W1|`` of row ``i`` and ``r2_i`` the
largest ``|W2|`` of input channel ``i`` (over every output channel that reads it),

    s_i = sqrt(r1_i * r2_i) / r2_i

makes both ranges ``sqrt(r1_i * r2_i)``: per-tensor weights (one scale for every channel)
lose less to the channel with the widest range. Chains of three or more Convs are passed
over until the scales settle (EQUALIZE_PASSES at most).

What may join the two Convs: nothing (a linear chain), Relu, LeakyRelu, PRelu (all
positively homogeneous: ``f(x / s) = f(x) / s`` for ``s > 0``), and Clip only with a lower
bound of 0 or none and no upper bound: Relu6 = Clip(0, 6) would need the bound ``6 * s_i``
per channel, which Clip's scalar bound cannot hold, so Relu6 chains are left alone.
Grouped and depthwise Convs are scaled group by group (Conv2's input channel ``c`` is
column ``c mod (C / group)`` of the output channels of group ``c // (C / group)``);
dilations, strides and pads play no part (zero padding commutes with the scale). Each
Conv's weight (and Conv1's bias) must be an initializer that no other node reads, and the
tensors between the two Convs must have no other reader and be no graph output.

The step is verified against the original like every prepare step (prepare.py).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx

from graphscan_ort.shared.graph import FLOAT_TYPES

EQUALIZE_PASSES = 16  # passes over the pairs; a chain's scales settle in a few
SETTLED = 1e-3  # a pass whose scales are all within this of 1 changes nothing worth another

# Operators between the two Convs that commute with a positive per-channel scale.
HOMOGENEOUS = ("Relu", "LeakyRelu", "PRelu")


def equalized(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with every Conv pair equalized, and how many pairs changed."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    pairs = conv_pairs(graph)
    if not pairs:
        return out, 0
    initializers = {init.name: init for init in graph.initializer}
    arrays = {name: onnx.numpy_helper.to_array(initializers[name]).astype(np.float64) for name in weight_names(pairs)}
    changed: set[int] = set()
    for _ in range(EQUALIZE_PASSES):
        moved = False
        for k, (first, second) in enumerate(pairs):
            scales = pair_scales(arrays[first.input[1]], arrays[second.input[1]], group_of(second))
            if scales is None or np.all(np.abs(scales - 1.0) <= SETTLED):
                continue
            apply_scales(arrays, first, second, scales)
            changed.add(k)
            moved = True
        if not moved:
            break
    for name, array in arrays.items():
        init = initializers[name]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
        init.CopyFrom(onnx.numpy_helper.from_array(array.astype(dtype), name))
    return out, len(changed)


def weight_names(pairs: list[tuple[onnx.NodeProto, onnx.NodeProto]]) -> set[str]:
    """Every initializer the equalization scales: both weights and Conv1's bias."""
    names = set()
    for first, second in pairs:
        names |= {first.input[1], second.input[1]}
        if len(first.input) > 2 and first.input[2]:
            names.add(first.input[2])
    return names


def group_of(node: onnx.NodeProto) -> int:
    """A Conv's ``group`` attribute (1 when absent)."""
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def pair_scales(first: np.ndarray, second: np.ndarray, group: int) -> np.ndarray | None:
    """``s_i`` per channel between a Conv weight ``first`` ([C, ...]) and the next Conv's
    ``second`` ([M, C / group, ...]); None when their shapes do not join."""
    channels = first.shape[0]
    per_group = second.shape[1] if second.ndim > 1 else 0
    if per_group * group != channels or second.shape[0] % group:
        return None
    r1 = np.abs(first.reshape(channels, -1)).max(axis=1)
    r2 = input_ranges(second, group)
    scales = np.ones(channels)
    usable = (r1 > 0) & (r2 > 0) & np.isfinite(r1) & np.isfinite(r2)
    scales[usable] = np.sqrt(r1[usable] * r2[usable]) / r2[usable]
    return scales


def input_ranges(weight: np.ndarray, group: int) -> np.ndarray:
    """The largest ``|W|`` per input channel of a Conv weight [M, C / group, ...]: input
    channel ``c`` is column ``c % (C / group)`` of group ``c // (C / group)``'s outputs."""
    outputs, per_group = weight.shape[0], weight.shape[1]
    blocks = np.abs(weight).reshape(group, outputs // group, per_group, -1)
    return blocks.max(axis=(1, 3)).reshape(group * per_group)


def apply_scales(
    arrays: dict[str, np.ndarray], first: onnx.NodeProto, second: onnx.NodeProto, scales: np.ndarray
) -> None:
    """Divide Conv1's rows (and bias) by ``scales``, multiply Conv2's input channels by them."""
    w1 = arrays[first.input[1]]
    arrays[first.input[1]] = w1 / scales.reshape((-1,) + (1,) * (w1.ndim - 1))
    if len(first.input) > 2 and first.input[2]:
        arrays[first.input[2]] = arrays[first.input[2]] / scales
    w2 = arrays[second.input[1]]
    group, outputs, per_group = group_of(second), w2.shape[0], w2.shape[1]
    by_group = scales.reshape(group, 1, per_group, *(1,) * (w2.ndim - 2))
    blocks = w2.reshape(group, outputs // group, per_group, *w2.shape[2:]) * by_group
    arrays[second.input[1]] = blocks.reshape(w2.shape)


def conv_pairs(graph: onnx.GraphProto) -> list[tuple[onnx.NodeProto, onnx.NodeProto]]:
    """``(Conv1, Conv2)`` joined as the module docstring says, in graph order."""
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    outputs = {o.name for o in graph.output}
    floats = {init.name for init in graph.initializer if init.data_type in FLOAT_TYPES}

    def owned(name: str, node: onnx.NodeProto) -> bool:  # an initializer only ``node`` reads
        return name in floats and all(reader is node for reader in readers[name])

    def scalable(node: onnx.NodeProto) -> bool:
        if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            return False
        bias = node.input[2] if len(node.input) > 2 else ""
        return owned(node.input[1], node) and (not bias or owned(bias, node))

    def only_reader(tensor: str) -> onnx.NodeProto | None:
        found = readers.get(tensor, [])
        return found[0] if len(found) == 1 and tensor not in outputs else None

    pairs = []
    for node in graph.node:
        if not scalable(node):
            continue
        after = only_reader(node.output[0])
        if after is not None and passes_scale(after, graph):
            after = only_reader(after.output[0])
        if after is not None and scalable(after):
            pairs.append((node, after))
    return pairs


def passes_scale(node: onnx.NodeProto, graph: onnx.GraphProto) -> bool:
    """Whether ``node`` commutes with a positive per-channel scale on its first input."""
    if node.domain not in ("", "ai.onnx") or not node.output:
        return False
    if node.op_type in HOMOGENEOUS:  # PRelu(x / s) = PRelu(x) / s whatever its slope per channel
        return True
    if node.op_type == "Clip":
        low, high = clip_bounds(node, graph)
        return low in (0.0, None) and high is None
    return False


def clip_bounds(node: onnx.NodeProto, graph: onnx.GraphProto) -> tuple[float | None, float | None]:
    """A Clip's ``(min, max)`` as scalars (None: absent); ``(nan, nan)`` when not constant scalars."""
    attributes = {a.name: a.f for a in node.attribute}
    if "min" in attributes or "max" in attributes:  # before opset 11
        return finite_bounds(attributes.get("min"), attributes.get("max"))
    constants = {init.name: init for init in graph.initializer}
    bounds: list[float | None] = []
    for position in (1, 2):
        name = node.input[position] if len(node.input) > position else ""
        if not name:
            bounds.append(None)
            continue
        if name not in constants:
            return float("nan"), float("nan")
        value = onnx.numpy_helper.to_array(constants[name])
        if value.size != 1:
            return float("nan"), float("nan")
        bounds.append(float(value.reshape(())))
    return finite_bounds(*bounds)


def finite_bounds(low: float | None, high: float | None) -> tuple[float | None, float | None]:
    """Clip's bounds with float32's extremes (its defaults) read as absent."""
    biggest = float(np.finfo(np.float32).max)
    return (None if low is None or low <= -biggest else low), (None if high is None or high >= biggest else high)
