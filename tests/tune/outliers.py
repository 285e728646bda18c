"""A model for tune's calibration overrides (tune/overrides.py), built with onnx: one input
whose calibration samples hold a rare outlier, so that MinMax spreads its levels over a range
its other values never use, and one whose largest values are rare but carry the output, so
that Percentile (and Entropy) clip the signal. Only a per-tensor choice of range serves both.
Each path is two 1x1 Convs, so that keeping the outputs' producers float (tune's structural
seeds) leaves the first Conv's tensors quantized."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SHAPES = {"x": [1, 4, 128, 128], "y": [1, 4, 256, 256]}  # over 60,000 values a sample each
OUTLIER = 100.0  # one value of x in the first calibration sample; x is standard normal otherwise
PEAK = 1.6  # y's peak in 2 of its 4 channels a sample, y uniform in [0, 1) otherwise
WIDTH = 128  # a1's channels: int8 weights then outweigh the Q/DQ nodes (a model larger than float is never chosen)
PEAKS = 2  # under 1 in 100,000 of y's values over 8 samples: what Percentile's 99.999 clips


def outlier_model(path, seed=0):
    """Write the model to ``path``: ``a`` = two Convs of x, ``b`` = GlobalMaxPool of two
    identity Convs of y (each channel's peak)."""
    rng = np.random.default_rng(seed)
    weights = {
        "wa1": rng.normal(0, 0.5, (WIDTH, 4, 1, 1)),
        "wa2": rng.normal(0, 0.5 / np.sqrt(WIDTH), (4, WIDTH, 1, 1)),
        "wb1": np.eye(4)[:, :, None, None],
        "wb2": np.eye(4)[:, :, None, None],
    }
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    nodes = [
        helper.make_node("Conv", ["x", "wa1"], ["a1"], name="conv_a1"),
        helper.make_node("Conv", ["a1", "wa2"], ["a"], name="conv_a2"),
        helper.make_node("Conv", ["y", "wb1"], ["b1"], name="conv_b1"),
        helper.make_node("Conv", ["b1", "wb2"], ["b2"], name="conv_b2"),
        helper.make_node("GlobalMaxPool", ["b2"], ["b"], name="peak"),
    ]
    graph = helper.make_graph(
        nodes,
        "outliers",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in SHAPES.items()],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, SHAPES["x"]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [1, 4, 1, 1]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return model


def outlier_samples(folder, count, seed, outlier):
    """``count`` seeded .npz samples in ``folder``, the first with x's outlier when ``outlier``;
    every sample has y's peaks (they are the signal, in calibration and evaluation alike)."""
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(count):
        x = rng.standard_normal(SHAPES["x"]).astype(np.float32)
        if outlier and k == 0:
            x[0, 0, 64, 64] = OUTLIER
        y = rng.random(SHAPES["y"]).astype(np.float32)
        channels = rng.choice(4, PEAKS, replace=False)
        y[0, channels, rng.integers(0, 256, PEAKS), rng.integers(0, 256, PEAKS)] = PEAK
        paths.append(str(folder / f"{'cal' if outlier else 'ev'}{seed}-{k}.npz"))
        np.savez(paths[-1], x=x, y=y)
    return paths
