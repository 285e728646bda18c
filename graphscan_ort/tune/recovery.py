"""tune's recovery stage: accuracy won back with every kernel still int8.

When no candidate reaches the target after the refinements, the most accurate row (the
search's start, choice.Policy.start) is tried two more ways, each a candidate row of its own
with ``recovery`` saying what was done and what it did:

1. ``equalize``: its prepared model with cross-layer equalization (equalize.py), verified
   against the original like every prepare step (its ``prepare`` step is ``equalize``),
   quantized with the row's own arguments and a calibration of its own.
2. ``bias_correction``: the more accurate of the row and its equalized twin, quantized
   again (the same arguments and calibration), then its biases corrected on the
   calibration samples (bias.py): the step after ``quantize_static`` that reproduces it.

Whatever the stages found, the row finally chosen is bias-corrected too (``polished``),
also when it reaches the target: the variant is written instead only where it helps as
deployed (``helps_as_deployed``: the target's metric higher, ties broken by the worst
part's SQNR; never below the target, never breaking a guard or a part).

``recovery`` is ``{"step", "from", "detail", "sqnr_gain_db", "metric_gain", "helps"}``
(and ``"speed_from"`` for bias correction): the gains are the row's minus the ``from``
row's (worst-part SQNR in dB, and the metric in its unit; null where either is
undefined), ``helps`` whether the metric rose. A bias-corrected model differs from its
source in initializer values only (bias.same_graph proves it of the two models), so it
runs the same kernels: it is not timed again, its speed figures are its source's and
``speed_from`` names that row (null: timed itself). Nothing is kept on trust: the choice
weighs these rows by what they measure, so a step that does not help as deployed is never
written.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from graphscan_ort.shared.answers import Candidate, PrepareStep
from graphscan_ort.tune.bias import bias_corrected
from graphscan_ort.tune.candidates import static_rows
from graphscan_ort.tune.choice import Policy
from graphscan_ort.tune.equalize import equalized
from graphscan_ort.tune.prepare import checked, step
from graphscan_ort.tune.trials import Origin, Post

if TYPE_CHECKING:
    from graphscan_ort.tune.progress import Progress


def recover(
    trials: Any,
    policy: Policy,
    original: onnx.ModelProto,
    calibration: list[dict[str, np.ndarray]],
    progress: Progress,
) -> list[PrepareStep]:
    """Add the equalized and the bias-corrected rows of the search's start (``policy.start``)
    to ``trials`` (trials.Trials; see the module); the prepare step equalization took, if any."""
    base = policy.start(static_rows(trials.rows))
    prepared_path = trials.files[base["id"]][1]
    steps: list[PrepareStep] = []
    settings, kept = base["quantize_static"], base["kept_float"]
    progress.show("equalizing the weights across layers")
    model, count = equalized(trials.given[prepared_path])
    best = base
    if count:
        error, problem = checked(original, model, trials.measure.evaluation)
        detail = f"{count} Conv pairs equalized"
        steps.append(step("equalize", problem is None, problem or detail, error))
        if problem is None:
            path = os.path.join(trials.work, f"prepared-equalized-{base['id']}.onnx")
            onnx.save(model, path)
            trials.given[path] = model
            folder = os.path.join(trials.work, f"cache-equalized-{base['id']}")
            os.mkdir(folder)
            origin = Origin("equalize", base, lambda: detail)
            row = trials.add(settings, base["rewrites"], path, folder, kept=kept, origin=origin)
            if row["error"] is None and policy.better(row, base):
                best = row
    corrected_variant(trials, best, calibration, progress)
    return steps


def corrected_variant(
    trials: Any, parent: Candidate, calibration: list[dict[str, np.ndarray]], progress: Progress
) -> Candidate:
    """``parent`` (a measured quantize_static row) quantized again with its arguments, its
    prepared model and its calibration, then its biases corrected (bias.py): a row of its
    own, whose speed figures are ``parent``'s when bias.same_graph proves the two graphs one
    (``recovery["speed_from"]``; else it is timed like any other)."""
    progress.show("correcting the biases")
    _, prepared, cache = trials.files[parent["id"]]
    given = trials.given[prepared]
    done: dict[str, Any] = {}

    def correct(target_path: str) -> None:
        corrected, what = bias_corrected(onnx.load(target_path), given, calibration, trials.measure.path)
        done.update(what)
        onnx.save(corrected, target_path)

    def detail() -> str:
        return f"{done.get('nodes', 0)} biases moved, by {done.get('mean_shift', 0.0):.3g} on average"

    settings = parent["quantize_static"]
    origin = Origin("bias_correction", parent, detail)
    row: Candidate = trials.add(
        settings,
        parent["rewrites"],
        prepared,
        cache,
        kept=parent["kept_float"],
        post=Post(correct, parent),
        origin=origin,
    )
    return row


def polished(
    trials: Any,
    policy: Policy,
    chosen: Candidate | None,
    reached: bool,
    calibration: list[dict[str, np.ndarray]],
    progress: Progress,
) -> tuple[Candidate | None, bool]:
    """The row to write and whether it reaches the target: ``chosen`` or its bias-corrected
    variant (corrected_variant; the one recover made when ``chosen`` was its source), the
    variant where it helps (``helps_as_deployed``). A dynamic row (nothing calibrated) and a
    row already corrected are left as they are."""
    if chosen is None or chosen["quantize_static"] is None or step_of(chosen) == "bias_correction":
        return chosen, reached
    variant = next(
        (r for r in trials.rows if step_of(r) == "bias_correction" and r["recovery"]["from"] == chosen["id"]), None
    ) or corrected_variant(trials, chosen, calibration, progress)
    if not helps_as_deployed(policy, variant, chosen, reached):
        return chosen, reached
    return variant, reached or policy.meets(variant)


def helps_as_deployed(policy: Policy, variant: Candidate, parent: Candidate, reached: bool) -> bool:
    """Whether ``variant`` is written instead of ``parent``: measured, no guard broken, more
    accurate by the policy's one order (``better``); when ``parent`` meets the target, the
    variant meets it too, and otherwise breaks no part ``parent`` holds. Speed is not weighed:
    the variant's is its parent's (or, when its graph differs, guarded like any row's)."""
    if variant["error"] is not None or variant["fails"]:
        return False
    better = policy.better(variant, parent)
    if reached:
        return better and policy.meets(variant)
    held = {(p["output"], p["part"]) for p in parent["broken_parts"] or []}
    return better and all((p["output"], p["part"]) in held for p in variant["broken_parts"] or [])


def step_of(row: Mapping[str, Any]) -> str | None:
    """The recovery step that made ``row`` (None: not a recovery row)."""
    return (row.get("recovery") or {}).get("step")
