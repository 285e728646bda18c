"""Determinism: byte-identical stdout across runs and ``PYTHONHASHSEED`` values (one
interpreter per seed, every counting command run in it)."""

import json
import os

import numpy as np
import pytest
from onnx import TensorProto, helper

import graphscan
from tests.helpers import COMMANDS, main_runs_in_one_process

OPSET = [helper.make_opsetid("", 13)]


HASH_SEEDS = ["0", "12345", "random"]


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
            helper.make_node(["Mul", "Add", "Sub"][k % 3], [f"r{k}", f"d{k}"], [f"m{k}"], name=named()),
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


@pytest.fixture(scope="module")
def runs_by_seed(many_islands_files, tmp_path_factory):
    """``{seed: {command: (exit code, stdout, stderr)}}``, each seed in its own process."""
    a, b = many_islands_files
    argvs = [[command, a, b] if command == "diff" else [command, a] for command in COMMANDS]
    found = {}
    for k, hash_seed in enumerate(HASH_SEEDS):  # the seed is fixed when an interpreter starts
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        runs = main_runs_in_one_process(argvs, cwd=tmp_path_factory.mktemp("seed"), env=env)
        found[f"{k}:{hash_seed}"] = {command: run[:3] for command, run in zip(COMMANDS, runs, strict=True)}
    return found


@pytest.mark.parametrize("command", COMMANDS)
def test_same_bytes_across_runs_and_hash_seeds(many_islands_files, runs_by_seed, command):
    a, b = many_islands_files
    paths = [a, b] if command == "diff" else [a]
    outputs = {}
    for seed, runs in runs_by_seed.items():
        code, out, err = runs[command]
        assert (code, err) == (0, ""), f"PYTHONHASHSEED={seed}: exit {code} {err!r}"
        outputs[seed] = out
    assert len(set(outputs.values())) == 1, {seed: out[:200] for seed, out in outputs.items()}

    answer = json.loads(next(iter(outputs.values())))
    assert answer == getattr(graphscan, command)(*paths)
    if command == "islands":  # the model really has what the test claims
        assert answer["island_count"] >= 50
        assert any("_" in name for island in answer["islands"] for name in island["nodes"])
    if command == "diff":
        assert len(answer["op_delta"]) >= 3
