"""trace on awkward real-world pairs (issue 10 items 6-8) and its new fields (issue 9):
output names that differ, node names reused with another meaning, outputs that are
not plain tensors, --save names that collide, clipped, --shape and defaulted.

Expected values come from onnxruntime run directly and numpy.
"""

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphscan
import graphscan_ort.engines.trace as trace_engine
from tests.helpers import error_line, json_answer, run_graphscan, run_onnx
from tests.lab import TRACE_LAB

SCALE = 0.05
OPSET = [helper.make_opsetid("", 17)]


def save(model, path):
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return str(path)


def quantize_tensor(nodes, tensor, scale=SCALE, zero_type=TensorProto.INT8, suffix=""):
    """Append Q->DQ after ``tensor`` named as onnxruntime's quantizer names them."""
    q, dq = f"{tensor}_QuantizeLinear_Output{suffix}", f"{tensor}_DequantizeLinear_Output{suffix}"
    s, z = f"{tensor}_scale{suffix}", f"{tensor}_zero{suffix}"
    nodes.append(helper.make_node("QuantizeLinear", [tensor, s, z], [q], name=f"{tensor}_q{suffix}"))
    nodes.append(helper.make_node("DequantizeLinear", [q, s, z], [dq], name=f"{tensor}_dq{suffix}"))
    zero = np.array(0, helper.tensor_dtype_to_np_dtype(zero_type))
    return dq, [numpy_helper.from_array(np.array(scale, np.float32), s), numpy_helper.from_array(zero, z)]


def model_of(nodes, inputs, outputs, inits=()):
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=OPSET)


def floats(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def intermediate(path, feeds, names):
    """Tensors ``names`` of the model at ``path``, run directly in onnxruntime."""
    import onnxruntime as ort

    model = onnx.load(path)
    del model.graph.output[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip(names, session.run(names, feeds), strict=True))


def rows_by_node(answer):
    return {row["node"]: row for row in answer["ops"]}


# --------------------------------------------------------------------------
# Item 6: blame the right model


def test_output_names_that_differ_are_paired_by_position(trace_lab, tmp_path):
    quant = onnx.load(trace_lab["full"])
    for node in quant.graph.node:
        node.output[:] = ["y_quant" if t == "y" else t for t in node.output]
    quant.graph.output[0].name = "y_quant"
    renamed = save(quant, tmp_path / "renamed.onnx")
    x = np.random.default_rng(3).standard_normal((2, TRACE_LAB.dim)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    answer = graphscan.trace(str(trace_lab["fp32"]), renamed, inputs=str(tmp_path / "x.npz"))
    (expected,), (actual,) = run_onnx(trace_lab["fp32"], {"x": x}), run_onnx(renamed, {"x": x})
    assert answer["outputs"] == {"y": float(np.max(np.abs(expected.astype(np.float64) - actual)))}


def reused_names_pair(tmp_path):
    """A float model and a "pre-processed" one whose nodes and tensors keep their
    names but Unsqueeze/Squeeze another axis: t and r are [1, 1, 4] in one and
    [1, 4, 1] in the other."""

    def build(axis, quantized):
        inits = [numpy_helper.from_array(np.array([axis], np.int64), "axis")]
        nodes = [
            helper.make_node("Unsqueeze", ["x", "axis"], ["t"], name="unsq"),
            helper.make_node("Relu", ["t"], ["r"], name="relu"),
        ]
        read = "r"
        if quantized:
            read, qdq = quantize_tensor(nodes, "r")
            inits += qdq
        nodes.append(helper.make_node("Squeeze", [read, "axis"], ["y"], name="sq"))
        return model_of(nodes, [floats("x", [1, 4])], [floats("y", [1, 4])], inits)

    return save(build(1, False), tmp_path / "float.onnx"), save(build(2, True), tmp_path / "pre.onnx")


def test_reused_names_with_other_shapes_are_not_compared(tmp_path):
    float_path, quant_path = reused_names_pair(tmp_path)
    x = np.linspace(-1, 1, 4, dtype=np.float32).reshape(1, 4)
    np.savez(tmp_path / "x.npz", x=x)
    answer = graphscan.trace(float_path, quant_path, inputs=str(tmp_path / "x.npz"))
    rows = rows_by_node(answer)
    assert rows["unsq"]["reference"] is None and rows["relu"]["reference"] is None  # shapes differ
    assert rows["sq"]["reference"] == "y"
    (expected,), (actual,) = run_onnx(float_path, {"x": x}), run_onnx(quant_path, {"x": x})
    assert rows["sq"]["propagated_max_abs"] == float(np.max(np.abs(expected.astype(np.float64) - actual)))
    # sq's single-op model reads the quantized model's own r (the float r has another shape):
    # Squeeze, then no output Q, so it reproduces the quantized model exactly.
    assert rows["sq"]["isolated_max_abs"] == rows["sq"]["propagated_max_abs"]


def test_a_failing_single_op_model_is_dropped_and_named_as_graphscans_own(tmp_path, monkeypatch):
    float_path, quant_path = reused_names_pair(tmp_path)
    # Without shapes, the float r ([1, 1, 4]) is fed to the quantized sq, which
    # squeezes axis 2: onnxruntime refuses graphscan's single-op model of sq.
    monkeypatch.setattr(trace_engine, "inferred_types", lambda model, feeds: {})
    answer = graphscan.trace(float_path, quant_path)
    rows = rows_by_node(answer)
    assert rows["sq"]["isolated_max_abs"] is None  # dropped, the run repeated without it
    x = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)  # trace's seeded input
    (expected,), (actual,) = run_onnx(float_path, {"x": x}), run_onnx(quant_path, {"x": x})
    assert answer["outputs"]["y"] == float(np.max(np.abs(expected.astype(np.float64) - actual)))
    (entry,) = [u for u in answer["unmatched"] if u["node"] == "sq"]
    assert entry["reason"].startswith("graphscan's own single-op model of this node does not run in onnxruntime (")
    # With no repeat allowed, the error says whose model failed: graphscan's, for node sq.
    monkeypatch.setattr(trace_engine, "TRACE_RETRIES", 0)
    with pytest.raises(graphscan.GraphscanError) as caught:
        graphscan.trace(float_path, quant_path)
    assert caught.value.exit_code == graphscan.EXIT_RUNTIME
    message = str(caught.value)
    assert message.startswith(f"{quant_path}: graphscan's own single-op model for node 'sq' does not run")
    assert len(message.splitlines()) == 1


# --------------------------------------------------------------------------
# Item 7: values that are not plain tensors


def not_tensor_pair(tmp_path, make_tail, output):
    """x -> Relu -> tail, the Relu's output quantized in the second model."""

    def build(quantized):
        nodes, inits = [helper.make_node("Relu", ["x"], ["r"], name="relu")], []
        read = "r"
        if quantized:
            read, inits = quantize_tensor(nodes, "r")
        nodes += make_tail(read)
        return model_of(nodes, [floats("x", [1, 4])], [output], inits)

    return save(build(False), tmp_path / "float.onnx"), save(build(True), tmp_path / "quant.onnx")


NOT_TENSORS = [
    pytest.param(
        lambda r: [helper.make_node("SequenceConstruct", [r, r], ["out"], name="tail")],
        helper.make_tensor_sequence_value_info("out", TensorProto.FLOAT, None),
        "SequenceConstruct",
        "a sequence",
        id="sequence",
    ),
    pytest.param(
        lambda r: [helper.make_node("Optional", [r], ["out"], name="tail")],
        helper.make_value_info(
            "out", helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [1, 4]))
        ),
        "Optional",
        "an optional",
        id="optional",
    ),
    pytest.param(
        lambda r: [helper.make_node("Cast", [r], ["out"], name="tail", to=TensorProto.STRING)],
        helper.make_tensor_value_info("out", TensorProto.STRING, [1, 4]),
        "Cast",
        "a string tensor",
        id="string",
    ),
]


@pytest.mark.parametrize(("make_tail", "output", "op_type", "kind"), NOT_TENSORS)
def test_outputs_that_are_not_tensors_are_listed_not_compared(tmp_path, make_tail, output, op_type, kind):
    float_path, quant_path = not_tensor_pair(tmp_path, make_tail, output)
    answer = json_answer(run_graphscan(["trace", float_path, quant_path]))
    rows = rows_by_node(answer)
    assert rows["relu"]["isolated_max_abs"] is not None  # what can be traced is traced
    assert rows["tail"]["reference"] is None and rows["tail"]["propagated_max_abs"] is None
    assert answer["outputs"] == {"out": None}
    assert {"node": "tail", "op_type": op_type, "reason": f"its output is {kind}: not compared"} in answer["unmatched"]


def test_untyped_graph_outputs_are_compared(trace_lab, tmp_path):
    paths = []
    for variant in ["fp32", "full"]:
        model = onnx.load(trace_lab[variant])
        model.graph.output[0].ClearField("type")
        paths.append(str(tmp_path / f"{variant}.onnx"))
        onnx.save(model, paths[-1])
    answer = graphscan.trace(*paths, shape=["x=2,16"])
    x = np.random.default_rng(0).standard_normal((2, TRACE_LAB.dim)).astype(np.float32)  # trace's seeded input
    (expected,), (actual,) = run_onnx(paths[0], {"x": x}), run_onnx(paths[1], {"x": x})
    assert answer["outputs"] == {"y": float(np.max(np.abs(expected.astype(np.float64) - actual)))}


def lstm_pair(tmp_path):
    """An LSTM whose optional output Y is left out (""), only Y_h written."""
    rng = np.random.default_rng(2)
    hidden, size = 3, 4
    inits = [
        numpy_helper.from_array(rng.standard_normal((1, 4 * hidden, size)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.standard_normal((1, 4 * hidden, hidden)).astype(np.float32), "R"),
    ]

    def build(quantized):
        nodes, read, extra = [], "x", []
        if quantized:
            read, extra = quantize_tensor(nodes, "x")
        nodes.append(helper.make_node("LSTM", [read, "W", "R"], ["", "Y_h"], name="lstm", hidden_size=hidden))
        return model_of(nodes, [floats("x", [2, 1, size])], [floats("Y_h", [1, 1, hidden])], inits + extra)

    return save(build(False), tmp_path / "float.onnx"), save(build(True), tmp_path / "quant.onnx")


def test_an_optional_output_left_out_still_traces(tmp_path):
    float_path, quant_path = lstm_pair(tmp_path)
    answer = graphscan.trace(float_path, quant_path)
    (row,) = [r for r in answer["ops"] if r["node"] == "lstm"]
    assert row["reference"] == "Y_h"
    x = np.random.default_rng(0).standard_normal((2, 1, 4)).astype(np.float32)  # trace's seeded input
    (expected,), (actual,) = run_onnx(float_path, {"x": x}), run_onnx(quant_path, {"x": x})
    error = float(np.max(np.abs(expected.astype(np.float64) - actual)))
    assert error > 0
    assert row["propagated_max_abs"] == error == answer["outputs"]["Y_h"]
    assert row["isolated_max_abs"] == error  # fed the float x through the same Q->DQ


def test_a_sequence_input_is_an_input_error(tmp_path):
    seq = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [1, 4])
    model = model_of(
        [helper.make_node("SequenceAt", ["s", "i"], ["y"], name="at")],
        [seq],
        [floats("y", [1, 4])],
        [numpy_helper.from_array(np.array(0, np.int64), "i")],
    )
    path = save(model, tmp_path / "seq.onnx")
    line = error_line(run_graphscan(["trace", path, path]), graphscan.EXIT_INPUTS)
    assert "'s'" in line


def string_input_pair(tmp_path):
    """A string input s, Cast to float and added to x; the sum quantized in the second model."""

    def build(quantized):
        nodes = [
            helper.make_node("Cast", ["s"], ["f"], name="cast", to=TensorProto.FLOAT),
            helper.make_node("Add", ["f", "x"], ["a"], name="add"),
        ]
        read, inits = "a", []
        if quantized:
            read, inits = quantize_tensor(nodes, "a")
        nodes.append(helper.make_node("Relu", [read], ["y"], name="relu"))
        inputs = [helper.make_tensor_value_info("s", TensorProto.STRING, [3]), floats("x", [3])]
        return model_of(nodes, inputs, [floats("y", [3])], inits)

    return save(build(False), tmp_path / "float.onnx"), save(build(True), tmp_path / "quant.onnx")


def test_a_string_input_is_given_with_inputs_and_traced(tmp_path):
    float_path, quant_path = string_input_pair(tmp_path)
    # It cannot be generated: exit 7, which says to give it with --inputs ...
    line = error_line(run_graphscan(["trace", float_path, quant_path]), graphscan.EXIT_INPUTS)
    assert "--inputs" in line
    # ... and a unicode array given that way is taken.
    feeds = {"s": np.array(["1.5", "-2", "0.25"]), "x": np.array([0.1, 0.2, 0.3], np.float32)}
    np.savez(tmp_path / "in.npz", **feeds)
    answer = json_answer(run_graphscan(["trace", float_path, quant_path, "--inputs", tmp_path / "in.npz"]))
    a = intermediate(float_path, feeds, ["a"])["a"].astype(np.float64)
    seen = intermediate(quant_path, feeds, ["a_DequantizeLinear_Output"])["a_DequantizeLinear_Output"]
    assert rows_by_node(answer)["add"]["propagated_max_abs"] == float(np.max(np.abs(a - seen)))


# --------------------------------------------------------------------------
# Item 8: --save names


def awkward_names_pair(tmp_path):
    """Nodes named a/b, a:b and a_b (one stem if only unsafe characters were
    replaced) whose tensors are named file, allow_pickle and reference (words
    np.savez and trace's old .npz format treat as their own)."""

    def build(quantized):
        nodes, inits, read = [], [], "x"
        for node, tensor in [("a/b", "file"), ("a:b", "allow_pickle"), ("a_b", "reference")]:
            nodes.append(helper.make_node("Sigmoid", [read], [tensor], name=node))
            read = tensor
            if quantized:
                read, qdq = quantize_tensor(nodes, tensor, scale=1 / 255, zero_type=TensorProto.UINT8)
                inits += qdq
        nodes.append(helper.make_node("Identity", [read], ["y"], name="out"))
        return model_of(nodes, [floats("x", [2, 3])], [floats("y", [2, 3])], inits)

    return save(build(False), tmp_path / "float.onnx"), save(build(True), tmp_path / "quant.onnx")


def test_saved_stems_are_unique_and_every_name_round_trips(tmp_path):
    float_path, quant_path = awkward_names_pair(tmp_path)
    folder = tmp_path / "saved"
    answer = json_answer(run_graphscan(["trace", float_path, quant_path, "--save", folder]))
    index = json.loads((folder / "index.json").read_text())
    assert list(index) == [r["node"] for r in answer["ops"]] == ["a/b", "a:b", "a_b", "out"]
    assert len({stem.casefold() for stem in index.values()}) == 4
    assert index["a_b"] == "a_b" and index["out"] == "out"  # safe names are their own stems
    for row in answer["ops"]:
        stem = index[row["node"]]
        with np.load(folder / f"{stem}.npz") as archive:  # allow_pickle stays False
            names = json.loads(archive["names.json"])
            feeds = {name: archive[key] for name, key in names["inputs"].items()}
            reference = archive[names["reference"]]
        (out,) = run_onnx(folder / f"{stem}.onnx", feeds)
        assert float(np.max(np.abs(reference.astype(np.float64) - out))) == row["isolated_max_abs"]
    # Each single-op model is fed the tensor before it, under its own name.
    assert set(feeds_of(folder, index["a:b"])) == {"file"}
    assert set(feeds_of(folder, index["a_b"])) == {"allow_pickle"}
    assert set(feeds_of(folder, index["out"])) == {"reference"}


def feeds_of(folder, stem):
    with np.load(folder / f"{stem}.npz") as archive:
        return json.loads(archive["names.json"])["inputs"]


# --------------------------------------------------------------------------
# Issue 9: clipped, --shape, defaulted


def sigmoid_pair(tmp_path, scale, zero_type):
    """x -> Sigmoid -> Relu; the Sigmoid's output Q has ``scale`` and a zero point of 0."""

    def build(quantized):
        nodes = [helper.make_node("Sigmoid", ["x"], ["s"], name="sig")]
        inits, read = [], "s"
        if quantized:
            read, inits = quantize_tensor(nodes, "s", scale=scale, zero_type=zero_type)
        nodes.append(helper.make_node("Relu", [read], ["y"], name="relu"))
        return model_of(nodes, [floats("x", [1, 1000])], [floats("y", [1, 1000])], inits)

    return save(build(False), tmp_path / "float.onnx"), save(build(True), tmp_path / "quant.onnx")


@pytest.mark.parametrize(
    ("scale", "zero_type", "hi"),
    [
        # uint8, zero point 0: [0, 255 s]; with s = 0.5 / 255 the range ends at 0.5,
        # so every Sigmoid output above 0.5 (every x > 0) is clipped.
        pytest.param(0.5 / 255, TensorProto.UINT8, 0.5, id="uint8-half-range"),
        # int8, zero point 0: [-128 s, 127 s] = [-0.64, 0.635]
        pytest.param(0.005, TensorProto.INT8, 127 * 0.005, id="int8"),
    ],
)
def test_clipped_is_the_fraction_outside_the_q_range(tmp_path, scale, zero_type, hi):
    float_path, quant_path = sigmoid_pair(tmp_path, scale, zero_type)
    x = np.random.default_rng(4).standard_normal((1, 1000)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    rows = rows_by_node(graphscan.trace(float_path, quant_path, inputs=str(tmp_path / "x.npz")))
    s = intermediate(quant_path, {"x": x}, ["s"])["s"].astype(np.float64)
    lo = (np.iinfo(helper.tensor_dtype_to_np_dtype(zero_type)).min - 0) * float(np.float32(scale))
    assert rows["sig"]["clipped"] == np.count_nonzero((s < lo) | (s > hi)) / s.size
    if hi == 0.5:
        assert rows["sig"]["clipped"] == pytest.approx(np.mean(x > 0), abs=0.002)  # by hand
    assert rows["relu"]["clipped"] is None  # no Q after the Relu


@pytest.mark.parametrize(
    ("options", "inputs", "defaulted"),
    [
        pytest.param([], {"x": [1, 16]}, ["x"], id="symbolic-dims-default-to-1"),
        pytest.param(["--shape", "x=5,16"], {"x": [5, 16]}, [], id="shape-given"),
        pytest.param(["--inputs", "NPZ"], {"x": [3, 16]}, [], id="inputs-given"),
    ],
)
def test_shape_and_defaulted(trace_lab, tmp_path, options, inputs, defaulted):
    np.savez(tmp_path / "x.npz", x=np.zeros((3, TRACE_LAB.dim), np.float32))
    options = [str(tmp_path / "x.npz") if o == "NPZ" else o for o in options]
    answer = json_answer(run_graphscan(["trace", trace_lab["fp32"], trace_lab["full"], *options]))
    assert answer["inputs"] == inputs
    assert answer["defaulted"] == defaulted
    assert list(answer) == [
        "a",
        "b",
        "inputs",
        "defaulted",
        "ops",
        "outputs",
        "worst_isolated",
        "first_over",
        "unmatched",
    ]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(["--shape", "x=5"], id="wrong-rank"),
        pytest.param(["--shape", "x=5,17"], id="fixed-dim-differs"),
        pytest.param(["--shape", "nope=1,16"], id="unknown-input"),
        pytest.param(["--shape", "x=a,b"], id="not-integers"),
        pytest.param(["--shape", "x=2,16", "--inputs", "NPZ"], id="with-inputs"),
    ],
)
def test_bad_shapes_are_input_errors(trace_lab, tmp_path, options):
    np.savez(tmp_path / "x.npz", x=np.zeros((3, TRACE_LAB.dim), np.float32))
    options = [str(tmp_path / "x.npz") if o == "NPZ" else o for o in options]
    error_line(run_graphscan(["trace", trace_lab["fp32"], trace_lab["full"], *options]), graphscan.EXIT_INPUTS)


def test_trace_help_lists_shape():
    done = run_graphscan(["trace", "--help"])
    assert done.returncode == 0 and b"--shape" in done.stdout


def test_a_float_model_at_an_older_opset_joins_the_quantized_one(trace_lab, tmp_path):
    # MatMul, Add and Relu mean the same at opset 13 and 17: the answer must not change.
    older = onnx.load(trace_lab["fp32"])
    older.opset_import[0].version = 13
    path = save(older, tmp_path / "fp32_opset13.onnx")
    at_13 = graphscan.trace(path, str(trace_lab["full"]))
    at_17 = graphscan.trace(str(trace_lab["fp32"]), str(trace_lab["full"]))
    assert {**at_13, "a": None} == {**at_17, "a": None}
    assert at_13["outputs"]["y"] > 0


def test_a_graph_whose_output_is_its_input_is_traced(tmp_path):
    """Nothing to run and nothing to fetch: graphscan's combined model was empty, onnxruntime
    refused it, and the user's model was blamed (exit 5)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
    )  # fmt: skip
    path = tmp_path / "io.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    answer = graphscan.trace(str(path), str(path))
    assert answer["ops"] == [] and answer["outputs"] == {"x": 0.0}


@pytest.mark.parametrize("fetch_elements", [2**22, 0], ids=["fetched", "reduced-in-graph"])
def test_an_overflow_to_infinity_gives_no_sqnr_not_a_crash(tmp_path, fetch_elements, monkeypatch):
    """exp(88.6) is a float32, exp(89) is not: the quantized Exp (its input rounded to 89)
    overflows where the float one does not. The noise is infinite: no SQNR, the maximum
    infinite (null in the JSON). It was exit 1, "math domain error"."""
    import graphscan_ort.engines.combined as combined

    monkeypatch.setattr(combined, "TRACE_FETCH_ELEMENTS", fetch_elements)
    x, y = ([helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4])] for n in ("x", "y"))
    nodes = [helper.make_node("Exp", ["x"], ["y"], name="exp")]
    float_path = save(helper.make_model(helper.make_graph(nodes, "a", x, y), opset_imports=OPSET), tmp_path / "a.onnx")
    quant_nodes = []
    wrapped, qparams = quantize_tensor(quant_nodes, "x", scale=1.0)
    quant_nodes.append(helper.make_node("Exp", [wrapped], ["y"], name="exp"))
    quant_path = save(
        helper.make_model(helper.make_graph(quant_nodes, "b", x, y, qparams), opset_imports=OPSET), tmp_path / "b.onnx"
    )
    np.savez(tmp_path / "x.npz", x=np.array([[88.6, 1, 2, 3]], np.float32))
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(np.float32(89))) and np.isfinite(np.exp(np.float32(88.6)))
    (row,) = graphscan.trace(float_path, quant_path, inputs=str(tmp_path / "x.npz"))["ops"]
    assert row["propagated_max_abs"] == math.inf and row["sqnr_db"] is None
    done = run_graphscan(["trace", float_path, quant_path, "--inputs", tmp_path / "x.npz"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ops"][0]["propagated_max_abs"] is None  # strict JSON


def test_an_if_branch_that_never_runs_does_not_stop_the_trace(tmp_path):
    """silero-vad's 8 kHz branch squeezes a dimension that is 2 at 16 kHz. onnxruntime
    accepts the model as declared ([n, 4]); graphscan declared its inputs with the fed
    sizes ([2, 4]), shape inference then refused the dead branch, and the user's model
    was blamed (exit 5)."""

    def branch(node, output):
        return helper.make_graph([node], output, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])

    then_branch = branch(helper.make_node("Relu", ["x"], ["t"], name="relu"), "t")
    else_branch = branch(helper.make_node("Squeeze", ["x", "axes"], ["e"], name="squeeze"), "e")
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then_branch, else_branch=else_branch)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 4])],
        [numpy_helper.from_array(np.array([0], np.int64), "axes")],
    )
    path = save(helper.make_model(graph, opset_imports=OPSET), tmp_path / "if.onnx")
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x, cond=np.array(True))
    assert np.array_equal(run_onnx(path, {"x": x, "cond": np.array(True)})[0], np.maximum(x, 0))  # it runs
    done = run_graphscan(["trace", path, path, "--inputs", tmp_path / "x.npz"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["outputs"] == {"y": 0.0}
