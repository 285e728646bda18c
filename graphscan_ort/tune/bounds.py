"""How sure a figure is: one-sided lower bounds of a metric at a confidence, and how many
samples would decide.

A row's metric is measured on a few samples, and the row tune writes is the best of many,
so its point value is biased upward. tune claims a target reached only when a lower bound
of the metric meets it (docs/SPEC.md, "tune", Verdict):

- a metric that says what its value rests on, ``(value, events)`` (a user's metric, or a
  proportion of events: the share of sequences decoded alike): the Wilson score bound of a
  proportion ``value`` in [0, 1] out of ``events``;
- otherwise its values sample by sample: the value less the one-sided Student-t margin of
  their mean (``t * sd / sqrt(n)``, n - 1 degrees of freedom): the value's own standard
  error read from how it varies from sample to sample.

Both need something to estimate the spread from: at least 2 samples that vary, or at least
one event. Where there is not, there is no bound, and tune claims nothing.

Student's t is computed here from the regularized incomplete beta function (a continued
fraction, as in Numerical Recipes' ``betacf``): no statistics package is needed for one
quantile.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable, Sequence

DEFAULT_CONFIDENCE = 0.95  # one-sided: exit 0 is wrong about a row at most once in 20
MAX_SAMPLES = 100_000  # how many samples samples_to_decide looks up to


@dataclasses.dataclass(frozen=True)
class Bound:
    """A one-sided lower bound of a metric: ``lower`` at ``confidence``, by ``method``
    ("wilson" on ``count`` events, "student_t" on ``count`` samples)."""

    lower: float
    method: str
    count: int
    confidence: float


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * beta_fraction(x, a, b) / a
    return 1.0 - front * beta_fraction(1.0 - x, b, a) / b


def beta_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        even = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        odd = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        for numerator in (even, odd):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return result


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (0 < p < 1), by bisection."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"a quantile needs 0 < p < 1, not {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if t_cdf(middle, df) < p:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * max(1.0, high):
            break
    return (low + high) / 2.0


def wilson_lower(value: float, events: int, confidence: float) -> float | None:
    """The one-sided Wilson score lower bound of a proportion ``value`` out of ``events``
    (None without an event or with a value outside [0, 1])."""
    if events < 1 or not 0.0 <= value <= 1.0:
        return None
    z = statistics.NormalDist().inv_cdf(confidence)
    z2n = z * z / events
    centre = value + z2n / 2.0
    half = z * math.sqrt(value * (1.0 - value) / events + z2n / (4.0 * events))
    return (centre - half) / (1.0 + z2n)


def student_margin(values: Sequence[float], confidence: float) -> float | None:
    """The one-sided Student-t margin of the mean of ``values``: ``t * sd / sqrt(n)`` (None
    with fewer than 2 values, or values that do not vary: no spread to read)."""
    n = len(values)
    if n < 2:
        return None
    sd = statistics.stdev(values)
    if not sd > 0 or not math.isfinite(sd):
        return None
    return t_quantile(confidence, n - 1) * sd / math.sqrt(n)


def metric_bound(
    value: float | None, by_sample: Sequence[float | None] | None, events: int | None, confidence: float
) -> Bound | None:
    """The lower bound of a row's metric ``value`` at ``confidence``: Wilson's on its
    ``events`` when it says what it rests on, else the Student-t margin of its finite
    values sample by sample (module docstring); None when neither can be had."""
    if value is None or not math.isfinite(value):
        return None
    if events is not None:
        lower = wilson_lower(value, events, confidence)
        return None if lower is None else Bound(lower, "wilson", events, confidence)
    finite = [v for v in by_sample or [] if v is not None and math.isfinite(v)]
    margin = student_margin(finite, confidence)
    return None if margin is None else Bound(value - margin, "student_t", len(finite), confidence)


def samples_to_decide(
    value: float, by_sample: Sequence[float | None] | None, events: int | None, target: float, confidence: float
) -> int | None:
    """How many samples (or events) would make the bound of a row measuring ``value`` (with
    the spread it showed) meet ``target``: None when none would (the value itself is short
    of the target), or the spread cannot be read."""
    if not math.isfinite(value) or value < target:
        return None
    if events is not None:
        found = next_count(lambda n: (wilson_lower(value, n, confidence) or -math.inf) >= target)
        return found
    finite = [v for v in by_sample or [] if v is not None and math.isfinite(v)]
    if len(finite) < 2 or not statistics.stdev(finite) > 0:
        return None
    sd = statistics.stdev(finite)
    return next_count(lambda n: value - t_quantile(confidence, n - 1) * sd / math.sqrt(n) >= target)


def next_count(enough: Callable[[int], bool]) -> int | None:
    """The smallest count from 2 to MAX_SAMPLES for which ``enough`` holds (None: none),
    by doubling then bisection (``enough`` holds from some count on)."""
    low, high = 1, 2
    while not enough(high):
        if high >= MAX_SAMPLES:
            return None
        low, high = high, min(high * 2, MAX_SAMPLES)
    while high - low > 1:
        middle = (low + high) // 2
        if enough(middle):
            high = middle
        else:
            low = middle
    return high


def corrected(confidence: float, compared: int) -> float:
    """The confidence each of ``compared`` rows is bounded at so that the best of them is
    wrong at most ``1 - confidence`` of the time (Bonferroni: the error shared out)."""
    return 1.0 - (1.0 - confidence) / max(compared, 1)
