"""tune's policy (choice.py): a row meets the target when its figures show it at the confidence;
of those, speeds their runs cannot tell apart are a tie and the most accurate tied row is chosen.
Where none meets it, a metric difference within its paired per-sample noise is a tie too, and
the worst part's SQNR decides. Expectations are derived by hand, with Student's t from tables
(t(0.95, 3) = 2.3534, t(0.95, 7) = 1.8946) or in closed form (2 degrees of freedom)."""

import math
import statistics

import numpy as np
import pytest

import graphscan
from graphscan_ort.tune import choice as tune_choice
from graphscan_ort.tune.choice import Policy, TimedRuns
from tests.helpers import mlp_with_samples

T_95_3 = 2.353363


def row(k, speedup, value, sqnr=None, bound=None, **more):
    """A measured row: its speedup, metric and worst-part SQNR; ``bound``: its metric's lower
    bound (default: the value itself, a row whose figures show it exactly)."""
    return {
        "id": k,
        "speedup": speedup,
        "metric_value": value,
        "metric_bound": value if bound is None else bound,
        "sqnr_db": value if sqnr is None else sqnr,
        "fails": [],
        "error": None,
        **more,
    }


def runs(session, *ratios):
    return TimedRuns(session, tuple(ratios))


def test_a_row_meets_an_absolute_target_only_where_its_bound_does():
    """Row 0 is the most accurate by its value (30) but its bound (18) is below the target (20):
    not shown. Row 1's bound (21) is: met, chosen. Above every bound: none meets it, the most
    accurate passing row is written unmet."""
    rows = [row(0, 2.0, 30.0, bound=18.0), row(1, 1.5, 25.0, bound=21.0), row(2, 3.0, 15.0)]
    policy = Policy(20.0)
    assert policy.chosen(rows) == (rows[1], True)
    assert Policy(22.0).chosen(rows) == (rows[0], False)
    assert Policy(None).chosen(rows) == (rows[0], False)  # an undefined target is never met


def test_speeds_timed_in_one_session_are_paired_round_by_round():
    """The fastest's ratios 2.0, 2.2, 1.8, 2.0 and another's 1.9, 2.1, 1.7, 1.9, round by round:
    the log differences are about -0.051, -0.047, -0.057, -0.051, a mean far below -t(0.95, 3)
    times their tiny standard error: told apart, not tied. In two sessions of their own, the
    spread of each row's runs (Welch) hides the same gap: tied."""
    fastest, other = [2.0, 2.2, 1.8, 2.0], [1.9, 2.1, 1.7, 1.9]
    differences = [math.log(o) - math.log(f) for o, f in zip(other, fastest, strict=True)]
    error = statistics.stdev(differences) / math.sqrt(4)
    assert statistics.fmean(differences) < -T_95_3 * error
    assert tune_choice.speeds_tie(runs(1, *other), runs(1, *fastest), 0.95) is False
    mine, theirs = np.log(other), np.log(fastest)
    welch = math.sqrt(mine.var(ddof=1) / 4 + theirs.var(ddof=1) / 4)
    assert theirs.mean() - mine.mean() < 1.9 * welch  # within the margin at any df >= 3 (t < 2.35)
    assert tune_choice.speeds_tie(runs(1, *other), runs(2, *fastest), 0.95) is True
    assert tune_choice.speeds_tie(None, runs(2, *fastest), 0.95) is None  # not timed: not known


def test_the_most_accurate_row_speed_tied_with_the_fastest_is_chosen():
    rows = [
        row(0, 2.00, 10.0, runs=None),
        row(1, 1.95, 15.0),
        row(2, 1.50, 20.0),
    ]
    timed = {0: runs(0, 2.0, 2.1, 1.9, 2.0), 1: runs(1, 1.95, 2.05, 1.9, 1.95), 2: runs(2, 1.5, 1.52, 1.49, 1.5)}
    policy = Policy(8.0, runs=timed)
    assert [r["id"] for r in policy.speed_tied(rows)] == [0, 1]
    assert policy.chosen(rows) == (rows[1], True)
    assert Policy(8.0).chosen(rows) == (rows[0], True)  # no runs known: the fastest's very speedup alone


def test_rows_timed_once_tie_in_speed_only_at_the_fastests_very_speedup():
    """--runs 1 leaves each row one ratio, too few to pair: speeds tie only where they are equal.
    Rows 0 and 1 are both at 2.0 (row 0, more accurate, is the fastest), row 2 at 1.99 is not
    tied. Row 1's metric lies within its paired noise of row 0's (differences 1, -1, -3: mean
    -1, standard error 2 / sqrt(3), margin -t(0.95, 2) * 1.155 = -3.37): the worst part's SQNR
    decides between the two tied rows, row 1's 30 dB."""
    rows = [row(0, 2.0, 20.0, sqnr=10.0), row(1, 2.0, 19.0, sqnr=30.0), row(2, 1.99, 19.5, sqnr=40.0)]
    once = {k: runs(k, r["speedup"]) for k, r in enumerate(rows)}
    by_sample = {0: [20.0, 18.0, 22.0], 1: [21.0, 17.0, 19.0], 2: [19.5, 19.5, 19.5]}
    assert -t2(0.95) * 2 / math.sqrt(3) < -1
    policy = Policy(8.0, runs=once, by_sample=by_sample)
    assert [r["id"] for r in policy.speed_tied(rows)] == [0, 1]
    assert policy.chosen(rows) == (rows[1], True)


def test_only_rows_that_pass_the_guards_and_meet_the_target_unbroken_can_be_chosen_met():
    rows = [
        row(0, 2.0, 10.0),
        row(1, 2.5, 30.0, fails=["larger"]),
        row(2, 2.5, 30.0, broken_parts=[{"output": "y", "part": 1, "node": "c", "why": "SQNR 2 dB"}]),
        row(3, 2.5, 7.0),  # below the target
    ]
    assert Policy(8.0).chosen(rows) == (rows[0], True)


def test_on_an_emulated_target_the_kernels_decide_then_the_metric_the_worst_part_and_speed():
    """kernels_first, level by level, on rows that all meet the target and pass the guards:
    the most int8 kernels on the target (none known counts as 0), then the metric, then the
    worst part's SQNR, then this machine's speedup; never speed first."""
    rows = [
        row(0, 3.0, 30.0, int8_kernels=None),  # fastest and most accurate: kernels unknown
        row(1, 1.0, 20.0, sqnr=20.0, int8_kernels=40),
        row(2, 0.9, 20.0, sqnr=25.0, int8_kernels=40),
        row(3, 1.1, 20.0, sqnr=25.0, int8_kernels=40),
        row(4, 2.0, 25.0, int8_kernels=40),
    ]
    emulated = Policy(10.0, emulated=True)
    assert emulated.chosen(rows) == (rows[4], True)  # 40 kernels, the metric
    assert emulated.chosen(rows[:4]) == (rows[3], True)  # then sqnr, then speed
    assert emulated.chosen(rows[:3]) == (rows[2], True)  # sqnr before speed
    assert emulated.chosen([rows[0], rows[1]]) == (rows[1], True)  # None: 0 kernels
    assert Policy(10.0).chosen(rows) == (rows[0], True)  # natively: the fastest
    assert Policy(30.5, emulated=True).chosen(rows) == (rows[0], False)  # none meets it: the most accurate


def paired_z(values, best):
    """The mean per-sample difference in standard errors, by the statistics module."""
    differences = [v - b for v, b in zip(values, best, strict=True)]
    return statistics.fmean(differences) / (statistics.stdev(differences) / math.sqrt(len(differences)))


def test_a_metric_difference_within_its_paired_noise_ties_and_the_worst_parts_sqnr_decides():
    """Not reached: row 0 is the most accurate by the metric (0.87), row 1 (0.76) has the
    higher worst-part SQNR. On 4 samples row 1 loses on one (differences 0, 0, 0, -1: mean
    -0.25, one standard error, within t(0.95, 3) = 2.35 of them): tied, row 1 is chosen. On 8
    samples losing on four (-2.65 standard errors, beyond t(0.95, 7) = 1.89): row 0 is."""
    rows = [row(0, 1.6, 0.87, sqnr=10.0), row(1, 1.6, 0.76, sqnr=12.0)]
    one_lost = {0: [1.0, 1.0, 1.0, 1.0], 1: [1.0, 1.0, 1.0, 0.0]}
    assert paired_z(one_lost[1], one_lost[0]) == pytest.approx(-1.0)
    assert Policy(2.0, by_sample=one_lost).chosen(rows) == (rows[1], False)
    assert Policy(2.0, by_sample=one_lost).start(rows) is rows[1]
    four_lost = {0: [1.0] * 8, 1: [1.0] * 4 + [0.0] * 4}
    assert paired_z(four_lost[1], four_lost[0]) == pytest.approx(-2.6458, abs=1e-4)
    assert Policy(2.0, by_sample=four_lost).chosen(rows) == (rows[0], False)
    assert Policy(2.0, by_sample=four_lost).start(rows) is rows[0]
    assert Policy(2.0).chosen(rows) == (rows[0], False)  # no samples known: the pooled metric alone


@pytest.mark.parametrize(
    ("values", "best", "tied"),
    [
        pytest.param([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], True, id="equal-on-every-sample"),
        pytest.param([0.5, 0.5, 0.5], [1.0, 1.0, 1.0], False, id="the-same-loss-on-every-sample"),
        pytest.param([1.0, 0.9, 0.8], [0.9, 0.9, 0.9], True, id="a-mean-at-zero"),
        pytest.param([0.0, None, 1.0], [1.0, 1.0, None], False, id="one-paired-sample-is-too-few"),
        pytest.param([0.0, None, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], True, id="undefined-samples-left-out"),
        # Two finite differences, -1 and -2: a standard error of 0.5, and t(0.95, 1) = 6.31: tied.
        pytest.param([float("inf"), 9.0, 8.0], [10.0, 10.0, 10.0], True, id="infinite-samples-left-out"),
        pytest.param([float("inf"), 9.0, 8.0, 9.0], [10.0, 10.0, 10.0, 10.0], False, id="three-losses-told"),
        pytest.param(None, [1.0, 1.0], None, id="not-known"),
    ],
)
def test_not_measurably_below_is_a_paired_comparison_of_the_defined_samples(values, best, tied):
    assert tune_choice.not_measurably_below(values, best, 0.95) is tied


def test_the_standard_error_is_the_sample_standard_deviation_over_the_root_of_the_count():
    """Best 3, 3, 3 and the row 3, 2, 1: differences 0, -1, -2, mean -1. The sample variance
    (over n - 1 = 2) is 1, a standard error of 1 / sqrt(3) = 0.577; with t(0.95, 2) = 2.92,
    -1 lies within -1.686: tied. Over n = 3 the standard error would be 0.471, and at the
    normal's 1.645 the margin -0.775 would not reach -1: not tied. Differences -1, -3, -3
    (mean -7/3, standard error 2/3, margin -1.95): beyond, not tied."""
    assert paired_z([3.0, 2.0, 1.0], [3.0, 3.0, 3.0]) == pytest.approx(-math.sqrt(3))
    assert tune_choice.not_measurably_below([3.0, 2.0, 1.0], [3.0, 3.0, 3.0], 0.95) is True
    assert tune_choice.not_measurably_below([0.30, 0.20, 0.10], [0.30, 0.30, 0.30], 0.95) is True
    assert tune_choice.not_measurably_below([2.0, 0.0, 0.0], [3.0, 3.0, 3.0], 0.95) is False
    # Differences 0.15, -0.5, -1, -1: mean -0.5875, sample standard deviation 0.5452 (over
    # n - 1), standard error 0.2726; t(0.95, 3) = 2.3534 gives a margin of 0.6416: tied. Over
    # n the deviation would be 0.4722 and the margin 0.5556, short of 0.5875: not tied.
    assert tune_choice.not_measurably_below([0.15, -0.5, -1.0, -1.0], [0.0] * 4, 0.95) is True


def t2(p):
    """Student's t quantile at 2 degrees of freedom, in closed form: F(t) = 1/2 + t / (2 sqrt(2 + t^2))."""
    u = 2 * p - 1
    return u * math.sqrt(2 / (1 - u * u))


def test_settle_bounds_every_row_below_its_value_corrected_for_the_rows_compared():
    """Three measured rows, 0.95 shared out: each bound at 1 - 0.05 / 3. Row 0's SQNR sample by
    sample 10, 12, 14 (sd 2): its bound is its value less t(0.98333, 2) times 2 / sqrt(3); row
    1 says what it rests on (0.9 of 20 events): Wilson's bound; row 2 did not vary: no bound;
    a refused row has none."""
    rows = [row(0, 1.0, 12.5), row(1, 1.0, 0.9, metric_events=20), row(2, 1.0, 11.0)]
    rows.append({**row(3, None, None), "error": "refused"})
    by_sample = {0: [10.0, 12.0, 14.0], 1: [0.9] * 3, 2: [11.0] * 3, 3: None}
    Policy(100.0, by_sample=by_sample).settle(rows)
    assert t2(0.95) == pytest.approx(2.919986, abs=1e-6)  # the table's t(0.95, 2)
    assert rows[0]["metric_bound"] == pytest.approx(12.5 - t2(1 - 0.05 / 3) * 2 / math.sqrt(3))
    z = statistics.NormalDist().inv_cdf(1 - 0.05 / 3)
    centre, half = 0.9 + z * z / 40, z * math.sqrt(0.9 * 0.1 / 20 + z * z / 1600)
    assert rows[1]["metric_bound"] == pytest.approx((centre - half) / (1 + z * z / 20))
    assert rows[2]["metric_bound"] is None and rows[3]["metric_bound"] is None


def test_a_target_from_onnxruntimes_defaults_is_met_by_rows_shown_at_least_as_accurate_as_their_row():
    """The defaults' row (0) meets its own target; row 1 beats it on every sample by 1, 2, 1, 2
    dB (mean 1.5, sd 0.577: its bound 1.5 - t * 0.289 >= 0 even at 1 - 0.05/3): shown; row 2 is
    ahead on average but not on every sample (differences 3, -2, 3, -2): not shown."""
    rows = [row(0, 1.0, 20.0), row(1, 2.0, 21.5), row(2, 3.0, 20.5)]
    by_sample = {0: [20.0] * 4, 1: [21.0, 22.0, 21.0, 22.0], 2: [23.0, 18.0, 23.0, 18.0]}
    policy = Policy(20.0, "defaults", by_sample=by_sample, reference=rows[0])
    chosen, met = policy.settle(rows)
    assert [policy.shown(r) for r in rows] == [True, True, False]
    assert (chosen, met) == (rows[1], True)
    assert policy.method(rows[1]) == "paired_student_t" and policy.method(rows[0]) == "defaults_row"


def test_only_samples_lack_when_a_row_meets_the_target_by_its_value_but_none_by_its_bound():
    """Row 0 reaches 25 against 20 by its value, its bound 18 below: only samples lack, the
    search stops. Shown by a bound (row 1's 21), met: nothing lacks. A row that breaks a guard
    or a part is no evidence; below the target by value, the search goes on."""
    policy = Policy(20.0)
    assert policy.only_samples_lack([row(0, 2.0, 25.0, bound=18.0), row(2, 3.0, 15.0)])
    assert not policy.only_samples_lack([row(0, 2.0, 25.0, bound=18.0), row(1, 1.5, 25.0, bound=21.0)])
    assert not policy.only_samples_lack([row(0, 2.0, 25.0, bound=18.0) | {"fails": ["slower"]}])
    assert not policy.only_samples_lack([row(0, 2.0, 25.0, bound=18.0, broken_parts=[{"part": 0}])])
    assert not policy.only_samples_lack([row(0, 2.0, 19.9, bound=18.0)])
    assert not Policy(None).only_samples_lack([row(0, 2.0, 25.0, bound=18.0)])


def test_against_onnxruntimes_defaults_a_mean_paired_difference_of_0_or_more_meets_by_value():
    """Row 2 is ahead of the defaults' row on average (differences 3, -2, 3, -2: mean 0.5) but
    not shown: it meets by value, only samples lack. Row 3 is behind on average (-0.5): not."""
    rows = [row(0, 1.0, 20.0, fails=["slower"]), row(2, 3.0, 20.5), row(3, 3.0, 19.5)]
    by_sample = {0: [20.0] * 4, 2: [23.0, 18.0, 23.0, 18.0], 3: [17.0, 22.0, 17.0, 22.0]}
    policy = Policy(20.0, "defaults", by_sample=by_sample, reference=rows[0])
    assert [policy.measured_meeting(r) for r in rows] == [False, True, False]  # 0 breaks a guard
    assert policy.only_samples_lack(rows)
    assert not policy.only_samples_lack([rows[0], rows[2]])  # without row 2, none meets by value


def claims(true_mean, spread, samples, rows, target, seeds, events=False):
    """How often the policy claims ``target`` met over ``seeds`` runs of ``rows`` rows whose
    true metric is ``true_mean``: each row's metric sample by sample drawn around it (or, with
    ``events``, ``samples`` Bernoulli events of that probability: value and events alone)."""
    claimed = 0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        found, by_sample = [], {}
        for k in range(rows):
            if events:
                hits = int(rng.binomial(samples, true_mean))
                found.append(row(k, 1.0, hits / samples, metric_events=samples))
                by_sample[k] = None
            else:
                values = rng.normal(true_mean, spread, samples)
                found.append(row(k, 1.0, float(values.mean())))
                by_sample[k] = [float(v) for v in values]
        claimed += Policy(target, by_sample=by_sample).settle(found)[1]
    return claimed / seeds


@pytest.mark.parametrize(("events"), [False, True], ids=["per-sample-values", "events"])
def test_rows_below_the_target_are_claimed_met_no_more_often_than_the_confidence_allows(events):
    """30 rows, each truly at 0.90 against a target of 0.92 (events: 0.92 against 0.95), on 16
    noisy samples: the best of them often measures above the target, yet the policy claims it
    met at most 5% of the time (plus three standard errors of the simulation). Rows truly well
    above the target are claimed met: the rule is not a refusal."""
    mean, target = (0.92, 0.95) if events else (0.90, 0.92)
    rate = claims(mean, 0.05, 16, 30, target, 300, events)
    assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 300)
    assert claims(0.995 if events else 0.99, 0.02, 200, 5, target, 20, events) >= 0.9


def test_tune_breaks_a_metrics_noise_by_the_worst_parts_sqnr(tmp_path, monkeypatch):
    """Wired through tune: with every difference taken for noise (Student's t made huge), a
    target out of reach writes the passing row of the highest worst-part SQNR, not the best by
    a metric that here rises with the error (the mean absolute difference from float)."""
    metric = tmp_path / "error.py"
    metric.write_text(
        "import numpy as np\n"
        "def error(reference, candidate):\n"
        "    return float(np.mean([np.abs(c['y'] - r['y']).mean() for r, c in zip(reference, candidate)]))\n"
    )
    files = mlp_with_samples(tmp_path, layers=4, width=32, count=5, rows=8, seed=3)
    monkeypatch.setattr(tune_choice, "t_quantile", lambda p, df: 1e9)
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
    rows = [row(0, 1.597, 0.0, sqnr=0.5), row(1, 1.596, 0.0, sqnr=1.3), row(2, 1.590, 0.0, sqnr=1.3)]
    tune_choice.pareto(rows)
    assert [r["pareto"] for r in rows] == [True, True, False]
