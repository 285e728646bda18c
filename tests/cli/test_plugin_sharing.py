"""What the plugin's tables share (graphscan_pytest.py): one model named by two tables of a
config is two sets of items, each named by its table's number.
"""

import onnx
from onnx import TensorProto, helper

from tests.helpers import item_outcomes


def relu(path):
    """A model of one float Relu: one float compute node, one node that onnxruntime runs."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def tables(*models, budget="snapshot = true"):
    """A config of one ``[[model]]`` table per model path, each with ``budget``."""
    return "\n".join(f'[[model]]\npath = "{model}"\n{budget}\n' for model in models)


def test_two_tables_of_one_model_are_two_items_each_named_by_its_tables_number(tmp_path, run_pytest):
    """One model in tables 1 and 2, one budget holding and the other broken: two ids, each
    passing or failing on its own, each deselected or chosen alone; a model in one table
    keeps its plain id."""
    relu(tmp_path / "m.onnx")
    relu(tmp_path / "other.onnx")
    holds, breaks = "max_float = 1", "max_float = 0"  # one float compute node: the Relu
    config = [tables("m.onnx", budget=holds), tables("m.onnx", budget=breaks), tables("other.onnx", budget=holds)]
    (tmp_path / "graphscan.toml").write_text("\n".join(config))
    first, second = "graphscan.toml::m.onnx:1::max_float", "graphscan.toml::m.onnx:2::max_float"
    other = "graphscan.toml::other.onnx::max_float"
    code, output = run_pytest(tmp_path, "--graphscan", "-rA")
    assert item_outcomes(output) == {first: "passed", second: "failed", other: "passed"}, output
    assert code == 1 and "max_float: 1 > 0" in output
    code, output = run_pytest(tmp_path, "--graphscan", "-rA", "--deselect", second)
    assert code == 0 and item_outcomes(output) == {first: "passed", other: "passed"}, output
    code, output = run_pytest(tmp_path, "--graphscan", "-rA", second)
    assert code == 1 and item_outcomes(output) == {second: "failed"}, output
