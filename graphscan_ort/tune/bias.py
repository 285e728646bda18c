"""Empirical bias correction (Nagel et al. 2019): a quantized model's variant, measured.

For every quantized Conv or Gemm (its weight read through a DequantizeLinear) with a
bias, the mean error of its output, quantized minus float, per output channel, over the
calibration samples, is subtracted from its bias: the error its integer weights (and bias)
add, ``E[(W_q - W) x]`` in Nagel's terms. The float output is a twin of the node holding the
weights of the same node (by name) in the prepared model the quantizer was given, reading
the same input in the same run of the quantized model. Correcting every node by the error
at its output in the whole model (quantized model against float model) instead counts each
upstream error again at every node below it: on a small residual CNN that lost 2 dB. All
nodes are corrected at once, from one pass over the samples. An int32 bias
(``DequantizeLinear(b_int, scale)``, onnxruntime's QDQ bias) moves by ``round(error /
scale)`` steps, a float bias by the error.

MatMul has no bias input: a MatMul's following Add is left alone. The correction changes
the float function by design, so the model is measured like any other candidate, never
verified against the original. It changes initializer values and nothing else, so the
corrected model runs the very kernels its parent runs: ``same_graph`` proves that of the two
files, and then the parent's timing stands for both (timing it again would only let noise
choose between them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import DEQUANTIZE, shown
from graphscan_ort.engines.combined import added_as_soon_as_ready
from graphscan_ort.shared.graph import default_opset, fresh_name, graph_names
from graphscan_ort.shared.sessions import does_not_run, impact_options, open_session

CORRECTED = ("Conv", "Gemm")
INT32_LIMITS = (np.iinfo(np.int32).min, np.iinfo(np.int32).max)


def biased_nodes(quantized: onnx.ModelProto, prepared: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The quantized Conv/Gemm nodes with a bias initializer (read directly or through a
    DequantizeLinear) that also stand in ``prepared`` under their name, their weights there
    initializers."""
    producers = {o: node for node in quantized.graph.node for o in node.output}
    constants = {init.name for init in quantized.graph.initializer}
    weights = {init.name for init in prepared.graph.initializer}
    float_names = {  # a twin needs the float node's weights as initializers
        node.name
        for node in prepared.graph.node
        if node.op_type in CORRECTED and all(name in weights for name in node.input[1:] if name)
    }
    found = []
    for node in quantized.graph.node:
        if node.op_type not in CORRECTED or node.domain not in ("", "ai.onnx") or node.name not in float_names:
            continue
        weight = producers.get(node.input[1]) if len(node.input) > 1 else None
        if weight is None or weight.op_type != DEQUANTIZE or len(node.input) < 3 or not node.input[2]:
            continue
        bias = producers.get(node.input[2])
        if node.input[2] in constants or (
            bias is not None and bias.op_type == DEQUANTIZE and bias.input[0] in constants
        ):
            found.append(node)
    return found


def mean_errors(
    quantized: onnx.ModelProto,
    prepared: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    samples: list[dict[str, np.ndarray]],
    path: str,
) -> dict[str, np.ndarray]:
    """Per node name, the mean of (quantized - float) output per output channel (axis 1)
    over ``samples`` and every other axis, in float64: the float output is a twin of the node
    with the prepared model's weights reading the same input, so each node's error is its
    weights' own (an upstream error is not counted again downstream). Summed inside
    onnxruntime (ErrorSums), so a run holds each node's output only until its sum is taken."""
    copy = onnx.ModelProto()
    copy.CopyFrom(quantized)
    twins, exposed = float_twins(copy, prepared, nodes)
    sums_model = ErrorSums(copy, twins, exposed)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    session = open_session(sums_model.model, f"{shown(path)}: model", sums_model.options)
    for feeds in samples:
        try:
            sample = session.run(sums_model.outputs, feeds)
        except Exception as exc:
            raise does_not_run(f"{shown(path)}: model", exc)
        for k, node in enumerate(nodes):
            total, shape = sample[2 * k], sample[2 * k + 1]  # shape: (N, channels, the rest)
            sums[node.name] = sums.get(node.name, 0.0) + np.asarray(total, np.float64)
            counts[node.name] = counts.get(node.name, 0) + int(shape[0]) * int(shape[2])
    return {name: sums[name] / counts[name] for name in sums if counts[name]}


class ErrorSums:
    """A copy of a quantized model (``model``, its float ``twins`` added) that sums each pair
    of ``exposed`` (a node's output, then its twin's) to ``sum(output - twin)`` per channel of
    axis 1 in float64, and gives the shape it summed, (N, channels, the rest): each sum right
    after its pair is made (onnxruntime's PRIORITY_BASED order, as levels.Reductions), so a
    run holds a few outputs at a time, not every node's and its twin's."""

    def __init__(self, model: onnx.ModelProto, twins: list[onnx.NodeProto], exposed: list[str]) -> None:
        self.pool = onnx.GraphProto()
        self.pool.node.extend(twins)  # each twin as soon as its input is made, its pair's sum right after both
        taken = set(graph_names(model.graph)) | {o for twin in twins for o in twin.output}
        self.prefix = fresh_name("bias/", taken)
        flat = self.constant(onnx.numpy_helper.from_array(np.array([0, 0, -1], np.int64)))
        new_reduce = default_opset(model) >= 13  # ReduceSum's axes: an input from opset 13, an attribute before
        axes = self.constant(onnx.numpy_helper.from_array(np.array([0, 2], np.int64))) if new_reduce else ""
        self.outputs: list[str] = []
        for output, twin in zip(exposed[::2], exposed[1::2], strict=True):
            doubles = [self.node("Cast", [name], to=onnx.TensorProto.DOUBLE) for name in (output, twin)]
            error = self.node("Reshape", [self.node("Sub", doubles), flat])
            if new_reduce:
                total = self.node("ReduceSum", [error, axes], keepdims=0)
            else:
                total = self.node("ReduceSum", [error], axes=[0, 2], keepdims=0)
            self.outputs += [total, self.node("Shape", [error])]
        self.model = added_as_soon_as_ready(model, self.pool, self.outputs)
        self.options = impact_options()
        self.options.execution_order = ort.ExecutionOrder.PRIORITY_BASED

    def node(self, op_type: str, inputs: list[str], **attributes: Any) -> str:
        output = f"{self.prefix}{len(self.pool.node)}/{op_type}"
        self.pool.node.append(onnx.helper.make_node(op_type, inputs, [output], name=output, **attributes))
        return output

    def constant(self, tensor: onnx.TensorProto) -> str:
        tensor.name = f"{self.prefix}constant/{len(self.pool.initializer)}"
        self.pool.initializer.append(tensor)
        return tensor.name


def float_twins(
    model: onnx.ModelProto, prepared: onnx.ModelProto, nodes: list[onnx.NodeProto]
) -> tuple[list[onnx.NodeProto], list[str]]:
    """For each of ``nodes``, a float twin (its float weights added to ``model`` as
    initializers) reading the node's own input; and the tensors to expose: each node's
    output, then its twin's."""
    float_nodes = {node.name: node for node in prepared.graph.node}
    float_inits = {init.name: init for init in prepared.graph.initializer}
    taken = set(graph_names(model.graph))
    twins, exposed = [], []
    for node in nodes:
        source = float_nodes[node.name]
        inputs = [node.input[0]]
        for name in source.input[1:]:
            fresh = fresh_name(f"{node.name}_float_{len(inputs)}", taken)
            init = onnx.TensorProto()
            init.CopyFrom(float_inits[name])
            init.name = fresh
            model.graph.initializer.append(init)
            inputs.append(fresh)
        twin = onnx.NodeProto()
        twin.CopyFrom(source)
        del twin.input[:], twin.output[:]
        twin.input.extend(inputs)
        twin.name = fresh_name(f"{node.name}_float", taken)
        twin.output.append(fresh_name(f"{node.name}_float_output", taken))
        twins.append(twin)
        exposed += [node.output[0], twin.output[0]]
    return twins, exposed


def bias_corrected(
    quantized: onnx.ModelProto,
    prepared: onnx.ModelProto,
    samples: list[dict[str, np.ndarray]],
    path: str,
) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """A copy of ``quantized`` with its biases corrected, and what was done:
    ``{"nodes": how many biases moved, "mean_shift": the mean |shift| in float units}``."""
    out = onnx.ModelProto()
    out.CopyFrom(quantized)
    nodes = biased_nodes(out, prepared)
    if not nodes or not samples:
        return out, {"nodes": 0, "mean_shift": 0.0}
    errors = mean_errors(out, prepared, nodes, samples, path)
    producers = {o: node for node in out.graph.node for o in node.output}
    initializers = {init.name: init for init in out.graph.initializer}
    readers: dict[str, int] = {}
    for node in out.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    moved, shifts = 0, []
    for node in nodes:
        error = errors.get(node.name)
        if error is None or not np.all(np.isfinite(error)):
            continue
        shift = corrected_bias(node, error, producers, initializers, readers)
        if shift is not None:
            moved += 1
            shifts.append(float(np.abs(shift).mean()))
    return out, {"nodes": moved, "mean_shift": float(np.mean(shifts)) if shifts else 0.0}


def corrected_bias(
    node: onnx.NodeProto,
    error: np.ndarray,
    producers: Mapping[str, onnx.NodeProto],
    initializers: Mapping[str, onnx.TensorProto],
    readers: Mapping[str, int],
) -> np.ndarray | None:
    """Subtract ``error`` from ``node``'s bias in place; the shift applied in float units
    (None: the bias is shared, or its shape does not match the channels)."""
    name = node.input[2]
    dequantize = producers.get(name)
    if dequantize is not None:  # DequantizeLinear(b_int, scale[, zero_point]): int32 steps
        name = dequantize.input[0]
        scale = onnx.numpy_helper.to_array(initializers[dequantize.input[1]]).astype(np.float64)
    else:
        scale = None
    init = initializers.get(name)
    if init is None or readers.get(name, 0) != 1 or (dequantize is not None and readers.get(node.input[2], 0) != 1):
        return None
    bias = onnx.numpy_helper.to_array(init)
    if bias.shape != error.shape:
        return None
    if scale is None:
        new = (bias.astype(np.float64) - error).astype(bias.dtype)
        shift = new.astype(np.float64) - bias
    else:
        steps = np.round(error / scale)
        new = np.clip(bias.astype(np.int64) - steps, *INT32_LIMITS).astype(bias.dtype)
        shift = (new.astype(np.float64) - bias) * scale
    init.CopyFrom(onnx.numpy_helper.from_array(new, name))
    return shift


def same_graph(model: onnx.ModelProto, other: onnx.ModelProto) -> bool:
    """Whether ``model`` and ``other`` differ at most in their initializers' values: the same
    nodes (operator, domain, name, inputs, outputs, attributes) in the same order, the same
    graph inputs, outputs, value infos and opsets, and the same initializers by name, type and
    shape. Such models make one session plan with the same kernels."""
    return skeleton(model) == skeleton(other)


def skeleton(model: onnx.ModelProto) -> bytes:
    """``model`` serialized with every top-level initializer reduced to its name, type and shape
    (its values, wherever stored, dropped; a subgraph's initializers are kept whole)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for init in copy.graph.initializer:
        init.CopyFrom(onnx.TensorProto(name=init.name, data_type=init.data_type, dims=init.dims))
    return copy.SerializeToString(deterministic=True)
