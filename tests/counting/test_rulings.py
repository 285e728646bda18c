"""One hand-built graph per ruling in SPEC.md, with the answer derived by hand from the SPEC text.

Every expected dict below was written from the contract, never copied from graphscan's output; the
comment above it gives the reasoning. The graphs are valid ONNX protobuf but are not meant to run
(tensor types and shapes are left loose and the checker is not called on deliberately odd graphs).
"""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphscan

OPSETS = [
    helper.make_opsetid("", 21),
    helper.make_opsetid("com.microsoft", 1),
    helper.make_opsetid("com.example", 1),
]


def tensor(name, dtype=np.float32, shape=(2, 2)):
    """An initializer of the given numpy dtype, filled with ones."""
    return numpy_helper.from_array(np.ones(shape, dtype=dtype), name)


# Scale and zero point shared by every Q/DQ built with q() / dq().
QPARAMS = [tensor("s", np.float32, ()), tensor("zp", np.int8, ())]


def node(op_type, inputs, outputs, name="", domain="", **attrs):
    """A node; name="" leaves it unnamed so graphscan must name it <op_type>_<index>."""
    return helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs)


def q(name, x, y, domain=""):
    """A QuantizeLinear of x with the shared scale and zero point."""
    return node("QuantizeLinear", [x, "s", "zp"], [y], name, domain)


def dq(name, x, y, domain=""):
    """A DequantizeLinear of x with the shared scale and zero point."""
    return node("DequantizeLinear", [x, "s", "zp"], [y], name, domain)


def save(tmp_path, nodes, inputs, outputs, initializers=(), filename="model.onnx"):
    """Write a one-graph model into tmp_path and return its path as the string graphscan echoes."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=list(initializers),
    )
    path = tmp_path / filename
    path.write_bytes(helper.make_model(graph, opset_imports=OPSETS).SerializeToString())
    return str(path)


def island(*names_and_ops):
    """Expected islands entry from (name, op_type) pairs; the literal order is pinned in
    test_islands_sorted_by_smallest_node_name_with_sorted_members."""
    names = sorted(n for n, _ in names_and_ops)
    return {"nodes": names, "size": len(names), "op_types": sorted(o for _, o in names_and_ops)}


NO_ISLANDS = {"island_count": 0, "crossings": 0, "per_island": []}


# --- node names -------------------------------------------------------------------------------


def test_unnamed_nodes_are_named_by_op_type_and_graph_position(tmp_path):
    path = save(
        tmp_path,
        [
            node("Relu", ["x"], ["a"]),  # 0 -> Relu_0
            q("", "a", "aq"),  # 1 -> QuantizeLinear_1 (unnamed Q/DQ still take an index)
            dq("", "aq", "a2"),  # 2
            node("Sigmoid", ["a2"], ["b"], "sig"),  # 3, named
            node("Relu", ["b"], ["y"]),  # 4 -> Relu_4, not Relu_2: the index counts Q/DQ too
        ],
        ["x"],
        ["y"],
        QPARAMS,
    )
    # Relu_0 reads a graph input -> float, alone (its only consumer is a Q).
    # sig feeds a Relu, Relu_4 reads sig -> both float, one island. "Relu_0" < "Relu_4".
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 3,
        "wrapped": 0,
        "float": 3,
        "island_count": 2,
        "islands": [
            island(("Relu_0", "Relu")),
            island(("Relu_4", "Relu"), ("sig", "Sigmoid")),
        ],
    }
    # Relu_0: no DQ in, one Q out. {Relu_4, sig}: the DQ at index 2 in, nothing out.
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 2,
        "crossings": 2,
        "per_island": [
            {"nodes": ["Relu_0"], "in_dequantize": 0, "out_quantize": 1},
            {"nodes": ["Relu_4", "sig"], "in_dequantize": 1, "out_quantize": 0},
        ],
    }


# --- boundary counting ------------------------------------------------------------------------


def test_dq_feeding_two_nodes_of_one_island_counts_once(tmp_path):
    path = save(
        tmp_path,
        [
            dq("dq", "xq", "xf"),
            node("Relu", ["xf"], ["r"], "a"),
            node("Add", ["xf", "r"], ["t"], "b"),
            q("q", "t", "y"),
        ],
        ["xq"],
        ["y"],
        QPARAMS,
    )
    # a feeds b (not a Q) -> float; b reads a -> float; one island {a, b}.
    # dq feeds both a and b but is one DQ -> in_dequantize 1; q -> out_quantize 1.
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 1,
        "crossings": 2,
        "per_island": [{"nodes": ["a", "b"], "in_dequantize": 1, "out_quantize": 1}],
    }


def test_dq_used_twice_by_one_node_counts_once(tmp_path):
    path = save(
        tmp_path,
        [dq("dq", "xq", "xf"), node("Mul", ["xf", "xf"], ["y"], "mul")],
        ["xq"],
        ["y"],
        QPARAMS,
    )
    # mul's output has no consumer node -> float; both of its inputs are the same DQ -> 1.
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 1,
        "crossings": 1,
        "per_island": [{"nodes": ["mul"], "in_dequantize": 1, "out_quantize": 0}],
    }


def test_island_reaching_only_a_graph_output_is_float_with_no_out_quantize(tmp_path):
    path = save(
        tmp_path,
        [dq("dq", "xq", "xf"), node("Relu", ["xf"], ["y"], "relu")],
        ["xq"],
        ["y"],
        QPARAMS,
    )
    # relu's input comes from a DQ, but its output has no consumer node -> not wrapped.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 1,
        "wrapped": 0,
        "float": 1,
        "island_count": 1,
        "islands": [island(("relu", "Relu"))],
    }
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 1,
        "crossings": 1,
        "per_island": [{"nodes": ["relu"], "in_dequantize": 1, "out_quantize": 0}],
    }


def test_output_that_is_also_a_graph_output_but_feeds_only_q_is_wrapped(tmp_path):
    path = save(
        tmp_path,
        [dq("dq", "xq", "xf"), node("Relu", ["xf"], ["r"], "relu"), q("q", "r", "y")],
        ["xq"],
        ["r", "y"],
        QPARAMS,
    )
    # A graph output is not a consumer: r's consumer set is {q}, non-empty and all Q -> wrapped.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 1,
        "wrapped": 1,
        "float": 0,
        "island_count": 0,
        "islands": [],
    }


def test_dq_shared_across_islands_counts_once_per_island(tmp_path):
    path = save(
        tmp_path,
        [
            dq("dq", "xq", "xf"),
            node("Relu", ["xf"], ["y1"], "a"),
            node("Tanh", ["xf"], ["t"], "b"),
            node("Abs", ["t"], ["u"], "c"),
            # One Q reading two tensors of island {b, c} (data from c, scale from b).
            node("QuantizeLinear", ["u", "t"], ["y2"], "q"),
        ],
        ["xq"],
        ["y1", "y2"],
        QPARAMS,
    )
    # a: output only a graph output -> float, alone (a and b meet only at a DQ).
    # b: t goes to c and q -> float; c reads b -> float. Island {b, c}.
    # dq feeds both islands: 1 each. q is one distinct Q for {b, c}. crossings = 1+0 + 1+1 = 3.
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 2,
        "crossings": 3,
        "per_island": [
            {"nodes": ["a"], "in_dequantize": 1, "out_quantize": 0},
            {"nodes": ["b", "c"], "in_dequantize": 1, "out_quantize": 1},
        ],
    }


# --- wrapped or float -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("compute", "outputs", "expected"),
    [
        pytest.param(
            node("Split", ["xf"], ["o0", "o1"], "n", num_outputs=2),
            ["y0"],
            [island(("n", "Split"))],
            id="split-second-output-unused",
        ),
        pytest.param(
            node("Split", ["xf"], ["o0", "o1"], "n", num_outputs=2),
            ["y0", "o1"],
            [island(("n", "Split"))],
            id="split-second-output-only-a-graph-output",
        ),
        pytest.param(
            node("TwoOut", ["xf"], ["o0", "o1"], "n", domain="com.example"),
            ["y0"],
            [island(("n", "TwoOut"))],
            id="custom-op-second-output-unused",
        ),
        pytest.param(
            # Control: the same Split with both outputs quantized is wrapped.
            node("Split", ["xf"], ["o0", "o1"], "n", num_outputs=2),
            ["y0", "y1"],
            [],
            id="split-both-outputs-to-q",
        ),
    ],
)
def test_node_with_an_unconsumed_output_is_not_wrapped(tmp_path, compute, outputs, expected):
    nodes = [dq("dq", "xq", "xf"), compute, q("q0", "o0", "y0")]
    if "y1" in outputs:
        nodes.append(q("q1", "o1", "y1"))
    path = save(tmp_path, nodes, ["xq"], outputs, QPARAMS)
    # Input from a DQ, o0 -> Q; o1 has no consumer node (unused or graph output only) -> float.
    float_count = len(expected)
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 1,
        "wrapped": 1 - float_count,
        "float": float_count,
        "island_count": float_count,
        "islands": expected,
    }


@pytest.mark.parametrize(
    ("extra_nodes", "inputs", "initializers", "wrapped"),
    [
        pytest.param([], ["xq"], [tensor("w")], False, id="float-initializer-weight"),
        pytest.param([], ["xq", "w"], [], False, id="graph-input-weight"),
        pytest.param(
            # Control: the same weight behind a DQ makes the MatMul wrapped.
            [dq("dq_w", "wq", "w")],
            ["xq"],
            [tensor("wq", np.int8)],
            True,
            id="dq-weight",
        ),
    ],
)
def test_node_reading_an_initializer_or_graph_input_is_float(tmp_path, extra_nodes, inputs, initializers, wrapped):
    path = save(
        tmp_path,
        [
            dq("dq_x", "xq", "xf"),
            *extra_nodes,
            node("MatMul", ["xf", "w"], ["m"], "mm"),
            q("q", "m", "y"),
        ],
        inputs,
        ["y"],
        [*QPARAMS, *initializers],
    )
    # w is an initializer / graph input, not made by a DQ -> mm float (one DQ in, one Q out).
    if wrapped:
        expected = {"compute": 1, "wrapped": 1, "float": 0, "island_count": 0, "islands": []}
        expected_boundary = NO_ISLANDS
    else:
        expected = {
            "compute": 1,
            "wrapped": 0,
            "float": 1,
            "island_count": 1,
            "islands": [island(("mm", "MatMul"))],
        }
        expected_boundary = {
            "island_count": 1,
            "crossings": 2,
            "per_island": [{"nodes": ["mm"], "in_dequantize": 1, "out_quantize": 1}],
        }
    assert graphscan.islands(path) == {"model": path, **expected}
    assert graphscan.boundary(path) == {"model": path, **expected_boundary}


def test_output_feeding_q_and_a_float_node_is_float_and_joins_its_island(tmp_path):
    path = save(
        tmp_path,
        [
            dq("dq", "xq", "xf"),
            node("Relu", ["xf"], ["r"], "relu"),
            q("q", "r", "y1"),
            node("Tanh", ["r"], ["y2"], "tanh"),
        ],
        ["xq"],
        ["y1", "y2"],
        QPARAMS,
    )
    # r's consumers are {q, tanh}: not all Q -> relu float; tanh reads relu -> same island.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 2,
        "wrapped": 0,
        "float": 2,
        "island_count": 1,
        "islands": [island(("relu", "Relu"), ("tanh", "Tanh"))],
    }
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 1,
        "crossings": 2,
        "per_island": [{"nodes": ["relu", "tanh"], "in_dequantize": 1, "out_quantize": 1}],
    }


@pytest.mark.parametrize(
    ("dq_domain", "q_domain"),
    [
        pytest.param("", "", id="onnx-domain"),
        pytest.param("com.microsoft", "com.microsoft", id="com-microsoft-domain"),
        pytest.param("com.microsoft", "", id="mixed-domains"),
    ],
)
def test_qdq_in_any_domain_count_as_qdq(tmp_path, dq_domain, q_domain):
    path = save(
        tmp_path,
        [
            dq("dq_x", "xq", "xf", dq_domain),
            dq("dq_w", "wq", "wf", dq_domain),
            node("MatMul", ["xf", "wf"], ["m"], "mm"),
            q("q", "m", "mq", q_domain),
            dq("dq_m", "mq", "y", dq_domain),
        ],
        ["xq"],
        ["y"],
        [*QPARAMS, tensor("wq", np.int8)],
    )
    # 1 Q, 3 DQ; q feeds only dq_m -> 1 round trip; dq_w reads initializer wq -> 1 weight DQ.
    assert graphscan.qdq(path) == {
        "model": path,
        "quantize": 1,
        "dequantize": 3,
        "round_trips": 1,
        "weight_dequantize": 1,
    }
    # mm: both inputs from DQs, output only to a Q -> wrapped; no float node at all.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 1,
        "wrapped": 1,
        "float": 0,
        "island_count": 0,
        "islands": [],
    }
    assert graphscan.boundary(path) == {"model": path, **NO_ISLANDS}


# --- absent optional inputs and outputs -------------------------------------------------------


@pytest.mark.parametrize(
    ("compute_nodes", "initializers"),
    [
        pytest.param(
            [
                node("DequantizeLinear", ["scq", "s", ""], ["scf"], "dq_sc"),
                node("Resize", ["xf", "", "scf"], ["r"], "n"),
            ],
            [tensor("scq", np.int8, (4,))],
            id="resize-empty-roi-dq-empty-zero-point",
        ),
        pytest.param([node("Clip", ["xf", "", ""], ["r"], "n")], [], id="clip-empty-min-and-max"),
        pytest.param([node("Dropout", ["xf"], ["r", ""], "n")], [], id="dropout-empty-mask-output"),
    ],
)
def test_absent_optional_inputs_and_outputs_are_ignored(tmp_path, compute_nodes, initializers):
    path = save(
        tmp_path,
        [
            node("DequantizeLinear", ["xq", "s", ""], ["xf"], "dq_x"),
            *compute_nodes,
            node("QuantizeLinear", ["r", "s", ""], ["y"], "q"),
        ],
        ["xq"],
        ["y"],
        [*QPARAMS, *initializers],
    )
    # n's only non-empty inputs come from DQs and its only non-empty output goes to q -> wrapped.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 1,
        "wrapped": 1,
        "float": 0,
        "island_count": 0,
        "islands": [],
    }


def test_empty_tensor_name_never_links_two_nodes(tmp_path):
    path = save(
        tmp_path,
        [
            dq("dq", "xq", "xf"),
            node("Dropout", ["xf"], ["d", ""], "drop"),  # "produces" the empty name
            node("Clip", ["xf", "", ""], ["c"], "clip"),  # "reads" the empty name
            q("q", "c", "y2"),
        ],
        ["xq"],
        ["d", "y2"],
        QPARAMS,
    )
    # "" is no tensor: clip's inputs are just xf (a DQ) and c goes to q -> wrapped.
    # drop's output d only reaches a graph output -> float, alone.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 2,
        "wrapped": 1,
        "float": 1,
        "island_count": 1,
        "islands": [island(("drop", "Dropout"))],
    }


# --- Constant nodes ---------------------------------------------------------------------------

CONSTANT = node("Constant", [], ["c"], "const", value=tensor("cv"))


def test_constant_feeding_only_q_is_wrapped(tmp_path):
    path = save(tmp_path, [CONSTANT, q("q", "c", "y")], [], ["y"], QPARAMS)
    # No inputs: "every non-empty input is produced by a DQ" is vacuously true; c -> only q.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 1,
        "wrapped": 1,
        "float": 0,
        "island_count": 0,
        "islands": [],
    }


def test_constant_feeding_a_float_node_joins_its_island(tmp_path):
    path = save(
        tmp_path,
        [dq("dq", "xq", "xf"), CONSTANT, node("Add", ["xf", "c"], ["a"], "add"), q("q", "a", "y")],
        ["xq"],
        ["y"],
        QPARAMS,
    )
    # const feeds add (not a Q) -> float; add reads const (not a DQ) -> float; linked by c.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 2,
        "wrapped": 0,
        "float": 2,
        "island_count": 1,
        "islands": [island(("add", "Add"), ("const", "Constant"))],
    }
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 1,
        "crossings": 2,
        "per_island": [{"nodes": ["add", "const"], "in_dequantize": 1, "out_quantize": 1}],
    }


# --- island shape and order -------------------------------------------------------------------


def test_islands_sorted_by_smallest_node_name_with_sorted_members(tmp_path):
    path = save(
        tmp_path,
        [
            # Five islands, each reading graph input x (which connects nothing), scrambled.
            node("Neg", ["x"], ["o4"], "a"),
            node("Relu", ["x"], ["o2"], "n2"),
            node("Relu", ["x"], ["t"], "zeta"),
            node("Tanh", ["t"], ["u"], "mu"),
            node("Relu", ["u"], ["o5"], "eta"),
            node("Relu", ["x"], ["o1"], "n10"),
            node("Abs", ["x"], ["o3"], "B"),
        ],
        ["x"],
        ["o1", "o2", "o3", "o4", "o5"],
    )
    # Plain string sort: "B" < "a" < "eta" < "n10" < "n2". The chain island is listed by its
    # smallest name "eta" (not "zeta", its first node in the graph); its op_types in node order
    # would be Relu, Tanh, Relu, sorted they are Relu, Relu, Tanh.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 7,
        "wrapped": 0,
        "float": 7,
        "island_count": 5,
        "islands": [
            {"nodes": ["B"], "size": 1, "op_types": ["Abs"]},
            {"nodes": ["a"], "size": 1, "op_types": ["Neg"]},
            {"nodes": ["eta", "mu", "zeta"], "size": 3, "op_types": ["Relu", "Relu", "Tanh"]},
            {"nodes": ["n10"], "size": 1, "op_types": ["Relu"]},
            {"nodes": ["n2"], "size": 1, "op_types": ["Relu"]},
        ],
    }
    # boundary lists the islands in the same order; nothing crosses a Q/DQ here.
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 5,
        "crossings": 0,
        "per_island": [
            {"nodes": names, "in_dequantize": 0, "out_quantize": 0}
            for names in [["B"], ["a"], ["eta", "mu", "zeta"], ["n10"], ["n2"]]
        ],
    }


def test_diamond_of_float_nodes_is_one_island(tmp_path):
    path = save(
        tmp_path,
        [
            dq("dq", "xq", "xf"),
            node("Relu", ["xf"], ["t"], "top"),
            node("Tanh", ["t"], ["l"], "left"),
            node("Sigmoid", ["t"], ["r"], "right"),
            node("Add", ["l", "r"], ["j"], "join"),
            q("q", "j", "y"),
        ],
        ["xq"],
        ["y"],
        QPARAMS,
    )
    # top feeds two non-Q nodes, left/right/join read float nodes -> all four float, connected.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 4,
        "wrapped": 0,
        "float": 4,
        "island_count": 1,
        "islands": [
            {
                "nodes": ["join", "left", "right", "top"],
                "size": 4,
                "op_types": ["Add", "Relu", "Sigmoid", "Tanh"],
            }
        ],
    }
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 1,
        "crossings": 2,
        "per_island": [{"nodes": ["join", "left", "right", "top"], "in_dequantize": 1, "out_quantize": 1}],
    }


def test_float_nodes_separated_by_a_q_dq_pair_are_two_islands(tmp_path):
    path = save(
        tmp_path,
        [
            node("Relu", ["x"], ["a1"], "a"),
            q("qa", "a1", "aq"),
            dq("dqa", "aq", "a2"),
            node("Tanh", ["a2"], ["y"], "c"),
        ],
        ["x"],
        ["y"],
        QPARAMS,
    )
    # a reads a graph input -> float; c's output only reaches a graph output -> float.
    # Their only path passes through qa/dqa -> two islands.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 2,
        "wrapped": 0,
        "float": 2,
        "island_count": 2,
        "islands": [island(("a", "Relu")), island(("c", "Tanh"))],
    }
    assert graphscan.boundary(path) == {
        "model": path,
        "island_count": 2,
        "crossings": 2,
        "per_island": [
            {"nodes": ["a"], "in_dequantize": 0, "out_quantize": 1},
            {"nodes": ["c"], "in_dequantize": 1, "out_quantize": 0},
        ],
    }


def test_graph_inputs_and_initializers_connect_no_nodes_but_a_graph_output_tensor_does(tmp_path):
    path = save(
        tmp_path,
        [
            node("Relu", ["x"], ["y1"], "a"),
            node("Tanh", ["x"], ["y2"], "b"),  # shares graph input x with a
            node("Add", ["x", "w"], ["y3"], "d"),
            node("Mul", ["x", "w"], ["y4"], "e"),  # shares initializer w with d
            node("Neg", ["x"], ["fo"], "f"),
            node("Abs", ["fo"], ["y5"], "g"),  # reads f's output, which is also a graph output
        ],
        ["x"],
        ["y1", "y2", "y3", "y4", "y5", "fo"],
        [tensor("w")],
    )
    # Only f -> g is a node-to-node tensor, so {f, g} is the one island of two; the rest are alone.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 6,
        "wrapped": 0,
        "float": 6,
        "island_count": 5,
        "islands": [
            island(("a", "Relu")),
            island(("b", "Tanh")),
            island(("d", "Add")),
            island(("e", "Mul")),
            island(("f", "Neg"), ("g", "Abs")),
        ],
    }


# --- qdq --------------------------------------------------------------------------------------


def test_round_trip_needs_a_consumer_and_only_dq_consumers(tmp_path):
    path = save(
        tmp_path,
        [
            dq("dq_x", "xq", "xf"),  # first input is a graph input: not a weight DQ
            dq("dq_w", "wq", "wf"),  # first input is an initializer: weight DQ
            node("MatMul", ["xf", "wf"], ["m"], "mm"),
            q("q_single", "m", "mq"),  # -> dq_single only: round trip
            dq("dq_single", "mq", "m1"),  # first input made by a node: not a weight DQ
            q("q_fan", "m1", "fq"),  # -> dq_fan_a and dq_fan_b: round trip
            dq("dq_fan_a", "fq", "fa"),
            dq("dq_fan_b", "fq", "fb"),
            node("Add", ["fa", "fb"], ["a"], "add"),
            q("q_mixed", "a", "aq"),  # -> dq_mixed and ident: not a round trip
            dq("dq_mixed", "aq", "y1"),
            node("Identity", ["aq"], ["y2"], "ident"),
            q("q_dangling", "a", "y3"),  # graph output only, no consumer: not a round trip
        ],
        ["xq"],
        ["y1", "y2", "y3"],
        [*QPARAMS, tensor("wq", np.int8)],
    )
    assert graphscan.qdq(path) == {
        "model": path,
        "quantize": 4,
        "dequantize": 6,
        "round_trips": 2,
        "weight_dequantize": 1,
    }


# --- nodes and scope --------------------------------------------------------------------------


def test_nodes_counts_op_types_and_initializer_dtype_names(tmp_path):
    path = save(
        tmp_path,
        [
            dq("dq", "xq", "xf"),
            node("MatMul", ["xf", "w"], ["m"], "mm"),
            node("Add", ["m", "bias"], ["a"], "add"),
            node("Relu", ["a"], ["r1"], "relu1"),
            node("Relu", ["r1"], ["r2"], "relu2"),
            node("TwoOut", ["r2"], ["y", "z"], "custom", domain="com.example"),
        ],
        ["xq"],
        ["y"],
        [
            *QPARAMS,  # s: FLOAT, zp: INT8
            tensor("w"),
            tensor("bias", np.float32, (2,)),
            tensor("u8", np.uint8),
            tensor("i32", np.int32),
            tensor("i64", np.int64),
            tensor("half", np.float16),
        ],
    )
    # Six nodes; Relu twice; the custom op is keyed by its op_type alone.
    # Initializers by DataType.Name: s, w, bias FLOAT; zp INT8; one each UINT8/INT32/INT64/FLOAT16.
    assert graphscan.nodes(path) == {
        "model": path,
        "nodes": 6,
        "op_types": {"DequantizeLinear": 1, "MatMul": 1, "Add": 1, "Relu": 2, "TwoOut": 1},
        "initializers": {
            "FLOAT": 3,
            "INT8": 1,
            "UINT8": 1,
            "INT32": 1,
            "INT64": 1,
            "FLOAT16": 1,
        },
    }


def test_only_the_top_level_graph_is_counted(tmp_path):
    then_branch = helper.make_graph(
        [
            dq("sub_dq", "sub_wq", "t1"),
            node("Relu", ["t1"], ["t2"], "sub_relu"),
            q("sub_q", "t2", "t_out"),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("t_out", TensorProto.INT8, None)],
        initializer=[tensor("sub_wq", np.int8), *QPARAMS],
    )
    else_branch = helper.make_graph(
        [node("Identity", ["sub_e"], ["e_out"], "sub_ident")],
        "else",
        [],
        [helper.make_tensor_value_info("e_out", TensorProto.INT8, None)],
        initializer=[tensor("sub_e", np.int8)],
    )
    path = save(
        tmp_path,
        [node("If", ["cond"], ["y"], "if", then_branch=then_branch, else_branch=else_branch)],
        ["cond"],
        ["y"],
    )
    # Only model.graph counts: one If node, no initializers, no Q/DQ.
    assert graphscan.nodes(path) == {
        "model": path,
        "nodes": 1,
        "op_types": {"If": 1},
        "initializers": {},
    }
    assert graphscan.qdq(path) == {
        "model": path,
        "quantize": 0,
        "dequantize": 0,
        "round_trips": 0,
        "weight_dequantize": 0,
    }
    # The If reads a graph input -> float, an island of one.
    assert graphscan.islands(path) == {
        "model": path,
        "compute": 1,
        "wrapped": 0,
        "float": 1,
        "island_count": 1,
        "islands": [island(("if", "If"))],
    }


# --- diff -------------------------------------------------------------------------------------


def float_tail_model(tmp_path):
    """a: MatMul on a float weight keeps MatMul -> Relu -> Sigmoid in one float island."""
    return save(
        tmp_path,
        [
            dq("dq_x", "xq", "xf"),
            node("MatMul", ["xf", "w"], ["m"], "mm"),
            node("Relu", ["m"], ["r"], "relu"),
            node("Sigmoid", ["r"], ["s_out"], "sig"),
            q("q", "s_out", "y"),
        ],
        ["xq"],
        ["y"],
        [*QPARAMS, tensor("w")],
        "a.onnx",
    )


def fully_wrapped_model(tmp_path):
    """b: every compute node between a DQ and a Q, with Tanh where a has Sigmoid."""
    return save(
        tmp_path,
        [
            dq("dq_x", "xq", "xf"),
            dq("dq_w", "wq", "wf"),
            node("MatMul", ["xf", "wf"], ["m"], "mm"),
            q("q_m", "m", "mq"),
            dq("dq_m", "mq", "m2"),
            node("Relu", ["m2"], ["r"], "relu"),
            q("q_r", "r", "rq"),
            dq("dq_r", "rq", "r2"),
            node("Tanh", ["r2"], ["t"], "tanh"),
            q("q", "t", "y"),
        ],
        ["xq"],
        ["y"],
        [*QPARAMS, tensor("wq", np.int8)],
        "b.onnx",
    )


def test_diff_is_b_minus_a_with_only_nonzero_op_delta(tmp_path):
    a, b = float_tail_model(tmp_path), fully_wrapped_model(tmp_path)
    # a: DQ 1, Q 1, MatMul 1, Relu 1, Sigmoid 1; round trips 0; one island of 3 float nodes.
    # b: DQ 4, Q 3, MatMul 1, Relu 1, Tanh 1; round trips 2 (q_m, q_r); all wrapped, 0 islands.
    # MatMul and Relu do not change, so they are left out of op_delta.
    assert graphscan.diff(a, b) == {
        "a": a,
        "b": b,
        "op_delta": {"DequantizeLinear": 3, "QuantizeLinear": 2, "Sigmoid": -1, "Tanh": 1},
        "quantize_delta": 2,
        "dequantize_delta": 3,
        "round_trip_delta": 2,
        "island_delta": -1,
        "float_delta": -3,
    }
    # Swapping the arguments negates every delta.
    assert graphscan.diff(b, a) == {
        "a": b,
        "b": a,
        "op_delta": {"DequantizeLinear": -3, "QuantizeLinear": -2, "Sigmoid": 1, "Tanh": -1},
        "quantize_delta": -2,
        "dequantize_delta": -3,
        "round_trip_delta": -2,
        "island_delta": 1,
        "float_delta": 3,
    }


def test_diff_of_a_model_with_itself_is_all_zero(tmp_path):
    a = float_tail_model(tmp_path)
    assert graphscan.diff(a, a) == {
        "a": a,
        "b": a,
        "op_delta": {},
        "quantize_delta": 0,
        "dequantize_delta": 0,
        "round_trip_delta": 0,
        "island_delta": 0,
        "float_delta": 0,
    }
