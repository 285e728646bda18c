"""Graphs onnx's checker would refuse but protobuf reads: a QuantizeLinear or
DequantizeLinear without inputs or without outputs, and a model whose output is a
sequence. The counting commands and dot count and draw them (a chain that starts
nowhere is not drawn); the commands that run models pass on onnxruntime's refusal
(exit 5) or say what they cannot measure (exit 2), one line each, never exit 1."""

import pytest
from onnx import TensorProto, helper

from tests.helpers import SINGLE_MODEL_COMMANDS, error_line, json_answer, run_graphscan

SCALE = [helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]), helper.make_tensor("z", TensorProto.INT8, [], [0])]


def write(path, nodes, output="y", initializers=SCALE, output_type=None):
    graph = helper.make_graph(
        nodes,
        "malformed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [output_type or helper.make_tensor_value_info(output, TensorProto.FLOAT, [1, 4])],
        list(initializers),
    )
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString())
    return str(path)


MALFORMED = {
    # x is never read: a Q with no input feeds a DQ and Relu.
    "q_without_inputs": [
        helper.make_node("QuantizeLinear", [], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        helper.make_node("Relu", ["d"], ["y"]),
    ],
    "dq_without_inputs": [helper.make_node("DequantizeLinear", [], ["d"]), helper.make_node("Relu", ["d"], ["y"])],
    "q_without_outputs": [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], []),
        helper.make_node("Identity", ["r"], ["y"]),
    ],
    "dq_without_outputs": [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], []),
        helper.make_node("Identity", ["r"], ["y"]),
    ],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_counting_and_dot_answer_on_a_q_or_dq_without_inputs_or_outputs(tmp_path, name):
    path = write(tmp_path / f"{name}.onnx", MALFORMED[name])
    for command in SINGLE_MODEL_COMMANDS:
        json_answer(run_graphscan([command, path]))
    for options in ([], ["--collapse"]):
        drawn = run_graphscan(["dot", path, *options])
        assert drawn.returncode == 0 and drawn.stderr == b"" and drawn.stdout.startswith(b"digraph")


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_trace_passes_on_onnxruntimes_refusal_of_a_q_or_dq_without_inputs_or_outputs(tmp_path, name):
    path = write(tmp_path / f"{name}.onnx", MALFORMED[name])
    line = error_line(run_graphscan(["trace", path, path]), 5)
    assert f"{name}.onnx: model does not run in onnxruntime" in line


def test_impact_says_it_measures_tensor_outputs_when_an_output_is_a_sequence(tmp_path):
    sequence = helper.make_tensor_sequence_value_info("y", TensorProto.FLOAT, [1, 4])
    path = write(tmp_path / "seq.onnx", [helper.make_node("SequenceConstruct", ["x"], ["y"])], output_type=sequence)
    line = error_line(run_graphscan(["impact", path, path]), 2)
    assert line.startswith(f"graphscan: usage: {path}: output 'y' is a sequence, not a tensor of numbers: ")
