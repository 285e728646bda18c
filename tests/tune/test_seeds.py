"""tune, faithful to the task (issue 33): on a YOLO-like detector whose output Concat joins box
pixels and class probabilities, onnxruntime's defaults collapse the probabilities under one
scale. tune must see it (every such row names the broken part), reach the fix that is free
in speed (the output's producer kept float), and never say "reached" about a collapsed model.
The written model is judged by numpy on its own outputs, with the partition known from how
the model was built."""

import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from graphscan import GraphscanError
from graphscan_ort.shared.agreement import DEFAULT_TARGET_FLOOR_DB
from graphscan_ort.tune import seeds
from graphscan_ort.tune.verdict import WORST_PART_FLOOR_DB
from tests import yolo_like
from tests.helpers import json_answer, run_graphscan


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    """The detector (width 32: its int8 files are smaller than float), 4 calibration samples
    and 8 held-out ones."""
    folder = tmp_path_factory.mktemp("detector")
    float_path = folder / "float.onnx"
    yolo_like.yolo_like(float_path, width=32)
    (folder / "cal").mkdir()
    (folder / "eval").mkdir()
    calibration = yolo_like.samples(folder / "cal", 4, seed=1)
    evaluation = yolo_like.samples(folder / "eval", 8, seed=2)
    return {"float": float_path, "calibration": calibration, "evaluation": evaluation, "folder": folder}


def tune_args(detector, out, *more):
    calibrate = [a for c in detector["calibration"] for a in ("--calibrate", c)]
    inputs = ["--inputs", detector["folder"] / "eval"]
    return ["tune", detector["float"], *calibrate, *inputs, "--out", out, "--min-speedup", "0", "--runs", "2", *more]


@pytest.fixture(scope="module")
def tuned(detector):
    out = detector["folder"] / "out"
    proc = run_graphscan(tune_args(detector, out))
    return {"answer": json_answer(proc), "code": proc.returncode, "out": out}


def outputs(path, samples):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [session.run(None, dict(np.load(s)))[0].astype(np.float64) for s in samples]


def class_part_sqnr(f, q):
    return 10 * math.log10(np.sum(f[:, 4:] ** 2) / np.sum((f[:, 4:] - q[:, 4:]) ** 2))


def test_the_written_model_keeps_its_class_scores(detector, tuned):
    """Exit 0 is a promise: the class probabilities of the written model are not collapsed."""
    answer = tuned["answer"]
    assert tuned["code"] == 0 and answer["reached"]
    floats = outputs(detector["float"], detector["evaluation"])
    written = outputs(tuned["out"] / "model.onnx", detector["evaluation"])
    f, q = np.concatenate(floats), np.concatenate(written)
    assert class_part_sqnr(f, q) > WORST_PART_FLOOR_DB
    assert len(np.unique(np.round(q[:, 4:], 6))) > 16  # not two values


def test_every_collapsed_row_names_its_broken_part_and_is_never_chosen(tuned):
    answer = tuned["answer"]
    broken = [c for c in answer["candidates"] if c["broken_parts"]]
    assert broken  # onnxruntime's defaults among them
    for row in broken:
        assert {(p["output"], p["part"], p["node"]) for p in row["broken_parts"]} == {("output0", 1, "cls_sigmoid")}
        assert row["id"] != answer["chosen"]
    default = next(c for c in broken if c["quantize_static"]["activation_type"] == "QInt8")
    assert default["worst_part"] == {"output": "output0", "part": 1, "node": "cls_sigmoid"}
    assert default["levels"]["value"] < 1 and default["levels"]["part"] == 1


def test_the_default_target_is_the_floor_where_onnxruntimes_defaults_are_poor(tuned):
    answer = tuned["answer"]
    assert answer["target"] == {"value": DEFAULT_TARGET_FLOOR_DB, "source": "floor"}
    assert "output0 part 1 (from cls_sigmoid)" in answer["warnings"][0]


def test_the_output_producer_kept_float_is_tried_and_chosen(tuned):
    answer = tuned["answer"]
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    assert chosen["kept_float"] == [{"node": "head_concat", "why": "outputs"}]
    assert chosen["quantize_static"]["nodes_to_exclude"] == ["head_concat"]
    assert chosen["excluded"] == {"head_concat": "float"} and chosen["broken_parts"] == []


def test_each_rows_spread_is_its_metric_sample_by_sample(detector, tuned):
    """metric_worst and metric_spread of the chosen row: the worst part's SQNR of each held-out
    sample alone, computed in numpy on the written model."""
    answer = tuned["answer"]
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    samples = sorted((detector["folder"] / "eval").glob("*.npz"))
    per_sample = []
    for f, q in zip(outputs(detector["float"], samples), outputs(tuned["out"] / "model.onnx", samples), strict=True):
        parts = [
            10 * math.log10(np.sum(f[:, rows] ** 2) / np.sum((f[:, rows] - q[:, rows]) ** 2))
            for rows in (slice(0, 4), slice(4, None))
        ]
        per_sample.append(min(parts))
    assert chosen["metric_worst"]["value"] == pytest.approx(min(per_sample), abs=1e-6)
    assert per_sample[chosen["metric_worst"]["sample"]] == pytest.approx(min(per_sample), abs=1e-6)
    expected = np.percentile(per_sample, [25, 75], method="nearest")
    np.testing.assert_allclose(chosen["metric_spread"], expected, atol=1e-6)


def test_user_seeds_go_into_every_row_and_a_metrics_events_are_reported(detector, tmp_path):
    metric = tmp_path / "boxes.py"
    metric.write_text(
        "import numpy as np\n"
        "def agree(reference, candidate):\n"
        "    f = np.concatenate([r['output0'] for r in reference])\n"
        "    q = np.concatenate([c['output0'] for c in candidate])\n"
        "    fired = f[:, 4:] > 0.5\n"
        "    return float(np.mean((q[:, 4:] > 0.5) == fired)), int(fired.sum())\n"
    )
    proc = run_graphscan(
        tune_args(detector, tmp_path / "out", "--keep-outputs-float", "--metric", f"{metric}:agree", "--target", "0.5")
    )
    answer = json_answer(proc)
    measured = [c for c in answer["candidates"] if c["error"] is None]
    assert all("head_concat" in c["quantize_static"]["nodes_to_exclude"] for c in measured)
    assert all({"node": "head_concat", "why": "--keep-outputs-float"} in c["kept_float"] for c in measured)
    fired = sum(int((f[:, 4:] > 0.5).sum()) for f in outputs(detector["float"], detector["evaluation"]))
    assert all(c["metric_events"] == fired for c in measured)
    assert answer["evaluation"]["events"] == fired


def test_an_unknown_node_to_exclude_is_a_usage_error(detector, tmp_path):
    proc = run_graphscan(tune_args(detector, tmp_path / "out", "--exclude", "no_such_node"))
    assert proc.returncode == 2
    assert proc.stderr.decode().strip().endswith("has no node of that name")
    assert not (tmp_path / "out").exists()


def conv_batchnorm(folder, channels=8):
    """x -> conv1 -> bn (BatchNormalization) -> relu -> conv2 -> y, and 4 samples (2 to
    calibrate, 2 held out): quant_pre_process folds bn into conv1. Returns the model's path,
    its initializers by name, and the samples."""
    rng = np.random.default_rng(0)
    weights = {
        "w1": rng.standard_normal((channels, 3, 3, 3)).astype(np.float32),
        "b1": rng.standard_normal(channels).astype(np.float32),
        "gamma": rng.uniform(0.5, 1.5, channels).astype(np.float32),
        "beta": rng.standard_normal(channels).astype(np.float32),
        "mean": rng.standard_normal(channels).astype(np.float32),
        "var": rng.uniform(0.5, 1.5, channels).astype(np.float32),
        "w2": (0.2 * rng.standard_normal((channels, channels, 3, 3))).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "gamma", "beta", "mean", "var"], ["bn_out"], name="bn"),
        helper.make_node("Relu", ["bn_out"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 8, 8])],
        [onnx.numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    path = folder / "conv_bn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    samples = []
    for k in range(4):
        samples.append(str(folder / f"s{k}.npz"))
        np.savez(samples[-1], x=rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    return path, weights, samples


def test_an_excluded_node_prepare_folds_away_is_followed_to_the_node_that_runs_it(tmp_path):
    """--exclude bn, which quant_pre_process folds into conv1: every row keeps conv1 float and
    says it holds bn; no row claims anything of bn, which no model tune writes holds. The
    written conv1 is float and holds bn's scale and shift: its weight is w1 * gamma /
    sqrt(var + eps) and its bias (b1 - mean) * gamma / sqrt(var + eps) + beta (numpy), and
    onnxruntime runs it as a float Conv reading x, not a QLinearConv behind a QuantizeLinear."""
    path, w, samples = conv_batchnorm(tmp_path)
    proc = run_graphscan(
        ["tune", path, "--calibrate", samples[0], "--calibrate", samples[1], "--inputs", samples[2],
         "--inputs", samples[3], "--out", tmp_path / "out", "--exclude", "bn", "--runs", "1", "--min-speedup", "0"]
    )  # fmt: skip
    answer = json_answer(proc)
    measured = [c for c in answer["candidates"] if c["error"] is None]
    assert measured and all(
        c["kept_float"] == [{"node": "conv1", "why": "--exclude", "folded": "bn"}] for c in measured
    )
    assert all(c["excluded"] == {"conv1": "float"} for c in measured)
    assert all("bn" not in (c["quantize_static"] or c["quantize_dynamic"])["nodes_to_exclude"] for c in measured)
    written = onnx.load(tmp_path / "out" / "model.onnx")
    assert not any(n.op_type == "BatchNormalization" or n.name == "bn" for n in written.graph.node)
    conv1 = next(n for n in written.graph.node if n.name == "conv1")
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in written.graph.initializer}
    assert conv1.input[1] in weights and conv1.input[2] in weights  # float initializers, no DequantizeLinear
    scale = w["gamma"].astype(np.float64) / np.sqrt(w["var"].astype(np.float64) + 1e-5)
    np.testing.assert_allclose(weights[conv1.input[1]], w["w1"] * scale[:, None, None, None], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights[conv1.input[2]], (w["b1"] - w["mean"]) * scale + w["beta"], rtol=1e-5, atol=1e-5)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(tmp_path / "optimized.onnx")
    reads_x = [n.op_type for n in optimized.graph.node if "x" in n.input]  # conv1, whatever its kernel's name
    assert reads_x == ["Conv"], reads_x  # a float Conv: a quantized one reads x through a QuantizeLinear


def test_a_node_followed_through_a_fusion_and_one_nothing_runs():
    """The model quant_pre_process makes of gen_models' MLP fuses each MatMul and the Add after
    it into one Gemm: either is followed to it (fc1_matmul/MatMulAddFusion makes fc1_add's
    output), a Relu stays itself; a node computed from constants alone becomes an initializer
    there (constant folding) and nothing runs it."""
    import gen_models

    original = gen_models.build_mlp(2, 4, 0, ("N",))
    fused = onnx.ModelProto()
    fused.CopyFrom(original)
    matmul, add = (n for n in fused.graph.node if n.name in ("fc1_matmul", "fc1_add"))
    gemm = helper.make_node("Gemm", [matmul.input[0], matmul.input[1], add.input[1]], list(add.output))
    gemm.name = "fc1_matmul/MatMulAddFusion"
    nodes = [gemm if n is matmul else n for n in fused.graph.node if n is not add]
    del fused.graph.node[:]
    fused.graph.node.extend(nodes)
    assert seeds.where_it_runs("fc1_add", original, fused) == "fc1_matmul/MatMulAddFusion"
    assert seeds.where_it_runs("fc1_matmul", original, fused) == "fc1_matmul/MatMulAddFusion"
    assert seeds.where_it_runs("fc1_relu", original, fused) == "fc1_relu"
    folded = onnx.ModelProto()
    folded.CopyFrom(original)  # fc2_add's output made an initializer: nothing of fc2_add runs
    keep = [n for n in folded.graph.node if n.name != "fc2_add"]
    del folded.graph.node[:]
    folded.graph.node.extend(keep)
    assert seeds.where_it_runs("fc2_add", original, folded) is None
    given = [{"node": "fc1_add", "why": "--exclude"}, {"node": "fc2_add", "why": "--keep-outputs-float"}]
    assert seeds.followed(given, original, folded, "mlp.onnx") == [{"node": "fc1_add", "why": "--exclude"}]
    with pytest.raises(GraphscanError, match=r"^usage: --exclude 'fc2_add': preparing mlp.onnx .* removes it"):
        seeds.followed([{"node": "fc2_add", "why": "--exclude"}], original, folded, "mlp.onnx")


def test_a_seed_fused_away_is_followed_to_its_nearest_reader_that_runs():
    """a is gone; of its readers (gone too, fused with it), b's output is made by x, while c's
    reader e is gone as well and e's output made by z: breadth first, the nearest, x."""
    original = helper.make_graph(
        [
            helper.make_node("Relu", ["in"], ["ta"], name="a"),
            helper.make_node("Relu", ["ta"], ["tb"], name="b"),
            helper.make_node("Relu", ["ta"], ["tc"], name="c"),
            helper.make_node("Relu", ["tc"], ["te"], name="e"),
            helper.make_node("Add", ["tb", "te"], ["out"], name="add"),
        ],
        "original",
        [helper.make_tensor_value_info("in", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])],
    )
    given = helper.make_graph(
        [
            helper.make_node("Relu", ["in"], ["tb"], name="x"),
            helper.make_node("Relu", ["in"], ["te"], name="z"),
            helper.make_node("Add", ["tb", "te"], ["out"], name="add"),
        ],
        "given",
        list(original.input),
        list(original.output),
    )
    assert seeds.where_it_runs("a", helper.make_model(original), helper.make_model(given)) == "x"


def test_a_node_excluded_that_also_makes_an_output_says_it_was_excluded():
    """--exclude narrow --exclude cat with --keep-outputs-float: cat, the output's producer,
    is the user's --exclude, listed once; without --exclude cat, it is --keep-outputs-float's."""
    from graphscan_ort.tune.command import seed_rows

    model = concat_of(1.0, 320.0)
    assert seed_rows(model, ["narrow", "cat"], True, "m.onnx") == [
        {"node": "narrow", "why": "--exclude"},
        {"node": "cat", "why": "--exclude"},
    ]
    assert seed_rows(model, ["narrow"], True, "m.onnx") == [
        {"node": "narrow", "why": "--exclude"},
        {"node": "cat", "why": "--keep-outputs-float"},
    ]


def test_two_seeds_followed_to_one_node_exclude_it_once():
    """--exclude conv1 and --exclude bn, which prepare folds into conv1: both seeds are listed
    (one says it holds bn), and the quantizer's nodes_to_exclude names conv1 once."""
    from graphscan_ort.tune.stages import excluding

    kept = [{"node": "conv1", "why": "--exclude"}, {"node": "conv1", "why": "--exclude", "folded": "bn"}]
    assert excluding(kept) == {"nodes_to_exclude": ["conv1"]}
    assert excluding([*kept, {"node": "head", "why": "--keep-outputs-float"}]) == {
        "nodes_to_exclude": ["conv1", "head"]
    }
    assert excluding([]) == {}  # no seed: no key, the quantizer's own default


def test_an_excluded_node_that_prepare_folds_into_a_constant_is_refused(tmp_path):
    """y = x + Mul(c, d), c and d initializers: quant_pre_process folds the Mul into a constant,
    so nothing of it runs in any model tune writes: --exclude of it is exit 2 saying so."""
    nodes = [
        helper.make_node("Mul", ["c", "d"], ["k"], name="scale"),
        helper.make_node("Add", ["x", "k"], ["y"], name="shift"),
    ]
    graph = helper.make_graph(
        nodes,
        "folded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [
            helper.make_tensor("c", TensorProto.FLOAT, [4], [1, 2, 3, 4]),
            helper.make_tensor("d", TensorProto.FLOAT, [], [2]),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "s.npz", x=np.ones((1, 4), np.float32))
    proc = run_graphscan(
        ["tune", tmp_path / "m.onnx", "--calibrate", tmp_path / "s.npz", "--out", tmp_path / "o", "--exclude", "scale"]
    )
    assert proc.returncode == 2 and proc.stdout == b""
    assert proc.stderr.decode().startswith("graphscan: usage: --exclude 'scale': preparing ")
    assert "removes it" in proc.stderr.decode() and proc.stderr.count(b"\n") == 1
    assert not (tmp_path / "o").exists()


def concat_of(low, high):
    """y = Concat(a * low, b * high): inputs whose ranges are ``low`` and ``high`` wide on [0, 1) inputs."""
    nodes = [
        helper.make_node("Mul", ["a", "low"], ["la"], name="narrow"),
        helper.make_node("Mul", ["b", "high"], ["hb"], name="wide"),
        helper.make_node("Concat", ["la", "hb"], ["y"], name="cat", axis=0),
    ]
    graph = helper.make_graph(
        nodes,
        "concat",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
        [
            helper.make_tensor("low", TensorProto.FLOAT, [], [low]),
            helper.make_tensor("high", TensorProto.FLOAT, [], [high]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("low", "high", "wide"),
    [
        pytest.param(1.0, 320.0, True, id="pixels-and-probabilities"),
        pytest.param(1.0, 15.0, False, id="within-the-factor"),
        pytest.param(1.0, 16.0, False, id="exactly-the-factor"),
        pytest.param(320.0, 1.0, True, id="either-order"),
    ],
)
def test_a_concat_is_wide_when_its_inputs_ranges_differ_by_more_than_the_factor(low, high, wide):
    samples = [{"a": np.linspace(0, 1, 4, dtype=np.float32), "b": np.linspace(0, 1, 4, dtype=np.float32)}]
    assert seeds.wide_concats(concat_of(low, high), samples, "m.onnx") == (["cat"] if wide else [])
    assert (max(low, high) / min(low, high) > seeds.WIDE_CONCAT_FACTOR) == wide


def test_a_wide_concat_that_produces_an_output_is_one_structural_seed_not_two():
    """The wide Concat is also the output's producer: the outputs' seed already holds it, so
    the wide Concats' seed, the same node, is not tried again."""
    samples = [{"a": np.linspace(0, 1, 4, dtype=np.float32), "b": np.linspace(0, 1, 4, dtype=np.float32)}]
    model = concat_of(1.0, 320.0)
    assert seeds.wide_concats(model, samples, "m.onnx") == ["cat"] and seeds.output_producers(model) == ["cat"]
    assert seeds.structural_seeds(model, samples, "m.onnx", []) == [("outputs", ["cat"])]


def concat_of_scaled(*factors):
    """y = Concat(a * f for f in ``factors``): on a of [0, 1], input k spans ``factors[k]`` (0: never varies)."""
    scales = [helper.make_tensor(f"f{k}", TensorProto.FLOAT, [], [f]) for k, f in enumerate(factors)]
    nodes = [helper.make_node("Mul", ["a", f"f{k}"], [f"m{k}"], name=f"mul{k}") for k in range(len(factors))]
    nodes.append(helper.make_node("Concat", [f"m{k}" for k in range(len(factors))], ["y"], name="cat", axis=0))
    graph = helper.make_graph(
        nodes,
        "concat",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4 * len(factors)])],
        scales,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("factors", "wide"),
    [
        pytest.param((1.0, 10.0, 0.0), False, id="ranges-1-and-10-beside-one-that-never-varies"),
        pytest.param((1.0, 0.0), False, id="one-varying-input-and-a-constant-one"),
        pytest.param((0.5, 10.0, 0.0), True, id="ranges-0.5-and-10-beside-one-that-never-varies"),
    ],
)
def test_a_concat_input_that_never_varies_is_left_out_of_the_comparison(factors, wide):
    """A Concat input whose range is 0 (a * 0: zeros on every sample) takes no levels of the
    shared scale, so it is left out: of the inputs that vary, ranges 1 and 10 lie within the
    factor 16 (not wide) and 0.5 and 10 beyond it (20 times: wide); one varying input has
    nothing to differ from. Counted, its 0 would make every such Concat wide (10 > 16 * 0)."""
    samples = [{"a": np.linspace(0, 1, 4, dtype=np.float32)}, {"a": np.linspace(0, 1, 4, dtype=np.float32)[::-1]}]
    assert seeds.wide_concats(concat_of_scaled(*factors), samples, "m.onnx") == (["cat"] if wide else [])


def concat_with_constant(values):
    """y = Concat(a, c): the input a on [0, 1] beside the initializer c holding ``values``."""
    graph = helper.make_graph(
        [helper.make_node("Concat", ["a", "c"], ["y"], name="cat", axis=0)],
        "concat",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4 + len(values)])],
        [helper.make_tensor("c", TensorProto.FLOAT, [len(values)], values)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("values", "wide"),
    [
        pytest.param([0.0, 100.0, 200.0, 320.0], True, id="a-constant-320-wide-beside-a-range-of-1"),
        pytest.param([-5.0, 0.0, 10.0], False, id="a-constant-15-wide-within-the-factor"),
        pytest.param([7.0, 7.0], False, id="a-constant-that-never-varies"),
    ],
)
def test_a_constant_concat_input_counts_by_the_spread_of_its_values(values, wide):
    """The Concat's output scale spans a constant input's values as it spans an activation's:
    beside a of range 1, a constant of range 320 makes a step of 320 / 255 = 1.25, wider than
    all of a (wide); one of range 15 lies within the factor 16, and one of equal values (range
    0) takes no levels and is left out."""
    samples = [{"a": np.linspace(0, 1, 4, dtype=np.float32)}]
    assert seeds.wide_concats(concat_with_constant(values), samples, "m.onnx") == (["cat"] if wide else [])


def test_the_answer_is_strict_json_with_the_new_keys_in_place(tuned):
    row = tuned["answer"]["candidates"][0]
    keys = list(row)
    assert keys.index("kept_float") == keys.index("rewrites") + 1
    assert keys[keys.index("sqnr_db") : keys.index("sqnr_db") + 3] == ["sqnr_db", "pooled_sqnr_db", "worst_part"]
    for key in ("metric_events", "metric_worst", "metric_spread", "levels", "broken_parts"):
        assert key in row
    json.dumps(tuned["answer"], allow_nan=False)


def test_the_search_tries_the_worst_parts_neighbourhood_first(tmp_path):
    """blocks.part_blocks: the node the worst part comes from, then with its nearest upstream
    operators (breadth first); nothing on a model whose outputs are one part."""
    from graphscan_ort.tune.blocks import part_blocks

    model = yolo_like.yolo_like(tmp_path / "d.onnx")
    blocks = part_blocks(model, "cls_sigmoid", frozenset())
    assert [b.nodes for b in blocks] == [
        ("cls_sigmoid",),
        ("cls_sigmoid", "cls_conv"),
        ("cls_sigmoid", "cls_conv", "relu2", "conv2"),
    ]
    assert all(b.kind == "part" for b in blocks)
    assert [b.nodes for b in part_blocks(model, "cls_sigmoid", frozenset({"cls_conv"}))][1] == ("cls_sigmoid", "relu2")
    single = onnx.load(tmp_path / "d.onnx")
    single.graph.node.pop()  # the Concat: its one output is now the class branch alone
    single.graph.output[0].name = "probs"
    assert part_blocks(single, "cls_sigmoid", frozenset()) == []


def test_a_part_below_either_floor_is_broken(tmp_path):
    """verdict.py on its own: the worst part's SQNR against 6 dB, and the levels of each part
    of an output's quantized tensor against 16 (the class part under one scale: under 1)."""
    from graphscan_ort.engines.levels import FloatRanges
    from graphscan_ort.tune.verdict import levels_figures, sqnr_broken

    part = {"output": "y", "part": 1, "node": "n"}
    assert sqnr_broken(WORST_PART_FLOOR_DB - 0.1, part) == [{**part, "why": "SQNR 5.9 dB (floor 6 dB)"}]
    assert sqnr_broken(WORST_PART_FLOOR_DB + 0.1, part) == [] and sqnr_broken(None, part) == []
    float_model = yolo_like.yolo_like(tmp_path / "f.onnx", width=32)
    paths = yolo_like.samples(tmp_path, 3)
    ranges = FloatRanges(float_model, [dict(np.load(p)) for p in paths], "f.onnx")
    collapsed = yolo_like.quantized_with_defaults(tmp_path / "f.onnx", tmp_path / "q.onnx", paths)
    levels, broken = levels_figures(collapsed, ranges)
    assert [(b["output"], b["part"], b["node"]) for b in broken] == [("output0", 1, "cls_sigmoid")]
    assert levels["value"] < 1 and "levels of its scale (floor 16)" in broken[0]["why"]


def test_a_low_target_is_never_reached_by_a_collapsed_model(detector, tmp_path):
    """Every candidate meets a target of 0 dB; only one whose parts are whole may be chosen."""
    proc = run_graphscan(tune_args(detector, tmp_path / "out", "--target-sqnr", "0"))
    answer = json_answer(proc)
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    assert proc.returncode == 0 and answer["reached"]
    assert chosen["broken_parts"] == [] and chosen["kept_float"] == [{"node": "head_concat", "why": "outputs"}]
