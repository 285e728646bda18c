"""tune's goal: the metric asked for and the target it must reach, with where the target
came from (the user, float's own agreement, onnxruntime's defaults or the floor under them)."""

from __future__ import annotations

import math

from graphscan import EXIT_USAGE, GraphscanError, MetricChoice, part_words
from graphscan_ort.shared.agreement import DEFAULT_TARGET_FLOOR_DB, POOR_SQNR_DB, Metric, metric
from graphscan_ort.shared.answers import Candidate, Target
from graphscan_ort.tune.bounds import DEFAULT_CONFIDENCE


def metric_of(given: MetricChoice, target: float | None, target_sqnr: float | None) -> Metric:
    """The metric group's metric, with --target and its alias --target-sqnr checked (exit 2)."""
    chosen = metric(given.name, given.threshold, given.blank, given.layout)
    if target is not None and target_sqnr is not None:
        raise GraphscanError("usage: give --target or --target-sqnr, not both", EXIT_USAGE)
    if target_sqnr is not None and chosen.name != "sqnr":
        raise GraphscanError(
            f"usage: --target-sqnr is the target of --metric sqnr; give --target for {chosen.name}", EXIT_USAGE
        )
    for flag, value in (("--target", target), ("--target-sqnr", target_sqnr)):
        if value is not None and not math.isfinite(value):
            raise GraphscanError(f"usage: {flag} must be a finite number, not {value!r}", EXIT_USAGE)
    return chosen


class Goal:
    """What tune aims at: the metric, the target the user gave (None: the default one),
    float's own agreement (the metric of the float model against itself), and the confidence
    the target must be shown at (bounds.py)."""

    def __init__(
        self, chosen: Metric, given: float | None, own: float | None, confidence: float = DEFAULT_CONFIDENCE
    ) -> None:
        self.metric, self.given, self.own, self.confidence = chosen, given, own, confidence

    def target(self, default: Candidate | None) -> tuple[Target, list[str]]:
        """The target and where it came from, with the warnings it deserves; ``default``:
        the row of onnxruntime's default settings (None when it was not measured)."""
        if self.given is not None:
            return {"value": self.given, "source": "user"}, []
        if self.metric.name != "sqnr":
            value = self.own
            warnings = [] if value is not None else [f"{self.metric.name} of float against itself is undefined"]
            return {"value": value, "source": "float"}, warnings
        value = None if default is None or default["error"] is not None else default["sqnr_db"]
        if value is None:
            why = (
                "the default target, the SQNR of onnxruntime's default settings, is undefined here: "
                "give --target; no candidate can reach an undefined target"
            )
            return {"value": None, "source": "defaults"}, [why]
        if value < POOR_SQNR_DB:
            part = default.get("worst_part") if default is not None else None
            where = f" on {part_words(part)}" if part else ""
            poor = (
                f"onnxruntime's default settings reach {value:.2f} dB{where}, poor (below {POOR_SQNR_DB:g} dB: models "
                "that far from float lose their task)"
            )
            if value < DEFAULT_TARGET_FLOOR_DB:
                floor = f"{poor}: the default target is the floor, {DEFAULT_TARGET_FLOOR_DB:g} dB"
                return {"value": DEFAULT_TARGET_FLOOR_DB, "source": "floor"}, [floor]
            return {"value": value, "source": "defaults"}, [f"{poor}; give --target or --metric"]
        return {"value": value, "source": "defaults"}, []
