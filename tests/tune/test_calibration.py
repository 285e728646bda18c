"""Calibration in bounded memory (issue 33 item 5): onnxruntime's ranges, not its peak.

The reference is onnxruntime itself: ``quantize_static`` with a reader of every sample writes
its own calibration cache, calibrated all at once; calibration.py must write the same
ranges (and, for the histogram methods, the same histograms) one sample at a time, and its
peak must not grow with the number of samples the way onnxruntime's does.
"""

import contextlib
import gc
import tracemalloc
import warnings
from fractions import Fraction

import numpy as np
import onnx
import onnxruntime
import pytest
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, quantize_static
from onnxruntime.quantization.calibrate import load_tensors_data

import gen_models
import graphscan
import graphscan_ort.tune.calibration as calibration
import graphscan_ort.tune.candidates as candidates
import graphscan_ort.tune.command as tune
import graphscan_ort.tune.graph_segments as graph_segments
import graphscan_ort.tune.percentile_tails as percentile_tails


class Samples(CalibrationDataReader):
    """``count`` seeded inputs of ``shapes`` in turn, of seeded scales, each made when read
    (the reader holds none); a new reader per pass (a consumed one yields nothing)."""

    def __init__(self, count, shapes=((1, 3, 8, 8),), seed=7):
        self.rng, self.shapes, self.count, self.read = np.random.default_rng(seed), shapes, count, 0

    def get_next(self):
        if self.read == self.count:
            return None
        shape, self.read = self.shapes[self.read % len(self.shapes)], self.read + 1
        scale = self.rng.uniform(0.2, 3.0)  # no sample holds every extreme, the last least of all
        return {"x": (self.rng.standard_normal(shape) * scale).astype(np.float32)}


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A small residual CNN (Conv, Relu, Add, Resize, Concat, Gemm): tensors of several ranges."""
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    onnx.save(gen_models.build_cnn(2, channels=4, size=8, seed=0), path)
    return str(path)


# Every way tune calibrates (candidates.METHODS and REFINEMENTS), and the options they reach.
WAYS = [
    pytest.param("MinMax", {}, id="minmax"),
    pytest.param("MinMax", {"CalibTensorRangeSymmetric": True}, id="minmax-symmetric"),
    pytest.param("MinMax", {"CalibMovingAverage": True}, id="minmax-moving-average"),
    pytest.param("Percentile", {}, id="percentile"),
    pytest.param("Percentile", {"CalibPercentile": 99.9}, id="percentile-99.9"),
    pytest.param("Percentile", {"CalibTensorRangeSymmetric": False}, id="percentile-values-not-magnitudes"),
    pytest.param("Entropy", {}, id="entropy"),
    pytest.param("Distribution", {}, id="distribution"),
]


@pytest.mark.parametrize(("method", "options"), WAYS)
def test_the_ranges_are_onnxruntimes_own_over_every_sample_at_once(cnn, tmp_path, monkeypatch, method, options):
    """11 samples, MinMax fed 4 at a time (chunks of 4, 4, 3): every tensor's range, and every
    histogram, equal to those quantize_static computes holding all 11 at once."""
    monkeypatch.setattr(calibration, "MINMAX_CHUNK", 4)
    settings = {"calibrate_method": method, **({"extra_options": options} if options else {})}
    arguments = candidates.keyword_arguments(settings)
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    with gen_models.quiet_quantizer():
        calibration.calibrate(cnn, arguments, lambda: Samples(11), str(ours))
        quantize_static(cnn, str(tmp_path / "q.onnx"), Samples(11), calibration_cache_path=str(theirs), **arguments)
    mine, reference = load_tensors_data(ours), load_tensors_data(theirs)
    assert mine.calibration_method == reference.calibration_method == CalibrationMethod[method]
    assert list(mine.keys()) == list(reference.keys()) and len(reference.keys()) > 10
    for name, expected in reference.items():
        got = mine[name]
        assert sorted(got._attrs) == sorted(expected._attrs), name
        for attribute in expected._attrs:
            np.testing.assert_array_equal(getattr(got, attribute), getattr(expected, attribute), err_msg=name)


def test_the_samples_are_run_once_for_every_way_then_once_per_binning_and_every_way_keeps_onnxruntimes_ranges(
    cnn, tmp_path
):
    """Every way calibrated in turn into one folder (as tune's stages do on one prepared
    model): the samples are run once for the extremes, which MinMax reads whatever its
    options (symmetric, moving average), then once more (one group of tensors: this model's
    fit in one) only for the first histogram of each binning (magnitudes at 2048 bins:
    Percentile at 99.999, then 99.9, onnxruntime's Percentile being symmetric by default;
    values at 2048: the values-Percentile; values at 128: Entropy, then Distribution), and
    each cache still holds the ranges onnxruntime computes on its own."""
    readers = []

    def make_reader():
        readers.append(Samples(11))
        return readers[-1]

    passes = []
    for param in WAYS:
        method, options = param.values
        arguments = candidates.keyword_arguments(
            {"calibrate_method": method, **({"extra_options": options} if options else {})}
        )
        ours, theirs = tmp_path / f"ours-{param.id}.json", tmp_path / "theirs" / f"{param.id}.json"
        theirs.parent.mkdir(exist_ok=True)
        before = len(readers)
        with gen_models.quiet_quantizer():
            calibration.calibrate(cnn, arguments, make_reader, str(ours))
            quantize_static(cnn, str(tmp_path / "q.onnx"), Samples(11), calibration_cache_path=str(theirs), **arguments)
        passes.append(len(readers) - before)
        mine, reference = load_tensors_data(ours), load_tensors_data(theirs)
        assert list(mine.keys()) == list(reference.keys()) and len(reference.keys()) > 10
        for name, expected in reference.items():
            for attribute in expected._attrs:
                got, want = getattr(mine[name], attribute), getattr(expected, attribute)
                np.testing.assert_array_equal(got, want, err_msg=name)
    assert [p.id for p in WAYS] == [
        "minmax", "minmax-symmetric", "minmax-moving-average",
        "percentile", "percentile-99.9", "percentile-values-not-magnitudes", "entropy", "distribution",
    ]  # fmt: skip
    assert passes == [1, 0, 0, 1, 0, 1, 1, 0]
    assert sorted(f.name for f in tmp_path.glob("*.pickle") if f.name != "reductions.pickle") == [
        "histograms-values-128.pickle", "histograms-values-2048.pickle", "tails-2048.pickle"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("method", "options", "carried"),
    [pytest.param(*w.values, "typed", id=w.id) for w in WAYS if w.values[0] != "MinMax"]
    + [pytest.param("Percentile", {}, "untyped", id="percentile-untyped")]  # the tails' pass
    + [pytest.param("Entropy", {}, "untyped", id="entropy-untyped")],  # a whole histogram's
)
def test_tensors_fetched_one_at_a_time_count_the_histograms_onnxruntime_counts(
    cnn, tmp_path, monkeypatch, method, options, carried
):
    """GROUP_BYTES of 1: every calibrated tensor is a group of its own. Where onnx types the
    tensors carried between groups, the graph is cut into a segment a group and each sample
    is read once for the extremes and once for every group; where it does not (no types
    known), each group is a run of the graph cut to what it needs, a pass over the samples a
    group. The ranges are onnxruntime's own, holding all 5 samples at once, either way."""
    monkeypatch.setattr(calibration, "GROUP_BYTES", 1)
    if carried == "untyped":
        monkeypatch.setattr(graph_segments, "carried_types", lambda model, carried: {})
    arguments = candidates.keyword_arguments(
        {"calibrate_method": method, **({"extra_options": options} if options else {})}
    )
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    readers = []

    def make_reader():
        readers.append(Samples(5))
        return readers[-1]

    with gen_models.quiet_quantizer():
        calibration.calibrate(cnn, arguments, make_reader, str(ours))
        quantize_static(cnn, str(tmp_path / "q.onnx"), Samples(5), calibration_cache_path=str(theirs), **arguments)
    mine, reference = load_tensors_data(ours), load_tensors_data(theirs)
    assert len(readers) == 1 + (1 if carried == "typed" else len(reference.keys()))
    for name, expected in reference.items():
        for attribute in expected._attrs:
            np.testing.assert_array_equal(getattr(mine[name], attribute), getattr(expected, attribute), err_msg=name)


def carried_model():
    """x -> Relu -> Split in two (one node, its outputs in two groups; the second read by no
    node, only fetched) -> the first Conv'd and joined to itself; the Relu's output is added
    back at the end (a skip carried past every segment) and its Shape (int64) reshapes the
    sum."""
    h = onnx.helper
    rng = np.random.default_rng(0)
    weight = h.make_tensor("w", onnx.TensorProto.FLOAT, [2, 2, 3, 3], rng.standard_normal(36).astype(np.float32))
    nodes = [
        h.make_node("Relu", ["x"], ["relu"]),
        h.make_node("Split", ["relu"], ["left", "right"], axis=1),
        h.make_node("Conv", ["left", "w"], ["left_conv"], pads=[1, 1, 1, 1]),
        h.make_node("Shape", ["relu"], ["relu_shape"]),
        h.make_node("Concat", ["left_conv", "left"], ["joined"], axis=1),
        h.make_node("Add", ["joined", "relu"], ["summed"]),
        h.make_node("Reshape", ["summed", "relu_shape"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "carried",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 6, 6])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [weight],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])


def test_a_segment_a_group_runs_each_node_once_and_fetches_what_one_run_of_the_graph_makes(monkeypatch):
    """One group a tensor, in the graph's order (GROUP_BYTES of 1): the segments run each node
    exactly once between them, and each group's arrays are bit for bit those one session of
    the whole graph makes, the graph input, both outputs of one node, an int64 shape and a
    tensor carried past every segment among them."""
    monkeypatch.setattr(calibration, "GROUP_BYTES", 1)
    model = carried_model()
    names = ["x", "relu", "left", "right", "left_conv", "relu_shape", "joined", "summed", "y"]
    extremes = {name: calibration.Extremes((1,), np.dtype(np.float32)) for name in names}
    groups = calibration.fetch_groups(model, names, extremes)
    assert len(groups) == len(names)
    segments = graph_segments.cut_segments(model, groups)
    ran = [node.output[0] for segment in segments for node in segment.model.graph.node]
    assert sorted(ran) == sorted(node.output[0] for node in model.graph.node)
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 4, 6, 6)).astype(np.float32)} for k in range(2)]
    fetched = list(calibration.grouped_tensors(model, names, extremes, lambda: calibration.ListReader(samples), None))
    whole = onnx.ModelProto()
    whole.CopyFrom(model)
    del whole.graph.output[:]
    whole.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in names if name != "x")
    session = calibration.calibration_session(whole, None)
    expected = [
        [(name, array)]
        for sample in samples
        for name, array in [("x", sample["x"]), *zip(names[1:], session.run(names[1:], sample), strict=True)]
    ]
    assert [[name for name, _ in group] for group in fetched] == [[name for name, _ in group] for group in expected]
    for got, want in zip(fetched, expected, strict=True):
        assert got[0][1].dtype == want[0][1].dtype
        np.testing.assert_array_equal(got[0][1], want[0][1], err_msg=got[0][0])


@pytest.mark.parametrize("fed", [True, False], ids=["sample-overrides", "default"])
def test_an_input_with_an_initializer_is_the_samples_where_it_gives_one_else_the_default(monkeypatch, fed):
    """A graph input that is also an initializer (its default) read by a later segment: the
    segments fetch what one session of the whole graph makes from the same sample, the
    sample's value where it gives one, the initializer's where it does not."""
    monkeypatch.setattr(calibration, "GROUP_BYTES", 1)
    h = onnx.helper
    scale = np.float32(3.0)
    graph = h.make_graph(
        [h.make_node("Relu", ["x"], ["relu"]), h.make_node("Mul", ["relu", "scale"], ["y"])],
        "default",
        [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in (("x", [2, 3]), ("scale", []))],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.array(scale), "scale")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    names = ["relu", "y"]
    extremes = {name: calibration.Extremes((1,), np.dtype(np.float32)) for name in names}
    sample = {"x": np.arange(-3, 3, dtype=np.float32).reshape(2, 3)}
    if fed:
        sample["scale"] = np.array(-2.0, np.float32)
    fetched = list(calibration.grouped_tensors(model, names, extremes, lambda: calibration.ListReader([sample]), None))
    whole = onnx.ModelProto()
    whole.CopyFrom(model)
    whole.graph.output.extend([h.make_empty_tensor_value_info("relu")])
    ran = calibration.calibration_session(whole, None).run(["y", "relu"], sample)
    expected = dict(zip(["y", "relu"], ran, strict=True))
    assert [name for group in fetched for name, _ in group] == names
    for group in fetched:
        for name, array in group:
            np.testing.assert_array_equal(array, expected[name], err_msg=name)


def test_tensors_carried_between_segments_are_typed_as_declared_and_inferred_only_where_not(monkeypatch):
    """The model's own declarations type the carried tensors; onnx's shape inference (a copy
    of the whole model) runs only where one is undeclared, and finds it."""
    model = carried_model()
    inferred = []
    element_types = graph_segments.element_types
    monkeypatch.setattr(graph_segments, "element_types", lambda m: inferred.append(m) or element_types(m))
    types = graph_segments.carried_types(model, {"relu", "relu_shape"})  # declares neither
    assert (types["relu"], types["relu_shape"]) == (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64)
    assert len(inferred) == 1
    typed = onnx.shape_inference.infer_shapes(model)
    inferred.clear()
    types = graph_segments.carried_types(typed, {"relu", "relu_shape"})
    assert (types["relu"], types["relu_shape"]) == (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64) and not inferred


@pytest.mark.parametrize("bad", [pytest.param(-1.0, id="nan"), pytest.param(0.0, id="infinity")])
def test_a_tensor_that_is_not_finite_inside_the_graph_is_refused_by_name(tmp_path, bad):
    """Log of one -1 (NaN) or of one 0 (minus infinity) among positive inputs: the histogram
    way refuses a tensor it reaches by name (the first the calibrator lists: the output or the
    Log's, both hold it), as a NaN or an infinity would make its bins
    meaningless, whatever rule a reduction has for NaN."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Log", ["x"], ["logged"]), helper.make_node("MatMul", ["logged", "w"], ["y"])]
    w = onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w],
    )  # fmt: skip
    path = tmp_path / "log.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.left = [{"x": np.array([[1.0, 2.0, bad, 3.0]], np.float32)}]

        def get_next(self):
            return self.left.pop() if self.left else None

    arguments = candidates.keyword_arguments({"calibrate_method": "Percentile"})
    with pytest.raises(ValueError, match=r"^(logged|y): range of \[.*\] is not finite$"):
        calibration.calibrate(str(path), arguments, Reader, str(tmp_path / "c.json"))


def hard_arrays():
    """Arrays where a bin number is easiest to get wrong: every edge itself and its float32
    neighbours, a range so narrow that a bin is 3 float32 steps wide (narrower, numpy refuses
    the bins), zeros alone (numpy widens that range by 0.5 each way), negatives only, a wide
    spread of magnitudes, and more elements than one block."""
    rng = np.random.default_rng(3)
    wide = (rng.standard_normal(20000) * np.exp(rng.uniform(-12, 12, 20000))).astype(np.float32)
    edges = np.histogram_bin_edges(wide, 2048, range=(-np.abs(wide).max(), np.abs(wide).max()))
    near = np.concatenate([edges, np.nextafter(edges, np.inf), np.nextafter(edges, -np.inf)]).astype(np.float32)
    narrow = np.float32(1) + np.arange(-3000, 3001, dtype=np.float32) * np.finfo(np.float32).eps
    return {
        "edges-and-neighbours": np.concatenate([near, wide]),
        "narrow": narrow.astype(np.float32),
        "zeros": np.zeros(64, np.float32),
        "negative": -np.abs(wide[:5000]) - np.float32(3),
        "wide": wide,
        "blocks": rng.standard_normal(calibration.COUNTING_BLOCK * 2 + 7).astype(np.float32),
    }


@pytest.mark.parametrize("values", hard_arrays().values(), ids=list(hard_arrays()))
@pytest.mark.parametrize("binning", [(True, 2048), (False, 2048), (False, 128), (True, 1)], ids=str)
def test_bins_counted_by_numpys_own_steps_are_np_histograms_count_for_count(values, binning):
    """bin_counts over a tensor's range as HistogramCollector sets it (outer_edges) is
    np.histogram over that range, count for count, on the arrays where float32 rounding puts
    an element one bin off: numpy's corrections, replayed in blocks."""
    magnitudes, bins = binning
    e = calibration.Extremes(values.shape, values.dtype)
    e.add("x", [values.min(), values.max(), np.abs(values).min(), np.float32(0), values.shape])
    low, high = calibration.outer_edges(e, magnitudes)
    edges = np.histogram_bin_edges(np.empty(0, np.float32), bins, range=(low, high))
    want, want_edges = np.histogram(np.abs(values) if magnitudes else values, bins, range=(low, high))
    np.testing.assert_array_equal(calibration.bin_counts(values, magnitudes, edges), want)
    np.testing.assert_array_equal(edges, want_edges)


def percentile_of(histogram, edges, low, high, percentile):
    """onnxruntime's own compute_percentile on one magnitudes histogram: (low, high, hist[0], hist[1])."""
    from onnxruntime.quantization.calibrate import HistogramCollector

    collector = HistogramCollector("percentile", True, len(edges) - 1, 128, percentile, "same")
    collector.histogram_dict = {"x": (histogram, edges, low, high)}
    with contextlib.redirect_stdout(None):
        return tuple(np.asarray(v).item() for v in collector.compute_percentile()["x"])


@pytest.mark.parametrize("values", hard_arrays().values(), ids=list(hard_arrays()))
@pytest.mark.parametrize("percentile", [99.999, 99.99, 99.95, 99.9])
def test_a_percentile_read_off_the_greatest_magnitudes_is_onnxruntimes_off_the_whole_histogram(values, percentile):
    """A tensor's Tail over three samples (its greatest magnitudes and its counts below the
    first two inner edges) gives a histogram onnxruntime's compute_percentile reads the same
    range and first two bins off as off np.histogram of every magnitude, on the arrays where
    a bin is easiest to get wrong, at every percentile tune asks and one between; where the
    crossing is too near p it says so (None: p N within the margin of a cumulative count, as
    it is for a round count like 20,000 elements at 99.99), and only there."""
    magnitudes = np.abs(values)
    e = calibration.Extremes(values.shape, values.dtype)
    e.add("x", [values.min(), values.max(), magnitudes.min(), np.float32(0), values.shape])
    edges = calibration.bin_edges(e, True, 2048)
    tail = percentile_tails.Tail(percentile_tails.tail_keep(values.size), values.dtype)
    for part in np.array_split(values, 3):
        tail.add(percentile_tails.tail_part(part, tail.keep, tail.floor(), edges))
    whole = np.histogram(magnitudes, 2048, range=(edges[0], edges[-1]))[0]
    assert tail.below == [whole[0], whole[0] + whole[1]]
    index = calibration.bin_indices(tail.top, edges)
    histogram = percentile_tails.tail_histogram(tail, index, values.size, 2048, percentile)
    if histogram is None:  # only where a cumulative count lies within the margin of p N
        p_n = Fraction(percentile / 100.0) * values.size
        near = [c for c in np.cumsum(whole) if abs(c - p_n) <= percentile_tails.TAIL_MARGIN * values.size]
        assert near, "undecided, though no count lies near p N"
        return
    assert histogram.sum() == values.size
    got = percentile_of(histogram, edges, e.low, e.high, percentile)
    assert got == percentile_of(whole, edges, e.low, e.high, percentile)


def strided_arrays():
    """A first sample whose every GUESS_STRIDE-th magnitude misleads a guessed floor: the
    sampled ones the greatest (too high a floor: fewer than keep reach it), the least (too
    low: all of them kept), and a plain one where the guess holds."""
    rng = np.random.default_rng(5)
    plain = rng.standard_normal(200_000).astype(np.float32)
    high, low = plain.copy(), plain.copy()
    high[:: percentile_tails.GUESS_STRIDE] = np.float32(1e6) + np.arange(len(high[:: percentile_tails.GUESS_STRIDE]))
    low[:: percentile_tails.GUESS_STRIDE] = np.float32(0)
    return {"plain": plain, "sampled-greatest": high, "sampled-least": low}


@pytest.mark.parametrize("values", strided_arrays().values(), ids=list(strided_arrays()))
@pytest.mark.parametrize("keep", [37, 1_217, 60_000])
def test_a_first_samples_share_is_its_greatest_magnitudes_whatever_its_guessed_floor(values, keep):
    """tail_part without a floor (a Tail's first sample) gives exactly the ``keep`` greatest
    magnitudes and the counts below the edges, as a partition of every magnitude does, where
    the floor guessed from every GUESS_STRIDE-th magnitude holds and where it is too high or
    too low (a guess too few reach is never used)."""
    magnitudes = np.abs(values)
    edges = np.array([0, magnitudes.max() / 2048, magnitudes.max() / 1024], np.float32)
    candidates, first, second = percentile_tails.tail_part(values, keep, None, edges)
    assert len(candidates) >= keep
    np.testing.assert_array_equal(np.sort(candidates)[::-1][:keep], np.sort(magnitudes)[::-1][:keep])
    assert (first, second) == (np.count_nonzero(magnitudes < edges[1]), np.count_nonzero(magnitudes < edges[2]))


def test_a_guessed_floor_is_reached_by_at_least_keep_or_not_used():
    """at_least_keep_above cuts at a floor only where at least ``keep`` magnitudes reach it."""
    magnitudes = np.arange(100, dtype=np.float32)
    assert len(percentile_tails.at_least_keep_above(magnitudes, 10, np.float32(90))) == 10
    assert len(percentile_tails.at_least_keep_above(magnitudes, 11, np.float32(90))) == 100
    assert len(percentile_tails.at_least_keep_above(magnitudes, 11, None)) == 100


def test_a_crossing_too_near_p_is_counted_whole(cnn, tmp_path, monkeypatch):
    """With no margin anything can cross (TAIL_MARGIN 1: every tensor undecided), the whole
    histograms are counted for every tensor, and the ranges are onnxruntime's own."""
    monkeypatch.setattr(percentile_tails, "TAIL_MARGIN", 1.0)
    counted = []
    real = calibration.histograms

    def histograms(calibrator, make_reader, binnings, folder=None, only=None):
        counted.append(list(only or []))
        return real(calibrator, make_reader, binnings, folder, only)

    monkeypatch.setattr(calibration, "histograms", histograms)
    arguments = candidates.keyword_arguments({"calibrate_method": "Percentile"})
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    with gen_models.quiet_quantizer():
        calibration.calibrate(cnn, arguments, lambda: Samples(5), str(ours))
        quantize_static(cnn, str(tmp_path / "q.onnx"), Samples(5), calibration_cache_path=str(theirs), **arguments)
    mine, reference = load_tensors_data(ours), load_tensors_data(theirs)
    assert counted and sorted(counted[0]) == sorted(reference.keys())
    for name, expected in reference.items():
        for attribute in expected._attrs:
            np.testing.assert_array_equal(getattr(mine[name], attribute), getattr(expected, attribute), err_msg=name)


@pytest.mark.parametrize("percentile", [99.999, 99.99, 99.9])
def test_percentiles_read_off_tails_of_larger_tensors_are_onnxruntimes_own(tmp_path, monkeypatch, percentile):
    """Samples of 1x3x48x48 (tensors of 9,216 to 36,864 elements a sample, 6 samples): most
    ranges end inside the tensor's magnitudes, not at the greatest, and each is the range and
    the first bins onnxruntime computes holding every sample, with no tensor counted whole."""
    counted = []
    monkeypatch.setattr(calibration, "histograms", lambda *args, **kwargs: counted.append(args) or {})
    shapes = ((1, 3, 48, 48),)
    model = tmp_path / "cnn48.onnx"
    onnx.save(gen_models.build_cnn(2, channels=4, size=48, seed=0), model)
    settings = {"calibrate_method": "Percentile", "extra_options": {"CalibPercentile": percentile}}
    arguments = candidates.keyword_arguments(settings)
    ours, theirs, extremes = tmp_path / "ours.json", tmp_path / "theirs.json", tmp_path / "minmax.json"
    with gen_models.quiet_quantizer():
        calibration.calibrate(str(model), arguments, lambda: Samples(6, shapes), str(ours))
        calibration.calibrate(str(model), {}, lambda: Samples(6, shapes), str(extremes))
        quantize_static(
            str(model), str(tmp_path / "q.onnx"), Samples(6, shapes), calibration_cache_path=str(theirs), **arguments
        )
    mine, reference, minmax = load_tensors_data(ours), load_tensors_data(theirs), load_tensors_data(extremes)
    assert list(mine.keys()) == list(reference.keys()) and not counted
    for name, expected in reference.items():
        for attribute in expected._attrs:
            np.testing.assert_array_equal(getattr(mine[name], attribute), getattr(expected, attribute), err_msg=name)
    inside = [n for n, r in reference.items() if r.highest < max(-minmax[n].lowest, minmax[n].highest)]
    assert len(inside) > len(reference.keys()) / 2


def test_binnings_counted_in_the_same_passes_equal_each_counted_alone(cnn, tmp_path):
    """Percentile's magnitudes at 2048 bins and Entropy's values at 128, counted together in
    one pair of passes, are the histograms each counts alone, array for array."""
    from onnxruntime.quantization.calibrate import create_calibrator

    calibrator = create_calibrator(
        cnn, augmented_model_path=str(tmp_path / "a.onnx"), calibrate_method=CalibrationMethod.Entropy
    )
    both = calibration.histograms(calibrator, lambda: Samples(4), [(True, 2048), (False, 128)])
    for binning in both:
        alone = calibration.histograms(calibrator, lambda: Samples(4), [binning])[binning]
        assert list(alone) == list(both[binning])
        for name, counted in alone.items():
            for got, want in zip(both[binning][name], counted, strict=True):
                np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_histogram_fetches_one_group_of_tensors_a_run_not_one_samples_every_tensor(tmp_path, monkeypatch):
    """One sample of a CNN with wide activations (8 channels at 96x96), counted with groups of
    a sixteenth of its calibrated tensors' bytes: no run of the samples hands back more than
    one group (or one tensor larger than a group), under a quarter of what one run fetching
    every tensor hands back. (The fetched arrays are onnxruntime's, which tracemalloc does
    not see: the bytes each run returns are the measure.)"""
    path = tmp_path / "wide.onnx"
    onnx.save(gen_models.build_cnn(2, channels=8, size=96, seed=0), path)
    arguments = candidates.keyword_arguments({"calibrate_method": "Percentile"})
    opened = calibration.calibration_session
    fetched = []

    class Counted:
        def __init__(self, session):
            self.session = session

        def run(self, names, feeds):
            outputs = self.session.run(names, feeds)
            if names is not None:  # a group's run (the extremes run asks for every small output)
                fetched.append((len(names), sum(o.nbytes for o in outputs), max(o.nbytes for o in outputs)))
            return outputs

    monkeypatch.setattr(calibration, "calibration_session", lambda *a: Counted(opened(*a)))

    def runs(group_bytes):
        monkeypatch.setattr(calibration, "GROUP_BYTES", group_bytes)
        folder = tmp_path / str(group_bytes)  # a folder each: the histograms kept in one are read, not counted
        folder.mkdir()
        fetched.clear()
        with gen_models.quiet_quantizer():
            calibration.calibrate(str(path), arguments, lambda: Samples(1, [(1, 3, 96, 96)]), str(folder / "c.json"))
        return list(fetched)

    [(tensors, whole, _)] = runs(2**40)
    assert tensors > 10 and whole > 8 * 96 * 96 * 4 * 4  # several tensors of 8x96x96 float32 in one run
    grouped = runs(whole // 16)
    assert sum(n for n, _, _ in grouped) == tensors and len(grouped) > 4
    assert all(total <= max(whole // 16, largest) for _, total, largest in grouped), grouped
    assert max(total for _, total, _ in grouped) < whole / 4, (whole, grouped)


def test_minmax_in_chunks_is_minmax_over_every_sample(cnn, tmp_path, monkeypatch):
    """An independent check of the merge: each tensor's range is numpy's min and max of that
    tensor over every sample (read off a copy of the model exposing every calibrated tensor)."""
    monkeypatch.setattr(calibration, "MINMAX_CHUNK", 3)
    cache = tmp_path / "c.json"
    with gen_models.quiet_quantizer():
        calibration.calibrate(cnn, {}, lambda: Samples(10), str(cache))
    ranges = load_tensors_data(cache)
    model = onnx.load(cnn)
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in ranges)
    options = onnxruntime.SessionOptions()  # unoptimized, as onnxruntime's calibrator runs it (no fusions)
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    outputs = [session.run(list(ranges.keys()), sample) for sample in iter(Samples(10).get_next, None)]
    for k, name in enumerate(ranges.keys()):
        values = np.concatenate([run[k].ravel() for run in outputs])
        low, high = ranges[name].range_value
        assert (np.asarray(low).item(), np.asarray(high).item()) == (values.min(), values.max()), name


@pytest.mark.parametrize(
    "options",
    [{}, {"CalibTensorRangeSymmetric": True}, {"CalibMovingAverage": True}],
    ids=["minmax", "symmetric", "moving-average"],
)
def test_minmax_read_off_the_extremes_is_onnxruntimes_own_on_nan_infinite_and_empty_samples(tmp_path, options):
    """MinMax's ranges come from the reductions the histograms' extremes pass makes, replayed
    into onnxruntime's own collect_data and compute_data: on samples whose tensors hold a NaN
    (Log of -1), an infinity (Log of 0) or no element at all (a batch of 0), where each
    reduction's rule is its own, they equal the ranges quantize_static calibrates itself."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Log", ["x"], ["logged"]), helper.make_node("MatMul", ["logged", "w"], ["y"])]
    w = onnx.numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], [w],
    )  # fmt: skip
    path = str(tmp_path / "log.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    rows = [[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 2.0, 6.0], [0.0, 2.5, 1.0, 1.5], [3.0, 0.25, 8.0, 2.0]]
    samples = [{"x": np.array([row], np.float32)} for row in rows] + [{"x": np.zeros((0, 4), np.float32)}]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.left = iter(samples)

        def get_next(self):
            return next(self.left, None)

    arguments = candidates.keyword_arguments({"calibrate_method": "MinMax", "extra_options": options})
    ours, theirs = tmp_path / "ours.json", tmp_path / "theirs.json"
    with gen_models.quiet_quantizer(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the quantizer's own about a range not finite
        calibration.calibrate(path, arguments, Reader, str(ours))
        with contextlib.suppress(Exception):  # it writes its cache before it quantizes (or refuses to)
            quantize_static(path, str(tmp_path / "q.onnx"), Reader(), calibration_cache_path=str(theirs), **arguments)
    mine, reference = load_tensors_data(ours), load_tensors_data(theirs)
    assert sorted(mine.keys()) == sorted(reference.keys()) == ["logged", "y"]
    assert not np.isfinite(reference["logged"].range_value[0]).all()  # the infinity reached the range
    for name, expected in reference.items():
        np.testing.assert_array_equal(mine[name].range_value, expected.range_value, err_msg=name)
        assert [np.asarray(v).dtype for v in mine[name].range_value] == [np.float32, np.float32]


@pytest.mark.parametrize("method", [pytest.param("Percentile", id="percentile"), pytest.param("MinMax", id="minmax")])
def test_peak_memory_does_not_grow_with_the_number_of_samples(tmp_path, monkeypatch, method):
    """Calibrating 48 samples peaks about where 12 do (numpy's allocations, traced): a
    histogram holds one sample's tensors at a time, MinMax one chunk's reductions (4 here,
    so both counts merge chunks) beside two numbers a sample and tensor. onnxruntime's own
    calibrators hold every sample's: all their tensors for a histogram (1.4 MB a sample
    here), all their reductions for MinMax. Each count's peak is the lesser of two runs:
    tracemalloc also counts what another thread of an xdist worker allocates meanwhile."""
    monkeypatch.setattr(calibration, "MINMAX_CHUNK", 4)
    path = tmp_path / "wide.onnx"
    onnx.save(gen_models.build_cnn(2, channels=8, size=48, seed=0), path)
    settings = {**candidates.candidate_settings()[0], "calibrate_method": method}

    def peak(count, run):
        folder = tmp_path / f"{count}-{run}"
        folder.mkdir()
        tracemalloc.start()
        with gen_models.quiet_quantizer():
            candidates.quantize_candidate(
                str(path), str(folder / "q.onnx"), settings, lambda: Samples(count, [(1, 3, 48, 48)]), str(folder)
            )
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    few, many = (min(peak(count, run) for run in range(2)) for count in (12, 48))
    assert many < 1.25 * few, (few, many)


def test_samples_of_several_shapes_are_refused_as_onnxruntime_refuses_them(cnn, tmp_path):
    """A histogram over samples of two batch sizes: onnxruntime cannot stack them, so neither
    does calibration.py (a row's arguments must reproduce its model, or it is no row)."""
    arguments = {"calibrate_method": CalibrationMethod.Percentile}
    shapes = [(1, 3, 8, 8), (2, 3, 8, 8)]
    with gen_models.quiet_quantizer():
        with pytest.raises(ValueError, match="inhomogeneous shape"):
            quantize_static(cnn, str(tmp_path / "q.onnx"), Samples(4, shapes), **arguments)
        with pytest.raises(ValueError, match="inhomogeneous shape"):
            calibration.calibrate(cnn, arguments, lambda: Samples(4, shapes), str(tmp_path / "c.json"))
    assert not (tmp_path / "c.json").exists()


class Stop(Exception):
    """Raised in place of tune's search: what came before it is what is measured."""


def test_tune_keeps_no_float_outputs_of_the_calibration_samples_beside_held_out_inputs(tmp_path, monkeypatch):
    """With held-out ``--inputs``, each ``--calibrate`` sample is run on the float model only to
    check that it runs: when tune's search starts, the float outputs alive (in lists, as
    sessions return them) are the one held-out sample's, whether 12 or 48 samples calibrate."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8, 1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 8, 4096])
    shape = onnx.numpy_helper.from_array(np.array([1, 8, 4096], dtype=np.int64), "shape")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Expand", ["x", "shape"], ["y"])], "g", [x], [y], [shape])
    path = tmp_path / "wide.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), path)
    rng = np.random.default_rng(0)
    files = []
    for k in range(49):
        files.append(str(tmp_path / f"s{k}.npz"))
        np.savez(files[-1], x=rng.standard_normal((1, 8, 1)).astype(np.float32))

    def outputs_alive(*_args, **_kwargs):
        alive = [a for o in gc.get_objects() if isinstance(o, list) for a in o if isinstance(a, np.ndarray)]
        raise Stop(sum(a.shape == (1, 8, 4096) for a in alive))

    monkeypatch.setattr(tune, "tune_in", outputs_alive)
    for count in (12, 48):
        with pytest.raises(Stop) as stopped:
            graphscan.tune(str(path), calibrate=files[:count], inputs=files[-1:], out=str(tmp_path / f"out{count}"))
        assert stopped.value.args[0] == 1, count


@pytest.mark.parametrize("method", [pytest.param("MinMax", id="minmax"), pytest.param("Percentile", id="percentile")])
def test_a_model_onnxruntime_moves_to_another_opset_is_calibrated_as_it_moves_it(tmp_path, method):
    """Conv, Relu and Add at opset 9: quantize_static calibrates its opset-11 conversion, and so
    does calibration.py; the ranges are the same."""
    w = onnx.numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [
        onnx.helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        onnx.helper.make_node("Relu", ["c"], ["r"], name="relu"),
        onnx.helper.make_node("Add", ["r", "c"], ["y"], name="add"),
    ]
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8, 8])
    model = onnx.helper.make_model(
        onnx.helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=[onnx.helper.make_opsetid("", 9)]
    )
    model.ir_version = 8
    path = str(tmp_path / "opset9.onnx")
    onnx.save(model, path)
    arguments = {"calibrate_method": CalibrationMethod[method]}
    with gen_models.quiet_quantizer():
        calibration.calibrate(path, arguments, lambda: Samples(5), str(tmp_path / "ours.json"))
        quantize_static(
            path,
            str(tmp_path / "q.onnx"),
            Samples(5),
            calibration_cache_path=str(tmp_path / "theirs.json"),
            **arguments,
        )
    mine, reference = load_tensors_data(tmp_path / "ours.json"), load_tensors_data(tmp_path / "theirs.json")
    assert list(mine.keys()) == list(reference.keys())
    for name, expected in reference.items():
        for attribute in expected._attrs:
            np.testing.assert_array_equal(getattr(mine[name], attribute), getattr(expected, attribute), err_msg=name)


def nan_everywhere(shape):
    return np.full(shape, np.nan, np.float32)


def one_value(value):
    def sample(shape):
        array = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        array.flat[5] = value
        return array

    return sample


@pytest.mark.parametrize(
    ("make", "alone", "said"),
    [
        pytest.param(nan_everywhere, True, "holds 192 NaN or infinite values of 192", id="nan-everywhere"),
        pytest.param(one_value(np.nan), False, "holds 1 NaN or infinite values of 192", id="one-nan-beside-a-good-one"),
        pytest.param(one_value(-np.inf), False, "holds 1 NaN or infinite values of 192", id="one-infinity"),
        pytest.param(lambda shape: np.zeros((0, *shape[1:]), np.float32), True, "hold no value (x [0, 3, 8, 8])",
                     id="zero-batch"),
    ],
)  # fmt: skip
def test_a_sample_that_cannot_calibrate_is_exit_7_naming_it_and_calibrate(cnn, tmp_path, capsys, make, alone, said):
    """The CNN's float runs on each of these (and the held-out sample is fine), but a
    calibration range is a min and a max over every value. Alone, NaN everywhere made every
    candidate "refused by quantize_static (scale issue)" (exit 5) and a zero batch ranged
    nothing (every scale 1.0) yet a model was written; beside a good sample, a NaN is dropped
    unsaid and an infinity widens the scales it reaches to infinity. The user's sample, named
    with its option, is what to fix: exit 7, nothing left."""
    from tests.helpers import main_error_line

    rng = np.random.default_rng(0)
    good, held, bad = tmp_path / "good.npz", tmp_path / "held.npz", tmp_path / "bad.npz"
    np.savez(good, x=rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    np.savez(held, x=rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    np.savez(bad, x=make((1, 3, 8, 8)))
    calibrate = [] if alone else ["--calibrate", str(good)]
    argv = ["tune", cnn, *calibrate, "--calibrate", str(bad), "--inputs", str(held), "--out", str(tmp_path / "o")]
    line = main_error_line(capsys, [*argv, "--runs", "1"], 7)
    assert line.startswith(f"graphscan: --calibrate {bad}: ") and said in line, line
    assert "good.npz" not in line and not (tmp_path / "o").exists()
    assert list(tmp_path.glob(".graphscan-tune-*")) == []


def test_a_sample_calibrates_when_some_array_holds_values_and_every_float_value_is_finite():
    """The rule, input by input: an empty array beside one with values (a decoder's empty
    past) ranges the tensors the values reach; integers hold no NaN; a float NaN anywhere is
    refused, naming the array."""
    from graphscan import GraphscanError
    from graphscan_ort.shared.inputs import check_calibrates

    ids, past = np.array([[3, 1]], np.int64), np.zeros((1, 0, 4), np.float32)
    check_calibrates([{"ids": ids, "past": past}], ["a.npz"])
    check_calibrates([{"ids": np.zeros((1, 0), np.int64), "x": np.ones((2,), np.float16)}], ["b.npz"])
    with pytest.raises(GraphscanError, match=r"^--calibrate c\.npz: its arrays hold no value \(ids \[1, 0\], past"):
        check_calibrates([{"ids": np.zeros((1, 0), np.int64), "past": past}], ["c.npz"])
    with pytest.raises(GraphscanError, match=r"^--calibrate d\.npz: array 'h' holds 1 NaN") as refused:
        check_calibrates([{"ids": ids}, {"ids": ids, "h": np.array([0.5, np.nan], np.float16)}], ["ok.npz", "d.npz"])
    assert refused.value.exit_code == 7


PEAK_SCRIPT = """
import os, resource, sys, tempfile
import numpy as np, onnxruntime
import gen_models
import graphscan_ort.tune.calibration as calibration
from graphscan_ort.tune import candidates
path, way = sys.argv[1], sys.argv[2]
samples = [np.random.default_rng(k).standard_normal((1, 3, 192, 192)).astype(np.float32) for k in range(3)]
class Reader:
    def __init__(self): self.left = list(samples)
    def get_next(self): return {"x": self.left.pop()} if self.left else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if way == "session":
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    for x in samples:
        session.run(None, {"x": x})
else:
    calibration.GROUP_BYTES = 16 * 2**20
    with gen_models.quiet_quantizer():
        arguments = candidates.keyword_arguments({"calibrate_method": way})
        calibration.calibrate(path, arguments, Reader, os.path.join(tempfile.mkdtemp(), "c.json"))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


@pytest.mark.slow
def test_calibration_peaks_within_a_few_plain_sessions_on_a_model_with_wide_activations(tmp_path):
    """A CNN of 32 channels at 192x192 (28 tensors of up to 4.7 MB: 132 MB a sample), 3
    samples, each way in a process of its own: the growth of the peak resident memory of
    MinMax calibration is at most 1.5 times a plain default session's three runs, of a
    histogram's (groups of 16 MiB) at most 3.5 times. Measured: 46 and 114 MB against 44-63
    MB; with onnxruntime's own order, every reduction run last, 233 and 283 MB."""
    import subprocess
    import sys

    path = tmp_path / "wide.onnx"
    onnx.save(gen_models.build_cnn(2, channels=32, size=192, seed=0), path)

    def growth(way):
        found = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, str(path), way], capture_output=True, text=True, check=True
        )
        return int(found.stdout.split()[-1])

    session = growth("session")
    assert growth("MinMax") <= 1.5 * session
    assert growth("Percentile") <= 3.5 * session


def test_a_model_older_than_ir_4_is_calibrated_as_onnxruntime_calibrates_it(tmp_path):
    """An IR 3 model (each initializer also a graph input, as such models must list them):
    MinMax's ranges come from the graph onnxruntime calibrates without the Reshape shape its
    augmentation added (an unread initializer fails such a model's session), and the quantized
    model is quantize_static's own, byte for byte, for both activation types."""
    model = gen_models.build_cnn(2, channels=4, size=8, seed=4)
    model.ir_version = 3
    known = {value.name for value in model.graph.input}
    model.graph.input.extend(
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in model.graph.initializer
        if t.name not in known
    )
    path = tmp_path / "ir3.onnx"
    onnx.save(model, path)
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 3, 8, 8)).astype(np.float32)} for k in range(3)]
    for activation in ("QUInt8", "QInt8"):
        settings = {"quant_format": "QDQ", "activation_type": activation, "weight_type": "QInt8"}
        settings |= {"per_channel": False, "calibrate_method": "MinMax"}
        ours, plain = tmp_path / f"ours-{activation}.onnx", tmp_path / f"plain-{activation}.onnx"
        with gen_models.quiet_quantizer():
            reader = lambda: candidates.SampleReader(list(samples))  # noqa: E731
            candidates.quantize_candidate(str(path), str(ours), settings, reader, str(tmp_path))
            quantize_static(str(path), str(plain), reader(), **candidates.keyword_arguments(settings))
        assert ours.read_bytes() == plain.read_bytes(), activation
