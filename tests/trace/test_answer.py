"""graphscan.py trace: where a quantized model's error is born.

The strongest checks here do not trust trace's own machinery: a fault is
injected and must be found, the faulty op's isolated error is recomputed in
plain numpy, and the final error is compared with onnxruntime run directly.
"""

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import gen_models
import graphscan
import graphscan_ort.engines.trace as trace_engine
from tests.helpers import json_answer, run_graphscan, run_onnx, saved_arrays, with_weight_scale_times
from tests.lab import TRACE_LAB

FAULTY = "fc2_matmul"
ROW_KEYS = [
    "node",
    "op_type",
    "wrapped",
    "reference",
    "isolated_max_abs",
    "propagated_max_abs",
    "isolated_lsb",
    "sqnr_db",
    "clipped",
    "levels",
]
ANSWER_KEYS = ["a", "b", "inputs", "defaulted", "ops", "outputs", "worst_isolated", "first_over", "unmatched"]


def initializers_of(model):
    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def producer(model, tensor):
    (node,) = [n for n in model.graph.node if tensor in n.output]
    return node


def consumer(model, tensor, op_type):
    (node,) = [n for n in model.graph.node if tensor in n.input and n.op_type == op_type]
    return node


def row_of(answer, node):
    (row,) = [r for r in answer["ops"] if r["node"] == node]
    return row


@pytest.fixture(scope="module")
def faulty(trace_lab, tmp_path_factory):
    """full.onnx with one hidden layer's weight scale multiplied by 1.5."""
    return with_weight_scale_times(trace_lab["full"], FAULTY, 1.5, tmp_path_factory.mktemp("faulty") / "faulty.onnx")


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(11).standard_normal((3, TRACE_LAB.dim)).astype(np.float32)


@pytest.fixture(scope="module")
def inputs_npz(tmp_path_factory, x):
    path = tmp_path_factory.mktemp("inputs") / "x.npz"
    np.savez(path, x=x)
    return path


@pytest.fixture(scope="module")
def faulty_trace(trace_lab, faulty, inputs_npz, tmp_path_factory):
    save = tmp_path_factory.mktemp("saved")
    answer = graphscan.trace(str(trace_lab["fp32"]), str(faulty), inputs=str(inputs_npz), save=str(save))
    return answer, save


def test_answer_shape(faulty_trace, trace_lab):
    answer, _ = faulty_trace
    assert list(answer) == ANSWER_KEYS
    assert answer["inputs"] == {"x": [3, TRACE_LAB.dim]}
    compute = graphscan.islands(str(trace_lab["full"]))["compute"]
    assert len(answer["ops"]) == compute
    for row in answer["ops"]:
        assert list(row) == ROW_KEYS
        assert row["op_type"] not in ("QuantizeLinear", "DequantizeLinear")
    names = [r["node"] for r in answer["ops"]]
    graph_order = [n.name for n in onnx.load(trace_lab["full"]).graph.node if n.name in names]
    assert names == graph_order


def test_injected_fault_is_the_worst_isolated_op(faulty_trace, trace_lab, inputs_npz):
    answer, _ = faulty_trace
    assert answer["worst_isolated"]["node"] == FAULTY
    # Above the clean model's worst isolated error, the first op over is the fault.
    clean = graphscan.trace(str(trace_lab["fp32"]), str(trace_lab["full"]), inputs=str(inputs_npz))
    tolerance = 1.5 * clean["worst_isolated"]["max_abs"]
    assert row_of(answer, FAULTY)["isolated_max_abs"] > tolerance
    over = trace_engine.first_over(answer["ops"], tolerance)
    assert over["node"] == FAULTY
    # At the default tolerance (1e-2) the first op over is earlier: fc1_matmul, whose
    # input and weight are both rounded, is already over it (test_holes_trace pins 1e-2).
    first = answer["ops"][0]
    assert first["node"] == "fc1_matmul" and first["isolated_max_abs"] > 1e-2
    assert answer["first_over"] == {"node": "fc1_matmul", "max_abs": first["isolated_max_abs"]}


def test_errors_before_the_fault_are_unchanged_by_it(faulty_trace, trace_lab, inputs_npz):
    answer, _ = faulty_trace
    clean = graphscan.trace(str(trace_lab["fp32"]), str(trace_lab["full"]), inputs=str(inputs_npz))
    names = [r["node"] for r in answer["ops"]]
    before = names.index(FAULTY)
    assert answer["ops"][:before] == clean["ops"][:before]
    # Isolation: ops after the fault get perfect inputs, so their isolated error stays.
    for row, clean_row in zip(answer["ops"][before + 1 :], clean["ops"][before + 1 :], strict=True):
        assert row["isolated_max_abs"] == pytest.approx(clean_row["isolated_max_abs"], rel=1e-6)
        assert row["propagated_max_abs"] >= clean_row["propagated_max_abs"] * 0.5


def quantize(values, scale, zero_point):
    """QuantizeLinear: round half to even, add the zero point, saturate."""
    info = np.iinfo(zero_point.dtype)
    q = np.rint(values / scale) + zero_point.astype(np.int64)
    return np.clip(q, info.min, info.max).astype(zero_point.dtype)


def dequantize(q, scale, zero_point):
    return ((q.astype(np.int64) - zero_point.astype(np.int64)) * scale).astype(np.float32)


def test_faulty_isolated_error_matches_numpy(faulty_trace, trace_lab, faulty, x):
    fp32 = initializers_of(onnx.load(trace_lab["fp32"]))
    quant_model = onnx.load(faulty)
    quant = initializers_of(quant_model)
    # Float reference input of fc2_matmul: layer 1 of the fp32 model, in numpy.
    h1 = np.maximum(x @ fp32["fc1_weight"] + fp32["fc1_bias"], 0).astype(np.float32)
    reference = (h1 @ fp32["fc2_weight"]).astype(np.float32)

    (matmul,) = [n for n in quant_model.graph.node if n.name == FAULTY]
    a_dq, w_dq = producer(quant_model, matmul.input[0]), producer(quant_model, matmul.input[1])
    a_scale, a_zp = quant[a_dq.input[1]], quant[a_dq.input[2]]
    a = dequantize(quantize(h1, a_scale, a_zp), a_scale, a_zp)
    w = dequantize(quant[w_dq.input[0]], quant[w_dq.input[1]], quant[w_dq.input[2]])
    out_q = consumer(quant_model, matmul.output[0], "QuantizeLinear")
    o_scale, o_zp = quant[out_q.input[1]], quant[out_q.input[2]]
    out = dequantize(quantize((a @ w).astype(np.float32), o_scale, o_zp), o_scale, o_zp)

    row = row_of(faulty_trace[0], FAULTY)
    expected = float(np.max(np.abs(out - reference)))
    assert row["isolated_max_abs"] == pytest.approx(expected, rel=1e-5)
    assert row["isolated_lsb"] == pytest.approx(expected / float(o_scale), rel=1e-5)


def test_final_output_equals_direct_onnxruntime(faulty_trace, trace_lab, faulty, x):
    answer, _ = faulty_trace
    (expected,) = run_onnx(trace_lab["fp32"], {"x": x})
    (actual,) = run_onnx(faulty, {"x": x})
    direct = float(np.max(np.abs(expected.astype(np.float64) - actual)))
    assert answer["outputs"] == {"y": pytest.approx(direct, rel=1e-6)}
    last = [r for r in answer["ops"] if r["reference"] == "y"]
    assert [r["propagated_max_abs"] for r in last] == [pytest.approx(direct, rel=1e-6)]
    noise = np.linalg.norm(expected.astype(np.float64) - actual)
    sqnr = 20 * np.log10(np.linalg.norm(expected.astype(np.float64)) / noise)
    assert last[0]["sqnr_db"] == pytest.approx(sqnr, rel=1e-6)


def test_saved_single_op_model_reruns_to_its_row(faulty_trace):
    answer, folder = faulty_trace
    index = json.loads((folder / "index.json").read_text())
    saved = sorted(p.name for p in folder.iterdir())
    nodes = [r["node"] for r in answer["ops"] if r["isolated_max_abs"] is not None]
    assert list(index) == nodes
    stems = index.values()
    assert saved == sorted([f"{s}.onnx" for s in stems] + [f"{s}.npz" for s in stems] + ["index.json"])
    for row in answer["ops"]:
        model_path = folder / f"{index[row['node']]}.onnx"
        onnx.checker.check_model(onnx.load(model_path))
        feeds, reference = saved_arrays(folder / f"{index[row['node']]}.npz")
        (out,) = run_onnx(model_path, feeds)
        error = float(np.max(np.abs(reference.astype(np.float64) - out)))
        assert error == pytest.approx(row["isolated_max_abs"], rel=1e-6, abs=1e-9), row["node"]


@pytest.mark.parametrize("variant", ["fp32", "full"])
def test_identical_models_give_all_zeros(trace_lab, variant):
    path = str(trace_lab[variant])
    answer = graphscan.trace(path, path)
    assert answer["ops"], "no rows to check"
    for row in answer["ops"]:
        assert row["reference"] is not None
        assert row["isolated_max_abs"] == 0.0 and row["propagated_max_abs"] == 0.0
        assert row["sqnr_db"] is None  # no noise: the ratio is infinite, shown as null
    assert set(answer["outputs"].values()) == {0.0}
    assert answer["first_over"] is None
    assert answer["unmatched"] == []


def test_absorbed_relu_compares_the_add_with_post_relu(trace_lab, x, inputs_npz):
    answer = graphscan.trace(str(trace_lab["fp32"]), str(trace_lab["full"]), inputs=str(inputs_npz))
    fp32 = onnx.load(trace_lab["fp32"])
    for layer in range(1, TRACE_LAB.layers + 1):
        _, add, relu = gen_models.layer_names(layer)
        row = row_of(answer, add)
        assert producer(fp32, row["reference"]).name == relu
        assert {"node": relu, "op_type": "Relu"}.items() <= next(
            u for u in answer["unmatched"] if u["node"] == relu
        ).items()
    # Against the pre-Relu sum the same Add would look far worse (the value it
    # passes on is clamped at 0), so matching the post-Relu tensor matters.
    weights = initializers_of(fp32)
    pre_relu = x @ weights["fc1_weight"] + weights["fc1_bias"]
    assert np.min(pre_relu) < -10 * row_of(answer, "fc1_add")["propagated_max_abs"]


@pytest.mark.parametrize("fold", [False, True], ids=["batchnorm", "folded"])
def test_cnn_runs_end_to_end(tmp_path, fold):
    model = gen_models.build_cnn(2, channels=4, size=8, seed=1, fold_batchnorm=fold)
    fp32, quant = tmp_path / "cnn.onnx", tmp_path / "cnn_q.onnx"
    onnx.save(model, fp32)
    gen_models.quantize_qdq(fp32, quant, seed=0)
    x = np.random.default_rng(4).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)

    answer = graphscan.trace(str(fp32), str(quant), inputs=str(tmp_path / "x.npz"))
    op_types = {r["op_type"] for r in answer["ops"]}
    assert {"Conv", "Resize", "Concat", "Add", "Gemm"} <= op_types
    assert ("BatchNormalization" in op_types) != fold
    for row in answer["ops"]:
        assert row["reference"] is not None, row
        assert row["isolated_max_abs"] is not None and row["propagated_max_abs"] is not None
    (expected,), (actual,) = run_onnx(fp32, {"x": x}), run_onnx(quant, {"x": x})
    assert answer["outputs"]["y"] == pytest.approx(float(np.max(np.abs(expected - actual))), rel=1e-6)


def test_dynamic_model_runs_with_unmatched_rows(trace_lab):
    answer = graphscan.trace(str(trace_lab["fp32"]), str(trace_lab["dynamic"]))
    rows = {r["node"]: r for r in answer["ops"]}
    assert rows["fc1_matmul_quant"]["reference"] is None  # MatMulInteger has no float twin
    assert rows["fc1_matmul_quant"]["isolated_max_abs"] is None
    assert rows["fc1_add"]["reference"] == "fc1_sum"
    assert {u["node"] for u in answer["unmatched"]} == {f"fc{i}_matmul" for i in range(1, TRACE_LAB.layers + 1)}


def test_unsafe_node_names_are_saved_file_safe(tmp_path):
    model = gen_models.build_mlp(3, 8, seed=0)
    for node in model.graph.node:
        node.name = node.name.replace("fc1_", "blocks.0/fc 1:")
    onnx.save(model, tmp_path / "fp32.onnx")
    answer = graphscan.trace(*[str(tmp_path / "fp32.onnx")] * 2, save=str(tmp_path / "saved"))
    assert "blocks.0/fc 1:matmul" in [r["node"] for r in answer["ops"]]
    index = json.loads((tmp_path / "saved" / "index.json").read_text())
    stem = index["blocks.0/fc 1:matmul"]
    assert stem.startswith("blocks.0_fc_1_matmul-")  # unsafe characters out, a hash of the name in
    assert (tmp_path / "saved" / f"{stem}.onnx").exists()
    assert (tmp_path / "saved" / f"{stem}.npz").exists()


def test_trace_by_subprocess(trace_lab, inputs_npz, tmp_path):
    answer = json_answer(
        run_graphscan(
            ["trace", trace_lab["fp32"], trace_lab["full"], "--inputs", inputs_npz, "--tolerance", "0.03"],
            cwd=tmp_path,
        )
    )
    assert list(answer) == ANSWER_KEYS
    # The first row over 0.03, measured in-process on the same input.
    expected = graphscan.trace(str(trace_lab["fp32"]), str(trace_lab["full"]), inputs=str(inputs_npz), tolerance=0.03)
    over = [r for r in expected["ops"] if r["isolated_max_abs"] > 0.03]
    assert over and over[0] != expected["ops"][-1]
    assert answer["first_over"] == {"node": over[0]["node"], "max_abs": over[0]["isolated_max_abs"]}
    assert answer == expected


def write_model_with_input(path, name):
    model = gen_models.build_mlp(3, 8, seed=0)
    model.graph.input[0].name = name
    model.graph.node[0].input[0] = name
    onnx.save(model, path)


def test_error_exits(tmp_path, trace_lab, capsys):
    other = tmp_path / "other.onnx"
    write_model_with_input(other, "z")
    (tmp_path / "junk.npz").write_bytes(b"not an npz")
    np.savez(tmp_path / "wrong.npz", z=np.zeros((1, 8), np.float32))
    custom = gen_models.build_mlp(3, TRACE_LAB.dim, seed=0)
    custom.graph.node[1].op_type, custom.graph.node[1].domain = "Mystery", "example.custom"
    custom.opset_import.append(onnx.helper.make_opsetid("example.custom", 1))
    onnx.save(custom, tmp_path / "custom.onnx")
    fp32, full = str(trace_lab["fp32"]), str(trace_lab["full"])
    cases = [
        (["trace", fp32, str(other)], graphscan.EXIT_INPUTS, "inputs differ"),
        (["trace", fp32, full, "--inputs", str(tmp_path / "wrong.npz")], graphscan.EXIT_INPUTS, "no array for input x"),
        (["trace", fp32, full, "--inputs", str(tmp_path / "junk.npz")], graphscan.EXIT_INPUTS, "not an .npz"),
        (["trace", fp32, full, "--inputs", str(tmp_path / "none.npz")], graphscan.EXIT_NO_FILE, "none.npz"),
        (["trace", fp32, str(tmp_path / "custom.onnx")], graphscan.EXIT_RUNTIME, "does not run"),
        (["trace", fp32, full, "--tolerance", "abc"], graphscan.EXIT_USAGE, "invalid float"),
        (["trace", fp32], graphscan.EXIT_USAGE, "required"),
    ]
    for argv, code, message in cases:
        assert graphscan.main(argv) == code, argv
        out, err = capsys.readouterr()
        assert out == "", argv
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
