"""tune: from diagnosis to a quantized model measured as it will be deployed.

    graphscan tune FLOAT.onnx --calibrate FILE.npz [...] [--inputs FILE.npz ...] --out DIR

1. Prepare the float model (prepare.py): onnxruntime's quant_pre_process, the
   opset, the rewrites; each step verified against the original.
2. Quantize every candidate (candidates.py) of the prepared model with and
   without the rewrites, calibrating once per model and method.
3. Measure each as deployed (deployed.py) on the --inputs samples, held out
   from calibration (or the calibration samples, said so).
4. Choose the fastest candidate whose SQNR meets the target (default: the SQNR
   of onnxruntime's default settings on this model), else the most accurate.
5. Write model.onnx and prepared.onnx into --out: built in a temporary folder
   beside it and renamed into place, so --out is absent or complete.

6. When no candidate reaches the target: exclusions realized by the quantizer.
   impact ranks the operators of the most accurate candidate; each is added to
   ``nodes_to_exclude`` in turn, the model re-quantized (same calibration) and
   measured as deployed, and an addition is kept only if it helps, until the
   target or --max-exclude (default 8 additions tried).
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import tempfile
import textwrap
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import (
    DEQUANTIZE,
    EXIT_INPUTS,
    EXIT_NO_FILE,
    EXIT_RUNTIME,
    EXIT_USAGE,
    MAX_RUNS,
    MAX_THREADS,
    QUANTIZE,
    RUNTIME_DEFAULT_RUNS,
    RUNTIME_LEVELS,
    TABLE_WIDTH,
    Command,
    GraphscanError,
    check_between,
    finite_float,
    format_fields,
    int_between,
    level_option,
    load_with_weights,
    non_negative_int,
    one_line,
    page,
    samples_group,
    section,
    shown,
    visible,
)
from graphscan_ort.engines.attribution import MIN_GAIN_DB
from graphscan_ort.engines.attribution import measure as impact_of
from graphscan_ort.shared.answers import Candidate, TuneAnswer, TuneChoice
from graphscan_ort.shared.files import check_out, place, write_failure
from graphscan_ort.shared.inputs import input_specs, inputs_answer, read_npz_inputs, sample_files
from graphscan_ort.shared.metrics import OutputNoise
from graphscan_ort.shared.sessions import environment, model_outputs
from graphscan_ort.tune.candidates import METHODS, SampleReader, candidate_settings, quantize_candidate
from graphscan_ort.tune.deployed import measure_candidate
from graphscan_ort.tune.prepare import prepared_base, with_rewrites
from graphscan_ort.tune.progress import Progress

# onnxruntime's own defaults: what a user gets from quantize_static without options.
DEFAULT_SETTINGS = {"activation_type": "QInt8", "per_channel": False, "calibrate_method": "MinMax"}


def accuracy(row: dict) -> float:
    """A row's SQNR for ranking: ``inf`` when its outputs equal float's, ``-inf`` when undefined."""
    return -math.inf if row["sqnr_db"] is None else row["sqnr_db"]


def speed(row: dict) -> float:
    """A row's speed for ranking: its speedup, interleaved with the float model in one
    measurement (never ``ms`` values timed minutes apart on a loaded machine)."""
    return 0.0 if row["speedup"] is None else row["speedup"]


def pareto(rows: list[dict]) -> None:
    """Mark each measured row on the front of (fastest, most accurate): no other is at least as fast and as
    accurate, and better in one."""
    measured = [r for r in rows if r["error"] is None]
    for row in rows:
        row["pareto"] = row["error"] is None and not any(
            other is not row
            and speed(other) >= speed(row)
            and accuracy(other) >= accuracy(row)
            and (speed(other) > speed(row) or accuracy(other) > accuracy(row))
            for other in measured
        )


def chosen_row(rows: list[dict], target: float | None) -> tuple[dict, bool]:
    """The fastest row meeting ``target``, else the most accurate; and whether the target was met."""
    measured = [r for r in rows if r["error"] is None]
    meeting = [r for r in measured if target is None or accuracy(r) >= target]
    if meeting:
        return max(meeting, key=lambda r: (speed(r), accuracy(r))), True
    return max(measured, key=lambda r: (accuracy(r), speed(r))), False


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
    calibrate, inputs = sample_files(calibrate), sample_files(inputs) if inputs else None
    parent = check_out(out)
    ort.set_default_logger_severity(4)  # the quantizer's own sessions log warnings on stderr
    model = load_with_weights(path)
    refuse_quantized(model, path)
    specs = input_specs(model)
    calibration = [read_npz_inputs(p, specs) for p in calibrate]
    evaluation = [read_npz_inputs(p, specs) for p in inputs] if inputs else calibration
    check_measurable(model, evaluation, path, inputs or calibrate)
    try:
        work = tempfile.mkdtemp(prefix=".graphscan-tune-", dir=parent)
    except OSError as exc:
        raise GraphscanError(f"{shown(out)}: cannot write ({exc.strerror or exc})", EXIT_NO_FILE)
    progress = Progress()
    try:
        measure = Measure(model, path, evaluation, level, threads, runs)
        answer = tune_in(path, model, calibration, work, target_sqnr, max_exclude, measure, progress)
        place(work, out)
    except Exception as exc:
        if isinstance(exc, GraphscanError) or not write_failure(exc):
            raise
        raise GraphscanError(f"{shown(out)}: cannot write ({one_line(exc)})", EXIT_NO_FILE) from None
    finally:
        progress.close()
        shutil.rmtree(work, ignore_errors=True)  # also on Ctrl-C: nothing half-written
    return {
        "model": path,
        "environment": environment(level, threads=threads),
        "calibration": {"samples": len(calibration), "methods": METHODS},
        "evaluation": {
            "samples": len(evaluation),
            "held_out": held_out(calibration, evaluation) if inputs else False,
            "inputs": inputs_answer(evaluation),
            "defaulted": [],
        },
        **answer,
        "output": out,
    }


def check_measurable(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], path: str, files: list[str]) -> None:
    """Exit 7 unless the float model's outputs on the evaluation samples hold a finite value:
    NaN or infinity everywhere, or nothing at all (a zero-size input), measures no candidate."""
    outputs = model_outputs(model, samples, path)
    values = [np.asarray(value) for sample in outputs for value in sample]
    if not any(value.size for value in values):
        why = "empty"
    elif not any(value.dtype.kind in "biuf" and np.isfinite(value.astype(np.float64)).any() for value in values):
        why = "NaN or infinite everywhere"
    else:
        return
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
    samples, the session's level and threads, the timed runs. Each candidate is read once:
    ``models`` keeps it by path for the exclusions."""

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
        self.references: dict[tuple[str, ...], OutputNoise] = {}  # the float model's outputs, run once

    def __call__(self, candidate_path: str) -> dict[str, Any]:
        candidate = self.models[candidate_path] = onnx.load(candidate_path)
        return measure_candidate(
            self.model,
            candidate,
            self.path,
            candidate_path,
            self.evaluation,
            self.level,
            self.threads,
            self.runs,
            self.references,
        )


def refused_row(row: dict[str, Any], exc: BaseException, work: str, path: str) -> dict[str, Any]:
    """A candidate the quantizer refused: kept with its error and nulls."""
    row.update(dict.fromkeys(["sqnr_db", "int8_fraction", "int8_kernels", "wrapped_but_float"]))
    row.update(ms=None, speedup=None, bytes=None, error=f"quantize_static: {users_terms(one_line(exc), work, path)}")
    return row


# onnxruntime's quantizer names the temporary copies it makes (ort.quant.*/augmented_model.onnx).
ORT_TEMPORARY = re.compile(r"\S*ort\.quant\.\w+/\S*?\.onnx")


def users_terms(text: str, work: str, path: str) -> str:
    """``text`` naming the user's model instead of a temporary file: tune's own copies in
    ``work`` and onnxruntime's calibration copies are files the user never saw."""
    text = ORT_TEMPORARY.sub(f"onnxruntime's calibration copy of {shown(path)}", text)
    return re.sub(re.escape(work) + r"/\S*?\.onnx", f"graphscan's prepared copy of {shown(path)}", text)


class Trials:
    """Every model tried, in order: ``rows`` (the candidate rows) and ``files``
    (``{id: (model, prepared model, calibration cache)}`` of those the quantizer made)."""

    def __init__(self, work: str, reader: Callable[[], SampleReader], measure: Measure) -> None:
        self.work, self.reader, self.measure = work, reader, measure
        self.rows: list[dict[str, Any]]
        self.files: dict[int, tuple[str, str, str]]
        self.rows, self.files = [], {}

    def add(self, settings: dict[str, Any], rewrites: bool, prepared_path: str, cache: str) -> dict[str, Any]:
        """Quantize ``prepared_path`` with ``settings`` and measure the model as deployed:
        its row, also when the quantizer refused it (with its error, never a crash)."""
        ident = len(self.rows)
        target_path = os.path.join(self.work, f"candidate-{ident}.onnx")
        row = {"id": ident, "quantize_static": settings, "rewrites": rewrites, "error": None}
        try:
            quantize_candidate(prepared_path, target_path, settings, self.reader, cache)
        except Exception as exc:
            if write_failure(exc):  # a full disk is not the quantizer refusing a candidate
                raise
            row = refused_row(row, exc, self.work, self.measure.path)
        else:
            row.update(self.measure(target_path))
            self.files[ident] = (target_path, prepared_path, cache)
        self.rows.append(row)
        return row


def tune_in(
    path: str,
    model: onnx.ModelProto,
    calibration: list[dict[str, np.ndarray]],
    work: str,
    target: float | None,
    max_exclude: int | None,
    measure: Measure,
    progress: Progress | None = None,
) -> TuneChoice:
    """tune's work inside the temporary folder ``work``; leaves model.onnx and prepared.onnx there."""
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
    planned = len(prepared) * len(candidate_settings())
    for rewrites, prepared_model in prepared.items():
        prepared_path = os.path.join(work, f"prepared-{rewrites}.onnx")
        onnx.save(prepared_model, prepared_path)
        cache = os.path.join(work, f"cache-{rewrites}")
        os.mkdir(cache)
        for settings in candidate_settings():
            progress.show("quantizing and measuring candidate", len(rows) + 1, planned)
            trials.add(settings, rewrites != "none", prepared_path, cache)
    if not files:
        raise GraphscanError(
            f"{shown(path)}: onnxruntime's quantize_static refused every candidate ({rows[0]['error']})", EXIT_RUNTIME
        )
    float_ms = popped_float_ms(rows)
    pareto(rows)
    default = next(
        (
            r
            for r in rows
            if not r["rewrites"] and all(r["quantize_static"][k] == v for k, v in DEFAULT_SETTINGS.items())
        ),
        None,
    )
    if target is None and default is not None and default["error"] is None:
        target = default["sqnr_db"]
    chosen, reached = chosen_row(rows, target)
    if not reached:
        progress.show("ranking the operators to exclude")
        exclusions(trials, chosen, target, max_exclude, prepared, progress)
        float_ms += popped_float_ms(rows)
        pareto(rows)
        chosen, reached = chosen_row(rows, target)
    model_path, prepared_path, _ = files[chosen["id"]]
    os.replace(model_path, os.path.join(work, "model.onnx"))
    os.replace(prepared_path, os.path.join(work, "prepared.onnx"))
    order = sorted(rows, key=lambda r: (not r["pareto"], r["error"] is not None, -speed(r), r["id"]))
    return {
        "float": {"ms": sorted(float_ms)[len(float_ms) // 2]},
        "prepare": steps + rewrite_steps,
        "candidates": [cast(Candidate, {key: row.get(key) for key in CANDIDATE_KEYS}) for row in order],
        "target_sqnr_db": target,
        "chosen": chosen["id"],
        "reached": reached,
    }


def popped_float_ms(rows: list[dict]) -> list[float]:
    """The float model's times measured beside each new candidate, taken out of
    its row: the answer reports their median once, as ``float.ms``."""
    return [row.pop("float_ms") for row in rows if "float_ms" in row]


DEFAULT_MAX_EXCLUDE = 8  # additions tried when --max-exclude is not given


def exclusions(
    trials: Trials,
    best: dict[str, Any],
    target: float | None,
    max_exclude: int | None,
    prepared: dict[str, onnx.ModelProto],
    progress: Progress | None = None,
) -> None:
    """Operators of ``best`` added to nodes_to_exclude one at a time in impact's order, each
    re-quantized and measured as deployed; an addition stays only if the SQNR rises.
    Every model tried is a candidate row of its own (the quantizer's, never a promise)."""
    candidate_path, prepared_path, cache = trials.files[best["id"]]
    given = prepared["rewrites" if best["rewrites"] else "none"]  # the model the quantizer was given
    measure = trials.measure
    candidate = measure.models[candidate_path]
    ranked = impact_of(given, candidate, measure.evaluation, prepared_path, candidate_path)["ops"]
    names = [r["node"] for r in ranked if r["gain_db"] is not None and r["gain_db"] >= MIN_GAIN_DB]
    limit = DEFAULT_MAX_EXCLUDE if max_exclude is None else max_exclude
    kept: list[str] = []
    current = best
    for k, node in enumerate(names[:limit]):
        if current["sqnr_db"] is not None and current["sqnr_db"] >= target:
            break
        if progress is not None:
            progress.show("trying exclusion", k + 1, min(limit, len(names)))
        settings = {**best["quantize_static"], "nodes_to_exclude": [*kept, node]}
        row = trials.add(settings, best["rewrites"], prepared_path, cache)
        if row["sqnr_db"] is not None and (current["sqnr_db"] is None or row["sqnr_db"] > current["sqnr_db"]):
            kept.append(node)
            current = row


CANDIDATE_KEYS = [
    "id",
    "quantize_static",
    "rewrites",
    "sqnr_db",
    "int8_fraction",
    "int8_kernels",
    "wrapped_but_float",
    "ms",
    "speedup",
    "bytes",
    "pareto",
    "error",
]


def tune_table(answer: dict[str, Any], top: int | None) -> str:
    """Candidates on the Pareto front first (the answer's order), then the choice."""
    head = format_fields(
        [("model", answer["model"]), ("level", answer["environment"]["level"]), ("float ms", answer["float"]["ms"])]
        + [("target_sqnr_db", answer["target_sqnr_db"])]
        + [("chosen", answer["chosen"]), ("reached", answer["reached"]), ("output", answer["output"])]
    )
    steps = [[s["step"], s["ok"], s["detail"]] for s in answer["prepare"]]
    rows = [
        [
            c["id"],
            c["quantize_static"]["activation_type"],
            "yes" if c["quantize_static"]["per_channel"] else "no",
            c["quantize_static"]["calibrate_method"],
            c["rewrites"],
            c["sqnr_db"],
            c["int8_kernels"],
            c["ms"],
            c["speedup"],
            c["pareto"],
            c["error"],
        ]
        for c in answer["candidates"]
    ]
    titles = ["id", "act", "pc", "method", "rw", "sqnr_db", "int8", "ms", "speedup", "pareto", "error"]
    # The detail that matters is often cut in its column: each is shown whole below.
    whole = [f"{s['step']}: {s['detail']}" for s in answer["prepare"] if not s["ok"]]
    whole += [f"candidate {c['id']}: {c['error']}" for c in answer["candidates"] if c["error"]]
    notes = "\n".join(textwrap.fill(visible(text), TABLE_WIDTH, subsequent_indent="  ") for text in whole)
    return page(
        head,
        section("prepare", ["step", "ok", "detail"], steps),
        section("candidates, Pareto-best first", titles, rows, top, cut_first=["error"]),
        *([f"in full:\n{notes}"] if notes else []),
    )


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
        (
            "--target-sqnr",
            {"metavar": "DB", "type": finite_float, "help": "default: onnxruntime's default settings' SQNR"},
        ),
        (
            "--max-exclude",
            {
                "metavar": "N",
                "type": non_negative_int,
                "help": "exclusions tried when the target is not met (default: 8)",
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
    answer=TuneAnswer,
)
