"""tune's recovery stage: accuracy won back with every kernel still int8.

When no candidate reaches the target after the refinements, the most accurate row (the
search's start, choice.start_row) is tried two more ways, each a candidate row of its own
with ``recovery`` saying what was done and what it did:

1. ``equalize``: its prepared model with cross-layer equalization (equalize.py), verified
   against the original like every prepare step (its ``prepare`` step is ``equalize``),
   quantized with the row's own arguments and a calibration of its own.
2. ``bias_correction``: the more accurate of the row and its equalized twin, quantized
   again (the same arguments and calibration), then its biases corrected on the
   calibration samples (bias.py): the step after ``quantize_static`` that reproduces it.

``recovery`` is ``{"step", "from", "detail", "sqnr_gain_db", "metric_gain", "helps"}``:
the gains are the row's minus the ``from`` row's (worst-part SQNR in dB, and the
metric in its unit; null where either is undefined), ``helps`` whether the metric rose.
Nothing is kept on trust: the choice weighs these rows like any other, so a step that
does not help as deployed is never written.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from graphscan_ort.shared.answers import PrepareStep
from graphscan_ort.tune.bias import bias_corrected
from graphscan_ort.tune.candidates import static_rows
from graphscan_ort.tune.choice import accuracy, chosen_row, pareto, start_row
from graphscan_ort.tune.equalize import equalized
from graphscan_ort.tune.prepare import checked, step

if TYPE_CHECKING:
    from graphscan_ort.tune.progress import Progress


def recover(
    trials: Any,
    target: float | None,
    original: onnx.ModelProto,
    calibration: list[dict[str, np.ndarray]],
    progress: Progress,
) -> list[PrepareStep]:
    """When no row of ``trials`` (trials.Trials) reaches ``target``, add the equalized and
    the bias-corrected rows of the search's start (see the module); the prepare step
    equalization took, if any."""
    pareto(trials.rows)
    if target is None or chosen_row(trials.rows, target)[1]:
        return []
    base = start_row(static_rows(trials.rows))
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
            row = trials.add(settings, base["rewrites"], path, folder, kept=kept)
            row["recovery"] = gains({"step": "equalize", "from": base["id"], "detail": detail}, row, base)
            if row["error"] is None and accuracy(row) > accuracy(base):
                best = row
    progress.show("correcting the biases")
    _, best_prepared, best_cache = trials.files[best["id"]]
    given = trials.given[best_prepared]
    done: dict[str, Any] = {}

    def correct(target_path: str) -> None:
        corrected, what = bias_corrected(onnx.load(target_path), given, calibration, trials.measure.path)
        done.update(what)
        onnx.save(corrected, target_path)

    row = trials.add(settings, best["rewrites"], best_prepared, best_cache, kept=kept, post=correct)
    detail = f"{done.get('nodes', 0)} biases moved, by {done.get('mean_shift', 0.0):.3g} on average"
    row["recovery"] = gains({"step": "bias_correction", "from": best["id"], "detail": detail}, row, best)
    return steps


def gains(recovery: dict[str, Any], row: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """``recovery`` with the row's gains over ``base`` in dB and in the metric."""
    recovery["sqnr_gain_db"] = difference(row.get("sqnr_db"), base.get("sqnr_db"))
    recovery["metric_gain"] = difference(row.get("metric_value"), base.get("metric_value"))
    recovery["helps"] = row["error"] is None and accuracy(row) > accuracy(base)
    return recovery


def difference(value: float | None, before: float | None) -> float | None:
    """``value - before`` when both are finite numbers (None otherwise)."""
    if value is None or before is None or not (math.isfinite(value) and math.isfinite(before)):
        return None
    return value - before
