"""tune's measurements: a candidate as it will be deployed.

Accuracy, kernels and speed are all taken from onnxruntime sessions at the
level users run (default: onnxruntime's own default, all optimizations) with
``threads`` intra-op threads:

- ``sqnr_db``: the output SQNR against the float model, by the one definition
  impact and check use (``metrics.OutputNoise``, outputs paired by name);
- ``metric_value``: the ``--metric`` agreement with the float model (shared.agreement)
  over every evaluation sample;
- ``int8_fraction``, ``int8_kernels`` and ``wrapped_but_float`` by reason, from
  the runtime command's classes at that level;
- ``ms``: the median wall time of ``runs`` runs on the latency samples (default: the
  first evaluation sample; several: the sum of their medians), timed in alternation
  with the float model in this process; ``speedup`` is the median of the run-by-run
  ratios (the float model's run over the candidate's next to it), and ``speedup_spread``
  their quartiles: one statistic, the spread around it;
- ``bytes``: the file's size.

On a CPU target (``OnTarget``), the accuracy figures and the kernels are that CPU's: the
float model runs there once for the whole run, each candidate once more in the same
interpreter (its outputs and runtime's classes of its optimized session in one call);
the time is still this machine's, natively (an emulated CPU's time is no latency).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx

from graphscan import EXIT_USAGE, GraphscanError, Session, TargetRunner, load_with_weights, shown
from graphscan_ort.engines.classify import classify, runtime_counts
from graphscan_ort.engines.timing import interleaved_runs
from graphscan_ort.shared.agreement import Metric, paired_events, paired_value
from graphscan_ort.shared.kernels import int8_fraction
from graphscan_ort.shared.metrics import (
    Checkpoints,
    FloatOutputs,
    PairedOutputs,
    output_layout,
    output_pairs,
    paired_outputs,
)
from graphscan_ort.shared.on_target import keyed_outputs, load_samples, read_outputs, save_samples
from graphscan_ort.shared.options import Named, Timing
from graphscan_ort.shared.sessions import model_outputs, open_session, session_options, temporary_folder
from graphscan_ort.tune.verdict import spread


def kernel_counts(model: onnx.ModelProto, path: str, level: str, optimized: onnx.ModelProto | None = None) -> dict:
    """int8 share, int8 kernels and the reasons wrapped nodes run float, from runtime's
    classification, and the digest of the graph onnxruntime runs (plan_digest); ``optimized``:
    the graph a session of ``model`` at ``level`` saved already (classify's)."""
    found = classify(model, path, level=level, optimized=optimized)
    rows = found.rows
    classes = runtime_counts(rows)["classes"]
    reasons = Counter(
        row["reason"]["code"] if row["reason"] else None for row in rows if row["wrapped"] and row["class"] == "float"
    )
    return {
        "int8_fraction": int8_fraction(classes),
        "int8_kernels": classes["int8"],
        "wrapped_but_float": dict(sorted(reasons.items())),
        "plan": plan_digest(found.optimized_model),  # not a row's key: the ledger keeps it (Trials.timed_alike)
    }


def plan_digest(optimized: onnx.ModelProto) -> str:
    """The SHA-256 of the graph onnxruntime saved after optimizing a model, its initializers
    taken by type and shape alone: models of one digest run the same kernels in one plan, so
    one's timing is the other's. The optimized graph, not the model as written: some of
    onnxruntime's fusions read values (a Relu goes where its QuantizeLinear's zero point is
    the type's least), so ranges alone can change what runs. Not by name either: onnxruntime
    shares initializers of equal values, so which name a node reads follows the values."""
    graph = optimized.graph
    constants = {t.name: f"{t.data_type}:{list(t.dims)}" for t in graph.initializer}
    digest = hashlib.sha256()
    for node in graph.node:
        plain = onnx.NodeProto()
        plain.CopyFrom(node)
        plain.input[:] = [f"constant {constants[name]}" if name in constants else name for name in node.input]
        digest.update(plain.SerializeToString(deterministic=True))
    for value in [*graph.input, *graph.output]:
        digest.update(value.SerializeToString(deterministic=True))
    return digest.hexdigest()


DEPLOYED = Session()  # onnxruntime's defaults: level all, one thread
TIMED = Timing()  # runtime --time's runs


def measure_candidate(
    reference: Named,
    candidate: Named,
    samples: list[dict],
    session: Session = DEPLOYED,
    timing: Timing = TIMED,
    references: dict[tuple[str, ...], FloatOutputs] | OnTarget | None = None,
    metric: Metric | None = None,
    latency: list[dict] | None = None,
    timed_alike: Callable[[str], dict | None] | None = None,
    race: Race | None = None,
    kept: Kept | None = None,
) -> dict:
    """``{"sqnr_db", "metric_value", "int8_fraction", "int8_kernels", "wrapped_but_float", "ms",
    "float_ms", "speedup", "speedup_spread", "bytes"}`` of ``candidate`` (the quantized model
    as written) against ``reference`` (the float model as read); ``references``: where the
    float model's outputs are kept from one candidate to the next, a dict (run in this
    process) or an ``OnTarget`` (run on that CPU target, whose outputs and kernels the
    candidate's then are too); ``latency``: the samples timed (default: the first of
    ``samples``); no ``metric``: ``metric_value`` is the SQNR; ``timed_alike``: the latency
    figures of a model timed already whose optimized graph has this plan_digest (None: none;
    the candidate is then timed). ``race`` (this process only, Race): why the candidate need
    not be measured for accuracy, or on its remaining samples; it is then timed first (its
    timing stops after RACE_FIRST_RUNS rounds where those already race it on speed), and a
    raced one's accuracy figures are null and ``raced`` says why; ``kept``: sessions the
    caller holds open already (Kept). In this process, one session of the candidate
    (measured_session) gives its kernels, its time and its accuracy."""
    kept = kept or Kept()
    if isinstance(references, OnTarget):  # its kernels and accuracy are the target's
        accuracy = accuracy_figures(reference, candidate, samples, session, references, metric)
        plan, timed_on = accuracy["plan"], latency or samples[:1]
        known = timed_alike(plan) if timed_alike is not None else None
        speed = speed_figures(reference, candidate, timed_on, session, timing, known, [kept.float_timing])
        return {**accuracy, **speed, "bytes": os.path.getsize(candidate.path)}
    opened, optimized = kept.candidate or measured_session(candidate, session)
    kernels = kernel_counts(candidate.model, candidate.path, session.level, optimized)

    def timed_now(stop: Callable[[dict], str | None] | None = None) -> dict:
        plan, timed_on, sessions = kernels["plan"], latency or samples[:1], [kept.float_timing, opened]
        known = timed_alike(plan) if timed_alike is not None else None
        return speed_figures(reference, candidate, timed_on, session, timing, known, sessions, stop)

    counted = (opened, kernels)
    if race is None:
        accuracy = accuracy_figures(reference, candidate, samples, session, references, metric, counted)
        return {**accuracy, **timed_now(), "bytes": os.path.getsize(candidate.path)}
    speed = timed_now(race.on_speed)  # its first rounds may already race it
    reason = race.on_speed(speed)
    if reason is not None:
        return {**UNMEASURED, **kernels, **speed, "bytes": os.path.getsize(candidate.path), "raced": reason}
    on_samples = None if race.on_samples is None else functools.partial(race.on_samples, speed)
    accuracy = accuracy_figures(reference, candidate, samples, session, references, metric, counted, on_samples)
    return {**accuracy, **speed, "bytes": os.path.getsize(candidate.path)}


@dataclasses.dataclass(frozen=True)
class Race:
    """Why a candidate need not be measured further (measure_candidate), each None where it
    is: ``on_speed``, given its speed figures, before any evaluation sample; ``on_samples``,
    given those and its metric on each of its first samples (at race_checkpoints), before the
    rest."""

    on_speed: Callable[[dict], str | None]
    on_samples: Callable[[dict, list[float | None]], str | None] | None = None


def race_checkpoints(samples: int) -> tuple[int, ...]:
    """Where a candidate's run on ``samples`` evaluation samples may stop (Race.on_samples):
    after the first RACE_FIRST, then at each doubling, short of every sample (successive
    halving's schedule: a row far behind is stopped early, a close one measured further)."""
    found, at = [], RACE_FIRST
    while at < samples:
        found.append(at)
        at *= 2
    return tuple(found)


# A candidate's first stretch of evaluation samples before it may be raced on them: enough
# for a paired Student-t bound with 7 degrees of freedom, few beside a run's usual dozens.
RACE_FIRST = 8


@dataclasses.dataclass(frozen=True)
class Kept:
    """Sessions held open for a candidate's measurement: the float model's timing session, or
    a function that gives it when the candidate is timed (a tune run keeps one: rows timed
    beside the same session, built and warmed once), and the candidate's own with the
    optimized graph it saved (measured_session's, opened when its exclusions were checked);
    None where measure_candidate opens one."""

    float_timing: Any = None
    candidate: tuple[Any, onnx.ModelProto | None] | None = None


def measured_session(candidate: Named, session: Session) -> tuple[Any, onnx.ModelProto | None]:
    """One session of ``candidate`` for everything it is measured by, ``(session, the
    optimized graph it saved)``: the graph, saved as it opens, gives its kernels
    (kernel_counts), then the session is timed and runs the accuracy samples, at the
    timing's options (spinning decides when a thread works, never what it computes): one
    build a row, not three. The graph is None where saving it failed (a full disk):
    classify then saves it in a session of its own and says which of the two failed."""
    subject = f"{shown(candidate.path)}: model"
    with temporary_folder("graphscan-tune-") as folder:
        saving = timing_options(session)
        saving.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        try:
            opened = open_session(candidate.model, subject, saving)
        except GraphscanError:
            return open_session(candidate.model, subject, timing_options(session)), None
        return opened, saved_graph(saving.optimized_model_filepath)


def timing_options(session: Session) -> Any:
    """The options every timed session is opened with: the deployed ones, threads spinning as in users' sessions."""
    return session_options(session.level, session.threads, spinning=True)


# A raced candidate's accuracy figures (measure_candidate): none measured.
UNMEASURED = dict.fromkeys(
    ("sqnr_db", "pooled_sqnr_db", "worst_part", "metric_value", "metric_events", "metric_worst", "metric_spread")
) | {"metric_by_sample": None}


def speed_figures(
    reference: Named,
    candidate: Named,
    latency: list[dict],
    session: Session,
    timing: Timing,
    timed_already: dict | None,
    opened: Sequence[Any] | None = None,
    stop: Callable[[dict], str | None] | None = None,
) -> dict:
    """The latency figures of a model timed already on the candidate's plan
    (``timed_already``: timed_alike's answer), else ``candidate`` timed now (latency_figures,
    in the sessions ``opened`` already: each a session, or a function that opens it, called
    only when it is timed; ``stop``: why its first rounds are enough)."""
    if timed_already is not None:
        return timed_already
    sessions = [given() if callable(given) else given for given in opened or []]
    return latency_figures(reference, [candidate], latency, session, timing, sessions, stop)[0]


def accuracy_figures(
    reference: Named,
    candidate: Named,
    samples: list[dict],
    session: Session = DEPLOYED,
    references: dict[tuple[str, ...], FloatOutputs] | OnTarget | None = None,
    metric: Metric | None = None,
    counted: tuple[Any, dict] | None = None,
    race: Callable[[list[float | None]], str | None] | None = None,
) -> dict:
    """measure_candidate's figures but the timing and the file's size: accuracy and kernels
    (``counted``: ``candidate``'s session open already and kernel_counts' of it; without it,
    measured_session opens one and its saved graph gives them). ``race`` (this process only):
    given the metric on each of the first samples (at race_checkpoints), why the rest need
    not be run; the figures are then UNMEASURED's but the kernels, ``metric_by_sample`` the
    values on the samples run, and ``raced`` says why."""
    pairs = output_pairs(reference, candidate)
    by_sample: list[float | None] = []  # the metric on each sample run, in order, taken once
    reason: list[str] = []

    def stop(outputs: PairedOutputs) -> bool:
        by_sample.extend(sample_value(outputs.sample(k), metric) for k in range(len(by_sample), len(outputs.candidate)))
        found = race(list(by_sample)) if race is not None else None
        reason.extend([found] if found is not None else [])
        return found is not None

    if isinstance(references, OnTarget):
        outputs, kernels = references.measure(reference, candidate, pairs)
    else:
        if counted is None:  # the candidate's own session, whose saved graph gives the kernels
            opened, optimized = measured_session(candidate, session)
            counted = opened, kernel_counts(candidate.model, candidate.path, session.level, optimized)
        opened, kernels = counted
        options = session_options(session.level, session.threads)
        checkpoints = None if race is None else Checkpoints(race_checkpoints(len(samples)), stop)
        outputs = paired_outputs(reference, candidate, samples, pairs, options, references, opened, checkpoints)
    if reason:
        return {**UNMEASURED, **kernels, "metric_by_sample": by_sample, "raced": reason[0]}
    figures = outputs.figures()
    sqnr = figures.worst_db
    value, events = (sqnr, None) if metric is None or metric.name == "sqnr" else paired_events(outputs, metric)
    by_sample.extend(sample_value(outputs.sample(k), metric) for k in range(len(by_sample), len(samples)))
    worst, spread_of = spread(by_sample)
    return {
        "sqnr_db": sqnr,
        "pooled_sqnr_db": figures.pooled_db,
        "worst_part": figures.worst_part,
        "metric_value": value,
        "metric_events": events,
        "metric_worst": worst,
        "metric_spread": spread_of,
        "metric_by_sample": by_sample,  # not a row's key: the ledger keeps it for the policy's paired rules
        **kernels,
    }


def saved_graph(path: str) -> onnx.ModelProto | None:
    """The optimized graph a session saved at ``path`` (None where it saved none: a session
    of its own makes it then)."""
    return onnx.load(path) if os.path.isfile(path) else None


def sample_value(outputs: PairedOutputs, metric: Metric | None) -> float | None:
    """The metric on one sample; None where a user's metric cannot be taken on one sample
    alone (it raised: the pooled value, taken first, did not)."""
    try:
        return paired_value(outputs, metric)
    except GraphscanError as exc:
        if metric is None or metric.function is None or exc.exit_code != EXIT_USAGE:
            raise
        return None


def latency_figures(
    reference: Named,
    candidates: list[Named],
    latency: list[dict],
    session: Session,
    timing: Timing,
    opened: Sequence[Any] | None = None,
    stop: Callable[[dict], str | None] | None = None,
) -> list[dict]:
    """``ms``, ``float_ms``, ``speedup`` and ``speedup_spread`` of each of ``candidates``, timed
    in one interleaved session with the float model on each latency sample: round k runs the
    float model, then each candidate, so every candidate's ratios (``speedup_runs``) are paired
    round by round with the float model's and with every other candidate's. ``opened``:
    sessions open already at timing_options, the float model's then each candidate's
    (None where one is opened here). ``stop`` (one candidate on one latency sample): given
    the figures of its first RACE_FIRST_RUNS rounds, why the rest need not be run (None: they
    are): its figures are then those rounds'."""
    models = (reference, *candidates)
    given = list(opened or []) + [None] * (len(models) - len(opened or []))
    sessions = [
        kept or open_session(m.model, f"{shown(m.path)}: model", timing_options(session))
        for m, kept in zip(models, given, strict=True)
    ]
    if stop is not None and len(candidates) == 1 and len(latency) == 1 and timing.runs > RACE_FIRST_RUNS:
        first = interleaved_runs(sessions, latency[0], RACE_FIRST_RUNS)
        so_far = timed_figures([first], len(candidates))
        if stop(so_far[0]) is not None:
            return so_far
        rest = interleaved_runs(sessions, latency[0], timing.runs - RACE_FIRST_RUNS, warm=False)
        return timed_figures([[a + b for a, b in zip(first, rest, strict=True)]], len(candidates))
    return timed_figures([interleaved_runs(sessions, feeds, timing.runs) for feeds in latency], len(candidates))


# A row's first timing rounds before it may be raced on its speed (latency_figures' stop):
# the fewest whose Student-t bound (2 degrees of freedom) can show a row far slower than float.
RACE_FIRST_RUNS = 3


def timed_figures(runs_by_sample: list[list[list[float]]], candidates: int) -> list[dict]:
    """latency_figures' figures of each candidate from each latency sample's runs
    (interleaved_runs': the float model's, then each candidate's)."""
    float_s = 0.0
    quant_s = [0.0] * candidates
    ratios: list[list[float]] = [[] for _ in range(candidates)]
    for float_runs, *quant_runs in runs_by_sample:
        float_s += statistics.median(float_runs)
        for k, runs in enumerate(quant_runs):
            quant_s[k] += statistics.median(runs)
            ratios[k] += [f / max(q, 1e-12) for f, q in zip(float_runs, runs, strict=True)]
    return [
        {
            "ms": quant_s[k] * 1e3,
            "float_ms": float_s * 1e3,
            "speedup": statistics.median(ratios[k]) if ratios[k] else None,
            "speedup_spread": quartiles(ratios[k]),
            "speedup_runs": ratios[k],  # not a row's key: the ledger keeps it for the policy's speed ties
        }
        for k in range(candidates)
    ]


def quartiles(values: list[float]) -> list[float] | None:
    """``[25th, 75th]`` percentiles of ``values`` (None without any)."""
    if not values:
        return None
    low, high = np.percentile(np.asarray(values, dtype=np.float64), [25, 75])
    return [float(low), float(high)]


class OnTarget:
    """tune's accuracy and kernels as a CPU target computes them, in one interpreter kept
    for the run (``runner``'s): the evaluation ``samples`` saved once into ``folder``, the
    float model's outputs run there once and kept, then one call per candidate for its
    outputs and its kernels (``candidate_on_target``)."""

    def __init__(self, runner: TargetRunner, folder: str, samples: list[dict], session: Session) -> None:
        self.runner, self.folder, self.samples, self.session = runner, folder, samples, session
        self.samples_file, self.names = save_samples(folder, samples)
        self.floats: dict[tuple[str, ...], FloatOutputs] = {}  # the float model's outputs, by the outputs wanted

    def measure(self, reference: Named, candidate: Named, pairs: list[tuple[str, str]]) -> tuple[PairedOutputs, dict]:
        """``candidate``'s outputs paired with the float model's, both as the target computes
        them, and ``kernel_counts`` of its optimized session there."""
        float_names = tuple(f for f, _ in pairs)
        answer = os.path.join(self.folder, "outputs.npz")
        if float_names not in self.floats:
            self.runner.call(float_on_target, reference.path, list(float_names), *self.arguments(), answer)
            with np.load(answer) as saved:
                rows = read_outputs(saved, "f", len(self.samples), len(float_names))
            layout = output_layout(reference.model, float_names, self.samples)
            self.floats[float_names] = FloatOutputs(rows, float_names, layout)
        kernels = self.runner.call(
            candidate_on_target, candidate.path, [q for _, q in pairs], *self.arguments(), answer
        )
        with np.load(answer) as saved:
            rows = read_outputs(saved, "q", len(self.samples), len(pairs))
        return PairedOutputs(self.floats[float_names], rows), kernels

    def arguments(self) -> list:
        return [self.session.level, self.session.threads, self.samples_file, self.names]


def saved_model_outputs(
    model: onnx.ModelProto, path: str, names: list[str], run: list, answer: str, prefix: str
) -> None:
    """``names`` of ``model`` on the saved samples in a session as measure_candidate opens it
    (``run``: ``OnTarget.arguments``, level, threads, the samples' file and input names),
    saved to ``answer`` (.npz) under ``prefix``."""
    level, threads, samples_file, sample_names = run
    samples = load_samples(samples_file, sample_names)
    outputs = model_outputs(model, samples, path, names, session_options(level, threads))
    np.savez(answer, **keyed_outputs(prefix, outputs))


def float_on_target(
    path: str, names: list[str], level: str, threads: int, samples_file: str, sample_names: list[list[str]], answer: str
) -> None:
    """Inside a CPU target: the float model's outputs ``names`` on the saved samples."""
    run = [level, threads, samples_file, sample_names]
    saved_model_outputs(load_with_weights(path), path, names, run, answer, "f")


def candidate_on_target(
    path: str, names: list[str], level: str, threads: int, samples_file: str, sample_names: list[list[str]], answer: str
) -> dict:
    """Inside a CPU target: a candidate's outputs ``names`` on the saved samples (saved to
    ``answer``) and ``kernel_counts`` of the session that target optimizes it into."""
    model = load_with_weights(path)
    saved_model_outputs(model, path, names, [level, threads, samples_file, sample_names], answer, "q")
    return kernel_counts(model, path, level)
