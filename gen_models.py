#!/usr/bin/env python3
"""Build the lab's models and write every artifact into ``ops/``.

The one model builder of the project: conftest.py builds its test models with
these same functions.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
CALIBRATION_BATCHES = 8
CALIBRATION_BATCH_SIZE = 4


def layer_names(layer):
    """Node names of layer ``layer`` (1-based): MatMul, Add, Relu."""
    return f"fc{layer}_matmul", f"fc{layer}_add", f"fc{layer}_relu"


def build_mlp(layers, dim, seed, input_shape=("N",)):
    """fp32 MatMul -> Add -> Relu stack with every node named.

    The graph input is ``x`` of shape ``input_shape + (dim,)`` (the leading
    symbolic batch keeps the model usable at any batch size), output ``y``.
    """
    rng = np.random.default_rng(seed)
    nodes, initializers = [], []
    previous = "x"
    for layer in range(1, layers + 1):
        matmul, add, relu = layer_names(layer)
        weight, bias = f"fc{layer}_weight", f"fc{layer}_bias"
        scale = 1.0 / np.sqrt(dim)  # keeps activations O(1) through the stack
        initializers.append(
            numpy_helper.from_array(
                (rng.standard_normal((dim, dim)) * scale).astype(np.float32), weight
            )
        )
        initializers.append(
            numpy_helper.from_array(
                (rng.standard_normal(dim) * 0.1).astype(np.float32), bias
            )
        )
        output = "y" if layer == layers else f"fc{layer}_out"
        nodes += [
            helper.make_node("MatMul", [previous, weight], [f"fc{layer}_mm"], name=matmul),
            helper.make_node("Add", [f"fc{layer}_mm", bias], [f"fc{layer}_sum"], name=add),
            helper.make_node("Relu", [f"fc{layer}_sum"], [output], name=relu),
        ]
        previous = output
    shape = list(input_shape) + [dim]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model, full_check=True)
    return model


def concrete_shape(model, batch=CALIBRATION_BATCH_SIZE):
    """The graph input's shape with every symbolic dimension set to ``batch``."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    return tuple(d.dim_value if d.HasField("dim_value") else batch for d in dims)


def calibration_reader(shape, seed):
    """A new, seeded CalibrationDataReader (a consumed reader yields nothing)."""
    from onnxruntime.quantization import CalibrationDataReader

    class SeededReader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(seed)
            self._batches = iter(
                [
                    {"x": rng.standard_normal(shape).astype(np.float32)}
                    for _ in range(CALIBRATION_BATCHES)
                ]
            )

        def get_next(self):
            return next(self._batches, None)

    return SeededReader()


def quantize_variants(fp32_path, out_dir, exclude, seed):
    """Write full, matmul_only, excluded and dynamic next to ``fp32_path``.

    Returns ``{variant: path}``. Each static call gets its own fresh reader.
    """
    from onnxruntime.quantization import QuantFormat, quantize_dynamic, quantize_static

    shape = concrete_shape(onnx.load(str(fp32_path)))
    scopes = {
        "full": {},
        "matmul_only": {"op_types_to_quantize": ["MatMul"]},
        "excluded": {"nodes_to_exclude": [exclude]},
    }
    paths = {}
    for variant, scope in scopes.items():
        paths[variant] = out_dir / f"{variant}.onnx"
        quantize_static(
            str(fp32_path),
            str(paths[variant]),
            calibration_reader(shape, seed),
            quant_format=QuantFormat.QDQ,
            **scope,
        )
    paths["dynamic"] = out_dir / "dynamic.onnx"
    quantize_dynamic(str(fp32_path), str(paths["dynamic"]))
    return paths
