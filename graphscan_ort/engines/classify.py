"""What onnxruntime runs for each node: the optimized graph mapped back to the model."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections import Counter
from typing import Any

import onnx
import onnxruntime as ort

from graphscan import (
    EXIT_NO_FILE,
    EXIT_RUNTIME,
    EXIT_USAGE,
    GraphIndex,
    GraphscanError,
    as_text,
    data_source,
    dtype_name,
    load_with_weights,
    node_name,
    parse_model,
    shown,
)
from graphscan_ort.shared.answers import NodeRow, Reason, RuntimeCounts
from graphscan_ort.shared.graph import first_free
from graphscan_ort.shared.kernels import (
    INT8_GATED_FUSIONS,
    PER_NODE_PROVIDERS,
    QDQ_FUSIONS,
    RUNTIME_CLASSES,
    WEIGHT_OPERANDS,
    OptimizedGraph,
    kernel_class,
)
from graphscan_ort.shared.sessions import CPU, environment, open_session, session_options, temporary_folder

REASON_LEVEL = "level"


REASON_NO_KERNEL = "no_kernel"


REASON_MIXED = "mixed_types"


REASON_INT8 = "int8_activations"


REASON_OTHER = "other"


def session_names(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` in which every node has a unique name.

    Unnamed nodes get their SPEC name (``<op_type>_<i>``); a name that is taken
    (or repeated) gets ``~<i>`` appended, and more ``~`` until it is a name no
    node has or had. Returns the copy and the names.
    """
    named = onnx.ModelProto()
    named.CopyFrom(model)
    taken = {as_text(node.name) for node in model.graph.node if node.name}
    seen, names = set(), []
    for i, node in enumerate(named.graph.node):
        name = node_name(node, i)
        if name in seen or (not node.name and name in taken):
            variants = (f"{name}~{i}" + "~" * k for k in itertools.count())
            name = first_free(variants, lambda variant: variant in seen or variant in taken)
        seen.add(name)
        names.append(name)
        node.name = name
    return named, names


def check_provider(provider: str) -> None:
    """Exit 2 for a provider that is not here or cannot be mapped per node."""
    available = ort.get_available_providers()
    if provider not in available:
        raise GraphscanError(f"usage: provider {provider} is not available here ({', '.join(available)})", EXIT_USAGE)
    if provider not in PER_NODE_PROVIDERS:
        raise GraphscanError(
            f"usage: provider {provider} compiles subgraphs into its own kernels, so its graph "
            f"cannot be mapped back to nodes (per-node providers: {', '.join(sorted(PER_NODE_PROVIDERS))})",
            EXIT_USAGE,
        )


def optimized_model(model_bytes: bytes, path: str, level: str, provider: str, int8_allowed: bool) -> onnx.ModelProto:
    """The model onnxruntime runs, as it saves it after optimizing ``model_bytes``."""
    with temporary_folder("graphscan-runtime-") as folder:
        options = session_options(level, int8_allowed=int8_allowed)
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        try:
            open_session(model_bytes, f"{shown(path)}: model", options, provider)
        except GraphscanError:
            # "Protobuf serialization failed" names no file: if the model builds
            # without saving its graph, saving is what failed (a full disk).
            open_session(
                model_bytes, f"{shown(path)}: model", session_options(level, int8_allowed=int8_allowed), provider
            )
            raise GraphscanError(
                f"cannot write onnxruntime's optimized graph into the temporary folder {shown(folder)}: "
                "is it full? set TMPDIR",
                EXIT_NO_FILE,
            )
        try:
            with open(options.optimized_model_filepath, "rb") as f:
                return parse_model(f.read(), path)
        except OSError as exc:
            raise GraphscanError(
                f"{shown(path)}: onnxruntime saved no optimized graph ({exc.strerror or exc})", EXIT_RUNTIME
            )


def find_in_optimized(
    index: GraphIndex, names: list[str], optimized: OptimizedGraph, i: int
) -> tuple[int | None, str | None]:
    """``(optimized node index or None, how)`` for compute node ``i`` of the original.

    By name, by name without onnxruntime's suffixes, by output tensor (also
    through the Q after it), by its Q/DQ signature (the quantized tensors its
    DQs read), by neighbours (the one node of its op type reading its input).
    """
    name = names[i]
    if name in optimized.by_name:
        return optimized.by_name[name], "name"
    stripped = optimized.by_stripped.get(name, [])
    if len(stripped) == 1:
        return stripped[0], "name"
    graph = index.graph
    for tensor in index.outputs[i]:
        producer = optimized.kernel_producer(tensor)
        if producer is not None:
            return producer, "tensor"
    for tensor in index.outputs[i]:
        # The Q after it keeps its name even when its tensors are renamed
        # (onnxruntime's int8 -> uint8 rewrite): the node was folded into it.
        for q in index.consumers_of(tensor):
            if not index.is_q[q]:
                continue
            if names[q] in optimized.by_name:
                return optimized.by_name[names[q]], "tensor"
            # The Q itself was fused: whatever makes its output took the node in.
            producer = optimized.kernel_producer(graph.node[q].output[0])
            if producer is not None:
                return producer, "tensor"
    signature = set()
    for tensor in index.inputs[i]:
        source, chain = data_source(index, graph, tensor)
        signature.add(graph.node[chain[-1]].input[0] if chain else source)
    readers: set[int] = set()
    for tensor in signature:
        readers.update(j for j in optimized.index.consumers_of(tensor) if optimized.index.is_compute(j))
    if len(readers) == 1:
        return readers.pop(), "signature"
    op_type = index.op_types[i]
    neighbours = {
        j for tensor in index.inputs[i] for j in optimized.index.consumers_of(tensor) if optimized.op_type(j) == op_type
    }
    if len(neighbours) == 1:
        return neighbours.pop(), "neighbours"
    return None, None


def tensors_gone(index: GraphIndex, optimized: OptimizedGraph, i: int) -> bool:
    """Whether node ``i``'s outputs are gone from the optimized graph or were
    folded into constants (initializers)."""
    live = optimized.index
    return all(
        t in live.initializers or (live.producer_of(t) is None and not live.consumers_of(t)) for t in index.outputs[i]
    )


def absorbed_by_neighbours(index: GraphIndex, found: dict[int, tuple[int | None, str | None]]) -> None:
    """Nodes not found whose upstream and downstream neighbours run in one
    kernel were fused into it (a Cast and a Mul inside a fused MatMul).
    Repeated until nothing changes, so chains of such nodes resolve."""
    changed = True
    while changed:
        changed = False
        for i in index.compute_nodes:
            if found[i][0] is not None:
                continue
            upstream = {found[p][0] for t in index.inputs[i] if (p := index.producer_of(t)) in found}
            downstream = {found[c][0] for t in index.outputs[i] for c in index.consumers_of(t) if c in found}
            shared = (upstream & downstream) - {None}
            if len(shared) == 1:
                found[i] = (shared.pop(), "neighbours")
                changed = True


def map_to_kernels(
    index: GraphIndex, names: list[str], optimized: OptimizedGraph
) -> dict[int, tuple[int | None, bool, str | None]]:
    """Per compute node: ``(optimized node or None, absorbed?, unmapped reason or None)``.

    When several nodes land on one kernel, the one found by name runs it (else
    the first in graph order) and the others were fused into it.
    """
    found = {}
    for i in index.compute_nodes:
        found[i] = find_in_optimized(index, names, optimized, i)
    runner: dict[int, int] = {}
    for i in index.compute_nodes:
        j, how = found[i]
        if j is None or not optimized.index.is_compute(j):
            continue
        current = runner.get(j)
        if current is None or (how == "name" and found[current][1] != "name"):
            runner[j] = i
    absorbed_by_neighbours(index, found)
    mapping: dict[int, tuple[int | None, bool, str | None]] = {}
    for i in index.compute_nodes:
        j, how = found[i]
        if j is None:
            if tensors_gone(index, optimized, i):
                mapping[i] = (None, True, None)  # removed: folded or an Identity
            else:
                mapping[i] = (
                    None,
                    False,
                    "not found in the optimized graph by name, tensor, Q/DQ signature or neighbours",
                )
        else:
            mapping[i] = (j, runner.get(j) != i, None)
    return mapping


def operand_types(optimized: OptimizedGraph, j: int, op_type: str) -> tuple[list[str], list[str], list[str], bool]:
    """Integer types of kernel ``j``'s DQ-fed inputs and Q-read outputs in the optimized graph.

    Returns ``(inputs, weights, outputs, complete)``: lists of type names;
    ``complete`` says whether every input came from a DQ and every output
    went only to Qs, as a fusion needs.
    """
    live, graph = optimized.index, optimized.graph
    inputs: list[str] = []
    weights: list[str] = []
    outputs: list[str] = []
    complete = True
    for k, tensor in enumerate(graph.node[j].input):
        if not tensor:
            continue
        producer = live.producer_of(tensor)
        if producer is None or not live.is_dq[producer]:
            complete = False
            continue
        source = graph.node[producer].input[0]
        kind = dtype_name(optimized.element_type(source)).lower()
        (weights if k in WEIGHT_OPERANDS.get(op_type, ()) else inputs).append(kind)
    for tensor in live.outputs[j]:
        readers = live.consumers_of(tensor)
        if not readers or not all(live.is_q[r] for r in readers):
            complete = False
        outputs += [
            dtype_name(optimized.element_type(graph.node[r].output[0])).lower() for r in readers if live.is_q[r]
        ]
    return inputs, weights, outputs, complete


def float_reason(
    op_type: str, optimized: OptimizedGraph, j: int | None, level: str, provider: str, int8_allowed: bool
) -> Reason:
    """Why a wrapped node still runs a float kernel: ``{"code", "detail"}``."""
    if level == "basic":
        return {"code": REASON_LEVEL, "detail": "QDQ fusions run at the extended level and above"}
    if op_type not in QDQ_FUSIONS.get(provider, ()):
        return {"code": REASON_NO_KERNEL, "detail": f"{provider} has no QDQ fusion for {op_type}"}
    if j is None:
        return {"code": REASON_OTHER, "detail": "its kernel was not found in the optimized graph"}
    inputs, weights, outputs, complete = operand_types(optimized, j, op_type)
    detail = f"inputs {', '.join(inputs) or '-'}"
    if weights:
        detail += f"; weights {', '.join(weights)}"
    detail += f"; outputs {', '.join(outputs) or '-'}"
    if not complete:
        return {
            "code": REASON_OTHER,
            "detail": "in the optimized graph not every input comes from a "
            f"DequantizeLinear or not every output goes only to QuantizeLinear ({detail})",
        }
    if len(set(inputs + outputs)) > 1:
        return {"code": REASON_MIXED, "detail": detail}
    if op_type in INT8_GATED_FUSIONS and set(inputs) == {"int8"} and not int8_allowed:
        return {
            "code": REASON_INT8,
            "detail": f"{detail}; int8 activations need session.qdqisint8allowed=1 (--int8-allowed)",
        }
    return {"code": REASON_OTHER, "detail": f"{detail}; the fusion's other conditions failed"}


def classify_nodes(
    index: GraphIndex, names: list[str], optimized: OptimizedGraph, level: str, provider: str, int8_allowed: bool
) -> tuple[list[NodeRow], list[str]]:
    """The ``nodes`` rows of the runtime answer, in graph order, and the unmapped names."""
    mapping = map_to_kernels(index, names, optimized)
    rows: list[NodeRow] = []
    unmapped: list[str] = []
    j: Any  # None only for a node unmapped or absorbed (removed)
    for i in index.compute_nodes:
        j, absorbed, unmapped_reason = mapping[i]
        wrapped = index.wrapped[i]
        kernel = optimized.op_type(j) if j is not None else None
        runs_in = optimized.graph.node[j].name if j is not None else None
        reason: Reason | None = None
        if unmapped_reason:
            kind = None
            reason = {"code": "unmapped", "detail": unmapped_reason}
            unmapped.append(index.name(i))
        elif absorbed or not optimized.index.is_compute(j):
            kind = "absorbed"
        else:
            kind = kernel_class(optimized, j)
            if kind == "float" and wrapped:
                reason = float_reason(index.op_types[i], optimized, j, level, provider, int8_allowed)
        rows.append(
            {
                "node": index.name(i),
                "op_type": index.op_types[i],
                "wrapped": wrapped,
                "class": kind,
                "kernel": kernel,
                "runs_in": runs_in,
                "reason": reason,
            }
        )
    return rows, unmapped


def runtime_counts(rows: list[NodeRow]) -> RuntimeCounts:
    classes = Counter(row["class"] for row in rows)
    by_op_type: dict[str, dict[str, int]] = {}
    for row in rows:
        if row["class"]:
            counts = by_op_type.setdefault(row["op_type"], {})
            counts[row["class"]] = counts.get(row["class"], 0) + 1
    return {
        "compute": len(rows),
        "wrapped": sum(row["wrapped"] for row in rows),
        "classes": {kind: classes.get(kind, 0) for kind in RUNTIME_CLASSES},
        "wrapped_but_float": sum(1 for row in rows if row["wrapped"] and row["class"] == "float"),
        "float_but_int8": sum(1 for row in rows if not row["wrapped"] and row["class"] == "int8"),
        "by_op_type": {op: dict(sorted(counts.items())) for op, counts in sorted(by_op_type.items())},
    }


@dataclasses.dataclass
class Classification:
    """What onnxruntime runs for each compute node of a model, and the graphs it was read from.

    ``rows``: the runtime answer's ``nodes``, in graph order; ``unmapped``: the
    names no rule found; ``named``: the copy of the model with unique node names
    that the session was built from (its bytes: ``named_bytes``); ``optimized``:
    the graph onnxruntime saved after optimizing it.
    """

    rows: list[NodeRow]
    unmapped: list[str]
    named: onnx.ModelProto
    named_bytes: bytes
    optimized_model: onnx.ModelProto
    optimized: OptimizedGraph

    @property
    def counts(self) -> RuntimeCounts:
        """The runtime answer's counts: compute, wrapped, classes, ..., by_op_type."""
        return runtime_counts(self.rows)


def classify(
    model: onnx.ModelProto,
    path: str,
    level: str = "extended",
    provider: str = CPU,
    int8_allowed: bool = False,
    optimized: onnx.ModelProto | None = None,
) -> Classification:
    """What onnxruntime runs for each compute node of ``model`` (read from ``path``,
    which failures name) in one session at ``level`` on ``provider``; ``optimized``: the
    graph a session of ``model`` at that level saved already (used where every node of
    ``model`` has its own name, so that it is the named model's graph too)."""
    check_provider(provider)
    named, names = session_names(model)
    named_bytes = named.SerializeToString()
    if optimized is None or names != [node.name for node in model.graph.node]:
        optimized = optimized_model(named_bytes, path, level, provider, int8_allowed)
    graph = OptimizedGraph(optimized.graph)
    rows, unmapped = classify_nodes(GraphIndex(named.graph), names, graph, level, provider, int8_allowed)
    return Classification(rows, unmapped, named, named_bytes, optimized, graph)


def classes_answer(path: str, level: str, provider: str, int8_allowed: bool) -> dict[str, Any]:
    """The runtime answer's classes for the model at ``path``, without its model name and
    timing: what runtime answers, what check's min_int8 counts, and what a CPU target
    computes in its own interpreter and hands back as JSON."""
    found = classify(load_with_weights(path), path, level, provider, int8_allowed)
    return {
        "environment": environment(level, provider, int8_allowed=int8_allowed),
        **found.counts,
        "nodes": found.rows,
        "unmapped": found.unmapped,
    }
