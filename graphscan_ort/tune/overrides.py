"""tune's calibration overrides: a tensor whose range its rare outliers set, clipped alone.

MinMax gives every tensor the range of all its calibration values, so a handful of outliers
can spread one tensor's 256 levels over a range its other values never use; Percentile clips
every tensor's tails, also those whose tails carry the signal. The override does each where it
fits: a tensor is *outlier-dominated* when its MinMax range is more than ``OUTLIER_FACTOR``
times as wide as its Percentile range (both onnxruntime's, from the calibration caches tune
keeps, both widened to include 0 as onnxruntime's scales are); that tensor gets its Percentile
range through onnxruntime's ``TensorQuantOverrides`` (``rmin``/``rmax``), every other tensor
keeps its MinMax range. At the factor 2, at least one bit of the tensor's 8 goes to values
rarer than 1 in 100,000 (onnxruntime's Percentile is 99.999).

Example: MinMax [-4.2, 96.0] and Percentile [-4.1, 4.3] (width 100.2 against 8.4, 11.9 times)
give ``{"x": [{"rmin": -4.1, "rmax": 4.3}]}``; a tensor at [0, 6.2] against [0, 5.9] (1.05
times) keeps its MinMax range.

``overridden`` is the variant of the recovery stage (recovery.py): when no row reaches the
target, the stage's start (choice.Policy.start among the rows before it: an equalized or
bias-corrected row is never the start) calibrated with MinMax and these overrides is a
candidate row of its own, ``recovery`` ``{"step": "calibration_overrides", ...}``; no row when
no tensor is outlier-dominated. Its ``quantize_static`` holds the overrides (``extra_options``),
so its arguments reproduce its model like any other row's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from onnxruntime.quantization.calibrate import TensorsData, load_tensors_data

from graphscan_ort.shared.sessions import quiet
from graphscan_ort.tune.calibration import calibrate
from graphscan_ort.tune.candidates import cache_path, calibration_key, keyword_arguments, static_rows
from graphscan_ort.tune.choice import Policy
from graphscan_ort.tune.trials import Origin

if TYPE_CHECKING:
    from graphscan_ort.tune.progress import Progress

__all__ = ["OUTLIER_FACTOR", "STEP", "outlier_overrides", "overridden"]

OUTLIER_FACTOR = 2.0  # MinMax width over Percentile width above which a tensor is outlier-dominated

STEP = "calibration_overrides"  # the recovery step's name in a row's ``recovery``

Overrides = dict[str, list[dict[str, float]]]  # TensorQuantOverrides in JSON form


def width(low: float, high: float) -> float:
    """The width of ``[low, high]`` widened to include 0, as onnxruntime's compute_scale_zp does."""
    return max(high, 0.0) - min(low, 0.0)


def bounds(data: TensorsData, name: str) -> tuple[float, float]:
    """A calibrated tensor's range as two Python floats (exact: the cache holds float32)."""
    low, high = data[name].range_value
    return float(np.asarray(low).item()), float(np.asarray(high).item())


def outlier_overrides(minmax: TensorsData, percentile: TensorsData, factor: float = OUTLIER_FACTOR) -> Overrides:
    """``{tensor: [{"rmin", "rmax"}]}``, the Percentile range of each tensor whose MinMax range is
    more than ``factor`` times as wide (a Percentile range of width 0 is never an override: it
    would quantize every value to 0), in the MinMax cache's order."""
    found: Overrides = {}
    for name in minmax.data:
        if name not in percentile.data:
            continue
        wide, narrow = width(*bounds(minmax, name)), width(*bounds(percentile, name))
        if narrow > 0 and wide > factor * narrow:
            low, high = bounds(percentile, name)
            found[name] = [{"rmin": low, "rmax": high}]
    return found


def ranges(prepared_path: str, settings: dict[str, Any], make_reader: Any, folder: str) -> TensorsData:
    """The calibration ranges of ``settings``' method for ``prepared_path``, from the cache in
    ``folder`` that every candidate of that method reads (calibrated into it when missing)."""
    cache = cache_path(folder, calibration_key(settings))
    if not os.path.exists(cache):  # every candidate of a method reads one cache, written once
        with quiet():
            calibrate(prepared_path, keyword_arguments(settings), make_reader, cache)
    return load_tensors_data(cache)


def overridden(trials: Any, policy: Policy, progress: Progress) -> None:
    """The search's start (``policy.start`` among the rows recovery did not make) quantized
    again with MinMax ranges and the Percentile range of each outlier-dominated tensor, a row
    of ``trials`` (trials.Trials) whose ``recovery`` says which tensors and what it gained (see
    the module); none when no tensor is outlier-dominated."""
    unrecovered = [r for r in static_rows(trials.rows) if r["recovery"] is None]  # recovery's own start
    base = policy.start(unrecovered)
    _, prepared_path, cache = trials.files[base["id"]]
    given = cast(dict[str, Any], base["quantize_static"])  # static_rows: never null
    plain = {k: v for k, v in given.items() if k not in ("calibrate_method", "extra_options")}
    progress.show("looking for tensors whose outliers set their range")
    trials.measure.release_float()  # a calibration may come (ranges), holding many tensors
    try:
        minmax = ranges(prepared_path, {**plain, "calibrate_method": "MinMax"}, trials.reader, cache)
        percentile = ranges(prepared_path, {**plain, "calibrate_method": "Percentile"}, trials.reader, cache)
    except ValueError:  # a histogram refused (samples of several shapes): no Percentile ranges to clip to
        return
    found = outlier_overrides(minmax, percentile)
    if not found:
        return
    settings = {**plain, "calibrate_method": "MinMax", "extra_options": {"TensorQuantOverrides": found}}
    widest = max(width(*bounds(minmax, n)) / width(*bounds(percentile, n)) for n in found)
    detail = (
        f"{len(found)} tensor{'s' if len(found) != 1 else ''} given {'their' if len(found) != 1 else 'its'} "
        f"Percentile range (MinMax up to {widest:.3g} times as wide), every other its MinMax range"
    )
    origin = Origin(STEP, base, lambda: detail)
    trials.add(settings, base["rewrites"], prepared_path, cache, kept=base["kept_float"], origin=origin)
