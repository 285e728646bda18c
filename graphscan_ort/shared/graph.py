"""Reading and editing ONNX graphs: names, constants, element types, a Q's range."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import numpy as np
import onnx

from graphscan import (
    as_text,
    q_output_type,
    representable_range,
    subgraphs,
)


def graph_names(graph: onnx.GraphProto) -> Iterator[str]:
    """Every name in ``graph`` and its If/Loop/Scan bodies: nodes, tensors, inputs, outputs, initializers."""
    for node in graph.node:
        yield node.name
        yield from node.input
        yield from node.output
        for body in subgraphs(node):
            yield from graph_names(body)
    for info in itertools.chain(graph.input, graph.output, graph.value_info):
        yield info.name
    for init in graph.initializer:
        yield init.name
    for sparse in graph.sparse_initializer:
        yield sparse.values.name


def fresh_prefix(*models: onnx.ModelProto, base: str = "graphscan") -> str:
    """``graphscan.``, or ``graphscan~1.``, ``graphscan~2.``, ...: the first prefix
    no name in ``models`` starts with, so no name graphscan derives can be one
    the models already use (a node named ``graphscan.where/x`` changed impact's answer)."""
    names = {as_text(name) for model in models for name in graph_names(model.graph)}
    prefix, k = f"{base}.", 0
    while any(name.startswith(prefix) for name in names):
        k += 1
        prefix = f"{base}~{k}."
    return prefix


def fresh_name(wanted: str, taken: set[str]) -> str:
    """``wanted``, or ``wanted_1``, ``wanted_2``, ...: a name no tensor or node has yet."""
    name, k = wanted, 0
    while name in taken:
        k += 1
        name = f"{wanted}_{k}"
    taken.add(name)
    return name


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}


def element_types(model: onnx.ModelProto) -> dict[str, int]:
    """``{tensor: element type}`` as onnx's shape inference knows them (what it cannot, left out)."""
    try:
        typed = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        typed = model
    graph = typed.graph
    types = {init.name: init.data_type for init in graph.initializer}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    return types


def constant_arrays(graph):
    """``{tensor: LazyArray}`` for initializers and Constant nodes with a ``value``."""
    arrays = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for attribute in node.attribute:
                if attribute.name == "value":
                    arrays[node.output[0]] = attribute.t
    return {name: LazyArray(proto) for name, proto in arrays.items()}


class LazyArray:
    """A TensorProto turned into numpy only when asked (most are never read)."""

    def __init__(self, proto):
        self.proto = proto

    @functools.cached_property
    def array(self):
        return onnx.numpy_helper.to_array(self.proto)


def quant_range(q_node, constants):
    """``(lo, hi, scale's elem_type)``: the float range a Q can represent
    (``representable_range``), or None when its scale or zero point is not a
    scalar constant."""
    scale = constants.get(q_node.input[1]) if len(q_node.input) > 1 else None
    if scale is None or scale.array.size != 1:
        return None
    zero = constants.get(q_node.input[2]) if len(q_node.input) > 2 and q_node.input[2] else None
    if zero is not None and zero.array.size != 1:
        return None
    zp = float(zero.array.reshape(-1)[0]) if zero is not None else 0.0
    q_type = q_output_type(q_node, zero.proto.data_type if zero is not None else None)
    bounds = representable_range(float(np.float64(scale.array.reshape(-1)[0])), zp, q_type)
    return None if bounds is None else (*bounds, scale.proto.data_type)
