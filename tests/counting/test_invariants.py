"""Laws that must hold on every lab case and every quantized variant.

Each test runs over all of tests/lab.py CASES (layers 3/4/6, 2-D and 3-D inputs,
a MatMul or an Add excluded), so a rule tuned to one shape fails here.
"""

import onnx
import pytest

import graphscan
from tests.helpers import DELTA_KEYS, SINGLE_MODEL_COMMANDS, laws_broken, negated
from tests.lab import QDQ_VARIANTS, VARIANTS
from tests.reference import reference_diff, reference_of


@pytest.mark.parametrize("variant", QDQ_VARIANTS)
def test_activation_dequantize_equals_round_trips(variants, variant):
    # onnxruntime wraps every quantized activation in one Q->DQ pair and stores
    # weights already quantized, so the DQs that are not weights are the round trips.
    answer = graphscan.qdq(str(variants[variant]))
    assert answer["round_trips"] > 0
    assert answer["dequantize"] - answer["weight_dequantize"] == answer["round_trips"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_laws_hold(variants, variant):
    """wrapped + float == compute, sum(sizes) == float, crossings == sum(per_island), ..."""
    path = str(variants[variant])
    answers = {command: getattr(graphscan, command)(path) for command in SINGLE_MODEL_COMMANDS}
    assert laws_broken(answers) == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_answers_equal_the_brute_force_reference(variants, variant):
    path = str(variants[variant])
    expected = reference_of(path)
    for command in SINGLE_MODEL_COMMANDS:
        assert getattr(graphscan, command)(path) == {"model": path, **expected[command]}, command


def test_fp32_is_one_float_island(variants, case):
    answer = graphscan.islands(str(variants["fp32"]))
    assert answer["wrapped"] == 0
    assert answer["float"] == 3 * case.layers
    assert answer["island_count"] == 1
    assert graphscan.boundary(str(variants["fp32"]))["crossings"] == 0


def test_full_wraps_every_compute_node(variants):
    # Static QDQ with no scope option wraps MatMul and Add (Relu is absorbed).
    answer = graphscan.islands(str(variants["full"]))
    assert answer["float"] == 0
    assert answer["island_count"] == 0
    assert "Relu" not in graphscan.nodes(str(variants["full"]))["op_types"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_diff_with_itself_is_zero(variants, variant):
    path = str(variants[variant])
    assert graphscan.diff(path, path) == {"a": path, "b": path, "op_delta": {}, **dict.fromkeys(DELTA_KEYS, 0)}


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param("full", "matmul_only", id="full-vs-matmul_only"),
        pytest.param("full", "excluded", id="full-vs-excluded"),
        pytest.param("fp32", "full", id="fp32-vs-full"),
        pytest.param("matmul_only", "dynamic", id="matmul_only-vs-dynamic"),
    ],
)
def test_diff_is_antisymmetric(variants, a, b):
    forward = graphscan.diff(str(variants[a]), str(variants[b]))
    backward = graphscan.diff(str(variants[b]), str(variants[a]))
    assert forward["op_delta"] != {}
    assert backward == negated(forward)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        pytest.param("full", "matmul_only", id="full-vs-matmul_only"),
        pytest.param("fp32", "excluded", id="fp32-vs-excluded"),
        pytest.param("excluded", "dynamic", id="excluded-vs-dynamic"),
    ],
)
def test_diff_deltas_are_b_minus_a(variants, a, b):
    """Against the brute-force reference, which shares no counting code with diff."""
    a, b = str(variants[a]), str(variants[b])
    expected = reference_diff(reference_of(a), reference_of(b))
    assert graphscan.diff(a, b) == {"a": a, "b": b, **expected}
    assert any(expected[key] for key in DELTA_KEYS)  # the two really differ


def test_matmul_only_leaves_one_island_per_layer(variants, case):
    answer = graphscan.islands(str(variants["matmul_only"]))
    assert answer["island_count"] == case.layers
    float_nodes = {name for island in answer["islands"] for name in island["nodes"]}
    census = graphscan.nodes(str(variants["matmul_only"]))["op_types"]
    adds = [f"fc{layer}_add" for layer in range(1, case.layers + 1)]
    assert census["Add"] == case.layers
    assert set(adds) <= float_nodes
    assert not any(name.endswith("_matmul") for name in float_nodes)


def test_excluded_node_stays_float_with_float_weight(variants, case):
    answer = graphscan.islands(str(variants["excluded"]))
    float_nodes = {name for island in answer["islands"] for name in island["nodes"]}
    assert case.exclude in float_nodes

    model = onnx.load(str(variants["excluded"]))
    (node,) = [n for n in model.graph.node if n.name == case.exclude]
    initializers = {init.name: init for init in model.graph.initializer}
    # The excluded node's own parameter (weight or bias) is read straight from
    # a FLOAT initializer, not through a DequantizeLinear.
    parameters = [initializers[name] for name in node.input if name in initializers]
    assert parameters, f"{case.exclude} reads no initializer directly"
    assert all(p.data_type == onnx.TensorProto.FLOAT for p in parameters)


def test_dynamic_has_integer_matmul_and_no_qdq(variants, case):
    census = graphscan.nodes(str(variants["dynamic"]))["op_types"]
    assert census.get("MatMulInteger") == case.layers
    assert census.get("DynamicQuantizeLinear", 0) > 0
    assert "QuantizeLinear" not in census
    assert "DequantizeLinear" not in census
    answer = graphscan.qdq(str(variants["dynamic"]))
    assert (answer["quantize"], answer["dequantize"], answer["round_trips"]) == (0, 0, 0)


@pytest.mark.parametrize("variant", QDQ_VARIANTS)
def test_the_chains_mirror_each_other(variants, variant):
    """Where a Q->DQ pair follows a compute output, the tensor the next op sees leads back
    through that same pair to it: output_chain and input_chain are one vocabulary's two ends."""
    model = onnx.load(str(variants[variant]))
    index = graphscan.GraphIndex(model.graph)
    pairs = 0
    for i in index.compute_nodes:
        for tensor in index.outputs[i]:
            chain, seen = graphscan.output_chain(index, model.graph, tensor)
            source, back = graphscan.data_source(index, model.graph, seen)
            if chain:
                pairs += 1
                assert [index.op_types[j] for j in chain] == ["QuantizeLinear", "DequantizeLinear"]
                assert (source, back) == (tensor, chain)
            else:
                assert seen == tensor
    assert pairs > 0
