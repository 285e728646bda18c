"""tune's guards: what a written model must be, whatever its accuracy.

tune exists to give a model that is faster and smaller than float, so a candidate
is only written when it is

- ``slower`` not: its interleaved speedup against float is above ``--min-speedup``
  (default 1: faster than float) at the latency inputs; on an emulated CPU target, whose
  time is no latency, only when ``--min-speedup`` is given (this machine's speedup);
- ``larger`` not: its file is no larger than the float model's (external data included);
- ``float_weights`` not: every Conv, ConvTranspose, MatMul and Gemm weight, excluded
  nodes apart, is stored as integers (a DequantizeLinear of an integer initializer).
  A weight quantized at run time from a float initializer or Constant (QuantizeLinear
  then DequantizeLinear in the graph) is float on disk and in the session's work.

A row's ``fails`` lists the guards it breaks, in that order.
"""

from __future__ import annotations

import os
from typing import Any

import onnx

from graphscan import DEQUANTIZE, QUANTIZE

WEIGHTED = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
INTEGER_TYPES = frozenset(
    {
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.INT16,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT4,
        onnx.TensorProto.UINT4,
    }
)
GUARDS = ("slower", "larger", "float_weights")


def file_bytes(path: str, model: onnx.ModelProto) -> int:
    """The bytes ``model`` takes on disk: its file and every external data file it names."""
    from onnx import external_data_helper

    folder = os.path.dirname(os.path.abspath(path))
    locations = {
        entry.value
        for tensor in model.graph.initializer
        if external_data_helper.uses_external_data(tensor)
        for entry in tensor.external_data
        if entry.key == "location"
    }
    external = (os.path.join(folder, location) for location in sorted(locations))
    return os.path.getsize(path) + sum(os.path.getsize(p) for p in external if os.path.isfile(p))


def float_weight_nodes(model: onnx.ModelProto, excluded: list[str] | None = None) -> list[str]:
    """The Conv, ConvTranspose, MatMul and Gemm nodes of ``model`` (not in ``excluded``)
    with a weight, an input that is a constant, not stored as integers."""
    graph = model.graph
    initializers = {t.name: t.data_type for t in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    constant = {output for node in graph.node if node.op_type == "Constant" for output in node.output}
    skipped = set(excluded or [])

    def stored(tensor: str) -> str:
        """``integer`` (a DQ of an integer initializer), ``float`` (a constant kept or
        quantized at run time) or ``activation`` (computed: not a weight)."""
        producer = producers.get(tensor)
        if tensor in initializers or tensor in constant:
            return "float" if initializers.get(tensor) not in INTEGER_TYPES else "integer"
        if producer is None or producer.op_type != DEQUANTIZE:
            return "activation"
        source = producer.input[0]
        if source in initializers:
            return "integer" if initializers[source] in INTEGER_TYPES else "float"
        if source in constant:
            return "integer"  # a Constant of integers feeding a DQ: stored as integers
        quantizer = producers.get(source)
        if quantizer is not None and quantizer.op_type == QUANTIZE:
            kept = quantizer.input[0]
            return "float" if kept in initializers or kept in constant else "activation"
        return "activation"

    return [
        node.name
        for node in graph.node
        if node.op_type in WEIGHTED
        and node.name not in skipped
        and any(stored(tensor) == "float" for tensor in node.input[:2] if tensor)
    ]


def failed_guards(row: dict[str, Any], float_bytes: int, min_speedup: float | None) -> list[str]:
    """The guards a measured row breaks (``GUARDS`` order); ``min_speedup`` None: no ``slower``."""
    fails = []
    if min_speedup is not None and (row["speedup"] is None or not row["speedup"] > min_speedup):
        fails.append("slower")
    if row["bytes"] is None or row["bytes"] > float_bytes:
        fails.append("larger")
    if row["float_weights"]:
        fails.append("float_weights")
    return fails
