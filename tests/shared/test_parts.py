"""Parts of a tensor (graphscan_ort/shared/parts.py): the elements a Concat joined, traced
through Concat, Split, Reshape, Transpose, Squeeze and Unsqueeze, and the output SQNR judged
by its worst part. Every expected partition is written by hand from how the model was built,
and every SQNR computed in numpy from the two models' outputs."""

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphscan_ort.shared import metrics, parts, sessions
from tests import parts_models


def model_of(nodes, inputs, output, shape, inits=(), opset=17):
    graph = helper.make_graph(
        nodes,
        "parts",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, s) for name, s in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)],
        list(inits),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def const(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def labels_of(model, output, feeds):
    return parts.TensorParts(model, [output]).labels(feeds)[output]


def test_a_concat_on_axis_1_labels_its_inputs_rows():
    model = model_of(
        [
            helper.make_node("Relu", ["a"], ["ra"], name="boxes"),
            helper.make_node("Sigmoid", ["b"], ["sb"], name="probs"),
            helper.make_node("Concat", ["ra", "sb"], ["y"], name="cat", axis=1),
        ],
        {"a": [1, 4, 6], "b": [1, 3, 6]},
        "y",
        [1, 7, 6],
    )
    found = parts.TensorParts(model, ["y"])
    feeds = {"a": np.zeros((1, 4, 6), np.float32), "b": np.zeros((1, 3, 6), np.float32)}
    expected = np.zeros((1, 7, 6), np.int64)
    expected[:, 4:, :] = 1
    np.testing.assert_array_equal(found.labels(feeds)["y"], expected)
    assert found.sources["y"] == ["boxes", "probs"]


def test_parts_follow_reshape_and_transpose_index_by_index():
    """y = Transpose(Reshape(Concat(a, b, axis=0), [2, 5]), [1, 0]): a's 4 values then b's 6,
    laid out row-major in a 2x5, then transposed."""
    model = model_of(
        [
            helper.make_node("Neg", ["a"], ["na"], name="from_a"),
            helper.make_node("Abs", ["b"], ["nb"], name="from_b"),
            helper.make_node("Concat", ["na", "nb"], ["c"], name="cat", axis=0),
            helper.make_node("Reshape", ["c", "shape"], ["r"], name="reshape"),
            helper.make_node("Transpose", ["r"], ["y"], name="transpose", perm=[1, 0]),
        ],
        {"a": [4], "b": [6]},
        "y",
        [5, 2],
        [const("shape", [2, 5])],
    )
    flat = np.array([0] * 4 + [1] * 6)
    expected = flat.reshape(2, 5).T
    np.testing.assert_array_equal(
        labels_of(model, "y", {"a": np.zeros(4, np.float32), "b": np.zeros(6, np.float32)}), expected
    )


def test_a_split_then_concat_in_the_other_order_gives_two_parts():
    """x split in halves and joined back reversed: the first half of y is x's second half."""
    model = model_of(
        [
            helper.make_node("Relu", ["x"], ["rx"], name="relu"),
            helper.make_node("Split", ["rx", "sizes"], ["lo", "hi"], name="split", axis=0),
            helper.make_node("Concat", ["hi", "lo"], ["u"], name="cat", axis=0),
            helper.make_node("Unsqueeze", ["u", "axes"], ["y"], name="unsqueeze"),
        ],
        {"x": [6]},
        "y",
        [1, 6],
        [const("sizes", [2, 4]), const("axes", [0])],
    )
    found = parts.TensorParts(model, ["y"])
    np.testing.assert_array_equal(found.labels({"x": np.zeros(6, np.float32)})["y"], [[0, 0, 0, 0, 1, 1]])
    assert found.sources["y"] == ["relu", "relu"]


def test_nested_concats_give_each_innermost_input_its_own_part():
    model = model_of(
        [
            helper.make_node("Concat", ["a", "b"], ["ab"], name="inner", axis=0),
            helper.make_node("Concat", ["ab", "c"], ["y"], name="outer", axis=0),
        ],
        {"a": [1], "b": [2], "c": [3]},
        "y",
        [6],
    )
    feeds = {k: np.zeros(n, np.float32) for k, n in (("a", 1), ("b", 2), ("c", 3))}
    np.testing.assert_array_equal(labels_of(model, "y", feeds), [0, 1, 1, 2, 2, 2])


@pytest.mark.parametrize(
    "op",
    [pytest.param("Add", id="add-stops-the-trace"), pytest.param("Identity", id="identity-stops-the-trace")],
)
def test_any_other_operator_stops_the_trace(op):
    inputs = ["c", "c"] if op == "Add" else ["c"]
    model = model_of(
        [helper.make_node("Concat", ["a", "b"], ["c"], name="cat", axis=0), helper.make_node(op, inputs, ["y"])],
        {"a": [2], "b": [2]},
        "y",
        [4],
    )
    found = parts.TensorParts(model, ["y"])
    assert found.labels({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)})["y"] is None  # one part


def two_part_model(scale):
    """y = Concat(boxes = x * scale, probs = Sigmoid(x)) on axis 0; q: the same with probs
    rounded to a step of 1.27, as one int8 scale set by the boxes would."""
    return model_of(
        [
            helper.make_node("Mul", ["x", "scale"], ["boxes"], name="box_pixels"),
            helper.make_node("Sigmoid", ["x"], ["probs"], name="cls_sigmoid"),
            helper.make_node("Concat", ["boxes", "probs"], ["y"], name="cat", axis=0),
        ],
        {"x": [8]},
        "y",
        [16],
        [numpy_helper.from_array(np.array(scale, np.float32), "scale")],
    )


def test_the_worst_part_is_heard_where_the_pooled_sqnr_is_not():
    """A collapsed probability part hides under the boxes' energy in the pooled figure."""
    x = np.linspace(-3, 3, 8).astype(np.float32)
    float_model = two_part_model(100.0)
    f = np.concatenate([x * 100.0, 1 / (1 + np.exp(-x))]).astype(np.float64)
    q = f.copy()
    q[:8] += 0.4  # a box error of 0.4 pixels
    q[8:] = np.round(q[8:] / 1.27) * 1.27  # every probability 0 or 1.27
    layout = metrics.output_layout(float_model, ["y"], [{"x": x}])
    figures = metrics.OutputNoise([[f]], layout).figures([[q]])
    box_db = 10 * math.log10(np.sum(f[:8] ** 2) / np.sum((f[:8] - q[:8]) ** 2))
    prob_db = 10 * math.log10(np.sum(f[8:] ** 2) / np.sum((f[8:] - q[8:]) ** 2))
    pooled_db = 10 * math.log10(np.sum(f**2) / np.sum((f - q) ** 2))
    assert prob_db < box_db
    assert figures.worst_db == pytest.approx(prob_db)
    assert figures.worst_part == {"output": "y", "part": 1, "node": "cls_sigmoid"}
    assert figures.pooled_db == pytest.approx(pooled_db)
    assert pooled_db > prob_db + 20  # what the pooled figure missed


def test_an_exact_part_is_never_the_worst_and_all_exact_is_exact():
    x = np.linspace(-3, 3, 8).astype(np.float32)
    layout = metrics.output_layout(two_part_model(10.0), ["y"], [{"x": x}])
    f = np.arange(1, 17, dtype=np.float64)
    q = f.copy()
    q[3] += 1.0  # only the first part moved
    figures = metrics.OutputNoise([[f]], layout).figures([[q]])
    assert figures.worst_part["part"] == 0 and not figures.exact
    assert metrics.OutputNoise([[f]], layout).figures([[f]]) == metrics.SqnrFigures(None, None, None, True)


def test_of_parts_at_the_same_sqnr_the_first_is_named_the_worst():
    """Both parts of y carry the same signal and noise: part 0 is named, in the Concat's order;
    made worse by a hair, part 1 is."""
    x = np.linspace(-3, 3, 8).astype(np.float32)
    layout = metrics.output_layout(two_part_model(1.0), ["y"], [{"x": x}])
    f = np.ones(16)
    q = f + 0.25
    assert metrics.OutputNoise([[f]], layout).figures([[q]]).worst_part["part"] == 0
    q[15] += 1e-6
    assert metrics.OutputNoise([[f]], layout).figures([[q]]).worst_part["part"] == 1


def if_model():
    """y = Concat(If(c, then: x[:k], else: x), x * 2): the If's branch and the bound its body
    reads from outside (k) decide the first part's length, k or 6 (a body's reads and an If's
    condition decide shapes by their values)."""
    then_branch = helper.make_graph(
        [helper.make_node("Slice", ["x", "zero", "k"], ["head"])],
        "then",
        [],
        [helper.make_tensor_value_info("head", TensorProto.FLOAT, [None])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["whole"])],
        "else",
        [],
        [helper.make_tensor_value_info("whole", TensorProto.FLOAT, [None])],
    )
    nodes = [
        helper.make_node("If", ["c"], ["chosen"], name="choose", then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Mul", ["x", "two"], ["doubled"], name="double"),
        helper.make_node("Concat", ["chosen", "doubled"], ["y"], name="cat", axis=0),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
        helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
    ]
    inits = [const("zero", [0]), numpy_helper.from_array(np.array(2, np.float32), "two")]
    graph = helper.make_graph(
        nodes, "if", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_labels_follow_an_ifs_condition_and_what_its_body_reads_from_outside():
    """One shape of inputs, x the same on every sample: the partition moves with k (read inside
    the then-branch) and with c (which branch runs), in any order."""
    found = parts.TensorParts(if_model(), ["y"])
    x = np.arange(6, dtype=np.float32)
    for c, k in ((True, 2), (True, 4), (False, 4), (True, 2), (False, 2)):
        labels = found.labels({"x": x, "k": np.array([k], np.int64), "c": np.array(c)})["y"]
        np.testing.assert_array_equal(labels, [0] * (k if c else 6) + [1] * 6)


def test_one_samples_paired_outputs_are_that_samples_own():
    """PairedOutputs.sample(k): sample k's float and quantized outputs and its parts' labels
    alone; its worst part by hand: part 0 of sample 1 is off by 1 on 6 and 8 (20 dB), part 1 exact."""
    x = np.linspace(-3, 3, 8).astype(np.float32)
    layout = metrics.output_layout(two_part_model(1.0), ["y"], [{"x": x}, {"x": x}])
    f = [np.array([6.0, 8.0] + [0.0] * 6 + [1.0] * 8), np.array([6.0, 8.0] + [0.0] * 6 + [2.0] * 8)]
    q = [f[0] + 0.5, f[1].copy()]
    q[1][0] += 1.0
    paired = metrics.PairedOutputs(metrics.FloatOutputs([[f[0]], [f[1]]], ("y",), layout), [[q[0]], [q[1]]])
    alone = paired.sample(1)
    assert (
        alone.figures().worst_db == pytest.approx(10 * math.log10(100 / 1)) and alone.figures().worst_part["part"] == 0
    )
    assert alone.candidate_by_name() == [{"y": q[1]}] and alone.reference.outputs == [[f[1]]]


def test_each_shape_deciding_input_of_the_common_operators_decides_the_parts():
    """A Split's sizes, a Tile's repeats, an Expand's shape and a Pad's pads read from an input:
    each such input decides the parts by its values; the data inputs, and Pad's constant value
    (a value, not a shape), do not."""
    i64 = [helper.make_tensor_value_info(n, TensorProto.INT64, [None]) for n in ("sizes", "repeats", "dims", "pads")]
    floats = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None]) for n in ("x", "fill")]
    nodes = [
        helper.make_node("Split", ["x", "sizes"], ["s0", "s1"]),
        helper.make_node("Tile", ["s0", "repeats"], ["tiled"]),
        helper.make_node("Expand", ["s1", "dims"], ["expanded"]),
        helper.make_node("Pad", ["x", "pads", "fill"], ["padded"]),
        helper.make_node("Concat", ["tiled", "expanded", "padded"], ["y"], axis=0),
    ]
    graph = helper.make_graph(nodes, "m", i64 + floats, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    assert parts.value_inputs(helper.make_model(graph), ["y"]) == {"sizes", "repeats", "dims", "pads"}


def test_labels_are_the_runtimes_and_kept_per_input_shape_where_only_floats_come_in(monkeypatch):
    """y = Concat(a, Reshape(b, Shape(b))): the floats' values reach no shape (Shape reads b's
    shape alone), so samples of one shape are labelled by one run, whatever their values."""
    model = model_of(
        [
            helper.make_node("Shape", ["b"], ["b_shape"]),
            helper.make_node("Reshape", ["b", "b_shape"], ["rb"]),
            helper.make_node("Concat", ["a", "rb"], ["y"], name="cat", axis=1),
        ],
        {"a": [1, "n"], "b": [1, 2]},
        "y",
        [1, None],
    )
    found = parts.TensorParts(model, ["y"])
    runs = []
    real = parts.TensorParts.run
    monkeypatch.setattr(parts.TensorParts, "run", lambda *args: runs.append(1) or real(*args))
    rng = np.random.default_rng(0)
    for n in (3, 3, 5):
        feeds = {"a": rng.normal(size=(1, n)).astype(np.float32), "b": rng.normal(size=(1, 2)).astype(np.float32)}
        np.testing.assert_array_equal(found.labels(feeds)["y"], [[0] * n + [1, 1]])
    assert len(runs) == 2  # once per shape


@pytest.mark.parametrize(
    "repeat", [pytest.param(False, id="k-moves-the-border"), pytest.param(True, id="k-sizes-both-parts")]
)
def test_labels_follow_an_input_whose_values_decide_the_parts(tmp_path, repeat):
    """y = Concat(x[:k] * 100, x[k:] * 2) (or x[:k] twice): one shape of inputs, and a partition
    per value of k, in any order."""
    parts_models.sliced_model(tmp_path / "m.onnx", False, repeat)
    found = parts.TensorParts(onnx.load(tmp_path / "m.onnx"), ["y"])
    x = np.zeros(parts_models.SIZE, np.float32)
    for k in (2, 6, 2, 3):
        labels = found.labels({"x": x, "k": np.array([k], np.int64)})["y"]
        np.testing.assert_array_equal(labels, parts_models.partition(k, repeat))


def test_the_inputs_whose_values_decide_the_parts_are_those_that_reach_a_shape():
    """k sets a Slice's end; f, cast to int64, a Reshape's shape; m's values only scale a part
    (Mul), and b reaches a Reshape through Shape, which reads its shape alone."""
    ints = [helper.make_tensor_value_info(name, TensorProto.INT64, [1]) for name in ("k", "m")]
    floats = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [None]) for name in ("x", "f", "b")]
    nodes = [
        helper.make_node("Slice", ["x", "zero", "k"], ["head"]),
        helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["head", "mf"], ["scaled"]),
        helper.make_node("Cast", ["f"], ["fi"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["x", "fi"], ["shaped"]),
        helper.make_node("Shape", ["b"], ["b_shape"]),
        helper.make_node("Reshape", ["b", "b_shape"], ["rb"]),
        helper.make_node("Concat", ["scaled", "shaped", "rb"], ["y"], axis=0),
    ]
    graph = helper.make_graph(
        nodes, "m", ints + floats, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])], [const("zero", [0])]
    )
    assert parts.value_inputs(helper.make_model(graph), ["y"]) == {"k", "f"}


def test_a_model_before_opset_9_is_one_part_per_output():
    model = model_of(
        [helper.make_node("Concat", ["a", "b"], ["y"], name="cat", axis=0)], {"a": [2], "b": [2]}, "y", [4], opset=8
    )
    found = parts.TensorParts(model, ["y"])
    assert found.labels({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)})["y"] is None
    assert found.sources["y"] == ["cat"]  # its one part holds the Concat's values, not its first input's


def test_the_labelled_copy_leaves_the_model_alone():
    model = two_part_model(1.0)
    before = model.SerializeToString()
    parts.TensorParts(model, ["y"]).labels({"x": np.zeros(8, np.float32)})
    assert model.SerializeToString() == before
    assert sessions.run_model(model, {"x": np.zeros(8, np.float32)}, "m")[0].shape == (16,)


def concat_of_two(first, second, axis):
    """Concat(a, b) on ``axis`` and the labels of its output by hand: a's elements 0, b's 1."""
    node = helper.make_node("Concat", ["a", "b"], ["c"], name="cat", axis=axis)
    labels = np.concatenate([np.zeros(first, np.int64), np.ones(second, np.int64)], axis=axis)
    return node, labels


def oldest_form(form):
    """(nodes after c = Concat(a [1, 2, 3], b [1, 1, 3], axis=1), initializers, y's labels by
    hand) of each form of a traced operator the tracer claims from opset 9 (MIN_OPSET) on:
    attributes where opsets before 13 have them (Split's sizes, Squeeze's and Unsqueeze's
    axes), Split's count of outputs from 18."""
    _, c = concat_of_two((1, 2, 3), (1, 1, 3), 1)
    if form == "split-sizes-attribute":  # rows 1 and 2 of c: a's second, b's
        return [helper.make_node("Split", ["c"], ["lo", "y"], axis=1, split=[1, 2])], [], c[:, 1:]
    if form == "split-equal-by-default":  # no sizes: three outputs of one row, the last b's
        return [helper.make_node("Split", ["c"], ["r0", "r1", "y"], axis=1)], [], c[:, 2:]
    if form == "split-num-outputs":  # from opset 18, the same by a count of outputs
        return [helper.make_node("Split", ["c"], ["r0", "r1", "y"], axis=1, num_outputs=3)], [], c[:, 2:]
    if form == "squeeze-unsqueeze-axes-attribute":  # [1, 3, 3] -> [1, 1, 3, 3] -> [1, 3, 3, 1] -> [3, 3, 1]
        nodes = [
            helper.make_node("Unsqueeze", ["c"], ["u"], axes=[1]),
            helper.make_node("Transpose", ["u"], ["t"], perm=[0, 2, 3, 1]),
            helper.make_node("Squeeze", ["t"], ["y"], axes=[0]),
        ]
        return nodes, [], c[0][:, :, np.newaxis]
    if form == "transpose-perm":  # not the default reversal
        nodes = [helper.make_node("Transpose", ["c"], ["y"], perm=[1, 2, 0])]
        return nodes, [], c.transpose(1, 2, 0)
    if form == "reshape-shape-input":  # [1, 3, 3] as [9, 1], row-major
        nodes = [helper.make_node("Reshape", ["c", "shape"], ["y"])]
        return nodes, [const("shape", [9, 1])], c.reshape(9, 1)
    raise AssertionError(form)


@pytest.mark.parametrize(
    ("form", "opset"),
    [
        pytest.param("split-sizes-attribute", 9, id="split-sizes-attribute-opset-9"),
        pytest.param("split-sizes-attribute", 11, id="split-sizes-attribute-opset-11"),
        pytest.param("split-equal-by-default", 9, id="split-equal-by-default-opset-9"),
        pytest.param("split-num-outputs", 18, id="split-num-outputs-opset-18"),
        pytest.param("squeeze-unsqueeze-axes-attribute", 9, id="squeeze-unsqueeze-axes-attribute-opset-9"),
        pytest.param("squeeze-unsqueeze-axes-attribute", 11, id="squeeze-unsqueeze-axes-attribute-opset-11"),
        pytest.param("transpose-perm", 9, id="transpose-perm-opset-9"),
        pytest.param("reshape-shape-input", 9, id="reshape-shape-input-opset-9"),
    ],
)
def test_each_oldest_form_of_a_traced_operator_is_followed_index_by_index(form, opset):
    """The labels by hand: c = Concat(a [1, 2, 3], b [1, 1, 3], axis=1) is rows [0, 0, 1], and
    each form moves those rows as numpy does."""
    nodes, inits, expected = oldest_form(form)
    concat, _ = concat_of_two((1, 2, 3), (1, 1, 3), 1)
    model = model_of([concat, *nodes], {"a": [1, 2, 3], "b": [1, 1, 3]}, "y", list(expected.shape), inits, opset)
    feeds = {"a": np.ones((1, 2, 3), np.float32), "b": np.ones((1, 1, 3), np.float32)}
    assert sessions.run_model(model, feeds, "m")[0].shape == expected.shape  # a valid model of that opset
    np.testing.assert_array_equal(labels_of(model, "y", feeds), expected)


def test_nodes_of_the_default_domain_spelled_ai_onnx_are_traced():
    node, expected = concat_of_two((2,), (3,), 0)
    node.domain = "ai.onnx"
    graph = helper.make_graph(
        [node],
        "m",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [s]) for n, s in (("a", 2), ("b", 3))],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("ai.onnx", 9)])
    feeds = {"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)}
    np.testing.assert_array_equal(labels_of(model, "c", feeds), expected)


def test_a_slice_of_opset_9_takes_its_bounds_from_attributes_so_no_input_decides_the_parts():
    """Slice before opset 10 has starts and ends as attributes: x, its data, decides nothing
    by its values; at opset 10 the same ends read from an input k do."""
    old = model_of(
        [
            helper.make_node("Slice", ["x"], ["head"], starts=[0], ends=[2]),
            helper.make_node("Concat", ["head", "x"], ["y"], axis=0),
        ],
        {"x": [6]},
        "y",
        [8],
        opset=9,
    )
    assert parts.value_inputs(old, ["y"]) == set()
    np.testing.assert_array_equal(labels_of(old, "y", {"x": np.zeros(6, np.float32)}), [0, 0] + [1] * 6)


@pytest.mark.parametrize(
    ("side", "bad"),
    [
        pytest.param("quantized", np.inf, id="quantized-part-infinite"),
        pytest.param("quantized", np.nan, id="quantized-part-nan"),
        pytest.param("float", np.inf, id="float-part-infinite"),
    ],
)
def test_a_part_whose_energy_is_not_finite_makes_the_worst_part_undefined(side, bad):
    """Part 0 alone is 20 dB by hand (signal 100, noise 1); part 1 holds a value that is not
    finite, so its SQNR is unknown and may be the worst: the figure is undefined (None, shown
    as null), never part 0's 20 dB, and no part is named."""
    x = np.linspace(-3, 3, 8).astype(np.float32)
    layout = metrics.output_layout(two_part_model(1.0), ["y"], [{"x": x}])
    f = np.array([6.0, 8.0, 0, 0, 0, 0, 0, 0] + [1.0] * 8)
    q = f.copy()
    q[0] += 1.0  # part 0: 10 log10((36 + 64) / 1) = 20 dB
    finite = metrics.OutputNoise([[f]], layout).figures([[q]])
    assert finite.worst_db == pytest.approx(20.0) and finite.worst_part["part"] == 0  # part 1 exact
    (f if side == "float" else q)[12] = bad
    figures = metrics.OutputNoise([[f]], layout).figures([[q]])
    assert (figures.worst_db, figures.worst_part, figures.pooled_db, figures.exact) == (None, None, None, False)
