"""tune's pipeline: its stages, one ordered list (STAGES), run by ``tune_in`` inside its
temporary folder. After each stage the policy settles the rows (choice.Policy.settle: every
row's bound, the Pareto front, the choice); a stage that searches runs only while no row
meets the target:

1. ``grid``: every quantizer setting of every prepared model (candidates.py), and
   onnxruntime's quantize_dynamic where a MatMul has a constant weight;
2. ``seeds``: the structural seeds kept float in the fastest rows of the Pareto front;
3. ``refinements``: the search's start calibrated each other way;
4. ``recovery``: the start equalized across layers, and bias-corrected (recovery.py);
5. ``overrides``: the start with its outlier-dominated tensors given their Percentile range;
6. ``exclusions``: blocks of operators kept float in turn;
7. ``polish``: the chosen row bias-corrected, written instead where that helps;
8. ``retime``: the chosen row and the rows it is speed-tied with timed again together.

``write_choice`` then leaves the chosen model in the folder.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import onnx

from graphscan import EXIT_RUNTIME, GraphscanError, shown
from graphscan_ort.engines.attribution import MIN_GAIN_DB, ranked_ops
from graphscan_ort.shared.answers import Candidate, PrepareStep, Shown, Target, TuneChoice
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
    Policy,
    accuracy,
    broken_words,
    choice_warnings,
    compared,
    listing_order,
    speed,
)
from graphscan_ort.tune.fallback import STILL_INT8
from graphscan_ort.tune.goal import Goal
from graphscan_ort.tune.overrides import overridden
from graphscan_ort.tune.prepare import dynamic_base, prepare, typing_failures
from graphscan_ort.tune.progress import Progress
from graphscan_ort.tune.recovery import polished, recover
from graphscan_ort.tune.seeds import followed, structural_seeds
from graphscan_ort.tune.trials import HISTOGRAM_SHAPES, Measure, Origin, Trials, busy_spread
from graphscan_ort.tune.verdict import FEW_SAMPLES, low_levels_warning


def static_settings(row: Candidate) -> dict[str, Any]:
    """A quantize_static row's keyword arguments: the stages refine only those (static_rows)."""
    return cast(dict[str, Any], row["quantize_static"])


@dataclasses.dataclass
class Run:
    """One tune run as its stages see it: the ledger (``trials``) and its policy, the goal,
    the calibration samples, the prepared models (``none``, and ``rewrites`` where they
    changed it), the search's limits (--max-exclude, --max-trials), the user's seeds, the
    progress line, the prepare steps taken, the target, and the row chosen so far."""

    trials: Trials
    policy: Policy
    goal: Goal
    calibration: list[dict[str, np.ndarray]]
    prepared: dict[str, onnx.ModelProto]
    limits: tuple[int | None, int | None]
    seeds: list[dict[str, str]]
    progress: Progress
    steps: list[PrepareStep]
    target: Target = dataclasses.field(default_factory=lambda: Target(value=None, source="user"))
    warnings: list[str] = dataclasses.field(default_factory=list)
    chosen: Candidate | None = None
    met: bool = False

    @property
    def rows(self) -> list[Candidate]:
        return self.trials.rows

    def searching(self) -> bool:
        """Whether a search stage runs: no row meets a defined target, nor meets it by its
        measured value alone (then only more samples can show it: Policy.only_samples_lack),
        and a quantize_static row was measured to start from (a dynamic one calibrates nothing)."""
        return (
            not self.met
            and self.target["value"] is not None
            and not self.policy.only_samples_lack(self.rows)
            and any(compared(r) for r in static_rows(self.rows))
        )

    def start(self) -> Candidate:
        """The search's start among the quantize_static rows (choice.Policy.start)."""
        return self.policy.start(static_rows(self.rows))


@dataclasses.dataclass(frozen=True)
class Stage:
    """A stage of the pipeline: its name, what it does (tune --help and DESIGN.md say it),
    the function that runs it, and whether it runs whatever the choice (else: while no row
    meets the target, ``Run.searching``)."""

    name: str
    does: str
    run: Callable[[Run], None]
    always: bool = False


def tune_in(
    calibration: list[dict[str, np.ndarray]],
    work: str,
    goal: Goal,
    measure: Measure,
    limits: tuple[int | None, int | None] = (None, None),
    progress: Progress | None = None,
    seeds: list[dict[str, str]] | None = None,
) -> tuple[TuneChoice, Shown]:
    """tune's work on ``measure``'s float model inside the temporary folder ``work``: the
    stages in order (STAGES), each settled by the policy; leaves prepared.onnx there, and
    model.onnx when a candidate passes the guards. ``limits``: (--max-exclude, --max-trials);
    ``seeds``: the nodes the user keeps float in every candidate, ``{"node", "why"}`` each."""
    progress = progress or Progress()
    progress.show("preparing the float model")
    base, rewritten, steps = prepare(measure.path, work, measure.evaluation, measure.model)
    prepared = {"none": base}
    if rewritten is not base:
        prepared["rewrites"] = rewritten
    trials = Trials(work, functools.partial(SampleReader, calibration), measure, goal.confidence)
    policy = Policy(None, emulated=measure.on is not None, confidence=goal.confidence)
    run = Run(trials, policy, goal, calibration, prepared, limits, seeds or [], progress, steps)
    for stage in STAGES:
        if stage.always or run.searching():
            stage.run(run)
            run.chosen, run.met = policy.settle(run.rows)
    return answer(run, measure, write_choice(work, trials.files, run.rows, run.chosen)), verdict(run)


def verdict(run: Run) -> Shown:
    """How the verdict was reached, for the answer's ``evaluation``: the confidence, the rows
    compared (each row's bound corrected for them) and the chosen row's method (None: no row
    chosen, or no bound could be had)."""
    policy, chosen = run.policy, run.chosen
    return {
        "confidence": policy.confidence,
        "rows_compared": policy.rows_compared(run.rows),
        "method": None if chosen is None else policy.method(chosen),
    }


def undecided(run: Run) -> list[str]:
    """What would decide a target the chosen row was not shown to meet: how many samples its
    spread asks for (bounds.samples_to_decide), or why none can tell."""
    policy, chosen, target = run.policy, run.chosen, run.target["value"]
    if run.met or chosen is None or target is None or chosen["broken_parts"]:
        return []
    if policy.method(chosen) is None:
        said = (
            "the chosen model's metric has no bound on these samples (a bound needs at least 2 samples whose "
            "values vary, or a metric that returns (value, events)): no target can be shown met; give more "
            "held-out --inputs"
        )
        return [said]
    needed = policy.samples_to_decide(chosen)
    if needed is None:
        return []
    count, unit = needed
    measured = len(run.trials.measure.evaluation) if unit == "samples" else chosen.get("metric_events")
    said = (
        f"the chosen model was not shown to meet the target at {policy.confidence:g} confidence over "
        f"{policy.rows_compared(run.rows)} rows on {measured} {unit}: with the spread it showed, "
        f"about {count} {unit} would (give more held-out --inputs)"
    )
    return [said]


def answer(run: Run, measure: Measure, written: list[str]) -> TuneChoice:
    """The stages' part of tune's answer, and its warnings."""
    rows, chosen, met, goal = run.rows, run.chosen, run.met, run.goal
    warnings = run.warnings + choice_warnings(rows, chosen, met, run.target["value"]) + undecided(run)
    warnings += run.trials.disturbed + busy(rows)
    if chosen is not None:
        _, prepared_path, _ = run.trials.files[chosen["id"]]
        model_written = onnx.load(os.path.join(run.trials.work, "model.onnx"), load_external_data=False)
        warnings += low_levels_warning(model_written, run.trials.float_ranges(prepared_path))
        warnings += [f"the chosen model breaks a part: {broken_words(part)}" for part in chosen["broken_parts"] or []]
    evaluation = measure.evaluation
    if len(evaluation) < FEW_SAMPLES:
        warnings.append(
            f"the verdict rests on {len(evaluation)} evaluation sample{'s' if len(evaluation) != 1 else ''} "
            f"(fewer than {FEW_SAMPLES}): give more held-out --inputs"
        )
    if any(HISTOGRAM_SHAPES in (r["error"] or "") for r in rows):
        warnings.append(f"{HISTOGRAM_SHAPES}: give --calibrate samples of one shape to try Percentile and Entropy")
    if all(accuracy(r) == -math.inf for r in rows if compared(r)):
        warnings.append(f"every candidate's {goal.metric.name} is undefined on these samples: none can be reached")
    float_ms = sorted(row["float_ms"] for row in rows if row["float_ms"] is not None)
    return {
        "float": {"ms": sorted(float_ms)[len(float_ms) // 2], "bytes": measure.float_bytes},
        "prepare": run.steps,
        "candidates": listing_order(rows),
        "metric": goal.metric.describe(),
        "target": run.target,
        "target_sqnr_db": run.target["value"] if goal.metric.name == "sqnr" else None,
        "latency": {
            "inputs": inputs_answer(measure.timed_samples),
            "samples": len(measure.timed_samples),
            "first_runs": measure.first.runs,
            "runs": measure.timing.runs,
            "min_speedup": measure.min_speedup,
        },
        "chosen": None if chosen is None else chosen["id"],
        "reached": met,
        "written": written,
        "warnings": warnings,
    }


def busy(rows: list[Candidate]) -> list[str]:
    """A warning when the float model's own times, timed beside every row, spread more than
    trials.BUSY_FACTOR times over the run (busy_spread): the machine was busy, and the
    speedups are less sure than their spreads say."""
    floats = sorted(row["float_ms"] for row in rows if row["float_ms"] is not None)
    if not busy_spread(floats):
        return []
    middle = floats[len(floats) // 2]
    said = (
        f"the float model's own time ranged from {floats[0]:.3g} to {floats[-1]:.3g} ms over the run (median "
        f"{middle:.3g} ms, {len(floats)} timings): the machine was busy, and the speedups are less sure than their "
        "spreads say (tune on a quiet machine)"
    )
    return [said]


def grid(run: Run) -> None:
    """Every quantizer setting of every prepared model, and quantize_dynamic's (its own
    unfused, typed model): then the target is known (goal.py), and the policy's with it."""
    trials, measure, progress = run.trials, run.trials.measure, run.progress
    path, model = measure.path, measure.model
    unfused, dynamic_steps = dynamic_base(model, measure.evaluation, trials.work)
    dynamic = dynamic_settings(unfused)
    planned = len(run.prepared) * len(candidate_settings()) + len(dynamic)
    for rewrites, prepared_model in run.prepared.items():
        prepared_path = os.path.join(trials.work, f"prepared-{rewrites}.onnx")
        onnx.save(prepared_model, prepared_path)
        trials.given[prepared_path] = prepared_model
        cache = os.path.join(trials.work, f"cache-{rewrites}")
        os.mkdir(cache)
        kept = followed(run.seeds, model, prepared_model, path)  # a seed prepare folded away: where it runs now
        for settings in candidate_settings():
            progress.show("quantizing and measuring candidate", len(run.rows) + 1, planned)
            trials.add({**settings, **excluding(kept)}, rewrites != "none", prepared_path, cache, kept=kept)
    if dynamic:  # onnxruntime's one-line peer on transformers: weights int8, activations at run time
        prepared_path = os.path.join(trials.work, "prepared-dynamic.onnx")
        onnx.save(unfused, prepared_path)
        trials.given[prepared_path] = unfused
        kept = followed(run.seeds, model, unfused, path)
    for settings in dynamic:
        progress.show("quantizing and measuring candidate", len(run.rows) + 1, planned)
        trials.add({**settings, **excluding(kept)}, False, prepared_path, trials.work, kept=kept, quantizer=DYNAMIC)
    run.steps += dynamic_steps
    if not trials.files:
        refused = f"onnxruntime's quantize_static refused every candidate ({run.rows[0]['error']})"
        raise GraphscanError(f"{shown(path)}: {refused}{typing_failures(run.steps)}", EXIT_RUNTIME)
    default = default_row(run.rows)
    run.target, run.warnings = run.goal.target(default)
    run.policy.target, run.policy.source = run.target["value"], run.target["source"]
    run.policy.reference = default if run.target["source"] == "defaults" else None
    run.policy.by_sample, run.policy.runs = trials.by_sample, trials.runs
    trials.policy = run.policy


def excluding(kept: list[dict[str, str]]) -> dict[str, list[str]]:
    """The quantizer's ``nodes_to_exclude`` for the seeds ``kept`` (each node once; none: no key)."""
    return {"nodes_to_exclude": list(dict.fromkeys(seed["node"] for seed in kept))} if kept else {}


SEEDED_ROWS = 3  # the fastest rows on the Pareto front that the structural seeds are added to
SEED_SAMPLES = 8  # the calibration samples the Concats' input ranges are measured on


def seeded(run: Run) -> None:
    """The structural seeds (seeds.py: the outputs' producers, the Concats whose inputs'
    ranges differ widely) kept float in the fastest rows of the Pareto front that pass the
    guards: the fixes that are free in speed, each tried as a candidate of its own."""
    trials, rows, progress = run.trials, run.rows, run.progress
    front = sorted((r for r in static_rows(rows) if r["pareto"] and not r["fails"]), key=lambda r: (-speed(r), r["id"]))
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for k, base in enumerate(front[:SEEDED_ROWS]):
        _, prepared_path, cache = trials.files[base["id"]]
        given = list(static_settings(base).get("nodes_to_exclude") or [])
        if prepared_path not in found:
            model = trials.given[prepared_path]
            samples = run.calibration[:SEED_SAMPLES]
            found[prepared_path] = structural_seeds(model, samples, trials.measure.path, given)
        for kind, nodes in found[prepared_path]:
            progress.show("keeping structural seeds float", k + 1, min(len(front), SEEDED_ROWS))
            settings = {**static_settings(base), "nodes_to_exclude": [*given, *nodes]}
            kept = base["kept_float"] + [{"node": node, "why": kind} for node in nodes]
            trials.add(settings, base["rewrites"], prepared_path, cache, kept=kept, origin=Origin("seed", base))


def refine(run: Run) -> None:
    """The search's start calibrated each other way (candidates.refinements): they change
    only the ranges, so they are tried on the best candidate alone."""
    base = run.start()
    _, prepared_path, cache = run.trials.files[base["id"]]
    seeded = static_settings(base).get("nodes_to_exclude")
    settings = [
        {**refined, "nodes_to_exclude": seeded} if seeded else refined for refined in refinements(static_settings(base))
    ]
    for k, refined in enumerate(settings):
        run.progress.show("refining the calibration", k + 1, len(settings))
        origin = Origin("refinement", base)
        run.trials.add(refined, base["rewrites"], prepared_path, cache, kept=base["kept_float"], origin=origin)


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
    policy: Policy,
    best: Candidate,
    limits: tuple[int | None, int | None],
    prepared: dict[str, onnx.ModelProto],
    in_db: bool,
    progress: Progress | None = None,
) -> None:
    """Blocks of operators of ``best`` (blocks.py) added to nodes_to_exclude, the next one
    chosen by its estimated gain per cost, each re-quantized and measured as deployed, until a
    row meets the policy's target; an addition stays only if it is more accurate (the
    policy's ``better``), its nodes really run float and it breaks no guard the start passed
    (then no block as costly is tried again). ``limits``:
    (--max-exclude nodes, --max-trials re-quantizations); ``in_db``: the metric is the SQNR,
    so impact's estimates are in its unit. Every model tried is a candidate row of its own
    (the quantizer's, never a promise)."""
    candidate_path, prepared_path, cache = trials.files[best["id"]]
    given = prepared["rewrites" if best["rewrites"] else "none"]  # the model the quantizer was given
    measure = trials.measure
    candidate = measure.models[candidate_path]
    # A ranking, not a measurement (every trial is measured on every sample): impact runs the
    # model once per operator, so it ranks on the first evaluation sample alone.
    measure.release_float()  # the ranking's segment sessions hold many tensors
    ranked = ranked_ops(Named(given, prepared_path), Named(candidate, candidate_path), measure.evaluation[:1])
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
    target = policy.target
    assert target is not None, "the search runs only toward a defined target"
    for k in range(budget):
        if policy.settle(trials.rows)[1]:  # met: more exclusions would only make it slower
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
        origin = Origin("trial", best, trial={"block": block.kind, "added": added})
        row = trials.add(settings, best["rewrites"], prepared_path, cache, best["kept_float"], origin=origin)
        real = row["error"] is None and all((row["excluded"] or {})[n] != STILL_INT8 for n in added)  # they run float
        if set(row["fails"] or []) - set(best["fails"] or []):
            # Larger or slower than the guards allow, where the start was not: keeping more float only
            # makes a model more so, so this block is never kept and no block as costly is tried again.
            ceiling = min(ceiling, block.cost)
        elif real and policy.better(row, current):
            kept_share += sum(s for n, s in zip(block.nodes, block.shares, strict=True) if n in added)
            kept += added
            current = row


def exclude(run: Run) -> None:
    """The exclusions stage: impact ranks the start's operators, blocks of them kept float in turn."""
    run.progress.show("ranking the operators to exclude")
    in_db = run.goal.metric.name == "sqnr"
    exclusions(run.trials, run.policy, run.start(), run.limits, run.prepared, in_db, run.progress)


def recovery(run: Run) -> None:
    """The recovery stage (recovery.py): the start equalized, and bias-corrected."""
    run.steps += recover(run.trials, run.policy, run.trials.measure.model, run.calibration, run.progress)


def overrides(run: Run) -> None:
    """The overrides stage (overrides.py): the start with its outlier-dominated tensors clipped alone."""
    overridden(run.trials, run.policy, run.progress)


def polish(run: Run) -> None:
    """The chosen row bias-corrected, written instead where it helps as deployed (recovery.polished)."""
    run.chosen, run.met = polished(run.trials, run.policy, run.chosen, run.met, run.calibration, run.progress)


RETIMED_ROWS = 4  # the chosen row and at most this many others timed again together


def retime(run: Run) -> None:
    """The chosen row and the rows the policy cannot tell from it by speed (of the rows that
    meet the target, those speed-tied with the fastest) timed again together in one
    interleaved session, then chosen anew by their paired runs: the written row's speed
    figures are that session's. On an emulated CPU speed chooses nothing: no session."""
    if run.chosen is None or run.policy.emulated:
        return
    meeting = [r for r in run.rows if run.policy.meets(r)] if run.met else []
    rivals = [r for r in run.policy.speed_tied(meeting) if r is not run.chosen] if meeting else []
    rivals.sort(key=lambda r: (-speed(r), r["id"]))
    run.progress.show("timing the chosen model and its rivals together")
    run.trials.retime_together([run.chosen, *rivals[: RETIMED_ROWS - 1]])


STAGES = (
    Stage("grid", "every quantizer setting of each prepared model, and onnxruntime's quantize_dynamic", grid, True),
    Stage("seeds", "the structural seeds kept float in the fastest rows of the Pareto front", seeded),
    Stage("refinements", "the search's start calibrated each other way", refine),
    Stage("recovery", "the start equalized across layers, and its biases corrected", recovery),
    Stage("overrides", "the start with its outlier-dominated tensors given their Percentile range", overrides),
    Stage("exclusions", "blocks of the start's operators kept float in turn", exclude),
    Stage("polish", "the chosen row bias-corrected, written instead where that helps", polish, True),
    Stage("retime", "the chosen row and the rows it is speed-tied with timed again together", retime, True),
)


def stages_text() -> str:
    """The pipeline as tune --help and DESIGN.md list it: one numbered line per stage."""
    searching = " (while no row meets the target, even by its measured value)"
    lines = [f"{k}. {stage.name}: {stage.does}{'' if stage.always else searching}" for k, stage in enumerate(STAGES, 1)]
    return "stages, each settled by the policy (the rows bounded, the front marked, a row chosen):\n" + "\n".join(lines)
