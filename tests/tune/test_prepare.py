"""tune's preparation (issue 18): onnxruntime's quant_pre_process, the opset, the rewrites,
each verified against the original model and dropped with its reason when it fails."""

import numpy as np
import onnx
from onnx import helper

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
    assert div["ok"] is False and "relative" in div["detail"]
    assert "Div" in [n.op_type for n in prepared.graph.node]  # the last good model goes on


def test_hard_sigmoid_alone_is_rewritten_after_the_opset(tmp_path):
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(HARD_SIGMOID, opset=10), source)
    prepared, steps = prepare.prepare(str(source), str(tmp_path), SAMPLES)
    assert [s["step"] for s in steps if s["ok"]] == ["quant_pre_process", "opset", "hard_sigmoid"]
    assert "HardSigmoid" not in [n.op_type for n in prepared.graph.node]
