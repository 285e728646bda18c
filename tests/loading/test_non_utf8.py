"""Strings that are not UTF-8: graphscan answers (names shown with U+FFFD) or
refuses in one line, never crashes.

protobuf (upb) parses a proto2 string field holding invalid UTF-8 and hands it
to Python as ``bytes`` instead of ``str``.
"""

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from tests.helpers import (
    COMMANDS,
    command_paths,
    contract_violation,
    process_result,
    run_graphscan,
    run_main,
)

OPSET = [helper.make_opsetid("", 13)]

# protobuf (upb) parses a proto2 string field holding invalid UTF-8 and hands it
# to Python as ``bytes`` instead of ``str``. The contract leaves two honest
# answers: exit 0 with valid JSON (names decoded somehow), or exit 4 ("not an
# ONNX model") in one line. Each marker below is replaced by the same bytes with
# one 0xff, so no length prefix changes.

UTF8_MARKERS = {
    "node-name": b"NAMEMARK",
    "op-type": b"OPMARKER",
    "unnamed-node-op-type": b"OPUNNAMD",
    "tensor-name": b"TENSMARK",
    "initializer-name": b"INITMARK",
    "graph-name": b"GRAPHMRK",
    "doc-string": b"DOCMARKR",
    "domain": b"DOMAINMK",
}


def utf8_model():
    """Named and unnamed nodes, Q/DQ and a custom domain, every marker in place."""
    inits = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
        helper.make_tensor("zp", TensorProto.INT8, [], [0]),
        helper.make_tensor("INITMARK", TensorProto.INT8, [2], [1, 2]),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["INITMARK", "s", "zp"], ["w"], name="w_dq"),
        helper.make_node("Add", ["x", "w"], ["TENSMARK"], name="NAMEMARK", doc_string="DOCMARKR"),
        helper.make_node("Relu", ["TENSMARK"], ["r"], name="relu"),
        helper.make_node("OPMARKER", ["r"], ["c"], name="custom", domain="DOMAINMK"),
        helper.make_node("OPUNNAMD", ["c"], ["u"], domain="DOMAINMK"),
        helper.make_node("Relu", ["u"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "GRAPHMRK",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET + [helper.make_opsetid("DOMAINMK", 1)])


def lone_node_model():
    """One named node and nothing else: no valid name beside the broken one."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="NAMEMARK")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=OPSET)


def break_utf8(data, marker):
    """``data`` with every ``marker`` given a 0xff byte (same length, so still well framed)."""
    assert data.count(marker) >= 1, marker
    return data.replace(marker, marker[:4] + b"\xff" + marker[5:])


@pytest.fixture
def utf8_files(tmp_path):
    """The intact model and, per field, a copy whose marker is not UTF-8."""
    data = utf8_model().SerializeToString()
    files = {"intact": tmp_path / "intact.onnx"}
    files["intact"].write_bytes(data)
    for field, marker in UTF8_MARKERS.items():
        files[field] = tmp_path / f"{field}.onnx"
        files[field].write_bytes(break_utf8(data, marker))
    return {name: str(path) for name, path in files.items()}


def test_broken_utf8_really_reaches_python_as_bytes(utf8_files):
    """The premise of the tests below: protobuf parses the file and gives back bytes."""
    model = onnx.ModelProto()
    model.ParseFromString(Path(utf8_files["node-name"]).read_bytes())
    assert model.graph.node[1].name == b"NAME\xffARK"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("field", list(UTF8_MARKERS))
def test_non_utf8_field_answers_or_refuses(utf8_files, capsys, field, command):
    paths = command_paths(command, utf8_files[field], utf8_files["intact"])
    code, out, err = run_main(capsys, [command, *paths])
    problem = contract_violation(command, paths, code, out, err)
    assert problem is None, f"{field} not UTF-8, {command}: {problem}"


@pytest.mark.parametrize("command", ["nodes", "islands", "boundary"])
def test_lone_non_utf8_name_as_a_process(tmp_path, command):
    """With no str name to compare against, the bytes name reaches json.dumps in main."""
    path = tmp_path / "lone.onnx"
    path.write_bytes(break_utf8(lone_node_model().SerializeToString(), b"NAMEMARK"))
    code, out, err = process_result(run_graphscan([command, path], cwd=tmp_path))
    problem = contract_violation(command, [str(path)], code, out, err)
    assert problem is None, f"{command}: {problem}"


def non_utf8_pair(folder):
    """The lab's fp32 and full models with a node name and a tensor (with its Q/DQ
    tensors and scales) given a byte that is not UTF-8, in both models alike."""
    from tests.helpers import ROOT

    paths = []
    for source, name in ((ROOT / "ops" / "fp32.onnx", "a.onnx"), (ROOT / "ops" / "full.onnx", "b.onnx")):
        model = onnx.load(source)

        def renamed(tensor):
            return tensor.replace("fc1_out", "TENSMARK", 1) if tensor.startswith("fc1_out") else tensor

        for node in model.graph.node:
            node.name = "NAMEMARK" if node.name == "fc2_matmul" else node.name
            node.input[:] = [renamed(t) for t in node.input]
            node.output[:] = [renamed(t) for t in node.output]
        for item in [*model.graph.initializer, *model.graph.value_info]:
            item.name = renamed(item.name)
        data = break_utf8(break_utf8(model.SerializeToString(), b"NAMEMARK"), b"TENSMARK")
        (folder / name).write_bytes(data)
        paths.append(str(folder / name))
    return paths


@pytest.mark.parametrize(
    "argv",
    [["trace", "{a}", "{b}"], ["impact", "{a}", "{b}"], ["runtime", "{b}", "--time", "--runs", "1"],
     ["check", "{b}", "--float", "{a}", "--min-sqnr", "1"], ["fuse", "{a}", "{out}"]],
    ids=["trace", "impact", "runtime-time", "check", "fuse"],
)  # fmt: skip
def test_commands_that_run_models_answer_with_non_utf8_names(tmp_path, argv):
    """They crashed (exit 1); the names are shown with U+FFFD, as the counting commands show them."""
    a, b = non_utf8_pair(tmp_path)
    argv = [arg.format(a=a, b=b, out=tmp_path / "out.onnx") for arg in argv]
    proc = run_graphscan(argv, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    answer = proc.stdout.decode()
    assert "NAME\\ufffdARK" in answer or argv[0] in ("check", "runtime")
