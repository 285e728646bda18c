"""Reading and editing ONNX graphs: names, constants, element types, a Q's range."""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx

from graphscan import as_text, subgraphs


def declared_values(graph: onnx.GraphProto) -> Iterator[onnx.ValueInfoProto]:
    """Every value ``graph`` declares a type for: its inputs, value_info and outputs, in that
    order (a later declaration of a name is the one the tables built from it keep)."""
    return itertools.chain(graph.input, graph.value_info, graph.output)


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
    prefixes = (f"{base}." if k == 0 else f"{base}~{k}." for k in itertools.count())
    return first_free(prefixes, lambda prefix: any(name.startswith(prefix) for name in names))


def fresh_name(wanted: str, taken: set[str]) -> str:
    """``wanted``, or ``wanted_1``, ``wanted_2``, ...: a name not in ``taken`` (a set
    of every tensor and node name), which it joins."""
    name = first_free((wanted if k == 0 else f"{wanted}_{k}" for k in itertools.count()), taken.__contains__)
    taken.add(name)
    return name


def first_free(candidates: Iterator[str], is_taken: Callable[[str], bool]) -> str:
    """The first of ``candidates`` that is not taken: the one scheme behind every
    name graphscan adds to a model (fresh names and prefixes, runtime's unique node names)."""
    return next(candidate for candidate in candidates if not is_taken(candidate))


def with_outputs(
    model: onnx.ModelProto, tensors: list[str], nodes: list[onnx.NodeProto] | None = None
) -> onnx.ModelProto:
    """A copy of ``model`` (``nodes`` appended) whose outputs are ``tensors``, inner ones
    included, declared by name alone: onnxruntime infers their types."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.graph.node.extend(nodes or [])
    del copy.graph.output[:]
    copy.graph.output.extend(onnx.ValueInfoProto(name=t) for t in tensors)
    return copy


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
    for info in declared_values(graph):
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    return types


def constant_arrays(graph: onnx.GraphProto) -> dict[str, LazyArray]:
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

    def __init__(self, proto: onnx.TensorProto) -> None:
        self.proto = proto

    @functools.cached_property
    def array(self) -> np.ndarray:
        return onnx.numpy_helper.to_array(self.proto)


def quant_range(q_node: onnx.NodeProto, constants: Mapping[str, LazyArray]) -> tuple[float, float, int] | None:
    """``(lo, hi, scale's elem_type)``: the float range a Q can represent
    (``representable_range``), or None when its scale or zero point is not a
    scalar of ``constants`` (``{name: LazyArray}``: trace reads initializers only,
    impact Constant nodes too). The one reader of a Q's range."""
    scale = constants.get(q_node.input[1]) if len(q_node.input) > 1 else None
    if scale is None or scale.array.size != 1:
        return None
    named_zero = len(q_node.input) > 2 and q_node.input[2]
    zero = constants.get(q_node.input[2]) if named_zero else None
    if named_zero and (zero is None or zero.array.size != 1):  # computed, or per channel
        return None
    zp = float(zero.array.reshape(-1)[0]) if zero is not None else 0.0
    q_type = q_output_type(q_node, zero.proto.data_type if zero is not None else None)
    bounds = representable_range(float(np.float64(scale.array.reshape(-1)[0])), zp, q_type)
    return None if bounds is None else (*bounds, scale.proto.data_type)


# --------------------------------------------------------------------------
# The QDQ vocabulary every command reads a quantized graph with


# The suffixes onnxruntime's quantizer gives the tensors around a Q/DQ pair.
QDQ_SUFFIX = re.compile(r"_(?:QuantizeLinear_Input|QuantizeLinear_Output|DequantizeLinear_Output)(?:_\d+)?$")


DQ_OUTPUT_SUFFIX = re.compile(r"_DequantizeLinear_Output(?:_\d+)?$")


# Representable range of each integer type a QuantizeLinear can produce.
Q_RANGES: dict[int, tuple[int, int]] = {
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT16: (-32768, 32767),
    onnx.TensorProto.UINT16: (0, 65535),
    onnx.TensorProto.INT4: (-8, 7),
    onnx.TensorProto.UINT4: (0, 15),
}


def q_output_type(q_node: onnx.NodeProto, zero_point_type: int | None) -> int:
    """The integer type a Q makes: its zero point's, else its ``output_dtype``, else UINT8."""
    if zero_point_type is not None:
        return zero_point_type
    declared = [a.i for a in q_node.attribute if a.name == "output_dtype" and a.type == onnx.AttributeProto.INT and a.i]
    return declared[0] if declared else onnx.TensorProto.UINT8


def representable_range(scale: float, zero_point: float, q_type: int) -> tuple[float, float] | None:
    """``((qmin - zp) * s, (qmax - zp) * s)``: the float values a per-tensor Q of
    ``q_type`` represents; None for a type that is not an integer one."""
    if q_type not in Q_RANGES:
        return None
    qmin, qmax = Q_RANGES[q_type]
    return (qmin - zero_point) * scale, (qmax - zero_point) * scale


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def first_output(node: onnx.NodeProto) -> str:
    """The first output a node writes ("" when it writes none): optional ones may be left out."""
    return next((t for t in node.output if t), "")


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every tensor name ``node`` reads: its inputs, then its bodies' reads at any
    depth (their outer-scope reads among them, and a body output may name an
    outer value too)."""
    names = [t for t in node.input if t]
    if not len(node.attribute):
        return names
    for body in subgraphs(node):
        for inner in body.node:
            names.extend(node_reads(inner))
        names.extend(o.name for o in body.output)
    return names


def body_reads(node: onnx.NodeProto) -> set[str]:
    """Every name the If/Loop/Scan bodies of ``node`` read or output (any depth)."""
    return set(node_reads(node)[len([t for t in node.input if t]) :])


def dense_initializer(sparse: onnx.SparseTensorProto) -> onnx.TensorProto:
    """A sparse initializer as the dense tensor it stands for, under its name: a model
    cut into segments lists the initializers each segment reads, and they are dense."""
    from onnx import numpy_helper

    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dims = tuple(sparse.dims)
    if indices.ndim == 2:  # one row of coordinates per value, not linear positions
        indices = np.ravel_multi_index(tuple(indices.T), dims)
    dense = np.zeros(math.prod(dims), dtype=values.dtype)
    dense[indices] = values
    return numpy_helper.from_array(dense.reshape(dims), sparse.values.name)
