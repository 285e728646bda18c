"""Reading and editing ONNX graphs (graphscan_ort/shared/graph.py): fresh names never
repeat, the default domain in both of its spellings, a Q's output type by the ONNX spec
(checked against onnx's reference evaluator)."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from graphscan_ort.shared import graph


def test_fresh_names_never_repeat_and_join_the_taken_names():
    taken = {"conv", "conv_1"}
    made = [graph.fresh_name("conv", taken) for _ in range(3)]
    assert made == ["conv_2", "conv_3", "conv_4"]
    assert taken == {"conv", "conv_1", *made}
    assert graph.fresh_name("relu", taken) == "relu" and "relu" in taken


@pytest.mark.parametrize(
    ("imports", "expected"),
    [
        pytest.param([("ai.onnx", 13)], 13, id="ai.onnx"),
        pytest.param([("com.microsoft", 1), ("", 11)], 11, id="empty-domain-after-another"),
        pytest.param([("com.microsoft", 1)], 0, id="none"),
    ],
)
def test_the_default_opset_is_read_from_either_spelling_of_the_default_domain(imports, expected):
    model = helper.make_model(
        helper.make_graph([], "g", [], []), opset_imports=[helper.make_opsetid(d, v) for d, v in imports]
    )
    assert graph.default_opset(model) == expected


def q_model(with_zero_point):
    """x -> QuantizeLinear(scale 0.1[, zero point int8 0]) -> y."""
    inputs = ["x", "s", "zp"] if with_zero_point else ["x", "s"]
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s")]
    if with_zero_point:
        inits.append(numpy_helper.from_array(np.array(0, np.int8), "zp"))
    q = helper.make_node("QuantizeLinear", inputs, ["y"], name="q")
    g = helper.make_graph(
        [q],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.INT8 if with_zero_point else TensorProto.UINT8, [3])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), q


@pytest.mark.parametrize("with_zero_point", [False, True], ids=["no-zero-point", "int8-zero-point"])
def test_a_qs_range_follows_the_type_the_onnx_spec_gives_its_output(with_zero_point):
    """Without a zero point a Q makes uint8 (the ONNX spec); the range read from the graph
    is what onnx's reference evaluator saturates to."""
    model, q = q_model(with_zero_point)
    x = np.array([-1000.0, 0.0, 1000.0], np.float32)
    (y,) = ReferenceEvaluator(model).run(None, {"x": x})
    constants = graph.constant_arrays(model.graph)
    lo, hi, scale_type = graph.quant_range(q, constants)
    zero = constants["zp"].proto.data_type if with_zero_point else None
    assert graph.q_output_type(q, zero) == helper.np_dtype_to_tensor_dtype(y.dtype)
    assert (lo, hi) == pytest.approx((float(y[0]) * 0.1, float(y[2]) * 0.1))
    assert scale_type == TensorProto.FLOAT


@pytest.mark.parametrize("coordinates", [False, True])
def test_a_sparse_initializer_densifies_to_the_tensor_it_stands_for(coordinates):
    """Linear positions ([NNZ]) and coordinates ([NNZ, rank]) alike, under the values' name."""
    values = numpy_helper.from_array(np.array([1.5, -2.0], dtype=np.float32), "w")
    positions = np.array([[0, 1], [1, 2]]) if coordinates else np.array([1, 5])
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(positions.astype(np.int64), "w_i"), [2, 3])
    dense = graph.dense_initializer(sparse)
    assert dense.name == "w"
    np.testing.assert_array_equal(numpy_helper.to_array(dense), [[0, 1.5, 0], [0, 0, -2.0]])
