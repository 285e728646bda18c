"""trace's ``levels`` (issue 33): per row whose output is quantized, the float range of the
output's worst part in steps of that Q's scale. On a detector that concatenates box pixels
and class probabilities under one scale, the probabilities span less than one step. The
expected values are numpy's, on the float model's own tensors, with the scale read from
the quantized file."""

import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

import gen_models
import graphscan
from graphscan_ort.engines import levels
from tests import yolo_like
from tests.helpers import ROOT, load_bench_script


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """trace of onnxruntime's defaults on the detector, rows by node, with the models and sample."""
    float_path, quant_path, paths = yolo_like.collapsed_detector(tmp_path_factory.mktemp("levels"))
    quant = onnx.load(quant_path)
    answer = graphscan.trace(str(float_path), str(quant_path), inputs=str(paths[0]))
    return float_path, quant, paths[0], {row["node"]: row for row in answer["ops"]}


def float_tensors(float_path, names, sample):
    model = onnx.load(float_path)
    del model.graph.output[:]
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = sample if isinstance(sample, dict) else dict(np.load(sample))  # a sample or its file
    return dict(zip(names, session.run(names, feeds), strict=True))


def output_scale(quant, tensor):
    (q,) = [n for n in quant.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor]
    scales = {i.name: numpy_helper.to_array(i) for i in quant.graph.initializer}
    return float(scales[q.input[1]])


def test_the_concats_levels_are_the_probabilities_range_in_steps_of_its_scale(traced):
    float_path, quant, sample, rows = traced
    values = float_tensors(float_path, ["output0"], sample)
    probs = values["output0"][:, 4:]
    expected = (probs.max() - probs.min()) / output_scale(quant, "output0_QuantizeLinear_Input")
    assert expected < 1  # every probability is 0 or one step
    assert rows["head_concat"]["levels"] == pytest.approx(expected, rel=1e-6)


def test_a_tensor_of_one_part_spans_its_whole_range(traced):
    float_path, quant, sample, rows = traced
    b = float_tensors(float_path, ["b"], sample)["b"]
    assert rows["box_conv"]["levels"] == pytest.approx((b.max() - b.min()) / output_scale(quant, "b"), rel=1e-6)


def test_a_row_whose_output_is_not_quantized_has_no_levels(tmp_path):
    float_path, quant_path = tmp_path / "f.onnx", tmp_path / "q.onnx"
    yolo_like.yolo_like(float_path)
    paths = yolo_like.samples(tmp_path, 2)
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tests.helpers import calibration_reader

    quantize_static(
        str(float_path),
        str(quant_path),
        calibration_reader(paths),
        quant_format=QuantFormat.QDQ,
        nodes_to_exclude=["head_concat"],
    )
    rows = {r["node"]: r for r in graphscan.trace(str(float_path), str(quant_path), inputs=str(paths[0]))["ops"]}
    assert rows["head_concat"]["levels"] is None


def test_the_table_leads_with_the_parts_that_span_few_levels(traced):
    from graphscan_ort.commands.trace import trace_table

    *_, rows = traced
    answer = {"a": "f", "b": "q", "inputs": {}, "defaulted": [], "outputs": {}, "worst_isolated": None}
    answer |= {"first_over": None, "unmatched": [], "ops": list(rows.values())}
    table = trace_table(answer, None)
    first = table.split("\n\n")[1]
    assert first.splitlines()[0].startswith("ops whose output's worst part spans under 16 levels")
    assert "head_concat" in first and "box_conv" not in first


RANGES_OF_SAMPLES = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import gen_models
from graphscan_ort.engines import levels
count = int(sys.argv[2])
model = gen_models.build_cnn(2, channels=8, size=160, seed=0)
tensors = [n.output[0] for n in model.graph.node if n.op_type in ("Conv", "Relu")]
rng = np.random.default_rng(5)
samples = [{"x": rng.standard_normal((1, 3, 160, 160)).astype(np.float32)} for _ in range(count)]
levels.part_ranges(model, tensors, samples, "cnn.onnx")
print(len(tensors) * 8 * 160 * 160 * 4)  # one sample's inner tensors, in bytes
"""


def test_the_float_ranges_hold_one_samples_tensors_at_a_time(tmp_path):
    """part_ranges over 32 samples peaks within a few samples' inner tensors of where 2 do
    (peak RSS of a fresh process, bench/measure.py; onnxruntime's outputs are not numpy
    allocations that tracemalloc sees): each sample's tensors are reduced before the next
    sample runs. Holding every sample's (11.5 MB a sample here: 321 MB more at 32), a
    recognizer's 40 crops took tune to 3.6 GB."""
    measure = load_bench_script("measure")

    def peak(count):
        out, err = tmp_path / f"{count}.out", tmp_path / f"{count}.err"
        result = measure.measured([sys.executable, "-c", RANGES_OF_SAMPLES, ROOT, count], out, err)
        assert result["exit"] == 0, err.read_text()
        return result["peak_rss"], int(out.read_text())

    (few, per_sample), (many, _) = peak(2), peak(32)
    assert many - few < 4 * per_sample, (few, many, per_sample)


FLOAT_RUN_OR_RANGES = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from graphscan_ort.engines import levels
from graphscan_ort.shared.sessions import impact_options, open_session
from tests.helpers import load_bench_script
width, count = 2**21, 12
model, _ = load_bench_script("bench_trace_memory").chain_models(count, width)
sample = {"x": np.random.default_rng(0).standard_normal((1, width)).astype(np.float32)}
if sys.argv[2] == "ranges":
    levels.part_ranges(model, [node.output[0] for node in model.graph.node], [sample], "chain.onnx")
else:
    open_session(model, "chain", impact_options()).run(None, sample)
print(width * 4)  # bytes of one tensor
"""


def test_the_float_ranges_cost_about_one_run_of_the_float_model(tmp_path):
    """The ranges of 12 tensors of 8 MiB each peak within two tensors of a plain run of the
    float model (peak RSS of fresh processes, bench/measure.py): each tensor is reduced inside
    the run right after it is made. Fetched 64 per run, all 12 were held at once (96 MiB more);
    reduced at the end of the run, too."""
    measure = load_bench_script("measure")

    def peak(mode):
        out, err = tmp_path / f"{mode}.out", tmp_path / f"{mode}.err"
        result = measure.measured([sys.executable, "-c", FLOAT_RUN_OR_RANGES, ROOT, mode], out, err)
        assert result["exit"] == 0, err.read_text()
        return result["peak_rss"], int(out.read_text())

    (run, tensor), (ranges, _) = peak("run"), peak("ranges")
    assert ranges - run < 2 * tensor, (run / 2**20, ranges / 2**20)


def test_the_float_ranges_are_numpys_over_every_sample(tmp_path):
    """The ranges part_ranges reduces sample by sample are numpy's over all samples at once."""
    path = tmp_path / "cnn.onnx"
    model = gen_models.build_cnn(2, channels=8, size=48, seed=0)
    onnx.save(model, path)
    tensors = [n.output[0] for n in model.graph.node if n.op_type in ("Conv", "Relu")]
    rng = np.random.default_rng(5)
    samples = [{"x": rng.standard_normal((1, 3, 48, 48)).astype(np.float32)} for _ in range(6)]
    ranges, _ = levels.part_ranges(model, tensors, samples, str(path))
    values = [float_tensors(path, tensors, sample) for sample in samples]
    for name in tensors:
        every = np.stack([v[name] for v in values])
        # the copy runs unoptimized (impact's options), the reference optimized: last-bit differences
        assert ranges[name] == [pytest.approx((float(every.min()), float(every.max())), rel=1e-5)], name


# The rules of levels.py on hand-made QDQ pairs: every figure derived by hand from the inputs.


def qdq(tensor, scale, zero, axis=None):
    """Q->DQ nodes of ``tensor`` reading the initializers ``scale`` and ``zero``; the DQ output."""
    extra = {} if axis is None else {"axis": axis}
    q, dq = f"{tensor}_q", f"{tensor}_dq"
    return [
        helper.make_node("QuantizeLinear", [tensor, scale, zero], [q], name=f"{tensor}_Q", **extra),
        helper.make_node("DequantizeLinear", [q, scale, zero], [dq], name=f"{tensor}_DQ", **extra),
    ], dq


def save_pair(tmp_path, float_nodes, quant_nodes, inputs, outputs, quant_inits, float_inits=(), opset=17):
    """The float model and its quantized twin in ``tmp_path``: ``(float path, quant path)``."""
    paths = []
    for name, nodes, inits in (("f", float_nodes, float_inits), ("q", quant_nodes, [*float_inits, *quant_inits])):
        graph = helper.make_graph(nodes, name, inputs, outputs, list(inits))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        onnx.save(model, tmp_path / f"{name}.onnx")
        paths.append(str(tmp_path / f"{name}.onnx"))
    return paths


def traced_rows(paths, x, tmp_path):
    np.savez(tmp_path / "x.npz", x=x)
    answer = graphscan.trace(*paths, inputs=str(tmp_path / "x.npz"))
    return {row["node"]: row["levels"] for row in answer["ops"]}


def test_a_part_whose_values_are_all_equal_is_left_out(tmp_path):
    """c = Concat(2x, 0x): part 0 spans 2 * (3 - -1) = 8, i.e. 16 steps of 0.5; part 1 is all
    zeros, nothing to resolve: c's levels are part 0's, and z alone (every value equal) has none."""
    x = np.array([[-1.0, 0.5, 2.0, 3.0]], np.float32)
    inits = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("two", 2.0), ("nought", 0.0))]
    qparams = [numpy_helper.from_array(np.array(0.5, np.float32), "s"), numpy_helper.from_array(np.int8(0), "zp")]
    z_chain, z_dq = qdq("z", "s", "zp")
    c_chain, c_dq = qdq("c", "s", "zp")
    twice, zero = (
        helper.make_node("Mul", ["x", "two"], ["v"], name="twice"),
        helper.make_node("Mul", ["x", "nought"], ["z"], name="zero"),
    )
    float_nodes = [twice, zero, helper.make_node("Concat", ["v", "z"], ["c"], name="join", axis=1)]
    float_nodes.append(helper.make_node("Neg", ["c"], ["y"], name="neg"))
    quant_nodes = [twice, zero, *z_chain, helper.make_node("Concat", ["v", z_dq], ["c"], name="join", axis=1)]
    quant_nodes += [*c_chain, helper.make_node("Neg", [c_dq], ["y"], name="neg")]
    io = ([helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],)
    out = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8])]
    paths = save_pair(tmp_path, float_nodes, quant_nodes, *io, out, qparams, inits)
    rows = traced_rows(paths, x, tmp_path)
    assert rows["join"] == 16.0
    assert rows["zero"] is None  # z's only part never varies
    assert rows["twice"] is None and rows["neg"] is None  # no Q reads their outputs
    answer = graphscan.check(paths[1], float_path=paths[0], min_levels=16, inputs=[str(tmp_path / "x.npz")])
    assert answer["budgets"][0]["value"] == 16.0 and answer["budgets"][0]["part"] == {"part": 0, "node": "twice"}


def per_channel_pair(tmp_path, axis=1):
    """t = Neg(x) on [1, 2, 3] under a Q with scales (0.5, 0.25) along ``axis``."""
    qparams = [
        numpy_helper.from_array(np.array([0.5, 0.25], np.float32), "s"),
        numpy_helper.from_array(np.zeros(2, np.int8), "zp"),
    ]
    chain, dq = qdq("t", "s", "zp", axis=axis)
    neg = helper.make_node("Neg", ["x"], ["t"], name="neg")
    relu = helper.make_node("Relu", ["t"], ["y"], name="relu")
    quant_nodes = [neg, *chain, helper.make_node("Relu", [dq], ["y"], name="relu")]
    io = ([helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 3])],)
    out = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 3])]
    return save_pair(tmp_path, [neg, relu], quant_nodes, *io, out, qparams)


@pytest.mark.parametrize("axis", [1, -2], ids=["axis-1", "axis-minus-2"])
def test_a_per_channel_q_counts_each_channels_values_in_that_channels_step(tmp_path, axis):
    """Channel 0 spans 20 (-10..10) in steps of 0.5: 40 levels; channel 1 spans 2 (0..2) in
    steps of 0.25: 8 levels. The tensor's levels are the fewest, 8 (the whole range over the
    largest step would say 40, every channel over the first or largest step 4)."""
    paths = per_channel_pair(tmp_path, axis)
    x = np.array([[[-10.0, 0.0, 10.0], [0.0, 1.0, 2.0]]], np.float32)
    assert traced_rows(paths, x, tmp_path)["neg"] == 8.0
    answer = graphscan.check(paths[1], float_path=paths[0], min_levels=16, inputs=[str(tmp_path / "x.npz")])
    assert answer["budgets"][0]["value"] == 8.0 and answer["budgets"][0]["tensor"] == "t"


def test_a_per_channel_q_leaves_out_a_channel_whose_values_are_all_equal(tmp_path):
    """Channel 1 holds 5 everywhere: nothing to resolve there; channel 0's 20 / 0.5 = 40 levels stand."""
    paths = per_channel_pair(tmp_path)
    x = np.array([[[-10.0, 0.0, 10.0], [5.0, 5.0, 5.0]]], np.float32)
    assert traced_rows(paths, x, tmp_path)["neg"] == 40.0


def test_values_that_are_not_finite_are_left_out_of_the_range(tmp_path):
    """Log of (-1, 0, 1, 4) is (NaN, -inf, 0, log 4): the finite values span log 4, in
    steps of 0.125: log(4) / 0.125 levels."""
    qparams = [numpy_helper.from_array(np.array(0.125, np.float32), "s"), numpy_helper.from_array(np.int8(0), "zp")]
    chain, dq = qdq("t", "s", "zp")
    log = helper.make_node("Log", ["x"], ["t"], name="log")
    io = ([helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],)
    out = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])]
    float_nodes = [log, helper.make_node("Abs", ["t"], ["y"], name="abs")]
    quant_nodes = [log, *chain, helper.make_node("Abs", [dq], ["y"], name="abs")]
    paths = save_pair(tmp_path, float_nodes, quant_nodes, *io, out, qparams)
    x = np.array([[-1.0, 0.0, 1.0, 4.0]], np.float32)
    assert traced_rows(paths, x, tmp_path)["log"] == pytest.approx(float(np.log(np.float32(4.0))) / 0.125, rel=1e-7)


def test_a_float16_tensors_levels_are_its_float16_values_span_in_steps_of_its_scale(tmp_path):
    """m = x * 3 in float16 (onnxruntime's own values), under a float16 scale of 0.07."""
    x16 = onnx.TensorProto.FLOAT16
    scale = np.array(0.07, np.float16)
    qparams = [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(np.int8(0), "zp")]
    three = [numpy_helper.from_array(np.array(3, np.float16), "three")]
    chain, dq = qdq("m", "s", "zp")
    mul = helper.make_node("Mul", ["x", "three"], ["m"], name="mul")
    io = ([helper.make_tensor_value_info("x", x16, [3, 5])],)
    out = [helper.make_tensor_value_info("y", x16, [3, 5])]
    float_nodes = [mul, helper.make_node("Neg", ["m"], ["y"], name="neg")]
    quant_nodes = [mul, *chain, helper.make_node("Neg", [dq], ["y"], name="neg")]
    paths = save_pair(tmp_path, float_nodes, quant_nodes, *io, out, qparams, three, opset=19)
    x = (np.random.default_rng(2).standard_normal((3, 5)) * 4).astype(np.float16)
    m = float_tensors(paths[0], ["m"], {"x": x})["m"]
    assert m.dtype == np.float16
    expected = (float(m.max()) - float(m.min())) / float(scale)
    assert traced_rows(paths, x, tmp_path)["mul"] == expected


def neg_pair(tmp_path, *qs):
    """t = Neg(x) on [1, 2, 3], read by one Q->DQ per ``(scale, axis)`` of ``qs`` (a number: a
    per-tensor scale; a list: per axis, along ``axis``, None leaving the attribute out for
    ONNX's default 1), each DQ followed by its own Relu output; the float model's outputs are
    the Relus of t."""
    quant_nodes, float_nodes, outs, params = [helper.make_node("Neg", ["x"], ["t"], name="neg")], [], [], []
    float_nodes.append(quant_nodes[0])
    for k, (scales, axis) in enumerate(qs):
        scale = np.array(scales, np.float32)  # 0-d for a number
        params += [
            numpy_helper.from_array(scale, f"s{k}"),
            numpy_helper.from_array(np.zeros_like(scale, np.int8), f"z{k}"),
        ]
        extra = {} if axis is None else {"axis": axis}
        quant_nodes += [
            helper.make_node("QuantizeLinear", ["t", f"s{k}", f"z{k}"], [f"q{k}"], name=f"t_Q{k}", **extra),
            helper.make_node("DequantizeLinear", [f"q{k}", f"s{k}", f"z{k}"], [f"d{k}"], name=f"t_DQ{k}", **extra),
            helper.make_node("Relu", [f"d{k}"], [f"y{k}"], name=f"relu{k}"),
        ]
        float_nodes.append(helper.make_node("Relu", ["t"], [f"y{k}"], name=f"relu{k}"))
        outs.append(helper.make_tensor_value_info(f"y{k}", onnx.TensorProto.FLOAT, [1, 2, 3]))
    io = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 3])]
    return save_pair(tmp_path, float_nodes, quant_nodes, io, outs, params)


def checked_levels(paths, tmp_path, *xs):
    """check --min-levels 16 on one sample per array of ``xs``: its budget row."""
    files = []
    for k, x in enumerate(xs):
        np.savez(tmp_path / f"x{k}.npz", x=np.asarray(x, np.float32))
        files.append(str(tmp_path / f"x{k}.npz"))
    return graphscan.check(paths[1], float_path=paths[0], min_levels=16, inputs=files)["budgets"][0]


WIDE_AND_NARROW = [[[-10.0, 0.0, 10.0], [0.0, 1.0, 2.0]]]  # t's channels span 20 and 2, the whole 20


def test_a_tensor_that_two_per_tensor_qs_read_takes_the_larger_scale_whatever_their_order(tmp_path):
    """t spans 20 under Qs of scales 0.5 and 0.25: 40 and 80 levels; the fewest, 40, whichever Q comes last."""
    for order, name in ((0.5, 0.25), "big-first"), ((0.25, 0.5), "small-first"):
        folder = tmp_path / name
        folder.mkdir()
        paths = neg_pair(folder, *((scale, None) for scale in order))
        assert traced_rows(paths, np.array(WIDE_AND_NARROW, np.float32), folder)["neg"] == 40.0
        assert checked_levels(paths, folder, WIDE_AND_NARROW)["value"] == 40.0


def test_a_tensor_read_by_a_per_tensor_and_a_per_axis_q_takes_the_fewest_levels_either_gives(tmp_path):
    """Per tensor at 0.25: 20 / 0.25 = 80 levels; per axis at (0.5, 0.25): 40 and 2 / 0.25 = 8.
    The tensor's levels are the fewest, 8; then with the per-axis Q's steps made (0.05, 0.01):
    400 and 200, so the per-tensor Q's 80."""
    paths = neg_pair(tmp_path, (0.25, None), ([0.5, 0.25], 1))
    assert checked_levels(paths, tmp_path, WIDE_AND_NARROW)["value"] == 8.0
    (tmp_path / "fine").mkdir()
    paths = neg_pair(tmp_path / "fine", (0.25, None), ([0.05, 0.01], 1))
    assert checked_levels(paths, tmp_path / "fine", WIDE_AND_NARROW)["value"] == pytest.approx(80.0)


def test_a_per_axis_q_without_an_axis_attribute_counts_channels_along_axis_1(tmp_path):
    """ONNX's default axis is 1: channels span 20 and 2 in steps of 0.5 and 0.25, 40 and 8 levels."""
    paths = neg_pair(tmp_path, ([0.5, 0.25], None))
    assert traced_rows(paths, np.array(WIDE_AND_NARROW, np.float32), tmp_path)["neg"] == 8.0


def test_a_part_constant_on_each_sample_spans_what_it_takes_over_the_samples(tmp_path):
    """t = -x is -5 everywhere on one sample and -7 on the other: over both it spans 2, 8 steps
    of 0.25 (a sample's own range is empty, the samples' together are not)."""
    paths = neg_pair(tmp_path, (0.25, None))
    budget = checked_levels(paths, tmp_path, np.full((1, 2, 3), 5.0), np.full((1, 2, 3), 7.0))
    assert budget["value"] == 8.0 and budget["tensor"] == "t"


def test_min_levels_of_a_model_whose_quantized_tensors_never_vary_holds(tmp_path):
    """t = -5 everywhere on the only sample: no part varies, nothing to lose; the budget holds
    (its value infinite: null)."""
    paths = neg_pair(tmp_path, (0.25, None))
    budget = checked_levels(paths, tmp_path, np.full((1, 2, 3), 5.0))
    assert budget["value"] is None and budget["ok"] and budget["tensor"] is None


def test_every_input_of_a_concat_whose_qdq_reaches_an_output_is_an_output_tensor():
    """y = Concat(DQ(Q(a)), Transpose(DQ(Q(b)))): both a and b reach y, through the Concat's
    first and second input; c's DQ is an output itself; d's feeds a Relu first and reaches none."""
    nodes = []
    for t in ("a", "b", "c", "d"):
        chain, _ = qdq(t, "s", "zp")
        nodes += chain
    nodes += [
        helper.make_node("Transpose", ["b_dq"], ["bt"], perm=[0, 1]),
        helper.make_node("Concat", ["a_dq", "bt"], ["y"], axis=0),
        helper.make_node("Relu", ["d_dq"], ["w"]),
    ]
    graph = helper.make_graph(
        nodes,
        "outs",
        [helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, [2, 2]) for t in "abcd"],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in ("y", "c_dq", "w")],
    )
    found = levels.output_tensors(helper.make_model(graph))
    assert found == {"a": "y", "b": "y", "c": "c_dq"}


def test_a_per_axis_q_over_a_concat_counts_each_parts_channels_apart(tmp_path):
    """t = Concat(a, b, axis=2) under a Q with scales (0.5, 0.25) along axis 1. Part 0 (a = -xa)
    spans 20 and 2 in its channels: 40 and 8 levels; part 1 (b = Relu(xb)) spans 1 and 100:
    2 and 400. The fewest is part 1's 2, from b's Relu (over both parts at once, every channel
    would span 20 and 100: 40)."""
    qparams = [
        numpy_helper.from_array(np.array([0.5, 0.25], np.float32), "s"),
        numpy_helper.from_array(np.zeros(2, np.int8), "zp"),
    ]
    chain, dq = qdq("t", "s", "zp", axis=1)
    common = [
        helper.make_node("Neg", ["xa"], ["a"], name="neg"),
        helper.make_node("Relu", ["xb"], ["b"], name="relu"),
        helper.make_node("Concat", ["a", "b"], ["t"], name="join", axis=2),
    ]
    float_nodes = [*common, helper.make_node("Abs", ["t"], ["y"], name="abs")]
    quant_nodes = [*common, *chain, helper.make_node("Abs", [dq], ["y"], name="abs")]
    io = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 2, 3]) for n in ("xa", "xb")]
    out = [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 6])]
    paths = save_pair(tmp_path, float_nodes, quant_nodes, io, out, qparams)
    xa = -np.array([[[-10.0, 0.0, 10.0], [0.0, 1.0, 2.0]]], np.float32)
    xb = np.array([[[0.0, 0.5, 1.0], [0.0, 50.0, 100.0]]], np.float32)
    np.savez(tmp_path / "s.npz", xa=xa, xb=xb)
    answer = graphscan.check(paths[1], float_path=paths[0], min_levels=16, inputs=[str(tmp_path / "s.npz")])
    budget = answer["budgets"][0]
    assert budget["value"] == 2.0 and budget["tensor"] == "t" and budget["part"] == {"part": 1, "node": "relu"}


def test_a_q_that_reads_a_weight_is_no_quantized_activation():
    """y = MatMul(DQ(Q(x)), DQ(Q(w))) with w an initializer (a float weight quantized by a Q
    node): x's Q is an activation's, w's a constant's, which levels leave to its own scale."""
    w = numpy_helper.from_array(np.full((4, 4), 0.01, np.float32), "w")
    x_chain, x_dq = qdq("x", "s", "zp")
    w_chain, w_dq = qdq("w", "s", "zp")
    qparams = [numpy_helper.from_array(np.array(0.5, np.float32), "s"), numpy_helper.from_array(np.int8(0), "zp")]
    graph = helper.make_graph(
        [*x_chain, *w_chain, helper.make_node("MatMul", [x_dq, w_dq], ["y"])],
        "weights",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
        [w, *qparams],
    )
    assert list(levels.quantized_activations(helper.make_model(graph))) == ["x"]
