"""The built-in metrics of check and tune, against values worked out by hand on tiny arrays.

Each expectation is derived in the comment beside it from docs/SPEC.md's definition,
never computed with graphscan's own code.
"""

import math
import os
import sys

import numpy as np
import pytest

import graphscan
from graphscan_ort.shared import agreement


def outputs(*samples):
    """One ``{"y": array}`` per sample."""
    return [{"y": np.asarray(s, dtype=np.float32)} for s in samples]


def test_top1_counts_positions_and_ties_go_to_the_first_maximum():
    reference = outputs([[0.1, 0.9], [0.5, 0.5], [0.7, 0.3]])
    # argmax per row: 1, 0 (a tie: the first), 0; candidate: 1, 0 (tie again), 1 -> 2 of 3
    candidate = outputs([[0.2, 0.8], [0.4, 0.4], [0.1, 0.9]])
    assert agreement.top1(reference, candidate) == pytest.approx(2 / 3)


def test_top1_pools_samples_and_leaves_out_float_nans():
    reference = outputs([[1.0, 0.0]], [[np.nan, 1.0]])  # the NaN row is no prediction
    candidate = outputs([[0.0, 1.0]], [[0.0, 1.0]])
    assert agreement.top1(reference, candidate) == 0.0  # 0 of the 1 position left
    assert agreement.top1(outputs([[np.nan, 1.0]]), outputs([[0.0, 1.0]])) is None  # none left
    # A NaN in the candidate where the float model has a prediction disagrees.
    assert agreement.top1(outputs([[0.0, 1.0]]), outputs([[np.nan, 1.0]])) == 0.0


def test_iou_of_thresholded_maps_and_of_two_empty_masks():
    reference = outputs([0.9, 0.8, 0.1, 0.0])  # > 0.5: positions 0, 1
    candidate = outputs([0.7, 0.2, 0.6, 0.0])  # > 0.5: positions 0, 2
    assert agreement.iou(reference, candidate, 0.5) == pytest.approx(1 / 3)  # {0} / {0, 1, 2}
    assert agreement.iou(outputs([0.1, 0.2]), outputs([0.0, 0.3]), 0.5) == 1.0  # both empty: agree
    assert agreement.iou(outputs([0.9, np.nan]), outputs([0.9, 0.9]), 0.5) == 0.5  # NaN is never above


def test_ctc_decodes_greedily_merging_repeats_and_dropping_the_blank():
    def onehot(classes, width=4):
        return np.eye(width, dtype=np.float32)[classes]

    # [1, 1, 0, 1, 2] decodes to (1, 1, 2): the blank 0 separates the two 1s.
    first = onehot([1, 1, 0, 1, 2])
    same = onehot([1, 0, 1, 1, 2])  # (1, 1, 2) too
    other = onehot([1, 1, 1, 2, 2])  # (1, 2)
    reference = [{"y": np.stack([first, first])}]  # one sample, two sequences
    assert agreement.ctc(reference, [{"y": np.stack([same, other])}], blank=0) == 0.5
    assert agreement.greedy_ctc(first[None], blank=3) == [(1, 0, 1, 2)]  # another blank keeps 0
    assert agreement.greedy_ctc(first[None], blank=0) == [(1, 1, 2)]
    # Where the blanks fall is no part of the text: [0, 1, 1] and [1, 1, 0] both read (1,).
    assert agreement.ctc([{"y": onehot([0, 1, 1])[None]}], [{"y": onehot([1, 1, 0])[None]}], blank=0) == 1.0


def test_cosine_of_everything_flattened():
    reference = outputs([1.0, 0.0], [0.0, 1.0])
    candidate = outputs([1.0, 1.0], [0.0, 0.0])
    # f = (1, 0, 0, 1), q = (1, 1, 0, 0): f.q = 1, |f| |q| = 2
    assert agreement.cosine(reference, candidate) == pytest.approx(0.5)
    assert agreement.cosine(outputs([0.0]), outputs([1.0])) is None  # no signal
    assert agreement.cosine(outputs([np.inf]), outputs([1.0])) is None


def test_sqnr_is_the_output_sqnr_and_equal_outputs_are_infinitely_good():
    reference, candidate = outputs([3.0, 4.0]), outputs([3.0, 3.0])
    assert agreement.sqnr(reference, candidate) == pytest.approx(10 * math.log10(25 / 1))  # f^2 = 25, noise 1
    assert agreement.sqnr(reference, reference) == math.inf  # an exact candidate is the best, never the worst
    assert agreement.sqnr(outputs([0.0]), outputs([0.0])) is None  # no signal: undefined
    assert agreement.sqnr(outputs([np.nan]), outputs([1.0])) is None


@pytest.mark.parametrize(
    ("name", "array", "needs"),
    [
        pytest.param("top1", np.float32(1.0), "1 or more", id="top1-scalar"),
        pytest.param("ctc", np.zeros(3, np.float32), "2 or more", id="ctc-vector"),
        pytest.param("iou", np.array(["a"]), "not numbers", id="iou-strings"),
    ],
)
def test_a_metric_that_does_not_fit_an_output_names_it(name, array, needs):
    chosen = agreement.metric(name)
    with pytest.raises(graphscan.GraphscanError) as raised:
        chosen.value([{"prob": array}], [{"prob": array}])
    assert raised.value.exit_code == graphscan.EXIT_USAGE
    assert "'prob'" in str(raised.value) and needs in str(raised.value)


def write_metric(tmp_path, body):
    path = tmp_path / "my_metric.py"
    path.write_text(body)
    return str(path)


def test_a_user_function_gets_every_sample_in_order(tmp_path):
    path = write_metric(
        tmp_path,
        "def agree(reference, candidate):\n"
        "    assert [sorted(r) for r in reference] == [['y'], ['y']]\n"
        "    return float(sum(abs(r['y'] - c['y']).sum() for r, c in zip(reference, candidate)))\n",
    )
    chosen = agreement.metric(f"{path}:agree")
    assert chosen.value(outputs([1.0], [2.0]), outputs([1.5], [1.0])) == pytest.approx(1.5)


def test_a_metric_file_rewritten_at_the_same_size_and_second_is_read_anew(tmp_path, monkeypatch):
    # Python's bytecode cache tells a source file only by its size and its mtime in whole
    # seconds: a test that rewrites its metric in place must still get the new function.
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = write_metric(tmp_path, "def f(r, c):\n    return 0.75\n")
    stamp = os.stat(path).st_mtime_ns
    assert agreement.metric(f"{path}:f").value(outputs([1.0]), outputs([1.0])) == 0.75
    write_metric(tmp_path, "def f(r, c):\n    return 0.25\n")
    os.utime(path, ns=(stamp, stamp))
    assert agreement.metric(f"{path}:f").value(outputs([1.0]), outputs([1.0])) == 0.25
    assert not (tmp_path / "__pycache__").exists()  # nothing written beside the user's file


@pytest.mark.parametrize("events", [0, 3])
def test_a_user_function_may_return_its_value_and_how_many_events_it_rests_on(tmp_path, events):
    """``(value, events)``: a count of events is an integer of 0 or more (no event fired is a count too)."""
    path = write_metric(tmp_path, f"def f(r, c):\n    return 0.5, {events}\n")
    assert agreement.metric(f"{path}:f").measure(outputs([1.0]), outputs([1.0])) == (0.5, events)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        pytest.param("def f(r, c):\n    raise ValueError('boom')\n", "raised ValueError: boom", id="raises"),
        pytest.param("def f(r, c):\n    return float('nan')\n", "returned nan", id="nan"),
        pytest.param("def f(r, c):\n    return 'high'\n", "returned 'high'", id="not-a-number"),
        pytest.param("def f(r, c):\n    return True\n", "returned True", id="a-bool"),
    ],
)
def test_a_user_function_that_fails_is_one_line_naming_it(tmp_path, body, said):
    path = write_metric(tmp_path, body)
    with pytest.raises(graphscan.GraphscanError) as raised:
        agreement.metric(f"{path}:f").value(outputs([1.0]), outputs([1.0]))
    message = str(raised.value)
    assert raised.value.exit_code == graphscan.EXIT_USAGE and "\n" not in message
    assert f"{path}:f" in message and said in message


@pytest.mark.parametrize(
    ("argument", "said"),
    [
        pytest.param("nope", "expected one of", id="unknown"),
        pytest.param("missing.py:f", "no such file", id="no-file"),
        pytest.param("{here}/my_metric.py:g", "has no function g", id="no-function"),
        pytest.param("{here}/my_metric.py:1f", "expected one of", id="not-an-identifier"),
    ],
)
def test_a_metric_that_cannot_be_had_is_a_usage_error(tmp_path, argument, said):
    write_metric(tmp_path, "def f(r, c):\n    return 1.0\n")
    with pytest.raises(graphscan.GraphscanError) as raised:
        agreement.metric(argument.format(here=tmp_path))
    assert raised.value.exit_code == graphscan.EXIT_USAGE and said in str(raised.value)


def test_parameters_of_another_metric_are_usage_errors():
    for call in (lambda: agreement.metric("top1", threshold=0.3), lambda: agreement.metric("iou", blank=0)):
        with pytest.raises(graphscan.GraphscanError):
            call()


def test_a_metric_describes_the_parameters_it_used_defaults_included():
    from graphscan_ort.shared.agreement import metric

    assert metric("iou").describe() == {"name": "iou", "threshold": 0.5}
    assert metric("ctc").describe() == {"name": "ctc", "blank": 0}
    assert metric("ctc", blank=3).describe() == {"name": "ctc", "blank": 3}
    assert metric("ctc", blank=0).describe() == {"name": "ctc", "blank": 0}  # the default, given: class 0
    with pytest.raises(graphscan.GraphscanError) as raised:
        metric("ctc", blank=-1)
    assert raised.value.exit_code == graphscan.EXIT_USAGE and ">= 0" in str(raised.value)
    assert metric(None).describe() == {"name": "sqnr"}
