"""tune's policy: how its rows rank, one definition for every stage, the recovery and the polish.

Every figure a decision rests on is a measurement on a few samples, and the written row is the
best of many; so the policy decides with each figure's uncertainty (bounds.py), at one
``--confidence``:

- **passing**: measured, no guard broken (guards.py: faster, no larger, integer weights);
- **met**: passing, no output part broken (verdict.py) and the target *shown*: an absolute
  target (the user's, float's own agreement, the floor) by the row's lower bound
  (``metric_bound``), onnxruntime's defaults by the paired comparison with their own row on
  the same samples (the lower bound of the mean difference at least 0; their own row meets
  it), each at the confidence corrected for the rows compared (bounds.corrected);
- **better**: the one order of accuracy: the metric, unless the paired per-sample comparison
  cannot tell two rows apart (a **noise tie**), then the worst part's SQNR (a figure of every
  output element), then speed;
- **speed tie**: speeds the paired run-by-run ratios cannot tell apart;
- **raced**: a grid row whose speed is shown not above ``--min-speedup`` (the upper bound of
  its runs' mean log ratio) while another row passes every guard, or whose metric on its
  first samples is shown below that of a passing row as fast (paired): it can never
  be written, so it is not measured further (a row raced on its samples is still among the
  rows compared);
- and four rankings built from those: **met here** (the most accurate of the rows speed-tied
  with the fastest that meet the target), **met on an emulated CPU** (the most int8 kernels
  there: its time is no latency), **not met** (the most accurate passing row) and **the
  search's start** (the most accurate row a search can still write).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from graphscan import part_words
from graphscan_ort.shared.answers import Candidate
from graphscan_ort.tune.bounds import DEFAULT_CONFIDENCE, corrected, metric_bound, samples_to_decide, t_quantile

BySample = Mapping[int, Sequence[float | None] | None]  # a row's id: its metric on each evaluation sample


@dataclasses.dataclass(frozen=True)
class TimedRuns:
    """A row's speedup run by run (the float model's run over the row's next to it), and the
    interleaved session they were timed in: rows of one session are paired round by round."""

    session: int
    ratios: tuple[float, ...]


Runs = Mapping[int, TimedRuns | None]  # a row's id: its timing runs
DEFAULTS = "defaults"  # the target's source when it is onnxruntime's defaults' accuracy (goal.py)


def accuracy(row: Mapping[str, Any]) -> float:
    """A row's metric for ranking (``metric_value``; ``sqnr_db`` in rows without one):
    ``inf`` when an SQNR's outputs equal float's, ``-inf`` when undefined."""
    value = row["metric_value"] if "metric_value" in row else row["sqnr_db"]
    return -math.inf if value is None else value


def speed(row: Mapping[str, Any]) -> float:
    """A row's speed for ranking: its speedup, interleaved with the float model in one
    measurement (never ``ms`` values timed minutes apart on a loaded machine)."""
    return 0.0 if row["speedup"] is None else row["speedup"]


def sqnr_rank(row: Mapping[str, Any]) -> float:
    """A row's worst-part SQNR for breaking ties of the target's metric (``-inf`` when undefined)."""
    sqnr = row.get("sqnr_db")
    return -math.inf if sqnr is None else sqnr


def ranked(row: Mapping[str, Any]) -> tuple[float, float]:
    """A row's accuracy for the front: the target's metric, then the worst part's SQNR."""
    return accuracy(row), sqnr_rank(row)


def compared(row: Mapping[str, Any]) -> bool:
    """Measured for accuracy on every evaluation sample: not refused, not raced."""
    return row["error"] is None and row.get("raced") is None


def passing(row: Mapping[str, Any]) -> bool:
    """Measured (for accuracy too: a raced row never passes, even timed again faster), and no
    guard broken."""
    return compared(row) and not row.get("fails")


def speed_bound_above(ratios: Sequence[float], confidence: float) -> float | None:
    """The one-sided upper bound at ``confidence`` of the speedup whose runs' ratios are
    ``ratios``: exp of their mean log plus the Student-t margin (None: fewer than 2 runs, or a
    ratio not above 0)."""
    if len(ratios) < 2 or min(ratios) <= 0:
        return None
    mean, error = mean_and_error(np.log(np.asarray(ratios, np.float64)))
    return math.exp(mean + t_quantile(confidence, len(ratios) - 1) * error)


def mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """The mean of ``values`` (at least 2) and its standard error, ``sd / sqrt(n)``: what each
    of the policy's one-sided Student-t rules reads."""
    return float(values.mean()), float(values.std(ddof=1)) / math.sqrt(len(values))


@dataclasses.dataclass
class Policy:
    """The policy of one tune run: the target (None: undefined, never met) and where it came
    from, whether accuracy and kernels are an emulated CPU's, the confidence, and what the
    ledger knows beyond the rows: each row's metric sample by sample and its speedup run by
    run. ``reference``: the row of onnxruntime's defaults, which a ``defaults`` target is."""

    target: float | None
    source: str = "user"
    emulated: bool = False
    confidence: float = DEFAULT_CONFIDENCE
    by_sample: BySample = dataclasses.field(default_factory=dict)
    runs: Runs = dataclasses.field(default_factory=dict)
    reference: Candidate | None = None

    # -- the verdict: what a row shows at the confidence

    corrected: float = DEFAULT_CONFIDENCE  # the confidence each row is shown at: settle's, for the rows compared

    def bound_confidence(self, rows: Sequence[Mapping[str, Any]]) -> float:
        """Each row's bound is at this confidence: the run's, corrected for the rows compared."""
        return corrected(self.confidence, self.rows_compared(rows))

    def rows_compared(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """The rows whose accuracy the choice looked at, each bound is corrected for: those
        measured on every sample (compared) and those raced on their first samples (whose
        metric there the ledger keeps); not a row raced on its speed alone."""
        return sum(compared(r) or (r["error"] is None and self.by_sample.get(r["id"]) is not None) for r in rows)

    def bound(self, row: Mapping[str, Any], confidence: float) -> float | None:
        """``row``'s metric's lower bound at ``confidence`` (None: cannot be had)."""
        found = metric_bound(accuracy_value(row), self.by_sample.get(row["id"]), row.get("metric_events"), confidence)
        return None if found is None else found.lower

    def shown(self, row: Mapping[str, Any]) -> bool:
        """Whether ``row``'s accuracy shows the target met (the module's rule), guards and
        parts aside."""
        if self.target is None:
            return False
        if self.source == DEFAULTS and self.reference is not None:
            if row["id"] == self.reference["id"]:
                return True  # onnxruntime's defaults are as accurate as themselves
            return shown_above(self.by_sample.get(row["id"]), self.by_sample.get(self.reference["id"]), self.corrected)
        lower = row.get("metric_bound")
        if lower is None:  # a row added since the last settle: bounded now, at that settle's confidence
            lower = self.bound(row, self.corrected)
        return lower is not None and lower >= self.target

    def meets(self, row: Mapping[str, Any]) -> bool:
        """Passing, no output part broken, and the target shown."""
        return passing(row) and not row.get("broken_parts") and self.shown(row)

    def measured_meeting(self, row: Mapping[str, Any]) -> bool:
        """Passing, no output part broken, and the target met by the measured value itself (not
        shown: the bound may still fall short): the metric at least the target, or for
        onnxruntime's defaults their row, or a mean paired difference with it of 0 or more."""
        if self.target is None or not passing(row) or row.get("broken_parts"):
            return False
        if self.source == DEFAULTS and self.reference is not None:
            if row["id"] == self.reference["id"]:
                return True
            differences = paired(self.by_sample.get(row["id"]), self.by_sample.get(self.reference["id"]))
            return differences is not None and len(differences) > 0 and float(differences.mean()) >= 0
        return accuracy(row) >= self.target

    def only_samples_lack(self, rows: Sequence[Candidate]) -> bool:
        """Whether a row meets the target by its measured value though none is shown to: then
        only more evaluation samples can show it; another row cannot (every row compared widens
        each bound, bounds.corrected), so the search for accuracy stops."""
        return any(self.measured_meeting(r) for r in rows) and not any(self.meets(r) for r in rows)

    def method(self, row: Mapping[str, Any]) -> str | None:
        """How ``row`` was shown to meet the target, or would be: ``defaults_row`` (it is
        onnxruntime's defaults), ``paired_student_t`` (against their row), ``wilson`` or
        ``student_t`` (its own bound); None when no bound can be had."""
        if self.source == DEFAULTS and self.reference is not None:
            return "defaults_row" if row["id"] == self.reference["id"] else "paired_student_t"
        found = metric_bound(
            accuracy_value(row), self.by_sample.get(row["id"]), row.get("metric_events"), self.corrected
        )
        return None if found is None else found.method

    def samples_to_decide(self, row: Mapping[str, Any]) -> tuple[int, str] | None:
        """How many samples (or events, for a metric that counts them) would show ``row``
        meeting the target with the spread it showed, and which (None: none would, or its
        spread cannot be read)."""
        if self.target is None:
            return None
        if self.source == DEFAULTS and self.reference is not None:
            differences = paired(self.by_sample.get(row["id"]), self.by_sample.get(self.reference["id"]))
            if differences is None or len(differences) < 2:
                return None
            needed = samples_to_decide(float(differences.mean()), list(differences), None, 0.0, self.corrected)
            return None if needed is None else (needed, "samples")
        events = row.get("metric_events")
        value = accuracy_value(row)
        if value is None:
            return None
        needed = samples_to_decide(value, self.by_sample.get(row["id"]), events, self.target, self.corrected)
        return None if needed is None else (needed, "events" if events is not None else "samples")

    # -- better: the one order of accuracy

    def noise_tie(self, row: Mapping[str, Any], other: Mapping[str, Any]) -> bool | None:
        """Whether ``row``'s metric is not measurably below ``other``'s, by their paired
        per-sample differences (None: not known sample by sample)."""
        return not_measurably_below(self.by_sample.get(row["id"]), self.by_sample.get(other["id"]), self.confidence)

    def most_accurate(self, rows: Sequence[Candidate]) -> Candidate:
        """The most accurate of ``rows``: by the metric (ties by the worst part's SQNR, then
        speed); the rows it cannot tell apart from that one (noise ties) are then ranked by
        the worst part's SQNR: a metric resting on a few events moves by one event from one
        row to the next, and that is not accuracy."""
        best = max(rows, key=lambda r: (*ranked(r), speed(r)))
        tied = [r for r in rows if r is best or self.noise_tie(r, best)]
        return max(tied, key=lambda r: (sqnr_rank(r), accuracy(r), speed(r)))

    def better(self, row: Candidate, other: Candidate) -> bool:
        """Whether ``row`` is more accurate than ``other`` by the one order (most_accurate)."""
        return row is not other and self.most_accurate([other, row]) is row and ranked(row) != ranked(other)

    # -- speed

    def speed_tied(self, rows: Sequence[Candidate]) -> list[Candidate]:
        """The fastest of ``rows`` and every row whose speed its runs cannot tell from the
        fastest's (speeds_tie); a row without runs ties only at the fastest's very speedup."""
        fastest = max(rows, key=lambda r: (speed(r), accuracy(r)))
        return [r for r in rows if r is fastest or self.speed_tie(r, fastest)]

    def speed_tie(self, row: Candidate, fastest: Candidate) -> bool:
        tie = speeds_tie(self.runs.get(row["id"]), self.runs.get(fastest["id"]), self.confidence)
        return tie if tie is not None else speed(row) >= speed(fastest)

    # -- the four rankings

    def chosen(self, rows: list[Candidate]) -> tuple[Candidate | None, bool]:
        """The row to write and whether it meets the target: of the rows that meet it, the most
        accurate of those speed-tied with the fastest (on an emulated CPU: the most int8
        kernels there); else the most accurate passing row (None: none passes)."""
        meeting = [r for r in rows if self.meets(r)]
        if meeting and self.emulated:
            return max(meeting, key=kernels_first), True
        if meeting:
            return self.most_accurate(self.speed_tied(meeting)), True
        found = [r for r in rows if passing(r)]
        return (self.most_accurate(found), False) if found else (None, False)

    def start(self, rows: list[Candidate]) -> Candidate:
        """Where the refinements and exclusions start: the most accurate row that passes the
        guards (each exclusion only makes a model slower and larger: one that fails them
        already can never be written), else the most accurate with integer weights, else the
        most accurate of all. A bias-corrected row is never the start: its correction fits its
        own weights, and every later model is quantized again without it."""
        measured = [r for r in rows if compared(r) and (r.get("recovery") or {}).get("step") != "bias_correction"]
        stored = [r for r in measured if passing(r)] or [r for r in measured if not r["float_weights"]] or measured
        return self.most_accurate(stored)

    def settle(self, rows: list[Candidate]) -> tuple[Candidate | None, bool]:
        """After a stage adds rows: every row's bound at the corrected confidence and the
        Pareto front marked anew, then the choice."""
        self.corrected = self.bound_confidence(rows)
        for row in rows:
            row["metric_bound"] = None if row["error"] is not None else self.bound(row, self.corrected)
        pareto(rows)
        return self.chosen(rows)


def accuracy_value(row: Mapping[str, Any]) -> float | None:
    """The metric's value a bound is taken below (None: undefined or infinite)."""
    value = accuracy(row)
    return value if math.isfinite(value) else None


def paired(values: Sequence[float | None] | None, other: Sequence[float | None] | None) -> np.ndarray | None:
    """The finite per-sample differences ``values - other`` (None: either not known)."""
    if values is None or other is None:
        return None
    differences = np.asarray(
        [v - o for v, o in zip(values, other, strict=True) if v is not None and o is not None], dtype=np.float64
    )
    return differences[np.isfinite(differences)]  # a sample where either is undefined or infinite


def not_measurably_below(
    values: Sequence[float | None] | None, other: Sequence[float | None] | None, confidence: float
) -> bool | None:
    """Whether a row's metric sample by sample (``values``) is not measurably below another's
    on the same samples: over the samples where both are finite (at least 2), the mean paired
    difference is at least minus the one-sided Student-t margin at ``confidence`` (n - 1
    degrees of freedom; 0 or above always is). None where the samples are not known; False
    with fewer than 2 paired samples (nothing shown)."""
    differences = paired(values, other)
    if differences is None:
        return None
    if len(differences) < 2:
        return False
    mean, error = mean_and_error(differences)
    return mean >= -t_quantile(confidence, len(differences) - 1) * error


def shown_above(values: Sequence[float | None] | None, other: Sequence[float | None] | None, confidence: float) -> bool:
    """Whether a row's metric sample by sample (``values``) is shown at least as high as
    another's on the same samples: the one-sided Student-t lower bound of their mean paired
    difference at ``confidence`` is 0 or above (at least 2 paired samples)."""
    differences = paired(values, other)
    if differences is None or len(differences) < 2:
        return False
    mean, error = mean_and_error(differences)
    return mean - t_quantile(confidence, len(differences) - 1) * error >= 0


def shown_behind(
    values: Sequence[float | None] | None, other: Sequence[float | None] | None, confidence: float
) -> bool:
    """Whether a row's metric sample by sample (``values``) is shown below another's on the
    same samples: the one-sided Student-t lower bound of their mean paired difference (the
    other's less these) at ``confidence`` is above 0 (at least 2 paired samples); rows equal
    sample by sample never are."""
    differences = paired(other, values)
    if differences is None or len(differences) < 2:
        return False
    mean, error = mean_and_error(differences)
    return mean - t_quantile(confidence, len(differences) - 1) * error > 0


def speeds_tie(runs: TimedRuns | None, fastest: TimedRuns | None, confidence: float) -> bool | None:
    """Whether a row's speed cannot be told below the fastest's, by their log speedups run by
    run: rows timed in one session are paired round by round (not_measurably_below, accuracy's
    rule), others compared by Welch's one-sided margin at ``confidence``. None: either row's
    runs not known, or fewer than 2 each."""
    if runs is None or fastest is None or len(runs.ratios) < 2 or len(fastest.ratios) < 2:
        return None
    mine, theirs = np.log(np.asarray(runs.ratios, np.float64)), np.log(np.asarray(fastest.ratios, np.float64))
    if runs.session == fastest.session:
        return not_measurably_below(list(mine), list(theirs), confidence)
    parts = [float(x.var(ddof=1)) / len(x) for x in (mine, theirs)]  # each mean's squared standard error
    error2 = sum(parts)
    gap = float(theirs.mean() - mine.mean())
    if error2 == 0:
        return gap <= 0
    freedom = error2**2 / (parts[0] ** 2 / (len(mine) - 1) + parts[1] ** 2 / (len(theirs) - 1))  # Welch-Satterthwaite
    return gap <= t_quantile(confidence, freedom) * math.sqrt(error2)


def kernels_first(row: Mapping[str, Any]) -> tuple[float, float, float, float]:
    """A row's rank on an emulated CPU target: its int8 kernels there (what makes a model fast
    on that CPU, the one speed figure the target gives), then accuracy, the worst part's SQNR
    and this machine's speedup."""
    return (row.get("int8_kernels") or 0, accuracy(row), sqnr_rank(row), speed(row))


def pareto(rows: list[Candidate]) -> None:
    """Mark each row measured for accuracy (compared) on the front of (fastest, most
    accurate): no other is at least as fast and as accurate, and better in one. Accuracy is
    the target's metric, its ties broken by the worst part's SQNR (ranked): where a metric
    scores every row alike (all collapsed, say), the front still holds the most accurate fast
    row, not only the one a timing put first."""
    measured = [r for r in rows if compared(r)]
    for row in rows:
        row["pareto"] = compared(row) and not any(
            other is not row
            and speed(other) >= speed(row)
            and ranked(other) >= ranked(row)
            and (speed(other) > speed(row) or ranked(other) > ranked(row))
            for other in measured
        )


def listing_order(rows: list[Candidate]) -> list[Candidate]:
    """The answer's order of the candidates: the Pareto front first, then the other measured
    rows, then the refused ones; in each, the fastest (by speedup) first, ties by id."""
    return sorted(rows, key=lambda r: (not r["pareto"], r["error"] is not None, -speed(r), r["id"]))


def broken_words(part: dict[str, Any]) -> str:
    """``output0 part 1 (from cls_sigmoid): 0.6 levels of its scale (floor 16)``."""
    return f"{part_words(part)}: {part['why']}"


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
