"""tune's choice: how rows rank (the target's metric, then speed), the Pareto front, the
row chosen, where the search starts, and what a user is told about the choice."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from graphscan import part_words
from graphscan_ort.shared.answers import Candidate

BySample = Mapping[int, Sequence[float | None] | None]  # a row's id: its metric on each evaluation sample
NOISE_SE = 2.0  # a mean paired per-sample difference this many standard errors below zero is measurable


def accuracy(row: Mapping[str, Any]) -> float:
    """A row's metric for ranking (``metric_value``; ``sqnr_db`` in rows without one):
    ``inf`` when an SQNR's outputs equal float's, ``-inf`` when undefined."""
    value = row["metric_value"] if "metric_value" in row else row["sqnr_db"]
    return -math.inf if value is None else value


def speed(row: Mapping[str, Any]) -> float:
    """A row's speed for ranking: its speedup, interleaved with the float model in one
    measurement (never ``ms`` values timed minutes apart on a loaded machine)."""
    return 0.0 if row["speedup"] is None else row["speedup"]


def pareto(rows: list[Candidate]) -> None:
    """Mark each measured row on the front of (fastest, most accurate): no other is at least as fast and as
    accurate, and better in one. Accuracy is the target's metric, its ties broken by the worst
    part's SQNR (ranked): where a metric scores every row alike (all collapsed, say), the front
    still holds the most accurate fast row, not only the one a timing put first."""
    measured = [r for r in rows if r["error"] is None]
    for row in rows:
        row["pareto"] = row["error"] is None and not any(
            other is not row
            and speed(other) >= speed(row)
            and ranked(other) >= ranked(row)
            and (speed(other) > speed(row) or ranked(other) > ranked(row))
            for other in measured
        )


def ranked(row: Mapping[str, Any]) -> tuple[float, float]:
    """A row's accuracy for the front: the target's metric, then the worst part's SQNR."""
    return accuracy(row), sqnr_rank(row)


def listing_order(rows: list[Candidate]) -> list[Candidate]:
    """The answer's order of the candidates: the Pareto front first, then the other measured
    rows, then the refused ones; in each, the fastest (by speedup) first, ties by id."""
    return sorted(rows, key=lambda r: (not r["pareto"], r["error"] is not None, -speed(r), r["id"]))


def chosen_row(
    rows: list[Candidate], target: float | None, emulated: bool = False, by_sample: BySample | None = None
) -> tuple[Candidate | None, bool]:
    """Of the rows that pass the guards and meet ``target`` with no part of its outputs broken
    (verdict.py), the most accurate of those tied in speed with the fastest (speed_tied), else
    the most accurate that passes them (most_accurate; None: none does); and whether the
    target was met. An undefined target (None) is never met. ``emulated``: the rows' accuracy
    and kernels are an emulated CPU target's, whose speed is not measured: of the rows that
    meet the target, the one with the most int8 kernels on that CPU (kernels_first)."""
    passing = [r for r in rows if r["error"] is None and not r.get("fails")]
    meeting = [r for r in passing if target is not None and accuracy(r) >= target and not r.get("broken_parts")]
    if meeting and emulated:
        return max(meeting, key=kernels_first), True
    if meeting:
        return most_accurate(speed_tied(meeting)), True
    if passing:
        return most_accurate(passing, by_sample), False
    return None, False


def most_accurate(rows: list[Candidate], by_sample: BySample | None = None) -> Candidate:
    """The most accurate of ``rows`` by the target's metric (ties broken by the worst part's
    SQNR, then speed). Where each row's metric is known sample by sample (``by_sample``), the
    rows the metric cannot tell from that one (within_noise) tie with it, and the worst
    part's SQNR, a figure of every output element, decides among them: a metric resting on
    a few events moves by one event from one row to the next, and that is not accuracy."""
    best = max(rows, key=lambda r: (*ranked(r), speed(r)))
    if by_sample is None:
        return best
    tied = [r for r in rows if r is best or within_noise(by_sample.get(r["id"]), by_sample.get(best["id"]))]
    return max(tied, key=lambda r: (sqnr_rank(r), accuracy(r), speed(r)))


def within_noise(values: Sequence[float | None] | None, best: Sequence[float | None] | None) -> bool:
    """Whether a row's metric, sample by sample (``values``), is not measurably below the
    best row's (``best``): over the samples where both are finite (at least 2), the mean
    difference is at least -NOISE_SE standard errors (0 or above always is; a paired
    comparison: both rows ran on the same samples)."""
    if values is None or best is None:
        return False
    differences = np.asarray(
        [v - b for v, b in zip(values, best, strict=True) if v is not None and b is not None], dtype=np.float64
    )
    differences = differences[np.isfinite(differences)]  # a sample where either is undefined or infinite
    if len(differences) < 2:
        return False
    mean = float(differences.mean())
    error = float(differences.std(ddof=1)) / math.sqrt(len(differences))
    return mean >= -NOISE_SE * error


def kernels_first(row: Mapping[str, Any]) -> tuple[float, float, float, float]:
    """A row's rank on an emulated CPU target: its int8 kernels there (what makes a model fast
    on that CPU, the one speed figure the target gives), then accuracy, the worst part's SQNR
    and this machine's speedup."""
    return (row.get("int8_kernels") or 0, accuracy(row), sqnr_rank(row), speed(row))


def speed_tied(rows: list[Candidate]) -> list[Candidate]:
    """The fastest of ``rows`` (by speedup) and every row whose speedup lies within the
    fastest's run-by-run spread: at or above its 25th percentile (``speedup_spread``). One
    timing on a shared machine cannot order those; the choice takes the most accurate of them.
    The row's own median, not its spread, must lie there: a few noisy runs widen a slow row's
    spread up to the fastest's, never its median. A fastest row without a spread stands for
    its speedup alone."""
    fastest = max(rows, key=lambda r: (speed(r), accuracy(r)))
    spread = fastest.get("speedup_spread")
    low = spread[0] if spread else speed(fastest)
    return [r for r in rows if r is fastest or speed(r) >= low]


def settle(
    rows: list[Candidate], target: float | None, emulated: bool = False, by_sample: BySample | None = None
) -> tuple[Candidate | None, bool]:
    """After a stage adds rows: mark the Pareto front anew, then choose (chosen_row)."""
    pareto(rows)
    return chosen_row(rows, target, emulated, by_sample)


def broken_words(part: dict[str, Any]) -> str:
    """``output0 part 1 (from cls_sigmoid): 0.6 levels of its scale (floor 16)``."""
    return f"{part_words(part)}: {part['why']}"


def start_row(rows: list[Candidate], by_sample: BySample | None = None) -> Candidate:
    """Where the refinements and exclusions start: the most accurate row (most_accurate:
    by the target's metric, its ties and noise broken by the worst part's SQNR) that passes the guards (each
    exclusion only makes a model slower and larger: one that fails them already can never
    be written), else the most accurate with integer weights, else the most accurate of all.
    A bias-corrected row (recovery.py) is never the start: its correction fits its own
    weights, and every later model is quantized again without it."""
    measured = [r for r in rows if r["error"] is None and (r.get("recovery") or {}).get("step") != "bias_correction"]
    passing = [r for r in measured if not r["fails"]]
    stored = passing or [r for r in measured if not r["float_weights"]] or measured
    return most_accurate(stored, by_sample)


def sqnr_rank(row: Mapping[str, Any]) -> float:
    """A row's worst-part SQNR for breaking ties of the target's metric (``-inf`` when undefined)."""
    sqnr = row.get("sqnr_db")
    return -math.inf if sqnr is None else sqnr


def choice_warnings(rows: list[Candidate], chosen: Candidate | None, reached: bool, target: float | None) -> list[str]:
    """What a user would otherwise find out later about the choice."""
    measured = [r for r in rows if r["error"] is None]
    counts = {
        guard: sum(guard in (r["fails"] or []) for r in measured) for guard in ("slower", "larger", "float_weights")
    }
    broken = ", ".join(f"{n} {WHY[guard]}" for guard, n in counts.items() if n)
    if chosen is None:
        return [f"no candidate passes the guards ({broken} of {len(measured)}): only prepared.onnx is written"]
    if not reached and target is not None:
        return ["no candidate that passes the guards meets the target: the most accurate of them is written"]
    return []


WHY = {"slower": "not faster than float", "larger": "larger than float", "float_weights": "with float weights"}
