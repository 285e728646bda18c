"""tune's stages, in the order tune_in runs them inside its temporary folder.

The candidates of every prepared model (candidates.py) and onnxruntime's
quantize_dynamic; when none meets the target, the structural seeds kept float
in the fastest rows of the Pareto front (``seeded``), the best row calibrated
each other way (``refine``), and blocks of operators excluded in turn
(``exclusions``). After each stage the rows settle (choice.settle: the front
marked, a row chosen); the chosen row is then bias-corrected, the variant kept where
it helps as deployed (recovery.polished), and ``write_choice`` leaves the chosen model
in the folder.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, cast

import numpy as np
import onnx

from graphscan import EXIT_RUNTIME, GraphscanError, shown
from graphscan_ort.engines.attribution import MIN_GAIN_DB
from graphscan_ort.engines.attribution import measure as impact_of
from graphscan_ort.shared.answers import Candidate, TuneChoice
from graphscan_ort.shared.inputs import inputs_answer
from graphscan_ort.shared.options import Named
from graphscan_ort.tune.blocks import next_block, part_blocks, search_blocks
from graphscan_ort.tune.candidates import (
    DYNAMIC,
    SampleReader,
    candidate_settings,
    default_row,
    dynamic_settings,
    refinements,
    static_rows,
)
from graphscan_ort.tune.choice import (
    accuracy,
    broken_words,
    choice_warnings,
    listing_order,
    settle,
    speed,
    start_row,
)
from graphscan_ort.tune.fallback import STILL_INT8
from graphscan_ort.tune.goal import Goal
from graphscan_ort.tune.overrides import overridden
from graphscan_ort.tune.prepare import dynamic_base, prepare, typing_failures
from graphscan_ort.tune.progress import Progress
from graphscan_ort.tune.recovery import polished, recover
from graphscan_ort.tune.seeds import followed, structural_seeds
from graphscan_ort.tune.trials import HISTOGRAM_SHAPES, Measure, Trials
from graphscan_ort.tune.verdict import FEW_SAMPLES, low_levels_warning


def static_settings(row: Candidate) -> dict[str, Any]:
    """A quantize_static row's keyword arguments: the stages refine only those (static_rows)."""
    return cast(dict[str, Any], row["quantize_static"])


def tune_in(
    calibration: list[dict[str, np.ndarray]],
    work: str,
    goal: Goal,
    measure: Measure,
    limits: tuple[int | None, int | None] = (None, None),
    progress: Progress | None = None,
    seeds: list[dict[str, str]] | None = None,
) -> TuneChoice:
    """tune's work on ``measure``'s float model inside the temporary folder ``work``; leaves
    prepared.onnx there, and model.onnx when a candidate passes the guards. ``limits``:
    (--max-exclude, --max-trials); ``seeds``: the nodes the user keeps float in every
    candidate, ``{"node", "why"}`` each."""
    path, model = measure.path, measure.model
    seeds = seeds or []
    progress = progress or Progress()
    evaluation = measure.evaluation
    progress.show("preparing the float model")
    base, rewritten, steps = prepare(path, work, evaluation, model)
    prepared = {"none": base}
    if rewritten is not base:
        prepared["rewrites"] = rewritten
    trials = Trials(work, functools.partial(SampleReader, calibration), measure)
    rows, files = trials.rows, trials.files
    unfused, dynamic_steps = dynamic_base(model, evaluation, work)
    dynamic = dynamic_settings(unfused)
    planned = len(prepared) * len(candidate_settings()) + len(dynamic)
    for rewrites, prepared_model in prepared.items():
        prepared_path = os.path.join(work, f"prepared-{rewrites}.onnx")
        onnx.save(prepared_model, prepared_path)
        trials.given[prepared_path] = prepared_model
        cache = os.path.join(work, f"cache-{rewrites}")
        os.mkdir(cache)
        kept = followed(seeds, model, prepared_model, path)  # a seed prepare folded away: where it runs now
        for settings in candidate_settings():
            progress.show("quantizing and measuring candidate", len(rows) + 1, planned)
            trials.add({**settings, **excluding(kept)}, rewrites != "none", prepared_path, cache, kept=kept)
    if dynamic:  # onnxruntime's one-line peer on transformers: weights int8, activations at run time
        prepared_path = os.path.join(work, "prepared-dynamic.onnx")
        onnx.save(unfused, prepared_path)
        trials.given[prepared_path] = unfused
        kept = followed(seeds, model, unfused, path)
    for settings in dynamic:
        progress.show("quantizing and measuring candidate", len(rows) + 1, planned)
        trials.add({**settings, **excluding(kept)}, False, prepared_path, work, kept=kept, quantizer=DYNAMIC)
    if not files:
        refused = f"onnxruntime's quantize_static refused every candidate ({rows[0]['error']})"
        raise GraphscanError(f"{shown(path)}: {refused}{typing_failures(steps + dynamic_steps)}", EXIT_RUNTIME)
    target, warnings = goal.target(default_row(rows))
    emulated = measure.on is not None  # a CPU target's accuracy and kernels, this machine's time
    chosen, reached = settle(rows, target["value"], emulated, trials.by_sample)
    if not reached and target["value"] is not None:
        seeded(trials, rows, calibration, progress)
        chosen, reached = settle(rows, target["value"], emulated, trials.by_sample)
    # The refinements and exclusions start from a quantize_static row: a dynamic one calibrates nothing.
    searchable = not reached and target["value"] is not None and any(r["error"] is None for r in static_rows(rows))
    if searchable:
        refine(trials, start_row(static_rows(rows), trials.by_sample), progress)
        steps += recover(trials, target["value"], model, calibration, progress)  # still short: int8 kept
        overridden(trials, target["value"], progress)  # still short: outlier-dominated tensors clipped alone
        chosen, reached = settle(rows, target["value"], emulated, trials.by_sample)
    if searchable and not reached and target["value"] is not None:
        progress.show("ranking the operators to exclude")
        start = start_row(static_rows(rows), trials.by_sample)
        exclusions(trials, start, target["value"], limits, prepared, goal.metric.name == "sqnr", progress)
        chosen, reached = settle(rows, target["value"], emulated, trials.by_sample)
    # The chosen row bias-corrected, written instead where that helps as deployed (reached or not).
    chosen, reached = polished(trials, chosen, reached, target["value"], calibration, progress)
    written = write_choice(work, files, rows, chosen)
    warnings += choice_warnings(rows, chosen, reached, target["value"]) + trials.disturbed
    if chosen is not None:
        _, prepared_path, _ = files[chosen["id"]]
        model_written = onnx.load(os.path.join(work, "model.onnx"), load_external_data=False)
        warnings += low_levels_warning(model_written, trials.float_ranges(prepared_path))
        warnings += [f"the chosen model breaks a part: {broken_words(part)}" for part in chosen["broken_parts"] or []]
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
    return {
        "float": {"ms": sorted(float_ms)[len(float_ms) // 2], "bytes": measure.float_bytes},
        "prepare": steps + dynamic_steps,
        "candidates": listing_order(rows),
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


def excluding(kept: list[dict[str, str]]) -> dict[str, list[str]]:
    """The quantizer's ``nodes_to_exclude`` for the seeds ``kept`` (each node once; none: no key)."""
    return {"nodes_to_exclude": list(dict.fromkeys(seed["node"] for seed in kept))} if kept else {}


SEEDED_ROWS = 3  # the fastest rows on the Pareto front that the structural seeds are added to
SEED_SAMPLES = 8  # the calibration samples the Concats' input ranges are measured on


def seeded(trials: Trials, rows: list[Candidate], calibration: list[dict[str, np.ndarray]], progress: Progress) -> None:
    """The structural seeds (seeds.py: the outputs' producers, the Concats whose inputs'
    ranges differ widely) kept float in the fastest rows of the Pareto front that pass the
    guards: the fixes that are free in speed, each tried as a candidate of its own."""
    front = sorted((r for r in static_rows(rows) if r["pareto"] and not r["fails"]), key=lambda r: (-speed(r), r["id"]))
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for k, base in enumerate(front[:SEEDED_ROWS]):
        _, prepared_path, cache = trials.files[base["id"]]
        given = list(static_settings(base).get("nodes_to_exclude") or [])
        if prepared_path not in found:
            model = trials.given[prepared_path]
            found[prepared_path] = structural_seeds(model, calibration[:SEED_SAMPLES], trials.measure.path, given)
        for kind, nodes in found[prepared_path]:
            progress.show("keeping structural seeds float", k + 1, min(len(front), SEEDED_ROWS))
            settings = {**static_settings(base), "nodes_to_exclude": [*given, *nodes]}
            kept = base["kept_float"] + [{"node": node, "why": kind} for node in nodes]
            trials.add(settings, base["rewrites"], prepared_path, cache, kept=kept)


def refine(trials: Trials, base: Candidate, progress: Progress) -> None:
    """``base``'s settings calibrated each other way (candidates.refinements): they change
    only the ranges, so they are tried on the best candidate alone."""
    _, prepared_path, cache = trials.files[base["id"]]
    seeded = static_settings(base).get("nodes_to_exclude")
    settings = [
        {**refined, "nodes_to_exclude": seeded} if seeded else refined for refined in refinements(static_settings(base))
    ]
    for k, refined in enumerate(settings):
        progress.show("refining the calibration", k + 1, len(settings))
        trials.add(refined, base["rewrites"], prepared_path, cache, kept=base["kept_float"])


def write_choice(
    work: str, files: dict[int, tuple[str, str, str]], rows: list[Candidate], chosen: Candidate | None
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
    best: Candidate,
    target: float,
    limits: tuple[int | None, int | None],
    prepared: dict[str, onnx.ModelProto],
    in_db: bool,
    progress: Progress | None = None,
) -> None:
    """Blocks of operators of ``best`` (blocks.py) added to nodes_to_exclude, the next one
    chosen by its estimated gain per cost, each re-quantized and measured as deployed; an
    addition stays only if the metric rises, its nodes really run float and it breaks no guard
    the start passed (then no block as costly is tried again). ``limits``:
    (--max-exclude nodes, --max-trials re-quantizations); ``in_db``: the metric is the SQNR,
    so impact's estimates are in its unit. Every model tried is a candidate row of its own
    (the quantizer's, never a promise)."""
    candidate_path, prepared_path, cache = trials.files[best["id"]]
    given = prepared["rewrites" if best["rewrites"] else "none"]  # the model the quantizer was given
    measure = trials.measure
    candidate = measure.models[candidate_path]
    # A ranking, not a measurement (every trial is measured on every sample): impact runs the
    # model once per operator, so it ranks on the first evaluation sample alone.
    ranked = impact_of(Named(given, prepared_path), Named(candidate, candidate_path), measure.evaluation[:1])["ops"]
    blocks = search_blocks(given, ranked, MIN_GAIN_DB)
    part = best["worst_part"]
    given_seeds = frozenset(static_settings(best).get("nodes_to_exclude") or [])
    first = part_blocks(given, part["node"] if part else None, given_seeds)
    max_exclude, max_trials = limits
    budget = DEFAULT_MAX_TRIALS if max_trials is None else max_trials
    seeded = list(static_settings(best).get("nodes_to_exclude") or [])  # the seeds stay float in every trial
    kept: list[str] = []
    kept_share = 0.0
    tried: set[tuple[str, ...]] = set()
    current = best
    ceiling = math.inf  # a block this costly made a model the guards refuse: none as costly is tried again
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
                and b.cost < ceiling
                and not set(b.nodes) <= set(kept)
                and (room is None or len(set(b.nodes) - set(kept)) <= room)
            ),
            None,
        ) or next_block(
            [b for b in blocks if b.cost < ceiling], tried, frozenset(kept + seeded), kept_share, needed, room
        )
        if block is None:
            break
        tried.add(block.nodes)
        added = [n for n in block.nodes if n not in kept]
        if progress is not None:
            progress.show("trying exclusion", k + 1, budget)
        settings = {**static_settings(best), "nodes_to_exclude": [*seeded, *kept, *added]}
        trial = {"block": block.kind, "added": added}
        row = trials.add(settings, best["rewrites"], prepared_path, cache, trial, best["kept_float"])
        real = row["error"] is None and all((row["excluded"] or {})[n] != STILL_INT8 for n in added)  # they run float
        if set(row["fails"] or []) - set(best["fails"] or []):
            # Larger or slower than the guards allow, where the start was not: keeping more float only
            # makes a model more so, so this block is never kept and no block as costly is tried again.
            ceiling = min(ceiling, block.cost)
        elif real and accuracy(row) > accuracy(current):
            kept_share += sum(s for n, s in zip(block.nodes, block.shares, strict=True) if n in added)
            kept += added
            current = row
