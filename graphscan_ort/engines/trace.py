"""trace's engine: the operator where a quantized model's error is born, on models in memory.

``compare(float_model, quant_model, feeds)`` pairs each compute operator of the
quantized model with the float tensor it stands for (``ReferenceMatcher``),
builds its single-op model (``OpModel``), and measures it alone on perfect
inputs (isolated) and in the chain (propagated), every row at once in one
combined model (combined.py). ``--save`` writes each single-op model and the
arrays it ran on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Callable, Container, Iterable, Mapping
from typing import Any, cast

import numpy as np
import onnx

from graphscan import EXIT_NO_FILE, GraphIndex, GraphscanError, data_source, output_chain, shown, value_inputs
from graphscan_ort.engines.combined import CombinedModel, SingleOpModelError, float_in_quant_opset, run_combined
from graphscan_ort.engines.levels import TensorLevels, quantized_activations, tensor_levels
from graphscan_ort.engines.measures import shapes_agree, type_problem, value_info_of
from graphscan_ort.shared.answers import NodeError, TraceMeasures, TraceOp, Unmatched
from graphscan_ort.shared.files import write_atomically
from graphscan_ort.shared.graph import (
    QDQ_SUFFIX,
    LazyArray,
    declared_values,
    first_output,
    has_subgraph,
    quant_range,
)
from graphscan_ort.shared.metrics import output_pairs
from graphscan_ort.shared.options import Named

TRACE_TOLERANCE = 1e-2  # --tolerance's default: the isolated error first_over names


def value_names(graph: onnx.GraphProto) -> set[str]:
    """Graph inputs that are not initializers, and every node output."""
    names = {info.name for info in value_inputs(graph)}
    names.update(t for node in graph.node for t in node.output if t)
    return names


def inferred_types(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, onnx.TypeProto]:
    """``{tensor: TypeProto}`` from onnx shape inference with the graph inputs set
    to the shapes fed. Big initializers enter as typed inputs, so their payloads
    are never copied; a model inference cannot handle gives what it declares."""
    graph = model.graph
    shell = onnx.ModelProto(ir_version=model.ir_version)
    shell.opset_import.extend(model.opset_import)
    shell.functions.extend(model.functions)
    body = shell.graph
    body.node.extend(graph.node)
    initializers = {init.name for init in graph.initializer}
    for info in graph.input:
        if info.name in initializers:
            continue
        copy = body.input.add()
        copy.CopyFrom(info)
        array = feeds.get(info.name)
        if copy.type.HasField("tensor_type") and hasattr(array, "shape"):
            copy.type.tensor_type.shape.Clear()
            copy.type.tensor_type.shape.SetInParent()
            for size in array.shape:  # type: ignore[union-attr]  # hasattr: not None
                copy.type.tensor_type.shape.dim.add().dim_value = size
    for init in graph.initializer:
        if math.prod(init.dims) <= 64:  # small: shape inputs whose values inference reads
            body.initializer.append(init)
        else:
            body.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    body.output.extend(graph.output)
    body.value_info.extend(graph.value_info)
    with contextlib.suppress(Exception):  # else what the model declares is all there is
        body = onnx.shape_inference.infer_shapes(shell, strict_mode=False, data_prop=True).graph
    infos = declared_values(body)
    return {info.name: info.type for info in infos if info.type.WhichOneof("value")}


class ReferenceMatcher:
    """Finds the float tensor a quantized-model tensor should be compared with.

    Like the quantized side, the float side is taken as the next op sees it:
    after its own Q->DQ, if the "float" model has one (comparing two
    quantized models, or a model with itself, then gives zeros where equal).
    """

    def __init__(self, float_graph: onnx.GraphProto, types: dict[str, onnx.TypeProto] | None = None) -> None:
        self.graph = float_graph
        self.types = types or {}
        self.index = GraphIndex(float_graph)
        self.tensors = value_names(float_graph)
        self.by_node: dict[tuple[str | None, int | None], str] = {}
        for i, node in enumerate(float_graph.node):
            for k, tensor in enumerate(node.output):
                if tensor:
                    self.by_node[(self.index.names[i], k)] = tensor

    def reference(self, tensor: str, *where: Any) -> str | None:
        """``counterpart`` (``where``: its other arguments), as the next op sees it: after the
        float model's own Q->DQ, if any."""
        found = self.counterpart(tensor, *where)
        return None if found is None else output_chain(self.index, self.graph, found)[1]

    def counterpart(
        self,
        tensor: str,
        producer_name: str | None = None,
        output_index: int | None = None,
        want: onnx.TypeProto | None = None,
    ) -> str | None:
        """The float tensor ``tensor`` stands for: the same name without ORT's QDQ suffixes,
        else the same node's same output.

        A candidate whose shape is known to differ from ``want`` (the quantized
        tensor's type) is passed over: a name reused with another meaning.
        """
        stripped = QDQ_SUFFIX.sub("", tensor)
        candidates: list[str | None] = [stripped] if stripped in self.tensors else []
        candidates.append(self.by_node.get((producer_name, output_index)))
        for candidate in candidates:
            if candidate is not None and shapes_agree(self.types.get(candidate), want) is not False:
                return candidate
        return None


class OpModel:
    """The single-op model of one operator of the quantized model.

    ``nodes`` are indices into the quantized graph: each input's own Q->DQ
    chain (or weight DQ), the operator, and its output Q->DQ if any.
    ``feeds`` maps each model input (a quantized-model tensor name) to the
    float reference fed in (``None``: the quantized model's own value, used
    only when no reference exists). ``output`` is what the next op sees.
    ``weight_nodes`` are the chains that start at an initializer: their value
    is the quantized model's own, so the combined graph reuses it.
    """

    def __init__(
        self,
        index: GraphIndex,
        graph: onnx.GraphProto,
        i: int,
        matcher: ReferenceMatcher,
        initializer_protos: Mapping[str, LazyArray],
        types: dict[str, onnx.TypeProto],
        out_chain: Any,
    ) -> None:
        self.index, self.graph, self.row = index, graph, i
        chain, self.weight_nodes = [], set()
        for tensor in index.inputs[i]:
            source, links = data_source(index, graph, tensor)
            if links and source in index.initializers:
                self.weight_nodes.update(links)
            chain += [j for j in links if j not in chain]
        out_chain, self.output = out_chain
        self.nodes = chain + [i] + out_chain
        produced = {t for j in self.nodes for t in index.outputs[j]}
        self.initializers: list[str] = []
        self.feeds: dict[str, str | None] = {}
        for j in self.nodes:
            for tensor in index.inputs[j]:
                if tensor in produced or tensor in self.feeds or tensor in self.initializers:
                    continue
                if tensor in index.initializers:
                    self.initializers.append(tensor)
                else:
                    self.feeds[tensor] = tensor_reference(index, matcher, tensor, types)
        self.output_scale = output_scale(graph, out_chain, initializer_protos)

    def node_protos(
        self, rename: Callable[[str], str] | None = None, name_prefix: str = "", skip: Container[int] = ()
    ) -> list[onnx.NodeProto]:
        """Copies of the model's nodes but ``skip``, every tensor passed through ``rename``."""
        rename = rename or (lambda t: t)
        protos = []
        for j in self.nodes:
            if j in skip:
                continue
            node = onnx.NodeProto()
            node.CopyFrom(self.graph.node[j])
            node.name = name_prefix + self.index.names[j]
            node.input[:] = [rename(t) if t else t for t in node.input]
            node.output[:] = [rename(t) if t else t for t in node.output]
            protos.append(node)
        return protos


class InitializerTable(dict):
    """Initializers by name, each read into numpy once when asked (every Q and DQ asks)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        super().__init__((init.name, LazyArray(init)) for init in graph.initializer)


def output_scale(
    graph: onnx.GraphProto, out_chain: list[int], initializer_protos: Mapping[str, LazyArray]
) -> float | None:
    """The output Q's scale as a float, when it is a scalar initializer."""
    if not out_chain:
        return None
    scale = initializer_protos.get(graph.node[out_chain[0]].input[1])
    return None if scale is None or scale.array.size != 1 else float(scale.array.reshape(-1)[0])


def clip_range(
    graph: onnx.GraphProto, q_node: int, initializer_protos: Mapping[str, LazyArray]
) -> tuple[float, float] | None:
    """``(lo, hi)``: what a per-tensor Q represents; None for a per-channel or
    non-integer Q, or one whose scale or zero point is not an initializer."""
    bounds = quant_range(graph.node[q_node], initializer_protos)
    return None if bounds is None else bounds[:2]


def tensor_reference(
    index: GraphIndex, matcher: ReferenceMatcher, tensor: str, types: dict[str, onnx.TypeProto] | None = None
) -> str | None:
    """The reference of a tensor of the quantized model (``index``): ``ReferenceMatcher.reference``."""
    return tensor_match(index, matcher, tensor, types, matcher.reference)


def tensor_counterpart(
    index: GraphIndex, matcher: ReferenceMatcher, tensor: str, types: dict[str, onnx.TypeProto] | None = None
) -> str | None:
    """The float tensor a tensor of the quantized model stands for: ``ReferenceMatcher.counterpart``."""
    return tensor_match(index, matcher, tensor, types, matcher.counterpart)


def tensor_match(
    index: GraphIndex,
    matcher: ReferenceMatcher,
    tensor: str,
    types: dict[str, onnx.TypeProto] | None,
    match: Callable[[str, str | None, int | None, onnx.TypeProto | None], str | None],
) -> str | None:
    want = (types or {}).get(tensor)
    producer = index.producer_of(tensor)
    if producer is None:
        return match(tensor, None, None, want)
    return match(tensor, index.names[producer], index.outputs[producer].index(tensor), want)


def float_counterparts(
    float_model: onnx.ModelProto, quant_model: onnx.ModelProto, tensors: Iterable[str], feeds: dict[str, np.ndarray]
) -> dict[str, str | None]:
    """Per tensor of ``quant_model``, the float tensor of ``float_model`` it stands for, as
    trace's rows pair them (``ReferenceMatcher.counterpart``, shapes inferred on ``feeds``);
    None where neither its name nor its node's is in the float model."""
    matcher = ReferenceMatcher(float_model.graph, inferred_types(float_model, feeds))
    index, types = GraphIndex(quant_model.graph), inferred_types(quant_model, feeds)
    return {tensor: tensor_counterpart(index, matcher, tensor, types) for tensor in tensors}


REASON_ABSORBED = "its output is compared with a quantized node of another type (absorbed)"


REASON_NO_TWIN = "no quantized node of the same name and op_type"


REASON_SUBGRAPH = "has a subgraph (If/Loop/Scan): only its outputs are compared, it is not isolated"


REASON_NOT_TENSOR = "its output is {}: not compared"


REASON_SINGLE_OP = "graphscan's own single-op model of this node does not run in onnxruntime ({}): not isolated"


# Single-op models that fail (a reference whose shape inference could not check
# it) are dropped, the run repeated, at most this many times.
TRACE_RETRIES = 8


def unmatched_float_nodes(float_index: GraphIndex, quant_index: GraphIndex, rows: list[TraceOp]) -> list[Unmatched]:
    """Float compute nodes with no quantized counterpart of the same name and op_type.

    Nodes with subgraphs are listed too: trace compares their outputs but
    builds no single-op model for them (their bodies read outer tensors).
    """
    quant = {(quant_index.names[i], quant_index.op_types[i]) for i in range(len(quant_index))}
    referenced: dict[int, set[str]] = {}
    for row in rows:
        if row["reference"] is None:
            continue
        source, _ = data_source(float_index, float_index.graph, row["reference"])
        producer = float_index.producer_of(source)
        if producer is not None:
            referenced.setdefault(producer, set()).add(row["op_type"])
    unmatched: list[Unmatched] = []
    for i in range(len(float_index)):
        if not float_index.is_compute(i):
            continue
        name, op_type = float_index.names[i], float_index.op_types[i]
        if has_subgraph(float_index.graph.node[i]):
            reason = REASON_SUBGRAPH
        elif (name, op_type) in quant or op_type in referenced.get(i, ()):
            continue
        else:
            reason = REASON_ABSORBED if i in referenced else REASON_NO_TWIN
        unmatched.append({"node": name, "op_type": op_type, "reason": reason})
    return unmatched


def file_stems(names: Iterable[str]) -> list[str]:
    """A file stem per name, all different even on a case-insensitive file system.

    A name made only of ``[A-Za-z0-9._-]`` is its own stem; any other gets its
    unsafe characters turned into ``_`` and a hash of the name appended.
    """
    import hashlib

    stems, taken = [], set()
    for name in names:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120]
        if safe != name or safe.strip(".") == "":
            safe = f"{safe}-{hashlib.sha1(name.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"
        stem, n = safe, 1
        while stem.casefold() in taken:
            n += 1
            stem = f"{safe}-{n}"
        taken.add(stem.casefold())
        stems.append(stem)
    return stems


def standalone_model(
    quant_model: onnx.ModelProto, op: OpModel, input_arrays: dict[str, np.ndarray], output_array: np.ndarray
) -> onnx.ModelProto:
    """``op`` as a model of its own, for ``--save``: typed from the arrays it ran on."""
    wanted = set(op.initializers)
    initializers = [init for init in quant_model.graph.initializer if init.name in wanted]
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            op.node_protos(),
            op.index.names[op.row],
            [value_info_of(name, input_arrays[name]) for name in op.feeds],
            [value_info_of(op.output, output_array)],
            initializers,
        ),
        opset_imports=quant_model.opset_import,
    )
    model.ir_version = quant_model.ir_version
    return model


def npz_bytes(inputs: dict[str, np.ndarray], reference: np.ndarray) -> bytes:
    """The ``--save`` .npz: arrays under generated keys (``input0``, ...,
    ``reference``) and ``names.json`` mapping each key back to its tensor name,
    so any tensor name round-trips."""
    import io
    import zipfile

    keys = {f"input{k}": name for k, name in enumerate(inputs)}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for key, name in keys.items():
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(inputs[name]), allow_pickle=False)
        with archive.open("reference.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.asarray(reference), allow_pickle=False)
        names = {"inputs": {name: key for key, name in keys.items()}, "reference": "reference"}
        archive.writestr("names.json", json.dumps(names, ensure_ascii=False))
    return buffer.getvalue()


def save_op_models(
    folder: str,
    quant_model: onnx.ModelProto,
    rows: list[TraceOp],
    op_models: list[OpModel | None],
    arrays_by_row: list[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray] | None],
) -> None:
    """Write ``<stem>.onnx`` and ``<stem>.npz`` for every row that has a single-op
    model, and ``index.json`` mapping each row's node to its stem."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise GraphscanError(f"{shown(folder)}: cannot create ({exc.strerror or exc})", EXIT_NO_FILE)
    saved = [(row, op, arrays) for row, op, arrays in zip(rows, op_models, arrays_by_row) if op and arrays]
    stems = file_stems([row["node"] for row, _, _ in saved])
    for stem, (_row, op, (arrays, reference, isolated)) in zip(stems, saved):
        model = standalone_model(quant_model, op, arrays, isolated)
        write_atomically(model.SerializeToString(), os.path.join(folder, stem + ".onnx"))
        write_atomically(npz_bytes(arrays, reference), os.path.join(folder, stem + ".npz"))
    index = {row["node"]: stem for stem, (row, _, _) in zip(stems, saved)}
    write_atomically(json.dumps(index, ensure_ascii=False).encode("utf-8"), os.path.join(folder, "index.json"))


class TraceRow:
    """One compute node of the quantized model: its float reference, single-op
    model (None where it has no reference or has a subgraph), the tensor it
    writes and what the next op sees, and why it is not compared, if so."""

    def __init__(
        self,
        index: GraphIndex,
        graph: onnx.GraphProto,
        i: int,
        matcher: ReferenceMatcher,
        initializer_protos: Mapping[str, LazyArray],
        types: dict[str, onnx.TypeProto],
    ) -> None:
        node = graph.node[i]
        self.i, self.name = i, index.names[i]
        self.output = first_output(node)
        self.problem = type_problem(types.get(self.output)) if self.output else None
        self.reference = self.op = None
        self.out_chain, self.seen = output_chain(index, graph, self.output) if self.output else ([], "")
        if self.output and not self.problem:
            self.reference = tensor_reference(index, matcher, self.output, types)
        if self.reference is not None and not has_subgraph(node):
            self.op = OpModel(index, graph, i, matcher, initializer_protos, types, (self.out_chain, self.seen))
        self.clip = clip_range(graph, self.out_chain[0], initializer_protos) if self.out_chain else None


def plan_rows(
    quant_model: onnx.ModelProto, quant_index: GraphIndex, matcher: ReferenceMatcher, types: dict[str, onnx.TypeProto]
) -> list[TraceRow]:
    """A TraceRow per compute node of the quantized model, in graph order."""
    graph = quant_model.graph
    initializer_protos = InitializerTable(graph)
    return [TraceRow(quant_index, graph, i, matcher, initializer_protos, types) for i in quant_index.compute_nodes]


def row_answer(
    index: GraphIndex,
    row: TraceRow,
    isolated: tuple[float | None, float | None],
    propagated: tuple[float | None, float | None],
    clipped: float | None,
) -> TraceOp:
    """One ``ops`` row of the trace answer."""
    isolated_max, _ = isolated
    propagated_max, sqnr = propagated
    scale = row.op.output_scale if row.op else None
    return {
        "node": index.names[row.i],
        "op_type": index.op_types[row.i],
        "wrapped": index.wrapped[row.i],
        "reference": row.reference,
        "isolated_max_abs": isolated_max,
        "propagated_max_abs": propagated_max,
        "isolated_lsb": isolated_max / scale if isolated_max is not None and scale else None,
        "sqnr_db": sqnr,
        "clipped": clipped,
    }


def compare(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    a: str,
    b: str,
    tolerance: float = TRACE_TOLERANCE,
    save: str | None = None,
) -> TraceMeasures:
    """trace's rows for two models in memory (``a`` and ``b`` name them in failures) on
    one sample: every operator of ``quant_model`` against ``float_model``'s tensors."""
    pairs = output_pairs(Named(float_model, a), Named(quant_model, b))
    float_types, quant_types = inferred_types(float_model, feeds), inferred_types(quant_model, feeds)
    quant_index = GraphIndex(quant_model.graph)
    matcher = ReferenceMatcher(float_model.graph, float_types)
    plan = plan_rows(quant_model, quant_index, matcher, quant_types)

    # Before the combined model: its sessions reuse the arena this run leaves (levels.py).
    levels = row_levels(float_model, quant_model, plan, quant_index, matcher, quant_types, feeds, a)
    float_for_session = float_in_quant_opset(float_model, quant_model, a, b)
    failed: dict[int, str] = {}  # row index -> onnxruntime's reason its single-op model failed
    while True:
        combined = CombinedModel(float_for_session, quant_model, feeds, float_types, quant_types)
        combined.keep = save is not None  # --save writes the arrays each row ran on
        measured = [combined.add_row(k, row, quant_index, save is not None) for k, row in enumerate(plan)]
        output_comparisons = {}
        for f, q in pairs:
            reference = combined.float_name(f)
            output_comparisons[f] = combined.compare(combined.end, reference, q, fetch=combined.fits([reference, q]))
        combined.add_float_model()
        try:
            kept = run_combined(combined, feeds, a, b, plan)  # every fetched array with --save
            break
        except SingleOpModelError as failure:
            if failure.row in failed or len(failed) >= TRACE_RETRIES:
                raise
            failed[failure.row] = failure.reason
            plan[failure.row].op = None  # traced without it: its isolated error is null
    kept.update(feeds)

    rows, saved = [], []
    for row, (isolated, propagated, clip, op_output) in zip(plan, measured):
        nothing = (None, None)
        rows.append(
            row_answer(
                quant_index,
                row,
                isolated.outcome if isolated else nothing,
                propagated.outcome if propagated else nothing,
                clip.outcome if clip else None,
            )
        )
        found = levels.get(row.output)
        rows[-1]["levels"] = None if found is None else found.levels
        arrays = None
        if save is not None and isolated is not None and rows[-1]["isolated_max_abs"] is not None:
            inputs_of_op = {t: kept[combined.float_name(r) if r is not None else t] for t, r in row.op.feeds.items()}  # type: ignore[union-attr]
            arrays = (inputs_of_op, kept[combined.float_name(row.reference)], kept[op_output])  # type: ignore[arg-type, index]
        saved.append(arrays)
    if save is not None:
        save_op_models(save, quant_model, rows, [row.op for row in plan], saved)
    return {
        "ops": rows,
        "outputs": {f: (comparison.outcome[0] if comparison else None) for f, comparison in output_comparisons.items()},
        "worst_isolated": worst_isolated(rows),
        "first_over": first_over(rows, tolerance),
        "unmatched": unmatched_float_nodes(matcher.index, quant_index, rows)
        + [
            {"node": row.name, "op_type": quant_index.op_types[row.i], "reason": REASON_NOT_TENSOR.format(row.problem)}
            for row in plan
            if row.problem
        ]
        + [
            {
                "node": plan[k].name,
                "op_type": quant_index.op_types[plan[k].i],
                "reason": REASON_SINGLE_OP.format(reason),
            }
            for k, reason in sorted(failed.items())
        ],
    }


def row_levels(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    plan: list[TraceRow],
    quant_index: GraphIndex,
    matcher: ReferenceMatcher,
    quant_types: dict[str, onnx.TypeProto],
    feeds: dict[str, np.ndarray],
    a: str,
) -> dict[str, TensorLevels]:
    """The levels (levels.py) of each row's output that a Q reads, its float values taken at
    the tensor the row's reference stands for."""
    outputs = {row.output for row in plan if row.output}
    steps = {t: s for t, s in quantized_activations(quant_model).items() if t in outputs}
    named = {t: tensor_counterpart(quant_index, matcher, t, quant_types) for t in steps}
    return tensor_levels(float_model, steps, [feeds], a, named, arena=True)


def worst_isolated(rows: list[TraceOp]) -> NodeError | None:
    measured = [r for r in rows if r["isolated_max_abs"] is not None]
    if not measured:
        return None
    worst = max(measured, key=lambda r: cast(float, r["isolated_max_abs"]))  # first of equals
    return {"node": worst["node"], "max_abs": cast(float, worst["isolated_max_abs"])}


def first_over(rows: list[TraceOp], tolerance: float) -> NodeError | None:
    for r in rows:
        error = r["isolated_max_abs"]
        if error is not None and error > tolerance:
            return {"node": r["node"], "max_abs": error}
    return None
