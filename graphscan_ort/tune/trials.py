"""tune's books: how a candidate is measured, and every model tried with its row.

``Measure`` holds what every candidate is measured against (the float model, the
evaluation and latency samples, the session); ``Trials.add`` quantizes one
candidate, measures it as deployed and books its row, a ``Candidate`` built once
from its outcome (measured, the twin of a model already measured, or refused by
the quantizer or onnxruntime with its error, never a crash).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import math
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import onnx

from graphscan import EXIT_NO_FILE, EXIT_RUNTIME, GraphscanError, Session, one_line, shown
from graphscan_ort.engines.levels import FloatRanges
from graphscan_ort.engines.timing import far_off
from graphscan_ort.shared.agreement import Metric
from graphscan_ort.shared.answers import RACED_ON_SPEED, Candidate
from graphscan_ort.shared.files import in_folder, out_of_room, write_failure
from graphscan_ort.shared.metrics import FloatOutputs
from graphscan_ort.shared.options import Named, Timing
from graphscan_ort.shared.sessions import open_session
from graphscan_ort.tune import choice, deployed
from graphscan_ort.tune.bias import same_graph
from graphscan_ort.tune.bounds import DEFAULT_CONFIDENCE
from graphscan_ort.tune.candidates import (
    DYNAMIC,
    STATIC,
    SampleReader,
    cache_path,
    calibration_key,
    defaults_settings,
    file_digest,
    quantize_candidate,
    quantize_dynamic_candidate,
)
from graphscan_ort.tune.choice import (
    Policy,
    TimedRuns,
    accuracy,
    passing,
    shown_behind,
    speed_bound_above,
    speeds_tie,
)
from graphscan_ort.tune.deployed import OnTarget, accuracy_figures, measure_candidate
from graphscan_ort.tune.fallback import honoured
from graphscan_ort.tune.guards import failed_guards, file_bytes, float_weight_nodes
from graphscan_ort.tune.requantize import FirstRow, RangePlan, quantize_by_plan
from graphscan_ort.tune.verdict import levels_figures, sqnr_broken

LATENCY = ("ms", "float_ms", "speedup", "speedup_spread")  # deployed.latency_figures' keys
STEADY_ROWS = 5  # rows timed before one's float time is judged against the others' (Trials.steady)
BUSY_FACTOR = 2.0  # the float model's own times across the run spread wider than this: a busy machine


UNBOOKED = -1  # the timing session of a row's runs before it is booked (Trials.sessions counts from 0)


def busy_spread(float_times: Sequence[float]) -> bool:
    """Whether the float model's own times, timed beside each row, spread more than
    BUSY_FACTOR times (at least 2 of them, all above 0): the machine was busy."""
    return len(float_times) >= 2 and min(float_times) > 0 and max(float_times) > BUSY_FACTOR * min(float_times)


class Post(NamedTuple):
    """A change made to a quantized file before it is measured (recovery.py's bias
    correction), and the row whose model it changes."""

    change: Callable[[str], None]
    parent: Candidate


# A row's first timing: enough runs for the policy's paired bounds to tell most rows apart;
# the retime stage times the written row and its rivals on --runs (a race: the runs go to
# the rows still in contention, as successive halving gives its budget to the survivors).
FIRST_RUNS = 5


class Measure:
    """How every candidate is measured: the float model (and its path), the evaluation
    samples, the session group (level, threads), the timed runs (``first``: every row's first
    timing, at most FIRST_RUNS of them), the metric (None: the
    SQNR), the latency samples (None: the first evaluation sample), the speedup a
    model must beat (None: no ``slower`` guard, an emulated CPU target's run without
    --min-speedup) and the CPU target the accuracy and kernels are measured on (None:
    this process). ``models`` keeps every candidate written, read once by Trials.add,
    by path for the exclusions."""

    def __init__(
        self,
        reference: Named,
        evaluation: list[dict[str, np.ndarray]],
        session: Session,
        timing: Timing,
        metric: Metric | None = None,
        latency: list[dict[str, np.ndarray]] | None = None,
        min_speedup: float | None = 1.0,
        on: OnTarget | None = None,
    ) -> None:
        self.reference, self.evaluation, self.session, self.timing = reference, evaluation, session, timing
        self.first = Timing(min(timing.runs, FIRST_RUNS))  # every row's first timing; --runs for the contenders
        self.model, self.path, self.level = reference.model, reference.path, session.level  # as Trials reads them
        self.metric, self.latency, self.min_speedup, self.on = metric, latency, min_speedup, on
        self.models: dict[str, onnx.ModelProto] = {}
        self.references: dict[tuple[str, ...], FloatOutputs] = {}  # the float model's outputs, run once
        self.float_bytes = file_bytes(reference.path, reference.model)
        self.float_session: Any = None  # the float model's timing session, opened once (float_timing)

    def float_timing(self) -> Any:
        """The float model's timing session, opened at the first timing and kept from one
        timing to the next: rows are timed beside the same session, built and warmed once.
        Its arena holds the float model's tensors at the latency samples' sizes (180 MB for a
        detector at 736x736), so steps that hold many tensors of their own drop it first
        (release_float) and the next timing opens it again."""
        if self.float_session is None:
            self.float_session = open_session(
                self.reference.model, f"{shown(self.reference.path)}: model", deployed.timing_options(self.session)
            )
        return self.float_session

    def release_float(self) -> None:
        """Drop the float model's timing session (float_timing) before a step that holds many
        tensors (a calibration, a bias correction, the exclusions' ranking): its arena would
        add to that step's peak."""
        self.float_session = None

    @property
    def timed_samples(self) -> list[dict[str, np.ndarray]]:
        """The samples every latency is timed on: --latency-inputs, else the first evaluation sample."""
        return self.latency or self.evaluation[:1]

    def timed(self, candidate: onnx.ModelProto, candidate_path: str) -> dict:
        """``candidate``'s latency figures timed again (Trials.steady) by the timer that
        measure_candidate timed them with: deployed.latency_figures, looked up when called."""
        named = Named(candidate, candidate_path)
        timed = deployed.latency_figures(
            self.reference, [named], self.timed_samples, self.session, self.first, [self.float_timing()]
        )
        return timed[0]

    def __call__(
        self,
        candidate: onnx.ModelProto,
        candidate_path: str,
        excluded: list[str] | None = None,
        speed: dict | None = None,
        timed_alike: Callable[[str], dict | None] | None = None,
        race: deployed.Race | None = None,
        opened: tuple[Any, onnx.ModelProto | None] | None = None,
    ) -> dict:
        """A candidate's figures as deployed (``candidate``, read from ``candidate_path``), with
        its weights' storage and the guards it breaks; ``speed``: latency figures it inherits;
        ``timed_alike``: those of a row timed already that runs the same plan; ``race``: why
        its accuracy need not be measured, given its speed (measure_candidate); ``opened``: its
        session and saved graph, open already (deployed.measured_session)."""
        named = Named(candidate, candidate_path)
        references = self.references if self.on is None else self.on  # where the float outputs are run
        if speed is None:
            row = measure_candidate(
                self.reference,
                named,
                self.evaluation,
                self.session,
                self.first,
                references,
                self.metric,
                self.latency,
                timed_alike if self.on is None else None,  # a CPU target's plan is not the timed one
                race,
                deployed.Kept(self.float_timing, opened),  # opened when the row is timed
            )
        else:  # the same graph as a row timed already: its speed, this model's own accuracy and file
            accuracy = accuracy_figures(self.reference, named, self.evaluation, self.session, references, self.metric)
            row = {**accuracy, **speed, "bytes": os.path.getsize(candidate_path)}
        row["float_weights"] = len(float_weight_nodes(candidate, excluded))
        row["fails"] = failed_guards(row, self.float_bytes, self.min_speedup)
        return row


def blame_the_disk(exc: Exception, work: str, needed: int) -> None:
    """Raise when the quantizer failed for want of room, never a refusal of the candidate:
    ``work`` (in --out's folder) or the temporary folder (TMPDIR, where the quantizer keeps
    its calibration copies) said so, or has less room left than ``needed`` (the model the
    quantizer was given: what it writes is about that size)."""
    temporary = tempfile.gettempdir()
    if out_of_room(work, needed) or (write_failure(exc) and in_folder(exc, work)):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), work) from exc
    # Beside work, the quantizer writes only into the temporary folder (its copies, removed
    # again by the time this runs: a failure that names no file was there).
    unnamed = getattr(exc, "filename", None) is None
    if (write_failure(exc) and (unnamed or in_folder(exc, temporary))) or out_of_room(temporary, needed):
        why = getattr(exc, "strerror", None) if write_failure(exc) else None
        raise GraphscanError(
            f"cannot write into the temporary folder {shown(temporary)} ({why or 'no space left on its file system'}): "
            "is it full? set TMPDIR to a folder with room",
            EXIT_NO_FILE,
        ) from None
    if write_failure(exc):
        raise exc


def candidate_row(
    ident: int,
    quantizer: str,
    settings: dict[str, Any],
    rewrites: bool,
    kept: list[dict[str, str]],
    trial: dict[str, Any] | None,
    *,
    excluded: dict[str, str] | None = None,
    post_step: dict[str, list[str]] | None = None,
    same_as: int | None = None,
    speed_from: int | None = None,
    figures: Mapping[str, Any] | None = None,
    error: str | None = None,
) -> Candidate:
    """A candidate's row, key for key in the answer's order: ``settings`` under its
    ``quantizer``'s key, the other null; ``figures``: what its measurement gave (a twin
    copies its twin's, float_ms too: its speedup is that float time over its ms), none
    for a refused one. Off the Pareto front until choice.pareto marks it."""
    got = figures or {}
    return {
        "id": ident,
        "quantize_static": settings if quantizer == STATIC else None,
        "quantize_dynamic": settings if quantizer == DYNAMIC else None,
        "rewrites": rewrites,
        "kept_float": kept,
        "trial": trial,
        "post_step": post_step,
        "excluded": excluded,
        "same_as": same_as,
        "speed_from": speed_from,
        "recovery": None,  # recovery.py fills it in on the rows it adds
        "sqnr_db": got.get("sqnr_db"),
        "pooled_sqnr_db": got.get("pooled_sqnr_db"),
        "worst_part": got.get("worst_part"),
        "metric_value": got.get("metric_value"),
        "metric_bound": None,  # choice.Policy.settle bounds every measured row at the run's confidence
        "metric_events": got.get("metric_events"),
        "metric_worst": got.get("metric_worst"),
        "metric_spread": got.get("metric_spread"),
        "levels": got.get("levels"),
        "broken_parts": got.get("broken_parts"),
        "int8_fraction": got.get("int8_fraction"),
        "int8_kernels": got.get("int8_kernels"),
        "wrapped_but_float": got.get("wrapped_but_float"),
        "ms": got.get("ms"),
        "float_ms": got.get("float_ms"),
        "speedup": got.get("speedup"),
        "speedup_spread": got.get("speedup_spread"),
        "bytes": got.get("bytes"),
        "float_weights": got.get("float_weights"),
        "fails": got.get("fails"),
        "pareto": False,
        "error": error,
        "raced": got.get("raced"),
    }


def gains(row: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, float | None]:
    """A row's gains over ``base``: in the worst part's SQNR (dB) and in the metric's unit
    (None where either is undefined or infinite)."""
    return {
        "sqnr_gain_db": difference(row.get("sqnr_db"), base.get("sqnr_db")),
        "metric_gain": difference(row.get("metric_value"), base.get("metric_value")),
    }


def difference(value: float | None, before: float | None) -> float | None:
    """``value - before`` when both are finite numbers (None otherwise)."""
    if value is None or before is None or not (math.isfinite(value) and math.isfinite(before)):
        return None
    return value - before


# onnxruntime's quantizer names the temporary copies it makes (ort.quant.*/augmented_model.onnx).
ORT_TEMPORARY = re.compile(r"\S*ort\.quant\.\w+/\S*?\.onnx")


def users_terms(text: str, work: str, path: str) -> str:
    """``text`` naming the user's model instead of a temporary file: tune's own copies in
    ``work`` and onnxruntime's calibration copies are files the user never saw; numpy's
    words for onnxruntime stacking samples of several shapes said in the user's terms."""
    text = ORT_TEMPORARY.sub(f"onnxruntime's calibration copy of {shown(path)}", text)
    text = re.sub(re.escape(work) + r"/\S*?\.onnx", f"graphscan's prepared copy of {shown(path)}", text)
    if "inhomogeneous shape" in text:
        text = f"{HISTOGRAM_SHAPES} ({text})"
    return text


# onnxruntime's histogram calibrators (Percentile, Entropy, Distribution) stack every
# calibration output into one array, so samples of several shapes fail in numpy.
HISTOGRAM_SHAPES = (
    "onnxruntime's histogram calibration (Percentile, Entropy) needs calibration samples of one shape; "
    "these have several"
)


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a row came from: its stage (``STAGE_OF``'s kinds: grid, seed, refinement,
    equalize, bias_correction, calibration_overrides, trial) and the row it came from (None:
    none), with what was done, in words, for a recovery row."""

    stage: str = "grid"
    source: Candidate | None = None
    detail: Callable[[], str] | None = None  # read once the row is made (a bias correction's count)
    trial: dict[str, Any] | None = None  # an exclusion trial's block: {"block": kind, "added": [node, ...]}


RECOVERY_STEPS = ("equalize", "bias_correction", "calibration_overrides")  # a row's ``recovery``


@dataclasses.dataclass
class Record:
    """Everything the run knows of one model tried, kept with it and nowhere else: its row
    (the answer's), where it came from, its files (the model, the prepared model it was
    quantized from and its calibration cache; None when refused), its metric sample by
    sample, its speedup run by run, the row whose timing it carries (None: its own) and
    whether it was timed twice."""

    row: Candidate
    origin: Origin
    files: tuple[str, str, str] | None = None
    by_sample: list[float | None] | None = None
    runs: TimedRuns | None = None
    speed_from: int | None = None
    retimed: bool = False


class Column(Mapping[int, Any]):
    """One fact of every record, by row id, read from the records when asked (never a copy)."""

    def __init__(self, records: dict[int, Record], fact: str) -> None:
        self.records, self.fact = records, fact

    def __getitem__(self, ident: int) -> Any:
        return getattr(self.records[ident], self.fact)

    def __iter__(self) -> Iterator[int]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


class Trials:
    """The ledger: every model tried, in order, one ``Record`` each (``records``, by id; their
    rows in ``rows``), and what the run shares between them: the prepared models the quantizer
    was given (``given``, by path), the digest of each model measured (its twins are measured
    once), each prepared model's float values by part (``ranges``). ``policy``: the run's
    policy (choice.Policy), once the target is known; a recovery row's ``helps`` is its word."""

    def __init__(
        self,
        work: str,
        reader: Callable[[], SampleReader],
        measure: Measure,
        confidence: float = DEFAULT_CONFIDENCE,
    ) -> None:
        self.work, self.reader, self.measure, self.confidence = work, reader, measure, confidence
        self.records: dict[int, Record] = {}
        self.rows: list[Candidate] = []
        self.given: dict[str, onnx.ModelProto] = {}  # the prepared models the quantizer is given, by path
        self.digests: dict[str, Candidate] = {}  # a model's SHA-256: the row that measured it
        self.ranges: dict[str, FloatRanges] = {}  # per prepared model: its float values by part
        self.disturbed: list[str] = []  # what the answer's warnings say of each row whose speed stayed disturbed
        self.policy: Policy | None = None
        # requantize's plans: one quantized graph per structure, many ranges
        self.plans: dict[tuple[str, str], RangePlan | FirstRow] = {}
        self.timed_plans: dict[str, int] = {}  # the optimized graph's digest: the first row timed on it
        self.sessions = itertools.count()  # each timing session's key: the runs of one are paired

    @property
    def files(self) -> dict[int, tuple[str, str, str]]:
        """Each row's files (model, prepared model, cache), of the rows the quantizer made."""
        return {ident: record.files for ident, record in self.records.items() if record.files is not None}

    @property
    def by_sample(self) -> Column:
        """Each row's metric sample by sample (None: not measured, or not known), as the
        records hold it now and later."""
        return Column(self.records, "by_sample")

    @property
    def runs(self) -> Column:
        """Each row's speedup run by run, and the session they were timed in (None: not
        timed), as the records hold them now and later."""
        return Column(self.records, "runs")

    def timed_runs(self, figures: Mapping[str, Any]) -> TimedRuns | None:
        """latency figures' run-by-run speedups, as timed in a session of their own."""
        ratios = figures.get("speedup_runs")
        return None if ratios is None else TimedRuns(next(self.sessions), tuple(ratios))

    def add(
        self,
        settings: dict[str, Any],
        rewrites: bool,
        prepared_path: str,
        cache: str,
        kept: list[dict[str, str]] | None = None,
        quantizer: str = STATIC,
        post: Post | None = None,
        origin: Origin | None = None,
    ) -> Candidate:
        """Quantize ``prepared_path`` with ``settings`` and measure the model as deployed:
        its row, also when the quantizer refused it (with its error, never a crash);
        ``kept``: the seeds kept float in it, ``{"node", "why"}`` each (seeds.py); ``quantizer``:
        quantize_static or quantize_dynamic (no calibration), the row's key holding ``settings``;
        ``post``: a change to the quantized file before it is measured, and the row it changes
        (whose speed the model takes, untimed, when its graph is that row's: bias.same_graph);
        ``origin``: where the row came from (a recovery step's row says what it did and gained,
        an exclusion trial the block it added). A grid row may be raced out on speed
        (raced_out) or on its first evaluation samples (raced_on_samples), but for
        onnxruntime's defaults' own: its accuracy may be the target."""
        ident = len(self.rows)
        origin = origin or Origin()
        record = Record(cast(Candidate, {}), origin)
        target_path = os.path.join(self.work, f"candidate-{ident}.onnx")
        row = functools.partial(candidate_row, ident, quantizer, settings, rewrites, kept or [], origin.trial)
        calibrates = quantizer == STATIC and not os.path.isfile(cache_path(cache, calibration_key(settings)))
        if post is not None or calibrates:
            self.measure.release_float()  # a calibration or a bias correction to come
        try:
            quantize = quantize_dynamic_candidate if quantizer == DYNAMIC else self.quantize_static
            quantize(prepared_path, target_path, settings, self.reader, cache)
            if post is not None:  # a change to the quantized file itself (recovery.py's bias correction)
                post.change(target_path)
        except Exception as exc:
            blame_the_disk(exc, self.work, os.path.getsize(prepared_path))
            return self.book(record, row(error=f"{quantizer}: {self.users_terms(one_line(exc))}"))
        excluded = settings.get("nodes_to_exclude")
        model = onnx.load(target_path)  # read once: checked, measured and kept for the exclusions
        status, post_step = None, None
        opened = None  # the session its exclusions are checked in, measured in too when they hold
        if excluded:  # checked in the deployed session, made real where onnxruntime undid it
            given = self.given[prepared_path]
            try:
                if self.measure.on is None:
                    opened = deployed.measured_session(Named(model, target_path), self.measure.session)
                optimized = None if opened is None else opened[1]
                model, status, fixed = honoured(model, target_path, self.measure.level, excluded, given, optimized)
            except GraphscanError as exc:  # a trial onnxruntime cannot even optimize: a row, not the end
                if exc.exit_code != EXIT_RUNTIME:
                    raise
                return self.book(record, row(error=f"onnxruntime: {self.users_terms(str(exc))}"))
            post_step = {"float_inputs": fixed} if fixed else None
            opened = None if fixed else opened  # a model made real anew is another file
        digest = file_digest(target_path)
        twin = self.digests.get(digest)
        if twin is not None:  # the quantizer made the very same model: measured once
            measured = row(excluded=status, post_step=post_step, same_as=twin["id"], figures=twin)
            record.by_sample, record.runs = self.records[twin["id"]].by_sample, self.records[twin["id"]].runs
        else:
            speed = None
            parent = None if post is None else self.records[post.parent["id"]]
            if parent is not None and parent.files and same_graph(model, self.measure.models[parent.files[0]]):
                owner = self.timing_owner(parent).row  # the same kernels: timing it again adds only noise
                speed = {**{key: owner.get(key) for key in LATENCY}, "speed_from": owner["id"]}
            try:
                race = origin.stage == "grid" and quantizer == STATIC and speed is None
                racing = self.race if race and not defaults_settings(settings, rewrites) else None
                figures = self.measure(model, target_path, excluded, speed, self.timed_alike, racing, opened)
            except GraphscanError as exc:  # a model the quantizer made that onnxruntime refuses
                if exc.exit_code != EXIT_RUNTIME:
                    raise
                error = f"onnxruntime: {self.users_terms(str(exc))}"
                return self.book(record, row(excluded=status, post_step=post_step, error=error))
            if figures.get("raced") is None:  # a raced row has no outputs to judge
                figures.update(self.verdict(model, prepared_path, figures))
            record.speed_from = figures.get("speed_from")
            measured = row(excluded=status, post_step=post_step, speed_from=record.speed_from, figures=figures)
            record.by_sample = figures.get("metric_by_sample")
            if record.speed_from is None:
                record.runs = self.timed_runs(figures)
                if figures.get("plan") is not None:
                    self.timed_plans.setdefault(figures["plan"], measured["id"])
            else:
                record.runs = self.records[record.speed_from].runs
            if figures.get("raced") is None:  # a twin of a raced row is measured: it may be wanted later
                self.digests[digest] = measured
        record.files = (target_path, prepared_path, cache)
        self.measure.models[target_path] = model
        self.book(record, measured)
        self.steady()
        return measured

    @property
    def race(self) -> deployed.Race:
        """How a grid row may be raced (measure_candidate): on its speed, then on its first samples."""
        return deployed.Race(self.raced_out, self.raced_on_samples)

    def raced_on_samples(self, timed: Mapping[str, Any], values: list[float | None]) -> str | None:
        """Why a grid row timed at ``timed`` (latency figures) need not be run on its remaining
        evaluation samples, or None: on the first ones (its metric on each, ``values``) it is
        shown less accurate (choice.shown_behind, paired, at the run's confidence) than a row
        measured already that passes every guard, breaks no output part, is no bias correction
        and is at least as fast (its speedup at least this row's, or their runs cannot tell
        them apart: the policy's speed tie), so the policy would write that row before it.
        Never on a busy machine (unsteady): a speed read in a burst could name the wrong row
        the faster."""
        if timed.get("speedup") is None or self.unsteady(timed):
            return None
        mine = self.race_runs(timed)
        for rival in self.rows:
            theirs = self.records[rival["id"]].by_sample
            if theirs is None or not passing(rival) or rival.get("broken_parts"):
                continue
            corrected = (rival.get("recovery") or {}).get("step") == "bias_correction"
            tie = speeds_tie(self.records[rival["id"]].runs, mine, self.confidence)
            as_fast = choice.speed(rival) >= choice.speed(timed) or tie is True
            if not corrected and as_fast and shown_behind(values, theirs[: len(values)], self.confidence):
                rest = len(self.measure.evaluation) - len(values)
                return (
                    f"not run on its last {rest} evaluation samples: on its first {len(values)}, its metric is "
                    f"shown below candidate {rival['id']}'s at {self.confidence:g} confidence (paired), a row as "
                    "fast that passes every guard: it is never written"
                )
        return None

    def unsteady(self, timed: Mapping[str, Any]) -> bool:
        """Whether the float model's times so far, with the one timed beside ``timed``, spread
        more than BUSY_FACTOR times (busy_spread), or one is not above 0: no race is run then."""
        floats = [r["float_ms"] for r in self.rows if r["float_ms"] is not None] + [timed["float_ms"]]
        return min(floats) <= 0 or busy_spread(floats)

    def race_runs(self, timed: Mapping[str, Any]) -> TimedRuns | None:
        """The runs behind latency figures ``timed`` before their row is booked: those of the
        row whose plan it runs (``speed_from``), else its own, in a session no booked row
        shares (None: none)."""
        twin = timed.get("speed_from")
        if twin is not None and self.records[twin].runs is not None:
            return self.records[twin].runs
        ratios = timed.get("speedup_runs")
        return TimedRuns(UNBOOKED, tuple(ratios)) if ratios else None

    def raced_out(self, speed: Mapping[str, Any]) -> str | None:
        """Why a row timed at ``speed`` (latency figures, its own or a plan twin's) need not be
        measured for accuracy, or None: its speedup is shown not above ``--min-speedup`` (the
        upper bound of its runs' speedup at the run's confidence, choice.speed_bound_above) while
        a row measured already passes every guard, so the policy can never write it. Never on
        a busy machine (the float model's times so far spread more than BUSY_FACTOR times):
        a burst on a row's own runs could make a fast row look slow."""
        floor = self.measure.min_speedup
        rival = next((r for r in self.rows if passing(r)), None)
        if floor is None or rival is None or speed.get("speedup") is None:  # (0: every bound lies above it)
            return None
        if self.unsteady(speed):
            return None
        runs = self.race_runs(speed)
        ratios = () if runs is None else runs.ratios
        upper = speed_bound_above(ratios, self.confidence)
        if upper is None or upper > floor:
            return None
        return (
            f"{RACED_ON_SPEED}: its speedup, {speed['speedup']:.3g}x, is at most {upper:.3g}x at "
            f"{self.confidence:g} confidence ({len(ratios)} runs), not above --min-speedup {floor:g}, while "
            f"candidate {rival['id']} passes every guard: it is never written"
        )

    def quantize_static(
        self,
        prepared: str,
        output: str,
        settings: dict[str, Any],
        make_reader: Callable[[], SampleReader],
        cache: str,
    ) -> None:
        """quantize_static's row: made from an earlier row's model where only its ranges differ
        (requantize.quantize_by_plan: the same bytes), else quantize_candidate's."""
        quantize_by_plan(self.plans, prepared, output, settings, make_reader, cache, fallback=quantize_candidate)

    def timed_alike(self, plan: str) -> dict[str, Any] | None:
        """The latency figures of the first row timed itself whose optimized graph has the
        digest ``plan`` (deployed.plan_digest), ``speed_from`` naming it; None: no such row.
        A row made from another by its ranges alone (a calibration method or percentile,
        overrides, a bias correction) most often runs the same plan: timing it again would
        add only noise, and half the rows' time on a page-size model. A row whose speedup was
        nulled (its float time stayed far off: steady) lends none: the next row is timed."""
        ident = self.timed_plans.get(plan)
        if ident is None or self.records[ident].row["speedup"] is None:
            return None
        return {**{key: self.records[ident].row.get(key) for key in LATENCY}, "speed_from": ident}

    def recovery(self, record: Record) -> dict[str, Any] | None:
        """A recovery row's ``recovery``: its step and source, what it did and gained, whether
        it helps (the policy's ``better``), and for a bias correction whose timing it carries."""
        origin = record.origin
        if origin.stage not in RECOVERY_STEPS or origin.source is None:
            return None
        row, base = record.row, origin.source
        helps = row["error"] is None and (
            self.policy.better(row, base) if self.policy is not None else accuracy(row) > accuracy(base)
        )
        detail = origin.detail() if origin.detail is not None else ""
        found = {"step": origin.stage, "from": base["id"], "detail": detail, **gains(row, base), "helps": helps}
        if origin.stage == "bias_correction":
            found["speed_from"] = record.speed_from
        return found

    def book(self, record: Record, row: Candidate) -> Candidate:
        """Keep ``row`` among the rows tried, in its record (a refused one has no file to write)."""
        row["recovery"] = None
        record.row = row
        row["recovery"] = self.recovery(record)
        self.records[row["id"]] = record
        self.rows.append(row)
        return row

    def steady(self) -> None:
        """Time again, once, each row whose float time lies far off the other rows'
        (timing.far_off): every row times the same float model, so only a disturbed moment
        moves it, and the speedup with it. A row still far off keeps its times but loses its
        speedup and spread (null: never ranked by them, and the ``slower`` guard fails it),
        and is named in ``disturbed``. The rows that carry its speed (twins, bias-corrected
        rows of its graph) take the new figures, their guards judged anew."""
        floats = {
            ident: float(record.row["float_ms"])
            for ident, record in self.records.items()
            if record.row["float_ms"] is not None and record.row["same_as"] is None and record.speed_from is None
        }  # the rows timed themselves
        if len(floats) < STEADY_ROWS:
            return
        for ident in list(floats):
            record = self.records[ident]
            others = [value for other, value in floats.items() if other != ident]
            if record.retimed or not far_off(floats[ident], others):
                continue
            record.retimed = True
            assert record.files is not None, "a timed row has its model"
            model_path = record.files[0]
            speed = self.measure.timed(self.measure.models[model_path], model_path)
            if far_off(speed["float_ms"], others):
                self.disturbed.append(
                    f"candidate {ident}'s float time lay far off the other rows' (median "
                    f"{statistics.median(others):.3g} ms): {floats[ident]:.3g} ms, then {speed['float_ms']:.3g} ms "
                    "timed again; its speedup is null, never ranked (time it on a quiet machine)"
                )
                speed = {**speed, "speedup": None, "speedup_spread": None, "speedup_runs": None}
            floats[ident] = speed["float_ms"]
            self.retake_with_carriers(record, speed, self.timed_runs(speed))

    def retime_together(self, rows: list[Candidate]) -> None:
        """``rows`` timed again together in one interleaved session with the float model
        (deployed.latency_figures): their runs paired round by round, their guards judged
        anew, and the rows that carry their speed with them."""
        measure = self.measure
        # The records whose timing they are: a row that carries another's (a bias-corrected
        # row of the same graph) is timed as that one, and takes its figures with the rest.
        owners = [self.timing_owner(self.records[row["id"]]) for row in rows]
        records = list({id(r): r for r in owners}.values())
        models = [Named(measure.models[r.files[0]], r.files[0]) for r in records if r.files is not None]
        timed = deployed.latency_figures(
            measure.reference, models, measure.timed_samples, measure.session, measure.timing, [measure.float_timing()]
        )
        session = next(self.sessions)
        for record, speed in zip(records, timed, strict=True):
            ratios = speed.get("speedup_runs")
            self.retake_with_carriers(record, speed, None if ratios is None else TimedRuns(session, tuple(ratios)))

    def timing_owner(self, record: Record) -> Record:
        """The record whose timing ``record``'s is: its own, or, following ``speed_from`` and
        ``same_as``, the row that was timed."""
        while (source := record.speed_from if record.speed_from is not None else record.row["same_as"]) is not None:
            record = self.records[source]
        return record

    def retake_with_carriers(self, record: Record, speed: Mapping[str, Any], runs: TimedRuns | None) -> None:
        """``record`` retaken (retake), and every row that carries its speed: its twins (the
        quantizer made the same model) and the rows timed alike (``speed_from``: a bias
        correction of its graph, a row that runs its plan), and theirs in turn."""
        carriers = [record]
        for carrier in carriers:  # grows as it goes: a twin of a row that carries this one's speed
            ident = carrier.row["id"]
            carriers += [
                r
                for r in self.records.values()
                if (r.row["same_as"] == ident or r.speed_from == ident) and all(r is not c for c in carriers)
            ]
        for carrier in carriers:
            self.retake(carrier, speed, runs)

    def retake(self, record: Record, speed: Mapping[str, Any], runs: TimedRuns | None) -> None:
        """``record``'s row with the latency figures ``speed`` and their ``runs``, its guards judged anew."""
        row = record.row
        row["ms"], row["float_ms"] = speed["ms"], speed["float_ms"]
        row["speedup"], row["speedup_spread"] = speed["speedup"], speed["speedup_spread"]
        record.runs = runs
        row["fails"] = failed_guards(dict(row), self.measure.float_bytes, self.measure.min_speedup)

    def users_terms(self, text: str) -> str:
        """``text`` in the user's terms (users_terms): this run's folder and model."""
        return users_terms(text, self.work, self.measure.path)

    def float_ranges(self, prepared_path: str) -> FloatRanges:
        """The float values of the prepared model at ``prepared_path``, by part, on the
        evaluation samples: measured once per tensor for every candidate quantized from it."""
        if prepared_path not in self.ranges:
            self.ranges[prepared_path] = FloatRanges(
                self.given[prepared_path], self.measure.evaluation, self.measure.path
            )
        return self.ranges[prepared_path]

    def verdict(self, model: onnx.ModelProto, prepared_path: str, figures: dict[str, Any]) -> dict[str, Any]:
        """A measured candidate's fewest levels and the parts of its outputs below a floor."""
        levels, broken = levels_figures(model, self.float_ranges(prepared_path))
        return {"levels": levels, "broken_parts": sqnr_broken(figures["sqnr_db"], figures["worst_part"]) + broken}
