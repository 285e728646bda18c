"""Damaged files: graphscan answers or refuses in one line, never crashes.

SPEC.md "Invocation": a run ends either with exit 0 and one JSON object on
stdout (stderr empty), or with an error exit (4 for a file that is not an ONNX
model, 3 for one that cannot be read) and one stderr line naming the path
(stdout empty). Never a traceback, never exit 1 ("internal error").

A few valid models (hand-built QDQ graphs and onnx's own test files) are
truncated, bit-flipped and zero-filled at places drawn from
``numpy.random.default_rng(n)``, n = the mutation's number, so every id is a
reproducible case. ``GRAPHSCAN_MUTATIONS`` (default 200) sets how many; the ids
of the first 200 never change when it grows. Most runs call
``graphscan.main(argv)`` in-process; every tenth also runs as a process.
"""

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphscan
from tests.helpers import (
    COMMANDS,
    SINGLE_MODEL_COMMANDS,
    command_paths,
    contract_violation,
    laws_broken,
    process_result,
    run_graphscan,
    run_main,
)

CORPUS_ROOT = Path(onnx.__file__).parent / "backend" / "test" / "data"
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
            "If",
            ["cond"],
            ["branch", ""],
            then_branch=branch("then", "Relu"),
            else_branch=branch("else", "Neg"),
            name="pick",
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
        for position, mask in zip(positions, masks, strict=True):
            damaged[position] ^= mask
        return bytes(damaged), f"xor (offset, mask) {list(zip(positions, masks, strict=True))}"
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
# 1. Seeded mutations


@pytest.mark.parametrize(("source", "kind", "seed"), mutation_params(range(MUTATIONS)))
def test_mutated_model_answers_or_refuses(originals, tmp_path, capsys, monkeypatch, source, kind, seed):
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
        code, out, err = run_main(capsys, [command, *paths])
        full_runs[command] = (code, out)
        problem = contract_violation(command, paths, code, out, err)
        if problem:
            problems.append(f"{command}: {problem}")
        elif code == 0:
            answers[command] = json.loads(out)
    if all(command in answers for command in SINGLE_MODEL_COMMANDS):
        problems += [f"law broken: {law}" for law in laws_broken(answers)]

    monkeypatch.setattr(graphscan, "_SKIM_THRESHOLD", 1)
    for command in SINGLE_MODEL_COMMANDS:
        code, out, err = run_main(capsys, [command, path])
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
    n for j in range(MUTATIONS // SUBPROCESS_EVERY + 1) if (n := SUBPROCESS_EVERY * j + j % 10) < MUTATIONS
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
    code, out, err = process_result(run_graphscan([command, *paths], cwd=tmp_path))
    problem = contract_violation(command, paths, code, out, err)
    assert problem is None, f"{command} {path} ({source}, {description}): {problem}"
