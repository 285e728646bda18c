"""Damaged and odd files: graphscan answers or refuses in one line, never crashes.

SPEC.md "Invocation": a run ends either with exit 0 and one JSON object on
stdout (stderr empty), or with an error exit (4 for a file that is not an ONNX
model, 3 for one that cannot be read) and one stderr line naming the path
(stdout empty). Never a traceback, never exit 1 ("internal error").

- Mutations: a few valid models (hand-built QDQ graphs and onnx's own test
  files) are truncated, bit-flipped and zero-filled at places drawn from
  ``numpy.random.default_rng(n)``, n = the mutation's number, so every id is a
  reproducible case. ``GRAPHSCAN_MUTATIONS`` (default 200) sets how many; the
  ids of the first 200 never change when it grows. Most runs call
  ``graphscan.main(argv)`` in-process; every tenth also runs as a process.
- Fields protobuf accepts but onnx never writes: strings that are not UTF-8,
  data types and enum values onnx does not know.
- Determinism: byte-identical stdout across runs and ``PYTHONHASHSEED`` values.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphscan
from conftest import (
    COMMANDS,
    SINGLE_MODEL_COMMANDS,
    SPEC_KEYS,
    assert_counts_are_integers,
)

GRAPHSCAN = str(Path(__file__).resolve().parent.parent / "graphscan.py")
CORPUS_ROOT = Path(onnx.__file__).parent / "backend" / "test" / "data"

ERROR_EXITS = [graphscan.EXIT_NO_FILE, graphscan.EXIT_NOT_ONNX]

MUTATIONS = int(os.environ.get("GRAPHSCAN_MUTATIONS", "200"))
KINDS = ["truncate", "flip", "zero"]
SUBPROCESS_EVERY = 10  # every tenth mutation also runs as a process
OPSET = [helper.make_opsetid("", 13)]


# --------------------------------------------------------------------------
# Models


def qdq(name, tensor, scale, zero_point, out, dq_out):
    """A named Q -> DQ pair on ``tensor``."""
    return [
        helper.make_node("QuantizeLinear", [tensor, scale, zero_point], [out], name=f"{name}_q"),
        helper.make_node("DequantizeLinear", [out, scale, zero_point], [dq_out], name=f"{name}_dq"),
    ]


def qdq_mlp():
    """Two int8-wrapped MatMuls around a float Relu+Add island, as onnxruntime writes them."""
    rng = np.random.default_rng(0)
    inits = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.05]),
        helper.make_tensor("zp", TensorProto.INT8, [], [0]),
        helper.make_tensor("w1_q", TensorProto.INT8, [4, 4], rng.integers(-128, 128, 16).tolist()),
        helper.make_tensor("w2_q", TensorProto.INT8, [4, 4], rng.integers(-128, 128, 16).tolist()),
        helper.make_tensor("bias", TensorProto.FLOAT, [4], rng.standard_normal(4).tolist()),
    ]
    nodes = [
        *qdq("x", "x", "s", "zp", "x_q", "x_dq"),
        helper.make_node("DequantizeLinear", ["w1_q", "s", "zp"], ["w1"], name="w1_dq"),
        helper.make_node("MatMul", ["x_dq", "w1"], ["mm1"], name="fc1"),
        *qdq("mm1", "mm1", "s", "zp", "mm1_q", "mm1_dq"),
        helper.make_node("Relu", ["mm1_dq"], ["r"]),  # unnamed: Relu_7
        helper.make_node("Add", ["r", "bias"], ["a"], name="fc1_add"),
        *qdq("a", "a", "s", "zp", "a_q", "a_dq"),
        helper.make_node("DequantizeLinear", ["w2_q", "s", "zp"], ["w2"]),
        helper.make_node("MatMul", ["a_dq", "w2"], ["mm2"], name="fc2"),
        *qdq("mm2", "mm2", "s", "zp", "mm2_q", "mm2_dq"),
        helper.make_node("Softmax", ["mm2_dq"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)


def branch(name, op_type):
    """An If branch reading the outer graph's ``c_dq``."""
    return helper.make_graph(
        [helper.make_node(op_type, ["c_dq"], [f"{name}_out"], name=f"{name}_op")],
        name,
        [],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)],
    )


def qdq_odd():
    """Optional empty inputs, an If with subgraphs, ms-domain Q/DQ, typed payloads, metadata."""
    inits = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
        helper.make_tensor("zp", TensorProto.UINT8, [], [128]),
        helper.make_tensor("lo", TensorProto.FLOAT, [], [-1.0]),
        helper.make_tensor("shape", TensorProto.INT64, [2], [1, -1]),
        helper.make_tensor("labels", TensorProto.STRING, [2], [b"cat", b"dog"]),
        helper.make_tensor("wide", TensorProto.DOUBLE, [3], [1.5, -2.5, 1e300]),
        helper.make_tensor("w_q", TensorProto.UINT8, [2, 2], bytes([1, 2, 3, 4]), raw=True),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["x_q"], domain="com.microsoft"),
        helper.make_node("DequantizeLinear", ["x_q", "s", "zp"], ["x_dq"], domain="com.microsoft"),
        helper.make_node("Clip", ["x_dq", "", "lo"], ["c"], name="clip"),  # absent min
        helper.make_node("Reshape", ["c", "shape"], ["flat"], doc_string="a doc string"),
        helper.make_node("QuantizeLinear", ["flat", "s", "zp"], ["c_q"]),
        helper.make_node("DequantizeLinear", ["c_q", "s", "zp"], ["c_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "s", "zp"], ["w"], name="w_dq"),
        helper.make_node("ReduceSum", ["c_dq"], ["cond_f"], keepdims=0),
        helper.make_node("Cast", ["cond_f"], ["cond"], to=TensorProto.BOOL),
        helper.make_node(
            "If", ["cond"], ["branch", ""], then_branch=branch("then", "Relu"),
            else_branch=branch("else", "Neg"), name="pick",
        ),
        helper.make_node("MatMul", ["w", "w"], ["ww"], name="square"),
        helper.make_node("Identity", ["ww"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_odd",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [
            helper.make_tensor_value_info("branch", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 2]),
        ],
        inits,
        doc_string="graph doc",
    )
    model = helper.make_model(
        graph, opset_imports=OPSET + [helper.make_opsetid("com.microsoft", 1)], producer_name="test"
    )
    helper.set_model_props(model, {"author": "mutation test"})
    return model


BUILT_SOURCES = {"qdq-mlp": qdq_mlp, "qdq-odd": qdq_odd}
CORPUS_SOURCES = {
    "squeezenet": "light/light_squeezenet.onnx",
    "sequence": "simple/test_sequence_model3/model.onnx",
    "params": "pytorch-operator/test_operator_params/model.onnx",
}
SOURCES = list(BUILT_SOURCES) + list(CORPUS_SOURCES)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """``{source name: path}`` of the unmutated models, written once per module.

    Built models are serialized here (onnx writes them byte-identically every
    time), so mutation n always damages the same bytes.
    """
    folder = tmp_path_factory.mktemp("originals")
    paths = {}
    for name, build in BUILT_SOURCES.items():
        paths[name] = folder / f"{name}.onnx"
        paths[name].write_bytes(build().SerializeToString())
    for name, relative in CORPUS_SOURCES.items():
        paths[name] = folder / f"{name}.onnx"
        paths[name].write_bytes((CORPUS_ROOT / relative).read_bytes())
    return paths


# --------------------------------------------------------------------------
# Mutations


def mutate(data, kind, rng):
    """``(damaged bytes, what was done)``; the description reproduces the case by hand."""
    if kind == "truncate":
        cut = int(rng.integers(0, len(data)))
        return data[:cut], f"truncated to {cut} of {len(data)} bytes"
    if kind == "flip":
        count = int(rng.integers(1, 9))
        positions = [int(p) for p in rng.integers(0, len(data), size=count)]
        masks = [int(m) for m in rng.integers(1, 256, size=count)]
        damaged = bytearray(data)
        for position, mask in zip(positions, masks):
            damaged[position] ^= mask
        return bytes(damaged), f"xor (offset, mask) {list(zip(positions, masks))}"
    start = int(rng.integers(0, len(data)))
    length = int(rng.integers(1, 65))
    damaged = bytearray(data)
    damaged[start : start + length] = bytes(len(damaged[start : start + length]))
    return bytes(damaged), f"zeroed [{start}, {start + length})"


def mutation_case(n):
    """Mutation ``n``: its source, kind and seed (the seed is ``n`` itself)."""
    return SOURCES[n % len(SOURCES)], KINDS[n % len(KINDS)], n


def mutation_params(numbers):
    params = []
    for n in numbers:
        source, kind, seed = mutation_case(n)
        params.append(pytest.param(source, kind, seed, id=f"m{n:05d}-{source}-{kind}"))
    return params


def write_mutation(originals, folder, source, kind, seed):
    data, description = mutate(originals[source].read_bytes(), kind, np.random.default_rng(seed))
    path = folder / f"{source}-{kind}-{seed}.onnx"
    path.write_bytes(data)
    return str(path), description


# --------------------------------------------------------------------------
# The contract, as one function per side


def contract_violation(command, paths, code, out, err):
    """Why one run breaks SPEC.md's contract, or None; ``out``/``err`` are str.

    The last path is the damaged one: an error line must name it.
    """
    shown = f"exit {code}, stdout {out[:300]!r}, stderr {err[:500]!r}"
    if "Traceback" in out or "Traceback" in err:
        return f"traceback: {shown}"
    if code == 0:
        if err or not out.endswith("\n") or out.count("\n") != 1:
            return f"exit 0 but not one stdout line and empty stderr: {shown}"
        try:
            answer = json.loads(out)
        except ValueError:
            return f"exit 0 with stdout that is not JSON: {shown}"
        if not isinstance(answer, dict) or sorted(answer) != sorted(SPEC_KEYS[command]):
            return f"exit 0 with keys other than SPEC.md's: {shown}"
        try:
            assert_counts_are_integers(answer)
        except AssertionError as exc:
            return f"exit 0 with a count that is not an int ({exc}): {shown}"
        return None
    if code in ERROR_EXITS:
        if out:
            return f"error exit with stdout: {shown}"
        if not err.endswith("\n") or err.count("\n") != 1 or not err.strip():
            return f"error exit without exactly one stderr line: {shown}"
        if paths[-1] not in err:
            return f"error line does not name {paths[-1]}: {shown}"
        return None
    return f"exit code outside the contract: {shown}"


def run_in_process(capsys, command, paths):
    """``graphscan.main`` on ``[command, *paths]`` as ``(code, stdout, stderr)``.

    An exception escaping ``main`` would be a traceback on the command line;
    it comes back as code None with the exception in stderr.
    """
    capsys.readouterr()
    try:
        code = graphscan.main([command, *paths])
    except BaseException as exc:  # noqa: BLE001 - any escape is the finding
        captured = capsys.readouterr()
        escaped = f"Traceback (escaped main): {type(exc).__name__}: {exc}"
        return None, captured.out, captured.err + escaped
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_process(command, paths, cwd, env=None):
    proc = subprocess.run(
        [sys.executable, GRAPHSCAN, command, *paths],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=120,
    )
    out, err = (stream.decode("utf-8", "replace") for stream in (proc.stdout, proc.stderr))
    return proc.returncode, out, err


def command_paths(command, path, original):
    """The paths of one run: ``diff`` compares the original with the damaged file."""
    return [str(original), path] if command == "diff" else [path]


def laws_broken(answers):
    """The invariants of STYLE.md on the JSON answers of one (damaged but parsed) model."""
    nodes, qdq_answer, islands, boundary = (answers[c] for c in SINGLE_MODEL_COMMANDS)
    broken = []
    if nodes["nodes"] != sum(nodes["op_types"].values()):
        broken.append("nodes != sum(op_types)")
    if nodes["nodes"] != islands["compute"] + qdq_answer["quantize"] + qdq_answer["dequantize"]:
        broken.append("nodes != compute + Q + DQ")
    if islands["wrapped"] + islands["float"] != islands["compute"]:
        broken.append("wrapped + float != compute")
    if sum(e["size"] for e in islands["islands"]) != islands["float"]:
        broken.append("sum(sizes) != float")
    per_island = boundary["per_island"]
    if boundary["crossings"] != sum(e["in_dequantize"] + e["out_quantize"] for e in per_island):
        broken.append("crossings != sum(per_island)")
    if [e["nodes"] for e in per_island] != [e["nodes"] for e in islands["islands"]]:
        broken.append("boundary islands differ from islands")
    firsts = [e["nodes"][0] for e in islands["islands"]]
    unsorted = any(e["nodes"] != sorted(e["nodes"]) for e in islands["islands"])
    if firsts != sorted(firsts) or unsorted:
        broken.append("islands not sorted")
    return broken


# --------------------------------------------------------------------------
# 1. Seeded mutations


@pytest.mark.parametrize(("source", "kind", "seed"), mutation_params(range(MUTATIONS)))
def test_mutated_model_answers_or_refuses(
    originals, tmp_path, capsys, monkeypatch, source, kind, seed
):
    """Every command on the damaged file keeps the contract; parsed answers keep the laws.

    The run is repeated with the big-file skim forced on (SKIM_THRESHOLD = 1): it
    must keep the contract too and give the same answer whenever the full parse
    gives one. The one tolerated difference: the skim never reads tensor payloads,
    so a file damaged only inside one may be refused (4) by the full parse and
    answered by the skim.
    """
    path, description = write_mutation(originals, tmp_path, source, kind, seed)
    problems, answers, full_runs = [], {}, {}
    for command in COMMANDS:
        paths = command_paths(command, path, originals[source])
        code, out, err = run_in_process(capsys, command, paths)
        full_runs[command] = (code, out)
        problem = contract_violation(command, paths, code, out, err)
        if problem:
            problems.append(f"{command}: {problem}")
        elif code == 0:
            answers[command] = json.loads(out)
    if all(command in answers for command in SINGLE_MODEL_COMMANDS):
        problems += [f"law broken: {law}" for law in laws_broken(answers)]

    monkeypatch.setattr(graphscan, "SKIM_THRESHOLD", 1)
    for command in SINGLE_MODEL_COMMANDS:
        code, out, err = run_in_process(capsys, command, [path])
        problem = contract_violation(command, [path], code, out, err)
        if problem:
            problems.append(f"{command} (skim): {problem}")
            continue
        full_code, full_out = full_runs[command]
        if full_code == 0 and (code, out) != (0, full_out):
            problems.append(f"{command} (skim): exit {code} {out or err!r}, full parse answered")
        elif full_code != 0 and code != full_code and not (full_code == 4 and code == 0):
            problems.append(f"{command} (skim): exit {code}, full parse exit {full_code}")

    assert not problems, f"{path} ({source}, {description}):\n" + "\n".join(problems)


# Mutation 10j + (j mod 10): one in ten, and (unlike 0, 10, 20...) every source.
SUBPROCESS_NUMBERS = [
    n
    for j in range(MUTATIONS // SUBPROCESS_EVERY + 1)
    if (n := SUBPROCESS_EVERY * j + j % 10) < MUTATIONS
]


def process_command(n):
    """The command mutation ``n`` runs as a process: every (source, command) pair within 25."""
    j = n // SUBPROCESS_EVERY
    return COMMANDS[(j + j // len(COMMANDS)) % len(COMMANDS)]


@pytest.mark.parametrize(("source", "kind", "seed"), mutation_params(SUBPROCESS_NUMBERS))
def test_mutated_model_as_a_process(originals, tmp_path, source, kind, seed):
    """A sample of the same mutations through ``python graphscan.py``, one command each."""
    path, description = write_mutation(originals, tmp_path, source, kind, seed)
    command = process_command(seed)
    paths = command_paths(command, path, originals[source])
    code, out, err = run_process(command, paths, tmp_path)
    problem = contract_violation(command, paths, code, out, err)
    assert problem is None, f"{command} {path} ({source}, {description}): {problem}"


# --------------------------------------------------------------------------
# 2. Strings that are not UTF-8
#
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
    return helper.make_model(
        graph, opset_imports=OPSET + [helper.make_opsetid("DOMAINMK", 1)]
    )


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
    code, out, err = run_in_process(capsys, command, paths)
    problem = contract_violation(command, paths, code, out, err)
    assert problem is None, f"{field} not UTF-8, {command}: {problem}"


@pytest.mark.parametrize("command", ["nodes", "islands", "boundary"])
def test_lone_non_utf8_name_as_a_process(tmp_path, command):
    """With no str name to compare against, the bytes name reaches json.dumps in main."""
    path = tmp_path / "lone.onnx"
    path.write_bytes(break_utf8(lone_node_model().SerializeToString(), b"NAMEMARK"))
    code, out, err = run_process(command, [str(path)], tmp_path)
    problem = contract_violation(command, [str(path)], code, out, err)
    assert problem is None, f"{command}: {problem}"


# --------------------------------------------------------------------------
# 3. Data types and enum values onnx does not know


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
    graph = helper.make_graph(
        nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], inits
    )
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
    code, out, err = run_in_process(capsys, command, [unknown_types_file])
    assert contract_violation(command, [unknown_types_file], code, out, err) is None
    assert code == 0
    assert json.loads(out) == {"model": unknown_types_file, **EXPECTED_UNKNOWN_TYPES[command]}


def test_unknown_data_type_as_a_process(unknown_types_file, tmp_path):
    code, out, err = run_process("nodes", [unknown_types_file], tmp_path)
    assert contract_violation("nodes", [unknown_types_file], code, out, err) is None
    assert json.loads(out)["initializers"] == EXPECTED_UNKNOWN_TYPES["nodes"]["initializers"]


# --------------------------------------------------------------------------
# 4. Determinism across runs and hash seeds

HASH_SEEDS = ["0", "1", "12345", "random", "random"]


def many_islands_model(segments, seed):
    """``segments`` float islands split by Q->DQ, mostly unnamed nodes, in shuffled order.

    Named nodes draw from a few names, so duplicates exist; shuffling puts the
    ``<op_type>_<i>`` names out of graph order. Every set or dict order that
    leaked into the answer would show up across hash seeds.
    """
    rng = np.random.default_rng(seed)

    def named():
        return f"n{int(rng.integers(0, 12))}" if rng.random() < 0.3 else ""

    inits = [helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])]
    nodes, tensor = [], "x"
    for k in range(segments):
        nodes += [
            helper.make_node("QuantizeLinear", [tensor, "s"], [f"q{k}"]),
            helper.make_node("DequantizeLinear", [f"q{k}", "s"], [f"d{k}"]),
            helper.make_node("Relu", [f"d{k}"], [f"r{k}"], name=named()),
            helper.make_node(
                ["Mul", "Add", "Sub"][k % 3], [f"r{k}", f"d{k}"], [f"m{k}"], name=named()
            ),
            helper.make_node("Sigmoid", [f"m{k}"], [f"g{k}"], name=named()),
        ]
        if k % 4 == 0:  # an int8-wrapped node between two pairs
            nodes += [
                helper.make_node("QuantizeLinear", [f"g{k}", "s"], [f"gq{k}"]),
                helper.make_node("DequantizeLinear", [f"gq{k}", "s"], [f"gd{k}"]),
                helper.make_node("Neg", [f"gd{k}"], [f"w{k}"], name=named()),
                helper.make_node("QuantizeLinear", [f"w{k}", "s"], [f"wq{k}"]),
                helper.make_node("DequantizeLinear", [f"wq{k}", "s"], [f"g{k}w"]),
            ]
            tensor = f"g{k}w"
        else:
            tensor = f"g{k}"
    nodes.append(helper.make_node("Identity", [tensor], ["y"]))
    order = rng.permutation(len(nodes))
    graph = helper.make_graph(
        [nodes[i] for i in order],
        "many_islands",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        inits,
    )
    return helper.make_model(graph, opset_imports=OPSET)


@pytest.fixture(scope="module")
def many_islands_files(tmp_path_factory):
    """Two different many-island models, so diff has a non-trivial op_delta to order."""
    folder = tmp_path_factory.mktemp("many_islands")
    a, b = folder / "a.onnx", folder / "b.onnx"
    a.write_bytes(many_islands_model(60, seed=1).SerializeToString())
    b.write_bytes(many_islands_model(45, seed=2).SerializeToString())
    return str(a), str(b)


@pytest.mark.parametrize("command", COMMANDS)
def test_same_bytes_across_runs_and_hash_seeds(many_islands_files, tmp_path, command):
    a, b = many_islands_files
    paths = [a, b] if command == "diff" else [a]
    outputs = {}
    for k, hash_seed in enumerate(HASH_SEEDS):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        code, out, err = run_process(command, paths, tmp_path, env)
        assert (code, err) == (0, ""), f"PYTHONHASHSEED={hash_seed}: exit {code} {err!r}"
        outputs[f"{k}:{hash_seed}"] = out
    assert len(set(outputs.values())) == 1, {seed: out[:200] for seed, out in outputs.items()}

    answer = json.loads(next(iter(outputs.values())))
    assert answer == getattr(graphscan, command)(*paths)
    if command == "islands":  # the model really has what the test claims
        assert answer["island_count"] >= 50
        assert any("_" in name for island in answer["islands"] for name in island["nodes"])
    if command == "diff":
        assert len(answer["op_delta"]) >= 3
