"""Models with an output that is not a tensor of numbers, beside one that is: ``y =
Relu(x)`` (x [4]; its quantized twin a uint8 Q->DQ of scale 0.05) and ``label``, a STRING
tensor (ai.onnx.ml's LabelEncoder, as a classifier's class names) or a ragged sequence
(SplitToSequence into lengths 1 and 3). ``declared=False`` leaves label's type out of the
graph's outputs, so only its value tells what it is."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

KINDS = {"string": "a string tensor", "sequence": "a sequence"}  # how graphscan names each


def odd_model(path, kind, quantized, declared=True):
    """Write the model with a ``kind`` ("string" or "sequence") label output to ``path``."""
    nodes = [helper.make_node("Relu", ["x"], ["r" if quantized else "y"], name="relu")]
    inits = [numpy_helper.from_array(np.array([1, 3], np.int64), "lengths")]
    if quantized:
        nodes += [
            helper.make_node("QuantizeLinear", ["r", "scale", "zp"], ["rq"], name="q"),
            helper.make_node("DequantizeLinear", ["rq", "scale", "zp"], ["y"], name="dq"),
        ]
        inits += [
            numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
            numpy_helper.from_array(np.array(0, np.uint8), "zp"),
        ]
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 2)]
    if kind == "string":
        encoder = helper.make_node(
            "LabelEncoder",
            ["x"],
            ["label"],
            name="names",
            domain="ai.onnx.ml",
            keys_floats=[0.0],
            values_strings=["zero"],
            default_string="other",
        )
        nodes.append(encoder)
        label = helper.make_tensor_value_info("label", TensorProto.STRING, [4])
    else:
        nodes.append(helper.make_node("SplitToSequence", ["x", "lengths"], ["label"], name="pieces", axis=0))
        label = helper.make_tensor_sequence_value_info("label", TensorProto.FLOAT, None)
    if not declared:
        label = onnx.ValueInfoProto(name="label")
    graph = helper.make_graph(
        nodes,
        "odd_outputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]), label],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=opsets), path)


def sample(folder):
    """One .npz sample of x in ``folder``; its path."""
    path = folder / "x.npz"
    np.savez(path, x=np.array([0.0, 0.3, -1.0, 2.0], np.float32))
    return path


def refusal(path, kind):
    """The one stderr line every command that measures accuracy gives for ``kind``'s label."""
    return (
        f"graphscan: usage: {path}: output 'label' is {KINDS[kind]}, not a tensor of numbers: the output SQNR "
        "and the metrics measure numeric outputs only (measure a model cut to those, e.g. by "
        "onnx.utils.extract_model)"
    )
