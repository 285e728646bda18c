"""tune's choice among the rows that meet the target: speeds whose run-by-run spreads overlap
the fastest's are a tie, and the most accurate of the tied rows is chosen."""

from graphscan_ort.tune import choice as tune_choice


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
