"""A YOLO-like detector built with onnx, for the tests of issue 33: box coordinates in pixels
(0..SIZE) and class probabilities (0..1) joined by one Concat into ``[1, 4 + classes,
anchors]``, as YOLOv8 exports are. onnxruntime's default quantize_static puts one scale over
that Concat, set by the boxes, so every probability becomes 0 or about SIZE/255."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIZE = 320.0


def yolo_like(path, classes=3, side=8, seed=0, width=8):
    """Write the model to ``path`` (input ``x`` [1, 3, side, side], output ``output0``) and return
    it; ``width`` channels in the backbone (32 and more: int8 files are smaller than float)."""
    rng = np.random.default_rng(seed)
    anchors = side * side
    weights = {
        "w1": rng.normal(0, 0.5, (width, 3, 3, 3)),
        "w2": rng.normal(0, 0.6 / np.sqrt(width), (width, width, 3, 3)),
        "wbox": rng.normal(0, 0.9 / np.sqrt(width), (4, width, 1, 1)),
        "wcls": rng.normal(0, 0.9 / np.sqrt(width), (classes, width, 1, 1)),
        "scale": np.array([SIZE]),
    }
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    inits += [
        numpy_helper.from_array(np.array([1, 4, anchors], np.int64), "box_shape"),
        numpy_helper.from_array(np.array([1, classes, anchors], np.int64), "cls_shape"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "wbox"], ["b"], name="box_conv"),
        helper.make_node("Sigmoid", ["b"], ["bs"], name="box_sigmoid"),
        helper.make_node("Mul", ["bs", "scale"], ["boxes4d"], name="box_pixels"),
        helper.make_node("Reshape", ["boxes4d", "box_shape"], ["boxes"], name="box_reshape"),
        helper.make_node("Conv", ["r2", "wcls"], ["k"], name="cls_conv"),
        helper.make_node("Sigmoid", ["k"], ["probs4d"], name="cls_sigmoid"),
        helper.make_node("Reshape", ["probs4d", "cls_shape"], ["probs"], name="cls_reshape"),
        helper.make_node("Concat", ["boxes", "probs"], ["output0"], name="head_concat", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "yolo_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, side, side])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 4 + classes, anchors])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return model


def samples(folder, count, side=8, seed=1):
    """``count`` seeded .npz samples of ``x`` in ``folder``; their paths."""
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(count):
        path = folder / f"x{k}.npz"
        np.savez(path, x=rng.normal(0, 1, (1, 3, side, side)).astype(np.float32))
        paths.append(path)
    return paths


def quantized_with_defaults(float_path, out_path, sample_paths):
    """onnxruntime's quantize_static with its defaults (QDQ, int8, per tensor, MinMax)."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tests.helpers import calibration_reader

    quantize_static(str(float_path), str(out_path), calibration_reader(sample_paths), quant_format=QuantFormat.QDQ)
    return onnx.load(out_path)


def collapsed_detector(folder, count=3):
    """The detector, onnxruntime's defaults' quantization of it (one scale over its output
    Concat: the class scores collapse) and ``count`` seeded samples, in ``folder``:
    ``(float_path, quant_path, sample_paths)``."""
    float_path, quant_path = folder / "float.onnx", folder / "quant.onnx"
    yolo_like(float_path)
    paths = samples(folder, count)
    quantized_with_defaults(float_path, quant_path, paths)
    return float_path, quant_path, paths
