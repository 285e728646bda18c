"""The kernel vocabulary of onnxruntime's optimized graph: which kernels are integer, the QDQ fusions, tensor types."""

from __future__ import annotations

import re
from typing import Any

import onnx

from graphscan import DEQUANTIZE, QUANTIZE, GraphIndex
from graphscan_ort.shared.graph import Q_RANGES, declared_values

# The classes of the runtime answer: what a compute node runs as (docs/SPEC.md).
RUNTIME_CLASSES = ["int8", "int8_data", "float", "absorbed"]
TIME_CLASSES = ["int8", "int8_data", "float", "quantize", "dequantize"]


# Providers that run one kernel per node, so their optimized graph maps back
# to the model's nodes. Providers that compile subgraphs into one opaque
# kernel (TensorRT, OpenVINO, QNN, CoreML, ...) cannot answer per node.
PER_NODE_PROVIDERS = {"CPUExecutionProvider", "CUDAExecutionProvider", "DmlExecutionProvider", "ROCMExecutionProvider"}


# Kernels that compute on integers.
INT8_KERNELS = {
    "QGemm",
    "MatMulInteger",
    "ConvInteger",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
    "QAttention",
    "QEmbedLayerNormalization",
    "DynamicQuantizeLSTM",
    "MatMulNBits",
}


QUANTIZE_KERNELS = {QUANTIZE, "DynamicQuantizeLinear"}


# Integer element types that quantized data is stored in.
QUANTIZED_TYPES = set(Q_RANGES)


# onnxruntime's CPU QDQ fusions (qdq_selector_action_transformer.cc, 1.32):
# op types whose DQ -> op -> Q group can become an integer kernel or drop its
# Q/DQ. Any other wrapped op type keeps a float kernel on this provider.
# fmt: off
QDQ_FUSIONS = {
    "CPUExecutionProvider": {
        "AveragePool", "LeakyRelu", "GlobalAveragePool", "Sigmoid", "Softmax",  # QLinear unary
        "Add", "Mul", "Concat", "Conv", "MatMul", "Gemm", "Where", "Split",
        "Resize", "MaxPool", "ReduceMax", "ReduceMin", "Expand", "Flatten", "Gather",  # Q/DQ dropped
        "GatherElements", "Reshape", "Slice", "Squeeze", "Tile", "Transpose", "Unsqueeze", "ArgMax",
    },
}


# fmt: on
# Ops whose fused kernel takes int8 weights beside uint8 activations: the
# weight operand does not count when operand types are compared.
WEIGHT_OPERANDS = {"Conv": {1, 2}, "MatMul": {1}, "Gemm": {1, 2}}


# Fusions that take int8 activations only with session.qdqisint8allowed=1
# (onnxruntime's ConvSelector and MatMulSelector; QGemm takes them always).
INT8_GATED_FUSIONS = {"Conv", "MatMul"}


# Layout nodes onnxruntime inserts between a kernel and the tensor it makes.
LAYOUT_KERNELS = {"ReorderOutput", "ReorderInput"}


ORT_NAME_SUFFIX = re.compile(r"(?:_token_\d+|_nchwc|/[A-Za-z0-9]*Fusion/?|/duplicated)$")


def strip_ort_suffixes(name: str) -> str:
    """A node name without the suffixes onnxruntime appends when it rewrites a node."""
    while True:
        stripped = ORT_NAME_SUFFIX.sub("", name)
        if stripped == name:
            return name
        name = stripped


class OptimizedGraph:
    """The optimized graph with the lookups the mapping needs, and its tensor types."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.index = GraphIndex(graph)
        self.by_name: dict[str, int] = {}
        self.by_stripped: dict[str, list[int]] = {}
        for i, node in enumerate(graph.node):
            self.by_name.setdefault(node.name, i)
            self.by_stripped.setdefault(strip_ort_suffixes(node.name), []).append(i)
        self.types = tensor_types(graph)

    def op_type(self, i: int) -> str:
        return self.index.op_types[i]

    def kernel_producer(self, tensor: str) -> int | None:
        """The node making ``tensor``, looking through inserted layout nodes."""
        producer = self.index.producer_of(tensor)
        while producer is not None and self.op_type(producer) in LAYOUT_KERNELS:
            producer = self.index.producer_of(self.graph.node[producer].input[0])
        return producer

    def element_type(self, tensor: str) -> int:
        return self.types.get(tensor, onnx.TensorProto.UNDEFINED)


def tensor_types(graph: onnx.GraphProto) -> dict[str, int]:
    """``{tensor: element type}`` for the optimized graph.

    onnxruntime saves value_info for most float tensors but not for the
    integer tensors its Q/DQ rewrites make, so those are derived here: a Q
    makes its zero point's type, integer kernels keep their first input's.
    """
    types = {}
    for info in declared_values(graph):
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    for init in graph.initializer:
        types[init.name] = init.data_type
    for node in graph.node:
        outputs = [t for t in node.output if t and t not in types]
        if not outputs:
            continue
        derived = derived_output_type(node, types)
        for tensor in outputs:
            types[tensor] = derived
    return types


def derived_output_type(node: onnx.NodeProto, types: dict[str, int]) -> int:
    op = node.op_type
    if op == QUANTIZE:
        return (
            types.get(node.input[2], onnx.TensorProto.UINT8)
            if len(node.input) > 2 and node.input[2]
            else onnx.TensorProto.UINT8
        )
    if op == DEQUANTIZE:
        return types.get(node.input[1], onnx.TensorProto.FLOAT) if len(node.input) > 1 else onnx.TensorProto.FLOAT
    if op == "DynamicQuantizeLinear":
        return onnx.TensorProto.UINT8
    if op in ("MatMulInteger", "ConvInteger"):
        return onnx.TensorProto.INT32
    if op in ("Shape", "Size"):
        return onnx.TensorProto.INT64
    if op == "Cast":  # its own type: onnxruntime casts float16 weights and scales to float
        return next((a.i for a in node.attribute if a.name == "to"), onnx.TensorProto.UNDEFINED)
    first: Any = next((t for t in node.input if t), None)  # None (no input): UNDEFINED
    return types.get(first, onnx.TensorProto.UNDEFINED)


def kernel_class(optimized: OptimizedGraph, j: int) -> str:
    """int8 / int8_data / float for a kernel of the optimized graph (Q and DQ excluded)."""
    op = optimized.op_type(j)
    if op in INT8_KERNELS or op.startswith(("QLinear", "NhwcQLinear")):
        return "int8"
    if op not in QUANTIZE_KERNELS:
        first = next((t for t in optimized.graph.node[j].input if t), None)
        if first is not None and optimized.element_type(first) in QUANTIZED_TYPES:
            return "int8_data"
    return "float"


def time_class(optimized: OptimizedGraph, j: int) -> str:
    op = optimized.op_type(j)
    if op in QUANTIZE_KERNELS:
        return "quantize"
    if op == DEQUANTIZE:
        return "dequantize"
    return kernel_class(optimized, j)


def int8_fraction(classes: dict[str, int]) -> float:
    """Of the nodes whose runtime class is int8, int8_data or float, the fraction
    that are int8 or int8_data: check's --min-int8 and tune's int8_fraction."""
    running = classes["int8"] + classes["int8_data"] + classes["float"]
    return (classes["int8"] + classes["int8_data"]) / running if running else 0.0
