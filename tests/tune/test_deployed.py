"""tune's measurements (issue 18): each figure equals an independent measurement of
the written model, as it will be deployed."""

from pathlib import Path

import numpy as np
import onnx
import pytest

import gen_models
import graphscan
import graphscan_ort.tune.deployed as deployed
from graphscan_ort.shared.options import Named, Timing
from tests.helpers import small_cnn_and_qdq


@pytest.fixture(scope="module")
def cnn_pair(tmp_path_factory):
    """A small residual CNN and its onnxruntime QDQ model, with two samples."""
    folder = tmp_path_factory.mktemp("cnn")
    fp32, quant = small_cnn_and_qdq(folder)
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 3, 8, 8)).astype(np.float32)} for k in range(2)]
    paths = []
    for k, sample in enumerate(samples):
        np.savez(folder / f"s{k}.npz", **sample)
        paths.append(str(folder / f"s{k}.npz"))
    return str(fp32), str(quant), samples, paths


def test_every_figure_equals_an_independent_measurement(cnn_pair):
    fp32, quant, samples, paths = cnn_pair
    reference, candidate = Named(onnx.load(fp32), fp32), Named(onnx.load(quant), quant)
    measured = deployed.measure_candidate(reference, candidate, samples, timing=Timing(3))
    # The SQNR: check's min_sqnr, as deployed (default session), on the same samples.
    budget = graphscan.check(quant, float_path=fp32, min_sqnr=-100, inputs=paths)["budgets"][0]
    assert measured["sqnr_db"] == pytest.approx(budget["value"], abs=1e-6)
    # The kernels: the runtime command at onnxruntime's default level.
    classes = graphscan.runtime(quant, level="all")["classes"]
    assert measured["int8_kernels"] == classes["int8"]
    running = classes["int8"] + classes["int8_data"] + classes["float"]
    assert measured["int8_fraction"] == (classes["int8"] + classes["int8_data"]) / running
    assert measured["bytes"] == len(Path(quant).read_bytes())
    # The speedup is the median of the run-by-run ratios, not float_ms / ms (a ratio of medians,
    # which differs whenever the median runs of the two models fall in different rounds).
    ratios = measured["speedup_runs"]
    assert measured["ms"] > 0 and len(ratios) == 3
    assert measured["speedup"] == pytest.approx(sorted(ratios)[1])
    assert all(isinstance(count, int) and count > 0 for count in measured["wrapped_but_float"].values())


@pytest.mark.parametrize("unnamed", [False, True], ids=["named", "a-node-unnamed"])
def test_a_rows_kernels_are_read_off_its_own_accuracy_session_and_equal_runtimes(
    cnn_pair, tmp_path, monkeypatch, unnamed
):
    """Once the float outputs are kept, a row's accuracy and kernels take one onnxruntime
    session: the candidate's, which saves the graph it optimized for the kernels. With a node
    unnamed (classify names it: the saved graph would not carry its name) classify opens its
    own. Either way the kernels are those the runtime command finds at level all."""
    import onnxruntime

    fp32, quant, samples, _ = cnn_pair
    model = onnx.load(quant)
    if unnamed:
        next(n for n in model.graph.node if n.op_type == "Conv").name = ""
        quant = str(tmp_path / "unnamed.onnx")
        onnx.save(model, quant)
    reference, candidate = Named(onnx.load(fp32), fp32), Named(model, quant)
    kept = {}
    deployed.accuracy_figures(reference, candidate, samples, references=kept)  # the float outputs, kept
    opened = []
    made = onnxruntime.InferenceSession

    def counted(*args, **kwargs):
        opened.append(args)
        return made(*args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", counted)
    figures = deployed.accuracy_figures(reference, candidate, samples, references=kept)
    assert len(opened) == (2 if unnamed else 1)
    classes = graphscan.runtime(quant, level="all")["classes"]
    assert figures["int8_kernels"] == classes["int8"] > 0
    assert figures["wrapped_but_float"] == deployed.kernel_counts(model, quant, "all")["wrapped_but_float"]


def test_a_graph_the_accuracy_session_cannot_save_leaves_the_kernels_to_classify(cnn_pair, tmp_path, monkeypatch):
    """Where onnxruntime cannot write the optimized graph (here a folder that is not there; a
    full disk alike) it fails the session as if the model did not run: the row is measured
    again without saving, and classify's own session finds the kernels (and, were saving
    broken there too, says so with exit 3), the same figures as a row whose graph was saved."""
    import contextlib

    fp32, quant, samples, _ = cnn_pair
    reference, candidate = Named(onnx.load(fp32), fp32), Named(onnx.load(quant), quant)
    saved = deployed.accuracy_figures(reference, candidate, samples)

    @contextlib.contextmanager
    def gone(prefix):
        yield str(tmp_path / "not-there")

    monkeypatch.setattr(deployed, "temporary_folder", gone)
    unsaved = deployed.accuracy_figures(reference, candidate, samples)
    assert unsaved == saved and unsaved["int8_kernels"] > 0


def counted_sessions(monkeypatch):
    """onnxruntime.InferenceSession recording the arguments of each session built."""
    import onnxruntime

    opened, made = [], onnxruntime.InferenceSession

    def counted(*args, **kwargs):
        opened.append(args)
        return made(*args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", counted)
    return opened


@pytest.mark.parametrize(
    "race",
    [None, deployed.Race(lambda speed: None), deployed.Race(lambda speed: "raced")],
    ids=["no-race", "kept", "raced"],
)
def test_a_measured_row_is_one_session_for_its_kernels_its_time_and_its_accuracy(cnn_pair, monkeypatch, race):
    """With the float outputs kept and the float model's timing session open, a row's kernels,
    timing and accuracy (unless raced) take one session of the candidate, and its figures are
    the runtime command's kernels and the accuracy of a measurement of its own."""
    fp32, quant, samples, _ = cnn_pair
    reference, candidate = Named(onnx.load(fp32), fp32), Named(onnx.load(quant), quant)
    kept = {}
    alone = deployed.accuracy_figures(reference, candidate, samples, references=kept)
    float_session = deployed.open_session(reference.model, "float", deployed.timing_options(deployed.DEPLOYED))
    opened = counted_sessions(monkeypatch)
    figures = deployed.measure_candidate(
        reference, candidate, samples, timing=Timing(2), references=kept, race=race, kept=deployed.Kept(float_session)
    )
    assert len(opened) == 1 and len(figures["speedup_runs"]) == 2
    assert figures["int8_kernels"] == graphscan.runtime(quant, level="all")["classes"]["int8"] > 0
    assert figures["sqnr_db"] == (None if figures.get("raced") else alone["sqnr_db"])


def test_a_row_whose_graph_cannot_be_saved_is_still_measured_with_classifys_kernels(cnn_pair, tmp_path, monkeypatch):
    """Where the measured session cannot save its optimized graph (a folder not there, a full
    disk alike), it is opened without saving and classify's own session finds the kernels:
    the same kernels and accuracy as a row whose graph was saved."""
    import contextlib

    fp32, quant, samples, _ = cnn_pair
    reference, candidate = Named(onnx.load(fp32), fp32), Named(onnx.load(quant), quant)
    saved = deployed.measure_candidate(reference, candidate, samples, timing=Timing(1))

    @contextlib.contextmanager
    def gone(prefix):
        yield str(tmp_path / "not-there")

    monkeypatch.setattr(deployed, "temporary_folder", gone)
    opened = counted_sessions(monkeypatch)
    unsaved = deployed.measure_candidate(reference, candidate, samples, timing=Timing(1))
    steady = ("int8_kernels", "int8_fraction", "wrapped_but_float", "sqnr_db", "metric_value", "plan")
    assert {key: unsaved[key] for key in steady} == {key: saved[key] for key in steady}
    assert len(opened) > 2  # the unsaved session, classify's own, the float model's


def relu_kept_between_convs(folder, overrides):
    """Conv, Relu, Conv quantized by onnxruntime with the Relu kept in the QDQ graph
    (QDQKeepRemovableActivations) and ``overrides``, ranges by tensor (c: the Relu's input,
    r: its output): the model file."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
               for n, s in (("w1", (8, 3, 3, 3)), ("w2", (8, 8, 3, 3)))]  # fmt: skip
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], weights,
    )  # fmt: skip
    fp32 = folder / "float.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), fp32)

    class Samples(CalibrationDataReader):
        def __init__(self):
            rngs = [np.random.default_rng(k) for k in range(3)]
            self.left = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for rng in rngs]

        def get_next(self):
            return self.left.pop() if self.left else None

    extra = {"QDQKeepRemovableActivations": True}
    if overrides:
        ranges = {t: [{"rmin": np.float32(lo), "rmax": np.float32(hi)}] for t, (lo, hi) in overrides.items()}
        extra["TensorQuantOverrides"] = ranges
    path = folder / f"q{len(list(folder.glob('q*.onnx')))}.onnx"
    with gen_models.quiet_quantizer():
        quantize_static(str(fp32), str(path), Samples(), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, extra_options=extra)  # fmt: skip
    return str(path)


def optimized_operators(path, folder):
    """The operators of the graph onnxruntime saves after optimizing the model at ``path``
    (its defaults: level all), read by onnxruntime itself, not by graphscan."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(folder / (Path(path).stem + "-optimized.onnx"))
    onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node]


def test_models_alike_but_for_values_run_one_plan_or_two_as_their_zero_points_say(tmp_path):
    """Three models that differ in initializer values alone (bias.same_graph): the Relu's
    input and output ranged alike from 0 by calibration, both from 0 to 2 by overrides
    (other scales, the same zero point: uint8's least), and the output from -1 to 4.
    onnxruntime drops a Relu whose QuantizeLinear's zero point is its type's least, so the
    first two run one plan and the third runs the Relu: plan_digest is one for the first two
    and another for the third, as onnxruntime's own optimized graphs are."""
    from graphscan_ort.tune.bias import same_graph

    ranges = ({}, {"c": (0.0, 2.0), "r": (0.0, 2.0)}, {"r": (-1.0, 4.0)})
    paths = [relu_kept_between_convs(tmp_path, overrides) for overrides in ranges]
    models = [onnx.load(p) for p in paths]
    assert all(same_graph(m, models[0]) for m in models) and len({p.read_bytes() for p in map(Path, paths)}) == 3
    operators = [optimized_operators(p, tmp_path) for p in paths]
    plans = [deployed.kernel_counts(m, p, "all")["plan"] for m, p in zip(models, paths, strict=True)]
    assert operators[0] == operators[1] and "Relu" not in operators[0] and "Relu" in operators[2]
    assert plans[0] == plans[1] != plans[2]
