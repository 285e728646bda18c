"""tune's books: how a candidate is measured, and every model tried with its row.

``Measure`` holds what every candidate is measured against (the float model, the
evaluation and latency samples, the session); ``Trials.add`` quantizes one
candidate, measures it as deployed and books its row, a ``Candidate`` built once
from its outcome (measured, the twin of a model already measured, or refused by
the quantizer or onnxruntime with its error, never a crash).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import onnx

from graphscan import EXIT_NO_FILE, EXIT_RUNTIME, GraphscanError, Session, one_line, shown
from graphscan_ort.engines.levels import FloatRanges
from graphscan_ort.engines.timing import far_off
from graphscan_ort.shared.agreement import Metric
from graphscan_ort.shared.answers import Candidate
from graphscan_ort.shared.files import in_folder, out_of_room, write_failure
from graphscan_ort.shared.metrics import FloatOutputs
from graphscan_ort.shared.options import Named, Timing
from graphscan_ort.tune import deployed
from graphscan_ort.tune.bias import same_graph
from graphscan_ort.tune.candidates import (
    DYNAMIC,
    STATIC,
    SampleReader,
    file_digest,
    quantize_candidate,
    quantize_dynamic_candidate,
)
from graphscan_ort.tune.deployed import OnTarget, accuracy_figures, measure_candidate
from graphscan_ort.tune.fallback import honoured
from graphscan_ort.tune.guards import failed_guards, file_bytes, float_weight_nodes
from graphscan_ort.tune.verdict import levels_figures, sqnr_broken

LATENCY = ("ms", "float_ms", "speedup", "speedup_spread")  # deployed.latency_figures' keys
STEADY_ROWS = 5  # rows timed before one's float time is judged against the others' (Trials.steady)


class Post(NamedTuple):
    """A change made to a quantized file before it is measured (recovery.py's bias
    correction), and the row whose model it changes."""

    change: Callable[[str], None]
    parent: Candidate


class Measure:
    """How every candidate is measured: the float model (and its path), the evaluation
    samples, the session group (level, threads), the timed runs, the metric (None: the
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
        self.model, self.path, self.level = reference.model, reference.path, session.level  # as Trials reads them
        self.metric, self.latency, self.min_speedup, self.on = metric, latency, min_speedup, on
        self.models: dict[str, onnx.ModelProto] = {}
        self.references: dict[tuple[str, ...], FloatOutputs] = {}  # the float model's outputs, run once
        self.float_bytes = file_bytes(reference.path, reference.model)

    def timed(self, candidate: onnx.ModelProto, candidate_path: str) -> dict:
        """``candidate``'s latency figures timed again (Trials.steady) by the timer that
        measure_candidate timed them with: deployed.latency_figures, looked up when called."""
        latency = self.latency or self.evaluation[:1]
        named = Named(candidate, candidate_path)
        return deployed.latency_figures(self.reference, named, latency, self.session, self.timing)

    def __call__(
        self,
        candidate: onnx.ModelProto,
        candidate_path: str,
        excluded: list[str] | None = None,
        speed: dict | None = None,
    ) -> dict:
        """A candidate's figures as deployed (``candidate``, read from ``candidate_path``), with
        its weights' storage and the guards it breaks; ``speed``: latency figures it inherits."""
        named = Named(candidate, candidate_path)
        references = self.references if self.on is None else self.on  # where the float outputs are run
        if speed is None:
            row = measure_candidate(
                self.reference,
                named,
                self.evaluation,
                self.session,
                self.timing,
                references,
                self.metric,
                self.latency,
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
        "recovery": None,  # recovery.py fills it in on the rows it adds
        "sqnr_db": got.get("sqnr_db"),
        "pooled_sqnr_db": got.get("pooled_sqnr_db"),
        "worst_part": got.get("worst_part"),
        "metric_value": got.get("metric_value"),
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
    }


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


class Trials:
    """Every model tried, in order: ``rows`` (the candidate rows) and ``files``
    (``{id: (model, prepared model, calibration cache)}`` of those the quantizer made)."""

    def __init__(self, work: str, reader: Callable[[], SampleReader], measure: Measure) -> None:
        self.work, self.reader, self.measure = work, reader, measure
        self.rows: list[Candidate] = []
        self.files: dict[int, tuple[str, str, str]] = {}
        self.given: dict[str, onnx.ModelProto] = {}  # the prepared models the quantizer is given, by path
        self.digests: dict[str, Candidate] = {}  # a model's SHA-256: the row that measured it
        self.ranges: dict[str, FloatRanges] = {}  # per prepared model: its float values by part
        self.speed_from: dict[int, int] = {}  # a row's id: the row whose timing it inherits (bias.same_graph)
        self.by_sample: dict[int, list[float | None] | None] = {}  # a measured row's id: its metric sample by sample
        self.retimed: set[int] = set()  # the rows timed twice (steady)
        self.disturbed: list[str] = []  # what the answer's warnings say of each row whose speed stayed disturbed

    def add(
        self,
        settings: dict[str, Any],
        rewrites: bool,
        prepared_path: str,
        cache: str,
        trial: dict[str, Any] | None = None,
        kept: list[dict[str, str]] | None = None,
        quantizer: str = STATIC,
        post: Post | None = None,
    ) -> Candidate:
        """Quantize ``prepared_path`` with ``settings`` and measure the model as deployed:
        its row, also when the quantizer refused it (with its error, never a crash);
        ``trial``: the block a search stage added (its kind and the nodes it added);
        ``kept``: the seeds kept float in it, ``{"node", "why"}`` each (seeds.py); ``quantizer``:
        quantize_static or quantize_dynamic (no calibration), the row's key holding ``settings``;
        ``post``: a change to the quantized file before it is measured, and the row it changes
        (whose speed the model takes, untimed, when its graph is that row's: bias.same_graph)."""
        ident = len(self.rows)
        target_path = os.path.join(self.work, f"candidate-{ident}.onnx")
        row = functools.partial(candidate_row, ident, quantizer, settings, rewrites, kept or [], trial)
        try:
            quantize = quantize_dynamic_candidate if quantizer == DYNAMIC else quantize_candidate
            quantize(prepared_path, target_path, settings, self.reader, cache)
            if post is not None:  # a change to the quantized file itself (recovery.py's bias correction)
                post.change(target_path)
        except Exception as exc:
            blame_the_disk(exc, self.work, os.path.getsize(prepared_path))
            return self.book(row(error=f"{quantizer}: {self.users_terms(one_line(exc))}"))
        excluded = settings.get("nodes_to_exclude")
        model = onnx.load(target_path)  # read once: checked, measured and kept for the exclusions
        status, post_step = None, None
        if excluded:  # checked in the deployed session, made real where onnxruntime undid it
            given = self.given[prepared_path]
            try:
                model, status, fixed = honoured(model, target_path, self.measure.level, excluded, given)
            except GraphscanError as exc:  # a trial onnxruntime cannot even optimize: a row, not the end
                if exc.exit_code != EXIT_RUNTIME:
                    raise
                return self.book(row(error=f"onnxruntime: {self.users_terms(str(exc))}"))
            post_step = {"float_inputs": fixed} if fixed else None
        digest = file_digest(target_path)
        twin = self.digests.get(digest)
        if twin is not None:  # the quantizer made the very same model: measured once
            measured = row(excluded=status, post_step=post_step, same_as=twin["id"], figures=twin)
            self.by_sample[ident] = self.by_sample[twin["id"]]
        else:
            speed = None
            if post is not None and same_graph(model, self.measure.models[self.files[post.parent["id"]][0]]):
                self.speed_from[ident] = post.parent["id"]  # the same kernels: timing it again adds only noise
                speed = {key: post.parent.get(key) for key in LATENCY}
            try:
                figures = self.measure(model, target_path, excluded, speed)
            except GraphscanError as exc:  # a model the quantizer made that onnxruntime refuses
                if exc.exit_code != EXIT_RUNTIME:
                    raise
                error = f"onnxruntime: {self.users_terms(str(exc))}"
                return self.book(row(excluded=status, post_step=post_step, error=error))
            figures.update(self.verdict(model, prepared_path, figures))
            measured = row(excluded=status, post_step=post_step, figures=figures)
            self.by_sample[ident] = figures.get("metric_by_sample")
            self.digests[digest] = measured
        self.files[ident] = (target_path, prepared_path, cache)
        self.measure.models[target_path] = model
        self.book(measured)
        self.steady()
        return measured

    def book(self, row: Candidate) -> Candidate:
        """Keep ``row`` among the rows tried (a refused one has no file to write)."""
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
            r["id"]: float(r["float_ms"])
            for r in self.rows
            if r["float_ms"] is not None and r["same_as"] is None and r["id"] not in self.speed_from
        }  # the rows timed themselves
        if len(floats) < STEADY_ROWS:
            return
        for row in [r for r in self.rows if r["id"] in floats and r["id"] not in self.retimed]:
            others = [value for ident, value in floats.items() if ident != row["id"]]
            if not far_off(floats[row["id"]], others):
                continue
            self.retimed.add(row["id"])
            model_path = self.files[row["id"]][0]
            speed = self.measure.timed(self.measure.models[model_path], model_path)
            if far_off(speed["float_ms"], others):
                self.disturbed.append(
                    f"candidate {row['id']}'s float time lay far off the other rows' (median "
                    f"{statistics.median(others):.3g} ms): {floats[row['id']]:.3g} ms, then {speed['float_ms']:.3g} ms "
                    "timed again; its speedup is null, never ranked (time it on a quiet machine)"
                )
                speed = {**speed, "speedup": None, "speedup_spread": None}
            floats[row["id"]] = speed["float_ms"]
            carriers = [r for r in self.rows if r["same_as"] == row["id"] or self.speed_from.get(r["id"]) == row["id"]]
            for carrier in [row, *carriers]:
                self.retake(carrier, speed)

    def retake(self, row: Candidate, speed: dict[str, Any]) -> None:
        """``row`` with the latency figures ``speed``, its guards judged anew."""
        row["ms"], row["float_ms"] = speed["ms"], speed["float_ms"]
        row["speedup"], row["speedup_spread"] = speed["speedup"], speed["speedup_spread"]
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
