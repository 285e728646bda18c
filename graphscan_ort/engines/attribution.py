"""impact's engine: the derived model that answers every 'what if X stayed float'."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import cached_property
from typing import Any, cast

import numpy as np
import onnx

from graphscan import EXIT_INPUTS, GraphIndex, GraphscanError, shown
from graphscan_ort.engines.levels import TENSORS_PER_RUN
from graphscan_ort.engines.segments import IMPACT_PREFIX, segment_runner
from graphscan_ort.shared.answers import Exclusion, ImpactMeasures, OpGain, TensorGain, WorstPart
from graphscan_ort.shared.graph import (
    DQ_OUTPUT_SUFFIX,
    QDQ_SUFFIX,
    LazyArray,
    body_reads,
    constant_arrays,
    fresh_prefix,
    quant_range,
    with_outputs,
)
from graphscan_ort.shared.metrics import (
    OutputNoise,
    answer_figures,
    count_outside,
    output_layout,
    output_pairs,
    paired_outputs,
    require_numbers,
)
from graphscan_ort.shared.options import Named
from graphscan_ort.shared.sessions import deployed_options, does_not_run, impact_options, model_outputs, open_session

MIN_GAIN_DB = 0.01  # --min-gain's default: the least gain an operator added to exclude.nodes brings


ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")  # what the quantizer folds into a Q


def float_activation(float_index: GraphIndex, quant_index: GraphIndex, tensor: str) -> onnx.NodeProto | None:
    """The Relu/Clip/LeakyRelu the quantizer absorbed into the Q of ``tensor``.

    Returns the float model's node (None when nothing was absorbed): its
    producer of the name (without ORT's QDQ suffix when the float model has
    no tensor of that name, as for a renamed graph output) is an activation
    while the quantized model's producer is another op type.
    """
    float_producer = float_index.producer_of(tensor)
    if float_producer is None:
        float_producer = float_index.producer_of(QDQ_SUFFIX.sub("", tensor))
    quant_producer = quant_index.producer_of(tensor)
    if float_producer is None or quant_producer is None:
        return None
    op_type = float_index.op_types[float_producer]
    if op_type not in ACTIVATIONS or quant_index.op_types[quant_producer] == op_type:
        return None
    return float_index.graph.node[float_producer]


def activation_bounds(node: onnx.NodeProto, float_constants: dict[str, LazyArray]) -> tuple[float, ...] | None:
    """``(lo, hi)`` such that Clip(t, lo, hi) is ``node`` (Relu or Clip); None otherwise."""
    if node.op_type == "Relu":
        return 0.0, math.inf
    if node.op_type != "Clip":
        return None
    bounds = [-math.inf, math.inf]
    for a in node.attribute:  # opset < 11
        if a.name in ("min", "max"):
            bounds[a.name == "max"] = a.f
    for k, name in enumerate(node.input[1:3]):
        if name:
            value = float_constants.get(name)
            if value is None or value.array.size != 1:
                return None
            bounds[k] = float(value.array.reshape(-1)[0])
    return tuple(bounds)


class ImpactPlan:
    """The sites of ``impact``: every DQ(Q(t)) pair, every weight DQ with a
    float twin, the op rows and the tensor rows, all as quantized-graph indices.

    ``op_rows``: ``[(node, [(input position, ("pair", dq) | ("weight", name))])]``.
    ``tensor_rows``: ``[(t, [(q, dq)], first Q's range or None, absorbed node or None)]``.
    """

    def __init__(self, float_model: onnx.ModelProto, quant_model: onnx.ModelProto) -> None:
        graph, fgraph = quant_model.graph, float_model.graph
        self.index = index = GraphIndex(graph)
        self.float_index = GraphIndex(fgraph)
        self.constants = constant_arrays(graph)
        self.float_constants = constant_arrays(fgraph)
        float_inits = {init.name: init for init in fgraph.initializer}
        quant_inits = {init.name: init for init in graph.initializer}
        self.pair_of = {}  # dq -> (q, t)
        for dq in index.dq_nodes:
            q = index.producer_of(graph.node[dq].input[0])
            if q is not None and index.is_q[q]:
                self.pair_of[dq] = (q, graph.node[q].input[0])
        self.weight_of = {}  # dq -> float initializer name
        self.weight_dqs = 0  # DQs of an initializer: the weights there are to match
        for dq in index.dq_nodes:
            source = graph.node[dq].input[0]
            self.weight_dqs += source in quant_inits
            twin = float_inits.get(DQ_OUTPUT_SUFFIX.sub("", graph.node[dq].output[0]))
            scale = self.constants.get(graph.node[dq].input[1]) if len(graph.node[dq].input) > 1 else None
            if (
                source in quant_inits
                and twin is not None
                and list(twin.dims) == list(quant_inits[source].dims)
                and (scale is None or scale.proto.data_type == twin.data_type)  # Where needs one type
            ):
                self.weight_of[dq] = twin.name
        self.op_rows = []
        for i in index.compute_nodes:
            edges: list[tuple[int, tuple[str, Any]]] = []  # ("pair", dq) or ("weight", name)
            for pos, tensor in enumerate(graph.node[i].input):
                reader_dq = index.producer_of(tensor) if tensor else None
                if reader_dq in self.pair_of:
                    edges.append((pos, ("pair", reader_dq)))
                elif reader_dq in self.weight_of:
                    edges.append((pos, ("weight", self.weight_of[reader_dq])))
            if edges:
                self.op_rows.append((i, edges))
        rows: dict[str, list[tuple[int, int]]] = {}
        for dq, (q, t) in sorted(self.pair_of.items(), key=lambda item: item[1][0]):
            producer = index.producer_of(t)
            if t in quant_inits or (producer is not None and index.op_types[producer] == "Constant"):
                continue  # a weight, not an activation
            rows.setdefault(t, []).append((q, dq))
        self.tensor_rows = []
        for t, pairs in rows.items():
            q_range = quant_range(graph.node[pairs[0][0]], self.constants)
            self.tensor_rows.append((t, pairs, q_range, self.absorbed(t)))

    def absorbed(self, tensor: str) -> onnx.NodeProto | None:
        return float_activation(self.float_index, self.index, tensor)


class SwitchedModelBuilder:
    """Builds the derived model: DQ outputs renamed, Where on each changed edge.

    Every Where reads its own boolean graph input, and the bounds of each
    Clip are scalar graph inputs: a variant is a few inputs set on the host,
    with no Or or scalar nodes running for every variant. ``defaults`` holds
    each added input's value while no variant is on.
    """

    def __init__(self, plan: ImpactPlan, quant_model: onnx.ModelProto, prefix: str = IMPACT_PREFIX) -> None:
        self.plan, self.prefix = plan, prefix
        self.model = onnx.ModelProto()
        self.model.CopyFrom(quant_model)
        self.graph = self.model.graph
        self.nodes: list[onnx.NodeProto] = []  # new nodes, appended after the graph (ORT sorts topologically)
        self.defaults: dict[str, np.ndarray] = {}
        self.cache: dict[tuple[str | None, ...], Any] = {}

    def scalar_input(self, name: str, value: float, elem_type: int) -> str:
        self.graph.input.append(onnx.helper.make_tensor_value_info(name, elem_type, []))
        self.defaults[name] = np.array(value, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem_type))
        return name

    def constant(self, name: str, value: np.ndarray | float, elem_type: int) -> str:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        self.graph.initializer.append(onnx.numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def node(self, op_type: str, inputs: list[str], output: str, **attributes: Any) -> str:
        name = output if output.startswith(self.prefix) else f"{self.prefix}keep/{output}"
        self.nodes.append(onnx.helper.make_node(op_type, inputs, [output], name=name, **attributes))
        return output

    def where(self, alternative: str, raw: str, output: str | None = None) -> tuple[str, str]:
        """``Where(on, alternative, raw)`` with a new condition input; returns (output, condition)."""
        key = ("where", alternative, raw, output)
        if key not in self.cache:
            condition = self.scalar_input(f"{self.prefix}on/{len(self.defaults)}", False, onnx.TensorProto.BOOL)
            output = output or f"{self.prefix}where/{condition}"
            self.cache[key] = (self.node("Where", [condition, alternative, raw], output), condition)
        return self.cache[key]


def float_value(builder: SwitchedModelBuilder, plan: ImpactPlan, t: str, absorbed: onnx.NodeProto | None) -> str:
    """float(t) as a tensor of the derived model: t, or the absorbed activation on t."""
    if absorbed is None:
        return t
    name = f"{builder.prefix}float/{t}"
    if ("float", t) not in builder.cache:
        node = onnx.NodeProto()
        node.CopyFrom(absorbed)
        node.name = name
        inputs = [t]
        for k, extra in enumerate(absorbed.input[1:], start=1):
            if extra and extra in plan.float_constants:
                value = plan.float_constants[extra]
                extra = builder.constant(f"{builder.prefix}float/{t}/{k}", value.array, value.proto.data_type)
            inputs.append(extra)
        node.input[:] = inputs
        node.output[:] = [name]
        builder.nodes.append(node)
        builder.cache[("float", t)] = name
    return name


def tensor_alternative(
    builder: SwitchedModelBuilder,
    plan: ImpactPlan,
    t: str,
    q_range: tuple[float, float, int] | None,
    absorbed: onnx.NodeProto | None,
) -> tuple[str, dict[str, Any] | None]:
    """``(value, rounding settings)``: what readers of DQ(Q(t)) take when their
    Where is on: float(t), or Clip(t, lo, hi) with the settings applied (None
    when the Q's range is unknown)."""
    if q_range is None:
        return float_value(builder, plan, t, absorbed), None
    lo, hi, elem_type = q_range
    bounds = (-math.inf, math.inf) if absorbed is None else activation_bounds(absorbed, plan.float_constants)
    prefix = f"{builder.prefix}range/{t}"
    if bounds is None:  # LeakyRelu (or a Clip with computed bounds): its own node
        lo_name = builder.constant(prefix + "/lo", lo, elem_type)
        hi_name = builder.constant(prefix + "/hi", hi, elem_type)
        clipped = builder.node("Clip", [t, lo_name, hi_name], f"{builder.prefix}round/{t}")
        alternative, condition = builder.where(
            clipped, float_value(builder, plan, t, absorbed), f"{builder.prefix}alt/{t}"
        )
        return alternative, {condition: True}
    # Clip(t, -inf, inf) is t and Clip(t, 0, inf) is Relu(t), exactly; the
    # rounding variant binds the Q's range instead.
    low = builder.scalar_input(prefix + "/lo", bounds[0], elem_type)
    high = builder.scalar_input(prefix + "/hi", bounds[1], elem_type)
    dtype = builder.defaults[low].dtype
    rounding = {low: np.array(lo, dtype), high: np.array(hi, dtype)}
    return builder.node("Clip", [t, low, high], f"{builder.prefix}alt/{t}"), rounding


def switched_model(
    plan: ImpactPlan, quant_model: onnx.ModelProto, float_model: onnx.ModelProto, prefix: str = IMPACT_PREFIX
) -> tuple[
    onnx.ModelProto, dict[str, np.ndarray], list[dict[str, Any]], list[tuple[dict[str, Any], dict[str, Any] | None]]
]:
    """The derived model and its variants: ``(model, defaults, op_variants, tensor_variants)``.

    A variant is ``{input name: value}`` to bind instead of ``defaults``.
    ``op_variants[k]`` un-quantizes op row k; ``tensor_variants[m]`` is
    ``(float(t) variant, rounding-only variant or None)`` for tensor row m.
    Every name it adds starts with ``prefix``, which no name of the models may start with.
    """
    builder = SwitchedModelBuilder(plan, quant_model, prefix)
    graph, index = builder.graph, plan.index
    float_inits = {init.name: init for init in float_model.graph.initializer}
    rounding: dict[int, Any]  # None for a row without a known range
    alternatives, rounding = {}, {}  # per dq: float(t) (or its Clip), per tensor row: settings
    row_of = {}
    for m, (t, pairs, q_range, absorbed) in enumerate(plan.tensor_rows):
        alternative, rounding[m] = tensor_alternative(builder, plan, t, q_range, absorbed)
        for _, dq in pairs:
            alternatives[dq], row_of[dq] = alternative, m
    for _, edges in plan.op_rows:  # pairs only ops read: weights kept as Constant -> Q -> DQ
        for _, (kind, source) in edges:
            if kind == "pair" and source not in alternatives:
                t = plan.pair_of[source][1]
                alternatives[source] = float_value(builder, plan, t, plan.absorbed(t))
    raw = {}
    for dq in alternatives:
        raw[dq] = f"{builder.prefix}dq/{graph.node[dq].output[0]}"
        graph.node[dq].output[0] = raw[dq]
    op_rows = {i: k for k, (i, _) in enumerate(plan.op_rows)}
    op_variants: list[dict[str, object]] = [{} for _ in plan.op_rows]
    tensor_on: list[dict[str, object]] = [{} for _ in plan.tensor_rows]
    # Graph outputs and names If/Loop/Scan bodies read from outside keep the
    # DQ's name, now given to the switched value.
    kept_names = {o.name for o in graph.output}.union(*(body_reads(node) for node in graph.node))
    for dq, alternative in alternatives.items():
        output = quant_model.graph.node[dq].output[0]
        row = row_of.get(dq)
        for reader in index.consumers_of(output):
            if row is None and reader not in op_rows:
                continue  # nobody would switch it
            node = graph.node[reader]
            value, condition = builder.where(alternative, raw[dq], f"{builder.prefix}where/{reader}/{output}")
            node.input[:] = [value if t == output else t for t in node.input]
            if reader in op_rows:
                op_variants[op_rows[reader]][condition] = True
            if row is not None:
                tensor_on[row][condition] = True
        if output in kept_names:
            if row is None:
                builder.node("Identity", [raw[dq]], output)
            else:
                _, condition = builder.where(alternative, raw[dq], output)
                tensor_on[row][condition] = True
    for k, (i, edges) in enumerate(plan.op_rows):
        node = graph.node[i]
        for pos, (kind, source) in edges:
            if kind == "weight":
                weight = f"{builder.prefix}weight/{source}"
                if ("weight", source) not in builder.cache:
                    copy = onnx.TensorProto()
                    copy.CopyFrom(float_inits[source])
                    copy.name = weight
                    graph.initializer.append(copy)
                    builder.cache[("weight", source)] = weight
                value, condition = builder.where(weight, node.input[pos], f"{builder.prefix}where/{i}/{pos}")
                node.input[pos] = value
                op_variants[k][condition] = True
    graph.node.extend(builder.nodes)
    tensor_variants = [(on, None if rounding[m] is None else {**on, **rounding[m]}) for m, on in enumerate(tensor_on)]
    return builder.model, builder.defaults, op_variants, tensor_variants


def gain(sqnr: float | None, baseline: float | None) -> float | None:
    return sqnr - baseline if sqnr is not None and baseline is not None else None


def ranked(rows: list[OpGain] | list[TensorGain], exact: list[bool], baseline_exact: bool) -> list[int]:
    """Row order: larger gain first, graph order among equals. A variant whose
    output equals the float model's (sqnr null) while the baseline does not
    counts as the largest gain; rows without a gain come last."""

    def key(k: int) -> tuple[int, float, int]:
        if exact[k] and not baseline_exact:
            return (0, 0.0, k)
        gained = rows[k]["gain_db"]
        if gained is None:
            return (2, 0.0, k)
        return (1, -gained, k)

    return sorted(range(len(rows)), key=key)


class ValueStats:
    """What impact keeps of one tensor's values over all samples, instead of
    the values: how many lie outside its Q's [lo, hi] (``clipped``), whether
    all are finite, and the smallest and largest in the tensor's own type."""

    def __init__(self, q_range: tuple[float, float, int]) -> None:
        self.lo, self.hi, _ = q_range
        self.total = self.outside = 0
        self.dtype: np.dtype | None
        self.low: np.generic | None
        self.high: np.generic | None
        self.finite, self.dtype, self.low, self.high = True, None, None, None

    def add(self, value: np.ndarray) -> None:
        value = np.asarray(value)
        self.dtype = value.dtype  # the same for every sample: the model's type of the tensor
        self.total += value.size
        if not value.size:
            return
        self.finite = self.finite and bool(np.all(np.isfinite(value)))
        low, high = value.min(), value.max()
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)
        self.outside += count_outside(value, self.lo, self.hi)

    @property
    def clipped(self) -> float | None:
        """Fraction of the values outside the Q's [lo, hi] (None without values)."""
        return self.outside / self.total if self.total else None


def exclusion(
    measure: Callable[[dict[str, Any]], tuple[float | None, bool]],
    candidates: list[tuple[str, dict[str, Any]]],
    baseline: tuple[float | None, bool],
    target: float,
    max_exclude: int | None,
) -> Exclusion:
    """``{"target_sqnr_db", "nodes", "sqnr_db", "reached"}``: ``candidates``
    (``(node, variant)`` in rank order) are added one at a time and the combined
    model measured after each addition, until the target or ``max_exclude``."""
    nodes: list[str] = []
    combined: dict[str, object] = {}
    sqnr, exact = baseline

    def met() -> bool:
        return exact or (sqnr is not None and sqnr >= target)

    for name, variant in candidates:
        if met() or (max_exclude is not None and len(nodes) >= max_exclude):
            break
        nodes.append(name)
        combined.update(variant)
        sqnr, exact = measure(dict(combined))
    return {"target_sqnr_db": target, "nodes": nodes, "sqnr_db": sqnr, "reached": met()}


def tensor_stats(
    model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], ranges: dict[str, tuple[float, float, int]], path: str
) -> dict[str, ValueStats]:
    """``{tensor: ValueStats}`` of ``model``'s own tensors (``ranges``: ``{tensor:
    Q range}``): the computed ones fetched TENSORS_PER_RUN per run of the model, a session
    a group (as levels fetches them), so a run holds one sample's values of one group, each
    dropped once counted."""
    stats = {t: ValueStats(q_range) for t, q_range in ranges.items()}
    for feeds in samples:
        for t in ranges.keys() & feeds.keys():
            stats[t].add(feeds[t])
    computed = [t for t in ranges if t not in samples[0]]
    for start in range(0, len(computed), TENSORS_PER_RUN):
        group = computed[start : start + TENSORS_PER_RUN]
        session = open_session(with_outputs(model, group), f"{shown(path)}: model", impact_options())
        for feeds in samples:
            try:
                outputs = session.run(group, feeds)
            except Exception as exc:
                raise does_not_run(f"{shown(path)}: model", exc)
            for t, value in zip(group, outputs):
                stats[t].add(value)
            del outputs
    return stats


def variant_key(variant: dict[str, Any]) -> tuple[tuple[str, bool | tuple[str, bytes]], ...]:
    """A hashable ``variant``: equal keys set the same inputs to the same values."""
    return tuple(
        sorted((name, True if value is True else (value.dtype.str, value.tobytes())) for name, value in variant.items())
    )


def same_clip(stats: ValueStats, kept: tuple[np.ndarray, np.ndarray], rounded: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether ``Clip(t, *kept)`` and ``Clip(t, *rounded)`` (bounds: numpy
    scalars of t's type) are equal bit for bit for every value of t (``stats``:
    its ValueStats): t is finite and, on each side, the two bounds are the
    same number or no value of t reaches either."""
    (kept_lo, kept_hi), (lo, hi) = kept, rounded
    same_lo, same_hi = kept_lo.tobytes() == lo.tobytes(), kept_hi.tobytes() == hi.tobytes()
    if stats.dtype != lo.dtype or not stats.finite:
        return False
    if stats.low is None:  # no values at all
        return True
    return bool((same_lo or stats.low > max(kept_lo, lo)) and (same_hi or stats.high < min(kept_hi, hi)))


class ImpactRun:
    """The derived model of ``quant_model`` as segment sessions, ready to measure variants.

    ``baseline``: ``(sqnr_db, exact)`` of the quantized model as it is;
    ``stats``: per tensor row with a known range, the ValueStats of its values (one more
    session over the samples, run when first read: an operators' ranking never reads it);
    ``measure(variant)``: ``(sqnr_db, exact)`` with ``variant`` on, run once per distinct variant.
    """

    def __init__(
        self,
        float_model: onnx.ModelProto,
        quant_model: onnx.ModelProto,
        samples: list[dict[str, np.ndarray]],
        output_names: list[str],
        noise: OutputNoise,
        path: str,
    ) -> None:
        self.noise, self.quant_model, self.samples, self.path = noise, quant_model, samples, path
        self.plan = plan = ImpactPlan(float_model, quant_model)
        prefix = fresh_prefix(quant_model, float_model)
        derived, self.defaults, self.op_variants, self.tensor_variants = switched_model(
            plan, quant_model, float_model, prefix
        )
        machinery = {node.name for node in derived.graph.node if node.name.startswith(prefix)}
        self.runner = segment_runner(derived, self.defaults, machinery, samples, output_names, path, prefix)
        del derived
        self.measured: dict[tuple[tuple[str, bool | tuple[str, bytes]], ...], tuple[float | None, bool]] = {}
        self.baseline_figures = noise.figures(self.runner.run({}))  # the worst part named, the pooled figure
        self.measured[variant_key({})] = (self.baseline_figures.worst_db, self.baseline_figures.exact)
        self.baseline = self.measure({})

    @cached_property
    def stats(self) -> dict[str, ValueStats]:
        ranges = {t: q_range for t, _, q_range, _ in self.plan.tensor_rows if q_range is not None}
        return tensor_stats(self.quant_model, self.samples, ranges, self.path)

    def measure(self, variant: dict[str, Any]) -> tuple[float | None, bool]:
        key = variant_key(variant)
        if key not in self.measured:
            self.measured[key] = self.noise.measure(self.runner.run(variant))
        return self.measured[key]

    def measure_all(self, variants: list[dict[str, Any]]) -> list[tuple[float | None, bool]]:
        """``measure`` of each of ``variants``, in order; those not measured yet run side by
        side where the runner can (SegmentRunner.run_each), each run once."""
        keys = [variant_key(variant) for variant in variants]
        missing = {key: variant for key, variant in zip(keys, variants) if key not in self.measured}
        figures = self.runner.run_each(list(missing.values()), self.noise.measure)
        self.measured.update(zip(missing, figures))
        return [self.measured[key] for key in keys]

    def rounding_variant(self, m: int) -> dict[str, Any] | None:
        """Tensor row m's rounding-only variant, or its float(t) variant when the
        two are the same run: t's values never reach the Clip bounds that differ."""
        kept, rounded = self.tensor_variants[m]
        if rounded is None:
            return None
        changed = [(name, value) for name, value in rounded.items() if name not in kept]
        if len(changed) != 2 or any(value is True for _, value in changed):
            return rounded  # a Clip node of its own (after LeakyRelu): not a bound change
        (low, lo), (high, hi) = changed
        stats = self.stats[self.plan.tensor_rows[m][0]]
        return kept if same_clip(stats, (self.defaults[low], self.defaults[high]), (lo, hi)) else rounded


def weight_warnings(plan: ImpactPlan, a: str) -> list[str]:
    """Why the answer may mislead: weights of b with no float twin in a are kept quantized in every row."""
    unmatched = plan.weight_dqs - len(plan.weight_of)
    if not unmatched:
        return []
    warning = (
        f"{unmatched} of {plan.weight_dqs} quantized weights have no float initializer of the same name and "
        f"shape in {a}: those stay quantized in every row. Pass the float model that was given to the "
        "quantizer (after quant_pre_process, if it ran)"
    )
    return [warning]


def impact_run(reference: Named, candidate: Named, samples: list[dict]) -> tuple[ImpactRun, list[tuple[str, str]]]:
    """The float ``reference`` and the quantized ``candidate`` (their paths named in failures)
    checked and run on ``samples``: ``(ImpactRun, output pairs)``, ready to measure variants."""
    float_model, quant_model, a, b = reference.model, candidate.model, reference.path, candidate.path
    pairs = output_pairs(Named(float_model, a), Named(quant_model, b))
    float_names, quant_names = [f for f, _ in pairs], [q for _, q in pairs]
    require_numbers(reference, float_names)
    require_numbers(candidate, quant_names)
    # One thread, as the segment sessions run: the same bits whatever the cores (SegmentRunner).
    float_outputs = model_outputs(float_model, samples, a, float_names, impact_options(1))
    require_numbers(reference, float_names, float_outputs)
    noise = OutputNoise(float_outputs, output_layout(float_model, float_names, samples))
    if noise.empty:
        raise GraphscanError(
            f"{shown(a)}: the float model's outputs are empty on these inputs: nothing to measure", EXIT_INPUTS
        )
    return ImpactRun(float_model, quant_model, samples, quant_names, noise, b), pairs


def op_gains(measured: ImpactRun) -> tuple[list[OpGain], list[bool]]:
    """Each operator's row (in the graph's order) and whether its variant's output equals float's."""
    index, baseline = measured.plan.index, measured.baseline
    rows: list[OpGain] = []
    exact: list[bool] = []
    figures = measured.measure_all(measured.op_variants)
    for (i, _), (sqnr, same) in zip(measured.plan.op_rows, figures, strict=True):
        rows.append(
            {"node": index.names[i], "op_type": index.op_types[i], "sqnr_db": sqnr, "gain_db": gain(sqnr, baseline[0])}
        )
        exact.append(same)
    return rows, exact


def ranked_ops(reference: Named, candidate: Named, samples: list[dict]) -> list[OpGain]:
    """impact's ``ops``, all of them in its order, without its tensors' rows (two runs a
    tensor, half of impact's time) nor its deployed figure: what tune's search ranks by."""
    measured, _ = impact_run(reference, candidate, samples)
    with contextlib.closing(measured.runner):
        rows, exact = op_gains(measured)
    return [rows[k] for k in ranked(rows, exact, measured.baseline[1])]


def measure(
    reference: Named,
    candidate: Named,
    samples: list[dict],
    target_sqnr: float | None = None,
    max_exclude: int | None = None,
    top: int | None = None,
    min_gain: float | None = None,
) -> ImpactMeasures:
    """impact's answer for two models in memory (the float ``reference``, the quantized
    ``candidate``, their paths named in failures and warnings), from ``samples`` on: the
    output SQNR each operator and tensor of the candidate costs, and with ``target_sqnr``
    what to exclude."""
    measured, pairs = impact_run(reference, candidate, samples)
    with contextlib.closing(measured.runner):  # its sessions and values, once measured
        plan, baseline, measure = measured.plan, measured.baseline, measured.measure
        index = plan.index
        op_rows, op_exact = op_gains(measured)
        tensor_rows: list[TensorGain] = []
        tensor_exact: list[bool] = []
        kept_figures = measured.measure_all([kept for kept, _ in measured.tensor_variants])
        rounded_variants = [measured.rounding_variant(m) for m in range(len(plan.tensor_rows))]
        measured.measure_all([rounded for rounded in rounded_variants if rounded is not None])
        for (t, q_dq_pairs, q_range, _), (sqnr, exact), rounded in zip(
            plan.tensor_rows, kept_figures, rounded_variants, strict=True
        ):
            rounding = measure(rounded)[0] if rounded is not None else None
            producer = index.producer_of(t)
            readers = sorted({r for _, dq in q_dq_pairs for r in index.consumers_of(index.outputs[dq][0])})
            tensor_rows.append(
                {
                    "tensor": t,
                    "producer": index.names[producer] if producer is not None else None,
                    "consumers": [index.names[r] for r in readers],
                    "sqnr_db": sqnr,
                    "gain_db": gain(sqnr, baseline[0]),
                    "rounding_sqnr_db": rounding,
                    "rounding_gain_db": gain(rounding, baseline[0]),
                    "clipped": measured.stats[t].clipped if q_range else None,
                }
            )
            tensor_exact.append(exact)
        op_order = ranked(op_rows, op_exact, baseline[1])
        tensor_order = ranked(tensor_rows, tensor_exact, baseline[1])
        # As users run both models: onnxruntime may rewrite what impact measures as written.
        deployed = paired_outputs(reference, candidate, samples, pairs, deployed_options())
        stated = answer_figures(measured.baseline_figures, measured.noise.empty)
        answer: ImpactMeasures = {
            "samples": len(samples),
            "output_sqnr_db": stated.worst_db,
            "pooled_sqnr_db": stated.pooled_db,
            "worst_part": cast(WorstPart | None, stated.worst_part),
            "deployed_output_sqnr_db": deployed.figures().worst_db,
            "weights": {"matched": len(plan.weight_of), "total": plan.weight_dqs},
            "warnings": weight_warnings(plan, reference.path),
            "ops": [op_rows[k] for k in op_order][:top],
            "tensors": [tensor_rows[k] for k in tensor_order][:top],
        }
        if target_sqnr is not None:
            # A gain of 1e-9 dB is noise, not a reason to keep an operator float.
            least = MIN_GAIN_DB if min_gain is None else min_gain

            def helps(k: int) -> bool:
                gained = op_rows[k]["gain_db"] or 0.0
                return (op_exact[k] and not baseline[1]) or (gained > 0 and gained >= least)

            candidates = [(op_rows[k]["node"], measured.op_variants[k]) for k in op_order if helps(k)]
            answer["exclude"] = exclusion(measure, candidates, baseline, target_sqnr, max_exclude)
        return answer
