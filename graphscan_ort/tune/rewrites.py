"""Model rewrites that unlock onnxruntime's int8 kernels, which no library does.

Each rewrite is a function ``model -> (new model, how many nodes it rewrote)``
that leaves every graph output's name and value alone (up to float rounding):

- ``div_by_constant``: ``Div(x, c)`` with c a constant of non-zero finite
  floats becomes ``Mul(x, 1/c)``. onnxruntime neither quantizes nor fuses a
  Div, while a Mul becomes a QLinearMul (with uint8 activations).
- ``hard_sigmoid``: ``HardSigmoid(x; alpha, beta)`` becomes
  ``Clip(Add(Mul(x, alpha), beta), 0, 1)``. The CPU provider has no QDQ kernel
  for HardSigmoid; Mul and Add become QLinearMul and QLinearAdd, and the Clip
  is folded into the Q after it.

They are measured, not trusted: a caller verifies the rewritten model against
the original (``metrics.verified``: prepare's 80 dB rule) before using it.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphscan import node_name
from graphscan_ort.shared.graph import (
    FLOAT_TYPES,
    constant_arrays,
    default_opset,
    element_types,
    fresh_name,
    graph_names,
)

CLIP_INPUTS_OPSET = 11  # Clip takes min and max as inputs from opset 11 on


def div_by_constant(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Every ``Div(x, c)`` by a constant of non-zero finite floats as ``Mul(x, 1/c)``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    constants, taken, count = constant_arrays(graph), set(graph_names(graph)), 0
    for i, node in enumerate(graph.node):
        if node.op_type != "Div" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        divisor = constants.get(node.input[1])
        if divisor is None or divisor.proto.data_type not in FLOAT_TYPES:
            continue
        values = divisor.array
        if values.size == 0 or not np.all(np.isfinite(values)) or np.any(values == 0):
            continue
        reciprocal = (1.0 / values.astype(np.float64)).astype(values.dtype)
        name = fresh_name(f"{node_name(node, i)}_reciprocal", taken)
        graph.initializer.append(onnx.numpy_helper.from_array(reciprocal, name))
        node.op_type = "Mul"
        node.input[1] = name
        count += 1
    return out, count


def hard_sigmoid(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Every HardSigmoid as ``Clip(Add(Mul(x, alpha), beta), 0, 1)`` (opset 11 and newer)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if default_opset(out) < CLIP_INPUTS_OPSET:
        return out, 0
    graph = out.graph
    types = element_types(out)
    taken, count, nodes = set(graph_names(graph)), 0, []
    for i, node in enumerate(graph.node):
        if node.op_type != "HardSigmoid" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        kind = types.get(node.input[0], onnx.TensorProto.FLOAT)
        if kind not in FLOAT_TYPES:
            nodes.append(node)
            continue
        attrs = {a.name: a.f for a in node.attribute}
        alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(kind)
        # An unnamed node's SPEC name may be another node's: the Clip takes a fresh one.
        name = node.name or fresh_name(node_name(node, i), taken)
        constants = {}
        for key, value in (("alpha", alpha), ("beta", beta), ("zero", 0.0), ("one", 1.0)):
            constants[key] = fresh_name(f"{name}_{key}", taken)
            graph.initializer.append(onnx.numpy_helper.from_array(np.array(value, dtype), constants[key]))
        scaled, shifted = fresh_name(f"{name}_scaled", taken), fresh_name(f"{name}_shifted", taken)
        nodes += [
            onnx.helper.make_node(
                "Mul", [node.input[0], constants["alpha"]], [scaled], name=fresh_name(f"{name}_mul", taken)
            ),
            onnx.helper.make_node("Add", [scaled, constants["beta"]], [shifted], name=fresh_name(f"{name}_add", taken)),
            onnx.helper.make_node("Clip", [shifted, constants["zero"], constants["one"]], [node.output[0]], name=name),
        ]
        count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return out, count


REWRITES = {"div_by_constant": div_by_constant, "hard_sigmoid": hard_sigmoid}
