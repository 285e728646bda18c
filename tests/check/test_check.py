"""graphscan.py check: a CI gate that measures budgets and exits 8 when one is broken.

The counts are SPEC's answers for the canonical lab models, derived by hand
(see the comments); the SQNR is recomputed here with onnxruntime and numpy.
"""

import json
import math
import platform

import numpy as np
import onnx
import pytest

import graphscan
from tests.helpers import (
    describe,
    error_line,
    json_answer,
    main_error_line,
    run_graphscan,
    run_main,
    run_onnx,
    strict_loads,
)
from tests.lab import DEFAULT_LAB

# matmul_only of the canonical 3-layer lab: each layer's Add and Relu stay
# float (the MatMul alone is wrapped), one island per layer. Each island has
# one DQ in (the MatMul's output) and one Q out (the next MatMul's input),
# except the last, which only reaches the graph output: 2 + 2 + 1 crossings.
MATMUL_ONLY = {
    "max_float": 2 * DEFAULT_LAB.layers,
    "max_islands": DEFAULT_LAB.layers,
    "max_crossings": 2 * DEFAULT_LAB.layers - 1,
}


def budget_rows(answer):
    return {b["name"]: (b["value"], b["limit"], b["ok"]) for b in answer["budgets"]}


def test_counting_budgets_hold_at_their_value_and_break_below(default_lab):
    path = str(default_lab["matmul_only"])
    at_value = graphscan.check(path, **MATMUL_ONLY)
    assert list(at_value) == ["model", "float", "budgets", "ok"]
    assert at_value["ok"] is True and at_value["float"] is None
    assert budget_rows(at_value) == {name: (v, v, True) for name, v in MATMUL_ONLY.items()}
    below = graphscan.check(path, **{name: v - 1 for name, v in MATMUL_ONLY.items()})
    assert below["ok"] is False
    assert budget_rows(below) == {name: (v, v - 1, False) for name, v in MATMUL_ONLY.items()}


def test_one_broken_budget_breaks_the_gate(default_lab):
    answer = graphscan.check(str(default_lab["matmul_only"]), max_float=100, max_islands=MATMUL_ONLY["max_islands"] - 1)
    assert [b["ok"] for b in answer["budgets"]] == [True, False] and answer["ok"] is False


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's uint8 rewrite")
def test_min_int8_uses_the_runtime_classes(default_lab):
    # full.onnx on x86: the 3 MatMuls run QLinearMatMul, the 3 Adds stay float
    # (mixed int8/uint8 operands): 3 of the 6 nodes that run a kernel.
    assert budget_rows(graphscan.check(str(default_lab["full"]), min_int8=0.5)) == {"min_int8": (0.5, 0.5, True)}
    assert budget_rows(graphscan.check(str(default_lab["full"]), min_int8=0.51))["min_int8"][2] is False


def direct_sqnr(float_path, quant_path, samples, level):
    """The output SQNR measured here, in onnxruntime sessions at ``level`` and numpy."""
    f = np.concatenate([run_onnx(float_path, {"x": x}, level)[0].ravel() for x in samples]).astype(np.float64)
    q = np.concatenate([run_onnx(quant_path, {"x": x}, level)[0].ravel() for x in samples]).astype(np.float64)
    return 20 * math.log10(np.linalg.norm(f) / np.linalg.norm(f - q))


def test_min_sqnr_matches_onnxruntime_run_directly(default_lab, tmp_path):
    rng = np.random.default_rng(7)
    samples = []
    for k in range(2):
        x = rng.standard_normal((5, DEFAULT_LAB.dim)).astype(np.float32)
        np.savez(tmp_path / f"s{k}.npz", x=x)
        samples.append(x)
    expected = direct_sqnr(default_lab["fp32"], default_lab["full"], samples, "all")
    inputs = [str(tmp_path / "s0.npz"), str(tmp_path / "s1.npz")]
    answer = graphscan.check(
        str(default_lab["full"]), float_path=str(default_lab["fp32"]), min_sqnr=expected - 0.01, inputs=inputs
    )
    ((value, _limit, ok),) = budget_rows(answer).values()
    assert value == pytest.approx(expected, abs=1e-9) and ok is True
    broken = graphscan.check(
        str(default_lab["full"]), float_path=str(default_lab["fp32"]), min_sqnr=expected + 0.01, inputs=inputs
    )
    assert broken["ok"] is False and broken["float"] == str(default_lab["fp32"])


def test_min_sqnr_is_measured_as_deployed_where_onnxruntime_rewrites_the_model(tmp_path):
    """One Conv excluded from quantization: in a default session onnxruntime
    quantizes its weights anyway (WeightBiasQuantization) and fuses a QLinearConv,
    so the SQNR users get differs from the graph as written; check measures the
    first by default and the second with --level disabled, and impact reports both."""
    import gen_models

    fp32, quant = tmp_path / "cnn.onnx", tmp_path / "cnn_qdq.onnx"
    onnx.save(gen_models.build_cnn(2, channels=4, size=8, seed=3), fp32)
    convs = [n.name for n in onnx.load(fp32).graph.node if n.op_type == "Conv"]
    with gen_models.quiet_quantizer():
        gen_models.quantize_qdq(fp32, quant, seed=0, nodes_to_exclude=convs[1:2])
    samples = [np.random.default_rng(k).standard_normal((1, 3, 8, 8)).astype(np.float32) for k in range(2)]
    for k, x in enumerate(samples):
        np.savez(tmp_path / f"s{k}.npz", x=x)
    inputs = [str(tmp_path / f"s{k}.npz") for k in range(2)]
    deployed, written = (direct_sqnr(fp32, quant, samples, level) for level in ("all", "disabled"))
    assert abs(deployed - written) > 1e-3  # the rewrite matters on this model
    for level, expected in ((None, deployed), ("all", deployed), ("disabled", written)):
        answer = graphscan.check(str(quant), float_path=str(fp32), min_sqnr=-100, inputs=inputs, level=level)
        ((value, _limit, _ok),) = budget_rows(answer).values()
        assert value == pytest.approx(expected, abs=1e-6), level
    measured = graphscan.impact(str(fp32), str(quant), inputs=inputs, top=0)
    assert measured["deployed_output_sqnr_db"] == pytest.approx(deployed, abs=1e-6)
    assert measured["output_sqnr_db"] == pytest.approx(written, abs=1e-4)  # without pre-packing: other sum order


def test_identical_outputs_hold_any_sqnr_and_show_null(default_lab):
    answer = graphscan.check(str(default_lab["full"]), float_path=str(default_lab["full"]), min_sqnr=1000)
    assert budget_rows(answer) == {"min_sqnr": (None, 1000.0, True)}


def two_output_model(path, order):
    """``y_relu = Relu(x)`` and ``y_neg = Neg(x)``, declared in ``order``: the same model either way."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["y_relu"]), helper.make_node("Neg", ["x"], ["y_neg"])]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3]) for name in order]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_outputs_are_paired_by_name_as_impact_pairs_them(tmp_path):
    """Two identical models whose outputs are listed in swapped order: equal outputs
    (null, infinite SQNR), as impact says; pairing by position gave -5.98 dB."""
    a = two_output_model(tmp_path / "a.onnx", ["y_relu", "y_neg"])
    b = two_output_model(tmp_path / "b.onnx", ["y_neg", "y_relu"])
    answer = graphscan.check(b, float_path=a, min_sqnr=100)
    assert budget_rows(answer) == {"min_sqnr": (None, 100.0, True)}
    impact = graphscan.impact(a, b)
    assert impact["output_sqnr_db"] == impact["deployed_output_sqnr_db"] == math.inf  # exact, as check says


def test_an_undefined_sqnr_shows_null_and_does_not_hold(default_lab, tmp_path):
    """A float model whose outputs are all zeros gives an SQNR of -infinity
    against anything else: undefined, shown as null, and the gate is closed."""
    zero = onnx.load(default_lab["fp32"])
    for init in zero.graph.initializer:
        init.CopyFrom(onnx.numpy_helper.from_array(np.zeros_like(onnx.numpy_helper.to_array(init)), init.name))
    onnx.save(zero, tmp_path / "zero.onnx")
    answer = graphscan.check(str(default_lab["full"]), float_path=str(tmp_path / "zero.onnx"), min_sqnr=-1000)
    assert budget_rows(answer) == {"min_sqnr": (None, -1000.0, False)}


def test_budget_file_gives_the_same_answer_and_options_override_it(default_lab, tmp_path):
    path = str(default_lab["matmul_only"])
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"max_crossings": 0, "max_islands": MATMUL_ONLY["max_islands"]}))
    from_file = graphscan.check(path, budget=str(budget))
    from_options = graphscan.check(path, max_islands=MATMUL_ONLY["max_islands"], max_crossings=0)
    assert from_file == from_options
    # Reported in a fixed order (max_islands before max_crossings), whatever the file's.
    assert [b["name"] for b in from_file["budgets"]] == ["max_islands", "max_crossings"]
    overridden = graphscan.check(path, budget=str(budget), max_crossings=100)
    assert overridden["ok"] is True


def test_process_exit_8_prints_the_same_json(default_lab, tmp_path):
    path = default_lab["matmul_only"]
    broken = run_graphscan(["check", path, "--max-islands", "0"], cwd=tmp_path)
    assert broken.returncode == graphscan.EXIT_BUDGET == 8, describe(broken)
    assert broken.stderr == b""
    answer = strict_loads(broken.stdout.decode())
    assert answer["ok"] is False and answer["budgets"][0]["value"] == MATMUL_ONLY["max_islands"]
    held = json_answer(run_graphscan(["check", path, "--max-islands", str(MATMUL_ONLY["max_islands"])], cwd=tmp_path))
    assert held["budgets"] == [
        {"name": "max_islands", "value": MATMUL_ONLY["max_islands"], "limit": MATMUL_ONLY["max_islands"], "ok": True}
    ]


def test_usage_errors(default_lab, tmp_path):
    path = default_lab["matmul_only"]
    (tmp_path / "unknown.json").write_text('{"max_floats": 3}')
    (tmp_path / "notjson.json").write_text("{max_float: 3")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "fraction.json").write_text('{"max_float": 1.5}')
    (tmp_path / "boolean.json").write_text('{"max_islands": true}')
    cases = [
        (["check", path], 2, "at least one budget"),
        (["check", path, "--budget", tmp_path / "unknown.json"], 2, "unknown budget max_floats"),
        (["check", path, "--budget", tmp_path / "notjson.json"], 2, "not a JSON budget file"),
        (["check", path, "--budget", tmp_path / "list.json"], 2, "JSON object"),
        (["check", path, "--budget", tmp_path / "fraction.json"], 2, "whole number"),
        (["check", path, "--budget", tmp_path / "boolean.json"], 2, "finite number"),
        (["check", path, "--budget", tmp_path / "missing.json"], 3, "missing.json"),
        (["check", path, "--min-sqnr", "10"], 2, "needs --float"),
        (["check", path, "--min-int8", "1.5"], 2, "between 0 and 1"),
        (["check", path, "--max-float", "-1"], 2, "whole number"),
        (["check", path, "--min-sqnr", "nan", "--float", path], 2, "finite"),
        (["check", tmp_path / "none.onnx", "--max-float", "1"], 3, "none.onnx"),
    ]
    for argv, code, message in cases:
        line = error_line(run_graphscan(argv, cwd=tmp_path), code)
        assert message in line, (argv, line)


def test_min_int8_counts_int8_data_and_leaves_absorbed_nodes_out(tmp_path):
    """The hand-built graph of tests/runtime/test_runtime.py runs one int8 kernel (Conv),
    one int8_data kernel (Reshape) and one float kernel (HardSigmoid); its Relu,
    Identity and Constant are absorbed: (1 + 1) / 3 of the kernels run int8."""
    from tests.runtime.test_runtime import every_class_model

    path = tmp_path / "every_class.onnx"
    onnx.save(every_class_model(), path)
    ((value, _limit, ok),) = budget_rows(graphscan.check(str(path), min_int8=0.6)).values()
    assert value == pytest.approx(2 / 3) and ok is True


@pytest.mark.parametrize(
    ("text", "why"),
    [
        pytest.param('{"max_float": 1' + "0" * 400 + "}", "too large", id="401-digit-limit"),
        pytest.param("[" * 100_000 + "]" * 100_000, "not a JSON budget file", id="nested-100000-deep"),
        pytest.param('{"max_float": 3, "max_float": 900}', "given twice", id="duplicate-key"),
    ],
)
def test_hostile_budget_files_are_usage_errors(default_lab, tmp_path, text, why, capsys):
    budget = tmp_path / "budget.json"
    budget.write_text(text)
    assert why in main_error_line(capsys, ["check", default_lab["full"], "--budget", str(budget)], 2)


def test_a_huge_limit_on_the_command_line_is_a_usage_error(default_lab, capsys):
    assert "max_crossings" in main_error_line(capsys, ["check", default_lab["full"], "--max-crossings", "9" * 401], 2)


@pytest.mark.parametrize(
    "extra",
    [["--float", "{fp32}"], ["--inputs", "{npz}"], ["--shape", "x=1,16"], ["--seed", "3"]],
    ids=["float", "inputs", "shape", "seed"],
)
def test_sample_options_without_min_sqnr_are_refused(default_lab, tmp_path, extra, capsys):
    np.savez(tmp_path / "x.npz", x=np.zeros((1, 16), np.float32))
    extra = [e.format(fp32=default_lab["fp32"], npz=tmp_path / "x.npz") for e in extra]
    line = main_error_line(capsys, ["check", default_lab["full"], "--max-float", "9", *extra], 2)
    assert extra[0] in line and "--min-sqnr" in line
    budget = tmp_path / "budget.json"
    budget.write_text('{"min_sqnr": -1000}')  # from the file, min_sqnr makes them apply
    if extra[0] != "--float":
        extra += ["--float", str(default_lab["fp32"])]
    assert run_main(capsys, ["check", default_lab["full"], "--budget", str(budget), *extra])[0] == 0


def relu_model(path, dims):
    """y = Relu(x) on ``dims``."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return str(path)


def test_models_with_other_inputs_are_exit_7_never_blamed_on_a_model(tmp_path, capsys):
    """x [1, 4] in the float model, [1, 5] in the quantized one: no sample feeds both."""
    float_path, quant_path = relu_model(tmp_path / "f.onnx", [1, 4]), relu_model(tmp_path / "q.onnx", [1, 5])
    line = main_error_line(capsys, ["check", quant_path, "--float", float_path, "--min-sqnr", "10"], 7)
    assert "input 'x'" in line and "[1, 4]" in line and "[1, 5]" in line


def test_min_sqnr_is_measured_on_the_sample_the_seed_generates(default_lab):
    """The sample is seeded normal data (symbolic dimensions 1), drawn here with numpy."""
    values = []
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((1, DEFAULT_LAB.dim)).astype(np.float32)
        expected = direct_sqnr(default_lab["fp32"], default_lab["full"], [x], "all")
        answer = graphscan.check(default_lab["full"], float_path=default_lab["fp32"], min_sqnr=-100, seed=seed)
        ((value, _limit, _ok),) = budget_rows(answer).values()
        assert value == pytest.approx(expected, abs=1e-6), seed
        values.append(value)
    assert values[0] != values[1]


def test_an_empty_sample_never_holds_min_sqnr(default_lab):
    """A zero-size input compares nothing: the SQNR is undefined (null) and the gate closed."""
    answer = graphscan.check(
        str(default_lab["full"]), float_path=str(default_lab["fp32"]), min_sqnr=-1000, shape=[f"x=0,{DEFAULT_LAB.dim}"]
    )
    assert budget_rows(answer) == {"min_sqnr": (None, -1000.0, False)}


@pytest.mark.parametrize(("value", "accepted"), [(0, True), (1, True), (0.5, True), (-0.01, False), (1.01, False)])
def test_min_int8_takes_every_fraction_from_0_to_1_both_ends_included(value, accepted):
    if accepted:
        assert graphscan.budget_limit("min_int8", value, "--min-int8") == value
        return
    with pytest.raises(graphscan.GraphscanError) as raised:
        graphscan.budget_limit("min_int8", value, "--min-int8")
    assert raised.value.exit_code == graphscan.EXIT_USAGE


def test_a_model_with_its_weights_beside_it_runs_with_them_beside_a_counting_budget(tmp_path):
    """One read serves both kinds of budget: it must be the one with the external weights."""
    import gen_models
    from tests.helpers import mlp_with_weights_beside

    beside = mlp_with_weights_beside(tmp_path / "beside", "mlp.onnx", seed=0)
    inline = tmp_path / "inline.onnx"
    onnx.save(gen_models.build_mlp(3, 8, seed=0), inline)
    answer = graphscan.check(str(beside), float_path=str(inline), max_float=100, min_sqnr=100)
    assert budget_rows(answer)["min_sqnr"] == (None, 100.0, True)  # the same weights: equal outputs
    assert answer["ok"] is True
