"""tune: from diagnosis to a quantized model measured as it will be deployed.

    graphscan tune FLOAT.onnx --calibrate FILE.npz [...] [--inputs FILE.npz ...] --out DIR

1. Prepare the float model (prepare.py): onnxruntime's quant_pre_process, the
   opset, the rewrites; each step verified against the original.
2. Quantize every candidate (candidates.py) of the prepared model with and
   without the rewrites, calibrating once per model and method; where a MatMul
   has a constant weight, also onnxruntime's quantize_dynamic (uncalibrated).
3. Measure each as deployed (deployed.py) on the --inputs samples, held out
   from calibration (or the calibration samples, said so).
4. Choose the fastest candidate that passes the guards (guards.py: faster and no
   larger than float, integer weights) and whose --metric meets the target
   (default: sqnr, and the SQNR of onnxruntime's default settings on this model;
   an agreement metric's default target is float's own agreement, 1.0).
5. When none does: exclusions realized by the quantizer. impact ranks the
   operators of the most accurate candidate; blocks of them (blocks.py) are
   added to ``nodes_to_exclude`` in turn, the model re-quantized (same
   calibration), its exclusions made real (fallback.py) and measured as
   deployed, and an addition is kept only if it helps, until the target,
   --max-trials (default 8) or --max-exclude nodes.
6. Write model.onnx and prepared.onnx into --out: built in a temporary folder
   beside it and renamed into place, so --out is absent or complete. Target not
   met: the most accurate candidate that passes the guards is written (exit 8);
   none passes: only prepared.onnx, ``chosen`` null (exit 8).
"""

from __future__ import annotations

import errno
import functools
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import (
    DEQUANTIZE,
    EXIT_BUDGET,
    EXIT_INPUTS,
    EXIT_NO_FILE,
    EXIT_OK,
    EXIT_RUNTIME,
    EXIT_USAGE,
    QUANTIZE,
    RUNTIME_LEVELS,
    Command,
    GraphscanError,
    finite_float,
    level_option,
    load_with_weights,
    metric_group,
    non_negative_int,
    one_line,
    samples_group,
    shown,
)
from graphscan_ort.engines.attribution import MIN_GAIN_DB
from graphscan_ort.engines.attribution import measure as impact_of
from graphscan_ort.engines.levels import FloatRanges
from graphscan_ort.shared.agreement import Metric, check_layout_fits
from graphscan_ort.shared.answers import Candidate, TuneAnswer, TuneChoice
from graphscan_ort.shared.files import check_out, in_folder, out_of_room, place, write_failure
from graphscan_ort.shared.inputs import input_specs, inputs_answer, read_npz_inputs, sample_files
from graphscan_ort.shared.metrics import FloatOutputs, named_outputs
from graphscan_ort.shared.options import MAX_RUNS, MAX_THREADS, RUNTIME_DEFAULT_RUNS, check_between, int_between
from graphscan_ort.shared.parts import TensorParts
from graphscan_ort.shared.sessions import environment, sample_outputs
from graphscan_ort.tune.blocks import next_block, part_blocks, search_blocks
from graphscan_ort.tune.candidates import (
    DYNAMIC,
    METHODS,
    STATIC,
    SampleReader,
    candidate_settings,
    default_row,
    dynamic_settings,
    file_digest,
    quantize_candidate,
    quantize_dynamic_candidate,
    refinements,
    static_rows,
)
from graphscan_ort.tune.choice import (
    accuracy,
    choice_warnings,
    chosen_row,
    listing_order,
    pareto,
    part_words,
    speed,
    start_row,
)
from graphscan_ort.tune.deployed import measure_candidate
from graphscan_ort.tune.fallback import STILL_INT8, honoured
from graphscan_ort.tune.goal import Goal, metric_of
from graphscan_ort.tune.guards import failed_guards, file_bytes, float_weight_nodes
from graphscan_ort.tune.prepare import dynamic_base, prepared_base, with_rewrites
from graphscan_ort.tune.progress import Progress
from graphscan_ort.tune.seeds import structural_seeds, user_seeds
from graphscan_ort.tune.table import tune_table
from graphscan_ort.tune.verdict import FEW_SAMPLES, levels_figures, low_levels_warning, sqnr_broken


def tune(
    path: str,
    calibrate: list[str] | None = None,
    inputs: list[str] | None = None,
    out: str | None = None,
    target_sqnr: float | None = None,
    max_exclude: int | None = None,
    level: str = "all",
    threads: int = 1,
    runs: int = 20,
    metric: str | None = None,
    threshold: float | None = None,
    blank: int | None = None,
    target: float | None = None,
    min_speedup: float = 1.0,
    latency_inputs: list[str] | None = None,
    max_trials: int | None = None,
    exclude: list[str] | None = None,
    keep_outputs_float: bool = False,
) -> TuneAnswer:
    """Quantize ``path`` every way candidates.py knows, measure each as deployed, write the best into ``out``."""
    if not calibrate:
        raise GraphscanError("usage: tune needs --calibrate FILE.npz (one sample per file, repeatable)", EXIT_USAGE)
    if out is None:
        raise GraphscanError("usage: tune needs --out DIR", EXIT_USAGE)
    check_between("--runs", runs, 1, MAX_RUNS)
    check_between("--threads", threads, 1, MAX_THREADS)
    if level not in RUNTIME_LEVELS:  # "disabled" is no deployment
        raise GraphscanError(f"usage: --level must be one of {', '.join(RUNTIME_LEVELS)}", EXIT_USAGE)
    chosen_metric = metric_of(metric, threshold, blank, target, target_sqnr)
    target = target_sqnr if target is None else target
    if not (isinstance(min_speedup, (int, float)) and math.isfinite(min_speedup) and min_speedup >= 0):
        raise GraphscanError(f"usage: --min-speedup must be a finite number >= 0, not {min_speedup!r}", EXIT_USAGE)
    calibrate, inputs = sample_files(calibrate), sample_files(inputs) if inputs else None
    latency_files = sample_files(latency_inputs) if latency_inputs else None
    parent = check_out(out)
    ort.set_default_logger_severity(4)  # the quantizer's own sessions log warnings on stderr
    model = load_with_weights(path)
    refuse_quantized(model, path)
    seeds = seed_rows(model, exclude, keep_outputs_float, path)
    specs = input_specs(model)
    calibration = [read_npz_inputs(p, specs) for p in calibrate]
    evaluation = [read_npz_inputs(p, specs) for p in inputs] if inputs else calibration
    latency = [read_npz_inputs(p, specs) for p in latency_files] if latency_files else evaluation[:1]
    # Every sample the user gave is run once before any work: one that does not run is named.
    calibrated = sample_outputs(model, calibration, path, calibrate, "--calibrate", keep=not inputs)
    evaluated = sample_outputs(model, evaluation, path, inputs, "--inputs") if inputs else calibrated
    if latency_files:
        sample_outputs(model, latency, path, latency_files, "--latency-inputs")
    reference = check_measurable(model, evaluated, path, inputs or calibrate)
    check_layout_fits(chosen_metric, TensorParts(model, [o.name for o in model.graph.output]).sources)
    own = chosen_metric.value(reference, reference)  # fits every output, and float's own agreement
    try:
        work = tempfile.mkdtemp(prefix=".graphscan-tune-", dir=parent)
    except OSError as exc:
        raise GraphscanError(f"{shown(out)}: cannot write ({exc.strerror or exc})", EXIT_NO_FILE)
    progress = Progress()
    try:
        measure = Measure(model, path, evaluation, level, threads, runs)
        measure.metric, measure.latency, measure.min_speedup = chosen_metric, latency, float(min_speedup)
        goal = Goal(chosen_metric, target, own)
        answer = tune_in(path, model, calibration, work, goal, max_exclude, measure, progress, max_trials, seeds)
        place(work, out)
    except Exception as exc:
        if isinstance(exc, GraphscanError) or not write_failure(exc):
            raise
        why = getattr(exc, "strerror", None) or one_line(exc)
        raise GraphscanError(f"--out {shown(out)}: cannot write ({why})", EXIT_NO_FILE) from None
    finally:
        progress.close()
        shutil.rmtree(work, ignore_errors=True)  # also on Ctrl-C: nothing half-written
    if not inputs:
        answer["warnings"].insert(
            0, "the evaluation samples are the calibration samples: give held-out --inputs to measure accuracy"
        )
    return {
        "model": path,
        "environment": environment(level, threads=threads),
        "calibration": {"samples": len(calibration), "methods": METHODS},
        "evaluation": {
            "samples": len(evaluation),
            "held_out": held_out(calibration, evaluation) if inputs else False,
            "inputs": inputs_answer(evaluation),
            "defaulted": [],
            "events": next((c["metric_events"] for c in answer["candidates"] if c["id"] == answer["chosen"]), None),
        },
        **answer,
        "output": out,
    }


def seed_rows(model: onnx.ModelProto, exclude: list[str] | None, keep_outputs_float: bool, path: str) -> list[dict]:
    """The user's seeds as rows' ``kept_float`` entries, ``{"node", "why"}`` each."""
    chosen = set(exclude or [])
    return [
        {"node": node, "why": "--exclude" if node in chosen else "--keep-outputs-float"}
        for node in user_seeds(model, exclude, keep_outputs_float, path)
    ]


def check_measurable(model: onnx.ModelProto, outputs: list, path: str, files: list[str]) -> list[dict[str, np.ndarray]]:
    """The float model's ``outputs`` on the evaluation samples, by name. Exit 7 unless they
    hold a finite value: NaN or infinity everywhere, or nothing at all (a zero-size input),
    measures no candidate."""
    values = [np.asarray(value) for sample in outputs for value in sample]
    if not any(value.size for value in values):
        why = "empty"
    elif not any(value.dtype.kind in "biuf" and np.isfinite(value.astype(np.float64)).any() for value in values):
        why = "NaN or infinite everywhere"
    else:
        return named_outputs(outputs, [o.name for o in model.graph.output])
    raise GraphscanError(
        f"{', '.join(map(shown, files))}: the float model's outputs are {why} on these samples: nothing to measure",
        EXIT_INPUTS,
    )


def refuse_quantized(model: onnx.ModelProto, path: str) -> None:
    """Exit 2 for a model that holds Q or DQ nodes: tune quantizes a float model, and a
    quantized one given as the float reference would make every figure a comparison of
    two quantized models."""
    if any(node.op_type in (QUANTIZE, DEQUANTIZE) for node in model.graph.node):
        raise GraphscanError(
            f"usage: {shown(path)} is already quantized (it holds QuantizeLinear/DequantizeLinear): "
            "give tune the float model",
            EXIT_USAGE,
        )


def sample_key(sample: dict[str, np.ndarray]) -> tuple[tuple[str, str, tuple[int, ...], bytes], ...]:
    """A sample's contents (names, dtypes, shapes and bytes), to compare samples by value."""
    return tuple((name, a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes()) for name, a in sorted(sample.items()))


def held_out(calibration: list[dict[str, np.ndarray]], evaluation: list[dict[str, np.ndarray]]) -> bool:
    """Whether no evaluation sample is also a calibration sample, by content, not by path:
    the same arrays given to --calibrate and --inputs are not held out."""
    calibrated = {sample_key(sample) for sample in calibration}
    return not any(sample_key(sample) in calibrated for sample in evaluation)


class Measure:
    """How every candidate is measured: the float model (and its path), the evaluation
    samples, the session's level and threads, the timed runs. ``models`` keeps every candidate
    written, read once by Trials.add, by path for the exclusions."""

    def __init__(
        self,
        model: onnx.ModelProto,
        path: str,
        evaluation: list[dict[str, np.ndarray]],
        level: str,
        threads: int,
        runs: int,
    ) -> None:
        self.model, self.path, self.evaluation = model, path, evaluation
        self.level, self.threads, self.runs = level, threads, runs
        self.models: dict[str, onnx.ModelProto] = {}
        self.references: dict[tuple[str, ...], FloatOutputs] = {}  # the float model's outputs, run once
        self.metric: Metric | None = None  # None: the SQNR
        self.latency: list[dict[str, np.ndarray]] | None = None  # None: the first evaluation sample
        self.min_speedup = 1.0
        self.float_bytes = file_bytes(path, model)

    def __call__(self, candidate: onnx.ModelProto, candidate_path: str, excluded: list[str] | None = None) -> dict:
        """A candidate's figures as deployed (``candidate``, read from ``candidate_path``), with
        its weights' storage and the guards it breaks."""
        row = measure_candidate(
            self.model,
            candidate,
            self.path,
            candidate_path,
            self.evaluation,
            self.level,
            self.threads,
            self.runs,
            self.references,
            self.metric,
            self.latency,
        )
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


def refused_row(row: dict[str, Any], error: str) -> dict[str, Any]:
    """A candidate the quantizer (or onnxruntime) refused: kept with its error and nulls."""
    row.update(dict.fromkeys(MEASURED))
    row["error"] = error
    return row


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
        self.rows: list[dict[str, Any]]
        self.files: dict[int, tuple[str, str, str]]
        self.rows, self.files = [], {}
        self.given: dict[str, onnx.ModelProto] = {}  # the prepared models the quantizer is given, by path
        self.digests: dict[str, dict[str, Any]] = {}  # a model's SHA-256: the row that measured it
        self.ranges: dict[str, FloatRanges] = {}  # per prepared model: its float values by part

    def add(
        self,
        settings: dict[str, Any],
        rewrites: bool,
        prepared_path: str,
        cache: str,
        trial: dict[str, Any] | None = None,
        kept: list[dict[str, str]] | None = None,
        quantizer: str = STATIC,
    ) -> dict[str, Any]:
        """Quantize ``prepared_path`` with ``settings`` and measure the model as deployed:
        its row, also when the quantizer refused it (with its error, never a crash);
        ``trial``: the block a search stage added (its kind and the nodes it added);
        ``kept``: the seeds kept float in it, ``{"node", "why"}`` each (seeds.py); ``quantizer``:
        quantize_static or quantize_dynamic (no calibration), the row's key holding ``settings``."""
        ident = len(self.rows)
        target_path = os.path.join(self.work, f"candidate-{ident}.onnx")
        row: dict[str, Any] = {"id": ident, STATIC: None, DYNAMIC: None, "rewrites": rewrites}
        row.update({quantizer: settings}, kept_float=kept or [], error=None)
        row.update(trial=trial, post_step=None, excluded=None, same_as=None)
        try:
            quantize = quantize_dynamic_candidate if quantizer == DYNAMIC else quantize_candidate
            quantize(prepared_path, target_path, settings, self.reader, cache)
        except Exception as exc:
            blame_the_disk(exc, self.work, os.path.getsize(prepared_path))
            row = refused_row(row, f"{quantizer}: {users_terms(one_line(exc), self.work, self.measure.path)}")
        else:
            excluded = settings.get("nodes_to_exclude")
            model = onnx.load(target_path)  # read once: checked, measured and kept for the exclusions
            if excluded:  # checked in the deployed session, made real where onnxruntime undid it
                given = self.given[prepared_path]
                try:
                    model, status, fixed = honoured(model, target_path, self.measure.level, excluded, given)
                except GraphscanError as exc:  # a trial onnxruntime cannot even optimize: a row, not the end
                    if exc.exit_code != EXIT_RUNTIME:
                        raise
                    return self.refused(row, f"onnxruntime: {users_terms(str(exc), self.work, self.measure.path)}")
                row["excluded"] = status
                row["post_step"] = {"float_inputs": fixed} if fixed else None
            digest = file_digest(target_path)
            twin = self.digests.get(digest)
            if twin is not None:  # the quantizer made the very same model: measured once
                row.update({k: v for k, v in twin.items() if k in MEASURED}, same_as=twin["id"])
            else:
                try:
                    row.update(self.measure(model, target_path, excluded))
                except GraphscanError as exc:  # a model the quantizer made that onnxruntime refuses
                    if exc.exit_code != EXIT_RUNTIME:
                        raise
                    return self.refused(row, f"onnxruntime: {users_terms(str(exc), self.work, self.measure.path)}")
                row.update(self.verdict(model, prepared_path, row))
                self.digests[digest] = row
            self.files[ident] = (target_path, prepared_path, cache)
            self.measure.models[target_path] = model
        self.rows.append(row)
        return row

    def float_ranges(self, prepared_path: str) -> FloatRanges:
        """The float values of the prepared model at ``prepared_path``, by part, on the
        evaluation samples: measured once per tensor for every candidate quantized from it."""
        if prepared_path not in self.ranges:
            self.ranges[prepared_path] = FloatRanges(
                self.given[prepared_path], self.measure.evaluation, self.measure.path
            )
        return self.ranges[prepared_path]

    def verdict(self, model: onnx.ModelProto, prepared_path: str, row: dict[str, Any]) -> dict[str, Any]:
        """A measured candidate's fewest levels and the parts of its outputs below a floor."""
        levels, broken = levels_figures(model, self.float_ranges(prepared_path))
        return {"levels": levels, "broken_parts": sqnr_broken(row["sqnr_db"], row["worst_part"]) + broken}

    def refused(self, row: dict[str, Any], error: str) -> dict[str, Any]:
        """A model onnxruntime refuses to run: a row with its error, no file to write."""
        row = refused_row(row, error)
        self.rows.append(row)
        return row


def tune_in(
    path: str,
    model: onnx.ModelProto,
    calibration: list[dict[str, np.ndarray]],
    work: str,
    goal: Goal,
    max_exclude: int | None,
    measure: Measure,
    progress: Progress | None = None,
    max_trials: int | None = None,
    seeds: list[dict[str, str]] | None = None,
) -> TuneChoice:
    """tune's work inside the temporary folder ``work``; leaves prepared.onnx there, and
    model.onnx when a candidate passes the guards. ``seeds``: the nodes the user keeps float
    in every candidate, ``{"node", "why"}`` each."""
    seeds = seeds or []
    progress = progress or Progress()
    evaluation = measure.evaluation
    progress.show("preparing the float model")
    base, steps = prepared_base(path, work, evaluation, model)
    rewritten, rewrite_steps = with_rewrites(base, model, evaluation)
    prepared = {"none": base}
    if rewritten is not base:
        prepared["rewrites"] = rewritten
    trials = Trials(work, functools.partial(SampleReader, calibration), measure)
    rows, files = trials.rows, trials.files
    unfused = dynamic_base(model)
    dynamic = dynamic_settings(unfused)
    excluding = {"nodes_to_exclude": [seed["node"] for seed in seeds]} if seeds else {}
    planned = len(prepared) * len(candidate_settings()) + len(dynamic)
    for rewrites, prepared_model in prepared.items():
        prepared_path = os.path.join(work, f"prepared-{rewrites}.onnx")
        onnx.save(prepared_model, prepared_path)
        trials.given[prepared_path] = prepared_model
        cache = os.path.join(work, f"cache-{rewrites}")
        os.mkdir(cache)
        for settings in candidate_settings():
            progress.show("quantizing and measuring candidate", len(rows) + 1, planned)
            trials.add({**settings, **excluding}, rewrites != "none", prepared_path, cache, kept=seeds)
    if dynamic:  # onnxruntime's one-line peer on transformers: weights int8, activations at run time
        prepared_path = os.path.join(work, "prepared-dynamic.onnx")
        onnx.save(unfused, prepared_path)
        trials.given[prepared_path] = unfused
    for settings in dynamic:
        progress.show("quantizing and measuring candidate", len(rows) + 1, planned)
        trials.add({**settings, **excluding}, False, prepared_path, work, kept=seeds, quantizer=DYNAMIC)
    if not files:
        raise GraphscanError(
            f"{shown(path)}: onnxruntime's quantize_static refused every candidate ({rows[0]['error']})", EXIT_RUNTIME
        )
    pareto(rows)
    target, warnings = goal.target(default_row(rows))
    chosen, reached = chosen_row(rows, target["value"])
    if not reached and target["value"] is not None:
        seeded(trials, rows, calibration, progress)
        pareto(rows)
        chosen, reached = chosen_row(rows, target["value"])
    # The refinements and exclusions start from a quantize_static row: a dynamic one calibrates nothing.
    searchable = not reached and target["value"] is not None and any(r["error"] is None for r in static_rows(rows))
    if searchable:
        refine(trials, start_row(static_rows(rows)), progress)
        pareto(rows)
        chosen, reached = chosen_row(rows, target["value"])
    if searchable and not reached and target["value"] is not None:
        progress.show("ranking the operators to exclude")
        limits = (max_exclude, max_trials)
        start = start_row(static_rows(rows))
        exclusions(trials, start, target["value"], limits, prepared, goal.metric.name == "sqnr", progress)
        pareto(rows)
        chosen, reached = chosen_row(rows, target["value"])
    written = write_choice(work, files, rows, chosen)
    warnings += choice_warnings(rows, chosen, reached, target["value"])
    if chosen is not None:
        _, prepared_path, _ = files[chosen["id"]]
        model_written = onnx.load(os.path.join(work, "model.onnx"), load_external_data=False)
        warnings += low_levels_warning(model_written, trials.float_ranges(prepared_path))
        warnings += [f"the chosen model breaks a part: {part_words(part)}" for part in chosen["broken_parts"] or []]
    if len(evaluation) < FEW_SAMPLES:
        warnings.append(
            f"the verdict rests on {len(evaluation)} evaluation sample{'s' if len(evaluation) != 1 else ''} "
            f"(fewer than {FEW_SAMPLES}): give more held-out --inputs"
        )
    if any(HISTOGRAM_SHAPES in (r["error"] or "") for r in rows):
        warnings.append(f"{HISTOGRAM_SHAPES}: give --calibrate samples of one shape to try Percentile and Entropy")
    if all(accuracy(r) == -math.inf for r in rows if r["error"] is None):
        warnings.append(f"every candidate's {goal.metric.name} is undefined on these samples: none can be reached")
    float_ms = sorted(row["float_ms"] for row in rows if row["float_ms"] is not None)
    order = listing_order(rows)
    return {
        "float": {"ms": sorted(float_ms)[len(float_ms) // 2], "bytes": measure.float_bytes},
        "prepare": steps + rewrite_steps,
        "candidates": [cast(Candidate, {key: row.get(key) for key in CANDIDATE_KEYS}) for row in order],
        "metric": goal.metric.describe(),
        "target": target,
        "target_sqnr_db": target["value"] if goal.metric.name == "sqnr" else None,
        "latency": {
            "inputs": inputs_answer(measure.latency or evaluation[:1]),
            "samples": len(measure.latency or evaluation[:1]),
            "min_speedup": measure.min_speedup,
        },
        "chosen": None if chosen is None else chosen["id"],
        "reached": reached,
        "written": written,
        "warnings": warnings,
    }


SEEDED_ROWS = 3  # the fastest rows on the Pareto front that the structural seeds are added to
SEED_SAMPLES = 8  # the calibration samples the Concats' input ranges are measured on


def seeded(
    trials: Trials, rows: list[dict[str, Any]], calibration: list[dict[str, np.ndarray]], progress: Progress
) -> None:
    """The structural seeds (seeds.py: the outputs' producers, the Concats whose inputs'
    ranges differ widely) kept float in the fastest rows of the Pareto front that pass the
    guards: the fixes that are free in speed, each tried as a candidate of its own."""
    front = sorted((r for r in static_rows(rows) if r["pareto"] and not r["fails"]), key=lambda r: (-speed(r), r["id"]))
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for k, base in enumerate(front[:SEEDED_ROWS]):
        _, prepared_path, cache = trials.files[base["id"]]
        given = list(base["quantize_static"].get("nodes_to_exclude") or [])
        if prepared_path not in found:
            model = trials.given[prepared_path]
            found[prepared_path] = structural_seeds(model, calibration[:SEED_SAMPLES], trials.measure.path, given)
        for kind, nodes in found[prepared_path]:
            progress.show("keeping structural seeds float", k + 1, min(len(front), SEEDED_ROWS))
            settings = {**base["quantize_static"], "nodes_to_exclude": [*given, *nodes]}
            kept = base["kept_float"] + [{"node": node, "why": kind} for node in nodes]
            trials.add(settings, base["rewrites"], prepared_path, cache, kept=kept)


def refine(trials: Trials, base: dict[str, Any], progress: Progress) -> None:
    """``base``'s settings calibrated each other way (candidates.refinements): they change
    only the ranges, so they are tried on the best candidate alone."""
    _, prepared_path, cache = trials.files[base["id"]]
    seeded = base["quantize_static"].get("nodes_to_exclude")
    settings = [
        {**refined, "nodes_to_exclude": seeded} if seeded else refined
        for refined in refinements(base["quantize_static"])
    ]
    for k, refined in enumerate(settings):
        progress.show("refining the calibration", k + 1, len(settings))
        trials.add(refined, base["rewrites"], prepared_path, cache, kept=base["kept_float"])


def write_choice(
    work: str, files: dict[int, tuple[str, str, str]], rows: list[dict[str, Any]], chosen: dict | None
) -> list[str]:
    """Leave model.onnx (``chosen``'s) and prepared.onnx in ``work``; without a choice,
    prepared.onnx alone (the one of the most accurate row). The names written."""
    if chosen is not None:
        model_path, prepared_path, _ = files[chosen["id"]]
        os.replace(model_path, os.path.join(work, "model.onnx"))
        os.replace(prepared_path, os.path.join(work, "prepared.onnx"))
        return ["model.onnx", "prepared.onnx"]
    best = max((r for r in rows if r["id"] in files), key=lambda r: (accuracy(r), speed(r)))
    os.replace(files[best["id"]][1], os.path.join(work, "prepared.onnx"))
    return ["prepared.onnx"]


DEFAULT_MAX_TRIALS = 8  # re-quantizations of the fallback search when --max-trials is not given


def exclusions(
    trials: Trials,
    best: dict[str, Any],
    target: float,
    limits: tuple[int | None, int | None],
    prepared: dict[str, onnx.ModelProto],
    in_db: bool,
    progress: Progress | None = None,
) -> None:
    """Blocks of operators of ``best`` (blocks.py) added to nodes_to_exclude, the next one
    chosen by its estimated gain per cost, each re-quantized and measured as deployed; an
    addition stays only if the metric rises and its nodes really run float. ``limits``:
    (--max-exclude nodes, --max-trials re-quantizations); ``in_db``: the metric is the SQNR,
    so impact's estimates are in its unit. Every model tried is a candidate row of its own
    (the quantizer's, never a promise)."""
    candidate_path, prepared_path, cache = trials.files[best["id"]]
    given = prepared["rewrites" if best["rewrites"] else "none"]  # the model the quantizer was given
    measure = trials.measure
    candidate = measure.models[candidate_path]
    # A ranking, not a measurement (every trial is measured on every sample): impact runs the
    # model once per operator, so it ranks on the first evaluation sample alone.
    ranked = impact_of(given, candidate, measure.evaluation[:1], prepared_path, candidate_path)["ops"]
    blocks = search_blocks(given, ranked, MIN_GAIN_DB)
    part = best.get("worst_part") or {}
    first = part_blocks(given, part.get("node"), frozenset(best["quantize_static"].get("nodes_to_exclude") or []))
    max_exclude, max_trials = limits
    budget = DEFAULT_MAX_TRIALS if max_trials is None else max_trials
    seeded = list(best["quantize_static"].get("nodes_to_exclude") or [])  # the seeds stay float in every trial
    kept: list[str] = []
    kept_share = 0.0
    tried: set[tuple[str, ...]] = set()
    current = best
    for k in range(budget):
        if accuracy(current) >= target:  # met: more exclusions would only make it slower
            break
        needed = target - accuracy(current) if in_db and math.isfinite(accuracy(current)) else None
        room = None if max_exclude is None else max_exclude - len(kept)
        block = next(
            (
                b
                for b in first
                if b.nodes not in tried
                and not set(b.nodes) <= set(kept)
                and (room is None or len(set(b.nodes) - set(kept)) <= room)
            ),
            None,
        ) or next_block(blocks, tried, frozenset(kept + seeded), kept_share, needed, room)
        if block is None:
            break
        tried.add(block.nodes)
        added = [n for n in block.nodes if n not in kept]
        if progress is not None:
            progress.show("trying exclusion", k + 1, budget)
        settings = {**best["quantize_static"], "nodes_to_exclude": [*seeded, *kept, *added]}
        trial = {"block": block.kind, "added": added}
        row = trials.add(settings, best["rewrites"], prepared_path, cache, trial, best["kept_float"])
        real = row["error"] is None and all(row["excluded"][n] != STILL_INT8 for n in added)  # they run float
        if real and accuracy(row) > accuracy(current):
            kept_share += sum(s for n, s in zip(block.nodes, block.shares, strict=True) if n in added)
            kept += added
            current = row


# What a candidate's measurement gives (a twin of a measured model copies them, float_ms
# too: its speedup is that float time over its ms).
MEASURED = [
    "sqnr_db",
    "pooled_sqnr_db",
    "worst_part",
    "metric_value",
    "metric_events",
    "metric_worst",
    "metric_spread",
    "levels",
    "broken_parts",
    "int8_fraction",
    "int8_kernels",
    "wrapped_but_float",
    "ms",
    "float_ms",
    "speedup",
    "speedup_spread",
    "bytes",
    "float_weights",
    "fails",
]


CANDIDATE_KEYS = ["id", STATIC, DYNAMIC, "rewrites", "kept_float", "trial", "post_step", "excluded", "same_as"]
CANDIDATE_KEYS += [*MEASURED, "pareto", "error"]


COMMAND = Command(
    "tune",
    tune,
    options=(
        (
            "--calibrate",
            {
                "metavar": "FILE.npz",
                "action": "append",
                "help": "a calibration sample, one array per input, or a folder of them (repeatable)",
            },
        ),
        (
            "--inputs",
            {
                **samples_group(1, samples="many")[0][1],
                "help": "a held-out evaluation sample (repeatable; default: the calibration samples)",
            },
        ),
        ("--out", {"metavar": "DIR", "help": "absent or empty folder for model.onnx and prepared.onnx"}),
        *metric_group(default=" (default: sqnr)"),
        (
            "--target",
            {
                "metavar": "X",
                "type": finite_float,
                "help": "the --metric to reach, in its unit (default: sqnr's is the SQNR of onnxruntime's default "
                "settings; an agreement's is float's own, 1.0)",
            },
        ),
        ("--target-sqnr", {"metavar": "DB", "type": finite_float, "help": "--target of --metric sqnr"}),
        (
            "--min-speedup",
            {
                "metavar": "X",
                "type": finite_float,
                "default": 1.0,
                "help": "a model written must be faster than float by more than this (default: 1, faster; 0: any)",
            },
        ),
        (
            "--latency-inputs",
            {
                "metavar": "FILE.npz",
                "action": "append",
                "help": "a sample at the deployed shape, timed for the speedup (repeatable; default: the first "
                "--inputs sample)",
            },
        ),
        (
            "--exclude",
            {
                "metavar": "NODE",
                "action": "append",
                "help": "keep NODE float in every candidate (repeatable)",
            },
        ),
        (
            "--keep-outputs-float",
            {
                "action": "store_true",
                "help": "keep the nodes that produce the graph's outputs float in every candidate",
            },
        ),
        (
            "--max-exclude",
            {
                "metavar": "N",
                "type": non_negative_int,
                "help": "at most N nodes kept float by the fallback search (default: no limit)",
            },
        ),
        (
            "--max-trials",
            {
                "metavar": "N",
                "type": non_negative_int,
                "help": f"at most N re-quantizations in the fallback search (default: {DEFAULT_MAX_TRIALS})",
            },
        ),
        level_option(list(RUNTIME_LEVELS), "all", "deployed optimization level (default: all)"),
        (
            "--threads",
            {
                "type": int_between(1, MAX_THREADS),
                "default": 1,
                "help": f"intra-op threads of the measurements, 1 to {MAX_THREADS} (default: 1)",
            },
        ),
        (
            "--runs",
            {
                "type": int_between(1, MAX_RUNS),
                "default": RUNTIME_DEFAULT_RUNS,
                "help": f"timed runs per candidate, 1 to {MAX_RUNS} (default: 20)",
            },
        ),
    ),
    table=tune_table,
    exit_code=lambda answer: EXIT_OK if answer["reached"] else EXIT_BUDGET,
    answer=TuneAnswer,
)
