"""Issue 10, fuse: writing the output safely, verification that NaN cannot fool,
Gemm only where onnxruntime runs it, a broken original blamed on itself,
--inputs / --shape, and types that are not plain tensors.

Expected numbers come from onnxruntime run directly (tests/helpers.py run_onnx) or
from hand derivation, never from graphscan.
"""

import os
import signal
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.commands.fuse as fuse_command
import graphscan_ort.shared.files as files
import graphscan_ort.shared.metrics as metrics
from tests.helpers import error_line, fuse_with_transposed_b, json_answer, run_graphscan, run_onnx

RNG = np.random.default_rng(10)
tensor = helper.make_tensor_value_info


def save_model(path, nodes, inputs, outputs, initializers=(), opset=17, check=True):
    """Save a graph of ValueInfoProto ``inputs``/``outputs``; ``check=False`` keeps broken ones."""
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    if check:
        onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return str(path)


def weights(dtype=np.float32, b_shape=(3, 4)):
    b = RNG.standard_normal(b_shape).astype(dtype)
    c = RNG.standard_normal(b_shape[1:]).astype(dtype)
    return [numpy_helper.from_array(b, "B"), numpy_helper.from_array(c, "C")]


def matmul_add(a="a", out="y"):
    return [
        helper.make_node("MatMul", [a, "B"], ["mm"], name="mm_node"),
        helper.make_node("Add", ["mm", "C"], [out], name="add_node"),
    ]


@pytest.fixture
def lab_fp32(tmp_path):
    """The lab's float MLP (input x [N, 16]), the model fuse exists for."""
    path = tmp_path / "fp32.onnx"
    onnx.save(gen_models.build_mlp(3, 16, seed=0), path)
    return path


def fuse_main(capsys, *argv):
    """graphscan.main(["fuse", ...]) in-process: (exit code, stdout, stderr lines)."""
    code = graphscan.main(["fuse", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


# --------------------------------------------------------------------------
# Item 1: an output path that exists and is not a regular file is left alone


def make_fifo(folder):
    os.mkfifo(folder / "out.onnx")
    return folder / "out.onnx", stat.S_ISFIFO


def make_folder(folder):
    (folder / "out.onnx").mkdir()
    (folder / "out.onnx" / "kept").write_text("kept")
    return folder / "out.onnx", stat.S_ISDIR


def make_link_to_fifo(folder):
    os.mkfifo(folder / "fifo")
    os.symlink("fifo", folder / "out.onnx")
    return folder / "out.onnx", stat.S_ISFIFO


def make_char_device(folder):
    """A private copy of /dev/null (major 1, minor 3): never the system's own, so a
    regression that replaces the target cannot damage the machine running the test."""
    if os.geteuid() != 0:
        pytest.skip("creating a device node needs root")
    os.mknod(folder / "out.onnx", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return folder / "out.onnx", stat.S_ISCHR


@pytest.mark.parametrize(
    "make_target",
    [
        pytest.param(make_fifo, id="fifo"),
        pytest.param(make_folder, id="folder"),
        pytest.param(make_link_to_fifo, id="symlink-to-fifo"),
        pytest.param(make_char_device, id="character-device"),
    ],
)
def test_output_that_is_not_a_regular_file_is_untouched(tmp_path, lab_fp32, make_target):
    target, is_kind = make_target(tmp_path)
    # A subprocess with a timeout: opening a FIFO for writing would block forever.
    proc = run_graphscan(["fuse", lab_fp32, target], timeout=60)
    line = error_line(proc, graphscan.EXIT_NO_FILE)
    assert "not a regular file" in line
    assert is_kind(os.stat(target).st_mode)
    if os.path.isdir(target):
        assert os.listdir(target) == ["kept"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(files.TEMPORARY_PREFIX)]


def test_symlink_to_a_regular_file_is_written_through(tmp_path, lab_fp32):
    real = tmp_path / "real.onnx"
    real.write_bytes(b"old")
    os.symlink("real.onnx", tmp_path / "link.onnx")
    json_answer(run_graphscan(["fuse", lab_fp32, tmp_path / "link.onnx"]))
    assert os.path.islink(tmp_path / "link.onnx")
    assert {n.op_type for n in onnx.load(real).graph.node} == {"Gemm", "Relu"}


# --------------------------------------------------------------------------
# Item 2: temporary file beside the output, fsync, rename, fsync the folder

KILL_AT_RENAME = """
import os, runpy, signal, sys
sys.argv = sys.argv[1:]
def hook(event, args):
    if event == "os.rename":  # os.replace: the temporary file is complete, not yet renamed
        os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_run_killed_before_rename_leaves_no_output_and_its_temp_is_ignored(tmp_path, lab_fp32):
    target = tmp_path / "gemm.onnx"
    killed = run_graphscan(["fuse", lab_fp32, target], python_flags=("-c", KILL_AT_RENAME))
    assert killed.returncode == -signal.SIGKILL
    assert not target.exists()
    (stale,) = [p for p in tmp_path.iterdir() if p.name.startswith(files.TEMPORARY_PREFIX)]
    assert stale.suffix == files.TEMPORARY_SUFFIX  # never *.onnx
    stale_bytes = stale.read_bytes()

    answer = json_answer(run_graphscan(["fuse", lab_fp32, target]))
    assert len(answer["fused"]) == 3
    x = RNG.standard_normal((5, 16)).astype(np.float32)
    np.testing.assert_allclose(run_onnx(target, {"x": x})[0], run_onnx(lab_fp32, {"x": x})[0], rtol=1e-5, atol=1e-6)
    assert stale.read_bytes() == stale_bytes  # another run's file: neither used nor removed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["fp32.onnx", "gemm.onnx", stale.name])


def test_write_fsyncs_the_file_renames_then_fsyncs_the_folder(tmp_path, lab_fp32, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source, destination):
        events.append(("replace", str(source), str(destination)))
        real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "gemm.onnx"
    graphscan.fuse(str(lab_fp32), str(target))
    (_, temporary), rename, folder_sync = events
    assert os.path.dirname(temporary) == str(tmp_path)
    assert os.path.basename(temporary).startswith(files.TEMPORARY_PREFIX)
    assert rename == ("replace", temporary, str(target))
    assert folder_sync == ("fsync", str(tmp_path))


def test_new_output_gets_the_usual_permissions(tmp_path, lab_fp32):
    umask = os.umask(0o022)
    try:
        graphscan.fuse(str(lab_fp32), str(tmp_path / "gemm.onnx"))
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "gemm.onnx").st_mode) == 0o644  # 0666 & ~022


def test_250_character_output_name_is_written(tmp_path, lab_fp32):
    name = "g" * 245 + ".onnx"
    assert len(name) == 250  # legal: NAME_MAX is 255
    answer = json_answer(run_graphscan(["fuse", lab_fp32, name], cwd=tmp_path))
    assert answer["output"] == name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["fp32.onnx", name])


# --------------------------------------------------------------------------
# Item 3: NaN and infinity cannot make a wrong fusion pass


def nan_first_output_model(tmp_path):
    """Two outputs: ``first`` is a * NaN (NaN everywhere), ``y`` the MatMul+Add.

    B is square so that a transposed B still gives a valid (but wrong) Gemm.
    """
    nodes = [helper.make_node("Mul", ["a", "nan"], ["first"], name="mul")] + matmul_add()
    return save_model(
        tmp_path / "m.onnx",
        nodes,
        [tensor("a", TensorProto.FLOAT, [2, 4])],
        [tensor("first", TensorProto.FLOAT, [2, 4]), tensor("y", TensorProto.FLOAT, [2, 4])],
        weights(b_shape=(4, 4)) + [numpy_helper.from_array(np.array([np.nan], np.float32), "nan")],
    )


def test_wrong_gemm_is_caught_when_the_first_output_is_nan(tmp_path, monkeypatch, capsys):
    """The issue's reproduction: max() kept the NaN and NaN > tolerance is False."""
    source = nan_first_output_model(tmp_path)
    fuse_with_transposed_b(monkeypatch)
    code, out, err = fuse_main(capsys, source, tmp_path / "out.onnx")
    assert (code, out, len(err)) == (graphscan.EXIT_MISMATCH, "", 1)
    assert "differs from the original" in err[0]
    assert not (tmp_path / "out.onnx").exists()


def test_partly_nan_outputs_compare_nan_places_then_finite_values(tmp_path):
    """Sqrt after the Gemm: NaN wherever MatMul+Add is negative, in both models."""
    nodes = matmul_add(out="pre") + [helper.make_node("Sqrt", ["pre"], ["y"], name="sqrt")]
    source = save_model(
        tmp_path / "m.onnx",
        nodes,
        [tensor("a", TensorProto.FLOAT, [6, 3])],
        [tensor("y", TensorProto.FLOAT, [6, 4])],
        weights(),
    )
    a = RNG.standard_normal((6, 3)).astype(np.float32)
    np.savez(tmp_path / "a.npz", a=a)
    answer = graphscan.fuse(source, str(tmp_path / "out.onnx"), inputs=str(tmp_path / "a.npz"))
    (expected,), (actual,) = run_onnx(source, {"a": a}), run_onnx(tmp_path / "out.onnx", {"a": a})
    assert np.isnan(expected).any() and not np.isnan(expected).all()  # the case under test
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert answer["max_abs_error"] == float(np.max(np.abs(expected[finite] - actual[finite])))


def test_model_whose_float_outputs_are_all_nan_is_not_written(tmp_path, capsys):
    """Nothing finite to compare: fuse refuses to call that verified (README, fuse)."""
    nodes = matmul_add(out="pre") + [helper.make_node("Mul", ["pre", "nan"], ["y"], name="mul")]
    source = save_model(
        tmp_path / "m.onnx",
        nodes,
        [tensor("a", TensorProto.FLOAT, [2, 3])],
        [tensor("y", TensorProto.FLOAT, [2, 4])],
        weights() + [numpy_helper.from_array(np.array([np.nan], np.float32), "nan")],
    )
    code, out, err = fuse_main(capsys, source, tmp_path / "out.onnx")
    assert (code, out, len(err)) == (graphscan.EXIT_MISMATCH, "", 1)
    assert "all NaN or infinite" in err[0]
    assert not (tmp_path / "out.onnx").exists()


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("expected", "actual", "error", "problem"),
    [
        pytest.param([[1.0, NAN]], [[1.5, NAN]], 0.5, None, id="nan-same-place"),
        pytest.param([[NAN, 1.0]], [[1.0, NAN]], None, "NaN or infinity", id="nan-moved"),
        pytest.param([[NAN, 1.0]], [[NAN, NAN]], None, "NaN or infinity", id="nan-added"),
        pytest.param([[INF, 2.0]], [[INF, 2.25]], 0.25, None, id="inf-same-place"),
        pytest.param([[INF, 2.0]], [[-INF, 2.0]], None, "NaN or infinity", id="inf-sign-flipped"),
        pytest.param([[INF]], [[NAN]], None, "NaN or infinity", id="inf-became-nan"),
    ],
)
def test_compare_outputs_rules(expected, actual, error, problem):
    got_error, _, _, got_problem = metrics.compare_outputs(
        [np.array(expected, np.float32)], [np.array(actual, np.float32)]
    )
    if problem is None:
        assert got_problem is None and got_error == error
    else:
        assert problem in got_problem


def test_inf_weight_gives_strict_json(tmp_path):
    """An infinite bias makes some outputs infinite in both models: JSON stays strict."""
    b, c = weights()
    c_values = numpy_helper.to_array(c).copy()
    c_values[0] = np.inf
    source = save_model(
        tmp_path / "m.onnx",
        matmul_add(),
        [tensor("a", TensorProto.FLOAT, [2, 3])],
        [tensor("y", TensorProto.FLOAT, [2, 4])],
        [b, numpy_helper.from_array(c_values, "C")],
    )
    answer = json_answer(run_graphscan(["fuse", source, tmp_path / "out.onnx"]))
    assert answer["fused"] == [{"matmul": "mm_node", "add": "add_node", "gemm": "mm_node_gemm"}]
    assert 0.0 <= answer["max_abs_error"] <= 1e-5


# --------------------------------------------------------------------------
# Item 9: only types Gemm runs; a broken original; --inputs / --shape


@pytest.mark.parametrize(
    ("dtype", "fused"),
    [
        pytest.param(np.float32, True, id="float"),
        pytest.param(np.float16, True, id="float16"),
        pytest.param(np.float64, True, id="double"),
        pytest.param(np.int32, False, id="int32"),
        pytest.param(np.int64, False, id="int64"),
    ],
)
def test_only_types_onnxruntime_gemm_runs_are_fused(tmp_path, dtype, fused):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    init = [
        numpy_helper.from_array(np.arange(12).reshape(3, 4).astype(dtype), "B"),
        numpy_helper.from_array(np.arange(4).astype(dtype), "C"),
    ]
    source = save_model(
        tmp_path / "m.onnx", matmul_add(), [tensor("a", elem, [2, 3])], [tensor("y", elem, [2, 4])], init
    )
    target = tmp_path / "out.onnx"
    answer = graphscan.fuse(source, str(target))
    if fused:
        assert [f["gemm"] for f in answer["fused"]] == ["mm_node_gemm"]
    else:
        assert answer["skipped"] == [{"node": "mm_node", "reason": fuse_command.SKIP_TYPE}]
    # Whatever was written runs in onnxruntime and gives a @ B + C (small integers: exact).
    a = np.arange(6).reshape(2, 3).astype(dtype)
    expected = a.astype(np.float64) @ np.arange(12).reshape(3, 4) + np.arange(4)
    np.testing.assert_array_equal(run_onnx(target, {"a": a})[0].astype(np.float64), expected)


def cycle(tmp_path):
    nodes = [
        helper.make_node("Relu", ["y"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "B"], ["mm"], name="mm_node"),
        helper.make_node("Add", ["mm", "C"], ["y"], name="add_node"),
    ]
    return nodes, [tensor("a", TensorProto.FLOAT, [2, 4])], weights(b_shape=(4, 4)), 17


def duplicate_producer(tmp_path):
    nodes = matmul_add() + [helper.make_node("Relu", ["a"], ["y"], name="relu")]
    return nodes, [tensor("a", TensorProto.FLOAT, [2, 4])], weights(b_shape=(4, 4)), 17


def opset_that_does_not_exist(tmp_path):
    return matmul_add(), [tensor("a", TensorProto.FLOAT, [2, 4])], weights(b_shape=(4, 4)), 99


def opset_1(tmp_path):
    """Opset 1 passes onnx's checker, but no onnxruntime runs it (its oldest is 7)."""
    return matmul_add(), [tensor("a", TensorProto.FLOAT, [2, 4])], weights(b_shape=(4, 4)), 1


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(cycle, id="cycle"),
        pytest.param(duplicate_producer, id="duplicate-producer"),
        pytest.param(opset_that_does_not_exist, id="opset-99"),
        pytest.param(opset_1, id="opset-1"),
    ],
)
def test_invalid_original_is_exit_4_not_a_fusion_failure(tmp_path, capsys, broken):
    nodes, inputs, init, opset = broken(tmp_path)
    source = save_model(
        tmp_path / "m.onnx",
        nodes,
        inputs,
        [tensor("y", TensorProto.FLOAT, [2, 4])],
        init,
        opset=opset,
        check=False,
    )
    code, out, err = fuse_main(capsys, source, tmp_path / "out.onnx")
    assert (code, out, len(err)) == (graphscan.EXIT_NOT_ONNX, "", 1)
    assert "m.onnx: not a valid ONNX model" in err[0] or "m.onnx: opset" in err[0]
    assert not (tmp_path / "out.onnx").exists()


@pytest.fixture
def batch_one_model(tmp_path):
    """MatMul+Add on a [N, 3] input, then Reshape to a fixed [1, 4]: it only runs
    with N = 1, so fuse's default of 2 for symbolic dimensions cannot verify it."""
    nodes = matmul_add(out="pre") + [helper.make_node("Reshape", ["pre", "shape"], ["y"], name="reshape")]
    return save_model(
        tmp_path / "m.onnx",
        nodes,
        [tensor("a", TensorProto.FLOAT, ["N", 3])],
        [tensor("y", TensorProto.FLOAT, [1, 4])],
        weights() + [numpy_helper.from_array(np.array([1, 4], np.int64), "shape")],
    )


def test_fuse_shape_sets_symbolic_dimensions(tmp_path, batch_one_model, capsys):
    code, _, err = fuse_main(capsys, batch_one_model, tmp_path / "out.onnx")
    assert code == graphscan.EXIT_RUNTIME and len(err) == 1  # without it: N = 2 cannot run
    answer = graphscan.fuse(batch_one_model, str(tmp_path / "out.onnx"), shape=["a=1,3"])
    assert [f["gemm"] for f in answer["fused"]] == ["mm_node_gemm"]


def test_fuse_inputs_are_the_verification_sample(tmp_path, batch_one_model):
    a = RNG.standard_normal((1, 3)).astype(np.float32)
    np.savez(tmp_path / "a.npz", a=a)
    target = tmp_path / "out.onnx"
    answer = json_answer(run_graphscan(["fuse", batch_one_model, target, "--inputs", tmp_path / "a.npz"]))
    assert answer["max_abs_error"] == float(
        np.max(np.abs(run_onnx(batch_one_model, {"a": a})[0] - run_onnx(target, {"a": a})[0]))
    )
    # The file really is what runs: a NaN sample leaves nothing to compare (exit 6).
    np.savez(tmp_path / "nan.npz", a=np.full((1, 3), np.nan, np.float32))
    error_line(run_graphscan(["fuse", batch_one_model, target, "--inputs", tmp_path / "nan.npz"]), 6)


# --------------------------------------------------------------------------
# Item 6: --inputs problems and -1 dimensions, for fuse (trace: tests/cli/test_process_boundary.py)


def test_minus_one_declared_dimension_is_symbolic_in_fuse(tmp_path):
    source = save_model(
        tmp_path / "m.onnx",
        matmul_add(),
        [tensor("a", TensorProto.FLOAT, [-1, 3])],
        [tensor("y", TensorProto.FLOAT, [-1, 4])],
        weights(),
    )
    answer = json_answer(run_graphscan(["fuse", source, tmp_path / "out.onnx"]))
    assert [f["gemm"] for f in answer["fused"]] == ["mm_node_gemm"]


# --------------------------------------------------------------------------
# Item 7 for fuse: inputs and outputs that are not plain numeric tensors


def sequence_output():
    nodes = matmul_add() + [helper.make_node("SequenceConstruct", ["y", "y"], ["out"], name="seq")]
    return nodes, [helper.make_tensor_sequence_value_info("out", TensorProto.FLOAT, [2, 4])]


def optional_output():
    nodes = matmul_add() + [helper.make_node("Optional", ["y"], ["out"], name="opt")]
    optional = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 4]))
    return nodes, [helper.make_value_info("out", optional)]


def string_output():
    nodes = matmul_add() + [helper.make_node("Cast", ["y"], ["out"], name="cast", to=TensorProto.STRING)]
    return nodes, [tensor("out", TensorProto.STRING, [2, 4])]


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(sequence_output, id="sequence"),
        pytest.param(optional_output, id="optional"),
        pytest.param(string_output, id="string"),
    ],
)
def test_outputs_that_are_not_plain_tensors_are_compared(tmp_path, build):
    nodes, outputs = build()
    source = save_model(tmp_path / "m.onnx", nodes, [tensor("a", TensorProto.FLOAT, [2, 3])], outputs, weights())
    answer = json_answer(run_graphscan(["fuse", source, tmp_path / "out.onnx"]))
    assert [f["gemm"] for f in answer["fused"]] == ["mm_node_gemm"]
    a = RNG.standard_normal((2, 3)).astype(np.float32)
    (expected,), (actual,) = run_onnx(source, {"a": a}), run_onnx(tmp_path / "out.onnx", {"a": a})
    np.testing.assert_array_equal(np.asarray(actual, dtype=object), np.asarray(expected, dtype=object))


def test_string_output_that_changes_is_a_mismatch():
    expected = [np.array(["1.5", "2"], dtype=object)]
    assert "other values" in metrics.compare_outputs(expected, [np.array(["1.5", "3"], dtype=object)])[3]
    assert metrics.compare_outputs(expected, [[np.zeros(2)]])[3] is not None  # a sequence instead
    assert metrics.compare_outputs([None], [np.zeros(2)])[3] is not None  # optional left empty in one


def sequence_input():
    return [helper.make_node("SequenceAt", ["s", "zero"], ["a"], name="at")], helper.make_tensor_sequence_value_info(
        "s", TensorProto.FLOAT, [2, 3]
    )


def optional_input():
    optional = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2, 3]))
    return [helper.make_node("OptionalGetElement", ["s"], ["a"], name="get")], helper.make_value_info("s", optional)


@pytest.mark.parametrize(
    "build",
    [pytest.param(sequence_input, id="sequence"), pytest.param(optional_input, id="optional")],
)
def test_inputs_that_are_not_tensors_are_exit_7(tmp_path, capsys, build):
    front, graph_input = build()
    source = save_model(
        tmp_path / "m.onnx",
        front + matmul_add(),
        [graph_input],
        [tensor("y", TensorProto.FLOAT, [2, 4])],
        weights() + [numpy_helper.from_array(np.array(0, np.int64), "zero")],
    )
    code, out, err = fuse_main(capsys, source, tmp_path / "out.onnx")
    assert (code, out, len(err)) == (graphscan.EXIT_INPUTS, "", 1)
    assert "'s'" in err[0] and "only tensors" in err[0]


def test_string_input_is_exit_7_without_inputs_and_runs_with_them(tmp_path, capsys):
    """A STRING input cannot be generated; a text array in --inputs feeds it."""
    nodes = [
        helper.make_node("Shape", ["t"], ["dims"], name="shape"),
        helper.make_node("Cast", ["dims"], ["flat"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["flat", "row"], ["a"], name="reshape"),
        *matmul_add(),
    ]
    source = save_model(
        tmp_path / "m.onnx",
        nodes,
        [tensor("t", TensorProto.STRING, [1, 3])],
        [tensor("y", TensorProto.FLOAT, [1, 4])],
        weights(b_shape=(2, 4)) + [numpy_helper.from_array(np.array([1, 2], np.int64), "row")],
    )
    code, out, err = fuse_main(capsys, source, tmp_path / "out.onnx")
    assert (code, out, len(err)) == (graphscan.EXIT_INPUTS, "", 1)
    assert "give it with --inputs" in err[0]
    np.savez(tmp_path / "t.npz", t=np.array([["A", "B", "c"]]))
    answer = graphscan.fuse(source, str(tmp_path / "out.onnx"), inputs=str(tmp_path / "t.npz"))
    assert [f["gemm"] for f in answer["fused"]] == ["mm_node_gemm"]


@pytest.mark.parametrize("untyped", ["a", "y"], ids=["untyped-input", "untyped-output"])
def test_untyped_input_or_output_is_a_clear_exit_4(tmp_path, capsys, untyped):
    """onnx's checker requires a type on graph inputs and outputs: the original is refused."""

    def info(name, shape):
        return helper.make_empty_tensor_value_info(name) if name == untyped else tensor(name, TensorProto.FLOAT, shape)

    source = save_model(
        tmp_path / "m.onnx", matmul_add(), [info("a", [2, 3])], [info("y", [2, 4])], weights(), check=False
    )
    code, out, err = fuse_main(capsys, source, tmp_path / "out.onnx")
    assert (code, out, len(err)) == (graphscan.EXIT_NOT_ONNX, "", 1)
    assert "not a valid ONNX model" in err[0] and "type" in err[0]


def test_a_changed_model_with_fewer_outputs_is_a_mismatch():
    """compare_outputs zipped the two lists: a model that lost an output compared only the
    outputs both had, and passed."""
    kept = np.array([1.0, 2.0], np.float32)
    problem = metrics.compare_outputs([kept, kept], [kept])[3]
    assert problem == "1 outputs instead of 2"
