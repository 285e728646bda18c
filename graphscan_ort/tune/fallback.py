"""Float fallback that onnxruntime honours.

``nodes_to_exclude`` leaves a node's weights float and its own output unquantized,
but its input can still come from a DequantizeLinear and its output still go to a
QuantizeLinear (the neighbours' Q/DQ). For Conv, ConvTranspose, MatMul and Gemm a
default session then quantizes the float weight itself (onnxruntime's
``WeightBiasQuantization``) and runs the "excluded" node as an int8 kernel.

So every exclusion is checked with runtime's classes at the deployed level. A node
that still runs int8 gets its activation inputs unquantized: each input that is a
``DQ(Q(x))`` round trip is read from ``x`` itself (the post-step ``float_inputs``,
named in the row), and the model is checked again. Only where the node read ``x``,
made by the same node, in the model the quantizer was given: the quantizer removes a
Relu or Clip whose range its Q's clipping covers and gives the Relu's output name to
the node before it, so ``x`` can be the tensor before a Relu under the Relu's name,
and reading it would drop the Relu. A node that runs int8 even then is reported as such, and the
search does not keep it.
"""

from __future__ import annotations

import onnx

from graphscan import DEQUANTIZE, QUANTIZE, GraphscanError
from graphscan_ort.engines.classify import classify
from graphscan_ort.shared.graph import fresh_name, graph_names

# What an excluded node does in the deployed session: runs float as asked; runs
# float once its inputs are unquantized (float_inputs); runs int8 whatever tune does.
AS_EXCLUDED, WITH_FLOAT_INPUTS, STILL_INT8 = "float", "float_inputs", "int8"


# Activations the quantizer folds into a Q's clipping (removed, their output name given
# to the node before them): float_inputs applies them again to the float tensor.
FOLDED_INTO_Q = frozenset({"Relu", "Clip"})


def float_inputs(model: onnx.ModelProto, nodes: list[str], given: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` in which each node of ``nodes`` reads its activation inputs in
    float: an input that is a ``DQ(Q(x))`` round trip is read from ``x`` where it read
    ``x``, made by the same node, in ``given`` (the model the quantizer was given), or from
    a copy of ``given``'s Relu or Clip applied to ``x`` where the quantizer folded that
    activation into the Q. Q and DQ nodes left without a consumer are removed; the other
    consumers of a round trip keep it. Returns the copy and the nodes changed."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    graph = changed.graph
    producers = {output: node for node in graph.node for output in node.output}
    given_nodes = {node.name: node for node in given.graph.node}
    made_before = {output: node for node in given.graph.node for output in node.output}
    taken = set(graph_names(graph)) | set(graph_names(given.graph))
    inserted: dict[str, list[onnx.NodeProto]] = {}  # node name: the activations it now reads first
    changed_nodes = []
    for node in graph.node:
        if node.name not in nodes or node.name not in given_nodes:
            continue
        for k, tensor in enumerate(node.input):
            round_trip = round_trip_source(producers, tensor)
            if round_trip is None or k >= len(given_nodes[node.name].input):
                continue
            x, read_before = round_trip, given_nodes[node.name].input[k]
            maker = producers[x].name if x in producers else None
            before = made_before.get(read_before)
            if read_before == x and (before.name if before is not None else None) == maker:
                node.input[k] = x  # the very tensor it read
            elif before is not None and before.op_type in FOLDED_INTO_Q and folded_input(before, made_before) == maker:
                constants = activation_constants(before, graph, given.graph)
                if constants is None:  # its min or max is computed: it cannot be copied alone
                    continue
                graph.initializer.extend(constants)
                again = onnx.NodeProto()
                again.CopyFrom(before)
                again.name = fresh_name(f"{before.name}/float", taken)
                again.input[0] = x
                again.output[:] = [fresh_name(f"{read_before}/float", taken)]
                inserted.setdefault(node.name, []).append(again)
                node.input[k] = again.output[0]
            else:
                continue
            if node.name not in changed_nodes:
                changed_nodes.append(node.name)
    if inserted:
        order = [n for node in graph.node for n in [*inserted.get(node.name, []), node]]
        del graph.node[:]
        graph.node.extend(order)
    remove_unused_round_trips(graph)
    return changed, changed_nodes


def activation_constants(
    activation: onnx.NodeProto, graph: onnx.GraphProto, given: onnx.GraphProto
) -> list[onnx.TensorProto] | None:
    """The initializers of ``given`` that ``activation`` (a Clip's min and max) reads and
    ``graph`` lacks (the quantizer drops those of the Clip it folds); None when one of its
    inputs is neither in ``graph`` nor an initializer of ``given``."""
    present = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    present |= {i.name for i in graph.input}
    initializers = {t.name: t for t in given.initializer}
    missing = []
    for tensor in activation.input[1:]:
        if not tensor or tensor in present:
            continue
        if tensor not in initializers:
            return None
        copy = onnx.TensorProto()
        copy.CopyFrom(initializers[tensor])
        missing.append(copy)
        present.add(tensor)
    return missing


def round_trip_source(producers: dict[str, onnx.NodeProto], tensor: str) -> str | None:
    """``x`` when ``tensor`` is ``DQ(Q(x))``, else None."""
    dequantize = producers.get(tensor)
    if dequantize is None or dequantize.op_type != DEQUANTIZE:
        return None
    quantize = producers.get(dequantize.input[0])
    if quantize is None or quantize.op_type != QUANTIZE:
        return None
    return quantize.input[0]


def folded_input(activation: onnx.NodeProto, made_before: dict[str, onnx.NodeProto]) -> str | None:
    """The name of the node that made ``activation``'s input in the given model."""
    maker = made_before.get(activation.input[0]) if activation.input else None
    return maker.name if maker is not None else None


def remove_unused_round_trips(graph: onnx.GraphProto) -> None:
    """Remove Q and DQ nodes whose outputs nothing reads (repeated: a DQ's Q goes next),
    then the scales and zero points only they read."""
    left_behind: set[str] = set()
    while True:
        read = {tensor for node in graph.node for tensor in node.input} | {o.name for o in graph.output}
        unused = [
            node
            for node in graph.node
            if node.op_type in (QUANTIZE, DEQUANTIZE) and not any(output in read for output in node.output)
        ]
        if not unused:
            break
        for node in unused:
            left_behind.update(node.input[1:])
            graph.node.remove(node)
    read = {tensor for node in graph.node for tensor in node.input} | {o.name for o in graph.output}
    for initializer in [t for t in graph.initializer if t.name in left_behind and t.name not in read]:
        graph.initializer.remove(initializer)


def int8_nodes(
    model: onnx.ModelProto, path: str, level: str, nodes: list[str], optimized: onnx.ModelProto | None = None
) -> list[str]:
    """The nodes of ``nodes`` that run an int8 kernel in a session at ``level`` (``optimized``:
    the graph such a session saved already, as classify takes it)."""
    wanted = set(nodes)
    rows = classify(model, path, level=level, optimized=optimized).rows
    return [row["node"] for row in rows if row["node"] in wanted and row["class"] in ("int8", "int8_data")]


def honoured(
    model: onnx.ModelProto,
    path: str,
    level: str,
    excluded: list[str],
    given: onnx.ModelProto,
    optimized: onnx.ModelProto | None = None,
) -> tuple[onnx.ModelProto, dict[str, str], list[str]]:
    """``model`` (``given`` quantized with ``excluded`` in nodes_to_exclude, written at
    ``path``) with its exclusions made real where they were not: the model to deploy
    (rewritten at ``path`` when it changed), what each excluded node does there, and the
    nodes the post-step ``float_inputs`` was applied to; ``optimized``: the graph a session
    of ``model`` at ``level`` saved already."""
    status = dict.fromkeys(excluded, AS_EXCLUDED)
    quantized = int8_nodes(model, path, level, excluded, optimized)
    if not quantized:
        return model, status, []
    fixed, changed = float_inputs(model, quantized, given)
    still = set(quantized) - set(changed)
    if changed:
        onnx.save(fixed, path)
        try:
            still |= set(int8_nodes(fixed, path, level, changed))
        except GraphscanError:  # the rewritten model does not run: the exclusion stays as it was
            onnx.save(model, path)
            return model, {**status, **dict.fromkeys(quantized, STILL_INT8)}, []
    for node in quantized:
        status[node] = STILL_INT8 if node in still else WITH_FLOAT_INPUTS
    return (fixed if changed else model), status, changed
