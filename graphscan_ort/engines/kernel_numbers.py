"""Where a CPU target's kernels compute other numbers than this machine's (``trace --cpu``).

trace's ``--save`` folder holds each operator as a single-op model (its input Q→DQ chains,
the operator, its output Q→DQ) with the inputs it ran on. Each is run again in a default
onnxruntime session here and inside the target, on the same inputs, and the two outputs
are compared in steps of the operator's output scale (LSB): a difference there is the
kernel's alone, never an upstream one carried along.
"""

from __future__ import annotations

import json
import os
import zipfile
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from graphscan import DEQUANTIZE, QUANTIZE

# U8S8: uint8 activations times int8 weights (and S8S8, which x86 runs as U8S8). Without VNNI,
# x86's vpmaddubsw adds two u8·s8 products into a saturating 16-bit lane before widening.
U8S8_OPS = frozenset({"Conv", "MatMul", "Gemm"})
U8S8_CAUSE = (
    "8-bit activations x int8 weights on x86 without VNNI (U8S8, and S8S8, which x86 runs as U8S8): "
    "AVX2's vpmaddubsw adds pairs of products in saturating 16-bit lanes"
)
U8S8_REMEDY = (
    "quantize with reduce_range=True (7-bit weights cannot saturate), or open the session with "
    "session.x64quantprecision=1 (U8U8 kernels); int8 activations (S8S8) do not help, x86 runs them as U8S8"
)
X86_WITHOUT_VNNI = ("x86-avx2",)  # the targets whose integer products saturate


def saved_inputs(path: str) -> dict[str, np.ndarray]:
    """The inputs of a ``--save`` .npz by tensor name (``names.json`` maps its keys back)."""
    with zipfile.ZipFile(path) as archive:
        names = json.loads(archive.read("names.json"))["inputs"]
    with np.load(path) as arrays:
        return {name: arrays[key] for name, key in names.items()}


def saved_outputs(folder: str, out: str) -> int:
    """Run every single-op model of a trace ``--save`` folder on its own inputs in a default
    session; write ``{stem: output}`` to ``out`` (.npz). Returns how many ran. Called inside
    a target by ``targets.run`` and here, the same code on both sides."""
    import onnxruntime as ort

    with open(os.path.join(folder, "index.json"), encoding="utf-8") as f:
        stems = list(json.load(f).values())
    outputs = {}
    for stem in stems:
        session = ort.InferenceSession(os.path.join(folder, stem + ".onnx"), providers=["CPUExecutionProvider"])
        outputs[stem] = session.run(None, saved_inputs(os.path.join(folder, stem + ".npz")))[0]
    np.savez(out, **outputs)
    return len(outputs)


def output_scale(model: onnx.ModelProto) -> np.ndarray | None:
    """The scale of the DequantizeLinear that writes the single-op model's output, shaped to
    broadcast over it (None: the output is not quantized, so it has no LSB)."""
    graph = model.graph
    producer = next((n for n in graph.node if graph.output[0].name in n.output), None)
    if producer is None or producer.op_type != DEQUANTIZE:
        return None
    initializers = {init.name: init for init in graph.initializer}
    if producer.input[1] not in initializers:
        return None
    scale = numpy_helper.to_array(initializers[producer.input[1]]).astype(np.float64)
    if scale.ndim == 1 and scale.size > 1:  # per axis: along the DQ's axis of the output
        axis = next((a.i for a in producer.attribute if a.name == "axis"), 1)
        rank = len(graph.output[0].type.tensor_type.shape.dim)
        shape = [1] * rank
        shape[axis % rank] = scale.size
        scale = scale.reshape(shape)
    return scale


def input_types(model: onnx.ModelProto, op: onnx.NodeProto) -> list[int | None]:
    """The element type each input of ``op`` was quantized to (the zero point's or the
    quantized initializer's), None for an input read in float."""
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    initializers = {init.name: init for init in graph.initializer}
    found: list[int | None] = []
    for name in op.input:
        dq = producers.get(name)
        if dq is None or dq.op_type != DEQUANTIZE:
            found.append(None)
            continue
        source = dq.input[0]
        if source in initializers:
            found.append(initializers[source].data_type)
        elif len(dq.input) > 2 and dq.input[2] in initializers:
            found.append(initializers[dq.input[2]].data_type)
        else:
            q = producers.get(source)
            zero = q.input[2] if q is not None and q.op_type == QUANTIZE and len(q.input) > 2 else None
            found.append(initializers[zero].data_type if zero in initializers else None)
    return found


def known_cause(model: onnx.ModelProto, target: str) -> tuple[str | None, str | None]:
    """``(cause, remedy)`` of a difference where one is known, else ``(None, None)``."""
    compute = [n for n in model.graph.node if n.op_type not in (QUANTIZE, DEQUANTIZE)]
    # the operator itself: named as its graph, or the one node that is not a Q or DQ
    op = next((n for n in compute if n.name == model.graph.name), compute[0] if len(compute) == 1 else None)
    if op is None or op.op_type not in U8S8_OPS or target not in X86_WITHOUT_VNNI:
        return None, None
    types = input_types(model, op)
    eight_bit = (onnx.TensorProto.UINT8, onnx.TensorProto.INT8)
    if len(types) > 1 and types[0] in eight_bit and types[1] == onnx.TensorProto.INT8:
        return U8S8_CAUSE, U8S8_REMEDY
    return None, None


def value_differs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Where ``a`` and ``b`` differ, a NaN in both at the same place being no difference (a
    kernel that gives NaN on both CPUs computes the same thing)."""
    return (a != b) & ~(np.isnan(a) & np.isnan(b))


def finite_gap(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """``|a - b|`` where both values are finite (None where no such pair differs: a NaN or an
    infinity against a number has no size in LSB)."""
    both = np.isfinite(a) & np.isfinite(b)
    gap = np.abs(a[both] - b[both])
    return gap if gap.size and gap.max() > 0 else None


def differences(folder: str, native: str, there: str, target: str, op_types: dict[str, str]) -> list[dict[str, Any]]:
    """The operators whose single-op output differs between this machine (``native`` .npz of
    saved_outputs) and ``target`` (``there``), in trace's row order: ``{"node", "op_type",
    "values", "differing", "max_abs", "max_lsb", "cause", "remedy"}`` (``max_lsb`` null where
    the output is not quantized, both null where only NaN or infinities differ); ``op_types``:
    each node's, from trace's rows."""
    with open(os.path.join(folder, "index.json"), encoding="utf-8") as f:
        stems = json.load(f)
    rows = []
    with np.load(native) as here, np.load(there) as away:
        for node, stem in stems.items():
            a, b = here[stem].astype(np.float64), away[stem].astype(np.float64)
            if a.shape != b.shape:
                continue
            apart = value_differs(a, b)
            if not apart.any():
                continue
            model = onnx.load(os.path.join(folder, stem + ".onnx"))
            scale = output_scale(model)
            gap = finite_gap(a, b)
            cause, remedy = known_cause(model, target)
            rows.append(
                {
                    "node": node,
                    "op_type": op_types[node],
                    "values": int(a.size),
                    "differing": int(apart.sum()),
                    "max_abs": None if gap is None else float(gap.max()),
                    "max_lsb": None if scale is None or gap is None else float(np.round((gap / scale).max(), 6)),
                    "cause": cause,
                    "remedy": remedy,
                }
            )
    return rows
