"""tune's preparation (issue 18): onnxruntime's quant_pre_process, the opset, the rewrites,
each verified against the original model and dropped with its reason when it fails."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphscan_ort.shared.graph as graph_edit
import graphscan_ort.shared.metrics as metrics
import graphscan_ort.tune.prepare as prepare
import graphscan_ort.tune.rewrites as rewrites
from tests.tune.test_rewrites import DIV, HARD_SIGMOID, SAMPLES, conv_block_model


def test_every_step_is_verified_and_the_result_reproduces_the_original(tmp_path):
    """An opset-11 CNN with a Div by a constant and a HardSigmoid: pre-processed, raised
    to opset 13 and both rewritten, each step within fuse's tolerance of the original."""
    middle = [
        helper.make_node("Div", ["c0", "four"], ["h"], name="div"),
        helper.make_node("HardSigmoid", ["h"], ["d"], name="hs", alpha=0.25, beta=0.4),
    ]
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(middle, opset=11), source)
    prepared, steps = prepare.prepare(str(source), str(tmp_path), SAMPLES)
    assert [s["step"] for s in steps] == ["quant_pre_process", "opset", "div_by_constant", "hard_sigmoid"]
    assert all(s["ok"] for s in steps), steps
    assert graph_edit.default_opset(prepared) == 13
    assert {"Div", "HardSigmoid"}.isdisjoint(n.op_type for n in prepared.graph.node)
    error, problem = metrics.verified(onnx.load(source), prepared, SAMPLES)
    assert problem is None and error < 1e-5


def test_a_step_that_changes_the_outputs_is_dropped_with_its_reason(tmp_path, monkeypatch):
    def wrong(model):
        out, count = rewrites.div_by_constant(model)
        for init in out.graph.initializer:
            if init.name.endswith("_reciprocal"):
                init.CopyFrom(onnx.numpy_helper.from_array(np.array(0.3, np.float32), init.name))
        return out, count

    monkeypatch.setitem(rewrites.REWRITES, "div_by_constant", wrong)
    monkeypatch.setattr(prepare, "REWRITES", rewrites.REWRITES)
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(DIV), source)
    prepared, steps = prepare.prepare(str(source), str(tmp_path), SAMPLES)
    (div,) = [s for s in steps if s["step"] == "div_by_constant"]
    assert div["ok"] is False and "output SQNR" in div["detail"] and "80 dB" in div["detail"]
    assert "Div" in [n.op_type for n in prepared.graph.node]  # the last good model goes on


def test_hard_sigmoid_alone_is_rewritten_after_the_opset(tmp_path):
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(HARD_SIGMOID, opset=10), source)
    prepared, steps = prepare.prepare(str(source), str(tmp_path), SAMPLES)
    assert [s["step"] for s in steps if s["ok"]] == ["quant_pre_process", "opset", "hard_sigmoid"]
    assert "HardSigmoid" not in [n.op_type for n in prepared.graph.node]


def scaled_model(factor):
    """y = x * factor: an original (factor 1) and its 'prepared' twins."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("k", TensorProto.FLOAT, [], [factor])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize(
    ("factor", "kept"),
    [
        # 2e-5 relative, more than fuse's 1e-5 allows: what PP-OCR det's BatchNorm folding
        # costs (1.5e-5). Its SQNR, 20*log10(1/2e-5) = 94 dB, is above 80: float reassociation.
        pytest.param(1 + 2e-5, True, id="reassociation-kept"),
        # 1e-3 relative, 60 dB: still below int8's noise, yet a real change of the model.
        pytest.param(1 + 1e-3, False, id="a-real-change-dropped"),
    ],
)
def test_the_prepare_tolerance_keeps_reassociation_and_drops_a_real_change(factor, kept):
    samples = [{"x": np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)}]
    error, problem = metrics.verified(scaled_model(1.0), scaled_model(factor), samples)
    assert (problem is None) is kept, problem
    assert error == pytest.approx(3.0 * (factor - 1), rel=1e-2)  # the largest value times the change


def test_a_step_with_nothing_finite_to_compare_is_not_verified():
    """All-NaN samples compare nothing: no step is verified on them (a Div by the denormal
    1e-40 rewritten as a Mul by inf passed this way)."""
    samples = [{"x": np.full((1, 4), np.nan, np.float32)}]
    _, problem = metrics.verified(scaled_model(1.0), scaled_model(2.0), samples)
    assert problem is not None and "nothing to compare" in problem


def constant_weight_model():
    """A Conv whose weight and bias are Constant nodes, as PP-OCR's models keep them."""
    weight = np.random.default_rng(0).standard_normal((2, 1, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(weight, "w")),
        helper.make_node("Constant", [], ["b"], value=onnx.numpy_helper.from_array(np.ones(2, np.float32), "b")),
        helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "constant_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_constant_weights_become_initializers_bit_exact_even_without_quant_pre_process(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "pre_processed", lambda source, target: (None, "quant_pre_process failed (test)"))
    source = tmp_path / "float.onnx"
    onnx.save(constant_weight_model(), source)
    samples = [{"x": np.random.default_rng(1).standard_normal((1, 1, 4, 4)).astype(np.float32)}]
    prepared, steps = prepare.prepare(str(source), str(tmp_path), samples)
    (constants,) = [s for s in steps if s["step"] == "constants"]
    assert constants["ok"] and constants["max_abs_error"] == 0.0 and constants["detail"].startswith("2 Constant")
    assert "Constant" not in [n.op_type for n in prepared.graph.node]
    assert sorted(init.name for init in prepared.graph.initializer) == ["b", "w"]


def test_a_dropped_quant_pre_process_says_what_it_costs():
    folded = onnx.ModelProto()
    folded.CopyFrom(constant_weight_model())
    del folded.graph.node[:2]  # as if both Constants were folded away
    assert prepare.folding_lost(constant_weight_model(), folded) == "the 2 nodes it folds (2 Constant)"


def test_unnamed_nodes_are_named_so_that_an_exclusion_excludes_them(tmp_path):
    """Without names, nodes_to_exclude got graphscan's derived names, which name nothing in
    prepared.onnx: every exclusion rebuilt the same model."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    unnamed = onnx.ModelProto()
    unnamed.CopyFrom(constant_weight_model())
    for node in unnamed.graph.node:
        node.name = ""
    source = tmp_path / "float.onnx"
    onnx.save(unnamed, source)
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 1, 4, 4)).astype(np.float32)} for k in range(2)]
    prepared, steps = prepare.prepare(str(source), str(tmp_path), samples)
    names = [node.name for node in prepared.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert [s["ok"] for s in steps if s["step"] == "names"] == [True]
    onnx.save(prepared, tmp_path / "prepared.onnx")
    conv = next(node.name for node in prepared.graph.node if node.op_type == "Conv")

    def quantized(exclude):
        target = tmp_path / f"q{len(exclude)}.onnx"
        reader = iter(samples)
        calibration = type("R", (), {"get_next": lambda self: next(reader, None)})()
        quantize_static(
            tmp_path / "prepared.onnx", target, calibration, quant_format=QuantFormat.QDQ, nodes_to_exclude=exclude
        )
        return [n.op_type for n in onnx.load(target).graph.node]

    assert quantized([]).count("QuantizeLinear") > quantized([conv]).count("QuantizeLinear")  # it is excluded


def test_a_bit_exact_step_is_checked_against_the_step_before_not_the_original(tmp_path, monkeypatch):
    """quant_pre_process's folding reassociates sums (here: one weight changed by 1e-7, about
    110 dB); naming the unnamed nodes after it changes nothing more and is kept. Compared
    with the original, as on the PP-OCR recognizer, it was dropped at 'allowed inf dB'."""
    unnamed = onnx.ModelProto()
    unnamed.CopyFrom(conv_block_model(DIV))
    for node in unnamed.graph.node:
        node.name = ""
    source = tmp_path / "float.onnx"
    onnx.save(unnamed, source)

    def reassociated(src, target):
        model = onnx.load(src)
        weight = next(t for t in model.graph.initializer if t.name == "w")
        values = onnx.numpy_helper.to_array(weight) * np.float32(1 + 1e-7)
        weight.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), "w"))
        onnx.save(model, target)
        return target, "quant_pre_process ran"

    monkeypatch.setattr(prepare, "pre_processed", reassociated)
    prepared, steps = prepare.prepare(str(source), str(tmp_path), SAMPLES)
    by_step = {s["step"]: s for s in steps}
    assert by_step["quant_pre_process"]["ok"] and by_step["quant_pre_process"]["max_abs_error"] > 0
    assert by_step["names"]["ok"] and by_step["names"]["max_abs_error"] == 0.0
    assert all(node.name for node in prepared.graph.node)
