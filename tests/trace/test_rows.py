"""trace: inputs that kill the mutants the first mutation campaign left alive.

Each test names the hole it closes (issue 12). Expectations come from the
models' own initializers read with onnx, from numpy, or from hand derivation;
never from another trace answer.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.engines.trace as trace_engine
from tests.helpers import (
    error_line,
    json_answer,
    mlp_with_weights_beside,
    run_graphscan,
    run_onnx,
    saved_arrays,
    with_external_weights,
)
from tests.lab import TRACE_LAB

OPSET = [helper.make_opsetid("", 17)]


@pytest.fixture(scope="module")
def traced(trace_lab):
    """trace(fp32, variant) with the default seeded input, per static variant."""
    return {variant: graphscan.trace(trace_lab["fp32"], trace_lab[variant]) for variant in ["full", "matmul_only"]}


def save(path, nodes, inputs, outputs, initializers=()):
    """A float model of ``nodes``; ``inputs``/``outputs`` are ``{name: shape}``."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=OPSET)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return str(path)


def output_q_scales(path):
    """``{compute node name: scale}`` of the Q reading its first output, from the
    model's own initializers (only nodes whose output goes to one Q)."""
    model = onnx.load(path)
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    scales = {}
    for node in model.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or not node.output:
            continue
        readers = [n for n in model.graph.node if node.output[0] in n.input]
        if len(readers) == 1 and readers[0].op_type == "QuantizeLinear":
            scales[node.name] = float(values[readers[0].input[1]].reshape(-1)[0])
    return scales


# --------------------------------------------------------------------------
# isolated_lsb is the isolated error in units of the output Q's scale, on every row


@pytest.mark.parametrize("variant", ["full", "matmul_only"])
def test_isolated_lsb_is_isolated_error_over_the_output_scale_on_every_row(trace_lab, traced, variant):
    answer, scales = traced[variant], output_q_scales(trace_lab[variant])
    differing = 0
    for row in answer["ops"]:
        if row["node"] in scales:
            expected = row["isolated_max_abs"] / scales[row["node"]]
            assert row["isolated_lsb"] == pytest.approx(expected, rel=1e-12), row["node"]
        else:  # no output Q: there is no LSB to count in
            assert row["isolated_lsb"] is None, row["node"]
        differing += row["isolated_max_abs"] != row["propagated_max_abs"]
    # Rows after the first carry inherited error: the two measures really differ there.
    assert differing >= 3
    assert any(row["isolated_lsb"] is not None for row in answer["ops"])


# --------------------------------------------------------------------------
# worst_isolated, first_over and the default input size


def test_trace_of_a_model_with_itself_names_the_first_row_worst(trace_lab):
    """Every isolated error is 0.0: a tie, and the first row wins it."""
    answer = graphscan.trace(trace_lab["full"], trace_lab["full"])
    assert answer["worst_isolated"] == {"node": "fc1_matmul", "max_abs": 0.0}


def test_zero_tolerance_on_identical_models_is_null(trace_lab):
    """0.0 is not over a tolerance of 0: first_over compares with >, not >=."""
    assert graphscan.trace(trace_lab["fp32"], trace_lab["fp32"], tolerance=0.0)["first_over"] is None


def test_tolerance_equal_to_an_error_is_not_over_it(trace_lab, traced):
    """fc1_matmul has the largest isolated error of full.onnx (its input and its weight
    are both rounded); at exactly that tolerance no row is over."""
    worst = traced["full"]["worst_isolated"]
    assert worst["node"] == "fc1_matmul"
    answer = graphscan.trace(trace_lab["fp32"], trace_lab["full"], tolerance=worst["max_abs"])
    assert answer["first_over"] is None
    below = graphscan.trace(trace_lab["fp32"], trace_lab["full"], tolerance=np.nextafter(worst["max_abs"], 0))
    assert below["first_over"] == worst


def test_worst_and_first_over_pick_the_first_of_equal_rows():
    rows = [
        {"node": "a", "isolated_max_abs": None},
        {"node": "b", "isolated_max_abs": 0.5},
        {"node": "c", "isolated_max_abs": 0.5},
        {"node": "d", "isolated_max_abs": 0.25},
    ]
    assert trace_engine.worst_isolated(rows) == {"node": "b", "max_abs": 0.5}
    assert trace_engine.first_over(rows, 0.25) == {"node": "b", "max_abs": 0.5}
    assert trace_engine.first_over(rows, 0.5) is None
    assert trace_engine.worst_isolated(rows[:1]) is None


def test_default_input_gives_symbolic_dimensions_size_1(trace_lab, traced):
    """Without --inputs, the batch dimension N of x [N, 16] is 1."""
    assert traced["full"]["inputs"] == {"x": [1, TRACE_LAB.dim]}


# --------------------------------------------------------------------------
# Matching quantized tensors to float ones


QDQ_SUFFIXES = [
    "_QuantizeLinear_Input",
    "_QuantizeLinear_Output",
    "_DequantizeLinear_Output",
    "_DequantizeLinear_Output_1",
    "_QuantizeLinear_Output_12",
]


@pytest.mark.parametrize("suffix", QDQ_SUFFIXES)
def test_ort_qdq_suffix_maps_back_to_the_float_tensor(tmp_path, suffix):
    """A renamed node whose output carries one of ORT's suffixes: only the name can match it."""
    a = save(
        tmp_path / "a.onnx",
        [helper.make_node("Relu", ["x"], ["t"], name="r1"), helper.make_node("Neg", ["t"], ["y"], name="n1")],
        {"x": [1, 4]},
        {"y": [1, 4]},
    )
    renamed = f"t{suffix}"
    b = save(
        tmp_path / "b.onnx",
        [
            helper.make_node("Relu", ["x"], [renamed], name="other"),
            helper.make_node("Neg", [renamed], ["y"], name="n1"),
        ],
        {"x": [1, 4]},
        {"y": [1, 4]},
    )
    answer = graphscan.trace(a, b)
    rows = {row["node"]: row for row in answer["ops"]}
    assert rows["other"]["reference"] == "t"
    assert rows["other"]["isolated_max_abs"] == 0.0
    assert rows["n1"]["isolated_max_abs"] == 0.0  # fed the float t
    assert answer["unmatched"] == []  # r1's output is compared with a Relu: matched


def test_split_with_renamed_outputs_matches_output_by_position(tmp_path):
    """Split "sp" keeps its name but its outputs are renamed: output k is the float output k."""

    def model(path, first, second):
        return save(
            path,
            [
                helper.make_node("Split", ["x"], [first, second], name="sp", axis=1),
                helper.make_node("Relu", [first], ["ya"], name="ra"),
                helper.make_node("Neg", [second], ["yb"], name="nb"),
            ],
            {"x": [1, 4]},
            {"ya": [1, 2], "yb": [1, 2]},
        )

    a = model(tmp_path / "a.onnx", "a", "b")
    b = model(tmp_path / "b.onnx", "first_half", "second_half")
    x = np.array([[1.0, -2.0, 3.0, -4.0]], np.float32)  # halves differ, so a mix-up shows
    np.savez(tmp_path / "x.npz", x=x)
    answer = graphscan.trace(a, b, inputs=str(tmp_path / "x.npz"))
    rows = {row["node"]: row for row in answer["ops"]}
    assert rows["sp"]["reference"] == "a"
    assert rows["nb"]["reference"] == "yb"
    for name in ["ra", "nb"]:
        assert rows[name]["isolated_max_abs"] == 0.0, name
        assert rows[name]["propagated_max_abs"] == 0.0, name


# --------------------------------------------------------------------------
# Rows and unmatched nodes


@pytest.mark.parametrize("variant", ["full", "matmul_only"])
def test_rows_tell_wrapped_from_float(traced, variant):
    """full.onnx wraps every MatMul and Add; matmul_only.onnx only the MatMuls (each Add
    reads its float bias initializer directly, each Relu reads a float Add)."""
    rows = traced[variant]["ops"]
    expected = {
        "full": lambda op: True,
        "matmul_only": lambda op: op == "MatMul",
    }[variant]
    assert [(r["node"], r["wrapped"]) for r in rows] == [(r["node"], expected(r["op_type"])) for r in rows]
    assert {r["op_type"] for r in rows} >= {"MatMul", "Add"}


def test_unmatched_relus_of_the_lab_are_absorbed(traced):
    """full.onnx: the quantizer folded every Relu into its Add, whose output is compared
    with the Relu's."""
    assert traced["full"]["unmatched"] == [
        {"node": f"fc{i}_relu", "op_type": "Relu", "reason": trace_engine.REASON_ABSORBED}
        for i in range(1, TRACE_LAB.layers + 1)
    ]


UNMATCHED_CASES = [
    # A Sigmoid of another name now computes t: the Relu's output is compared with it.
    pytest.param(
        [helper.make_node("Sigmoid", ["x"], ["t"], name="s"), helper.make_node("Neg", ["t"], ["y"], name="n1")],
        "absorbed",
        id="output-compared-with-another-op",
    ),
    # The Relu is gone and nothing is compared with t.
    pytest.param([helper.make_node("Neg", ["x"], ["y"], name="n1")], "no quantized node", id="no-twin"),
]


@pytest.mark.parametrize(("quant_nodes", "reason_word"), UNMATCHED_CASES)
def test_unmatched_reason_says_why(tmp_path, quant_nodes, reason_word):
    a = save(
        tmp_path / "a.onnx",
        [helper.make_node("Relu", ["x"], ["t"], name="r1"), helper.make_node("Neg", ["t"], ["y"], name="n1")],
        {"x": [1, 4]},
        {"y": [1, 4]},
    )
    b = save(tmp_path / "b.onnx", quant_nodes, {"x": [1, 4]}, {"y": [1, 4]})
    (entry,) = graphscan.trace(a, b)["unmatched"]
    assert (entry["node"], entry["op_type"]) == ("r1", "Relu")
    assert reason_word in entry["reason"]
    assert entry["reason"] in (
        trace_engine.REASON_ABSORBED,
        trace_engine.REASON_NO_TWIN,
    )


# --------------------------------------------------------------------------
# --save: one pair of files per row, whatever the names


SAVE_NAMES = [
    pytest.param(["a/b", "a:b", "a_b"], id="three-names-one-safe-form"),
    # The second unsafe name would fall back to "a_b_2": a node already has that name.
    pytest.param(["a_b_2", "a/b", "a:b"], id="fallback-stem-is-another-name"),
]


@pytest.mark.parametrize("names", SAVE_NAMES)
def test_saved_files_never_overwrite_each_other(tmp_path, names):
    nodes, previous = [], "x"
    for k, name in enumerate(names):
        op = ["Relu", "Neg", "Sigmoid"][k % 3]
        nodes.append(helper.make_node(op, [previous], [f"t{k}"], name=name))
        previous = f"t{k}"
    nodes.append(helper.make_node("Identity", [previous], ["y"], name="out"))
    path = save(tmp_path / "m.onnx", nodes, {"x": [1, 4]}, {"y": [1, 4]})
    folder = tmp_path / "saved"
    answer = graphscan.trace(path, path, save=str(folder))

    saved = sorted(folder.glob("*.onnx"))
    assert len(saved) == len(answer["ops"]) == len(names) + 1
    # Each row's node is in exactly one saved model, and that model reruns to its inputs.
    owners = {}
    for model_path in saved:
        model = onnx.load(model_path)
        for node in model.graph.node:
            owners.setdefault(node.name, []).append(model_path)
        feeds, reference = saved_arrays(model_path.with_suffix(".npz"))
        (out,) = run_onnx(model_path, feeds)
        np.testing.assert_array_equal(out, reference)
    for row in answer["ops"]:
        assert len(owners[row["node"]]) == 1, (row["node"], owners[row["node"]])


# --------------------------------------------------------------------------
# External data


@pytest.mark.parametrize("side", ["float", "quantized"])
def test_trace_reports_missing_external_data(tmp_path, side):
    broken = with_external_weights(tmp_path / "broken.onnx", "weights.bin", 256)
    good = tmp_path / "good.onnx"
    onnx.save(gen_models.build_mlp(3, 8, seed=0), good)
    paths = [broken, good] if side == "float" else [good, broken]
    line = error_line(run_graphscan(["trace", *paths], cwd=tmp_path), graphscan.EXIT_NOT_ONNX)
    assert "external data" in line and str(broken) in line


def test_trace_reads_external_data_beside_the_model_from_any_folder(tmp_path):
    """Weights in sub/weights.bin are found from sub/, not from the working directory."""
    sub = tmp_path / "sub"
    mlp_with_weights_beside(sub, "m.onnx", seed=0)
    assert (sub / "weights.bin").stat().st_size > 0
    answer = json_answer(run_graphscan(["trace", "sub/m.onnx", "sub/m.onnx"], cwd=tmp_path))
    assert {row["isolated_max_abs"] for row in answer["ops"]} == {0.0}


# --------------------------------------------------------------------------
# Defaults: the tolerance and the seeded input


def offset_pair(tmp_path, offset):
    """x + c in both models, c larger by ``offset`` in the second: row "n" is off by it."""

    def model(name, c):
        return save(
            tmp_path / name,
            [helper.make_node("Add", ["x", "c"], ["y"], name="n")],
            {"x": [1, 4]},
            {"y": [1, 4]},
            [numpy_helper.from_array(np.full(4, c, np.float32), "c")],
        )

    return model("a.onnx", 0.5), model("b.onnx", 0.5 + offset)


@pytest.mark.parametrize(
    ("offset", "over"), [pytest.param(0.004, False, id="4e-3-under"), pytest.param(0.02, True, id="2e-2-over")]
)
def test_default_tolerance_is_1e2(tmp_path, offset, over):
    a, b = offset_pair(tmp_path, offset)
    answer = graphscan.trace(a, b)
    (row,) = answer["ops"]
    assert row["isolated_max_abs"] == pytest.approx(offset, rel=1e-3)
    assert answer["first_over"] == ({"node": "n", "max_abs": row["isolated_max_abs"]} if over else None)


@pytest.mark.parametrize("seed", [0, 3])
def test_default_input_is_the_seeded_standard_normal(trace_lab, tmp_path, seed):
    """Without --inputs, x is numpy's default_rng(seed).standard_normal((1, 16)) as float32."""
    x = np.random.default_rng(seed).standard_normal((1, TRACE_LAB.dim)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    seeded = graphscan.trace(trace_lab["fp32"], trace_lab["full"], seed=seed)
    given = graphscan.trace(trace_lab["fp32"], trace_lab["full"], inputs=str(tmp_path / "x.npz"))
    assert seeded["ops"] == given["ops"] and seeded["outputs"] == given["outputs"]
    (expected,), (actual,) = run_onnx(trace_lab["fp32"], {"x": x}), run_onnx(trace_lab["full"], {"x": x})
    assert seeded["outputs"]["y"] == pytest.approx(float(np.max(np.abs(expected - actual))), rel=1e-6)


# --------------------------------------------------------------------------
# What cannot be measured is null, not a guess


def test_per_channel_output_scale_gives_no_lsb(tmp_path):
    """The output Q has one scale per channel: there is no single LSB to count in."""
    a = save(tmp_path / "a.onnx", [helper.make_node("Relu", ["x"], ["y"], name="r")], {"x": [1, 2]}, {"y": [1, 2]})
    qparams = [
        numpy_helper.from_array(np.array([0.1, 0.2], np.float32), "s"),
        numpy_helper.from_array(np.array([0, 0], np.int8), "z"),
    ]
    b = save(
        tmp_path / "b.onnx",
        [
            helper.make_node("Relu", ["x"], ["t"], name="r"),
            helper.make_node("QuantizeLinear", ["t", "s", "z"], ["t_q"], name="q", axis=1),
            helper.make_node("DequantizeLinear", ["t_q", "s", "z"], ["y"], name="dq", axis=1),
        ],
        {"x": [1, 2]},
        {"y": [1, 2]},
        qparams,
    )
    np.savez(tmp_path / "x.npz", x=np.array([[0.33, 0.77]], np.float32))  # not on either grid
    (row,) = graphscan.trace(a, b, inputs=str(tmp_path / "x.npz"))["ops"]
    assert row["isolated_max_abs"] > 0
    assert row["isolated_lsb"] is None


def test_outputs_of_different_shapes_are_not_compared(tmp_path):
    """Same node, same output name, [1, 1] in one model and a scalar in the other: null."""

    def model(name, keepdims, shape):
        return save(
            tmp_path / name,
            [helper.make_node("ReduceSum", ["x"], ["y"], name="s", keepdims=keepdims)],
            {"x": [2, 2]},
            {"y": shape},
        )

    answer = graphscan.trace(model("a.onnx", 1, [1, 1]), model("b.onnx", 0, []))
    (row,) = answer["ops"]
    assert (row["isolated_max_abs"], row["propagated_max_abs"], row["sqnr_db"]) == (None, None, None)
    assert answer["outputs"] == {"y": None}


def test_values_at_the_ends_of_the_q_range_are_not_clipped(tmp_path):
    """T23: a Relu's zeros sit exactly on a uint8 Q's lower end (zero point 0, so
    ``(0 - 0) * s = 0``): representable, not clipped. With s = 4/255 the range is
    [0, 4]; clipped is the fraction of Relu outputs above 4, counted in numpy."""
    scale = np.float32(4 / 255)
    qparams = [numpy_helper.from_array(np.array(scale), "s"), numpy_helper.from_array(np.array(0, np.uint8), "z")]
    a = save(
        tmp_path / "a.onnx",
        [helper.make_node("Relu", ["x"], ["t"], name="r"), helper.make_node("Sigmoid", ["t"], ["y"], name="g")],
        {"x": [1, 1000]},
        {"y": [1, 1000]},
    )
    b = save(
        tmp_path / "b.onnx",
        [
            helper.make_node("Relu", ["x"], ["t"], name="r"),
            helper.make_node("QuantizeLinear", ["t", "s", "z"], ["t_q"], name="q"),
            helper.make_node("DequantizeLinear", ["t_q", "s", "z"], ["t_dq"], name="dq"),
            helper.make_node("Sigmoid", ["t_dq"], ["y"], name="g"),
        ],
        {"x": [1, 1000]},
        {"y": [1, 1000]},
        qparams,
    )
    x = np.random.default_rng(7).standard_normal((1, 1000)).astype(np.float32) * 3
    x[0, :10] = 4.5  # some values above the range
    np.savez(tmp_path / "x.npz", x=x)
    rows = {r["node"]: r for r in graphscan.trace(a, b, inputs=str(tmp_path / "x.npz"))["ops"]}
    relu = np.maximum(x, 0).astype(np.float64)
    assert np.mean(relu == 0) > 0.4  # the lower end is really hit
    assert rows["r"]["clipped"] == np.count_nonzero(relu > 255 * float(scale)) / relu.size
    assert rows["r"]["clipped"] > 0


def test_save_stems_differ_in_more_than_case():
    """T10, T27: safe names are their own stems, but "relu" after "Relu" would
    overwrite it on a case-insensitive file system: it gets the next free suffix."""
    assert trace_engine.file_stems(["Relu", "relu", "RELU", "b"]) == ["Relu", "relu-2", "RELU-3", "b"]


def test_outputs_whose_shapes_differ_only_at_run_time_are_not_compared(tmp_path):
    """T22: the Reshape's target comes from an input, so shape inference cannot
    tell [1, 6] from [6, 1]; numpy would broadcast them to [6, 6]. Null, not a number."""
    shp = helper.make_tensor_value_info("shp", TensorProto.INT64, [2])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])

    def model(path, nodes, inits=()):
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        graph = helper.make_graph(nodes, "g", [x, shp], [y], list(inits))
        onnx.save(helper.make_model(graph, opset_imports=OPSET), path)
        return str(path)

    a = model(tmp_path / "a.onnx", [helper.make_node("Reshape", ["x", "shp"], ["y"], name="r")])
    b = model(
        tmp_path / "b.onnx",
        [
            helper.make_node("Gather", ["shp", "order"], ["shp2"], name="g"),
            helper.make_node("Reshape", ["x", "shp2"], ["y"], name="r"),
        ],
        [numpy_helper.from_array(np.array([1, 0], np.int64), "order")],
    )
    np.savez(tmp_path / "in.npz", x=np.arange(6, dtype=np.float32), shp=np.array([1, 6], np.int64))
    # Measured in the graph, and (with --save, which fetches the row) in numpy.
    for save in [None, str(tmp_path / "saved")]:
        answer = graphscan.trace(a, b, inputs=str(tmp_path / "in.npz"), save=save)
        rows = {r["node"]: r for r in answer["ops"]}
        assert rows["r"]["reference"] == "y"
        assert (rows["r"]["isolated_max_abs"], rows["r"]["propagated_max_abs"]) == (None, None), save
        assert answer["outputs"] == {"y": None}
