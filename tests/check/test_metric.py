"""check --metric M --min-metric X: a gate on the user's own agreement with the float model.

The expected values are recomputed here from onnxruntime run directly (a default
session, as check runs both models) and numpy, never from graphscan's metric code.
"""

import json
import math

import numpy as np
import pytest

import graphscan
from tests.helpers import error_line, json_answer, main_error_line, run_graphscan, run_main, run_onnx
from tests.lab import DEFAULT_LAB


def samples_on_disk(tmp_path, count=2, rows=6):
    rng = np.random.default_rng(11)
    arrays = [rng.standard_normal((rows, DEFAULT_LAB.dim)).astype(np.float32) for _ in range(count)]
    paths = []
    for k, x in enumerate(arrays):
        np.savez(tmp_path / f"s{k}.npz", x=x)
        paths.append(str(tmp_path / f"s{k}.npz"))
    return arrays, paths


def direct_outputs(path, arrays):
    return [run_onnx(path, {"x": x}, level="all")[0] for x in arrays]


def metric_budget(answer):
    (budget,) = [b for b in answer["budgets"] if b["name"] == "min_metric"]
    return budget


def test_top1_and_cosine_equal_a_direct_recomputation(default_lab, tmp_path):
    arrays, paths = samples_on_disk(tmp_path)
    f = direct_outputs(default_lab["fp32"], arrays)
    q = direct_outputs(default_lab["full"], arrays)
    top1 = np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(f, q, strict=True)]))
    ff, qq = np.concatenate([a.ravel() for a in f]).astype(float), np.concatenate([b.ravel() for b in q]).astype(float)
    cosine = ff @ qq / math.sqrt((ff @ ff) * (qq @ qq))
    for name, expected in [("top1", top1), ("cosine", cosine)]:
        answer = graphscan.check(
            default_lab["full"], float_path=default_lab["fp32"], inputs=paths, metric=name, min_metric=0.0
        )
        budget = metric_budget(answer)
        assert budget["value"] == pytest.approx(expected, abs=1e-9)
        assert budget["metric"] == {"name": name} and budget["ok"] is True


def test_the_budget_holds_at_its_value_and_breaks_above_with_exit_8(default_lab, tmp_path):
    _, paths = samples_on_disk(tmp_path)
    args = ["check", default_lab["full"], "--float", default_lab["fp32"], "--metric", "cosine"]
    args += [a for p in paths for a in ("--inputs", p)]
    value = metric_budget(json_answer(run_graphscan([*args, "--min-metric", "0"])))["value"]
    assert 0.9 < value < 1.0  # the lab's full model is close to float, not equal
    held = json_answer(run_graphscan([*args, "--min-metric", repr(value)]))
    assert held["ok"] is True
    broken = run_graphscan([*args, "--min-metric", "1.0"])
    assert broken.returncode == 8 and broken.stderr == b""
    answer = json.loads(broken.stdout)
    assert answer["ok"] is False and metric_budget(answer)["value"] == value


def test_iou_names_its_threshold_and_a_table_shows_it(default_lab, tmp_path, capsys):
    _, paths = samples_on_disk(tmp_path, count=1)
    argv = ["check", default_lab["full"], "--float", default_lab["fp32"], "--inputs", paths[0]]
    argv += ["--metric", "iou", "--threshold", "0.25", "--min-metric", "0.5", "--max-islands", "9"]
    code, out, _ = run_main(capsys, argv)
    answer = json.loads(out)
    assert metric_budget(answer)["metric"] == {"name": "iou", "threshold": 0.25}
    assert [b["name"] for b in answer["budgets"]] == ["max_islands", "min_metric"]
    assert code == (0 if answer["ok"] else 8)
    code, table, _ = run_main(capsys, [*argv, "--format", "table"])
    assert "min_metric (iou, threshold 0.25)" in table


def test_a_users_function_is_called_with_every_sample_by_output_name(default_lab, tmp_path):
    arrays, paths = samples_on_disk(tmp_path, count=3)
    metric_file = tmp_path / "agree.py"
    metric_file.write_text(
        "import numpy as np\n"
        "def max_gap(reference, candidate):\n"
        "    assert len(reference) == len(candidate) == 3\n"
        "    return -max(float(np.abs(r['y'] - c['y']).max()) for r, c in zip(reference, candidate))\n"
    )
    f = direct_outputs(default_lab["fp32"], arrays)
    q = direct_outputs(default_lab["full"], arrays)
    expected = -max(float(np.abs(a - b).max()) for a, b in zip(f, q, strict=True))
    answer = graphscan.check(
        default_lab["full"],
        float_path=default_lab["fp32"],
        inputs=paths,
        metric=f"{metric_file}:max_gap",
        min_metric=-1e9,
    )
    assert metric_budget(answer)["value"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--min-metric", "1"], "needs --metric"),
        (["--metric", "top1", "--min-sqnr", "0"], "--metric: only with --min-metric"),
        (["--metric", "top1", "--threshold", "0.2", "--min-metric", "1"], "--threshold: only with --metric iou"),
        (["--metric", "bleu", "--min-metric", "1"], "expected one of sqnr, top1"),
        (["--metric", "top1", "--min-metric", "nan"], "finite number"),
    ],
    ids=["no-metric", "no-budget", "wrong-parameter", "unknown", "nan-limit"],
)
def test_usage_errors_are_one_line_exit_2(default_lab, capsys, extra, words):
    line = main_error_line(capsys, ["check", default_lab["full"], "--float", default_lab["fp32"], *extra], 2)
    assert words in line


def test_min_metric_needs_the_float_model(default_lab, capsys):
    line = main_error_line(capsys, ["check", default_lab["full"], "--metric", "top1", "--min-metric", "1"], 2)
    assert "--min-metric needs --float" in line


def test_a_failing_users_function_is_one_line_naming_it(default_lab, tmp_path, capsys):
    metric_file = tmp_path / "broken.py"
    metric_file.write_text("def f1(reference, candidate):\n    raise KeyError('boxes')\n")
    argv = ["check", default_lab["full"], "--float", default_lab["fp32"], "--metric", f"{metric_file}:f1"]
    line = main_error_line(capsys, [*argv, "--min-metric", "0.5"], 2)
    assert "f1" in line and "KeyError" in line


USER_CODE = """
import sys
print("loading")
def exits(reference, candidate):
    sys.exit(0)
def exits_3(reference, candidate):
    sys.exit(3)
def huge(reference, candidate):
    return 10 ** 400
def chatty(reference, candidate):
    print("measuring")
    return 0.5
"""


@pytest.mark.parametrize(
    ("function", "words"),
    [("exits", "raised SystemExit: 0"), ("exits_3", "raised SystemExit: 3"), ("huge", "a metric returns a finite")],
)
def test_a_users_function_that_exits_or_overflows_is_one_line_exit_2(default_lab, tmp_path, function, words):
    (tmp_path / "user.py").write_text(USER_CODE.replace('print("loading")\n', ""))  # the one line is graphscan's
    argv = ["check", default_lab["full"], "--float", default_lab["fp32"], "--metric", f"{tmp_path}/user.py:{function}"]
    line = error_line(run_graphscan([*argv, "--min-metric", "0.5"]), 2)
    assert function in line and words in line


def test_what_a_users_metric_prints_goes_to_stderr_and_stdout_stays_one_answer(default_lab, tmp_path):
    (tmp_path / "user.py").write_text(USER_CODE)
    argv = ["check", default_lab["full"], "--float", default_lab["fp32"], "--metric", f"{tmp_path}/user.py:chatty"]
    proc = run_graphscan([*argv, "--min-metric", "0.5"])
    assert proc.returncode == 0 and proc.stderr.decode().splitlines() == ["loading", "measuring"]
    assert metric_budget(json.loads(proc.stdout))["value"] == 0.5


def test_a_budget_file_may_hold_min_metric(default_lab, tmp_path, capsys):
    budget = tmp_path / "budget.json"
    budget.write_text('{"min_metric": 0.5}')
    argv = ["check", default_lab["full"], "--float", default_lab["fp32"], "--budget", str(budget)]
    assert "needs --metric" in main_error_line(capsys, argv, 2)
    code, out, _ = run_main(capsys, [*argv, "--metric", "cosine"])
    assert code == 0 and metric_budget(json.loads(out))["limit"] == 0.5


def test_the_table_says_which_level_each_measured_budget_ran_at(default_lab, capsys):
    argv = ["check", default_lab["full"], "--float", default_lab["fp32"], "--min-int8", "0", "--min-sqnr", "-99"]
    _, table, _ = run_main(capsys, [*argv, "--format", "table"])
    assert "min_int8: what runs at level extended" in table and "sessions at --level (default all)" in table
    _, plain, _ = run_main(capsys, ["check", default_lab["full"], "--max-islands", "9", "--format", "table"])
    assert "level" not in plain  # counted from the graph: no session, no level


def test_an_undefined_metric_is_null_and_never_holds(tmp_path):
    """cosine of all-zero outputs is undefined (no norm): null, and not even a limit of -1 holds."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Sub", ["x", "x"], ["y"])], "zeros", [x], [y])
    import onnx

    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "zeros.onnx")
    zeros = str(tmp_path / "zeros.onnx")
    answer = graphscan.check(zeros, float_path=zeros, metric="cosine", min_metric=-1.0, shape=["x=2,3"])
    assert metric_budget(answer)["value"] is None and metric_budget(answer)["ok"] is False and answer["ok"] is False
