"""The built-in metrics of check and tune, against values worked out by hand on tiny arrays.

Each expectation is derived in the comment beside it from docs/SPEC.md's definition,
never computed with graphscan's own code.
"""

import math
import os
import sys

import numpy as np
import onnx
import pytest

import graphscan
from graphscan_ort.shared import agreement
from tests import helpers


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
    assert agreement.sqnr(outputs([0.0]), outputs([0.0])) == math.inf  # equal, even without signal
    assert agreement.sqnr(outputs([0.0]), outputs([1.0])) is None  # no signal, some noise: undefined
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


# --- ctc's layout: [N, T, C] or [T, N, C], given or told by the output ---------------------

ALPHABET = "-abcde"  # class 0, the blank, is "-"


def string_agreement(reference, candidate, time_first):
    """The share of sequences whose strings, decoded apart from graphscan (tests/helpers.py), agree."""
    return helpers.string_agreement([f["y"] for f in reference], [q["y"] for q in candidate], time_first, ALPHABET)


def recognizer_outputs(sequences, time_first, samples=4, frames=16, seed=5):
    """Logits a recognizer might give: mostly blank, a character now and then, and a
    candidate with noise of another strength per sequence, which changes some strings and
    leaves others."""
    rng = np.random.default_rng(seed)
    reference, candidate = [], []
    for _ in range(samples):
        classes = np.where(
            rng.random((sequences, frames)) < 0.6, 0, rng.integers(1, len(ALPHABET), (sequences, frames))
        )
        logits = np.eye(len(ALPHABET))[classes] * 2 + rng.normal(0, 0.3, (sequences, frames, len(ALPHABET)))
        noisy = logits + rng.normal(0, 1, logits.shape) * rng.uniform(0, 1.2, (sequences, 1, 1))
        if time_first:
            logits, noisy = logits.transpose(1, 0, 2), noisy.transpose(1, 0, 2)
        reference.append({"y": logits.astype(np.float32)})
        candidate.append({"y": noisy.astype(np.float32)})
    return reference, candidate


@pytest.mark.parametrize(
    ("layout", "sequences", "given"),
    [
        pytest.param("NTC", 1, None, id="1xTxC-told-by-shape"),
        pytest.param("TNC", 1, None, id="Tx1xC-told-by-shape"),
        pytest.param("NTC", 3, "NTC", id="3xTxC-given"),
        pytest.param("TNC", 3, "TNC", id="Tx3xC-given"),
    ],
)
def test_ctc_is_the_share_of_sequences_whose_decoded_strings_agree_on_both_layouts(layout, sequences, given):
    reference, candidate = recognizer_outputs(sequences, time_first=layout == "TNC")
    expected = string_agreement(reference, candidate, time_first=layout == "TNC")
    assert 0 < expected < 1  # some strings changed, some did not: the figure has something to tell
    chosen = agreement.metric("ctc", **({"layout": given} if given else {}))  # told by the shape when not given
    assert chosen.value(reference, candidate) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("dims", "layout"),
    [
        pytest.param(("batch", "T", ""), "NTC", id="batch-first"),
        pytest.param(("seq", "N", ""), "TNC", id="N-second"),
        pytest.param(("time", "batch_size", "classes"), "TNC", id="batch_size-second"),
    ],
)
def test_a_declared_batch_dim_tells_the_layout_where_the_shape_cannot(dims, layout):
    reference, candidate = recognizer_outputs(3, time_first=layout == "TNC")
    expected = string_agreement(reference, candidate, time_first=layout == "TNC")
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(dims))
    graph = onnx.helper.make_graph([], "g", [y], [y])
    chosen = agreement.metric("ctc").reading(onnx.helper.make_model(graph))
    assert chosen.value(reference, candidate) == pytest.approx(expected)


def usage_error(call):
    with pytest.raises(graphscan.GraphscanError) as raised:
        call()
    assert raised.value.exit_code == graphscan.EXIT_USAGE and "\n" not in str(raised.value)
    return str(raised.value)


def test_an_output_whose_layout_cannot_be_told_is_refused_naming_layout():
    reference, candidate = recognizer_outputs(3, time_first=True)  # [16, 3, 6]: both readings decode sequences
    said = usage_error(lambda: agreement.metric("ctc").value(reference, candidate))
    assert "output 'y' is [16, 3, 6]" in said and "--layout TNC" in said
    # Declared dims of another rank (a recognizer declaring [1, seqlen] for [T, 1, C]) tell nothing.
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, "seqlen"])
    declared = agreement.metric("ctc").reading(onnx.helper.make_model(onnx.helper.make_graph([], "g", [y], [y])))
    assert "--layout" in usage_error(lambda: declared.value(reference, candidate))
    # A batch name at both places tells nothing either.
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", "batch", 6])
    both = agreement.metric("ctc").reading(onnx.helper.make_model(onnx.helper.make_graph([], "g", [y], [y])))
    assert "--layout" in usage_error(lambda: both.value(reference, candidate))


@pytest.mark.parametrize(
    ("shape", "given", "words"),
    [
        pytest.param((16, 1, 6), "NTC", "every sequence is a single frame", id="Tx1xC-read-as-NTC"),
        pytest.param((1, 16, 6), "TNC", "give --layout NTC", id="1xTxC-read-as-TNC"),
        pytest.param((1, 1, 6), None, "single frame", id="one-frame-either-way"),
        pytest.param((1, 6), None, "no CTC sequence", id="a-2d-single-frame"),
    ],
)
def test_a_reading_where_every_sequence_is_a_single_frame_is_refused(shape, given, words):
    # [16, 1, 6] read as [N, T, C] is 16 sequences of one frame: each decodes to its frame's
    # argmax, and their agreement, the argmax's, passes for the strings'.
    logits = [{"y": np.random.default_rng(1).standard_normal(shape).astype(np.float32)}]
    said = usage_error(lambda: agreement.metric("ctc", layout=given).value(logits, logits))
    assert "output 'y'" in said and words in said


def test_a_2d_output_is_one_sequence_without_a_layout():
    reference, candidate = recognizer_outputs(1, time_first=False)
    flat = [[{"y": sample["y"][0]} for sample in outputs] for outputs in (reference, candidate)]
    expected = string_agreement(reference, candidate, time_first=False)
    assert agreement.metric("ctc").value(*flat) == pytest.approx(expected)


def test_layout_is_a_parameter_of_ctc_alone_and_described_only_when_given():
    assert "--layout: only with --metric ctc" in usage_error(lambda: agreement.metric("top1", layout="NTC"))
    assert "NTC, TNC" in usage_error(lambda: agreement.metric("ctc", layout="NCT"))
    assert agreement.metric("ctc", layout="TNC").describe() == {"name": "ctc", "blank": 0, "layout": "TNC"}
    assert agreement.metric("ctc").describe() == {"name": "ctc", "blank": 0}  # told by the output, as before
