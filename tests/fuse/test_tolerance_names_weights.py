"""fuse: inputs that kill the mutants the first mutation campaign left alive.

The verification's tolerance, Gemm names, value_info of removed tensors,
external data read from the model's folder, and the weights of a model big
enough for the skim path. Expected numbers come from onnxruntime run directly.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.commands.fuse as fuse_command
from tests.helpers import error_line, json_answer, mlp_with_weights_beside, run_graphscan, run_onnx, strict_loads


def one_layer(path, weight_scale=1.0, value_info=(), extra_nodes=(), output="y", rows=2):
    """a [2, 3] -> MatMul "mm_node" (B) -> Add "add_node" (C) -> ``output``, plus extras.

    ``weight_scale`` sets the size of the outputs (B's entries are N(0, 1) times it).
    """
    rng = np.random.default_rng(5)
    initializers = [
        numpy_helper.from_array((rng.standard_normal((3, 4)) * weight_scale).astype(np.float32), "B"),
        numpy_helper.from_array((rng.standard_normal(4) * 0.1).astype(np.float32), "C"),
    ]
    nodes = [
        helper.make_node("MatMul", ["a", "B"], ["mm"], name="mm_node"),
        helper.make_node("Add", ["mm", "C"], [output], name="add_node"),
        *extra_nodes,
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [rows, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 4])],
        initializers,
        value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in value_info],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return str(path)


def seeded_input():
    """fuse's verification input for a [2, 3]: seed 0, standard normal (SPEC of fuse)."""
    return np.random.default_rng(graphscan.Samples().seed).standard_normal((2, 3)).astype(np.float32)


@pytest.fixture
def bias_offset(monkeypatch):
    """Makes fuse's Gemm add ``offset`` to C: a wrong fusion of a known size."""
    honest = fuse_command.fuse_matmul_add

    def install(offset):
        def off_by(model):
            fused, done, skipped = honest(model)
            (c,) = [i for i in fused.graph.initializer if i.name == "C"]
            c.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(c) + np.float32(offset), "C"))
            return fused, done, skipped

        monkeypatch.setattr(fuse_command, "fuse_matmul_add", off_by)

    return install


TOLERANCE_CASES = [
    # outputs of size ~1: allowed 1e-5 absolute
    pytest.param(1e-3, 1.0, graphscan.EXIT_MISMATCH, id="1e-3-off-at-scale-1-refused"),
    pytest.param(5e-6, 1.0, graphscan.EXIT_OK, id="5e-6-off-at-scale-1-accepted"),
    # outputs of size ~1000: allowed 1e-5 relative, about 1e-2
    pytest.param(1e-3, 1000.0, graphscan.EXIT_OK, id="1e-3-off-at-scale-1000-accepted"),
    pytest.param(1.0, 1000.0, graphscan.EXIT_MISMATCH, id="1-off-at-scale-1000-refused"),
]


@pytest.mark.parametrize(("offset", "weight_scale", "code"), TOLERANCE_CASES)
def test_verification_tolerance_is_1e5_relative(tmp_path, capsys, bias_offset, offset, weight_scale, code):
    source = one_layer(tmp_path / "m.onnx", weight_scale)
    target = tmp_path / "out.onnx"
    bias_offset(offset)
    assert graphscan.main(["fuse", source, str(target)]) == code
    out, err = capsys.readouterr()
    if code == graphscan.EXIT_MISMATCH:
        assert out == "" and len(err.splitlines()) == 1 and "differs from the original" in err
        assert not target.exists()
        return
    # Accepted: the reported error is the one onnxruntime shows on fuse's own input.
    x = seeded_input()
    (expected,), (actual,) = run_onnx(source, {"a": x}), run_onnx(target, {"a": x})
    direct = float(np.max(np.abs(expected - actual)))
    assert direct > 0.5 * offset  # the offset really is in the written model
    assert strict_loads(out)["max_abs_error"] == pytest.approx(direct, rel=1e-6)


def test_gemm_name_never_repeats_an_existing_name(tmp_path):
    source = one_layer(
        tmp_path / "m.onnx",
        output="s",
        extra_nodes=[helper.make_node("Relu", ["s"], ["y"], name="mm_node_gemm")],
    )
    answer = graphscan.fuse(source, str(tmp_path / "out.onnx"))
    (entry,) = answer["fused"]
    assert entry["gemm"] != "mm_node_gemm" and entry["gemm"].startswith("mm_node_gemm")
    names = [n.name for n in onnx.load(tmp_path / "out.onnx").graph.node]
    assert sorted(names) == sorted([entry["gemm"], "mm_node_gemm"])


def test_value_info_of_removed_tensors_is_dropped(tmp_path):
    source = one_layer(
        tmp_path / "m.onnx",
        output="s",
        value_info=["mm", "s"],
        extra_nodes=[helper.make_node("Relu", ["s"], ["y"], name="relu")],
    )
    graphscan.fuse(source, str(tmp_path / "out.onnx"))
    fused = onnx.load(tmp_path / "out.onnx")
    assert [v.name for v in fused.graph.value_info] == ["s"]  # mm is no longer in the graph
    assert "mm" not in {t for n in fused.graph.node for t in [*n.input, *n.output]}


def test_external_data_is_read_beside_the_model_from_another_folder(tmp_path):
    sub = tmp_path / "sub"
    mlp_with_weights_beside(sub, "fp32.onnx", seed=2)
    answer = json_answer(run_graphscan(["fuse", "sub/fp32.onnx", "gemm.onnx"], cwd=tmp_path))
    assert len(answer["fused"]) == 3
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    (expected,) = run_onnx(sub / "fp32.onnx", {"x": x})
    (actual,) = run_onnx(tmp_path / "gemm.onnx", {"x": x})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def test_missing_external_data_is_one_line_and_nothing_written(tmp_path):
    model = gen_models.build_mlp(3, 8, seed=2)
    onnx.save(model, tmp_path / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    (tmp_path / "w.bin").unlink()
    line = error_line(run_graphscan(["fuse", "m.onnx", "out.onnx"], cwd=tmp_path), graphscan.EXIT_NOT_ONNX)
    assert "m.onnx" in line and "external data" in line
    assert not (tmp_path / "out.onnx").exists()


def test_model_above_the_skim_threshold_is_fused_with_its_weights(tmp_path, monkeypatch):
    """A big model's counting skips tensor payloads; fuse must read them all the same."""
    source, target = tmp_path / "fp32.onnx", tmp_path / "gemm.onnx"
    onnx.save(gen_models.build_mlp(3, 8, seed=4), source)
    monkeypatch.setattr(graphscan, "_SKIM_THRESHOLD", 0)  # every file is "big"
    answer = graphscan.fuse(str(source), str(target))
    assert len(answer["fused"]) == 3
    x = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    (expected,), (actual,) = run_onnx(source, {"x": x}), run_onnx(target, {"x": x})
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    weights = {i.name: numpy_helper.to_array(i) for i in onnx.load(target).graph.initializer}
    original = {i.name: numpy_helper.to_array(i) for i in onnx.load(source).graph.initializer}
    assert weights.keys() == original.keys()
    for name in original:
        np.testing.assert_array_equal(weights[name], original[name])


def test_max_abs_error_is_measured_on_two_rows_for_a_symbolic_batch(tmp_path, monkeypatch):
    """B's second row off by 5e-6 (accepted): row r of the output is off by 5e-6 * |x[r, 1]|,
    which is larger in the seeded input's second row, so the answer pins fuse's input:
    seed 0, the symbolic batch N set to 2."""
    source = one_layer(tmp_path / "m.onnx", rows="N")
    honest = fuse_command.fuse_matmul_add

    def off_by(model):
        fused, done, skipped = honest(model)
        (b,) = [i for i in fused.graph.initializer if i.name == "B"]
        values = numpy_helper.to_array(b).copy()
        values[1] += np.float32(5e-6)
        b.CopyFrom(numpy_helper.from_array(values, "B"))
        return fused, done, skipped

    monkeypatch.setattr(fuse_command, "fuse_matmul_add", off_by)
    target = tmp_path / "out.onnx"
    answer = graphscan.fuse(source, str(target))
    x = seeded_input()
    assert abs(x[1, 1]) > 2 * abs(x[0, 1])  # the second row carries the larger error
    (expected,), (actual,) = run_onnx(source, {"a": x}), run_onnx(target, {"a": x})
    per_row = np.max(np.abs(expected - actual), axis=1)
    assert per_row[1] > 1.5 * per_row[0]
    assert answer["max_abs_error"] == float(per_row.max())


def test_fused_model_failing_the_checker_exits_6_and_writes_nothing(tmp_path, monkeypatch, capsys):
    source = one_layer(tmp_path / "m.onnx")
    honest = fuse_command.fuse_matmul_add

    def broken(model):
        fused, done, skipped = honest(model)
        fused.graph.node[0].input[1] = "no_such_tensor"
        return fused, done, skipped

    monkeypatch.setattr(fuse_command, "fuse_matmul_add", broken)
    target = tmp_path / "out.onnx"
    assert graphscan.main(["fuse", source, str(target)]) == graphscan.EXIT_MISMATCH
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "checker" in err
    assert not target.exists()
