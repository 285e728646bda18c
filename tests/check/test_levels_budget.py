"""check --min-levels measures every quantized tensor, or says it cannot.

The float model given with --float may be the same network exported with other tensor
names. min_levels pairs each quantized tensor with the float tensor it stands for as trace
pairs its rows (the same name without onnxruntime's suffixes, else the same node's same
output); a tensor it cannot pair is exit 7, never a budget that holds without looking.
Expected levels come from numpy on the float model's own tensors, run by onnxruntime, with
the scale read from the quantized file."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphscan
from tests.helpers import calibration_reader, main_error_line

SIZE = 320.0


def inner_concat_detector(path, seed=0):
    """Boxes in pixels (0..SIZE) and probabilities (0..1) joined by a Concat inside the
    network (a 1x1 Conv reads it): one int8 scale over the join erases the probabilities."""
    rng = np.random.default_rng(seed)
    weights = {
        "w1": rng.normal(0, 0.5, (8, 3, 3, 3)),
        "wbox": rng.normal(0, 0.3, (4, 8, 1, 1)),
        "wcls": rng.normal(0, 0.3, (3, 8, 1, 1)),
        "whead": rng.normal(0, 0.3, (7, 7, 1, 1)),
        "scale": np.array([SIZE]),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "wbox"], ["b"], name="box_conv"),
        helper.make_node("Sigmoid", ["b"], ["bs"], name="box_sigmoid"),
        helper.make_node("Mul", ["bs", "scale"], ["boxes"], name="box_pixels"),
        helper.make_node("Conv", ["r1", "wcls"], ["k"], name="cls_conv"),
        helper.make_node("Sigmoid", ["k"], ["probs"], name="cls_sigmoid"),
        helper.make_node("Concat", ["boxes", "probs"], ["joined"], name="join", axis=1),
        helper.make_node("Conv", ["joined", "whead"], ["y"], name="head"),
    ]
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    graph = helper.make_graph(
        nodes,
        "inner_concat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 7, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return model


def renamed(model, path, nodes_too=False):
    """``model`` exported again with every inner tensor named otherwise (``t`` becomes
    ``export/t``; the input and output keep their names), and with ``nodes_too`` its nodes."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept = {i.name for i in copy.graph.input} | {o.name for o in copy.graph.output}
    kept |= {i.name for i in copy.graph.initializer}
    for node in copy.graph.node:
        node.input[:] = [t if t in kept else f"export/{t}" for t in node.input]
        node.output[:] = [t if t in kept else f"export/{t}" for t in node.output]
        if nodes_too:
            node.name = f"export/{node.name}"
    onnx.save(copy, path)
    return path


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    """The float model, onnxruntime's defaults' quantization of it, and 3 seeded samples."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    folder = tmp_path_factory.mktemp("inner_concat")
    model = inner_concat_detector(folder / "float.onnx")
    rng = np.random.default_rng(1)
    paths = []
    for k in range(3):
        paths.append(folder / f"x{k}.npz")
        np.savez(paths[-1], x=rng.normal(0, 1, (1, 3, 8, 8)).astype(np.float32))
    quantize_static(
        str(folder / "float.onnx"), str(folder / "quant.onnx"), calibration_reader(paths), quant_format=QuantFormat.QDQ
    )
    return folder, model, paths


def probabilities_levels(folder, paths):
    """The probabilities' range over every sample, from the float model run by onnxruntime,
    over the scale of the Q that reads the join in the quantized file."""
    model = onnx.load(folder / "float.onnx")
    model.graph.output.append(onnx.ValueInfoProto(name="probs"))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    probs = np.concatenate([session.run(["probs"], dict(np.load(p)))[0] for p in paths], axis=None)
    quant = onnx.load(folder / "quant.onnx")
    (q,) = [n for n in quant.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "joined"]
    scale = float(numpy_helper.to_array(next(i for i in quant.graph.initializer if i.name == q.input[1])))
    return (float(probs.max()) - float(probs.min())) / scale


def min_levels(folder, float_path, paths):
    inputs = [str(p) for p in paths]
    (row,) = graphscan.check(str(folder / "quant.onnx"), float_path=str(float_path), min_levels=16, inputs=inputs)[
        "budgets"
    ]
    return row


def test_the_join_spans_under_one_level_with_the_float_model_it_was_quantized_from(detector):
    folder, _, paths = detector
    row = min_levels(folder, folder / "float.onnx", paths)
    expected = probabilities_levels(folder, paths)
    assert expected < 1
    assert row["value"] == pytest.approx(expected, rel=1e-6)
    assert row["tensor"] == "joined" and row["part"] == {"part": 1, "node": "cls_sigmoid"}


def test_a_float_model_exported_with_other_tensor_names_is_paired_by_node(detector, tmp_path):
    """The same network, every inner tensor named otherwise: each quantized tensor is found at
    its node's output, so the join's probabilities are measured, not skipped (skipped, the
    budget answered the input's levels and held)."""
    folder, model, paths = detector
    exported = renamed(model, tmp_path / "exported.onnx")
    row = min_levels(folder, exported, paths)
    assert row["value"] == pytest.approx(probabilities_levels(folder, paths), rel=1e-6)
    assert row["tensor"] == "joined" and row["part"] == {"part": 1, "node": "cls_sigmoid"}
    assert not row["ok"]


def test_quantized_tensors_the_float_model_lacks_are_exit_7_naming_how_many(detector, tmp_path, capsys):
    """Tensors and nodes named otherwise: only the input and the output keep their names,
    so every other quantized activation has no float tensor to be measured on."""
    folder, model, paths = detector
    exported = renamed(model, tmp_path / "exported.onnx", nodes_too=True)
    quant = onnx.load(folder / "quant.onnx")
    constants = {i.name for i in quant.graph.initializer}
    activations = {n.input[0] for n in quant.graph.node if n.op_type == "QuantizeLinear"} - constants
    kept = {t for t in activations if t in ("x", "y") or t.startswith("y_QuantizeLinear")}
    argv = ["check", folder / "quant.onnx", "--float", exported, "--min-levels", "16", "--inputs", paths[0]]
    line = main_error_line(capsys, argv, graphscan.EXIT_INPUTS)
    assert f"{len(activations) - len(kept)} of {len(activations)} quantized tensors" in line
    assert "min_levels cannot measure them" in line
    assert len(activations) - len(kept) >= 5  # the join and the tensors around it, not a corner case
