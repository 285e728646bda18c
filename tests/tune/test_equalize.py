"""Cross-layer equalization (issue 33 item 3): the equalized model computes the float
function of the original (onnxruntime on both), and each pair's per-channel weight ranges
come out equal, ``sqrt(r1 * r2)``, by numpy on the weights themselves."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from graphscan_ort.tune.equalize import equalized, pair_scales

RNG = np.random.default_rng(33)
CHANNELS = 8


def conv(name, x, y, weight, bias=True, group=1, dilation=1):
    """A Conv node and its initializers; ``weight`` scaled per output row so that the
    ranges differ widely (what equalization is for)."""
    inits = [onnx.numpy_helper.from_array(weight.astype(np.float32), f"{name}_w")]
    inputs = [x, f"{name}_w"]
    if bias:
        inits.append(onnx.numpy_helper.from_array(RNG.normal(size=weight.shape[0]).astype(np.float32), f"{name}_b"))
        inputs.append(f"{name}_b")
    pad = dilation * (weight.shape[2] // 2)
    node = helper.make_node("Conv", inputs, [y], name=name, group=group, dilations=[dilation, dilation], pads=[pad] * 4)
    return node, inits


def uneven(shape):
    """Weights whose output rows span 1e-3 to 10 in range."""
    rows = np.logspace(-3, 1, shape[0]).reshape((-1,) + (1,) * (len(shape) - 1))
    return RNG.normal(size=shape) * RNG.permutation(rows)


def chain_model(middle_op, second_group=1, second_dilation=1, links=2, clip=None):
    """``links`` Convs of CHANNELS channels joined by ``middle_op`` (None: directly); the
    second Conv grouped by ``second_group`` (CHANNELS: depthwise), dilated by ``second_dilation``."""
    nodes, inits, x = [], [], "x"
    for k in range(links):
        group = second_group if k else 1
        weight = uneven((CHANNELS, CHANNELS // group, 3, 3))
        node, more = conv(f"conv{k}", x, f"c{k}", weight, group=group, dilation=second_dilation if k else 1)
        nodes.append(node)
        inits += more
        x = f"c{k}"
        if middle_op and k < links - 1:
            inputs = [x]
            if middle_op == "Clip":
                for bound, value in zip(("lo", "hi"), clip, strict=True):
                    if value is None:
                        inputs.append("")
                    else:
                        inits.append(onnx.numpy_helper.from_array(np.array(value, np.float32), f"{k}{bound}"))
                        inputs.append(f"{k}{bound}")
            if middle_op == "PRelu":
                slope = RNG.uniform(0.05, 0.3, size=(CHANNELS, 1, 1)).astype(np.float32)
                inits.append(onnx.numpy_helper.from_array(slope, f"{k}slope"))
                inputs.append(f"{k}slope")
            nodes.append(helper.make_node(middle_op, inputs, [f"a{k}"], name=f"act{k}"))
            x = f"a{k}"
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS, 12, 12])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def weights(model):
    return {init.name: onnx.numpy_helper.to_array(init).astype(np.float64) for init in model.graph.initializer}


def ranges_after(model, first, second, group):
    """``(r1, r2)`` per channel, by numpy from the weights: Conv1's rows and Conv2's input columns."""
    w = weights(model)
    w1, w2 = w[f"{first}_w"], w[f"{second}_w"]
    r1 = np.abs(w1.reshape(w1.shape[0], -1)).max(axis=1)
    per_group = w2.shape[1]
    r2 = np.array(
        [
            np.abs(
                w2[
                    (c // per_group) * (w2.shape[0] // group) : (c // per_group + 1) * (w2.shape[0] // group),
                    c % per_group,
                ]
            ).max()
            for c in range(w1.shape[0])
        ]
    )
    return r1, r2


@pytest.mark.parametrize(
    ("middle", "group", "dilation"),
    [
        pytest.param("Relu", 1, 1, id="conv-relu-conv"),
        pytest.param("Relu", CHANNELS, 1, id="conv-relu-depthwise"),
        pytest.param("Relu", 2, 2, id="conv-relu-grouped-dilated"),
        pytest.param("PRelu", 1, 1, id="conv-prelu-conv"),
        pytest.param("LeakyRelu", CHANNELS, 1, id="conv-leakyrelu-depthwise"),
        pytest.param(None, 1, 1, id="conv-conv"),
    ],
)
def test_one_pair_keeps_the_function_and_equalizes_the_ranges(middle, group, dilation):
    model = chain_model(middle, second_group=group, second_dilation=dilation)
    before = ranges_after(model, "conv0", "conv1", group)
    out, count = equalized(model)
    assert count == 1
    r1, r2 = ranges_after(out, "conv0", "conv1", group)
    np.testing.assert_allclose(r1, r2, rtol=1e-5)
    np.testing.assert_allclose(r1, np.sqrt(before[0] * before[1]), rtol=1e-5)
    x = RNG.normal(size=(1, CHANNELS, 12, 12)).astype(np.float32)
    expected = run(model, x)
    np.testing.assert_allclose(run(out, x), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_a_chain_of_four_settles_on_equal_ranges_everywhere():
    model = chain_model("Relu", links=4)
    out, count = equalized(model)
    assert count == 3
    for k in range(3):
        r1, r2 = ranges_after(out, f"conv{k}", f"conv{k + 1}", 1)
        np.testing.assert_allclose(r1, r2, rtol=1e-2)
    x = RNG.normal(size=(1, CHANNELS, 12, 12)).astype(np.float32)
    expected = run(model, x)
    np.testing.assert_allclose(run(out, x), expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize(
    ("bounds", "passes"),
    [
        pytest.param((0.0, None), True, id="clip-0-inf-is-relu"),
        pytest.param((None, None), True, id="clip-unbounded"),
        pytest.param((0.0, 6.0), False, id="relu6-left-alone"),
        pytest.param((-1.0, None), False, id="clip-negative-floor-left-alone"),
    ],
)
def test_clip_is_passed_only_where_its_bounds_stay_scalar(bounds, passes):
    model = chain_model("Clip", clip=bounds)
    out, count = equalized(model)
    assert count == (1 if passes else 0)
    if not passes:
        assert weights(out).keys() == weights(model).keys()
        assert all(np.array_equal(weights(out)[k], v) for k, v in weights(model).items())


def test_a_weight_another_node_reads_is_left_alone():
    model = chain_model("Relu")
    model.graph.node.append(helper.make_node("Add", ["conv1_w", "conv1_w"], ["twice"], name="reader"))
    model.graph.output.append(helper.make_tensor_value_info("twice", TensorProto.FLOAT, None))
    assert equalized(model)[1] == 0


def test_an_activation_that_is_a_graph_output_is_left_alone():
    model = chain_model("Relu")
    model.graph.output.append(helper.make_tensor_value_info("a0", TensorProto.FLOAT, None))
    assert equalized(model)[1] == 0


def test_specs_worked_example():
    """SPEC: rows with ranges r1 = (4, 0.01) into input channels with r2 = (0.25, 1) give
    s = (4, 0.1), and both Convs' ranges become (1, 0.1)."""
    first = np.array([[4.0, -1.0], [0.005, -0.01]]).reshape(2, 2, 1, 1)
    second = np.array([[0.25, -1.0], [-0.1, 0.5]]).reshape(2, 2, 1, 1)
    scales = pair_scales(first, second, 1)
    np.testing.assert_allclose(scales, [4.0, 0.1])
    np.testing.assert_allclose(np.abs(first).max(axis=(1, 2, 3)) / scales, [1.0, 0.1])
    np.testing.assert_allclose(np.abs(second).max(axis=(0, 2, 3)) * scales, [1.0, 0.1])
