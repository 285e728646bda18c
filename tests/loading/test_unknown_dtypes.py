"""Data types and enum values onnx does not know: counted, shown by number."""

import json

import onnx
import pytest
from onnx import TensorProto, helper

from tests.helpers import (
    SINGLE_MODEL_COMMANDS,
    contract_violation,
    process_result,
    run_graphscan,
    run_main,
)

OPSET = [helper.make_opsetid("", 13)]


def unknown_enum_attribute():
    """An attribute whose ``type`` (a closed proto2 enum) carries 99: kept as an unknown field."""
    known = helper.make_attribute("alpha", 0.5).SerializeToString()
    return onnx.AttributeProto.FromString(known + bytes([0xA0, 0x01, 99]))  # field 20, varint 99


def unknown_types_model():
    """A DQ whose weight has data_type 99, odd data types, unknown enum values."""
    location = TensorProto(name="far", data_type=TensorProto.FLOAT, dims=[1], raw_data=b"\0" * 4)
    location = TensorProto.FromString(location.SerializeToString() + bytes([0x70, 99]))  # field 14
    inits = [
        TensorProto(name="w99", data_type=99, dims=[2], raw_data=b"\x01\x02"),
        TensorProto(name="neg", data_type=-1, dims=[1], raw_data=b"\x00"),
        TensorProto(name="max", data_type=2**31 - 1, dims=[1], raw_data=b"\x00"),
        location,
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
    ]
    leaky = helper.make_node("LeakyRelu", ["w"], ["y"], name="leaky")
    leaky.attribute.append(unknown_enum_attribute())
    nodes = [helper.make_node("DequantizeLinear", ["w99", "s"], ["w"], name="w_dq"), leaky]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], inits)
    return helper.make_model(graph, opset_imports=OPSET)


@pytest.fixture
def unknown_types_file(tmp_path):
    """The unknown-types model on disk, checked to keep its odd values through a round trip."""
    path = tmp_path / "unknown_types.onnx"
    path.write_bytes(unknown_types_model().SerializeToString())
    reread = onnx.load(str(path), load_external_data=False)
    assert [init.data_type for init in reread.graph.initializer][:3] == [99, -1, 2**31 - 1]
    # The closed enum's 99 survives as an unknown field (upb has no UnknownFields()).
    assert reread.graph.node[1].attribute[0].SerializeToString().endswith(bytes([0xA0, 0x01, 99]))
    return str(path)


EXPECTED_UNKNOWN_TYPES = {
    "nodes": {
        "nodes": 2,
        "op_types": {"DequantizeLinear": 1, "LeakyRelu": 1},
        "initializers": {
            "DATA_TYPE_-1": 1,
            "DATA_TYPE_2147483647": 1,
            "DATA_TYPE_99": 1,
            "FLOAT": 2,
        },
    },
    "qdq": {"quantize": 0, "dequantize": 1, "round_trips": 0, "weight_dequantize": 1},
    "islands": {
        "compute": 1,
        "wrapped": 0,
        "float": 1,
        "island_count": 1,
        "islands": [{"nodes": ["leaky"], "size": 1, "op_types": ["LeakyRelu"]}],
    },
    "boundary": {
        "island_count": 1,
        "crossings": 1,
        "per_island": [{"nodes": ["leaky"], "in_dequantize": 1, "out_quantize": 0}],
    },
}


@pytest.mark.parametrize("command", SINGLE_MODEL_COMMANDS)
def test_unknown_data_types_and_enums_are_counted(unknown_types_file, capsys, command):
    code, out, err = run_main(capsys, [command, unknown_types_file])
    assert contract_violation(command, [unknown_types_file], code, out, err) is None
    assert code == 0
    assert json.loads(out) == {"model": unknown_types_file, **EXPECTED_UNKNOWN_TYPES[command]}


def test_unknown_data_type_as_a_process(unknown_types_file, tmp_path):
    code, out, err = process_result(run_graphscan(["nodes", unknown_types_file], cwd=tmp_path))
    assert contract_violation("nodes", [unknown_types_file], code, out, err) is None
    assert json.loads(out)["initializers"] == EXPECTED_UNKNOWN_TYPES["nodes"]["initializers"]
