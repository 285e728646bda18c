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
