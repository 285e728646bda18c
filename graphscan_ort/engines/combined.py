"""trace's combined model: one graph that measures every operator at once.

graphscan's combined model holds the quantized model, the float model (its
tensors renamed under its float prefix), every operator's single-op model reading
the float references, and the statistics of each row too big to fetch. Its nodes
are ordered so the two models advance together and each row is measured as soon
as its tensors exist; onnxruntime frees a tensor after its last reader. It runs in
sessions of at most TRACE_SEGMENT_NODES nodes and TRACE_FETCH_BUDGET fetched
bytes, what each fetches measured (Settler) while the next runs, so neither the
tensors held nor the sessions grow with the number of operators. No session per
operator.
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import math
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import EXIT_RUNTIME, GraphIndex, GraphscanError, one_line, shown, subgraphs
from graphscan_ort.engines.measures import (
    TRACE_CHUNK_ELEMENTS,
    ClipCount,
    Comparison,
    comparable_dtype,
    shapes_agree,
    tensor_bytes,
    tensor_dims,
)
from graphscan_ort.shared.graph import fresh_prefix, node_reads, with_outputs
from graphscan_ort.shared.metrics import float32_bounds
from graphscan_ort.shared.sessions import (
    OUT_OF_MEMORY,
    does_not_run,
    open_session,
    run_options,
    session_options,
    shared_arena,
)

if TYPE_CHECKING:
    import numpy.typing as npt

# trace's rows (engines/trace.py's TraceRow, which imports this module): what the combined model reads of one.
TraceRow = Any


# A comparison whose tensors are of known size, with at most TRACE_FETCH_ELEMENTS
# elements each, is fetched and measured in numpy; any other is reduced to scalars
# inside the graph, in float64. The maxima and counts are exact either way; sums of
# squares are added in another order, so an SQNR may differ in the last digits.
TRACE_FETCH_ELEMENTS = 2**22


# A session of graphscan's combined model ends once the tensors it fetches reach
# this many bytes: they are measured while the next session runs and freed before
# the one after.
TRACE_FETCH_BUDGET = 16 * 2**20


FLOAT16, BFLOAT16 = onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16


# graphscan's combined model runs in sessions of at most this many nodes.
TRACE_SEGMENT_NODES = 5000


# Under the prefix no name of either model starts with (``graphscan.`` unless a
# model uses it): row k's single-op model, the float model, the statistics.
ROW_PART, FLOAT_PART, STATS_PART = "row{}/", "float/", "stats/"


def rename_graph(graph: onnx.GraphProto, rename: Callable[[str], str], node_prefix: str) -> None:
    """Rename every tensor of ``graph`` and of its subgraphs in place."""
    for node in graph.node:
        if node.name:
            node.name = node_prefix + node.name
        node.input[:] = [rename(t) if t else t for t in node.input]
        node.output[:] = [rename(t) if t else t for t in node.output]
        for body in subgraphs(node):
            rename_graph(body, rename, node_prefix)
    for info in itertools.chain(graph.input, graph.output, graph.value_info):
        info.name = rename(info.name)
    for init in graph.initializer:
        init.name = rename(init.name)
    for sparse in graph.sparse_initializer:
        sparse.values.name = rename(sparse.values.name)


def schedule(
    entries: list[tuple[int, onnx.GraphProto, int, list[str] | None]],
) -> list[tuple[onnx.GraphProto, int, list[str], list[str]]]:
    """``entries`` (rank, graph, k, reads or None) for node ``graph.node[k]``, as ``(graph, k, reads, writes)``
    in an order that runs each node after its inputs, the ready node of lowest
    rank first (ties: as listed). onnxruntime's PRIORITY_BASED order then runs
    them exactly so."""
    import heapq

    producers, reads, writes = {}, [], []
    for e, (_, graph, k, known) in enumerate(entries):
        node = graph.node[k]
        reads.append(node_reads(node) if known is None else known)
        writes.append([t for t in node.output if t])
        for t in writes[-1]:
            producers[t] = e
    waiting = [0] * len(entries)
    readers: list[list[int]] = [[] for _ in entries]
    for e in range(len(entries)):
        needed = {producers[t] for t in reads[e] if t in producers} - {e}
        waiting[e] = len(needed)
        for producer in needed:
            readers[producer].append(e)
    ready = [(entry[0], e) for e, entry in enumerate(entries) if not waiting[e]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, e = heapq.heappop(ready)
        order.append(e)
        for reader in readers[e]:
            waiting[reader] -= 1
            if not waiting[reader]:
                heapq.heappush(ready, (entries[reader][0], reader))
    placed = set(order)
    order += [e for e in range(len(entries)) if e not in placed]  # a cycle: onnxruntime says so
    return [(entries[e][1], entries[e][2], reads[e], writes[e]) for e in order]


def added_as_soon_as_ready(model: onnx.ModelProto, added: onnx.GraphProto, outputs: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose outputs are ``outputs``, with ``added``'s nodes and
    initializers: the model's own nodes in their order, each added node right when its
    inputs are made (schedule, rank -1). Run in that order (PRIORITY_BASED), an added node
    that reduces a tensor lets it be freed after its last reader, not at the end of the run."""
    entries: list[tuple[int, onnx.GraphProto, int, list[str] | None]]
    entries = [(rank, model.graph, rank, None) for rank in range(len(model.graph.node))]
    entries += [(-1, added, k, None) for k in range(len(added.node))]
    copy = with_outputs(model, outputs)
    del copy.graph.node[:]
    copy.graph.node.extend(graph.node[k] for graph, k, _, _ in schedule(entries))
    copy.graph.initializer.extend(added.initializer)
    return copy


class CombinedModel:
    """Builds graphscan's combined model and says what to fetch from it.

    Quantized nodes keep their names; the float model's tensors and nodes are
    renamed under ``float_prefix`` (the fed inputs are shared); row k's single-op
    model lives under ``row_prefix.format(k)``; statistics under ``stats_prefix``.
    All three start with a prefix that no name of either model starts with.
    """

    def __init__(
        self,
        float_model: onnx.ModelProto,
        quant_model: onnx.ModelProto,
        feeds: dict[str, np.ndarray],
        float_types: dict[str, onnx.TypeProto],
        quant_types: dict[str, onnx.TypeProto],
    ) -> None:
        self.float_model, self.quant_model, self.feeds = float_model, quant_model, feeds
        self.prefix = fresh_prefix(quant_model, float_model)
        self.row_prefix = self.prefix + ROW_PART
        self.float_prefix = self.prefix + FLOAT_PART
        self.stats_prefix = self.prefix + STATS_PART
        self.row_node = re.compile(re.escape(self.prefix) + r"row(\d+)/")
        # Nodes are kept inside GraphProtos (the models' own, graphscan's pool),
        # never as one Python object each: 100,000 rows cost megabytes.
        self.pool = onnx.GraphProto()
        self.float_graph: onnx.GraphProto | None = None  # add_float_model() sets it
        # (rank, graph, node index, the names it reads or None: its own inputs), until scheduled
        self.entries: list[tuple[int, onnx.GraphProto, int, list[str] | None]] = [
            (rank, quant_model.graph, rank, None) for rank in range(len(quant_model.graph.node))
        ]
        self.fetch: list[str]
        self.fetch_set: set[str]
        self.fetch, self.fetch_set = [], set()
        self.fetch_rank: dict[str, int] = {}  # fetched float tensor -> lowest rank of a row that fetches it
        self.fetch_bytes: dict[str, int] = {}  # fetched tensor -> its bytes, where known
        self.measurements: list[Comparison | ClipCount]
        self.measurements = []  # every Comparison and ClipCount, settled as their tensors arrive
        self.keep = False  # whether run_combined keeps every fetched array (``--save`` reads them)
        self.reduced = False  # whether any measurement is reduced in the graph
        self.count = 0
        self.types: dict[str, onnx.TypeProto | None] = dict(quant_types)
        self.types.update((self.float_name(t), info) for t, info in float_types.items())
        self.end = len(quant_model.graph.node)
        self.feed_sizes = {
            name: declared_sizes(name, value, (float_model, quant_model)) for name, value in feeds.items()
        }

    def float_name(self, tensor: str) -> str:
        return tensor if tensor in self.feeds else self.float_prefix + tensor

    def fetched(self, rank: int, names: Iterable[str]) -> None:
        for name in names:
            if name not in self.fetch_set and name not in self.feeds:
                self.fetch.append(name)
                self.fetch_set.add(name)
            self.fetch_rank[name] = min(rank, self.fetch_rank.get(name, rank))

    def fits(self, names: Iterable[str]) -> bool:
        """Whether ``names`` can be fetched: each of known size, at most
        TRACE_FETCH_ELEMENTS. If so, their bytes are noted for segments()."""
        sizes = {n: tensor_bytes(self.types.get(n)) for n in names if n not in self.feeds}
        if any(size is None or size[0] > TRACE_FETCH_ELEMENTS for size in sizes.values()):
            return False
        self.fetch_bytes.update((n, size[1]) for n, size in sizes.items())  # type: ignore[index]  # all known (above)
        return True

    def add_node(self, rank: int, op_type: str, inputs: list[str], **attributes: Any) -> str:
        """One statistics node, made in place in the pool (thousands of them: no helper, no copy)."""
        self.count += 1
        output = f"{self.stats_prefix}{op_type}_{self.count}"
        node = self.pool.node.add()
        node.op_type, node.name = op_type, output
        node.input.extend(inputs)
        node.output.append(output)
        for key, value in attributes.items():
            node.attribute.append(onnx.helper.make_attribute(key, value))
        self.entries.append((rank, self.pool, len(self.pool.node) - 1, list(inputs)))
        return output

    def add_nodes(self, rank: int, nodes: Iterable[onnx.NodeProto]) -> None:
        for node in nodes:
            self.pool.node.append(node)
            self.entries.append((rank, self.pool, len(self.pool.node) - 1, node_reads(node)))

    def add_constant(self, array: npt.ArrayLike) -> str:
        self.count += 1
        name = f"{self.stats_prefix}constant_{self.count}"
        self.pool.initializer.append(onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def as_double(self, rank: int, tensor: str) -> str:
        type_proto = self.types.get(tensor)
        if type_proto is not None and type_proto.tensor_type.elem_type in (FLOAT16, BFLOAT16):
            # onnxruntime computes many 16-bit ops in float32 between Casts it inserts, and
            # merges its Cast back to 16 bits with this one, skipping the rounding: an
            # Identity between them keeps the tensor as the model holds it.
            tensor = self.add_node(rank, "Identity", [tensor])
        return self.add_node(rank, "Cast", [tensor], to=onnx.TensorProto.DOUBLE)

    def compare(
        self, rank: int, reference: str, value: str, signal: bool = False, fetch: bool = False
    ) -> Comparison | None:
        """A Comparison of two tensors (fetched when ``fetch``, else reduced in
        the graph), or None when their types rule it out."""
        first, second = self.types.get(reference), self.types.get(value)
        if not (comparable_dtype(first) and comparable_dtype(second)) or shapes_agree(first, second) is False:
            return None
        comparison = Comparison(reference, value, signal)
        self.measurements.append(comparison)
        if fetch:
            self.fetched(rank, [reference, value])
            return comparison
        scalars: dict[str, str | list[str]]
        scalars, agree = {}, shapes_agree(first, second)
        pieces: Iterable[tuple[str, ...]]
        if agree is None:
            # Shapes only known at run time: compare flat prefixes of one
            # length (each cut to the other's size), so the Sub always runs,
            # and fetch both shapes.
            flat, one, start = self.add_constant([-1]), self.add_constant([1]), self.add_constant([0])
            ref, val = self.add_node(rank, "Reshape", [reference, flat]), self.add_node(rank, "Reshape", [value, flat])
            ref_size = self.add_node(rank, "Reshape", [self.add_node(rank, "Size", [ref]), one])
            val_size = self.add_node(rank, "Reshape", [self.add_node(rank, "Size", [val]), one])
            pieces = [
                (
                    self.add_node(rank, "Slice", [ref, start, val_size]),
                    self.add_node(rank, "Slice", [val, start, ref_size]),
                )
            ]
            scalars["shapes"] = [self.add_node(rank, "Shape", [reference]), self.add_node(rank, "Shape", [value])]
        else:
            pieces = self.chunks(rank, [reference, value], math.prod(tensor_dims(first)))  # type: ignore[arg-type]
        maxima, noises, signals = [], [], []
        for ref_piece, val_piece in pieces:
            ref, val = self.as_double(rank, ref_piece), self.as_double(rank, val_piece)
            difference = self.add_node(rank, "Sub", [ref, val])
            maxima.append(self.add_node(rank, "ReduceMax", [self.add_node(rank, "Abs", [difference])], keepdims=0))
            noises.append(self.add_node(rank, "ReduceSumSquare", [difference], keepdims=0))
            if signal:
                signals.append(self.add_node(rank, "ReduceSumSquare", [ref], keepdims=0))
        scalars["max"] = self.combine(rank, "Max", maxima)
        scalars["noise"] = self.combine(rank, "Sum", noises)
        if signal:
            scalars["signal"] = self.combine(rank, "Sum", signals)
        comparison.scalars = scalars
        self.reduced = True
        self.fetched(rank, comparison.names())
        return comparison

    def chunks(self, rank: int, tensors: list[str], elements: int) -> Iterator[tuple[str, ...]]:
        """Yield ``tensors`` (of ``elements`` values each) as tuples of flat slices
        of at most TRACE_CHUNK_ELEMENTS, each slice's nodes made as it is asked
        for, so each slice is measured and freed before the next is cut."""
        if elements <= TRACE_CHUNK_ELEMENTS:
            yield tuple(tensors)
            return
        flat = self.add_constant([-1])
        flats = [self.add_node(rank, "Reshape", [t, flat]) for t in tensors]
        for begin in range(0, elements, TRACE_CHUNK_ELEMENTS):
            starts, ends = self.add_constant([begin]), self.add_constant([begin + TRACE_CHUNK_ELEMENTS])
            yield tuple(self.add_node(rank, "Slice", [t, starts, ends]) for t in flats)

    def combine(self, rank: int, op_type: str, scalars: list[str]) -> str:
        return scalars[0] if len(scalars) == 1 else self.add_node(rank, op_type, scalars)

    def clip_count(self, rank: int, tensor: str, lo: float, hi: float, fetch: bool) -> ClipCount | None:
        """A ClipCount of ``tensor``; counted in numpy when ``fetch`` (its row is fetched)."""
        count = ClipCount(tensor, lo, hi)
        type_proto = self.types.get(tensor)
        if not comparable_dtype(type_proto):
            return None
        self.measurements.append(count)
        if fetch:
            self.fetched(rank, [tensor])
            return count
        if type_proto is not None and type_proto.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            values, bounds = tensor, float32_bounds(lo, hi)
        else:
            values, bounds = self.as_double(rank, tensor), (np.float64(lo), np.float64(hi))
        outside = self.add_node(
            rank,
            "Or",
            [
                self.add_node(rank, "Less", [values, self.add_constant(bounds[0])]),
                self.add_node(rank, "Greater", [values, self.add_constant(bounds[1])]),
            ],
        )
        elements = tensor_bytes(type_proto)
        wide = elements is None or elements[0] >= 2**31
        flags = self.add_node(rank, "Cast", [outside], to=onnx.TensorProto.INT64 if wide else onnx.TensorProto.INT32)
        total = self.add_node(rank, "ReduceSum", [flags], keepdims=0)
        count.scalars = [total, elements[0] if elements else self.add_node(rank, "Size", [tensor])]
        self.reduced = True
        self.fetched(rank, count.names())
        return count

    def add_row(
        self, k: int, row: TraceRow, quant_index: GraphIndex, save: bool
    ) -> tuple[Comparison | None, Comparison | None, ClipCount | None, str | None]:
        """Row ``k``'s single-op model and measurements: ``(isolated, propagated,
        clip, single-op output)``, each None where it does not apply. A row's
        tensors are all fetched (``save`` fetches every row with a single-op model) or all
        reduced."""
        rank = row.i
        reference = self.float_name(row.reference) if row.reference is not None else None
        isolated = propagated = clip = op_output = None
        fed = {}
        if row.op is not None:
            prefix = self.row_prefix.format(k)
            fed = {t: (self.float_name(r) if r is not None else t) for t, r in row.op.feeds.items()}
            # Initializers and dequantized weights are the quantized model's own tensors.
            keep = set(row.op.initializers)
            keep.update(t for j in row.op.weight_nodes for t in quant_index.outputs[j])

            def rename(tensor: str) -> str:
                return fed.get(tensor) or (tensor if tensor in keep else prefix + tensor)

            self.add_nodes(rank, row.op.node_protos(rename, prefix, skip=row.op.weight_nodes))
            op_output = rename(row.op.output)
            self.types.setdefault(op_output, self.types.get(row.op.output))
        needed = [reference, op_output, row.seen] if reference is not None else []
        needed += [row.output] if row.clip is not None else []
        fetch = (save and row.op is not None) or self.fits([n for n in needed if n])
        if reference is not None:
            if op_output is not None:
                isolated = self.compare(rank, reference, op_output, fetch=fetch)
            if row.seen:
                # Ranked after what makes the value, so the reference waits for it.
                seen_rank = max(rank, quant_index.producer.get(row.seen, rank))
                propagated = self.compare(seen_rank, reference, row.seen, signal=True, fetch=fetch)
        if row.clip is not None:
            lo, hi = row.clip
            clip = self.clip_count(rank, row.output, lo, hi, fetch=fetch)
        if save and row.op is not None:
            self.fetched(rank, fed.values())
        return isolated, propagated, clip, op_output

    def add_float_model(self) -> None:
        """The float graph, renamed, each node ranked by the first row that needs it;
        nodes no row needs are left out."""
        graph = onnx.GraphProto()
        graph.CopyFrom(self.float_model.graph)
        rename_graph(graph, self.float_name, self.float_prefix)
        wanted: dict[str, int] = {}  # float tensor -> lowest rank of a reader
        for rank, source, _, reads in self.entries:
            if source is not self.pool or reads is None:
                continue  # only graphscan's own nodes read float tensors (and list what they read)
            for tensor in reads:
                if tensor.startswith(self.float_prefix):
                    wanted[tensor] = min(rank, wanted.get(tensor, rank))
        for name, rank in self.fetch_rank.items():
            if name.startswith(self.float_prefix):
                wanted[name] = min(rank, wanted.get(name, rank))
        ranked = []
        for k in range(len(graph.node) - 1, -1, -1):
            node = graph.node[k]
            ranks = [wanted[t] for t in node.output if t in wanted]
            if not ranks:
                continue
            rank = min(ranks)
            reads = node_reads(node)
            for tensor in reads:
                wanted[tensor] = min(rank, wanted.get(tensor, rank))
            ranked.append((rank, graph, k, reads))
        self.entries.extend(reversed(ranked))
        self.float_graph = graph

    def header(self) -> onnx.ModelProto:
        """An empty ModelProto with what every segment shares: IR, opsets, functions."""
        model = onnx.ModelProto()
        for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version"):
            setattr(model, field, getattr(self.quant_model, field))
        model.ir_version = max(model.ir_version, self.float_model.ir_version)
        model.opset_import.extend(self.quant_model.opset_import)
        quant_opsets = {o.domain or "ai.onnx" for o in model.opset_import}
        model.opset_import.extend(
            o for o in self.float_model.opset_import if (o.domain or "ai.onnx") not in quant_opsets
        )
        model.functions.extend(self.quant_model.functions)
        known = {(f.domain, f.name) for f in model.functions}
        model.functions.extend(f for f in self.float_model.functions if (f.domain, f.name) not in known)
        return model

    def unscheduled(self) -> onnx.ModelProto | None:
        """When every row is fetched, all within one session's budget, and the
        nodes fit one segment, order cannot matter to memory: the whole combined
        model as built, copied in bulk, no schedule to pay for."""
        one_session = len(self.entries) <= TRACE_SEGMENT_NODES and self.fetched_bytes(self.fetch) <= TRACE_FETCH_BUDGET
        if self.reduced or not one_session:
            return None
        model = self.header()
        graph = model.graph
        graph.name = "graphscan_combined"
        graph.node.extend(self.quant_model.graph.node)
        graph.node.extend(self.pool.node)
        assert self.float_graph is not None, "add_float_model() comes first"
        graph.node.extend([source.node[k] for _, source, k, _ in self.entries if source is self.float_graph])
        for source in (self.quant_model.graph, self.float_graph, self.pool):
            graph.initializer.extend(source.initializer)
            graph.sparse_initializer.extend(source.sparse_initializer)
        graph.input.extend(declared_input(name, value, self.feed_sizes.get(name)) for name, value in self.feeds.items())
        graph.output.extend(onnx.ValueInfoProto(name=t) for t in self.fetch)
        return model

    def fetched_bytes(self, names: Iterable[str]) -> int:
        """Bytes of the fetched tensors among ``names``, where known."""
        return sum(self.fetch_bytes.get(t, 0) for t in names if t in self.fetch_set)

    def segments(self) -> list[list[tuple[onnx.GraphProto, int, list[str], list[str]]]]:
        """The scheduled nodes cut into runs of at most TRACE_SEGMENT_NODES nodes,
        each ending once what it fetches reaches TRACE_FETCH_BUDGET bytes."""
        order = schedule(self.entries)
        self.entries = []  # scheduled: freed
        segments, current, held = [], [], 0
        for entry in order:
            current.append(entry)
            held += self.fetched_bytes(entry[3])
            if len(current) >= TRACE_SEGMENT_NODES or held >= TRACE_FETCH_BUDGET:
                segments.append(current)
                current, held = [], 0
        return segments + [current] if current else segments

    def initializer_protos(self) -> dict[str, onnx.TensorProto]:
        """``{name: TensorProto}`` of every initializer a node may read."""
        protos: dict[str, onnx.TensorProto] = {}
        for graph in (self.quant_model.graph, self.float_graph, self.pool):
            if graph is not None:
                protos.update((init.name, init) for init in graph.initializer)
                protos.update((sparse.values.name, sparse) for sparse in graph.sparse_initializer)
        return protos


def declared_sizes(name: str, value: object, models: Iterable[onnx.ModelProto]) -> list[int | None] | None:
    """The sizes to declare for a fed graph input: each one both models declare
    as that size, else unknown; None when the value is not a tensor."""
    if not isinstance(value, np.ndarray):
        return None
    sizes = list(value.shape)
    for model in models:
        info = next((i for i in model.graph.input if i.name == name), None)
        dims = tensor_dims(info.type) if info is not None else None
        if dims is None or len(dims) != len(sizes):
            return [None] * len(sizes)
        sizes = [size if size == declared else None for size, declared in zip(sizes, dims)]
    return sizes


def float_in_quant_opset(float_model: onnx.ModelProto, quant_model: onnx.ModelProto, a: str, b: str) -> onnx.ModelProto:
    """The float model at the quantized model's default opset, so both run in one session."""

    def default_opset(model: onnx.ModelProto) -> int | None:
        return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)

    wanted, have = default_opset(quant_model), default_opset(float_model)
    if wanted is None or have is None or wanted == have:
        return float_model
    try:
        return onnx.version_converter.convert_version(float_model, wanted)
    except Exception as exc:
        raise GraphscanError(
            f"{a}: opset {have} cannot join {b}'s opset {wanted} in graphscan's combined model ({one_line(exc)})",
            EXIT_RUNTIME,
        )


def combined_options() -> Any:
    """onnxruntime options for graphscan's combined model: the graph as written, run in our order."""
    # Without disable_quant_qdq onnxruntime gives each DQ read by our statistics a copy of
    # its own, appended after every other node, which would run last and hold memory.
    config = {"session.disable_quant_qdq": "1"}
    if shared_arena():
        config["session.use_env_allocators"] = "1"
    # One thread: its tensors are small and its sessions many, so a thread pool per
    # session costs more than it gives, and the answers cannot depend on the cores.
    options = session_options(threads=1, config=config)
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED  # the order schedule() chose
    return options


def declared_input(name: str, value: object, sizes: list[int | None] | None = None) -> onnx.ValueInfoProto:
    """A graph input typed from the value fed to it: its element type and rank,
    with ``sizes`` (None: every dimension unknown). Concrete sizes would let
    onnxruntime's shape inference refuse an If branch that never runs, which the
    model's own looser declarations pass."""
    if isinstance(value, np.ndarray):
        elem_type = onnx.TensorProto.STRING if value.dtype == object else None
        elem_type = elem_type or onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
        return onnx.helper.make_tensor_value_info(name, elem_type, sizes or [None] * value.ndim)
    if isinstance(value, list):
        elem_type = onnx.helper.np_dtype_to_tensor_dtype(value[0].dtype) if value else onnx.TensorProto.FLOAT
        return onnx.helper.make_tensor_sequence_value_info(name, elem_type, None)
    raise GraphscanError(f"tensor {name!r} cannot be passed between graphscan's sessions", EXIT_RUNTIME)


class Settler:
    """Settles each measurement (its ``outcome``) as soon as the fetched arrays
    it holds include every tensor it reads, then drops each array no unsettled
    measurement reads, unless ``keep``: what is fetched is freed as it is measured."""

    def __init__(self, measurements: list[Comparison | ClipCount], feeds: dict[str, np.ndarray], keep: bool) -> None:
        self.measurements, self.feeds, self.keep = measurements, feeds, keep
        self.held: dict[str, Any] = {}  # fetched name -> array, until nothing unsettled reads it
        self.missing: list[int] = []
        self.readers: dict[str, list[int]] = {}
        for m, measurement in enumerate(measurements):
            names = [n for n in dict.fromkeys(measurement.names()) if n not in feeds]
            self.missing.append(len(names))
            for name in names:
                self.readers.setdefault(name, []).append(m)
        self.unread = {name: len(readers) for name, readers in self.readers.items()}
        for m, missing in enumerate(self.missing):
            if not missing:  # reads only the feeds
                self.settle(m)

    def arrived(self, fetched: dict[str, Any]) -> None:
        """``fetched`` (``{name: array}``) just came out of a session."""
        self.held.update(fetched)
        for name in fetched:
            for m in self.readers.get(name, ()):
                self.missing[m] -= 1
                if not self.missing[m]:
                    self.settle(m)

    def settle(self, m: int) -> None:
        measurement = self.measurements[m]
        measurement.outcome = measurement.result(collections.ChainMap(self.held, self.feeds))
        for name in dict.fromkeys(measurement.names()):
            if name in self.unread:
                self.unread[name] -= 1
                if not self.unread[name] and not self.keep:
                    self.held.pop(name, None)


def run_combined(
    combined: CombinedModel, feeds: dict[str, np.ndarray], a: str, b: str, rows: list[TraceRow]
) -> dict[str, Any]:
    """Run graphscan's combined model, settling every measurement; returns
    ``{fetched name: value}`` of what is kept (everything with ``combined.keep``).

    The scheduled nodes run in segments of at most TRACE_SEGMENT_NODES, one
    session each, the tensors a later segment reads handed over: the session
    size, like the tensors, stays bounded however many operators there are.
    A segment also ends once it has fetched TRACE_FETCH_BUDGET bytes; those are
    measured by a second thread while the next segment runs (onnxruntime runs on
    one), and freed before the one after.
    A failure is blamed on the model it comes from: the float model, the
    quantized one, or graphscan's own single-op model of a row's node.
    """
    options, ran_with = combined_options(), run_options()
    settler = Settler(combined.measurements, feeds, combined.keep)
    whole = combined.unscheduled()
    if whole is not None and not whole.graph.node and not combined.fetch:
        return settler.held  # nothing to run or fetch (every output a graph input): onnxruntime refuses such a graph
    if whole is not None:
        values = run_segment(whole, combined.feeds, combined.fetch, options, ran_with, a, b, rows, combined)
        settler.arrived(dict(zip(combined.fetch, values)))
        return settler.held
    import concurrent.futures  # only here: a model of one session never starts a thread

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        measuring = None
        for fetched in segment_results(combined, feeds, options, ran_with, a, b, rows):
            if measuring is not None:
                measuring.result()  # the segment before is measured and freed
            measuring = pool.submit(settler.arrived, fetched)
            del fetched
        if measuring is not None:
            measuring.result()
    return settler.held


def segment_results(
    combined: CombinedModel,
    feeds: dict[str, np.ndarray],
    options: Any,
    ran_with: Any,
    a: str,
    b: str,
    rows: list[TraceRow],
) -> Iterator[dict[str, Any]]:
    """Run the scheduled segments one session each; yield what each fetches,
    ``{name: array}``, after the fetched initializers."""
    segments = combined.segments()
    initializers = combined.initializer_protos()
    fetch = combined.fetch_set
    last_reader, constants = {}, {}
    reads: Collection[str]
    for s, segment in enumerate(segments):
        for graph, k, reads, writes in segment:
            for tensor in reads:
                last_reader[tensor] = s
            if not reads and len(writes) == 1 and graph.node[k].op_type == "Constant":
                constants[writes[0]] = graph.node[k]
    # A Constant is copied into each segment that reads it, never handed over:
    # onnxruntime makes it an initializer (a MatMul then prepacks it), so a fed
    # copy would change the arithmetic.
    last_reader = {t: s for t, s in last_reader.items() if t not in constants}
    # A fetched initializer (a graph output no node writes) comes out of no session.
    yield {
        t: onnx.numpy_helper.to_array(initializers[t])
        for t in fetch
        if isinstance(initializers.get(t), onnx.TensorProto)
    }
    live = dict(feeds)
    for s, segment in enumerate(segments):
        model = combined.header()
        graph = model.graph
        graph.name = f"graphscan_segment_{s}"
        graph.node.extend([source.node[k] for source, k, _, _ in segment])
        reads = dict.fromkeys(itertools.chain.from_iterable(r for _, _, r, _ in segment))
        written = list(itertools.chain.from_iterable(w for _, _, _, w in segment))
        produced = set(written)
        copied = [t for t in reads if t in constants and t not in produced]
        graph.node.extend(constants[t] for t in copied)
        produced.update(copied)
        inputs = [t for t in reads if t in live and t not in produced]
        graph.input.extend(declared_input(t, live[t], combined.feed_sizes.get(t)) for t in inputs)
        for tensor in reads:
            proto = initializers.get(tensor)
            if proto is None or tensor in produced or tensor in live:
                continue
            (graph.sparse_initializer if isinstance(proto, onnx.SparseTensorProto) else graph.initializer).append(proto)
        outputs = [t for t in written if t in fetch or last_reader.get(t, -1) > s]
        if not outputs:
            continue
        graph.output.extend(onnx.ValueInfoProto(name=t) for t in outputs)
        values = run_segment(model, {t: live[t] for t in inputs}, outputs, options, ran_with, a, b, rows, combined)
        del model, graph
        live.update((t, v) for t, v in zip(outputs, values) if last_reader.get(t, -1) > s)
        fetched = {t: v for t, v in zip(outputs, values) if t in fetch}
        del values
        for tensor in [t for t in live if last_reader.get(t, -1) <= s]:
            del live[tensor]
        yield fetched
        del fetched


class SingleOpModelError(GraphscanError):
    """graphscan's own single-op model of row ``row`` does not run (``reason``: onnxruntime's line)."""

    def __init__(self, message: str, row: int, reason: str) -> None:
        super().__init__(message, EXIT_RUNTIME)
        self.row, self.reason = row, reason


def run_segment(
    model: onnx.ModelProto,
    feeds: dict[str, Any],
    outputs: list[str],
    options: Any,
    ran_with: Any,
    a: str,
    b: str,
    rows: list[TraceRow],
    names: CombinedModel,
) -> list[Any]:
    """One session of graphscan's combined model; blames failures as run_combined says."""
    combined = f"graphscan's combined model of {shown(a)} and {shown(b)}"
    try:
        data = model.SerializeToString()
        with contextlib.redirect_stdout(io.StringIO()):  # onnxruntime's "EP Error" prints: stdout is the answer's
            session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        del data  # the session has its own copy; the run needs the memory
        if not outputs:  # nothing to compare (the session was still built and checked)
            return []
        return session.run(outputs, feeds, ran_with)
    except MemoryError as exc:
        raise GraphscanError(f"{combined}: out of memory ({one_line(exc)})", EXIT_RUNTIME)
    except Exception as exc:
        text = str(exc)
        if OUT_OF_MEMORY.search(text):
            raise GraphscanError(f"{combined}: out of memory ({one_line(exc)})", EXIT_RUNTIME)
        found = re.search(r"Name:'([^']*)'|[Nn]ode \(([^)]*)\)", text)
        node = (found.group(1) or found.group(2) or "") if found else ""
        row = names.row_node.match(node)
        if row:
            k = int(row.group(1))
            message = (
                f"{shown(b)}: graphscan's own single-op model for node {rows[k].name!r} does not run in onnxruntime"
            )
            raise SingleOpModelError(f"{message} ({one_line(exc)})", k, one_line(exc))
        if node.startswith(names.float_prefix):
            subject = f"{shown(a)}: model"
        elif node.startswith(names.stats_prefix):
            subject = combined
        elif node:
            subject = f"{shown(b)}: model"
        else:  # onnxruntime names no node: blame a user's model only if it fails alone
            subject = culprit(names, a, b, combined)
        raise does_not_run(subject, exc)


def culprit(names: CombinedModel, a: str, b: str, combined: str) -> str:
    """Who to blame for a failure of graphscan's combined model that names no
    node: the quantized or the float model when it cannot be built alone, else
    graphscan's combined model itself."""
    for model, path in ((names.quant_model, b), (names.float_model, a)):
        try:
            open_session(model, f"{shown(path)}: model")
        except GraphscanError:
            return f"{shown(path)}: model"
    return combined
