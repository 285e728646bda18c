"""impact's derived model as a chain of segment sessions.

A variant changes the graph only from its sites on, and only along their
cone. The derived model's data-dependent nodes are cut into segments of
about equal work, each its own session: "plain" (the quantized model's
nodes, no switch machinery) or with the Where and Clip nodes of some or all
of its sites (see SegmentPlan). The baseline run keeps every value that
crosses a segment boundary as an OrtValue; a variant runs only the segments
of its cone, switched only where its own sites are, and reads every other
value from the baseline's without a copy. Nodes that read no data (weight
DQs, Constants) run once, before everything.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import shown
from graphscan_ort.shared.graph import body_reads, dense_initializer
from graphscan_ort.shared.sessions import (
    does_not_run,
    open_session,
    shared_arena_options,
    shrink_shared_arena,
    usable_cores,
)

# A variant changes the graph only from its sites on, and only along their
# cone. The derived model's data-dependent nodes are cut into segments of
# about equal work, each its own session: "plain" (the quantized model's
# nodes, no switch machinery) or with the Where and Clip nodes of some or all
# of its sites (see SegmentPlan). The baseline run keeps every value that
# crosses a segment boundary as an OrtValue; a variant runs only the segments
# of its cone, switched only where its own sites are, and reads every other
# value from the baseline's without a copy. Nodes that read no data (weight
# DQs, Constants) run once, before everything.
IMPACT_PREFIX = "graphscan."  # every node and tensor the derived model adds


IMPACT_SEGMENTS = 16


SWITCH_GROUPS = 8


# Segment sessions kept at once, the least recently used closed beyond (built again when a
# later variant needs it: the same results). Each holds its graph and kernels: about 7 MB
# on PP-OCRv4's detector, whose ranking built 123 of them (0.85 GiB held to the end). impact
# of the prepared detector on one page at 768x896 peaked at 1,398 MB with 24 (51.1 s), 1,300
# MB with 12 (50.9 s), 1,139 MB with 8 (55.5 s); tune at real page sizes at 2,152 MB with 24,
# 1,913 MB with 12, the exclusions' stage 34 s with either.
MAX_SESSIONS = 12


# Variants of one sample run at once by run_each: each run in flight holds its own tensors.
# tune's ranking of the page-size detector's 292 operators on one page at 768x896: 11.5 s
# two at a time on a thread each, 18.2 s one at a time on two.
RUNS_AT_ONCE = 2


PLAIN, FULL = "plain", "switched"  # segment versions besides the groups 0 .. SWITCH_GROUPS - 1


ORT_TENSOR_TYPES = {onnx.TensorProto.DataType.Name(t).lower(): t for t in onnx.TensorProto.DataType.values()}


class Unsegmentable(Exception):
    """A value crosses a segment boundary that a segment's inputs cannot declare (not a tensor)."""


def outer_reads(node: onnx.NodeProto, defined: set[str]) -> list[str]:
    """The names ``node`` reads from its graph: its inputs, then the names from ``defined`` its bodies read."""
    return [t for t in node.input if t] + sorted(body_reads(node) & defined)


def topological_nodes(
    nodes: list[onnx.NodeProto], reads: Callable[[onnx.NodeProto], list[str]]
) -> list[onnx.NodeProto]:
    """``nodes`` in an order where every producer comes first; each node stays
    where it was unless a node it reads from comes later. ``reads(node)``: the
    names it reads, bodies included."""
    producer = {t: k for k, node in enumerate(nodes) for t in node.output if t}
    emitted, order = [False] * len(nodes), []
    for root in range(len(nodes)):
        stack = [(root, False)]
        while stack:
            k, ready = stack.pop()
            if emitted[k]:
                continue
            if ready:
                emitted[k] = True
                order.append(k)
                continue
            stack.append((k, True))
            for t in reversed(reads(nodes[k])):
                j = producer.get(t)
                if j is not None and not emitted[j] and j != k:
                    stack.append((j, False))
    return [nodes[k] for k in order]


def known_shapes(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], sample: dict[str, np.ndarray]
) -> dict[str, list[int]]:
    """``{tensor: dims}`` for every tensor whose shape inference gives in full,
    with the graph inputs shaped as in ``sample``."""
    typed = onnx.ModelProto()
    typed.CopyFrom(model)
    del typed.graph.node[:]
    typed.graph.node.extend(nodes)
    for info in typed.graph.input:
        if info.name in sample and info.type.HasField("tensor_type"):
            shape = info.type.tensor_type.shape
            del shape.dim[:]
            for size in np.shape(sample[info.name]):
                shape.dim.add().dim_value = size
    with contextlib.suppress(Exception):  # else: the shapes the model already declares
        typed = onnx.shape_inference.infer_shapes(typed, strict_mode=False, data_prop=True)
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    for info in [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes[info.name] = [d.dim_value for d in tensor.shape.dim]
    return shapes


def node_work(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """A node's rough work: its output elements, times the length of the sums
    behind each for Conv, ConvTranspose, MatMul and Gemm; None when unknown."""
    outputs: list[Any] = [shapes.get(t) for t in node.output if t]
    if not outputs or None in outputs:
        return None
    elements = sum(math.prod(dims) for dims in outputs)
    read: list[Any] = [shapes.get(t) if t else None for t in node.input]
    if node.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm") and (len(read) < 2 or None in read[:2]):
        return None
    if node.op_type == "Conv":
        return elements * math.prod(read[1][1:])
    if node.op_type == "ConvTranspose":  # each input element feeds M/group x kernel outputs
        return math.prod(read[0]) * math.prod(read[1][1:])
    if node.op_type == "MatMul":
        return elements * (read[0][-1] if read[0] else 1)
    if node.op_type == "Gemm":
        trans = any(a.name == "transA" and a.i for a in node.attribute)
        return elements * (read[0][0 if trans else -1] if read[0] else 1)
    return elements


def equal_work_chunks(
    nodes: list[onnx.NodeProto], works: list[int | None] | list[float], count: int
) -> list[list[onnx.NodeProto]]:
    """``nodes`` (in order) cut into at most ``count`` runs of about equal work;
    a node of unknown work counts as the median node."""
    import statistics

    known = [w for w in works if w is not None]
    fill = statistics.median(known) if known else 1
    works = [max(1, fill if w is None else w) for w in works]
    done: float
    total, done, cut, starts = sum(works), 0, 1, [0]
    for i, work in enumerate(works):
        while cut < count and done >= total * cut / count:
            if i > starts[-1]:
                starts.append(i)
            cut += 1
        done += work
    return [nodes[a:b] for a, b in zip(starts, [*starts[1:], len(nodes)])]


class SegmentPlan:
    """The cut of a derived model into segments of data-dependent nodes; which
    segments a variant needs, in which version; each version's model.

    ``constant_nodes`` read no data and run once. ``selections`` are the
    weights' Wheres, ``(output, condition, on, off)``: both choices are
    constants, so the runner binds one instead of running a node. A segment's
    machinery is split in SWITCH_GROUPS groups by the position of the node it
    feeds: version g of a segment has only group g's machinery, version FULL
    all of it, PLAIN none. With ``count`` 1 the one segment is the whole model.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        data_inputs: list[str],
        switches: set[str],
        machinery: set[str],
        count: int,
        sample: dict[str, np.ndarray],
        prefix: str = IMPACT_PREFIX,
    ) -> None:
        graph = self.graph = model.graph
        self.prefix = prefix  # of every name the derived model adds
        self.machinery = machinery  # names of the nodes graphscan added
        initializers = [*graph.initializer, *map(dense_initializer, graph.sparse_initializer)]
        self.initializers = {init.name: init for init in initializers if init.name not in data_inputs}
        defined = {t for node in graph.node for t in node.output if t}
        defined |= {i.name for i in graph.input} | set(self.initializers)
        nodes = list(graph.node)  # one wrapper per node: ids below name them
        self.reads = {id(node): outer_reads(node, defined) for node in nodes}
        nodes = topological_nodes(nodes, lambda node: self.reads[id(node)])
        data_tensors = set(data_inputs)
        self.constant_nodes, self.selections, dependent = [], [], []
        for node in nodes:
            reads_data = not data_tensors.isdisjoint(self.reads[id(node)])
            selection = node.op_type == "Where" and node.name in machinery and node.input[0] in switches
            if count > 1 and selection and not reads_data:  # a weight's Where
                self.selections.append((node.output[0], *node.input))
                continue
            # Other machinery runs only in a switched segment.
            if count == 1 or node.name in machinery or reads_data:
                data_tensors.update(t for t in node.output if t)
                dependent.append(node)
            else:
                self.constant_nodes.append(node)
        if count == 1 or not dependent:
            self.chunks = [dependent]
        else:
            shapes = known_shapes(model, nodes, sample)
            self.chunks = equal_work_chunks(dependent, [node_work(n, shapes) for n in dependent], count)
        self.segment_of = {id(node): j for j, chunk in enumerate(self.chunks) for node in chunk}
        self.made_by = {t: node for node in nodes for t in node.output if t}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in nodes:
            for t in self.reads[id(node)]:
                self.consumers.setdefault(t, []).append(node)
        graph_outputs = self.graph_outputs = [o.name for o in graph.output]
        wanted = set(graph_outputs) | {t for selection in self.selections for t in selection[2:]}
        self.leaving: list[list[str]] = [[] for _ in self.chunks]
        for j in reversed(range(len(self.chunks))):
            made = [t for node in self.chunks[j] for t in node.output if t]
            self.leaving[j] = [t for t in made if t in wanted]
            wanted.update(t for node in self.chunks[j] for t in self.reads[id(node)])
        # by now, wanted: every name a segment or a selection reads, and the outputs
        self.constant_outputs = [t for node in self.constant_nodes for t in node.output if t in wanted]
        self.groups = self.switch_groups(graph_outputs)
        self.downstream: dict[int, int] = {}  # id(node) -> bit mask of the segments its value reaches
        for node in reversed(dependent):
            mask = 1 << self.segment_of[id(node)]
            for t in node.output:
                for reader in self.consumers.get(t, ()):
                    mask |= self.downstream.get(id(reader), 0)
            self.downstream[id(node)] = mask
        self.template = onnx.ModelProto()
        self.template.CopyFrom(model)
        self.template.ClearField("graph")

    def switch_groups(self, graph_outputs: list[str]) -> dict[int, frozenset[int]]:
        """``{id(machinery node): groups}``: the groups of the nodes of its own
        segment it feeds; every group when a later segment, a body or the graph
        outputs read it."""
        groups: dict[int, frozenset[int]] = {}
        every = frozenset(range(SWITCH_GROUPS))
        for chunk in self.chunks:
            readers = [node for node in chunk if node.name not in self.machinery]
            own = {id(node): k * SWITCH_GROUPS // len(readers) for k, node in enumerate(readers)}
            for node in reversed(chunk):
                if node.name not in self.machinery:
                    continue
                fed: set[int] = set()
                for t in node.output:
                    for reader in self.consumers.get(t, ()):
                        fed.update([own[id(reader)]] if id(reader) in own else groups.get(id(reader), every))
                    if t in graph_outputs:
                        fed.update(every)
                groups[id(node)] = frozenset(fed) or every
        return groups

    def needs(self, names: list[str]) -> dict[int, int | str]:
        """``{segment: version}`` a variant setting the inputs ``names`` runs,
        in order: the segments of its cone, each PLAIN or switched as little as
        its own machinery needs."""
        stack: list[Any]  # names, then nodes
        active, seeds, stack, seen = [], [], list(names), set(names)
        while stack:  # forward through constant nodes, selections and switch machinery
            for node in self.consumers.get(stack.pop(), ()):
                dependent = id(node) in self.segment_of
                if dependent and node.name not in self.machinery:
                    seeds.append(node)
                    continue
                if dependent:
                    active.append(node)
                for t in node.output:
                    if t and t not in seen:
                        seen.add(t)
                        stack.append(t)
        # The machinery feeding active nodes (e.g. the Clip computing float(t)).
        feeding: dict[int, Any] = {id(n): n for n in active}
        stack = list(active)
        while stack:
            for t in self.reads[id(stack.pop())]:
                maker = self.made_by.get(t)
                machine = maker is not None and maker.name in self.machinery and id(maker) in self.segment_of
                if machine and id(maker) not in feeding:
                    feeding[id(maker)] = maker
                    stack.append(maker)
        shared: dict[int, frozenset[int]] = {}  # per segment: the groups all its active machinery is in
        for node in feeding.values():
            j = self.segment_of[id(node)]
            shared[j] = shared.get(j, self.groups[id(node)]) & self.groups[id(node)]
        versions: dict[int, int | str] = {j: min(common) if common else FULL for j, common in shared.items()}
        cone = 0
        for node in seeds + active:
            cone |= self.downstream[id(node)]
        for j in range(len(self.chunks)):
            if cone >> j & 1:
                versions.setdefault(j, PLAIN)
        return dict(sorted(versions.items()))

    def segment_model(
        self, j: int | tuple[str, int] | None, version: int | str, types: dict[str, str]
    ) -> tuple[onnx.ModelProto, list[str], list[str], list[tuple[str, str]]]:
        """``(model, inputs, outputs, aliases)`` of segment j in ``version``:
        ``j`` None is the constant nodes, ``("from", k)`` segments k to the last
        as one (making the graph outputs only). ``types``: ``{name: ORT type}``
        of every value it may read. Machinery a version leaves out passes one
        input on: its output is an ``alias`` ``(name, source)`` for the runner,
        or an Identity where a body reads it."""
        if j is None:
            chunk, leaving = self.constant_nodes, self.constant_outputs
        elif isinstance(j, tuple):
            chunk = [node for later in self.chunks[j[1] :] for node in later]
            leaving = [t for node in chunk for t in node.output if t in self.graph_outputs]
        else:
            chunk, leaving = self.chunks[j], self.leaving[j]
        dropped: dict[str, str] = {}
        for node in chunk:
            if node.name in self.machinery and not (version == FULL or version in self.groups[id(node)]):
                source = node.input[2] if node.op_type == "Where" else node.input[0]
                for t in node.output:
                    dropped[t] = dropped.get(source, source)
        nodes, reads = [], []
        for node in chunk:
            if any(t in dropped for t in node.output):
                continue
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.input[:] = [dropped.get(t, t) for t in node.input]
            nodes.append(copy)
            reads += [dropped.get(t, t) for t in node.input if t]
            reads += self.reads[id(node)][len([t for t in node.input if t]) :]  # read by its bodies
        for t in dict.fromkeys(t for t in reads if t in dropped):  # a body reads a dropped name
            nodes.append(onnx.helper.make_node("Identity", [dropped[t]], [t], name=f"{self.prefix}body/{t}"))
            reads.append(dropped[t])
        made = {t for node in nodes for t in node.output if t}
        outputs, aliases = [], []
        for t in leaving:
            source = dropped.get(t, t)
            if source in made and source not in outputs:
                outputs.append(source)
            if source != t:
                aliases.append((t, source))
        inputs = [t for t in dict.fromkeys(reads) if t not in made and t not in self.initializers]
        infos = []
        for t in inputs:
            kind = types.get(t, "")
            if not (kind.startswith("tensor(") and kind[7:-1] in ORT_TENSOR_TYPES):
                raise Unsegmentable(t)
            infos.append(onnx.helper.make_tensor_value_info(t, ORT_TENSOR_TYPES[kind[7:-1]], None))
        model = onnx.ModelProto()
        model.CopyFrom(self.template)
        model.graph.CopyFrom(
            onnx.helper.make_graph(
                nodes,
                f"graphscan.segment/{segment_name(j)}/{version}",
                infos,
                [onnx.ValueInfoProto(name=t) for t in outputs],
                [self.initializers[t] for t in dict.fromkeys(reads) if t in self.initializers],
            )
        )
        return model, inputs, outputs, aliases


def segment_name(j: int | tuple[str, int] | None) -> str:
    """``constants``, ``3`` or ``from-3``: which nodes a segment model holds."""
    return "constants" if j is None else "-".join(map(str, j)) if isinstance(j, tuple) else str(j)


class SegmentRunner:
    """Runs the derived model as its chain of segment sessions, per sample.

    ``baseline``: per sample, ``{name: OrtValue}`` of every value that crosses
    a segment boundary with no variant on; ``run(settings)``: the graph outputs
    per sample with ``settings`` bound instead of the defaults.
    """

    def __init__(
        self,
        plan: SegmentPlan,
        defaults: dict[str, np.ndarray],
        samples: list[dict[str, np.ndarray]],
        outputs: list[str],
        path: str,
    ) -> None:
        import concurrent.futures
        import threading

        self.plan, self.path, self.outputs = plan, path, list(outputs)
        self.message = f"graphscan's derived model of {shown(path)}"
        self.value = ort.OrtValue.ortvalue_from_numpy
        self.true = self.value(np.array(True))
        # Runs side by side: a sample's each with several, else RUNS_AT_ONCE variants' (run_each).
        # Each on one thread, as impact's float reference (impact_run): a convolution's last bits
        # can depend on how many threads share it (PP-OCRv4 rec's Conv_35 on one page: up to
        # 1.9e-6 apart between one thread and two, 0.26 dB on a tensor's row), so the answer
        # must not depend on the machine's cores. A segment is a few milliseconds of work, which
        # one thread does with less waiting than two.
        workers = min(usable_cores(), max(len(samples), RUNS_AT_ONCE))
        self.threads = 1
        self.workers, self.pool = workers, concurrent.futures.ThreadPoolExecutor(workers)
        self.sessions: dict[
            tuple[int | tuple[str, int] | None, int | str], tuple[Any, list[str], list[str], list[tuple[str, str]]]
        ]
        self.sessions, self.lock = {}, threading.Lock()
        # ("build" or "run", segment, version) -> seconds of its build, of its last run
        self.seconds: dict[tuple[str, int | tuple[str, int] | None, int | str], float] = {}
        shared = {name: self.value(array) for name, array in defaults.items()}
        for _, _, on, off in plan.selections:
            for name in (on, off):
                if name in plan.initializers:
                    shared[name] = self.value(onnx.numpy_helper.to_array(plan.initializers[name]))
        if plan.constant_nodes:
            shared.update(self.step(None, PLAIN, shared))
        self.constants = shared
        shared = {**shared, **{output: shared[off] for output, _, _, off in plan.selections}}
        initial = [
            {**{n: self.value(np.require(a, requirements="C")) for n, a in s.items()}, **shared} for s in samples
        ]
        every = dict.fromkeys(range(len(plan.chunks)), PLAIN)
        self.baseline = list(self.pool.map(lambda values: self.chain(values, every), initial))

    def session(
        self, j: int | tuple[str, int] | None, version: int | str, values: dict[str, Any]
    ) -> tuple[Any, list[str], list[str], list[tuple[str, str]]]:
        """The session of segment j (None: the constant nodes) in ``version``, built on first use."""
        with self.lock:
            if (j, version) in self.sessions:
                self.sessions[j, version] = self.sessions.pop((j, version))  # the most recently used last
            else:
                types = {name: value.data_type() for name, value in values.items()}
                start = time.perf_counter()
                model, inputs, outputs, aliases = self.plan.segment_model(j, version, types)
                session = outputs and open_session(model, self.message, shared_arena_options(self.threads))
                self.sessions[j, version] = (session, inputs, outputs, aliases)
                self.seconds["build", j, version] = time.perf_counter() - start
                while len(self.sessions) > MAX_SESSIONS:
                    del self.sessions[next(iter(self.sessions))]  # the least recently used
            return self.sessions[j, version]

    def version(self, j: int, wanted: int | str) -> int | str:
        """The version of segment j to run for a variant that ``wanted`` it: a
        group's only once the full version is known to cost more per run (all
        samples, twice) than building the group's. Results are the same either
        way; only the time differs."""
        if wanted in (PLAIN, FULL) or (j, wanted) in self.sessions:
            return wanted
        full, plain = self.seconds.get(("run", j, FULL)), self.seconds.get(("run", j, PLAIN))
        if full is None or plain is None:
            return FULL
        return wanted if 2 * (full - plain) * len(self.baseline) > self.seconds["build", j, FULL] else FULL

    def step(self, j: int | tuple[str, int] | None, version: int | str, values: dict[str, Any]) -> dict[str, Any]:
        """``{name: OrtValue}`` that segment j makes (aliases included) from ``values``."""
        session, inputs, outputs, aliases = self.session(j, version, values)
        start = time.perf_counter()
        try:
            results = session.run_with_ort_values(outputs, {t: values[t] for t in inputs}) if outputs else []
        except Exception as exc:
            raise does_not_run(self.message, exc)
        self.seconds["run", j, version] = time.perf_counter() - start
        made = dict(zip(outputs, results))
        for t, source in aliases:
            made[t] = made[source] if source in made else values[source]
        return made

    def merged(self, versions: dict[int, int | str]) -> dict[Any, int | str]:
        """``versions`` with its plain tail, when it runs every segment to the
        last, as one session: one run per sample instead of one per segment."""
        last, tail = len(self.plan.chunks) - 1, None
        for j in range(last, -1, -1):
            if versions.get(j) != PLAIN:
                break
            tail = j
        if tail is None or tail == last:
            return versions
        return {**{j: v for j, v in versions.items() if j < tail}, ("from", tail): PLAIN}

    def chain(self, values: dict[str, Any], versions: Mapping[Any, int | str]) -> dict[str, Any]:
        values = dict(values)
        for j, version in versions.items():
            values.update(self.step(j, version, values))
        return values

    def run(self, settings: dict[str, Any] | None = None) -> list[list[np.ndarray]]:
        """Per sample, the graph outputs (numpy) with ``settings`` bound."""
        settings = settings or {}
        versions = {j: self.version(j, wanted) for j, wanted in self.plan.needs(list(settings)).items()}
        versions = self.merged(versions)
        bound = {name: self.true if value is True else self.value(value) for name, value in settings.items()}
        for output, condition, on, _ in self.plan.selections:
            if settings.get(condition) is True:
                bound[output] = self.constants[on]

        def one(baseline: dict[str, Any]) -> list[np.ndarray]:
            values = self.chain({**baseline, **bound}, versions)
            return [values[name].numpy() for name in self.outputs]

        if len(self.baseline) == 1:
            return [one(self.baseline[0])]
        return list(self.pool.map(one, self.baseline))

    def close(self) -> None:
        """Drops the sessions and the baseline's values, ends the worker threads and gives
        the shared arena's free memory back: the runner runs nothing after."""
        self.pool.shutdown()  # first: a run still in flight may build a session
        self.sessions.clear()
        self.baseline, self.constants = [], {}
        shrink_shared_arena()

    def run_each(self, variants: list[dict[str, Any]], reduce: Callable[[list[list[np.ndarray]]], Any]) -> list[Any]:
        """``reduce(run(settings))`` for each settings of ``variants``, in order. With one
        sample, variants run side by side, each reduced as it ends (no outputs held but the
        runs' in flight); with several, one variant at a time, its samples side by side."""
        if len(self.baseline) > 1 or self.workers < 2 or len(variants) < 2:
            return [reduce(self.run(settings)) for settings in variants]
        return list(self.pool.map(lambda settings: reduce(self.run(settings)), variants))


def segment_runner(
    model: onnx.ModelProto,
    defaults: dict[str, np.ndarray],
    machinery: set[str],
    samples: list[dict[str, np.ndarray]],
    outputs: list[str],
    path: str,
    prefix: str = IMPACT_PREFIX,
) -> SegmentRunner:
    """A SegmentRunner of the derived ``model``, cut in IMPACT_SEGMENTS, or in
    one segment when a value crossing a cut is not a tensor."""

    def runner(count: int) -> SegmentRunner:
        plan = SegmentPlan(model, list(samples[0]), set(defaults), machinery, count, samples[0], prefix)
        return SegmentRunner(plan, defaults, samples, outputs, path)

    try:
        return runner(IMPACT_SEGMENTS)
    except Unsegmentable:
        return runner(1)
