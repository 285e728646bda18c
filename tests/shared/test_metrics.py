"""Both models' paired outputs (graphscan_ort/shared/metrics.py: paired_outputs), the one
run behind impact's deployed SQNR, check's min_sqnr and min_metric and tune's candidates:
outputs are paired by name whatever order the quantized model lists them in, and the float
model runs once for every candidate that shares what it keeps."""

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphscan_ort.shared import metrics, sessions
from graphscan_ort.shared.options import Named
from tests.tune.test_prepare import scaled_model as scaled  # y = x * factor

SAMPLES = [{"x": np.array([[-2.0, -0.5, 0.5, 3.0]], dtype=np.float32)}]


def two_outputs(shift: float, reversed_outputs: bool) -> onnx.ModelProto:
    """``y = Relu(x) + shift`` and ``z = -x``, its outputs listed as (y, z) or (z, y)."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Add", ["r", "shift"], ["y"]),
        helper.make_node("Neg", ["x"], ["z"]),
    ]
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 4]) for name in ("y", "z")]
    graph = helper.make_graph(
        nodes,
        "two_outputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        outputs[::-1] if reversed_outputs else outputs,
        [helper.make_tensor("shift", TensorProto.FLOAT, [], [shift])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def paired(float_model, quant_model, kept=None):
    pairs = metrics.output_pairs(Named(float_model, "f.onnx"), Named(quant_model, "q.onnx"))
    options = sessions.deployed_options()
    reference, candidate = Named(float_model, "f.onnx"), Named(quant_model, "q.onnx")
    return metrics.paired_outputs(reference, candidate, SAMPLES, pairs, options, kept)


def test_outputs_are_paired_by_name_whatever_order_the_quantized_model_lists_them_in():
    outputs = paired(two_outputs(0.0, False), two_outputs(0.25, True))
    by_name = outputs.candidate_by_name()[0]
    np.testing.assert_array_equal(by_name["y"], [[0.25, 0.25, 0.75, 3.25]])  # y, not z, though z is listed first
    np.testing.assert_array_equal(by_name["z"], [[2.0, 0.5, -0.5, -3.0]])
    y_signal, z_signal = 0.5**2 + 3.0**2, 2.0**2 + 0.5**2 + 0.5**2 + 3.0**2  # y = Relu(x), z = -x
    noise = 4 * 0.25**2  # only y moved, by 0.25 everywhere
    figures = outputs.figures()
    # Each output is a part of its own: the worst is y's, z is exact; pooled sums both.
    assert figures.worst_db == pytest.approx(10 * math.log10(y_signal / noise)) and not figures.exact
    assert figures.worst_part == {"output": "y", "part": 0, "node": None} or figures.worst_part["output"] == "y"
    assert figures.pooled_db == pytest.approx(10 * math.log10((y_signal + z_signal) / noise))


def test_equal_outputs_are_exact_and_infinitely_accurate_but_no_value_is_undefined():
    """One edge rule for every answer (metrics.answer_figures): equal outputs are an infinite
    SQNR, worst and pooled, with no worst part; a zero-size sample verifies nothing (None)."""
    exact = paired(two_outputs(0.0, False), two_outputs(0.0, True)).figures()
    assert exact == metrics.SqnrFigures(math.inf, None, math.inf, True)
    raw = metrics.SqnrFigures(None, None, None, True)
    assert metrics.answer_figures(raw, empty=True) == metrics.SqnrFigures(None, None, None, False)
    measured = metrics.SqnrFigures(12.5, {"output": "y", "part": 0, "node": None}, 20.0, False)
    assert metrics.answer_figures(measured, empty=False) == measured


def test_the_float_model_runs_once_for_every_candidate_that_shares_what_is_kept(monkeypatch):
    runs = []
    real = metrics.model_outputs
    monkeypatch.setattr(
        metrics,
        "model_outputs",
        lambda model, samples, path, *rest: runs.append(path) or real(model, samples, path, *rest),
    )
    float_model, kept = two_outputs(0.0, False), {}
    figures = [paired(float_model, two_outputs(shift, True), kept).figures().worst_db for shift in (0.25, 0.5)]
    assert runs == ["f.onnx", "q.onnx", "q.onnx"]
    assert figures[0] > figures[1]  # the second candidate still measured against the float outputs
    # Without anything kept, every call runs the float model again.
    paired(float_model, two_outputs(0.25, True))
    assert runs[3:] == ["f.onnx", "q.onnx"]


@pytest.mark.parametrize("magnitude", [1e3, 1.0, 1e-3])
@pytest.mark.parametrize("share", [0.5, 2.0])
def test_the_tolerance_is_relative_to_the_original_outputs_largest_magnitude_at_least_1(magnitude, share):
    """A change of y = x to y = x (1 + d) moves the largest output (magnitude M) by M d; fuse's rule
    allows 1e-5 max(M, 1). So d = share * 1e-5 max(M, 1) / M passes at half the allowance and
    fails at twice it, whatever the magnitude (a tolerance relative to the error, to 1, or to M
    alone breaks one of them)."""
    allowed = metrics.VERIFY_RELATIVE_TOLERANCE * max(magnitude, 1.0)
    d = share * allowed / magnitude
    x = np.array([[1.0, 0.5, -0.25, 0.75]], np.float32) * np.float32(magnitude)
    result = metrics.verify(scaled(1.0), scaled(1.0 + d), [{"x": x}])
    assert (result.problem is None) == (share < 1), (result.max_abs_error, allowed)
    assert result.max_abs_error == pytest.approx(magnitude * d, rel=1e-2)
    _, scale, _, _ = metrics.compare_outputs([x], [x * np.float32(1 + d)])
    assert scale == float(np.max(np.abs(x)))  # the original's largest magnitude, never the changed one's


def declared_output(type_proto):
    """A model whose one output ``out`` is declared with ``type_proto`` (nothing computes it:
    the rule reads declarations before anything runs)."""
    graph = helper.make_graph([], "declared", [], [helper.make_value_info("out", type_proto)])
    return Named(helper.make_model(graph), "m.onnx")


@pytest.mark.parametrize(
    ("type_proto", "kind"),
    [
        pytest.param(helper.make_tensor_type_proto(TensorProto.STRING, [2]), "a string tensor", id="string"),
        pytest.param(helper.make_tensor_type_proto(TensorProto.COMPLEX64, [2]), "a complex tensor", id="complex"),
        pytest.param(helper.make_tensor_type_proto(TensorProto.COMPLEX128, [2]), "a complex tensor", id="complex128"),
        pytest.param(
            helper.make_sequence_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, None)),
            "a sequence",
            id="sequence",
        ),
        pytest.param(
            helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [])),
            "a map",
            id="map",
        ),
        pytest.param(
            helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [2])),
            "an optional",
            id="optional",
        ),
        pytest.param(helper.make_tensor_type_proto(TensorProto.FLOAT, [2]), None, id="float"),
        pytest.param(helper.make_tensor_type_proto(TensorProto.FLOAT16, [2]), None, id="float16"),
        pytest.param(helper.make_tensor_type_proto(TensorProto.INT64, [2]), None, id="int64"),
        pytest.param(helper.make_tensor_type_proto(TensorProto.BOOL, [2]), None, id="bool"),
        pytest.param(onnx.TypeProto(), None, id="undeclared"),
    ],
)
def test_only_an_output_declared_as_a_tensor_of_numbers_passes_before_anything_runs(type_proto, kind):
    named = declared_output(type_proto)
    if kind is None:
        metrics.require_numbers(named, ["out"])
        return
    with pytest.raises(
        metrics.GraphscanError, match=f"^usage: m.onnx: output 'out' is {kind}, not a tensor of numbers"
    ):
        metrics.require_numbers(named, ["out"])


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        pytest.param(np.array(["a", "b"], dtype=object), "a string tensor", id="strings"),
        pytest.param([np.zeros(1, np.float32), np.zeros(3, np.float32)], "a sequence", id="ragged-sequence"),
        pytest.param([{1: 0.5}], "a sequence", id="sequence-of-maps"),
        pytest.param({1: 0.5}, "a map", id="map"),
        pytest.param(None, "an optional without a value", id="empty-optional"),
        pytest.param(np.zeros(2, np.complex64), "a complex tensor", id="complex"),
        pytest.param(np.zeros(2, np.float16), None, id="float16"),
        pytest.param(np.zeros(2, np.uint8), None, id="uint8"),
        pytest.param(np.zeros(2, bool), None, id="bool"),
    ],
)
def test_an_undeclared_output_is_judged_by_its_value_in_every_sample(value, kind):
    named = declared_output(onnx.TypeProto())
    fine = [np.zeros(2, np.float32)]
    if kind is None:
        metrics.require_numbers(named, ["out"], [fine, [value]])
        return
    with pytest.raises(
        metrics.GraphscanError, match=f"^usage: m.onnx: output 'out' is {kind}, not a tensor of numbers"
    ):
        metrics.require_numbers(named, ["out"], [fine, [value]])  # the second sample's value tells
