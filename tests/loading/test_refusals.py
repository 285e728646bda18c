"""Loading: inputs that kill the mutants the first mutation campaign left alive.

A model with no opset, an unreadable file, the big-file skimmer on fields
onnx never writes and on a length that runs past its message, the first line
of an error, and names that are not UTF-8. The skimmed answer is compared
with the full parse, and the full parse with the brute-force reference.
"""

import os
from unittest import mock

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphscan
from tests.helpers import (
    SINGLE_MODEL_COMMANDS,
    error_line,
    json_answer,
    replace_command,
    run_graphscan,
    run_main,
    strict_loads,
    varint,
)
from tests.reference import reference

OPSET = [helper.make_opsetid("", 13)]


def key(number, wire):
    return varint(number << 3 | wire)


def length_delimited(number, payload):
    return key(number, 2) + varint(len(payload)) + payload


def qdq_model():
    """x -> Q -> DQ -> MatMul(DQ(w_q)) -> Q -> DQ -> y, with a float bias Add: every
    count depends on initializer names (weight DQ) and on node wiring."""
    inits = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]),
        helper.make_tensor("zp", TensorProto.INT8, [], [0]),
        helper.make_tensor("w_q", TensorProto.INT8, [2, 2], [1, -2, 3, -4]),
        helper.make_tensor("bias", TensorProto.FLOAT, [2], [0.5, -0.5]),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["x_q"], name="x_q"),
        helper.make_node("DequantizeLinear", ["x_q", "s", "zp"], ["x_dq"], name="x_dq"),
        helper.make_node("DequantizeLinear", ["w_q", "s", "zp"], ["w"], name="w_dq"),
        helper.make_node("MatMul", ["x_dq", "w"], ["mm"], name="mm"),
        helper.make_node("QuantizeLinear", ["mm", "s", "zp"], ["mm_q"], name="mm_q"),
        helper.make_node("DequantizeLinear", ["mm_q", "s", "zp"], ["mm_dq"], name="mm_dq"),
        helper.make_node("Add", ["mm_dq", "bias"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)


def model_bytes(model, graph_extra=b"", tensor_extra=b"", model_extra=b""):
    """``model`` serialized by hand: extra raw fields appended to the model, the graph,
    and every initializer, where onnx itself would never write them."""
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    initializers = [t.SerializeToString() for t in graph.initializer]
    del graph.initializer[:]
    graph_data = graph.SerializeToString() + b"".join(length_delimited(5, t + tensor_extra) for t in initializers)
    head = onnx.ModelProto()
    head.CopyFrom(model)
    head.ClearField("graph")
    return head.SerializeToString() + length_delimited(7, graph_data + graph_extra) + model_extra


def answers(path, skim):
    with mock.patch.object(graphscan, "_SKIM_THRESHOLD", 0 if skim else 1 << 40):
        return {command: getattr(graphscan, command)(str(path)) for command in SINGLE_MODEL_COMMANDS}


# --------------------------------------------------------------------------
# parse_model: what an ONNX model must carry


def test_model_without_opset_import_is_not_onnx(tmp_path, capsys):
    model = qdq_model()
    del model.opset_import[:]
    path = tmp_path / "no_opset.onnx"
    path.write_bytes(model.SerializeToString())
    assert onnx.load(path).graph.node  # a real graph: only the opset is missing
    for command in SINGLE_MODEL_COMMANDS:
        code, out, err = run_main(capsys, [command, path])
        assert (code, out) == (graphscan.EXIT_NOT_ONNX, ""), command
        assert err.startswith("graphscan: ") and str(path) in err and err.count("\n") == 1


def test_model_without_graph_is_not_onnx(tmp_path, capsys):
    path = tmp_path / "no_graph.onnx"
    path.write_bytes(onnx.ModelProto(ir_version=8, opset_import=OPSET).SerializeToString())
    code, out, err = run_main(capsys, ["nodes", path])
    assert (code, out) == (graphscan.EXIT_NOT_ONNX, "") and "no graph" in err


def test_unreadable_file_exits_3(tmp_path, monkeypatch, capsys):
    """Tests run as root, who reads anything: the PermissionError is injected."""
    path = tmp_path / "locked.onnx"
    path.write_bytes(qdq_model().SerializeToString())

    def refuse(file, *args, **kwargs):
        raise PermissionError(13, os.strerror(13), str(file))

    monkeypatch.setattr(graphscan, "open", refuse, raising=False)
    code, out, err = run_main(capsys, ["qdq", path])
    assert (code, out) == (graphscan.EXIT_NO_FILE, "")
    assert err.count("\n") == 1 and str(path) in err and os.strerror(13) in err


# --------------------------------------------------------------------------
# The skimmer: fields onnx never writes, lengths that lie


def fixed32(number):
    return key(number, 5) + b"\x01\x02\x03\x04"


def fixed64(number):
    return key(number, 1) + bytes(range(8))


UNKNOWN_FIELDS = [
    pytest.param({"tensor_extra": fixed32(99)}, id="fixed32-in-an-initializer"),
    pytest.param({"tensor_extra": fixed64(98)}, id="fixed64-in-an-initializer"),
    pytest.param({"graph_extra": fixed32(99)}, id="fixed32-in-the-graph"),
    pytest.param({"graph_extra": fixed64(98)}, id="fixed64-in-the-graph"),
    pytest.param({"model_extra": fixed32(99) + fixed64(98)}, id="fixed32-and-64-in-the-model"),
    pytest.param({"tensor_extra": key(97, 0) + varint(2**40)}, id="long-varint-in-an-initializer"),
]


@pytest.mark.parametrize("extra", UNKNOWN_FIELDS)
def test_skim_keeps_unknown_fields_and_answers_like_the_full_parse(tmp_path, extra):
    model = qdq_model()
    path = tmp_path / "m.onnx"
    path.write_bytes(model_bytes(model, **extra))
    full = answers(path, skim=False)
    expected = reference(model)
    assert full == {c: {"model": str(path), **expected[c]} for c in SINGLE_MODEL_COMMANDS}
    assert answers(path, skim=True) == full


def test_name_length_running_past_its_initializer_is_refused(tmp_path, capsys):
    """The first initializer's name (its last field) claims 20 more bytes than the
    initializer holds; they exist (the next initializer follows), so only the message
    bound can catch it."""
    model = qdq_model()
    data = model_bytes(model)
    tensor = model.graph.initializer[0].SerializeToString()
    name = key(8, 2) + varint(1) + b"s"
    assert tensor.endswith(name)
    bad_tensor = tensor[: -len(name)] + key(8, 2) + varint(21) + b"s"
    start = data.index(length_delimited(5, tensor))
    data = data[:start] + length_delimited(5, bad_tensor) + data[start + len(length_delimited(5, tensor)) :]
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    for threshold in [0, 1 << 40]:  # skimmed, then parsed whole
        with mock.patch.object(graphscan, "_SKIM_THRESHOLD", threshold):
            code, out, err = run_main(capsys, ["nodes", path])
        assert (code, out) == (graphscan.EXIT_NOT_ONNX, ""), (threshold, err)
        assert str(path) in err and err.count("\n") == 1


PAYLOADS = [
    pytest.param("float_data", TensorProto.FLOAT, [1.5, 2.5], id="float_data"),
    pytest.param("int32_data", TensorProto.INT32, [7, -7], id="int32_data"),
    pytest.param("string_data", TensorProto.STRING, [b"a", b"b"], id="string_data"),
    pytest.param("int64_data", TensorProto.INT64, [2**40, 3], id="int64_data"),
    pytest.param("raw_data", TensorProto.FLOAT, np.ones(2, np.float32).tobytes(), id="raw_data"),
    pytest.param("double_data", TensorProto.DOUBLE, [0.25, 4.0], id="double_data"),
    pytest.param("uint64_data", TensorProto.UINT64, [2**63, 1], id="uint64_data"),
]


@pytest.mark.parametrize(("field", "data_type", "values"), PAYLOADS)
def test_skim_drops_every_payload_field_and_keeps_the_header(field, data_type, values):
    tensor = TensorProto(name="w", data_type=data_type, dims=[2], doc_string="kept")
    if field == "raw_data":
        tensor.raw_data = values
    else:
        getattr(tensor, field).extend(values)
    external = TensorProto(name="far", data_type=TensorProto.FLOAT, dims=[3])
    external.data_location = TensorProto.EXTERNAL
    external.external_data.add(key="location", value="w.bin")
    graph = helper.make_graph([], "g", [], [], [tensor, external])
    model = helper.make_model(graph, opset_imports=OPSET)

    skimmed = onnx.ModelProto.FromString(graphscan._skim_model(model.SerializeToString()))
    kept, far = skimmed.graph.initializer
    assert not kept.HasField("raw_data") and not getattr(kept, field), field
    expected = TensorProto(name="w", data_type=data_type, dims=[2], doc_string="kept")
    assert kept == expected
    assert far == external  # header only: location and data_location are kept
    assert skimmed.opset_import == model.opset_import


def test_skim_threshold_is_the_first_size_that_skims(tmp_path, capsys):
    """A payload only protobuf can reject (a packed float_data of 3 bytes): the full parse
    refuses the file, the skim never reads the payload. The file's own size skims it."""
    bad = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1]).SerializeToString()
    bad += length_delimited(4, b"\x00\x00\x00")
    path = tmp_path / "m.onnx"
    path.write_bytes(model_bytes(qdq_model(), graph_extra=length_delimited(5, bad)))
    size = path.stat().st_size
    with mock.patch.object(graphscan, "_SKIM_THRESHOLD", size + 1):
        code, _, _ = run_main(capsys, ["nodes", path])
    assert code == graphscan.EXIT_NOT_ONNX
    with mock.patch.object(graphscan, "_SKIM_THRESHOLD", size):
        code, out, err = run_main(capsys, ["nodes", path])
    assert (code, err) == (0, "")
    assert strict_loads(out)["initializers"] == {"FLOAT": 3, "INT8": 2}


# --------------------------------------------------------------------------
# One line, and names that are not UTF-8


@pytest.mark.parametrize(
    ("message", "line"),
    [
        pytest.param("first line\nsecond line", "first line", id="two-lines"),
        pytest.param("\n  only after a blank line\nmore", "only after a blank line", id="leading-blank"),
        pytest.param("", "ValueError", id="empty-message"),
    ],
)
def test_one_line_is_the_first_line(message, line):
    assert graphscan.one_line(ValueError(message)) == line


def lone_model(marker_name="NAMEMARK", op_type="Relu"):
    graph = helper.make_graph(
        [helper.make_node(op_type, ["x"], ["y"], name=marker_name)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=OPSET)


def broken(data, marker):
    """``marker`` with its fifth byte replaced by 0xff: the same length, not UTF-8."""
    assert marker in data
    return data.replace(marker, marker[:4] + b"\xff" + marker[5:])


def test_non_utf8_node_name_shows_the_replacement_character(tmp_path):
    path = tmp_path / "lone.onnx"
    path.write_bytes(broken(lone_model().SerializeToString(), b"NAMEMARK"))
    answer = json_answer(run_graphscan(["islands", path], cwd=tmp_path))
    assert answer["islands"] == [{"nodes": ["NAME\ufffdARK"], "size": 1, "op_types": ["Relu"]}]
    boundary = json_answer(run_graphscan(["boundary", path], cwd=tmp_path))
    assert boundary["per_island"][0]["nodes"] == ["NAME\ufffdARK"]


def test_non_utf8_op_type_shows_the_replacement_character(tmp_path, capsys):
    path = tmp_path / "op.onnx"
    model = lone_model(marker_name="", op_type="OPMARKER")
    path.write_bytes(broken(model.SerializeToString(), b"OPMARKER"))
    code, out, err = run_main(capsys, ["nodes", path])
    assert (code, err) == (0, "")
    assert strict_loads(out)["op_types"] == {"OPMA\ufffdKER": 1}
    code, out, err = run_main(capsys, ["islands", path])
    # The unnamed node is named after its op_type and position: both shown the same way.
    assert strict_loads(out)["islands"][0]["nodes"] == ["OPMA\ufffdKER_0"]


def test_unreadable_and_missing_paths_name_the_path_as_a_process(tmp_path):
    line = error_line(run_graphscan(["nodes", "missing.onnx"], cwd=tmp_path), graphscan.EXIT_NO_FILE)
    assert "missing.onnx" in line


def test_a_bug_is_exit_1_in_one_line(tmp_path, monkeypatch, capsys):
    path = tmp_path / "m.onnx"
    path.write_bytes(qdq_model().SerializeToString())

    def crash(path):
        raise KeyError("a bug")

    replace_command(monkeypatch, "nodes", crash)
    code, out, err = run_main(capsys, ["nodes", path])
    assert (code, out) == (graphscan.EXIT_INTERNAL, "")
    assert err.startswith("graphscan: internal error: KeyError") and err.count("\n") == 1


def test_file_whose_first_field_is_not_a_model_field_is_refused(tmp_path, capsys):
    """L31: field 13 is not one of ModelProto's. protobuf skips it as an unknown
    field and parses the valid model behind it; graphscan refuses the file from
    its first bytes, as it refuses text or random bytes."""
    data = key(13, 0) + varint(1) + qdq_model().SerializeToString()
    parsed = onnx.ModelProto()
    parsed.ParseFromString(data)
    assert parsed.graph.node and parsed.opset_import  # a full parse alone would accept it
    path = tmp_path / "odd_start.onnx"
    path.write_bytes(data)
    code, out, err = run_main(capsys, ["nodes", path])
    assert (code, out) == (graphscan.EXIT_NOT_ONNX, "")
    assert "does not start with a ModelProto field" in err


def test_name_running_past_a_big_initializer_is_refused_by_the_skim(tmp_path, capsys):
    """L11: an initializer above FileBytes.WINDOW (1 MiB) is skimmed straight from
    the file, not as its own slice of bytes, so only the message bound stops its
    last field (a name claiming 21 bytes, 1 present) from reading into the next
    initializer. protobuf's full parse refuses the file; the skim must too."""
    model = qdq_model()
    raw = np.ones(300_000, np.float32).tobytes()  # 1.2 MB
    big = key(1, 0) + varint(300_000) + key(2, 0) + varint(TensorProto.FLOAT) + length_delimited(9, raw)
    big += key(8, 2) + varint(21) + b"b"
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    others = [t.SerializeToString() for t in graph.initializer]
    del graph.initializer[:]
    graph_data = graph.SerializeToString() + length_delimited(5, big) + b"".join(length_delimited(5, t) for t in others)
    head = onnx.ModelProto()
    head.CopyFrom(model)
    head.ClearField("graph")
    path = tmp_path / "m.onnx"
    path.write_bytes(head.SerializeToString() + length_delimited(7, graph_data))
    for threshold in [0, 1 << 40]:  # skimmed, then parsed whole
        with mock.patch.object(graphscan, "_SKIM_THRESHOLD", threshold):
            code, out, err = run_main(capsys, ["nodes", path])
        assert (code, out) == (graphscan.EXIT_NOT_ONNX, ""), (threshold, err)
