"""Small models whose parts (graphscan_ort/shared/parts.py) a test knows by hand.

``sliced_model``: parts decided by an input's values, not its shape: ``y = Concat(x[:k] *
100, x[k:] * 2)`` with ``k`` an int64 input (``repeat``: ``Concat(x[:k] * 100, x[:k] * 2)``,
whose size is 2k), and its quantized twin, one int8 Q->DQ of scale 0.8 on y (set by the first
part's +-100). Part 0 is then always the first k values, so a test knows every sample's
partition by hand.

``two_parts``: ``y = Concat(x * 100 + offset, x * factor)``, parts of fixed size, where a
factor of infinity gives a part whose energy is not finite."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIZE = 8  # x's length
SCALE = 0.8


def sliced_model(path, quantized, repeat=False):
    """Write the float model (``quantized``: its Q->DQ twin) to ``path``."""
    tail = ["x", "zero", "k"] if repeat else ["x", "k", "end"]
    nodes = [
        helper.make_node("Slice", ["x", "zero", "k"], ["head"], name="head"),
        helper.make_node("Slice", tail, ["tail"], name="tail"),
        helper.make_node("Mul", ["head", "hundred"], ["big"], name="big_part"),
        helper.make_node("Mul", ["tail", "two"], ["small"], name="small_part"),
        helper.make_node("Concat", ["big", "small"], ["joined" if quantized else "y"], name="cat", axis=0),
    ]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([SIZE], np.int64), "end"),
        numpy_helper.from_array(np.array(100, np.float32), "hundred"),
        numpy_helper.from_array(np.array(2, np.float32), "two"),
    ]
    if quantized:
        nodes += [
            helper.make_node("QuantizeLinear", ["joined", "scale", "zp"], ["joined_q"], name="q"),
            helper.make_node("DequantizeLinear", ["joined_q", "scale", "zp"], ["y"], name="dq"),
        ]
        inits += [
            numpy_helper.from_array(np.array(SCALE, np.float32), "scale"),
            numpy_helper.from_array(np.array(0, np.int8), "zp"),
        ]
    graph = helper.make_graph(
        nodes,
        "sliced",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [SIZE]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def partition(k, repeat=False):
    """The part id of each of y's values when ``k`` is fed, by how the model was built."""
    return np.array([0] * k + [1] * (k if repeat else SIZE - k))


def sample(folder, k):
    """One .npz sample (x from -1 to 1, ``k``) in ``folder``; its path."""
    path = folder / f"k{k}.npz"
    np.savez(path, x=np.linspace(-1, 1, SIZE).astype(np.float32), k=np.array([k], np.int64))
    return path


def worst_part_db(floats, quantized, labels):
    """The lowest of the parts' 10*log10(sum f^2 / sum (f - q)^2), each sum over every sample,
    computed in numpy from the models' outputs and the partitions given."""
    signal, noise = np.zeros(2), np.zeros(2)
    for f, q, part in zip(floats, quantized, labels, strict=True):
        f, q = np.asarray(f, np.float64), np.asarray(q, np.float64)
        signal += np.bincount(part, f**2, minlength=2)
        noise += np.bincount(part, (f - q) ** 2, minlength=2)
    return float(np.min(10 * np.log10(signal / noise))), int(np.argmin(10 * np.log10(signal / noise)))


def two_parts(path, offset, factor):
    """Write ``y = Concat(x * 100 + offset, x * factor)`` (x [4]) to ``path``: part 0 from the
    node "big_part", part 1 from "small_part"."""
    nodes = [
        helper.make_node("Mul", ["x", "hundred"], ["hundredfold"], name="big_scale"),
        helper.make_node("Add", ["hundredfold", "offset"], ["big"], name="big_part"),
        helper.make_node("Mul", ["x", "factor"], ["small"], name="small_part"),
        helper.make_node("Concat", ["big", "small"], ["y"], name="cat", axis=0),
    ]
    constants = {"hundred": 100.0, "offset": offset, "factor": factor}
    inits = [numpy_helper.from_array(np.array(value, np.float32), name) for name, value in constants.items()]
    graph = helper.make_graph(
        nodes,
        "two_parts",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
