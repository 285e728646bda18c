"""Float fallback that onnxruntime honours.

``nodes_to_exclude`` leaves a node's weights float and its own output unquantized,
but its input can still come from a DequantizeLinear and its output still go to a
QuantizeLinear (the neighbours' Q/DQ). For Conv, ConvTranspose, MatMul and Gemm a
default session then quantizes the float weight itself (onnxruntime's
``WeightBiasQuantization``) and runs the "excluded" node as an int8 kernel.

So every exclusion is checked with runtime's classes at the deployed level. A node
that still runs int8 gets its activation inputs unquantized: each input that is a
``DQ(Q(x))`` round trip is read from ``x`` itself (the post-step ``float_inputs``,
named in the row), and the model is checked again. A node that runs int8 even then
is reported as such, and the search does not keep it.
"""

from __future__ import annotations

import onnx

from graphscan import DEQUANTIZE, QUANTIZE
from graphscan_ort.engines.classify import classify

# What an excluded node does in the deployed session: runs float as asked; runs
# float once its inputs are unquantized (float_inputs); runs int8 whatever tune does.
AS_EXCLUDED, WITH_FLOAT_INPUTS, STILL_INT8 = "float", "float_inputs", "int8"


def float_inputs(model: onnx.ModelProto, nodes: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` in which each node of ``nodes`` reads every activation input
    that is a ``DQ(Q(x))`` round trip from ``x``; Q and DQ nodes left without a
    consumer are removed. The other consumers of the round trip keep it."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    graph = changed.graph
    producers = {output: node for node in graph.node for output in node.output}
    wanted = set(nodes)
    for node in graph.node:
        if node.name not in wanted:
            continue
        for k, tensor in enumerate(node.input):
            dequantize = producers.get(tensor)
            if dequantize is None or dequantize.op_type != DEQUANTIZE:
                continue
            quantize = producers.get(dequantize.input[0])
            if quantize is not None and quantize.op_type == QUANTIZE:
                node.input[k] = quantize.input[0]
    remove_unused_round_trips(graph)
    return changed


def remove_unused_round_trips(graph: onnx.GraphProto) -> None:
    """Remove Q and DQ nodes whose outputs nothing reads (repeated: a DQ's Q goes next)."""
    while True:
        read = {tensor for node in graph.node for tensor in node.input} | {o.name for o in graph.output}
        unused = [
            node
            for node in graph.node
            if node.op_type in (QUANTIZE, DEQUANTIZE) and not any(output in read for output in node.output)
        ]
        if not unused:
            return
        for node in unused:
            graph.node.remove(node)


def int8_nodes(model: onnx.ModelProto, path: str, level: str, nodes: list[str]) -> list[str]:
    """The nodes of ``nodes`` that run an int8 kernel in a session at ``level``."""
    wanted = set(nodes)
    rows = classify(model, path, level=level).rows
    return [row["node"] for row in rows if row["node"] in wanted and row["class"] in ("int8", "int8_data")]


def honoured(
    model: onnx.ModelProto, path: str, level: str, excluded: list[str]
) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
    """``model`` (quantized with ``excluded`` in nodes_to_exclude, written at ``path``) with
    its exclusions made real where they were not: the model to deploy (rewritten at
    ``path`` when it changed), what each excluded node does there, and the nodes the
    post-step ``float_inputs`` was applied to."""
    status = dict.fromkeys(excluded, AS_EXCLUDED)
    quantized = int8_nodes(model, path, level, excluded)
    if not quantized:
        return model, status, []
    fixed = float_inputs(model, quantized)
    onnx.save(fixed, path)
    still = set(int8_nodes(fixed, path, level, quantized))
    for node in quantized:
        status[node] = STILL_INT8 if node in still else WITH_FLOAT_INPUTS
    return fixed, status, quantized
