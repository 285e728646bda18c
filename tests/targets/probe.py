"""What the target tests ask a target's own interpreter, without graphscan's code.

Each function is called inside a target by ``targets.run`` and answers in JSON:
plain onnxruntime sessions, as a user on that CPU would open them.
"""

import numpy as np
import onnx
import onnxruntime as ort


def optimized_op_types(path: str) -> list[str]:
    """The op types of the graph onnxruntime saves after optimizing ``path`` (extended level)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        return [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]


def outputs(path: str, feeds: str) -> list[list[float]]:
    """Every output of ``path`` for the inputs saved in ``feeds`` (.npz), flattened, in a default session."""
    with np.load(feeds) as saved:
        inputs = {name: saved[name] for name in saved.files}
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return [np.asarray(value, dtype=np.float64).ravel().tolist() for value in session.run(None, inputs)]


# Operators that are integer kernels in onnxruntime's CPU provider (its QDQ fusions and the
# contrib integer operators), named here from onnxruntime's own operator list.
INTEGER_OPS = ("QLinear", "NhwcQLinear", "QGemm", "QAttention", "DynamicQuantize", "MatMulInteger", "ConvInteger")


def integer_kernel_nodes(path: str, level: str = "extended") -> dict[str, list[str]]:
    """``{op_type: sorted node names}`` of the integer kernels in the graph onnxruntime saves
    after optimizing ``path`` at ``level`` (runtime's default, extended): each fused kernel
    keeps the name of the node it replaced."""
    import os
    import tempfile

    levels = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[level]
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        nodes = onnx.load(options.optimized_model_filepath).graph.node
    found: dict[str, list[str]] = {}
    for node in nodes:
        if node.op_type.startswith(INTEGER_OPS):
            found.setdefault(node.op_type, []).append(node.name)
    return {op: sorted(names) for op, names in sorted(found.items())}


def one_thread_outputs(paths: list[str], feeds: str) -> list[list[list[float]]]:
    """Per model in ``paths``, every output for the inputs saved in ``feeds`` (.npz), flattened:
    a session at onnxruntime's default level (all) with one intra-op thread, as tune measures."""
    with np.load(feeds) as saved:
        inputs = {name: saved[name] for name in saved.files}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    answers = []
    for path in paths:
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        answers.append([np.asarray(value, dtype=np.float64).ravel().tolist() for value in session.run(None, inputs)])
    return answers


def tune_evidence(float_path: str, model_path: str, feeds: str) -> dict:
    """What tune --cpu's chosen row is checked against, in one start of the target: both
    models' plain outputs (``one_thread_outputs``) and runtime's classes of the written model
    at level all, the function ``runtime --cpu`` itself runs inside the target."""
    from graphscan_ort.engines.classify import classes_answer

    return {
        "outputs": one_thread_outputs([float_path, model_path], feeds),
        "classes": classes_answer(model_path, "all", "CPUExecutionProvider", False)["classes"],
    }
