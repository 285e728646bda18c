"""Models with If / Loop / Scan: counted at the top level, traced without crashing."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphscan
import graphscan_ort.engines.trace as trace_engine
from tests.helpers import run_onnx

FLOAT4 = [1, 4]


def constant_branch(op_type, outer, name):
    """A branch applying ``op_type`` to an outer-scope tensor and a constant."""
    constant = numpy_helper.from_array(np.full(4, 0.5, np.float32), f"{name}_c")
    return helper.make_graph(
        [helper.make_node(op_type, [outer, constant.name], [f"{name}_out"], name=f"{name}_node")],
        name,
        [],
        [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, FLOAT4)],
        [constant],
    )


def loop_body():
    """Adds one to a running value, as many times as the trip count says."""
    one = numpy_helper.from_array(np.ones(FLOAT4, np.float32), "one")
    return helper.make_graph(
        [
            helper.make_node("Add", ["v_in", "one"], ["v_out"], name="body_add"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond"),
        ],
        "loop_body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", TensorProto.FLOAT, FLOAT4),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", TensorProto.FLOAT, FLOAT4),
        ],
        [one],
    )


def scan_body():
    """Running sum over the rows of its scan input."""
    return helper.make_graph(
        [
            helper.make_node("Add", ["sum_in", "row"], ["sum_out"], name="scan_add"),
            helper.make_node("Identity", ["sum_out"], ["row_out"], name="scan_copy"),
        ],
        "scan_body",
        [
            helper.make_tensor_value_info("sum_in", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("row", TensorProto.FLOAT, [4]),
        ],
        [
            helper.make_tensor_value_info("sum_out", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("row_out", TensorProto.FLOAT, [4]),
        ],
    )


def control_flow_model(quantized):
    """x -> Relu -> If -> Loop -> Scan -> Sigmoid; the quantized twin wraps x and
    the Relu output in Q->DQ, and the If branches read the DQ output from outside."""
    qparams = [
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
    ]

    def qdq(tensor):
        return [
            helper.make_node("QuantizeLinear", [tensor, "s", "z"], [f"{tensor}_q"], name=f"{tensor}_quantize"),
            helper.make_node(
                "DequantizeLinear", [f"{tensor}_q", "s", "z"], [f"{tensor}_dq"], name=f"{tensor}_dequantize"
            ),
        ], f"{tensor}_dq"

    nodes, relu_input = [], "x"
    if quantized:
        chain, relu_input = qdq("x")
        nodes += chain
    nodes.append(helper.make_node("Relu", [relu_input], ["r"], name="relu"))
    branch_input = "r"
    if quantized:
        chain, branch_input = qdq("r")
        nodes += chain
    nodes += [
        helper.make_node(
            "If",
            ["cond"],
            ["chosen"],
            name="choose",
            then_branch=constant_branch("Add", branch_input, "then"),
            else_branch=constant_branch("Sub", branch_input, "else"),
        ),
        helper.make_node("Loop", ["trips", "", "chosen"], ["looped"], name="repeat", body=loop_body()),
        helper.make_node(
            "Scan",
            ["zeros", "looped"],
            ["total", "rows"],
            name="running_sum",
            body=scan_body(),
            num_scan_inputs=1,
        ),  # "total" is an unused output
        helper.make_node("Sigmoid", ["rows"], ["y"], name="squash"),
    ]
    graph = helper.make_graph(
        nodes,
        "control_flow",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, FLOAT4),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, FLOAT4)],
        qparams
        + [
            numpy_helper.from_array(np.array(3, np.int64), "trips"),
            numpy_helper.from_array(np.zeros(4, np.float32), "zeros"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("control_flow")
    paths = {}
    for name, quantized in [("float", False), ("quant", True)]:
        paths[name] = str(folder / f"{name}.onnx")
        onnx.save(control_flow_model(quantized), paths[name])
    return paths


def test_only_the_top_level_is_counted(pair):
    census = graphscan.nodes(pair["quant"])
    assert census["nodes"] == 9  # 4 Q/DQ + Relu, If, Loop, Scan, Sigmoid; bodies not counted
    assert census["op_types"] == {
        "DequantizeLinear": 2,
        "If": 1,
        "Loop": 1,
        "QuantizeLinear": 2,
        "Relu": 1,
        "Scan": 1,
        "Sigmoid": 1,
    }
    # Relu: DQ in, only Q out -> wrapped. If reads the graph input cond -> float;
    # If, Loop, Scan, Sigmoid chain directly -> one island (Scan's unused output
    # alone would already make it float).
    assert graphscan.islands(pair["quant"])["islands"] == [
        {
            "nodes": ["choose", "repeat", "running_sum", "squash"],
            "size": 4,
            "op_types": ["If", "Loop", "Scan", "Sigmoid"],
        },
    ]
    boundary = graphscan.boundary(pair["quant"])
    # The If branches read r_dq from inside their bodies: not a top-level edge.
    assert boundary["per_island"][0]["in_dequantize"] == 0
    assert boundary["crossings"] == 0


def test_trace_compares_outputs_and_lists_subgraph_nodes(pair, tmp_path):
    feeds = {"x": np.array([[0.3, -1.2, 0.77, 2.01]], np.float32), "cond": np.array(True)}
    np.savez(tmp_path / "inputs.npz", **feeds)
    saved = tmp_path / "saved"
    answer = graphscan.trace(pair["float"], pair["quant"], inputs=str(tmp_path / "inputs.npz"), save=str(saved))
    rows = {row["node"]: row for row in answer["ops"]}
    assert list(rows) == ["relu", "choose", "repeat", "running_sum", "squash"]
    for name in ["choose", "repeat", "running_sum"]:
        assert rows[name]["isolated_max_abs"] is None  # no single-op model
        assert rows[name]["propagated_max_abs"] is not None
    assert rows["squash"]["isolated_max_abs"] == 0.0  # float op on float inputs
    assert rows["relu"]["isolated_max_abs"] > 0.0
    assert [(u["node"], u["reason"]) for u in answer["unmatched"]] == [
        (name, trace_engine.REASON_SUBGRAPH) for name in ["choose", "repeat", "running_sum"]
    ]
    assert sorted(p.name for p in saved.iterdir()) == [
        "index.json",
        "relu.npz",
        "relu.onnx",
        "squash.npz",
        "squash.onnx",
    ]
    # The final error, from onnxruntime run directly on both models.
    (expected,), (actual,) = run_onnx(pair["float"], feeds), run_onnx(pair["quant"], feeds)
    direct = float(np.max(np.abs(expected.astype(np.float64) - actual)))
    assert direct > 0  # x is not on the 0.02 grid, so quantization shows
    assert answer["outputs"]["y"] == pytest.approx(direct, rel=1e-9)
    assert rows["squash"]["propagated_max_abs"] == pytest.approx(direct, rel=1e-9)
