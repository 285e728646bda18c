"""One graph, many ranges (tune/requantize.py): a row made from another row's model is the file
quantize_static writes for the row's own arguments, byte for byte.

The reference is onnxruntime itself: every row is also quantized by quantize_static with its
arguments and its calibration cache (tune's ``quantize_candidate``), and the two files must be
the same bytes. Where the quantizer would make another graph (other tensors with ranges, an
override of a type or of a weight) the plan makes no model, and quantize_static makes the row.
"""

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import quantize_static
from onnxruntime.quantization.calibrate import TensorsData, load_tensors_data, save_tensors_data

import gen_models
import graphscan_ort.tune.requantize as requantize
from graphscan_ort.tune.candidates import (
    SampleReader,
    cache_path,
    calibration_key,
    keyword_arguments,
    quantize_candidate,
    quiet,
)
from graphscan_ort.tune.requantize import RangePlan, quantize_by_plan, structure_key


def head_model():
    """Conv with a bias, Clip(0, 6), MaxPool (its output takes its input's scale), Conv, Softmax
    (its output's range set to [0, 1] by the quantizer), Gemm with beta 0.5: the quantizer's
    other adjustments of ranges, and a bias scaled by beta."""
    rng = np.random.default_rng(3)
    inits = {
        "w1": rng.normal(0, 0.4, (6, 3, 3, 3)),
        "b1": rng.normal(0, 0.3, (6,)),
        "w2": rng.normal(0, 0.3, (4, 6, 1, 1)),
        "b2": rng.normal(0, 0.3, (4,)),
        "low": np.array(0.0),
        "high": np.array(6.0),
        "wg": rng.normal(0, 0.3, (16, 5)),
        "bg": rng.normal(0, 0.3, (5,)),
        "shape": np.array([1, 16]),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["c1", "low", "high"], ["r1"], name="clip1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], name="conv2"),
        helper.make_node("Softmax", ["c2"], ["s2"], name="softmax", axis=1),
        helper.make_node("Reshape", ["s2", "shape"], ["f2"], name="flat"),
        helper.make_node("Gemm", ["f2", "wg", "bg"], ["y"], name="gemm", beta=0.5),
    ]
    arrays = [numpy_helper.from_array(v.astype(np.int64 if k == "shape" else np.float32), k) for k, v in inits.items()]
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        arrays,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", gen_models.OPSET)])


# Each model with its input's shape: a residual CNN (Conv, BatchNormalization, Relu, Add, a
# Resize and a Concat whose Q/DQ share their inputs' scales, Gemm), an MLP (MatMul, Add, Relu),
# and the head above.
MODELS = {
    "cnn": (lambda: gen_models.build_cnn(2, channels=4, size=8, seed=0), (1, 3, 8, 8)),
    "mlp": (lambda: gen_models.build_mlp(3, 8, 0), (4, 8)),
    "head": (head_model, (1, 3, 4, 4)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model saved in a folder of its own with 6 seeded samples: that folder keeps its
    calibration caches (one per method and option, as tune keeps them), each calibrated once
    for every test of the module."""
    made = {}
    for name, (build, shape) in MODELS.items():
        folder = tmp_path_factory.mktemp(name)
        onnx.save(build(), folder / "model.onnx")
        rng = np.random.default_rng(11)
        samples = [{"x": (rng.standard_normal(shape) * rng.uniform(0.5, 2)).astype(np.float32)} for _ in range(6)]
        made[name] = (str(folder / "model.onnx"), samples, str(folder))
    return made


def quantized(case, settings, out):
    """quantize_static's own file for ``settings`` (JSON form) on ``case``, as tune quantizes a
    candidate (its calibration cache filled once, then read), and the ranges it read."""
    path, samples, folder = case
    quantize_candidate(path, str(out), settings, lambda: SampleReader(samples), folder)
    return load_tensors_data(cache_path(folder, calibration_key(settings)))


def plan_of(case, settings, tmp_path):
    """A plan from quantize_static's model for ``settings`` (the base); its ranges."""
    ranges = quantized(case, settings, tmp_path / "base.onnx")
    plan = RangePlan(case[0], onnx.load(tmp_path / "base.onnx"), settings, ranges)
    return plan, ranges


def written(model, path):
    """The bytes of ``model`` saved as onnxruntime's quantizer saves its model (onnx.save_model)."""
    onnx.save_model(model, path)
    return path.read_bytes()


def with_extra(settings, **options):
    """``settings`` with more ``extra_options``."""
    return {**settings, "extra_options": {**settings.get("extra_options", {}), **options}}


# The quantizer's settings: activation types, per-tensor and per-channel weights, symmetric and
# asymmetric activations (a removable Relu or Clip removed or kept), asymmetric 7-bit weights.
BASES = [
    pytest.param({"activation_type": "QUInt8", "per_channel": False}, id="u8-per-tensor"),
    pytest.param({"activation_type": "QInt8", "per_channel": True}, id="s8-per-channel"),
    pytest.param(
        {"activation_type": "QUInt8", "per_channel": True, "extra_options": {"ActivationSymmetric": True}},
        id="u8-per-channel-symmetric",
    ),
    pytest.param(
        {"activation_type": "QInt8", "per_channel": False, "extra_options": {"ActivationSymmetric": True}},
        id="s8-per-tensor-symmetric",
    ),
    pytest.param(
        {
            "activation_type": "QUInt8",
            "per_channel": False,
            "reduce_range": True,
            "extra_options": {"WeightSymmetric": False},
        },
        id="u8-asymmetric-7-bit-weights",
    ),
]

# Every way a row's ranges differ from its base's (MinMax), and whether its file must differ
# from the base's: tune's calibration methods and refinements, the same ranges again (a row
# bias-corrected after the quantizer: the base's own bytes), symmetric calibrated ranges (the
# same scales where the activations are symmetric anyway), one tensor's range overridden.
# Entropy is not asserted to differ: quantize_static calibrates it with as many quantized bins
# as bins (128), and onnxruntime 1.32 then gives MinMax's ranges.
ROWS = [
    ("Entropy", {}, None),
    ("Percentile", {}, True),
    ("Percentile", {"CalibPercentile": 99.9}, True),
    ("MinMax", {"CalibMovingAverage": True}, True),
    ("MinMax", {}, False),
    ("MinMax", {"CalibTensorRangeSymmetric": True}, "asymmetric"),
    ("MinMax", "override", True),
]


def row_settings(base, quantized_base, ranges, method, options):
    """``base`` calibrated by ``method`` with ``options``, or ("override") with the range of the
    middle tensor (by name) that has its own scale in ``quantized_base`` narrowed to
    [lowest / 3, highest / 2]."""
    if options != "override":
        return with_extra({**base, "calibrate_method": method}, **options)
    scales = {init.name for init in quantized_base.graph.initializer}
    own = [name for name in sorted(ranges.keys()) if f"{name}_scale" in scales]
    name = own[len(own) // 2]
    low, high = (float(np.asarray(v).item()) for v in ranges[name].range_value)
    return with_extra(base, TensorQuantOverrides={name: [{"rmin": low / 3, "rmax": high / 2}]})


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("given", BASES)
def test_every_row_that_differs_in_ranges_is_quantize_statics_own_file(models, model, given, tmp_path):
    """For each kind of row, the plan's model and quantize_static's file are the same bytes;
    the plan makes every one of them (never leaves one to quantize_static)."""
    base = {"quant_format": "QDQ", "weight_type": "QInt8", "calibrate_method": "MinMax", **given}
    plan, ranges = plan_of(models[model], base, tmp_path)
    assert plan.refused is None
    base_bytes = (tmp_path / "base.onnx").read_bytes()
    for method, options, changes in ROWS:
        settings = row_settings(base, plan.base, ranges, method, options)
        row_ranges = quantized(models[model], settings, tmp_path / "row.onnx")
        expected = (tmp_path / "row.onnx").read_bytes()
        made = plan.requantized(settings, row_ranges)
        assert made is not None, (method, options)
        assert written(made, tmp_path / "made.onnx") == expected, (method, options)
        if changes == "asymmetric":
            changes = not base.get("extra_options", {}).get("ActivationSymmetric")
        assert changes is None or (expected != base_bytes) == changes, (method, options)


def test_a_bias_too_small_for_int32_widens_its_weight_as_the_quantizer_does(models, tmp_path):
    """conv2's input given the range [0, 1e-7]: input scale times weight scale is too small for
    its int32 bias, so the quantizer widens the weight's scale and quantizes the weight again;
    the plan's weight is the quantizer's, where its base's was not widened."""
    base = {"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8", "calibrate_method": "MinMax"}
    plan, _ = plan_of(models["head"], base, tmp_path)
    settings = with_extra(base, TensorQuantOverrides={"p1": [{"rmin": 0.0, "rmax": 1e-7}]})
    ranges = quantized(models["head"], settings, tmp_path / "row.onnx")
    made = plan.requantized(settings, ranges)
    assert made is not None
    assert written(made, tmp_path / "made.onnx") == (tmp_path / "row.onnx").read_bytes()
    weights = [
        {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}["w2_quantized"]
        for m in (plan.base, onnx.load(tmp_path / "row.onnx"))
    ]
    assert not np.array_equal(*weights)  # quantize_static did widen it


def test_ranges_of_other_tensors_are_left_to_quantize_static(models, tmp_path):
    """Which tensors have ranges decides which Relu the quantizer removes: with Relu outputs
    left unquantized (OpTypesToExcludeOutputQuantization), the last Relu goes into its
    producer's Q/DQ when its output has a range and stays when it has none. Ranges without it
    are another graph: the plan makes no model, and quantize_static's differs from the base's."""
    base = {
        "quant_format": "QDQ",
        "activation_type": "QUInt8",
        "weight_type": "QInt8",
        "calibrate_method": "MinMax",
        "extra_options": {"OpTypesToExcludeOutputQuantization": ["Relu"]},
    }
    plan, ranges = plan_of(models["mlp"], base, tmp_path)
    assert plan.refused is None
    fewer = TensorsData(ranges.calibration_method, {k: v for k, v in ranges.items() if k != "y"})
    assert plan.requantized(base, fewer) is None
    save_tensors_data(fewer, tmp_path / "fewer.json")
    with quiet():
        quantize_static(
            models["mlp"][0],
            tmp_path / "fewer.onnx",
            None,
            calibration_cache_path=tmp_path / "fewer.json",
            **keyword_arguments(base),
        )
    relus = [[n.op_type for n in m.graph.node].count("Relu") for m in (plan.base, onnx.load(tmp_path / "fewer.onnx"))]
    assert relus == [0, 1]


@pytest.mark.parametrize(
    "override",
    [
        pytest.param({"fc1_sum": [{"quant_type": "QUInt16"}]}, id="a-type"),
        pytest.param(
            {"fc1_sum": [{"rmin": -1.0, "rmax": 1.0, "convert": {"quant_type": "QUInt16"}}]}, id="a-conversion"
        ),
        pytest.param({"fc1_weight": [{"axis": 1}]}, id="an-axis"),
    ],
)
def test_an_override_of_more_than_a_range_has_no_structure_to_share(override):
    base = {"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8", "calibrate_method": "MinMax"}
    assert structure_key(base) is not None
    assert structure_key(with_extra(base, TensorQuantOverrides=override)) is None


def test_a_weights_own_range_overridden_is_left_to_quantize_static(models, tmp_path):
    """A weight's rmin/rmax set its quantized values: not an activation's range, no model."""
    base = {"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8", "calibrate_method": "MinMax"}
    plan, _ = plan_of(models["mlp"], base, tmp_path)
    settings = with_extra(base, TensorQuantOverrides={"fc1_weight": [{"rmin": -0.1, "rmax": 0.1}]})
    ranges = quantized(models["mlp"], settings, tmp_path / "row.onnx")
    assert plan.requantized(settings, ranges) is None
    weights = [
        {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}["fc1_weight_quantized"]
        for m in (plan.base, onnx.load(tmp_path / "row.onnx"))
    ]
    assert not np.array_equal(*weights)  # the reason: quantize_static quantized the weight otherwise


def test_a_base_that_sets_a_weights_own_range_makes_no_plan(models, tmp_path):
    """The base's weight quantized to an overridden range: a row without that override has
    other weight values, which the plan would not recompute, so the base makes no plan."""
    base = {"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8", "calibrate_method": "MinMax"}
    overridden = with_extra(base, TensorQuantOverrides={"fc1_weight": [{"rmin": -0.1, "rmax": 0.1}]})
    plan, ranges = plan_of(models["mlp"], overridden, tmp_path)
    assert plan.refused is not None
    assert plan.requantized(base, ranges) is None
    quantized(models["mlp"], base, tmp_path / "row.onnx")
    weights = [
        {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}["fc1_weight_quantized"]
        for m in (plan.base, onnx.load(tmp_path / "row.onnx"))
    ]
    assert not np.array_equal(*weights)  # the reason: without the override the weight is another


def test_a_plan_that_does_not_reproduce_its_base_is_never_used(models, tmp_path):
    """A base quantize_static made from other ranges than the plan is told: its self-check
    fails, and no row is made from it."""
    base = {"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8", "calibrate_method": "MinMax"}
    quantized(models["cnn"], {**base, "calibrate_method": "Percentile"}, tmp_path / "percentile.onnx")
    ranges = quantized(models["cnn"], base, tmp_path / "minmax.onnx")
    plan = RangePlan(models["cnn"][0], onnx.load(tmp_path / "percentile.onnx"), base, ranges)
    assert plan.refused is not None and "differs from the base's" in plan.refused
    assert plan.requantized(base, ranges) is None


def counting_quantizer(monkeypatch):
    """quantize_candidate as quantize_by_plan calls it, each call's output recorded."""
    calls = []

    def counted(prepared, output, *rest):
        calls.append(os.path.basename(output))
        quantize_candidate(prepared, output, *rest)

    monkeypatch.setattr(requantize, "quantize_candidate", counted)
    return calls


def test_tunes_rows_are_made_from_the_first_of_their_structure(models, tmp_path, monkeypatch):
    """quantize_by_plan: the first row of a structure is quantize_static's, every later one that
    differs only in ranges is made from it, each the bytes quantize_static writes for it; a row
    of another structure (per-channel weights) is quantize_static's again."""
    path, samples, folder = models["cnn"]
    calls = counting_quantizer(monkeypatch)
    plans = {}
    base = {"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8", "calibrate_method": "MinMax"}
    rows = [base, {**base, "calibrate_method": "Percentile"}, {**base, "calibrate_method": "Entropy"}, base]
    rows.append({**base, "per_channel": True})
    for k, settings in enumerate(rows):
        quantize_by_plan(plans, path, str(tmp_path / f"row{k}.onnx"), settings, lambda: SampleReader(samples), folder)
    assert calls == ["row0.onnx", "row4.onnx"]
    monkeypatch.undo()
    for k, settings in enumerate(rows):
        quantized(models["cnn"], settings, tmp_path / "reference.onnx")
        assert (tmp_path / f"row{k}.onnx").read_bytes() == (tmp_path / "reference.onnx").read_bytes(), k


def test_a_first_row_changed_after_the_quantizer_is_no_base(models, tmp_path, monkeypatch):
    """A post step (bias correction) changed the first row's file: the next row is
    quantize_static's, and becomes the base of the rows after it."""
    path, samples, folder = models["mlp"]
    calls = counting_quantizer(monkeypatch)
    plans = {}
    base = {"quant_format": "QDQ", "activation_type": "QInt8", "weight_type": "QInt8", "calibrate_method": "MinMax"}
    rows = [base, {**base, "calibrate_method": "Percentile"}, {**base, "calibrate_method": "Entropy"}]
    reader = lambda: SampleReader(samples)  # noqa: E731
    quantize_by_plan(plans, path, str(tmp_path / "row0.onnx"), rows[0], reader, folder)
    changed = onnx.load(tmp_path / "row0.onnx")
    changed.graph.initializer[0].raw_data = bytes(len(changed.graph.initializer[0].raw_data))
    onnx.save(changed, tmp_path / "row0.onnx")
    for k in (1, 2):
        quantize_by_plan(plans, path, str(tmp_path / f"row{k}.onnx"), rows[k], reader, folder)
    assert calls == ["row0.onnx", "row1.onnx"]
    monkeypatch.undo()
    quantized(models["mlp"], rows[2], tmp_path / "reference.onnx")
    assert (tmp_path / "row2.onnx").read_bytes() == (tmp_path / "reference.onnx").read_bytes()
