"""tune's choice: how rows rank (the target's metric, then speed), the Pareto front, the
row chosen, where the search starts, and what a user is told about the choice."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from graphscan_ort.shared.answers import Candidate


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


def listing_order(rows: list[Candidate]) -> list[Candidate]:
    """The answer's order of the candidates: the Pareto front first, then the other measured
    rows, then the refused ones; in each, the fastest (by speedup) first, ties by id."""
    return sorted(rows, key=lambda r: (not r["pareto"], r["error"] is not None, -speed(r), r["id"]))


def chosen_row(rows: list[Candidate], target: float | None, emulated: bool = False) -> tuple[Candidate | None, bool]:
    """Of the rows that pass the guards and meet ``target`` with no part of its outputs broken
    (verdict.py), the most accurate of those tied in speed with the fastest (speed_tied), else
    the most accurate that passes them (None: none does); and whether the target was met. An
    undefined target (None) is never met. ``emulated``: the rows' accuracy and kernels are an
    emulated CPU target's, whose speed is not measured: of the rows that meet the target, the
    one with the most int8 kernels on that CPU (kernels_first)."""
    passing = [r for r in rows if r["error"] is None and not r.get("fails")]
    meeting = [r for r in passing if target is not None and accuracy(r) >= target and not r.get("broken_parts")]
    if meeting and emulated:
        return max(meeting, key=kernels_first), True
    if meeting:
        return max(speed_tied(meeting), key=lambda r: (accuracy(r), sqnr_rank(r), speed(r))), True
    if passing:
        return max(passing, key=lambda r: (accuracy(r), speed(r))), False
    return None, False


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


def settle(rows: list[Candidate], target: float | None, emulated: bool = False) -> tuple[Candidate | None, bool]:
    """After a stage adds rows: mark the Pareto front anew, then choose (chosen_row)."""
    pareto(rows)
    return chosen_row(rows, target, emulated)


def part_words(part: dict[str, Any]) -> str:
    """``output0 part 1 (from cls_sigmoid): 0.6 levels of its scale (floor 16)``."""
    return f"{part['output']} part {part['part']} (from {part['node']}): {part['why']}"


def start_row(rows: list[Candidate]) -> Candidate:
    """Where the refinements and exclusions start: the most accurate row by the target's
    metric (ties broken by the worst part's SQNR, then speed) that passes the guards (each
    exclusion only makes a model slower and larger: one that fails them already can never
    be written), else the most accurate with integer weights, else the most accurate of all.
    A bias-corrected row (recovery.py) is never the start: its correction fits its own
    weights, and every later model is quantized again without it."""
    measured = [r for r in rows if r["error"] is None and (r.get("recovery") or {}).get("step") != "bias_correction"]
    passing = [r for r in measured if not r["fails"]]
    stored = passing or [r for r in measured if not r["float_weights"]] or measured
    return max(stored, key=lambda r: (accuracy(r), sqnr_rank(r), speed(r)))


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
