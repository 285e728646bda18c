"""graphscan.py fuse: MatMul+Add -> Gemm on any model, with one test per skip reason."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.commands.fuse as fuse_command
from tests.helpers import fuse_with_transposed_b, json_answer, run_graphscan, run_onnx

RNG = np.random.default_rng(7)


def initializer(name, shape):
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def save_graph(path, nodes, inputs, outputs, initializers):
    """Save a small float graph; ``inputs``/``outputs`` are ``{name: shape}``."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return str(path)


def matmul_add(a="a", b="B", c="C", extra=()):
    """MatMul(a, b) -> Add(., c) -> y, plus any extra nodes."""
    return [
        helper.make_node("MatMul", [a, b], ["mm"], name="mm_node"),
        helper.make_node("Add", ["mm", c], ["y"], name="add_node"),
        *extra,
    ]


def test_lab_model_fuses_every_layer(tmp_path):
    source = tmp_path / "fp32.onnx"
    onnx.save(gen_models.build_mlp(4, 8, seed=3), source)
    answer = graphscan.fuse(str(source), str(tmp_path / "gemm.onnx"))
    assert list(answer) == ["model", "output", "fused", "skipped", "max_abs_error"]
    assert answer["fused"] == [
        {"matmul": f"fc{i}_matmul", "add": f"fc{i}_add", "gemm": f"fc{i}_matmul_gemm"} for i in range(1, 5)
    ]
    assert answer["skipped"] == []
    assert answer["max_abs_error"] <= 1e-5

    fused = onnx.load(tmp_path / "gemm.onnx")
    onnx.checker.check_model(fused, full_check=True)
    gemms = [n for n in fused.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 4
    for gemm in gemms:  # default attributes: alpha=beta=1, no transposes
        assert list(gemm.attribute) == []
    assert graphscan.nodes(str(tmp_path / "gemm.onnx"))["op_types"] == {"Gemm": 4, "Relu": 4}


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_fused_model_matches_on_any_batch(tmp_path, batch):
    source, target = tmp_path / "fp32.onnx", tmp_path / "gemm.onnx"
    onnx.save(gen_models.build_mlp(3, 16, seed=1), source)
    graphscan.fuse(str(source), str(target))
    x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
    (expected,), (actual,) = run_onnx(source, {"x": x}), run_onnx(target, {"x": x})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_three_d_input_is_refused(tmp_path):
    source = tmp_path / "fp32.onnx"
    onnx.save(gen_models.build_mlp(3, 8, seed=0, input_shape=("N", 5)), source)
    answer = graphscan.fuse(str(source), str(tmp_path / "out.onnx"))
    assert answer["fused"] == []
    assert answer["skipped"] == [{"node": f"fc{i}_matmul", "reason": fuse_command.SKIP_A_NOT_RANK_2} for i in (1, 2, 3)]
    assert graphscan.nodes(str(tmp_path / "out.onnx"))["op_types"]["MatMul"] == 3


def skip_case(reason, nodes, inputs, initializers, outputs=None, case_id=None):
    return pytest.param(reason, nodes, inputs, initializers, outputs or {"y": [2, 4]}, id=case_id)


SKIP_CASES = [
    skip_case(
        fuse_command.SKIP_OUTPUT_SHARED,
        matmul_add(extra=[helper.make_node("Relu", ["mm"], ["r"], name="relu")]),
        {"a": [2, 3]},
        [initializer("B", [3, 4]), initializer("C", [4])],
        outputs={"y": [2, 4], "r": [2, 4]},
        case_id="matmul-output-also-feeds-relu",
    ),
    skip_case(
        fuse_command.SKIP_OUTPUT_SHARED,
        matmul_add(),
        {"a": [2, 3]},
        [initializer("B", [3, 4]), initializer("C", [4])],
        outputs={"y": [2, 4], "mm": [2, 4]},
        case_id="matmul-output-is-graph-output",
    ),
    skip_case(
        fuse_command.SKIP_OUTPUT_SHARED,
        [
            helper.make_node("MatMul", ["a", "B"], ["mm"], name="mm_node"),
            helper.make_node("Relu", ["mm"], ["y"], name="relu"),
        ],
        {"a": [2, 3]},
        [initializer("B", [3, 4])],
        case_id="matmul-feeds-no-add",
    ),
    skip_case(
        fuse_command.SKIP_C_NOT_INITIALIZER,
        matmul_add(c="c"),
        {"a": [2, 3], "c": [4]},
        [initializer("B", [3, 4])],
        case_id="add-other-input-is-graph-input",
    ),
    skip_case(
        fuse_command.SKIP_A_NOT_RANK_2,
        matmul_add(),
        {"a": [2, 5, 3]},
        [initializer("B", [3, 4]), initializer("C", [4])],
        outputs={"y": [2, 5, 4]},
        case_id="a-is-rank-3",
    ),
    skip_case(
        fuse_command.SKIP_B_NOT_2D,
        matmul_add(b="b"),
        {"a": [2, 3], "b": [3, 4]},
        [initializer("C", [4])],
        case_id="b-is-graph-input",
    ),
    skip_case(
        fuse_command.SKIP_B_NOT_2D,
        matmul_add(),
        {"a": [2, 3]},
        [initializer("B", [3]), initializer("C", [1])],
        outputs={"y": [2]},
        case_id="b-is-1d",
    ),
    skip_case(
        fuse_command.SKIP_C_NOT_BROADCAST,
        matmul_add(a="a"),
        {"a": [1, 3]},
        [initializer("B", [3, 4]), initializer("C", [5, 4])],
        outputs={"y": [5, 4]},
        case_id="c-rows-exceed-m",
    ),
    skip_case(
        fuse_command.SKIP_C_NOT_BROADCAST,
        matmul_add(),
        {"a": [2, 3]},
        [initializer("B", [3, 4]), initializer("C", [1, 2, 4])],
        outputs={"y": [1, 2, 4]},
        case_id="c-is-rank-3",
    ),
    skip_case(
        fuse_command.SKIP_C_NOT_BROADCAST,
        matmul_add(),
        {"a": ["N", 3]},
        [initializer("B", [3, 4]), initializer("C", [2, 4])],
        outputs={"y": [2, 4]},
        case_id="c-rows-against-symbolic-m",
    ),
]


@pytest.mark.parametrize(("reason", "nodes", "inputs", "initializers", "outputs"), SKIP_CASES)
def test_illegal_pattern_is_skipped_with_its_reason(tmp_path, reason, nodes, inputs, initializers, outputs):
    source = save_graph(tmp_path / "m.onnx", nodes, inputs, outputs, initializers)
    answer = graphscan.fuse(source, str(tmp_path / "out.onnx"))
    assert answer["fused"] == []
    assert answer["skipped"] == [{"node": "mm_node", "reason": reason}]
    assert answer["max_abs_error"] == 0.0  # nothing changed, so nothing differs


@pytest.mark.parametrize(
    ("c_shape", "a_shape"),
    [
        pytest.param([4], ["N", 3], id="c-vector-symbolic-batch"),
        pytest.param([1, 4], [2, 3], id="c-row"),
        pytest.param([2, 1], [2, 3], id="c-column"),
        pytest.param([2, 4], [2, 3], id="c-full"),
        pytest.param([1], [2, 3], id="c-scalar-like"),
    ],
)
def test_broadcastable_c_is_fused(tmp_path, c_shape, a_shape):
    source = save_graph(
        tmp_path / "m.onnx",
        matmul_add(),
        {"a": a_shape},
        {"y": [a_shape[0], 4]},
        [initializer("B", [3, 4]), initializer("C", c_shape)],
    )
    target = tmp_path / "out.onnx"
    answer = graphscan.fuse(source, str(target))
    assert answer["fused"] == [{"matmul": "mm_node", "add": "add_node", "gemm": "mm_node_gemm"}]
    a = RNG.standard_normal([2, 3]).astype(np.float32)
    np.testing.assert_allclose(run_onnx(target, {"a": a})[0], run_onnx(source, {"a": a})[0], rtol=1e-5)


def test_matmul_add_with_c_first_is_fused(tmp_path):
    nodes = [
        helper.make_node("MatMul", ["a", "B"], ["mm"], name="mm_node"),
        helper.make_node("Add", ["C", "mm"], ["y"], name="add_node"),
    ]
    source = save_graph(
        tmp_path / "m.onnx",
        nodes,
        {"a": [2, 3]},
        {"y": [2, 4]},
        [initializer("B", [3, 4]), initializer("C", [4])],
    )
    answer = graphscan.fuse(source, str(tmp_path / "out.onnx"))
    assert [f["gemm"] for f in answer["fused"]] == ["mm_node_gemm"]
    (gemm,) = onnx.load(tmp_path / "out.onnx").graph.node
    assert list(gemm.input) == ["a", "B", "C"] and list(gemm.output) == ["y"]


def test_wrong_fusion_is_caught_and_nothing_written(tmp_path, monkeypatch, capsys):
    """The verification must be able to fail: a transposed B gives other numbers."""
    source = tmp_path / "fp32.onnx"
    onnx.save(gen_models.build_mlp(3, 8, seed=0), source)
    fuse_with_transposed_b(monkeypatch)
    target = tmp_path / "gemm.onnx"
    code = graphscan.main(["fuse", str(source), str(target)])
    out, err = capsys.readouterr()
    assert code == graphscan.EXIT_MISMATCH
    assert out == ""
    assert len(err.splitlines()) == 1 and "differs from the original" in err
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["fp32.onnx"]


def test_fuse_by_subprocess(tmp_path):
    source = tmp_path / "fp32.onnx"
    onnx.save(gen_models.build_mlp(3, 8, seed=0), source)
    answer = json_answer(run_graphscan(["fuse", "fp32.onnx", "gemm.onnx"], cwd=tmp_path))
    assert (answer["model"], answer["output"]) == ("fp32.onnx", "gemm.onnx")
    assert len(answer["fused"]) == 3
    onnx.checker.check_model(onnx.load(tmp_path / "gemm.onnx"), full_check=True)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        pytest.param(["fuse", "missing.onnx", "out.onnx"], graphscan.EXIT_NO_FILE, id="missing-input"),
        pytest.param(["fuse", "fp32.onnx", "no/such/dir/out.onnx"], graphscan.EXIT_NO_FILE, id="output-folder-missing"),
        pytest.param(["fuse", "fp32.onnx"], graphscan.EXIT_USAGE, id="no-output-path"),
        pytest.param(["fuse", "junk.onnx", "out.onnx"], graphscan.EXIT_NOT_ONNX, id="not-onnx"),
    ],
)
def test_fuse_errors(tmp_path, monkeypatch, capsys, argv, code):
    monkeypatch.chdir(tmp_path)
    onnx.save(gen_models.build_mlp(3, 8, seed=0), tmp_path / "fp32.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\xff\x00 not a model")
    assert graphscan.main(argv) == code
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.onnx").exists()


def test_model_that_does_not_run_is_reported(tmp_path, capsys):
    # Valid protobuf and shape-inferable, but the custom op has no kernel.
    nodes = [helper.make_node("Mystery", ["a"], ["y"], name="m", domain="example.custom")]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)],
    )
    onnx.save(model, tmp_path / "m.onnx")
    code = graphscan.main(["fuse", str(tmp_path / "m.onnx"), str(tmp_path / "out.onnx")])
    out, err = capsys.readouterr()
    assert code == graphscan.EXIT_RUNTIME
    assert out == "" and len(err.splitlines()) == 1 and "does not run" in err
    assert not (tmp_path / "out.onnx").exists()


def test_a_model_that_builds_but_fails_to_run_is_exit_5_and_nothing_written(tmp_path):
    """The session builds (a symbolic batch passes every check) and the run fails:
    8 values cannot be reshaped to 3. A model that does not run is exit 5, never a
    failed fusion (exit 6)."""
    shape = numpy_helper.from_array(np.array([3], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [shape],
    )
    source, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    proc = run_graphscan(["fuse", source, out])
    assert proc.returncode == 5 and proc.stdout == b"" and b"does not run in onnxruntime" in proc.stderr
    assert not out.exists()
