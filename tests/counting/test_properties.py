"""Random QDQ graphs checked against a deliberately simple reference of SPEC.md.

The generator builds valid (not runnable) ONNX protobuf with everything the contract rules on:
branches and joins, shared DQs, Q->DQ pairs and bare float edges, weight DQs, float initializers
read directly, unnamed and duplicate-named nodes, multi-output nodes with unused outputs, graph
outputs, Q/DQ in both domains, absent optional inputs and outputs, Constant and If nodes, a node
reading one tensor twice, a Q feeding both a DQ and a compute node, a Q nobody reads, and node
order that is not topological; initializers of many dtypes with their payload in typed fields,
raw_data or a missing external file. Every graph is read both whole and through the big-file
skimmer (SKIM_THRESHOLD forced to 0).

The reference (tests/reference.py) shares no code with graphscan.py: plain loops over
``graph.node``, a BFS for islands, sets of node indices for the boundary.

Profiles: ``default`` (100 examples, derandomized so CI is deterministic) and ``thorough``
(5000): ``pytest tests/counting/test_properties.py -p no:xdist --hypothesis-profile thorough
--hypothesis-show-statistics``. Both are registered in conftest.py, not here: the hypothesis
plugin loads ``--hypothesis-profile`` in ``pytest_configure``, before test modules are
imported, and fails on a name it does not know.
"""

import contextlib
import itertools
import json
import shutil
from dataclasses import dataclass
from unittest import mock

import onnx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import graphscan
from tests.helpers import DELTA_KEYS, SINGLE_MODEL_COMMANDS, laws_broken, negated, run_main
from tests.reference import DQ, Q, reference, reference_diff

CUSTOM_DOMAIN = "com.example.graphscan"
OPSETS = [
    helper.make_opsetid("", 21),
    helper.make_opsetid("com.microsoft", 1),
    helper.make_opsetid(CUSTOM_DOMAIN, 1),
]
# Initializer dtypes beyond the fixed scale / zero point; names as TensorProto spells them.
EXTRA_DTYPES = [
    "FLOAT",
    "INT8",
    "UINT8",
    "INT16",
    "INT32",
    "INT64",
    "UINT32",
    "UINT64",
    "FLOAT16",
    "BFLOAT16",
    "DOUBLE",
    "BOOL",
    "INT4",
    "UINT4",
    "FLOAT8E4M3FN",
    "STRING",
]
# Where an initializer's payload lives: the typed repeated field of its dtype (float_data,
# int32_data, int64_data, ...), raw_data, or an external file that does not exist (structural
# commands must never open it). Big files are parsed without these payloads.
STORAGES = ["typed", "raw", "external"]
WEIGHT_DTYPES = {"INT8", "UINT8", "INT32", "INT4", "UINT4"}
# Names that collide with generated names, sort differently from natural order, or are not ASCII.
NAME_POOL = ["a", "B", "b", "a10", "a9", "Relu_0", "Add_1", "DequantizeLinear_0", "é", "z"]

# Compute operators: (op_type, domain, required inputs, optional inputs, required outputs,
# optional outputs). Optional slots may be written as "" (absent).
COMPUTE_OPS = [
    ("Relu", "", 1, 0, 1, 0),
    ("Add", "", 2, 0, 1, 0),
    ("MatMul", "", 2, 0, 1, 0),
    ("Concat", "", 1, 2, 1, 0),
    ("Clip", "", 1, 2, 1, 0),
    ("Gemm", "", 2, 1, 1, 0),
    ("Split", "", 1, 1, 2, 0),
    ("LayerNormalization", "", 2, 1, 1, 2),
    ("Dropout", "", 1, 2, 1, 1),
    ("TwoOut", CUSTOM_DOMAIN, 1, 1, 2, 0),
]


@dataclass(frozen=True)
class Node:
    """One node as plain data, so a falsifying example prints as pasteable Python."""

    op_type: str
    inputs: tuple
    outputs: tuple
    name: str = ""
    domain: str = ""
    captures: tuple = ()  # If only: outer tensors its branches read without a node input


@dataclass(frozen=True)
class Graph:
    """A top-level graph: nodes in graph order, graph inputs/outputs, initializers as
    (name, dtype, storage, element count)."""

    nodes: tuple
    inputs: tuple
    outputs: tuple
    initializers: tuple


# --- building protobuf -----------------------------------------------------------------------


def initializer(name, dtype, storage="typed", size=1):
    data_type = getattr(TensorProto, dtype)
    if storage == "external":
        tensor = TensorProto(name=name, data_type=data_type, dims=[size])
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in [("location", "missing_weights.bin"), ("offset", "0"), ("length", str(8 * size))]:
            tensor.external_data.add(key=key, value=value)
        return tensor
    if storage == "raw" and dtype != "STRING":
        # Not checked against the dtype's size: only names, dims and dtypes are counted.
        return TensorProto(name=name, data_type=data_type, dims=[size], raw_data=b"\x01" * 8 * size)
    value = {"BOOL": True, "STRING": b"s"}.get(dtype, 1)
    return helper.make_tensor(name, data_type, [size], [value] * size)


def branch(tag, captures, prefix):
    """An If branch: Q/DQ/Relu nodes (or a Constant) that must not be counted."""
    local = f"{prefix}{tag}"
    out = f"{local}_out"
    if captures:
        body = [
            helper.make_node(DQ, [captures[0], "s"], [f"{local}_f"], name=f"{local}_dq"),
            helper.make_node("Relu", [f"{local}_f", *captures[1:]], [f"{local}_r"]),
            helper.make_node(Q, [f"{local}_r", "s"], [out]),
        ]
    else:
        body = [helper.make_node("Constant", [], [out], value=initializer(f"{prefix}c", "INT8"))]
    return helper.make_graph(body, local, [], [helper.make_tensor_value_info(out, TensorProto.INT8, None)])


def to_model(graph):
    protos = []
    for k, node in enumerate(graph.nodes):
        attrs = {}
        if node.op_type == "Constant":
            attrs["value"] = initializer(f"const{k}", "FLOAT")
        elif node.op_type == "Split":
            attrs["num_outputs"] = len(node.outputs)
        elif node.op_type == "If":
            prefix = f"if{k}_"
            attrs["then_branch"] = branch("then", node.captures, prefix)
            attrs["else_branch"] = branch("else", node.captures[::-1], prefix)
        protos.append(
            helper.make_node(
                node.op_type,
                list(node.inputs),
                list(node.outputs),
                name=node.name,
                domain=node.domain,
                **attrs,
            )
        )
    proto = helper.make_graph(
        protos,
        "random",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in graph.inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in graph.outputs],
        initializer=[initializer(*init) for init in graph.initializers],
    )
    return helper.make_model(proto, opset_imports=OPSETS)


# --- the strategy ----------------------------------------------------------------------------


@st.composite
def node_names(draw):
    """Unnamed (named `<op_type>_<i>` by graphscan), unique, or from a pool that collides."""
    kind = draw(st.sampled_from(["unnamed", "unique", "pool"]))
    if kind == "unnamed":
        return ""
    if kind == "unique":
        return f"n{draw(st.integers(0, 10**6))}"
    return draw(st.sampled_from(NAME_POOL))


@st.composite
def graphs(draw):
    """A random QDQ graph (see the module docstring for everything it may contain)."""
    inputs = [f"x{k}" for k in range(draw(st.integers(1, 2)))]
    extra = draw(
        st.lists(
            st.tuples(st.sampled_from(EXTRA_DTYPES), st.sampled_from(STORAGES), st.integers(0, 4)),
            max_size=4,
        )
    )
    initializers = [("s", "FLOAT", "typed", 1), ("zp", "INT8", "typed", 1)]
    initializers += [(f"w{k}", *spec) for k, spec in enumerate(extra)]
    weights = [init[0] for init in initializers[2:] if init[1] in WEIGHT_DTYPES]
    float_weights = [init[0] for init in initializers[2:] if init[1] not in WEIGHT_DTYPES]
    # An initializer may also be listed as a graph input (IR < 4 style); it stays an initializer.
    if initializers[2:] and draw(st.booleans()):
        inputs.append(initializers[2][0])

    nodes = []
    produced = {"any": [], "q": [], "dq": [], "compute": []}
    counter = itertools.count()

    def fresh():
        return f"t{next(counter)}"

    def pick(candidates):
        # Recent tensors first: shrinking then favours chains over scattered reads.
        return candidates[-1 - draw(st.integers(0, len(candidates) - 1))]

    def any_tensor():
        return pick(inputs + [init[0] for init in initializers] + produced["any"])

    def add(op_type, ins, outs, kind, domain="", captures=()):
        nodes.append(Node(op_type, tuple(ins), tuple(outs), draw(node_names()), domain, captures))
        for t in outs:
            if t:
                produced["any"].append(t)
                produced[kind].append(t)
        return outs

    def compute_input(previous):
        source = draw(st.sampled_from(["recent", "dq", "q", "compute", "float-initializer", "repeat", "ghost"]))
        if source == "recent":
            return any_tensor()
        if source in ("dq", "q", "compute") and produced[source]:
            return pick(produced[source])
        if source == "float-initializer" and float_weights:
            return pick(float_weights)
        if source == "repeat" and previous:
            return previous[-1]  # one node reading the same tensor twice
        if source == "ghost":
            return "ghost"  # read but produced by nothing, not an input, not an initializer
        return any_tensor()

    def compute(ins=None):
        op_type, domain, required, optional, outs, optional_outs = draw(st.sampled_from(COMPUTE_OPS))
        if ins is None:
            ins = []
            for _ in range(required):
                ins.append(compute_input(ins))
            for _ in range(draw(st.integers(0, optional))):
                ins.append("" if draw(st.booleans()) else compute_input(ins))
        outputs = [fresh() for _ in range(outs)]
        for _ in range(draw(st.integers(0, optional_outs))):
            outputs.append("" if draw(st.booleans()) else fresh())
        return add(op_type, ins, outputs, "compute", domain)

    def qdq_params():
        scale = "s" if draw(st.integers(0, 5)) else any_tensor()  # rarely a computed scale
        zero_point = draw(st.sampled_from(["zp", "", None]))
        return [scale] if zero_point is None else [scale, zero_point]

    def quantize(x=None):
        if x is None:
            source = draw(st.sampled_from(["compute", "any"]))
            computed = produced["compute"]
            x = pick(computed) if source == "compute" and computed else any_tensor()
        domain = draw(st.sampled_from(["", "com.microsoft"]))
        return add(Q, [x, *qdq_params()], [fresh()], "q", domain)[0]

    def dequantize(x=None):
        if x is None:
            source = draw(st.sampled_from(["q", "weight", "any", "empty"]))
            if source == "q" and produced["q"]:
                x = pick(produced["q"])
            elif source == "weight" and weights:
                x = pick(weights)
            elif source == "empty":
                x = ""
            else:
                x = any_tensor()
        domain = draw(st.sampled_from(["", "com.microsoft"]))
        return add(DQ, [x, *qdq_params()], [fresh()], "dq", domain)[0]

    for _ in range(draw(st.integers(0, 12))):
        step = draw(st.sampled_from(["compute", "dq", "q", "pair", "wrapped", "diamond", "constant", "if"]))
        if step == "compute":
            compute()
        elif step == "dq":
            dequantize()
        elif step == "q":
            quantize()
        elif step == "pair":
            dequantize(quantize())
        elif step == "wrapped":
            # DQ -> compute -> Q (-> DQ): wrapped unless a later step also reads its output.
            ins = [dequantize() for _ in range(draw(st.integers(1, 2)))]
            for out in compute(ins):
                if out and draw(st.integers(0, 4)):
                    q_out = quantize(out)
                    if draw(st.booleans()):
                        dequantize(q_out)
        elif step == "diamond":
            # x feeds a branch and its join: a DQ here feeds two nodes of one island.
            source = draw(st.sampled_from(["dq", "any"]))
            x = pick(produced["dq"]) if source == "dq" and produced["dq"] else any_tensor()
            left = compute([x])[0]
            compute([x, left])
        elif step == "constant":
            add("Constant", [], [fresh()], "compute")
        else:
            # Its branches read outer tensors with no node input: not consumers (SPEC scope).
            captures = draw(st.lists(st.sampled_from(produced["any"] or inputs), max_size=2))
            add("If", [any_tensor()], [fresh()], "compute", captures=tuple(captures))

    readable = inputs + produced["any"]
    outputs = draw(st.lists(st.sampled_from(readable), max_size=3, unique=True))
    order = draw(st.permutations(range(len(nodes))))  # graph order need not be topological
    return Graph(tuple(nodes[i] for i in order), tuple(inputs), tuple(outputs), tuple(initializers))


# --- comparing --------------------------------------------------------------------------------


def as_key(entry):
    """An island entry as one sortable string."""
    return json.dumps(entry, sort_keys=True)


def assert_same_island_lists(actual, expected):
    """Equal lists; where two islands share their first name SPEC.md leaves their order open."""
    firsts = [entry["nodes"][0] for entry in actual]
    assert firsts == sorted(firsts)
    if len(set(firsts)) == len(firsts):
        assert actual == expected
    else:
        assert sorted(map(as_key, actual)) == sorted(map(as_key, expected))


@pytest.fixture(scope="session")
def save_graphs(tmp_path_factory):
    """Writes each example's models into a fresh folder and returns ``[(path, loaded model)]``.

    Hypothesis reruns a test body many times and function-scoped tmp_path is shared across
    those runs, so this session-scoped factory hands out one folder per example. The previous
    example's folder is removed (thousands of them under the thorough profile); the last one,
    after a failure the minimal example, stays for inspection.
    """
    base = tmp_path_factory.mktemp("graphs")
    counter = itertools.count()
    previous = []

    def save(*graphs):
        while previous:
            shutil.rmtree(previous.pop(), ignore_errors=True)
        folder = base / f"example{next(counter)}"
        folder.mkdir()
        previous.append(folder)
        saved = []
        for name, graph in zip("ab", graphs, strict=False):  # one or two graphs
            path = folder / f"{name}.onnx"
            path.write_bytes(to_model(graph).SerializeToString())
            saved.append((str(path), onnx.load(path, load_external_data=False)))
        return saved

    return save


def describe(answers):
    """Coverage notes for --hypothesis-show-statistics."""
    event(f"islands={min(answers['islands']['island_count'], 3)}")
    event(f"wrapped={'some' if answers['islands']['wrapped'] else 'none'}")
    event(f"round_trips={'some' if answers['qdq']['round_trips'] else 'none'}")


# --- the properties ---------------------------------------------------------------------------


def reading(how):
    """Small files are parsed whole; big ones (>= SKIM_THRESHOLD) without tensor payloads, by
    graphscan's own wire-format skimmer. A threshold of 0 sends these small graphs that way."""
    if how == "skimmed":
        return mock.patch.object(graphscan, "_SKIM_THRESHOLD", 0)
    return contextlib.nullcontext()


@pytest.mark.parametrize("how", ["parsed", "skimmed"])
@given(graph=graphs())
def test_every_answer_matches_the_reference(save_graphs, how, graph):
    [(path, model)] = save_graphs(graph)
    expected = reference(model)
    describe(expected)
    with reading(how):
        census, counts = graphscan.nodes(path), graphscan.qdq(path)
        islands, boundary = graphscan.islands(path), graphscan.boundary(path)

    assert census == {"model": path, **expected["nodes"]}
    assert counts == {"model": path, **expected["qdq"]}

    assert set(islands) == {"model", "compute", "wrapped", "float", "island_count", "islands"}
    assert {k: v for k, v in islands.items() if k != "islands"} == {
        "model": path,
        **{k: v for k, v in expected["islands"].items() if k != "islands"},
    }
    assert_same_island_lists(islands["islands"], expected["islands"]["islands"])

    assert set(boundary) == {"model", "island_count", "crossings", "per_island"}
    assert boundary["model"] == path
    assert boundary["island_count"] == expected["boundary"]["island_count"]
    assert boundary["crossings"] == expected["boundary"]["crossings"]
    assert_same_island_lists(boundary["per_island"], expected["boundary"]["per_island"])


@given(graph=graphs())
def test_invariants_hold(save_graphs, graph):
    [(path, _)] = save_graphs(graph)
    answers = {command: getattr(graphscan, command)(path) for command in SINGLE_MODEL_COMMANDS}
    assert laws_broken(answers) == []


@given(a=graphs(), b=graphs())
def test_diff_matches_the_reference_and_is_antisymmetric(save_graphs, a, b):
    (path_a, model_a), (path_b, model_b) = save_graphs(a, b)

    forward = graphscan.diff(path_a, path_b)
    assert forward == {"a": path_a, "b": path_b, **reference_diff(reference(model_a), reference(model_b))}
    assert graphscan.diff(path_b, path_a) == negated(forward)
    same = graphscan.diff(path_a, path_a)
    assert same == {"a": path_a, "b": path_a, "op_delta": {}, **dict.fromkeys(DELTA_KEYS, 0)}


# capsys is function-scoped, but run_main reads it empty before and after each run,
# so nothing leaks from one example to the next.
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(graph=graphs(), command=st.sampled_from(SINGLE_MODEL_COMMANDS))
def test_cli_prints_the_library_answer(save_graphs, capsys, graph, command):
    [(path, _)] = save_graphs(graph)
    code, stdout, stderr = run_main(capsys, [command, path])
    assert (code, stderr) == (0, "")
    assert stdout.endswith("\n") and stdout.count("\n") == 1
    assert json.loads(stdout) == getattr(graphscan, command)(path)
