"""fuse: MatMul + Add -> Gemm, verified with onnxruntime before anything is written."""

from __future__ import annotations

import os
from typing import Any

import onnx

from graphscan import (
    EXIT_MISMATCH,
    EXIT_NOT_ONNX,
    Command,
    GraphIndex,
    GraphscanError,
    Samples,
    format_fields,
    load_with_weights,
    one_line,
    page,
    section,
    shown,
)
from graphscan_ort.shared.answers import FuseAnswer, Fused, Skipped
from graphscan_ort.shared.files import check_output_path, write_atomically
from graphscan_ort.shared.graph import FLOAT_TYPES, declared_values, fresh_name
from graphscan_ort.shared.inputs import model_samples, parse_shapes
from graphscan_ort.shared.metrics import verify
from graphscan_ort.shared.sessions import inputs_hint

SYMBOLIC_DIM_SIZE = 2  # size given to symbolic dimensions of verification inputs


SKIP_OUTPUT_SHARED = "output used elsewhere or a graph output"


SKIP_C_NOT_INITIALIZER = "the Add's other input is not an initializer"


SKIP_A_NOT_RANK_2 = "A is not rank 2"


SKIP_B_NOT_2D = "B is not a 2-D initializer"


SKIP_C_NOT_BROADCAST = "C does not broadcast to (M, N)"


SKIP_TYPE = "Gemm runs only FLOAT, FLOAT16 or DOUBLE"


def static_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """``{tensor: [dim_value or None, ...]}`` for every tensor whose rank is known."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    shapes = {}
    for info in declared_values(graph):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def broadcasts_to(c_shape: list[int | None], m: int | None, n: int | None) -> bool:
    """Whether C of ``c_shape`` unidirectionally broadcasts to (m, n); m may be unknown."""
    if len(c_shape) > 2:
        return False
    return all(dim == 1 or (target is not None and dim == target) for dim, target in zip(reversed(c_shape), (n, m)))


def gemm_plan(
    index: GraphIndex,
    model: onnx.ModelProto,
    shapes: dict[str, list[int | None]],
    initializer_types: dict[str, int],
    graph_outputs: set[str],
    matmul: int,
) -> tuple[int, str, None] | tuple[None, None, str]:
    """``(add_index, c_name, None)`` if MatMul ``matmul`` can fuse, else ``(None, None, reason)``."""
    node = model.graph.node[matmul]
    product = node.output[0]
    consumers = index.consumers_of(product)
    if len(consumers) != 1 or index.op_types[consumers[0]] != "Add" or product in graph_outputs:
        return None, None, SKIP_OUTPUT_SHARED
    add = consumers[0]
    others = [t for t in model.graph.node[add].input if t != product]
    if len(others) != 1 or others[0] not in index.initializers:
        return None, None, SKIP_C_NOT_INITIALIZER
    a_shape = shapes.get(node.input[0])
    if a_shape is None or len(a_shape) != 2:
        return None, None, SKIP_A_NOT_RANK_2
    b_name = node.input[1]
    if b_name not in index.initializers or len(shapes[b_name]) != 2:
        return None, None, SKIP_B_NOT_2D
    if not broadcasts_to(shapes[others[0]], a_shape[0], shapes[b_name][1]):
        return None, None, SKIP_C_NOT_BROADCAST
    if initializer_types[b_name] not in FLOAT_TYPES:
        return None, None, SKIP_TYPE
    return add, others[0], None


def fuse_matmul_add(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[Fused], list[Skipped]]:
    """A copy of ``model`` with every legal MatMul+Add replaced by one Gemm.

    Returns ``(fused_model, fused, skipped)`` as the ``fuse`` answer lists them.
    The Gemm takes the Add's place and output name, so downstream is untouched.
    """
    index = GraphIndex(model.graph)
    shapes = static_shapes(model)
    initializer_types = {init.name: init.data_type for init in model.graph.initializer}
    taken = set(index.names)
    graph_outputs = {output.name for output in model.graph.output}
    replace, drop = {}, set()
    fused: list[Fused] = []
    skipped: list[Skipped] = []
    add: Any  # an int and c_name a str whenever reason is None (gemm_plan)
    c_name: Any
    for i, op_type in enumerate(index.op_types):
        if op_type != "MatMul":
            continue
        add, c_name, reason = gemm_plan(index, model, shapes, initializer_types, graph_outputs, i)
        if reason:
            skipped.append({"node": index.names[i], "reason": reason})
            continue
        matmul = model.graph.node[i]
        gemm_name = fresh_name(f"{index.names[i]}_gemm", taken)
        replace[add] = onnx.helper.make_node(
            "Gemm",
            [matmul.input[0], matmul.input[1], c_name],
            [model.graph.node[add].output[0]],
            name=gemm_name,
        )
        drop.add(i)
        fused.append({"matmul": index.names[i], "add": index.names[add], "gemm": gemm_name})
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    for i, node in enumerate(model.graph.node):
        if i not in drop:
            out.graph.node.append(replace.get(i, node))
    dropped_tensors = {model.graph.node[i].output[0] for i in drop}
    kept_info = [v for v in model.graph.value_info if v.name not in dropped_tensors]
    del out.graph.value_info[:]
    out.graph.value_info.extend(kept_info)
    return out, fused, skipped


ORT_OLDEST_OPSET = 7  # onnxruntime has no kernel for older default-domain opsets


def check_original(model: onnx.ModelProto, path: str) -> None:
    """Exit 4 unless the model to fuse passes the checker itself: a broken original
    (a cycle, two producers of a tensor, an opset that does not exist) is the
    input's fault, not the fusion's."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: not a valid ONNX model ({one_line(exc)})", EXIT_NOT_ONNX)
    # The checker passes default-domain opsets that do not exist (above onnx's
    # newest) and ones older than any onnxruntime runs.
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and not ORT_OLDEST_OPSET <= opset.version <= onnx.defs.onnx_opset_version():
            raise GraphscanError(
                f"{shown(path)}: opset {opset.version} of the default domain: onnx defines up to "
                f"{onnx.defs.onnx_opset_version()} and onnxruntime runs {ORT_OLDEST_OPSET} and newer",
                EXIT_NOT_ONNX,
            )


def fuse(path: str, output: str, samples: Samples) -> FuseAnswer:
    """Fuse MatMul+Add into Gemm, verify with onnxruntime, then write ``output``.

    The verification sample is the ``--inputs`` file or seeded data whose symbolic
    dimensions come from ``--shape NAME=D0,...`` or are 2.
    """
    model = load_with_weights(path)
    check_original(model, path)
    check_output_path(os.path.realpath(output) if os.path.islink(output) else output)
    fused_model, fused, skipped = fuse_matmul_add(model)
    try:
        onnx.checker.check_model(fused_model, full_check=True)
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: fused model fails the checker ({one_line(exc)})", EXIT_MISMATCH)
    chosen, _ = model_samples(model, samples.inputs, parse_shapes(samples.shape), samples.seed, SYMBOLIC_DIM_SIZE)
    with inputs_hint(not samples.inputs, SYMBOLIC_DIM_SIZE, [path]):
        result = verify(model, fused_model, chosen[:1], (f"{shown(path)}: model", f"the fused model of {shown(path)}"))
    if result.problem is None and not result.compared:
        why = "empty" if result.empty else "all NaN or infinite"
        raise GraphscanError(
            f"{shown(path)}: cannot verify the fused model: the original's outputs are {why} on this "
            f"input (give others with --inputs); nothing written",
            EXIT_MISMATCH,
        )
    if result.problem is not None:
        raise GraphscanError(
            f"{shown(path)}: fused model differs from the original {result.problem}; nothing written", EXIT_MISMATCH
        )
    write_atomically(fused_model.SerializeToString(), output)
    return {
        "model": path,
        "output": output,
        "fused": fused,
        "skipped": skipped,
        "max_abs_error": result.max_abs_error,
    }


def fuse_table(answer: dict[str, Any], top: int | None) -> str:
    """What was fused and what was skipped, in graph order."""
    fused = [[f["matmul"], f["add"], f["gemm"]] for f in answer["fused"]]
    skipped = [[s["node"], s["reason"]] for s in answer["skipped"]]
    return page(
        format_fields(
            [
                ("model", answer["model"]),
                ("output", answer["output"]),
                ("fused", len(fused)),
                ("skipped", len(skipped)),
                ("max_abs_error", answer["max_abs_error"]),
            ]
        ),
        section("fused", ["matmul", "add", "gemm"], fused, top),
        section("skipped", ["matmul", "reason"], skipped, top),
    )


COMMAND = Command(
    "fuse",
    fuse,
    ("model", "output"),
    options=(Samples.taken(SYMBOLIC_DIM_SIZE),),
    table=fuse_table,
    answer=FuseAnswer,
)
