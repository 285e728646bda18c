"""Model rewrites that unlock onnxruntime's int8 kernels, which no library does (for issue 18's tune).

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
the original (``verified``, as fuse verifies) before using it.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphscan import node_name
from graphscan_ort.common import compare_outputs, graph_names
from graphscan_ort.fuse import FUSE_RELATIVE_TOLERANCE, run_model
from graphscan_ort.impact import constant_arrays

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}
CLIP_INPUTS_OPSET = 11  # Clip takes min and max as inputs from opset 11 on


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
        name = node_name(node, i)
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


REWRITES = {"div_by_constant": div_by_constant, "hard_sigmoid": hard_sigmoid}


def verified(original: onnx.ModelProto, rewritten: onnx.ModelProto, samples: list[dict]) -> tuple[float, str | None]:
    """``(max_abs_error, problem or None)``: the rewritten model against the original on
    every sample, as fuse verifies (NaN-aware, 1e-5 relative to the outputs' magnitude)."""
    worst = 0.0
    for k, feeds in enumerate(samples):
        expected = run_model(original, feeds, "the model before the rewrite")
        actual = run_model(rewritten, feeds, "graphscan's rewritten model")
        error, scale, _, problem = compare_outputs(expected, actual)
        if problem is None and error > FUSE_RELATIVE_TOLERANCE * max(scale, 1.0):
            problem = f"by {error:.3g} (allowed {FUSE_RELATIVE_TOLERANCE:g} relative)"
        if problem is not None:
            return error, f"sample {k}: {problem}"
        worst = max(worst, error)
    return worst, None
