"""The rewrites tune will apply (issue 18): each keeps the outputs (checked against
onnxruntime within fuse's 1e-5 relative) and shows its effect in runtime's counts
once the model is quantized with uint8 activations, per channel."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.shared.metrics as metrics
import graphscan_ort.tune.rewrites as rewrites


def conv_block_model(middle, opset=13):
    """x -> Conv -> ``middle`` nodes (reading ``c0``, writing ``d``) -> Conv -> y."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(4.0, np.float32), "four"),
        numpy_helper.from_array(np.array([2.0, 0.0, 1.0, 3.0], np.float32).reshape(1, 4, 1, 1), "with_zero"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c0"], name="conv", pads=[1, 1, 1, 1]),
        *middle,
        helper.make_node("Conv", ["d", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


DIV = [helper.make_node("Div", ["c0", "four"], ["d"], name="div")]
HARD_SIGMOID = [helper.make_node("HardSigmoid", ["c0"], ["d"], name="hs", alpha=0.25, beta=0.4)]
SAMPLES = [{"x": np.random.default_rng(k).standard_normal((1, 3, 8, 8)).astype(np.float32)} for k in range(2)]


def int8_classes(model, folder, name):
    """runtime's classes of ``model`` quantized with uint8 activations, per channel."""
    from onnxruntime.quantization import QuantType

    source, target = folder / f"{name}.onnx", folder / f"{name}_u8.onnx"
    onnx.save(model, source)
    with gen_models.quiet_quantizer():
        gen_models.quantize_qdq(source, target, seed=0, activation_type=QuantType.QUInt8, per_channel=True)
    answer = graphscan.runtime(str(target))
    return answer["classes"], {row["op_type"]: row["class"] for row in answer["nodes"]}


@pytest.mark.parametrize(
    ("middle", "rewrite", "before_op"),
    [
        pytest.param(DIV, "div_by_constant", "Div", id="div"),
        pytest.param(HARD_SIGMOID, "hard_sigmoid", "HardSigmoid", id="hard-sigmoid"),
    ],
)
def test_a_rewrite_keeps_the_outputs_and_unlocks_int8_kernels(tmp_path, middle, rewrite, before_op):
    model = conv_block_model(middle)
    rewritten, count = rewrites.REWRITES[rewrite](model)
    assert count == 1
    onnx.checker.check_model(rewritten, full_check=True)
    error, problem = metrics.verified(model, rewritten, SAMPLES)
    assert problem is None and error < 1e-5
    before, before_ops = int8_classes(model, tmp_path, "before")
    after, after_ops = int8_classes(rewritten, tmp_path, "after")
    assert before_ops[before_op] == "float" and before_op not in after_ops
    assert after["float"] == before["float"] - 1 and after["int8"] > before["int8"]


def test_only_safe_divisions_are_rewritten():
    """A divisor that is not a constant, or holds a zero, stays a Div."""
    by_input = [helper.make_node("Div", ["c0", "c0"], ["d"], name="div")]
    by_zero = [helper.make_node("Div", ["c0", "with_zero"], ["d"], name="div")]
    for middle in (by_input, by_zero):
        rewritten, count = rewrites.div_by_constant(conv_block_model(middle))
        assert count == 0 and [n.op_type for n in rewritten.graph.node].count("Div") == 1


def test_hard_sigmoid_before_opset_11_is_left_alone():
    """Clip reads its bounds as inputs from opset 11 on: older models keep their HardSigmoid."""
    rewritten, count = rewrites.hard_sigmoid(conv_block_model(HARD_SIGMOID, opset=10))
    assert count == 0 and "HardSigmoid" in [n.op_type for n in rewritten.graph.node]


def test_a_rewrite_that_changes_the_outputs_is_caught():
    model = conv_block_model(DIV)
    broken, _ = rewrites.div_by_constant(model)
    for init in broken.graph.initializer:
        if init.name.endswith("_reciprocal"):
            init.CopyFrom(numpy_helper.from_array(np.array(0.3, np.float32), init.name))
    _, problem = metrics.verified(model, broken, SAMPLES)
    assert problem is not None and "output SQNR of 14 dB" in problem  # a wrong reciprocal: far below 80 dB


SAMPLES_1x4 = [{"x": np.array([[-4.0, -1.0, 0.5, 3.0]], np.float32)}]


def test_an_unnamed_hard_sigmoids_clip_takes_a_fresh_name():
    """An unnamed HardSigmoid at position 1 is HardSigmoid_1 by the SPEC; when another node
    already has that name, the Clip must not take it (the rewritten model was invalid)."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="HardSigmoid_1"),
            helper.make_node("HardSigmoid", ["r"], ["y"]),
        ],
        "clash",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    rewritten, count = rewrites.hard_sigmoid(model)
    names = [n.name for n in rewritten.graph.node]
    assert count == 1 and len(names) == len(set(names)), names
    onnx.checker.check_model(rewritten, full_check=True)
    _, problem = metrics.verified(model, rewritten, SAMPLES_1x4)
    assert problem is None


def one_op_model(op, elem_type, opset=13, constant=None, **attributes):
    """x -> op(x[, c]) -> y on [1, 4] tensors of ``elem_type``; ``c`` an initializer when given."""
    inits = [numpy_helper.from_array(constant, "c")] if constant is not None else []
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "c"] if inits else ["x"], ["y"], name="op", **attributes)],
        "g",
        [helper.make_tensor_value_info("x", elem_type, [1, 4])],
        [helper.make_tensor_value_info("y", elem_type, [1, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_an_integer_division_is_never_rewritten():
    """7 / 2 is 3 in int32: no Mul by a reciprocal computes that."""
    model = one_op_model("Div", TensorProto.INT32, constant=np.array(2, np.int32))
    rewritten, count = rewrites.div_by_constant(model)
    assert count == 0 and [n.op_type for n in rewritten.graph.node] == ["Div"]


def test_a_float16_hard_sigmoid_is_rewritten_in_float16():
    from onnx.reference import ReferenceEvaluator

    model = one_op_model("HardSigmoid", TensorProto.FLOAT16, alpha=0.25, beta=0.4)
    rewritten, count = rewrites.hard_sigmoid(model)
    assert count == 1
    onnx.checker.check_model(rewritten, full_check=True)
    assert {init.data_type for init in rewritten.graph.initializer} == {TensorProto.FLOAT16}
    x = np.array([[-4.0, -1.0, 0.5, 3.0]], np.float16)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(ReferenceEvaluator(rewritten).run(None, {"x": x})[0], expected, atol=1e-3)


@pytest.mark.parametrize(("opset", "rewritten"), [(10, False), (11, True)])
def test_hard_sigmoid_is_rewritten_from_opset_11_on(opset, rewritten):
    """Clip reads its bounds as inputs from opset 11 on: 11 itself is rewritten."""
    model = one_op_model("HardSigmoid", TensorProto.FLOAT, opset=opset, alpha=0.25, beta=0.4)
    out, count = rewrites.hard_sigmoid(model)
    assert count == int(rewritten)
    onnx.checker.check_model(out, full_check=True)
    if rewritten:
        _, problem = metrics.verified(model, out, SAMPLES_1x4)
        assert problem is None
