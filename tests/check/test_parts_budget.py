"""check --min-sqnr judges the worst part of each output (issue 33): on a detector whose
output joins box pixels and class probabilities, onnxruntime's defaults collapse the
probabilities, which the pooled SQNR hides. Expected figures come from numpy on the two
models' outputs, with the partition known from how the model was built."""

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import graphscan
from tests import parts_models, yolo_like


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    """A YOLO-like float model, its onnxruntime-defaults quantization, and samples."""
    return yolo_like.collapsed_detector(tmp_path_factory.mktemp("detector"))


def outputs(path, paths):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [session.run(None, dict(np.load(p)))[0].astype(np.float64) for p in paths]


def sqnr(f, q):
    return 10 * math.log10(np.sum(f**2) / np.sum((f - q) ** 2))


def test_min_sqnr_is_the_worst_parts_and_names_it(detector):
    float_path, quant_path, paths = detector
    answer = graphscan.check(str(quant_path), float_path=str(float_path), min_sqnr=20.0, inputs=[str(paths[0])])
    (row,) = answer["budgets"]
    f, q = outputs(float_path, paths[:1])[0], outputs(quant_path, paths[:1])[0]
    boxes, probs = sqnr(f[:, :4], q[:, :4]), sqnr(f[:, 4:], q[:, 4:])
    assert probs < boxes  # the probabilities collapsed, the boxes did not
    assert row["value"] == pytest.approx(probs, abs=1e-6)
    assert row["worst_part"] == {"output": "output0", "part": 1, "node": "cls_sigmoid"}
    assert row["pooled_sqnr_db"] == pytest.approx(sqnr(f, q), abs=1e-6)
    assert row["pooled_sqnr_db"] > row["value"] + 10  # what one pooled figure hid
    assert not row["ok"] and not answer["ok"]


def test_min_levels_names_the_tensor_and_part_that_spans_the_fewest_steps(detector):
    """Independent: the class probabilities' float range over the Q's scale after the Concat."""
    float_path, quant_path, paths = detector
    answer = graphscan.check(str(quant_path), float_path=str(float_path), min_levels=16, inputs=[str(p) for p in paths])
    (row,) = answer["budgets"]
    quant = onnx.load(quant_path)
    (q,) = [n for n in quant.graph.node if n.op_type == "QuantizeLinear" and n.input[0].startswith("output0")]
    scale = float(numpy_helper.to_array(next(i for i in quant.graph.initializer if i.name == q.input[1])))
    probs = np.concatenate([f[:, 4:] for f in outputs(float_path, paths)], axis=None)
    assert row["value"] == pytest.approx((probs.max() - probs.min()) / scale, rel=1e-6)
    assert row["value"] < 1 and not row["ok"]
    assert row["tensor"] == q.input[0]
    assert row["part"] == {"part": 1, "node": "cls_sigmoid"}


def test_min_levels_holds_where_the_concat_is_kept_float(detector, tmp_path):
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tests.helpers import calibration_reader

    float_path, _, paths = detector
    fixed = tmp_path / "fixed.onnx"
    reader = calibration_reader(paths)
    quantize_static(str(float_path), str(fixed), reader, quant_format=QuantFormat.QDQ, nodes_to_exclude=["head_concat"])
    answer = graphscan.check(str(fixed), float_path=str(float_path), min_levels=16, inputs=[str(p) for p in paths])
    assert answer["budgets"][0]["value"] > 16 and answer["ok"]


def test_min_levels_needs_the_float_model(detector):
    _, quant_path, _ = detector
    with pytest.raises(graphscan.GraphscanError, match="min-levels needs --float"):
        graphscan.check(str(quant_path), min_levels=16)


def test_top1_is_refused_on_an_output_that_joins_parts(detector):
    float_path, quant_path, paths = detector
    with pytest.raises(graphscan.GraphscanError, match="output 'output0' joins 2 parts") as raised:
        graphscan.check(
            str(quant_path), float_path=str(float_path), min_metric=0.9, metric="top1", inputs=[str(paths[0])]
        )
    assert raised.value.exit_code == 2


@pytest.mark.parametrize(
    "repeat", [pytest.param(False, id="k-moves-the-border"), pytest.param(True, id="k-sizes-both-parts")]
)
@pytest.mark.parametrize("order", [pytest.param((2, 6), id="k-2-then-6"), pytest.param((6, 2), id="k-6-then-2")])
def test_min_sqnr_labels_each_sample_by_the_input_values_that_decide_its_parts(tmp_path, repeat, order):
    """y = Concat(x[:k] * 100, x[k:] * 2) (or x[:k] twice): which values are part 0 depends on
    k's value, so two samples of one shape have two partitions; the figure is the same in either
    order and equals numpy's on the partitions known by hand."""
    float_path, quant_path = tmp_path / "float.onnx", tmp_path / "quant.onnx"
    parts_models.sliced_model(float_path, False, repeat)
    parts_models.sliced_model(quant_path, True, repeat)
    paths = [parts_models.sample(tmp_path, k) for k in order]
    answer = graphscan.check(str(quant_path), float_path=str(float_path), min_sqnr=0.0, inputs=[str(p) for p in paths])
    (row,) = answer["budgets"]
    labels = [parts_models.partition(k, repeat) for k in order]
    expected, part = parts_models.worst_part_db(outputs(float_path, paths), outputs(quant_path, paths), labels)
    assert row["value"] == pytest.approx(expected, abs=1e-9)
    assert row["worst_part"] == {"output": "y", "part": part, "node": ["big_part", "small_part"][part]}


@pytest.mark.parametrize(
    ("float_factor", "quant_factor"),
    [pytest.param(2.0, math.inf, id="quantized-part-infinite"), pytest.param(math.inf, 2.0, id="float-part-infinite")],
)
def test_a_part_whose_energy_is_not_finite_leaves_min_sqnr_undefined_and_broken(tmp_path, float_factor, quant_factor):
    """y = Concat(x * 100 + offset, x * factor): part 0 alone has a finite SQNR (offset 1 against
    0), part 1 is infinite in one model: the worst part is undefined, not part 0's figure."""
    float_path, quant_path, sample = tmp_path / "float.onnx", tmp_path / "quant.onnx", tmp_path / "x.npz"
    parts_models.two_parts(float_path, 0.0, float_factor)
    parts_models.two_parts(quant_path, 1.0, quant_factor)
    np.savez(sample, x=np.array([0.5, -1.0, 0.25, 2.0], np.float32))
    f, q = outputs(float_path, [sample])[0], outputs(quant_path, [sample])[0]
    assert math.isfinite(sqnr(f[:4], q[:4])) and not np.isfinite(np.concatenate([f[4:], q[4:]])).all()
    answer = graphscan.check(str(quant_path), float_path=str(float_path), min_sqnr=-1000.0, inputs=[str(sample)])
    (row,) = answer["budgets"]
    assert (row["value"], row["worst_part"], row["pooled_sqnr_db"], row["ok"]) == (None, None, None, False)
    impact = graphscan.impact(str(float_path), str(quant_path), inputs=[str(sample)])
    assert (impact["output_sqnr_db"], impact["worst_part"], impact["deployed_output_sqnr_db"]) == (None, None, None)
