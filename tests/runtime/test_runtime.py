"""graphscan.py runtime: what onnxruntime really executes for each operator.

The expectations come from two places that do not share graphscan's code:
hand-built QDQ graphs whose fate under onnxruntime's CPU fusions is worked
out from the fusion rules (each test says why), and onnxruntime's own
profiler, which reports the kernel that ran for every node.

onnxruntime rewrites int8 Q->DQ pairs to uint8 only on x86, and that rewrite
is what keeps the lab's Adds float; those expectations are x86 facts.
"""

import json
import os
import platform

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.engines.classify as classify
import graphscan_ort.engines.timing as timing
import graphscan_ort.shared.kernels as kernel_vocabulary
from tests.helpers import error_line, json_answer, main_error_line, run_graphscan
from tests.lab import DEFAULT_LAB

x86_only = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"),
    reason="onnxruntime's int8 -> uint8 Q/DQ rewrite, which these answers rest on, happens on x86 only",
)
ANSWER_KEYS = [
    "model",
    "environment",
    "compute",
    "wrapped",
    "classes",
    "wrapped_but_float",
    "float_but_int8",
    "by_op_type",
    "nodes",
    "unmapped",
]
NODE_KEYS = ["node", "op_type", "wrapped", "class", "kernel", "runs_in", "reason"]
INT8_OPS = {
    "QLinearConv",
    "QLinearMatMul",
    "QLinearAdd",
    "QLinearMul",
    "QLinearConcat",
    "QLinearGlobalAveragePool",
    "QLinearSigmoid",
    "QGemm",
    "QLinearAveragePool",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
}


def by_node(answer):
    return {row["node"]: row for row in answer["nodes"]}


@pytest.fixture(scope="module")
def lab_gemm(default_lab, tmp_path_factory):
    """gemm_full as gen_models builds it: the lab fp32 fused into Gemms, then quantized."""
    folder = tmp_path_factory.mktemp("gemm")
    gemm = folder / "gemm.onnx"
    graphscan.fuse(str(default_lab["fp32"]), str(gemm))
    gemm_full = folder / "gemm_full.onnx"
    gen_models.quantize_qdq(gemm, gemm_full, DEFAULT_LAB.seed)
    return gemm_full


# --------------------------------------------------------------------------
# The lab's models


@x86_only
def test_full_matmuls_run_int8_and_adds_stay_float_for_mixed_types(default_lab):
    answer = graphscan.runtime(str(default_lab["full"]))
    assert list(answer) == ANSWER_KEYS
    rows = by_node(answer)
    layers = DEFAULT_LAB.layers
    for k in range(1, layers + 1):
        matmul, add = rows[f"fc{k}_matmul"], rows[f"fc{k}_add"]
        assert list(matmul) == NODE_KEYS
        assert (matmul["class"], matmul["kernel"], matmul["runs_in"]) == ("int8", "QLinearMatMul", f"fc{k}_matmul")
        assert matmul["wrapped"] is True and matmul["reason"] is None
        # The Add reads the MatMul's requantized output (a Q feeding one DQ:
        # rewritten to uint8) and the bias initializer's DQ (a constant:
        # stays int8); the binary fusion needs one type, so Add runs float.
        assert (add["class"], add["kernel"], add["wrapped"]) == ("float", "Add", True)
        assert add["reason"]["code"] == "mixed_types"
        assert "uint8" in add["reason"]["detail"] and "int8," in add["reason"]["detail"]
    assert answer["classes"] == {"int8": layers, "int8_data": 0, "float": layers, "absorbed": 0}
    assert answer["wrapped_but_float"] == layers and answer["float_but_int8"] == 0
    assert answer["by_op_type"] == {"Add": {"float": layers}, "MatMul": {"int8": layers}}
    assert answer["unmapped"] == []


@x86_only
def test_gemm_full_runs_three_qgemm(lab_gemm):
    answer = graphscan.runtime(str(lab_gemm))
    assert [(r["op_type"], r["class"], r["kernel"]) for r in answer["nodes"]] == [("Gemm", "int8", "QGemm")] * 3
    assert answer["classes"]["int8"] == 3 and answer["wrapped_but_float"] == 0


@x86_only
def test_matmul_only_relus_are_absorbed_into_the_next_quantize(default_lab):
    rows = by_node(graphscan.runtime(str(default_lab["matmul_only"])))
    layers = DEFAULT_LAB.layers
    for k in range(1, layers):
        # Relu -> Q with zero point at qmin: onnxruntime drops the Relu (the
        # Q's clamp does the same), so it runs inside that QuantizeLinear.
        relu = rows[f"fc{k}_relu"]
        assert (relu["class"], relu["kernel"], relu["runs_in"]) == (
            "absorbed",
            "QuantizeLinear",
            f"fc{k + 1}_matmul_input_QuantizeLinear",
        ) or (relu["class"], relu["kernel"]) == ("absorbed", "QuantizeLinear"), relu
        assert rows[f"fc{k}_add"]["class"] == "float" and rows[f"fc{k}_add"]["reason"] is None  # not wrapped
    # The last Relu feeds the graph output, no Q to fold into.
    assert rows[f"fc{layers}_relu"]["class"] == "float"
    # The float Adds are not wrapped (SPEC), so they are not "wrapped but float".
    answer = graphscan.runtime(str(default_lab["matmul_only"]))
    assert answer["wrapped_but_float"] == 0 and answer["float_but_int8"] == 0


def test_level_basic_fuses_nothing_and_says_why(default_lab):
    answer = graphscan.runtime(str(default_lab["full"]), level="basic")
    assert answer["environment"]["level"] == "basic"
    for row in answer["nodes"]:
        assert row["class"] == "float" and row["reason"]["code"] == "level", row


@x86_only
def test_int8_allowed_changes_the_answer_and_says_so(default_lab):
    default = graphscan.runtime(str(default_lab["full"]))
    allowed = graphscan.runtime(str(default_lab["full"]), int8_allowed=True)
    assert default["environment"]["int8_allowed"] is False
    assert allowed["environment"]["int8_allowed"] is True
    # Without the uint8 rewrite every operand of an Add stays int8, so the
    # binary fusion's one-type rule holds and the Adds become QLinearAdd.
    assert {r["kernel"] for r in allowed["nodes"] if r["op_type"] == "Add"} == {"QLinearAdd"}
    assert allowed["classes"]["int8"] > default["classes"]["int8"]


# --------------------------------------------------------------------------
# Hand-built graphs: one of each class, and a graph with no names at all


def u8(name, value):
    return numpy_helper.from_array(np.array(value, dtype=np.uint8), name)


def f32(name, value):
    return numpy_helper.from_array(np.array(value, dtype=np.float32), name)


def every_class_model(named=True):
    """x -> Q -> DQ -> Conv -> Relu -> Q -> DQ -> Reshape -> Q -> DQ -> HardSigmoid -> Q -> DQ -> Identity -> y.

    All activations uint8 with zero point 0, the weight int8, the bias int32:
    - Conv: DQ(u8) x, DQ(s8) weight, DQ(s32) bias -> QLinearConv (int8);
    - Relu before a Q whose zero point is 0: folded into that Q, which the
      QLinearConv then takes in: it runs inside the QLinearConv (absorbed);
    - Reshape between a DQ and a Q of one scale: Q/DQ dropped, it moves uint8 (int8_data);
    - HardSigmoid: no QDQ fusion on the CPU provider (float, no_kernel);
    - Identity: removed; the DQ before it now writes the graph output (absorbed there);
    - the Constant giving Reshape its shape: folded into an initializer (absorbed, no kernel).
    """
    rng = np.random.default_rng(0)
    weight = rng.integers(-20, 20, (4, 2, 3, 3)).astype(np.int8)
    inits = [
        f32("s", 0.05),
        u8("zp", 0),
        numpy_helper.from_array(weight, "w_q"),
        f32("w_s", 0.02),
        numpy_helper.from_array(np.zeros(4, np.int8), "w_zp"),
        numpy_helper.from_array(np.arange(4, dtype=np.int32), "b_q"),
        f32("b_s", 0.001),
        numpy_helper.from_array(np.zeros(4, np.int32), "b_zp"),
    ]

    def n(op, ins, outs, name, **attrs):
        return helper.make_node(op, ins, outs, name=name if named else "", **attrs)

    nodes = [
        n("QuantizeLinear", ["x", "s", "zp"], ["x_q"], "x_Q"),
        n("DequantizeLinear", ["x_q", "s", "zp"], ["x_dq"], "x_DQ"),
        n("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["w"], "w_DQ"),
        n("DequantizeLinear", ["b_q", "b_s", "b_zp"], ["b"], "b_DQ"),
        n("Conv", ["x_dq", "w", "b"], ["c"], "conv", pads=[1, 1, 1, 1]),
        n("Relu", ["c"], ["r"], "relu"),
        n("QuantizeLinear", ["r", "s", "zp"], ["r_q"], "r_Q"),
        n("DequantizeLinear", ["r_q", "s", "zp"], ["r_dq"], "r_DQ"),
        n("Constant", [], ["shape"], "shape_const", value=numpy_helper.from_array(np.array([1, 4, 16], np.int64))),
        n("Reshape", ["r_dq", "shape"], ["h"], "reshape"),
        n("QuantizeLinear", ["h", "s", "zp"], ["h_q"], "h_Q"),
        n("DequantizeLinear", ["h_q", "s", "zp"], ["h_dq"], "h_DQ"),
        n("HardSigmoid", ["h_dq"], ["g"], "hardsigmoid"),
        n("QuantizeLinear", ["g", "s", "zp"], ["g_q"], "g_Q"),
        n("DequantizeLinear", ["g_q", "s", "zp"], ["g_dq"], "g_DQ"),
        n("Identity", ["g_dq"], ["y"], "identity"),
    ]
    graph = helper.make_graph(
        nodes,
        "every_class",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


EVERY_CLASS = {
    "shape_const": ("absorbed", None),
    "conv": ("int8", "QLinearConv"),
    "relu": ("absorbed", "QLinearConv"),
    "reshape": ("int8_data", "Reshape"),
    "hardsigmoid": ("float", "HardSigmoid"),
    "identity": ("absorbed", "DequantizeLinear"),
}


def test_every_class_occurs_in_a_hand_built_graph(tmp_path):
    path = tmp_path / "every_class.onnx"
    onnx.save(every_class_model(), path)
    answer = graphscan.runtime(str(path))
    found = {r["node"]: (r["class"], r["kernel"]) for r in answer["nodes"]}
    assert found == EVERY_CLASS
    rows = by_node(answer)
    assert rows["hardsigmoid"]["reason"] == {
        "code": "no_kernel",
        "detail": "CPUExecutionProvider has no QDQ fusion for HardSigmoid",
    }
    assert rows["identity"]["runs_in"] == "g_DQ" and rows["relu"]["runs_in"] == "conv"
    assert answer["classes"] == {"int8": 1, "int8_data": 1, "float": 1, "absorbed": 3}
    assert rows["shape_const"]["runs_in"] is None and answer["unmapped"] == []
    # SPEC's wrapped rule: Conv feeds a Relu (not a Q), the Relu reads the
    # Conv, the Reshape reads its shape initializer, the Identity feeds the
    # graph output. Only the HardSigmoid is wrapped, yet the Conv runs int8.
    assert [r["node"] for r in answer["nodes"] if r["wrapped"]] == ["hardsigmoid"]
    assert answer["float_but_int8"] == 1 and answer["wrapped_but_float"] == 1


def shared_int8_conv_model():
    """An int8 Conv whose input Q and output Q each feed two DQs.

    onnxruntime's uint8 rewrite needs a Q that feeds exactly one DQ, so here
    every activation stays int8, and its Conv fusion takes int8 activations
    only when session.qdqisint8allowed is set.
    """
    rng = np.random.default_rng(1)
    s8 = lambda name, value: numpy_helper.from_array(np.array(value, dtype=np.int8), name)  # noqa: E731
    inits = [
        f32("s", 0.05),
        s8("zp", 0),
        s8("w_q", rng.integers(-20, 20, (2, 2, 3, 3))),
        f32("w_s", 0.02),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["x_q"], name="x_Q"),
        helper.make_node("DequantizeLinear", ["x_q", "s", "zp"], ["x_dq"], name="x_DQ"),
        helper.make_node("DequantizeLinear", ["x_q", "s", "zp"], ["x_copy"], name="x_DQ2"),
        helper.make_node("DequantizeLinear", ["w_q", "w_s", "zp"], ["w"], name="w_DQ"),
        helper.make_node("Conv", ["x_dq", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "s", "zp"], ["c_q"], name="c_Q"),
        helper.make_node("DequantizeLinear", ["c_q", "s", "zp"], ["y"], name="c_DQ"),
        helper.make_node("DequantizeLinear", ["c_q", "s", "zp"], ["y2"], name="c_DQ2"),
    ]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 2, 4, 4])  # noqa: E731
    graph = helper.make_graph(nodes, "shared", [value("x")], [value("y"), value("y2"), value("x_copy")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_int8_activations_need_int8_allowed(tmp_path):
    path = tmp_path / "shared.onnx"
    onnx.save(shared_int8_conv_model(), path)
    (conv,) = graphscan.runtime(str(path))["nodes"]
    assert (conv["class"], conv["wrapped"]) == ("float", True)
    assert conv["reason"]["code"] == "int8_activations"
    assert conv["reason"]["detail"].startswith("inputs int8; weights int8; outputs int8")
    (conv,) = graphscan.runtime(str(path), int8_allowed=True)["nodes"]
    assert (conv["class"], conv["kernel"], conv["reason"]) == ("int8", "QLinearConv", None)


def test_int8_activations_is_not_the_reason_when_they_were_allowed():
    """The same unfused all-int8 Conv, judged as if --int8-allowed had been
    set: the fusion would have accepted int8, so something else stopped it."""
    named, _ = classify.session_names(shared_int8_conv_model())
    optimized = classify.optimized_model(named.SerializeToString(), "m", "extended", "CPUExecutionProvider", False)
    graph = kernel_vocabulary.OptimizedGraph(optimized.graph)
    conv = graph.by_name["conv"]
    assert graph.op_type(conv) == "Conv"
    assert (
        classify.float_reason("Conv", graph, conv, "extended", "CPUExecutionProvider", False)["code"]
        == "int8_activations"
    )
    reason = classify.float_reason("Conv", graph, conv, "extended", "CPUExecutionProvider", True)
    assert reason["code"] == "other" and "other conditions" in reason["detail"]


def test_unnamed_nodes_get_spec_names_and_the_same_classes(tmp_path):
    path = tmp_path / "unnamed.onnx"
    onnx.save(every_class_model(named=False), path)
    answer = graphscan.runtime(str(path))
    # SPEC naming: <op_type>_<position in graph.node>.
    spec_names = {
        "conv": "Conv_4",
        "relu": "Relu_5",
        "shape_const": "Constant_8",
        "reshape": "Reshape_9",
        "hardsigmoid": "HardSigmoid_12",
        "identity": "Identity_15",
    }
    assert {r["node"]: (r["class"], r["kernel"]) for r in answer["nodes"]} == {
        spec_names[name]: expected for name, expected in EVERY_CLASS.items()
    }


def test_nodes_are_found_by_tensors_when_every_optimized_name_is_gone(tmp_path):
    """Blank every node name of the optimized graph: the mapping must fall
    back to tensors and Q/DQ signatures and reach the same classes."""
    model = every_class_model()
    named, names = classify.session_names(model)
    optimized = classify.optimized_model(named.SerializeToString(), "m", "extended", "CPUExecutionProvider", False)
    for node in optimized.graph.node:
        node.name = ""
    rows, unmapped = classify.classify_nodes(
        graphscan.GraphIndex(named.graph),
        names,
        kernel_vocabulary.OptimizedGraph(optimized.graph),
        "extended",
        "CPUExecutionProvider",
        False,
    )
    assert unmapped == []
    assert {r["node"]: (r["class"], r["kernel"]) for r in rows} == EVERY_CLASS


def test_dynamic_model_fuses_into_dynamic_quantize_matmul(default_lab):
    """quantize_dynamic's MatMulInteger chain (DynamicQuantizeLinear, MatMulInteger,
    Cast, two Muls, the bias Add) becomes one DynamicQuantizeMatMul per layer:
    the MatMulInteger runs it (found by name), the rest were fused into it,
    the Cast and the scale Mul found only through their neighbours."""
    answer = graphscan.runtime(str(default_lab["dynamic"]))
    for row in answer["nodes"]:
        if row["op_type"] == "Relu":
            assert (row["class"], row["kernel"]) == ("float", "Relu")
        elif row["op_type"] == "MatMulInteger":
            assert (row["class"], row["kernel"], row["runs_in"]) == ("int8", "DynamicQuantizeMatMul", row["node"])
        else:
            assert (row["class"], row["kernel"]) == ("absorbed", "DynamicQuantizeMatMul"), row
    layers = DEFAULT_LAB.layers
    assert answer["classes"] == {
        "int8": layers,
        "int8_data": 0,
        "float": layers,
        "absorbed": answer["compute"] - 2 * layers,
    }
    assert answer["float_but_int8"] == layers  # nothing is wrapped in a dynamic model


def test_the_node_found_by_name_runs_the_kernel_not_a_removed_one_before_it(tmp_path):
    """x -> Identity -> Relu -> y: onnxruntime removes the Identity, so the Relu
    reads x. The Identity is found through its input (the Relu reads it now),
    but the Relu, found by name, runs the kernel; the Identity was absorbed."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["t"], name="id"), helper.make_node("Relu", ["t"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", 1, [4])],
        [helper.make_tensor_value_info("y", 1, [4])],
    )
    path = tmp_path / "identity.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    rows = by_node(graphscan.runtime(str(path)))
    assert (rows["relu"]["class"], rows["relu"]["runs_in"]) == ("float", "relu")
    assert (rows["id"]["class"], rows["id"]["runs_in"]) == ("absorbed", "relu")


def test_duplicate_and_colliding_names_are_made_unique():
    a = helper.make_node("Relu", ["x"], ["a"], name="same")
    b = helper.make_node("Relu", ["a"], ["b"], name="same")
    c = helper.make_node("Relu", ["b"], ["c"])  # SPEC name Relu_2 ...
    d = helper.make_node("Relu", ["c"], ["y"], name="Relu_2")  # ... already taken
    graph = helper.make_graph(
        [a, b, c, d], "g", [helper.make_tensor_value_info("x", 1, [1])], [helper.make_tensor_value_info("y", 1, [1])]
    )
    named, names = classify.session_names(helper.make_model(graph))
    assert names == ["same", "same~1", "Relu_2~2", "Relu_2"]
    assert [n.name for n in named.graph.node] == names


def test_a_made_name_never_repeats_a_name_a_node_already_has():
    """``a``, ``a~2`` (a user's name), ``a``: the third cannot become ``a~2`` as well."""
    chain = [helper.make_node("Relu", [f"t{k}"], [f"t{k + 1}"], name=name) for k, name in enumerate(["a", "a~2", "a"])]
    graph = helper.make_graph(
        chain, "g", [helper.make_tensor_value_info("t0", 1, [1])], [helper.make_tensor_value_info("t3", 1, [1])]
    )
    _, names = classify.session_names(helper.make_model(graph))
    assert names[:2] == ["a", "a~2"] and len(set(names)) == 3 and names[2].startswith("a~2")


# --------------------------------------------------------------------------
# An independent check: onnxruntime's profiler names the kernel of every node


def profiled_kernels(model, folder, level="extended"):
    """``{node name: (kernel op, first input's element type)}`` from onnxruntime's profiler."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(
        ort.GraphOptimizationLevel, {"extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}[level]
    )
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / "profile")  # never into the working directory
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    session.run(None, feeds)
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    kernels = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            first = e["args"]["input_type_shape"][0] if e["args"].get("input_type_shape") else {}
            kernels[e["name"][: -len("_kernel_time")]] = (e["args"]["op_name"], next(iter(first), None))
    return kernels


@pytest.fixture(scope="module", params=["int8", "uint8"])
def cnn(request, tmp_path_factory):
    """A residual CNN with every node named, quantized by onnxruntime with its
    defaults (int8 activations) and with uint8 activations."""
    from onnxruntime.quantization import QuantType

    folder = tmp_path_factory.mktemp(f"cnn-{request.param}")
    fp32, quant = folder / "cnn.onnx", folder / "cnn_qdq.onnx"
    onnx.save(gen_models.build_cnn(4, channels=8, size=16, seed=3), fp32)
    scope = {"activation_type": QuantType.QUInt8} if request.param == "uint8" else {}
    gen_models.quantize_qdq(fp32, quant, seed=3, **scope)
    model = onnx.load(quant)
    for i, node in enumerate(model.graph.node):  # the quantizer leaves some unnamed
        node.name = node.name or f"{node.op_type}_{i}"
    onnx.save(model, quant)
    return request.param, quant, model


@pytest.mark.parametrize("level", ["extended", "all"])
def test_static_classes_agree_with_the_profiler_on_every_node(cnn, level, tmp_path):
    _, path, model = cnn
    answer = graphscan.runtime(str(path), level=level)
    kernels = profiled_kernels(model, tmp_path, level)
    ran = 0
    for row in answer["nodes"]:
        if row["class"] == "absorbed":
            assert row["node"] not in kernels or row["runs_in"] != row["node"], row
            continue
        op_name, first_type = kernels[row["runs_in"]]
        assert op_name == row["kernel"], row
        expected = "int8" if op_name in INT8_OPS else "int8_data" if first_type in ("uint8", "int8") else "float"
        assert row["class"] == expected, (row, op_name, first_type)
        ran += 1
    assert ran > 10
    assert answer["classes"]["int8"] > 0 and answer["unmapped"] == []


@x86_only
def test_mixed_types_lists_weights_apart(cnn):
    """With int8 activations, a Conv whose input Q is shared stays int8 while
    its output Q (one reader) becomes uint8: mixed. The weight and bias types
    (int8, int32) are listed apart and not compared."""
    kind, path, _ = cnn
    reasons = [r["reason"] for r in graphscan.runtime(str(path))["nodes"] if r["op_type"] == "Conv" and r["reason"]]
    if kind == "uint8":
        assert reasons == []
        return
    assert reasons and all(
        r == {"code": "mixed_types", "detail": "inputs int8; weights int8, int32; outputs uint8"} for r in reasons
    )


def test_uint8_activations_run_more_int8_kernels_than_the_defaults(tmp_path):
    from onnxruntime.quantization import QuantType

    fp32 = tmp_path / "cnn.onnx"
    onnx.save(gen_models.build_cnn(2, channels=8, size=16, seed=5), fp32)
    int8, uint8 = tmp_path / "s8.onnx", tmp_path / "u8.onnx"
    gen_models.quantize_qdq(fp32, int8, seed=5)
    gen_models.quantize_qdq(fp32, uint8, seed=5, activation_type=QuantType.QUInt8)
    default, unsigned = graphscan.runtime(str(int8)), graphscan.runtime(str(uint8))
    assert unsigned["classes"]["int8"] > default["classes"]["int8"]
    assert unsigned["wrapped_but_float"] < default["wrapped_but_float"]


# --------------------------------------------------------------------------
# --time


def check_time(answer, runs):
    time = answer["time"]
    assert abs(sum(time["shares"].values()) - 1.0) < 1e-9
    assert list(time["shares"]) == ["int8", "int8_data", "float", "quantize", "dequantize"]
    assert time["runs"] == runs and "profiler" in time["method"]
    assert time["profiler_floor_us"] >= 0
    # Every kernel that runs a node has a time; absorbed nodes have none.
    assert set(time["nodes"]) == {r["node"] for r in answer["nodes"] if r["class"] != "absorbed"}
    assert all(us >= 0 for us in time["nodes"].values())
    return time


@x86_only
def test_time_on_a_cnn(cnn):
    """With int8 activations the float Adds leave Q -> DQ pairs as kernels
    (timed against a copy without them); with uint8 everything fuses."""
    kind, path, _ = cnn
    answer = graphscan.runtime(str(path), timed=True, runs=3, shape=["x=1,3,16,16"])
    time = check_time(answer, 3)
    assert time["inputs"] == {"x": [1, 3, 16, 16]} and time["defaulted"] == []
    if kind == "int8":
        assert time["shares"]["quantize"] > 0 and time["shares"]["dequantize"] > 0
        assert time["wall_ms"]["model"] > 0 and time["wall_ms"]["without_round_trips"] > 0
        assert -1 < time["round_trip_cost"] < 1
    else:
        assert time["round_trip_cost"] == 0.0 and time["wall_ms"]["model"] is None


@x86_only
def test_time_without_round_trips_costs_nothing(default_lab):
    """In full.onnx's optimized graph every Q feeds a QLinearMatMul: no
    Q -> DQ pair is left to remove, so the cost is 0 and nothing is timed."""
    time = check_time(graphscan.runtime(str(default_lab["full"]), timed=True, runs=2, shape=["x=4,16"]), 2)
    assert time["round_trip_cost"] == 0.0
    assert time["wall_ms"] == {"model": None, "without_round_trips": None}
    assert "without its 0 activation" in time["method"]


def test_time_says_when_symbolic_dims_were_defaulted(default_lab):
    time = graphscan.runtime(str(default_lab["full"]), timed=True, runs=1)["time"]
    assert time["inputs"] == {"x": [1, DEFAULT_LAB.dim]} and time["defaulted"] == ["x"]


def test_round_trips_removed_from_the_optimized_graph_only():
    """The ablation drops a Q->DQ pair between two float ops, keeps a Q that
    feeds an integer kernel, and keeps weight DQs."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r1"),
        helper.make_node("QuantizeLinear", ["a", "s", "zp"], ["a_q"], name="q1"),
        helper.make_node("DequantizeLinear", ["a_q", "s", "zp"], ["a_dq"], name="dq1"),
        helper.make_node("DequantizeLinear", ["w_q", "s", "zp"], ["w"], name="dqw"),
        helper.make_node("Add", ["a_dq", "w"], ["b"], name="add"),
        helper.make_node("QuantizeLinear", ["b", "s", "zp"], ["b_q"], name="q2"),
        helper.make_node("DequantizeLinear", ["b_q", "s", "zp"], ["b_dq"], name="dq2"),
        helper.make_node("Relu", ["b_dq"], ["c"], name="r2"),
        helper.make_node("QuantizeLinear", ["c", "s", "zp"], ["c_q"], name="q3"),
        helper.make_node("DequantizeLinear", ["c_q", "s", "zp"], ["y"], name="dq3"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", 1, [4])],
        [helper.make_tensor_value_info("y", 1, [4])],
        [f32("s", 0.1), u8("zp", 128), numpy_helper.from_array(np.ones(4, np.uint8), "w_q")],
    )
    ablated, removed = timing.without_round_trips(helper.make_model(graph))
    # q1/dq1 and q2/dq2 go; q3/dq3 stay because dq3 makes the graph output.
    assert removed == 4
    assert [n.name for n in ablated.graph.node] == ["r1", "dqw", "add", "r2", "q3", "dq3"]
    assert list(ablated.graph.node[2].input) == ["a", "w"] and list(ablated.graph.node[3].input) == ["b"]


def test_a_q_that_feeds_another_node_as_well_is_no_round_trip():
    """A Q whose integer output a DQ and another node both read stays: removing it would leave
    that reader without its input (graphscan's copy would not be a valid model)."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r1"),
        helper.make_node("QuantizeLinear", ["a", "s", "zp"], ["a_q"], name="q1"),
        helper.make_node("DequantizeLinear", ["a_q", "s", "zp"], ["a_dq"], name="dq1"),
        helper.make_node("Cast", ["a_q"], ["c"], name="also", to=TensorProto.FLOAT),  # reads the integers too
        helper.make_node("Relu", ["a_dq"], ["b"], name="r2"),
        helper.make_node("Add", ["b", "c"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", 1, [4])],
        [helper.make_tensor_value_info("y", 1, [4])],
        [f32("s", 0.1), u8("zp", 128)],
    )
    ablated, removed = timing.without_round_trips(helper.make_model(graph))
    assert removed == 0 and [n.name for n in ablated.graph.node] == ["r1", "q1", "dq1", "also", "r2", "add"]
    onnx.checker.check_model(ablated, full_check=True)


# --------------------------------------------------------------------------
# As users run it


def test_subprocess_strict_json_and_deterministic(default_lab, tmp_path):
    first = json_answer(run_graphscan(["runtime", default_lab["full"]], cwd=tmp_path))
    second = json_answer(run_graphscan(["runtime", default_lab["full"]], cwd=tmp_path))
    assert first == second and list(first) == ANSWER_KEYS
    assert first["model"] == str(default_lab["full"])
    assert first["environment"]["machine"] == platform.machine()


def test_errors_are_one_line_with_the_documented_code(default_lab, tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not a model")
    custom = gen_models.build_mlp(3, 8, seed=0)
    custom.graph.node[1].op_type, custom.graph.node[1].domain = "Mystery", "example.custom"
    custom.opset_import.append(onnx.helper.make_opsetid("example.custom", 1))
    onnx.save(custom, tmp_path / "custom.onnx")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    full = default_lab["full"]
    cases = [
        (["runtime", tmp_path / "missing.onnx"], 3, "missing.onnx"),
        (["runtime", junk], 4, "not an ONNX model"),
        (["runtime", tmp_path / "custom.onnx"], 5, "does not run in onnxruntime"),
        (["runtime", full, "--provider", "NoSuchExecutionProvider"], 2, "not available"),
        (["runtime", full, "--provider", "AzureExecutionProvider"], 2, "compiles subgraphs"),
        (["runtime", full, "--level", "max"], 2, "invalid choice"),
        (["runtime", full, "--time", "--runs", "0"], 2, "--runs"),
        (["runtime", full, "--time", "--shape", "x=a,b"], 7, "--shape"),
        (["runtime", full, "--time", "--shape", "x=2,15"], 7, "the model declares"),
        (["runtime", full, "--time", "--inputs", tmp_path / "bad.npz"], 7, "not an .npz"),
    ]
    for argv, code, message in cases:
        line = error_line(run_graphscan(argv, cwd=tmp_path), code)
        assert message in line, (argv, line)


def test_temporary_folders_are_removed_on_success_and_failure(default_lab, tmp_path):
    """The optimized graph and the profile go to temporary folders under TMPDIR:
    none may be left behind, whether the command answered or failed."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    json_answer(run_graphscan(["runtime", default_lab["full"], "--time", "--runs", "1"], cwd=tmp_path, env=env))
    custom = gen_models.build_mlp(3, 8, seed=0)
    custom.graph.node[1].op_type, custom.graph.node[1].domain = "Mystery", "example.custom"
    custom.opset_import.append(onnx.helper.make_opsetid("example.custom", 1))
    onnx.save(custom, tmp_path / "custom.onnx")
    error_line(run_graphscan(["runtime", tmp_path / "custom.onnx"], cwd=tmp_path, env=env), 5)
    # (onnxruntime's import leaves a ".ses" session-id file of its own there.)
    assert [p.name for p in scratch.iterdir() if p.name.startswith("graphscan-")] == []
    assert {p.name for p in scratch.iterdir()} <= {".ses"}


@pytest.mark.parametrize(
    "extra",
    [["--runs", "3"], ["--seed", "1"], ["--shape", "x=1,16"], ["--inputs", "{npz}"]],
    ids=["runs", "seed", "shape", "inputs"],
)
def test_time_options_without_time_are_refused(default_lab, tmp_path, extra, capsys):
    np.savez(tmp_path / "x.npz", x=np.zeros((1, 16), np.float32))
    extra = [e.format(npz=tmp_path / "x.npz") for e in extra]
    line = main_error_line(capsys, ["runtime", default_lab["full"], *extra], 2)
    assert extra[0] in line and "--time" in line


def test_runs_are_spread_over_sessions_below_the_profilers_event_cap(default_lab, monkeypatch):
    """onnxruntime's profiler drops every event past 1,000,000, and --runs 150 on a
    20,000-node chain reported a third of --runs 30's time per node. Runs are
    now spread over sessions whose profiles stay far below the cap (here a cap of
    200 events: 9 runs a session for the lab's kernels), and every run is counted."""
    monkeypatch.setattr(timing, "PROFILER_EVENT_CAP", 200)
    sessions, counted = [], []
    real_session, real_totals = (
        timing.profiled_session,
        timing.kernel_totals,
    )

    def spy_session(model_bytes, subject, options, provider, feeds, runs, folder):
        sessions.append(runs)
        return real_session(model_bytes, subject, options, provider, feeds, runs, folder)

    def spy_totals(profile, runs, floor):
        counted.append(sum(1 for _ in timing.profile_events(profile)))
        return real_totals(profile, runs, floor)

    monkeypatch.setattr(timing, "profiled_session", spy_session)
    monkeypatch.setattr(timing, "kernel_totals", spy_totals)
    answer = graphscan.runtime(str(default_lab["full"]), timed=True, runs=30)
    timed_sessions = sessions[1:]  # the first is the profiler-floor model's
    assert sum(timed_sessions) == 30 and len(timed_sessions) > 1 and max(timed_sessions) < 30
    assert all(count < 200 for count in counted)
    assert answer["time"]["runs"] == 30 and set(answer["time"]["nodes"]) == {
        row["node"] for row in answer["nodes"] if row["class"] in ("int8", "int8_data", "float")
    }


def test_a_truncated_profile_is_never_averaged(tmp_path):
    """A profile holding fewer runs than were made (the profiler stopped) is not complete."""
    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 5}]
    events += [{"cat": "Node", "name": "a_kernel_time", "ts": 10 + k, "dur": 3, "args": {}} for k in range(3)]
    profile = tmp_path / "profile.json"
    profile.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n")
    assert timing.kernel_totals(str(profile), runs=2, floor=0.0)[1] is False
    events.append({"cat": "Session", "name": "model_run", "ts": 5, "dur": 5})
    events.append({"cat": "Session", "name": "model_run", "ts": 9, "dur": 5})
    profile.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n")
    totals, complete = timing.kernel_totals(str(profile), runs=2, floor=1.0)
    assert complete is True and totals == {"a": 6.0}  # three events after the warm-up run's start, 3 - 1 each


def test_time_answers_when_a_body_reads_a_dequantized_tensor(tmp_path):
    """graphscan's copy without round trips renamed the DQ's readers at the top
    level only, so an If body still read the removed DQ's output: exit 5 on a valid model."""
    scale, zero = (
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
    )
    branch = {
        name: helper.make_graph(
            [helper.make_node(op, ["xd"], [f"{name}_out"], name=f"{name}_op")],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [2, 4])],
        )
        for name, op in (("then", "Relu"), ("else", "Neg"))
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q0"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq0"),
        helper.make_node("Relu", ["xd"], ["r"], name="relu"),
        helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch["then"], else_branch=branch["else"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in ("y", "r")]
    path = tmp_path / "if.onnx"
    onnx.save(
        helper.make_model(
            helper.make_graph(nodes, "g", inputs, outputs, [scale, zero]), opset_imports=[helper.make_opsetid("", 17)]
        ),
        path,
    )
    answer = json_answer(run_graphscan(["runtime", path, "--time", "--runs", "2"]))
    assert answer["time"]["runs"] == 2


def limited_file_size():
    """In the child: files may not grow past 1 KiB (writes fail with EFBIG), as on a full disk."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


@pytest.mark.parametrize("extra", [[], ["--time", "--runs", "1"]], ids=["optimized-graph", "profile"])
def test_a_full_temporary_folder_is_exit_3_not_a_model_that_does_not_run(default_lab, tmp_path, extra):
    """onnxruntime could not save its optimized graph ("Protobuf serialization failed")
    and the healthy model was blamed with exit 5."""
    import subprocess
    import sys

    from tests.helpers import GRAPHSCAN

    proc = subprocess.run(
        [sys.executable, GRAPHSCAN, "runtime", default_lab["full"], *extra],
        capture_output=True,
        preexec_fn=limited_file_size,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        timeout=120,
    )
    line = error_line(proc, 3)
    assert "temporary folder" in line and "TMPDIR" in line
    assert [p for p in tmp_path.iterdir() if p.name.startswith("graphscan-")] == []  # nothing of ours left behind


def test_no_writable_temporary_folder_is_exit_3(default_lab, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing" / "folder"))
    with pytest.raises(graphscan.GraphscanError) as caught:
        graphscan.runtime(str(default_lab["full"]))
    assert caught.value.exit_code == 3 and "no writable temporary folder" in str(caught.value)


def test_time_on_a_float16_model_keeps_the_round_trips_onnxruntime_casts_around(tmp_path):
    """onnxruntime runs a float16 MatMul in float: it casts the weight and the DQ's scale to
    float. A Cast's output was typed as its input's (float16), so the activation pair looked
    removable and graphscan's copy without round trips did not run (exit 5, "Type parameter
    (T) of Optype (MatMul) bound to different types")."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 4)).astype(np.float16), "W")
    scale = numpy_helper.from_array(np.array(0.05, np.float16), "s")
    zero = numpy_helper.from_array(np.array(128, np.uint8), "z")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("MatMul", ["xd", "W"], ["m"], name="mm"),
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["mq"]),
        helper.make_node("DequantizeLinear", ["mq", "s", "z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "float16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4])],
        [weight, scale, zero],
    )
    path = tmp_path / "f16.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)
    answer = graphscan.runtime(str(path), timed=True, runs=2)  # it was exit 5
    # The pair before the MatMul feeds a float Cast chain now typed as float: it stays (the
    # other makes the graph output), so nothing is removed and nothing is blamed.
    assert answer["time"]["round_trip_cost"] == 0 and answer["time"]["wall_ms"]["model"] is None
