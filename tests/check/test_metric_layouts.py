"""--metric ctc reads the output's layout, [N, T, C] or [T, N, C], from --layout or from the
output (its shape where only one reading decodes sequences of more than a frame, else a
declared batch dim), and refuses what it cannot tell. check and tune both carry --layout.

A recognizer's head built here passes its input frames through (relu(x W1) W2 = x), time
first or batch first; its candidate has noise in W2, or is tune's own quantization. The
expected agreement is the strings' of both models run directly in onnxruntime, decoded by
tests/helpers.py's greedy CTC decode, never by graphscan's."""

import json

import numpy as np
import pytest

import graphscan
from tests.helpers import CTC_ALPHABET, ctc_frames, ctc_head, main_error_line, run_main, run_onnx, string_agreement

CLASSES = len(CTC_ALPHABET)


def strings_agreement(float_path, candidate_path, arrays, time_first):
    """Both models run directly in a default onnxruntime session, their strings compared."""
    reference = [run_onnx(float_path, {"x": x}, level="all")[0] for x in arrays]
    candidate = [run_onnx(candidate_path, {"x": x}, level="all")[0] for x in arrays]
    return string_agreement(reference, candidate, time_first, CTC_ALPHABET)


def metric_row(answer):
    (row,) = [b for b in answer["budgets"] if b["name"] == "min_metric"]
    return row


@pytest.mark.parametrize(
    ("time_first", "sequences", "layout", "declared"),
    [
        pytest.param(False, 1, None, None, id="1xTxC-told-by-shape"),
        pytest.param(True, 1, None, None, id="Tx1xC-told-by-shape"),
        pytest.param(False, 3, "NTC", None, id="3xTxC-given"),
        pytest.param(True, 3, "TNC", None, id="Tx3xC-given"),
        pytest.param(True, 3, None, ["frames", "batch", CLASSES], id="Tx3xC-declared-batch"),
    ],
)
def test_check_min_metric_ctc_is_the_share_of_decoded_strings_that_agree(
    tmp_path, time_first, sequences, layout, declared
):
    reference = ctc_head(tmp_path / "rec.onnx", sequences, time_first, declared=declared)
    candidate = ctc_head(tmp_path / "rec.noisy.onnx", sequences, time_first, noise=0.3, declared=declared)
    paths, arrays = ctc_frames(tmp_path, sequences)
    expected = strings_agreement(reference, candidate, arrays, time_first)
    assert 0 < expected < 1  # some strings changed, some did not: the figure has something to tell
    given = {"layout": layout} if layout else {}  # told by the output when not given
    answer = graphscan.check(candidate, float_path=reference, inputs=paths, metric="ctc", min_metric=0, **given)
    assert metric_row(answer)["value"] == pytest.approx(expected)
    assert metric_row(answer)["metric"] == {"name": "ctc", "blank": 0, **({"layout": layout} if layout else {})}


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """Float heads time first with 3 sequences (a layout no shape tells) and with 1 (Tx1xC),
    a noisy candidate of each, and samples for both."""
    folder = tmp_path_factory.mktemp("heads")
    found = {}
    for sequences in (1, 3):
        found[sequences] = {
            "float": ctc_head(folder / f"tnc{sequences}.onnx", sequences, time_first=True),
            "noisy": ctc_head(folder / f"tnc{sequences}.noisy.onnx", sequences, time_first=True, noise=0.3),
            "inputs": ctc_frames(folder, sequences, count=2, seed=sequences)[0],
        }
    return found


def check_argv(head, *extra):
    return ["check", head["noisy"], "--float", head["float"], "--inputs", head["inputs"][0], *extra]


@pytest.mark.parametrize(
    ("sequences", "extra", "words"),
    [
        pytest.param(3, ["--metric", "ctc", "--min-metric", "0"], "neither its shape nor", id="cannot-be-told"),
        pytest.param(1, ["--metric", "ctc", "--layout", "NTC", "--min-metric", "0"], "give --layout TNC", id="1-frame"),
        pytest.param(1, ["--metric", "top1", "--layout", "NTC", "--min-metric", "0"], "only with --metric ctc",
                     id="layout-of-top1"),
        pytest.param(1, ["--metric", "ctc", "--layout", "NTC", "--min-sqnr", "0"], "--layout: only with --min-metric",
                     id="without-min-metric"),
        pytest.param(1, ["--metric", "ctc", "--layout", "NCT", "--min-metric", "0"], "invalid choice: 'NCT'",
                     id="not-a-layout"),
    ],
)  # fmt: skip
def test_check_refuses_what_ctc_cannot_read_in_one_line_exit_2(heads, capsys, sequences, extra, words):
    line = main_error_line(capsys, check_argv(heads[sequences], *extra), graphscan.EXIT_USAGE)
    assert words in line
    if "neither" in words:
        assert "--layout TNC or --layout NTC" in line and "output 'y' is [16, 3, 6]" in line


def test_an_in_process_check_refuses_a_layout_in_the_command_lines_words(heads, capsys):
    head = heads[1]
    line = main_error_line(capsys, check_argv(head, "--metric", "ctc", "--layout", "NCT", "--min-metric", "0"), 2)
    with pytest.raises(graphscan.GraphscanError) as raised:
        graphscan.check(head["noisy"], float_path=head["float"], inputs=head["inputs"][:1], metric="ctc",
                        layout="NCT", min_metric=0)  # fmt: skip
    assert f"graphscan: {raised.value}" == line.replace("argument --layout:", "argument layout=:")


def test_a_given_layout_reads_an_output_no_shape_tells_and_the_table_names_it(heads, capsys):
    head = heads[3]
    arrays = [np.load(path)["x"] for path in head["inputs"][:1]]
    expected = strings_agreement(head["float"], head["noisy"], arrays, time_first=True)
    code, out, _ = run_main(capsys, check_argv(head, "--metric", "ctc", "--layout", "TNC", "--min-metric", "0"))
    assert code == 0 and metric_row(json.loads(out))["value"] == pytest.approx(expected)
    argv = check_argv(head, "--metric", "ctc", "--layout", "TNC", "--min-metric", "0", "--format", "table")
    assert "min_metric (ctc, blank 0, layout TNC)" in run_main(capsys, argv)[1]


def tune_argv(head, tmp_path, *extra):
    calibrate = [a for path in head["inputs"] for a in ("--calibrate", path)]
    return ["tune", head["float"], *calibrate, "--out", str(tmp_path / "out"), "--runs", "2", *extra]


@pytest.mark.parametrize(
    ("sequences", "extra", "words"),
    [
        pytest.param(3, ["--metric", "ctc"], "give --layout TNC or --layout NTC", id="cannot-be-told"),
        pytest.param(1, ["--metric", "ctc", "--layout", "NTC"], "every sequence is a single frame", id="1-frame"),
        pytest.param(1, ["--metric", "cosine", "--layout", "TNC"], "--layout: only with --metric ctc", id="cosine"),
    ],
)
def test_tune_refuses_what_ctc_cannot_read_before_any_work(heads, tmp_path, capsys, sequences, extra, words):
    assert words in main_error_line(capsys, tune_argv(heads[sequences], tmp_path, *extra), graphscan.EXIT_USAGE)
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".graphscan-tune-*")) == []


def test_tune_measures_ctc_in_the_layout_the_declared_batch_dim_tells(tmp_path):
    """[16, 3, 6] declared [frames, batch, 6]: tune's metric of the model it writes is the
    agreement of the strings that model and float decode, time read as the first axis."""
    declared = ["frames", "batch", CLASSES]
    reference = ctc_head(tmp_path / "rec.onnx", 3, time_first=True, declared=declared, spread=5.0)
    paths, arrays = ctc_frames(tmp_path, 3, count=4, seed=7, margin=0.6)
    out = tmp_path / "out"
    # A head this small runs no faster in int8 than in float: without min_speedup 0 the slower
    # guard refuses every row on most runs and nothing is written to measure.
    answer = graphscan.tune(
        reference,
        calibrate=paths[:2],
        inputs=paths[2:],
        out=str(out),
        metric="ctc",
        runs=2,
        max_exclude=0,
        min_speedup=0,
    )
    assert answer["metric"] == {"name": "ctc", "blank": 0} and "model.onnx" in answer["written"]
    (chosen,) = [row for row in answer["candidates"] if row["id"] == answer["chosen"]]
    expected = strings_agreement(reference, str(out / "model.onnx"), arrays[2:], time_first=True)
    assert 0 < expected < 1  # int8 changed some strings: the figure has something to tell
    assert chosen["metric_value"] == pytest.approx(expected)


def test_every_option_of_the_metric_group_is_a_key_of_the_plugins_config():
    import graphscan_pytest

    flags = [flag for flag, _ in graphscan.MetricChoice.taken().options]
    assert [flag.removeprefix("--") for flag in flags] == list(graphscan_pytest.METRIC_KEYS)
