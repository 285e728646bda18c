"""tune's choice among the rows that meet the target: speeds whose run-by-run spreads overlap
the fastest's are a tie, and the most accurate of the tied rows is chosen. Where none meets
it, a metric difference within its paired per-sample noise is a tie too, and the worst
part's SQNR decides."""

import math
import statistics

import pytest

import graphscan
from graphscan_ort.tune import choice as tune_choice
from tests.helpers import mlp_with_samples


def row(k, speedup, spread, value, sqnr=None, **more):
    return {
        "id": k,
        "speedup": speedup,
        "speedup_spread": spread,
        "metric_value": value,
        "sqnr_db": value if sqnr is None else sqnr,
        "fails": [],
        "error": None,
        **more,
    }


def test_a_speed_within_the_fastests_spread_is_a_tie_and_the_most_accurate_tied_row_is_chosen():
    rows = [
        row(0, 2.00, [1.80, 2.20], 10.0),  # the fastest
        row(1, 1.80, [1.70, 1.85], 15.0),  # its median at the fastest's 25th percentile: tied
        row(2, 1.79, [1.50, 1.95], 20.0),  # its median just below it: slower, however wide its spread
        row(3, 1.95, [1.85, 2.05], 9.0),  # tied, less accurate
    ]
    assert [r["id"] for r in tune_choice.speed_tied(rows)] == [0, 1, 3]
    assert tune_choice.chosen_row(rows, 8.0) == (rows[1], True)
    assert tune_choice.chosen_row(rows, 16.0) == (rows[2], True)  # only 2 meets it
    assert tune_choice.chosen_row(rows, 25.0) == (rows[2], False)  # none does: the most accurate


def test_tied_rows_equal_in_the_metric_are_ordered_by_sqnr_then_speed():
    rows = [
        row(0, 2.0, [1.9, 2.1], 0.9, sqnr=12.0),  # an agreement metric: 0.9 in all three
        row(1, 1.9, [1.8, 2.0], 0.9, sqnr=14.0),
        row(2, 1.95, [1.85, 2.0], 0.9, sqnr=14.0),
    ]
    assert tune_choice.chosen_row(rows, 0.8) == (rows[2], True)


def test_only_rows_that_pass_the_guards_and_meet_the_target_unbroken_can_tie():
    rows = [
        row(0, 2.0, [1.8, 2.2], 10.0),
        row(1, 1.9, [1.7, 2.0], 30.0, fails=["larger"]),
        row(2, 1.9, [1.7, 2.0], 30.0, broken_parts=[{"output": "y", "part": 1, "node": "c", "why": "SQNR 2 dB"}]),
        row(3, 1.9, [1.7, 2.0], 7.0),  # below the target
    ]
    assert tune_choice.chosen_row(rows, 8.0) == (rows[0], True)


def test_rows_without_a_spread_tie_only_at_equal_speedups():
    rows = [row(0, 2.0, None, 10.0), row(1, 1.99, None, 20.0), row(2, 2.0, None, 12.0)]
    assert tune_choice.chosen_row(rows, 5.0) == (rows[2], True)
    # A spread on the slower row only: its median is what counts, below the fastest's speedup.
    rows[1]["speedup_spread"] = [1.9, 2.05]
    assert tune_choice.chosen_row(rows, 5.0) == (rows[2], True)
    # A spread on the fastest: the slower row's median within it ties.
    rows[0]["speedup_spread"] = rows[2]["speedup_spread"] = [1.98, 2.02]
    assert tune_choice.chosen_row(rows, 5.0) == (rows[1], True)


def test_on_an_emulated_target_the_most_int8_kernels_there_are_chosen_not_this_machines_speed():
    """The target's time is not measured: the row with the most int8 kernels on it wins, ties
    broken by the metric, the worst part's SQNR, then this machine's speedup."""
    rows = [
        row(0, 2.0, [1.9, 2.1], 10.0, int8_kernels=51),  # fastest here, few kernels there
        row(1, 1.2, [1.1, 1.3], 9.0, int8_kernels=293),
        row(2, 1.1, [1.0, 1.2], 12.0, int8_kernels=293),  # as many kernels, more accurate
        row(3, 1.5, [1.4, 1.6], 20.0, int8_kernels=300, fails=["larger"]),
        row(4, 1.4, [1.3, 1.5], 5.0, int8_kernels=400),  # below the target
    ]
    assert tune_choice.chosen_row(rows, 8.0, emulated=True) == (rows[2], True)
    assert tune_choice.chosen_row(rows, 8.0) == (rows[0], True)
    assert tune_choice.chosen_row(rows, 30.0, emulated=True) == (rows[2], False)  # none meets it: the most accurate


def paired_z(values, best):
    """The mean per-sample difference in standard errors, by the statistics module."""
    differences = [v - b for v, b in zip(values, best, strict=True)]
    return statistics.fmean(differences) / (statistics.stdev(differences) / math.sqrt(len(differences)))


def test_a_metric_difference_within_its_paired_noise_ties_and_the_worst_parts_sqnr_decides():
    """Not reached: row 0 is the most accurate by the metric (0.87), row 1 (0.76) has the
    higher worst-part SQNR. On 4 samples row 1 loses on one (differences 0, 0, 0, -1: mean
    -0.25, one standard error): tied, row 1 is chosen. On 8 samples losing on four (mean -0.5,
    -2.65 standard errors): measurably worse, row 0 is."""
    rows = [row(0, 1.6, [1.5, 1.7], 0.87, sqnr=10.0), row(1, 1.6, [1.5, 1.7], 0.76, sqnr=12.0)]
    one_lost = {0: [1.0, 1.0, 1.0, 1.0], 1: [1.0, 1.0, 1.0, 0.0]}
    assert paired_z(one_lost[1], one_lost[0]) == pytest.approx(-1.0)
    assert tune_choice.chosen_row(rows, 2.0, by_sample=one_lost) == (rows[1], False)
    assert tune_choice.start_row(rows, one_lost) is rows[1]
    four_lost = {0: [1.0] * 8, 1: [1.0] * 4 + [0.0] * 4}
    assert paired_z(four_lost[1], four_lost[0]) == pytest.approx(-2.6458, abs=1e-4)
    assert tune_choice.chosen_row(rows, 2.0, by_sample=four_lost) == (rows[0], False)
    assert tune_choice.start_row(rows, four_lost) is rows[0]
    assert tune_choice.chosen_row(rows, 2.0) == (rows[0], False)  # no samples known: the pooled metric alone
    assert tune_choice.chosen_row(rows, 0.8, by_sample=one_lost) == (rows[0], True)  # met: speed, then metric


@pytest.mark.parametrize(
    ("values", "best", "tied"),
    [
        pytest.param([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], True, id="equal-on-every-sample"),
        pytest.param([0.5, 0.5, 0.5], [1.0, 1.0, 1.0], False, id="the-same-loss-on-every-sample"),
        pytest.param([1.0, 0.9, 0.8], [0.9, 0.9, 0.9], True, id="a-mean-at-zero"),
        pytest.param([0.0, None, 1.0], [1.0, 1.0, None], False, id="one-paired-sample-is-too-few"),
        pytest.param([0.0, None, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], True, id="undefined-samples-left-out"),
        pytest.param([float("inf"), 9.0, 8.0], [10.0, 10.0, 10.0], False, id="infinite-samples-left-out"),
        pytest.param(None, [1.0, 1.0], False, id="not-known"),
    ],
)
def test_within_noise_is_a_paired_comparison_of_the_defined_samples(values, best, tied):
    assert tune_choice.within_noise(values, best) is tied


def test_the_standard_error_is_the_sample_standard_deviation_over_the_root_of_the_count():
    """Best 3, 3, 3 and the row 3, 2, 1: differences 0, -1, -2, mean -1. The sample variance
    (over n - 1 = 2) is (1 + 0 + 1) / 2 = 1, a standard error of 1 / sqrt(3) = 0.577, so -1 lies
    within 2 of them (-1.155): tied. Over n = 3 the variance would be 2/3, the standard error
    0.471 and -1 beyond 2 of them (-0.943): not tied. Scaled, the same differences tie alike."""
    assert paired_z([3.0, 2.0, 1.0], [3.0, 3.0, 3.0]) == pytest.approx(-math.sqrt(3))
    assert tune_choice.within_noise([3.0, 2.0, 1.0], [3.0, 3.0, 3.0]) is True
    assert tune_choice.within_noise([0.30, 0.20, 0.10], [0.30, 0.30, 0.30]) is True
    # Differences -1, -3, -3: mean -7/3, sample variance 4/3, standard error 2/3: beyond 2 of them.
    assert tune_choice.within_noise([2.0, 0.0, 0.0], [3.0, 3.0, 3.0]) is False


def test_on_an_emulated_target_the_kernels_decide_then_the_metric_the_worst_part_and_speed():
    """kernels_first, level by level, on rows that all meet the target and pass the guards:
    the most int8 kernels on the target (none known counts as 0), then the metric, then the
    worst part's SQNR, then this machine's speedup; never speed first."""
    rows = [
        row(0, 3.0, [2.9, 3.1], 30.0, int8_kernels=None),  # fastest and most accurate: kernels unknown
        row(1, 1.0, [0.9, 1.1], 20.0, sqnr=20.0, int8_kernels=40),
        row(2, 0.9, [0.8, 1.0], 20.0, sqnr=25.0, int8_kernels=40),
        row(3, 1.1, [1.0, 1.2], 20.0, sqnr=25.0, int8_kernels=40),
        row(4, 2.0, [1.9, 2.1], 25.0, int8_kernels=40),
    ]
    assert tune_choice.chosen_row(rows, 10.0, emulated=True) == (rows[4], True)  # 40 kernels, the metric
    assert tune_choice.chosen_row(rows[:4], 10.0, emulated=True) == (rows[3], True)  # then sqnr, then speed
    assert tune_choice.chosen_row(rows[:3], 10.0, emulated=True) == (rows[2], True)  # sqnr before speed
    assert tune_choice.chosen_row([rows[0], rows[1]], 10.0, emulated=True) == (rows[1], True)  # None: 0 kernels
    assert tune_choice.chosen_row(rows, 10.0) == (rows[0], True)  # natively: the fastest


def test_tune_breaks_a_metrics_noise_by_the_worst_parts_sqnr(tmp_path, monkeypatch):
    """Wired through tune: with every difference taken for noise (NOISE_SE huge), a target out
    of reach writes the passing row of the highest worst-part SQNR, not the best by a metric
    that here rises with the error (the mean absolute difference from float)."""
    metric = tmp_path / "error.py"
    metric.write_text(
        "import numpy as np\n"
        "def error(reference, candidate):\n"
        "    return float(np.mean([np.abs(c['y'] - r['y']).mean() for r, c in zip(reference, candidate)]))\n"
    )
    files = mlp_with_samples(tmp_path, layers=4, width=32, count=5, rows=8, seed=3)
    monkeypatch.setattr(tune_choice, "NOISE_SE", 1e9)
    answer = graphscan.tune(
        str(tmp_path / "mlp.onnx"), calibrate=files[:2], inputs=files[2:], out=str(tmp_path / "out"),
        metric=f"{metric}:error", target=1e9, runs=1, min_speedup=0, max_trials=1,
    )  # fmt: skip
    passing = [c for c in answer["candidates"] if c["error"] is None and not c["fails"]]
    chosen = next(c for c in passing if c["id"] == answer["chosen"])
    assert answer["reached"] is False
    assert chosen["sqnr_db"] == max(c["sqnr_db"] for c in passing)
    assert chosen["metric_value"] < max(c["metric_value"] for c in passing)  # the pooled metric alone differs


def test_rows_a_metric_scores_alike_stay_on_the_front_by_their_worst_parts_sqnr():
    """Every row 0.0 by a score-aware metric (collapsed class scores): the fastest by a timing's
    noise (0, 0.5 dB) and a hair slower one at 1.3 dB are both on the front, so the structural
    seeds go on both; a slower row no more accurate by either is not."""
    rows = [
        row(0, 1.597, [1.57, 1.60], 0.0, sqnr=0.5),
        row(1, 1.596, [1.58, 1.60], 0.0, sqnr=1.3),
        row(2, 1.590, [1.58, 1.60], 0.0, sqnr=1.3),
    ]
    tune_choice.pareto(rows)
    assert [r["pareto"] for r in rows] == [True, True, False]
