"""Calibration in bounded memory, with onnxruntime's own ranges.

onnxruntime's ``quantize_static`` holds what it calibrates for every sample at once: its
histogram calibrators (Percentile, Entropy, Distribution) keep every calibrated tensor of
every sample and stack them, so their peak grows with the number of samples (3.7 GB for
16 crops on PP-OCRv4's recognizer). ``calibrate`` writes the same ranges into a calibration
cache (``calibration_cache_path``) while holding one sample's tensors at a time, with
onnxruntime's own calibrator (its augmented model and its choice of tensors):

- one pass over the samples per prepared model (kept_reductions, kept in the cache's folder):
  each calibrated tensor reduced inside the graph to its least and greatest value and
  magnitude, a finiteness test and its shape, a few numbers per tensor and sample, each
  reduction right after the tensor's producer, so it is freed as the run goes on.
- MinMax: onnxruntime's own ``collect_data`` and ``compute_data`` fed those least and greatest
  values, shaped as its augmented model's ReduceMin and Reshape return them (``Replayed``),
  ``MINMAX_CHUNK`` samples a call; each call merges min with min and max with max, so the
  ranges are those of one call over all samples. ``CalibMovingAverage`` averages per call,
  not per sample, so that option gets a single call. ``CalibMaxIntermediateOutputs`` is not
  the way: onnxruntime 1.32 drops the samples it collected without reducing them
  (github.com/microsoft/onnxruntime/issues/18893).
- histograms: the bins set by those extremes, then one more pass per binning: each tensor's
  histogram over them, one sample and one group of at most ``GROUP_BYTES`` of tensors at a
  time (each group a run of the graph cut to what it needs). These are the bins onnxruntime's
  ``HistogramCollector`` sets over all samples at once, and a histogram over fixed bins is
  the sum of the samples' histograms, so the histogram is the same, count for count, and its
  own ``compute_collection_result`` turns it into the same ranges. The counting (bin_counts) is
  numpy's histogram, step for step, in threads: numpy's loops let go of the GIL, and the
  counting is most of the time at page size. ``histograms`` counts several binnings in the
  same passes when asked; tune asks for one at a time: counting Entropy's beside
  Percentile's costs as much again, and Entropy is a refinement a run may never reach.
- a symmetric Percentile (onnxruntime's default) at 99.9 or above: read off each tensor's
  greatest magnitudes, not a whole histogram (percentile_tails.py).

Example (``quantize_static`` then reads the ranges instead of calibrating)::

    arguments = {"calibrate_method": CalibrationMethod.Percentile}
    calibrate("prepared.onnx", arguments, lambda: SampleReader(samples), "cache.json")
    quantize_static("prepared.onnx", "int8.onnx", None, calibration_cache_path="cache.json", **arguments)
"""

from __future__ import annotations

import array
import copy
import itertools
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantType
from onnxruntime.quantization.calibrate import (
    HistogramCalibrater,
    HistogramCollector,
    MinMaxCalibrater,
    TensorsData,
    create_calibrator,
    save_tensors_data,
)
from onnxruntime.quantization.quant_utils import load_model_with_shape_infer, update_opset_version
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

from graphscan_ort.shared.graph import node_reads
from graphscan_ort.shared.sessions import usable_cores
from graphscan_ort.tune import percentile_tails
from graphscan_ort.tune.graph_segments import cut_segments, group_model, needed_after

__all__ = ["MINMAX_CHUNK", "calibrate"]

MINMAX_CHUNK = 16  # samples per MinMax collect_data call: their reduced outputs, not their tensors

# quantize_static's extra_options that reach the calibrator, and the names it gives them there.
CALIBRATOR_OPTIONS = [
    ("CalibTensorRangeSymmetric", "symmetric"),
    ("CalibMovingAverage", "moving_average"),
    ("CalibMovingAverageConstant", "averaging_constant"),
    ("CalibMaxIntermediateOutputs", "max_intermediate_outputs"),
    ("CalibPercentile", "percentile"),
]


def calibrate(
    model_path: str, arguments: dict[str, Any], make_reader: Callable[[], CalibrationDataReader], cache: str
) -> None:
    """Write to ``cache`` the ranges ``quantize_static(model_path, ..., **arguments)`` would
    calibrate on the samples of ``make_reader()`` (called once per pass over the samples)."""
    extra = arguments.get("extra_options") or {}
    if extra.get("SmoothQuant") or extra.get("CalibStridedMinMax"):
        raise ValueError("calibrate mirrors quantize_static without SmoothQuant and CalibStridedMinMax")
    options = {key: extra[name] for name, key in CALIBRATOR_OPTIONS if name in extra}
    method = arguments.get("calibrate_method", CalibrationMethod.MinMax)
    op_types = arguments.get("op_types_to_quantize") or list(set(QLinearOpsRegistry) | set(QDQRegistry))
    with tempfile.TemporaryDirectory(prefix="graphscan-calibration-") as folder:
        source = calibrated_model(model_path, arguments, folder)
        calibrator = create_calibrator(
            Path(source),
            op_types,
            augmented_model_path=os.path.join(folder, "augmented_model.onnx"),
            calibrate_method=method,
            use_external_data_format=arguments.get("use_external_data_format", False),
            providers=arguments.get("calibration_providers"),
            extra_options=options,
        )
        folder = os.path.dirname(os.path.abspath(cache))
        if isinstance(calibrator, HistogramCalibrater):
            ranges = histogram_ranges(calibrator, make_reader, folder)
        else:
            assert isinstance(calibrator, MinMaxCalibrater)
            ranges = minmax_calibrated(calibrator, make_reader, folder)
        del calibrator  # its session holds the augmented model in the folder
    save_tensors_data(ranges, cache)


def calibrated_model(model_path: str, arguments: dict[str, Any], folder: str) -> str:
    """The file quantize_static calibrates: the model itself, or its copy at the opset
    onnxruntime moves it to for these types (opset < 10, 16-bit or float 8 types)."""
    extra = arguments.get("extra_options") or {}

    def at_its_opset(model: onnx.ModelProto) -> onnx.ModelProto:
        return update_opset_version(
            model,
            arguments.get("weight_type", QuantType.QInt8),
            arguments.get("activation_type", QuantType.QInt8),
            tensor_quant_overrides=extra.get("TensorQuantOverrides"),
            block_size=extra.get("BlockSize", 0),
        )

    probe = onnx.load(model_path, load_external_data=False)  # the opset decides: no shapes needed
    if at_its_opset(probe) is probe:
        return model_path
    updated = at_its_opset(load_model_with_shape_infer(Path(model_path)))
    source = os.path.join(folder, "model_input.onnx")
    onnx.save_model(copy.deepcopy(updated), source, save_as_external_data=True)
    return source


def minmax_calibrated(
    calibrator: MinMaxCalibrater, make_reader: Callable[[], CalibrationDataReader], folder: str | None
) -> TensorsData:
    """onnxruntime's MinMax ranges: its own ``collect_data`` and ``compute_data`` fed each
    sample's least and greatest value of every tensor from the reductions the histograms read
    too (kept_reductions: one pass over the samples for MinMax and every histogram of a
    prepared model). Those are onnxruntime's ReduceMin and ReduceMax of the same tensors, so
    a NaN, an infinity or an empty sample comes out as its own reductions leave it."""
    outputs = [o.name for o in calibrator.model.graph.output]
    reduced = outputs[calibrator.num_model_outputs :]
    names = [reduced[k].rpartition("_")[0] for k in range(0, len(reduced), 2)]  # as compute_data names them
    if not names:  # nothing to calibrate: onnxruntime's own session and its own answer
        calibrator.infer_session = calibration_session(calibrator.augmented_model_path, calibrator.execution_providers)
        return minmax_ranges(calibrator, make_reader())
    reductions = kept_reductions(
        unreduced(calibrator.model, names), names, make_reader, calibrator.execution_providers, folder
    )
    calibrator.infer_session = Replayed(outputs, calibrator.num_model_outputs, names, reductions)
    return minmax_ranges(calibrator, Placeholders(reductions[names[0]].samples))


def unreduced(augmented: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """onnxruntime's MinMax augmented model without the ReduceMin, ReduceMax and Reshape nodes
    its ``augment_graph`` added for ``names`` (named after each tensor), nor the shape those
    Reshapes read: the graph calibrated. (An initializer no node reads fails the session of a
    model older than IR 4, whose initializers must each be a graph input.)"""
    added = {f"{name}_{op}{tail}" for name in names for op in ("ReduceMin", "ReduceMax") for tail in ("", "_Reshape")}
    model = copy.deepcopy(augmented)
    shapes = {node.input[1] for node in model.graph.node if node.name in added and node.op_type == "Reshape"}
    kept = [node for node in model.graph.node if node.name not in added]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    still_read = {name for node in kept for name in node_reads(node)}
    unread = [t for t in model.graph.initializer if t.name in shapes - still_read]
    for tensor in unread:
        model.graph.initializer.remove(tensor)
    return model


class Replayed:
    """The session onnxruntime's MinMax calibrator runs, answered from reductions already made:
    for each sample in turn, None for the model's own outputs (it drops them), then each
    tensor's least and greatest value shaped as its ReduceMin and Reshape leave them ([1])."""

    def __init__(
        self, outputs: list[str], model_outputs: int, names: list[str], reductions: dict[str, Reduced]
    ) -> None:
        self.outputs = [SimpleNamespace(name=name) for name in outputs]
        lows = [reductions[name].lows() for name in names]
        highs = [reductions[name].highs() for name in names]
        samples = reductions[names[0]].samples
        self.answers = iter(
            [None] * model_outputs
            + [part[k : k + 1] for low, high in zip(lows, highs, strict=True) for part in (low, high)]
            for k in range(samples)
        )

    def get_outputs(self) -> list[SimpleNamespace]:
        return self.outputs

    def run(self, output_names: list[str] | None, feeds: Any) -> list[np.ndarray | None]:
        return next(self.answers)


class Placeholders(CalibrationDataReader):
    """``count`` stand-ins for samples (``Replayed`` answers them), none of them empty."""

    def __init__(self, count: int) -> None:
        self.left = iter(range(count))

    def get_next(self) -> dict[str, int] | None:
        k = next(self.left, None)
        return None if k is None else {"sample": k}


def minmax_ranges(calibrator: MinMaxCalibrater, reader: CalibrationDataReader) -> TensorsData:
    """onnxruntime's MinMax ranges, its ``collect_data`` fed ``MINMAX_CHUNK`` samples a call
    (all at once under ``CalibMovingAverage``: it averages per call)."""
    chunk = None if calibrator.moving_average else MINMAX_CHUNK
    samples = samples_of(reader)
    while True:
        part = list(itertools.islice(samples, chunk))
        calibrator.collect_data(ListReader(part))  # an empty first chunk: onnxruntime's own "No data"
        if chunk is None or len(part) < chunk:
            return calibrator.compute_data()


def samples_of(reader: CalibrationDataReader) -> Iterator[dict[str, np.ndarray]]:
    """The samples of ``reader`` until its first empty one, as onnxruntime's calibrators read them."""
    while inputs := reader.get_next():
        yield inputs


class ListReader(CalibrationDataReader):
    """A list of samples as a reader: one chunk for ``collect_data``."""

    def __init__(self, samples: list[dict[str, np.ndarray]]) -> None:
        self.left = iter(samples)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.left, None)


GROUP_BYTES = 256 * 2**20  # one sample's calibrated tensors fetched per run: at most this many bytes
Binning = tuple[bool, int]  # (magnitudes, bins): what a histogram counts and over how many bins


class Extremes:
    """One tensor over every sample: its shape (one, as onnxruntime stacks them), element
    type, element count, least and greatest value, and least and greatest magnitude."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.shape, self.dtype, self.size = shape, dtype, 0
        self.low: Any = None  # numpy scalars of the tensor's type once a sample has elements
        self.high: Any = None
        self.least: Any = None
        self.most: Any = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def add(self, name: str, reduced: list[np.ndarray]) -> None:
        """One sample's reductions of the tensor (extremes_model's, in its order)."""
        low, high, least, finite, shape = reduced
        if tuple(shape) != self.shape:
            raise ValueError(f"{name}: the samples' arrays have an inhomogeneous shape ({self.shape}, {tuple(shape)})")
        count = int(np.prod(shape, dtype=np.int64))
        if not count:
            return
        if not np.isfinite(finite):  # a value times 0 summed: NaN where any value is NaN or infinite
            raise ValueError(f"{name}: range of [{low}, {high}] is not finite")
        most = max(abs(low), abs(high))  # finite, so the greatest magnitude is an extreme's
        first = self.size == 0
        self.size += count
        self.low = low if first else min(self.low, low)
        self.high = high if first else max(self.high, high)
        self.least = least if first else min(self.least, least)
        self.most = most if first else max(self.most, most)


class Reduced:
    """One tensor's reductions (extremes_model's) over every sample, in memory flat in the
    samples but for two numbers a sample: its Extremes, or the error they raised (a shape
    that changed, a value not finite: a histogram's to raise), and each sample's least and
    greatest value, as MinMax reduces it."""

    def __init__(self) -> None:
        self.extremes: Extremes | None = None
        self.problem: str | None = None
        self.low_values = array.array("d")  # a float16 or float32 value, exactly
        self.high_values = array.array("d")
        self.dtype: np.dtype | None = None

    @property
    def samples(self) -> int:
        return len(self.low_values)

    def add(self, name: str, parts: list[np.ndarray]) -> None:
        """One sample's REDUCTIONS reductions of the tensor, in extremes_model's order."""
        low, high = parts[0], parts[1]
        self.dtype = low.dtype
        self.low_values.append(float(low))
        self.high_values.append(float(high))
        if self.problem is None:
            try:
                if self.extremes is None:
                    self.extremes = Extremes(tuple(parts[-1]), low.dtype)
                self.extremes.add(name, parts)
            except ValueError as exc:
                self.problem = str(exc)

    def lows(self) -> np.ndarray:
        return np.asarray(self.low_values, self.dtype)

    def highs(self) -> np.ndarray:
        return np.asarray(self.high_values, self.dtype)

    def checked(self) -> Extremes:
        """The tensor's Extremes for a histogram; raises what Extremes raised."""
        if self.problem is not None:
            raise ValueError(self.problem)
        assert self.extremes is not None, "a tensor with reductions has extremes"
        return self.extremes


def histogram_ranges(
    calibrator: HistogramCalibrater, make_reader: Callable[[], CalibrationDataReader], folder: str | None = None
) -> TensorsData:
    """onnxruntime's histogram ranges, one sample's tensors held at a time, in groups of at
    most GROUP_BYTES: the bins ``HistogramCollector.collect`` sets over all, then the counts.
    ``folder``: where the histograms are kept for the next calibration that bins alike
    (histogram_file: Percentile at 99.999, 99.99 and 99.9 differ only in the ranges read
    off them), and read from instead of running the samples again."""
    # HistogramCollector.collect: magnitudes for a symmetric Percentile, values otherwise.
    binning = (calibrator.method == "percentile" and calibrator.symmetric, calibrator.num_bins)
    if binning[0] and calibrator.percentile >= percentile_tails.TAIL_PERCENTILE:
        found = percentile_histograms(calibrator, make_reader, folder)
    else:
        found = kept_pickle(
            None if folder is None else histogram_file(folder, *binning),
            lambda: histograms(calibrator, make_reader, [binning], folder)[binning],
        )
    collector = HistogramCollector(
        method=calibrator.method,
        symmetric=calibrator.symmetric,
        num_bins=calibrator.num_bins,
        num_quantized_bins=calibrator.num_quantized_bins,
        percentile=calibrator.percentile,
        scenario=calibrator.scenario,
    )
    collector.histogram_dict = found
    calibrator.collector = collector
    return calibrator.compute_data()


def kept_pickle(path: str | None, make: Callable[[], Any]) -> Any:
    """What ``make()`` returns, kept at ``path`` (None: not kept) for the next calibration of
    the same prepared model, and read from there instead when it is."""
    if path is not None and os.path.isfile(path):
        with open(path, "rb") as f:
            return pickle.load(f)  # tune's own file in its own temporary folder
    found = make()
    if path is not None:
        with open(path, "wb") as f:
            pickle.dump(found, f)
    return found


def histogram_file(folder: str, magnitudes: bool, bins: int) -> str:
    """Where the histograms of one binning are kept in a calibration cache's folder (one
    prepared model's): what they count (magnitudes or values) and how many bins decide them,
    not the method nor the percentile read off them."""
    return os.path.join(folder, f"histograms-{'magnitudes' if magnitudes else 'values'}-{bins}.pickle")


def kept_reductions(
    model: onnx.ModelProto,
    names: list[str],
    make_reader: Callable[[], CalibrationDataReader],
    providers: list[str] | None,
    folder: str | None,
) -> dict[str, Reduced]:
    """Each of ``names``' reductions (extremes_model's) on every sample of ``make_reader()``,
    run in ``model``; kept in ``folder`` (a calibration cache's: one prepared model's, like
    histogram_file) for the next calibration, which reads them instead of running the samples
    when they hold every tensor it calibrates."""
    path = None if folder is None else os.path.join(folder, "reductions.pickle")
    kept: dict[str, Reduced] = {}
    if path is not None and os.path.isfile(path):
        with open(path, "rb") as f:
            kept = pickle.load(f)  # tune's own file in its own temporary folder
        if all(name in kept for name in names):
            return {name: kept[name] for name in names}
    found = sample_reductions(model, names, make_reader, providers)
    if path is not None:
        with open(path, "wb") as f:
            pickle.dump({**kept, **found}, f)
    return found


def sample_reductions(
    model: onnx.ModelProto,
    names: list[str],
    make_reader: Callable[[], CalibrationDataReader],
    providers: list[str] | None,
) -> dict[str, Reduced]:
    """Each of ``names``' reductions (extremes_model) over the samples: one run a sample."""
    found = {name: Reduced() for name in names}
    session = calibration_session(extremes_model(model, names), providers)
    for sample in samples_of(make_reader()):
        reduced = session.run(None, sample)
        for k, name in enumerate(names):
            found[name].add(name, reduced[REDUCTIONS * k : REDUCTIONS * (k + 1)])
    return found


def calibrated_names(calibrator: HistogramCalibrater) -> list[str]:
    """The tensors onnxruntime's histogram calibrator counts, in its augmented model's output order."""
    return [o.name for o in calibrator.model.graph.output if o.name in calibrator.tensors_to_calibrate]


def calibrated_extremes(
    calibrator: HistogramCalibrater,
    make_reader: Callable[[], CalibrationDataReader],
    folder: str | None,
    only: list[str] | None = None,
) -> tuple[list[str], dict[str, Extremes]]:
    """The tensors a histogram calibrator counts (``only``: of these), in its order, and the
    Extremes of those the samples hold, from the reductions kept in ``folder`` (run when not
    kept); onnxruntime's error when no sample holds any."""
    names = calibrated_names(calibrator)
    reductions = kept_reductions(calibrator.model, names, make_reader, calibrator.execution_providers, folder)
    names = names if only is None else [name for name in names if name in only]
    extremes = {name: reductions[name].checked() for name in names if reductions[name].samples}
    if not extremes:
        raise ValueError("No data is collected.")
    return names, extremes


def histograms(
    calibrator: HistogramCalibrater,
    make_reader: Callable[[], CalibrationDataReader],
    binnings: list[Binning],
    folder: str | None = None,
    only: list[str] | None = None,
) -> dict[Binning, dict[str, tuple]]:
    """The histogram of every calibrated tensor (``only``: of these) for each of ``binnings``,
    as ``HistogramCollector.histogram_dict`` holds it: each tensor's extremes reduced inside
    the graph over every sample (one run each, tiny outputs), then its counts over those bins,
    fetched a group of tensors at a time (grouped_tensors)."""
    names, extremes = calibrated_extremes(calibrator, make_reader, folder, only)
    providers = calibrator.execution_providers
    edges = {(name, b): bin_edges(e, *b) for name, e in extremes.items() if e.size for b in binnings}
    counts: dict[tuple[str, Binning], np.ndarray] = {}
    with ThreadPoolExecutor(COUNTING_THREADS) as pool:
        for fetched in grouped_tensors(calibrator.model, names, extremes, make_reader, providers):
            tasks = [(name, b, array) for name, array in fetched if extremes[name].size for b in binnings]
            found = pool.map(lambda task: bin_counts(task[2], task[1][0], edges[task[0], task[1]]), tasks)
            for (name, b, _), hist in zip(tasks, found, strict=True):  # the tasks' order: the same sums
                counts[name, b] = counts[name, b] + hist if (name, b) in counts else hist
            del fetched, tasks  # this group's tensors, before the next is run
    return {b: histogram_dict(extremes, counts, edges, b) for b in binnings}


# numpy's elementwise loops let go of the GIL, so threads count tensors side by side; the
# blocks are large enough that a thread spends most of its time in them.
COUNTING_THREADS = min(4, usable_cores())
COUNTING_BLOCK = 1 << 18


def bin_counts(array: np.ndarray, magnitudes: bool, edges: np.ndarray) -> np.ndarray:
    """``np.histogram`` of ``array`` (its magnitudes when ``magnitudes``) over ``edges``
    (histogram_bin_edges'), count for count: for float32, numpy's own steps for equal bins
    (the element's offset from the first edge over the width times the bins, in float32 and
    truncated, the last edge in the last bin, then one bin down where the element is below
    its bin's left edge and one up where it is at or past its right edge but not in the last
    bin), without the mask numpy builds to drop elements outside the edges: the extremes set
    them, so none is. Any other type goes to np.histogram itself."""
    values = array.ravel()
    bins = len(edges) - 1
    if values.dtype != np.float32 or edges.dtype != np.float32:
        return np.histogram(np.absolute(values) if magnitudes else values, bins, range=(edges[0], edges[-1]))[0]
    found = np.zeros(bins, np.intp)
    for start in range(0, values.size, COUNTING_BLOCK):
        block = values[start : start + COUNTING_BLOCK]
        found += np.bincount(bin_indices(np.absolute(block) if magnitudes else block, edges), minlength=bins)
    return found


def bin_indices(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The bin np.histogram counts each of ``values`` (float32, within the edges) in over
    ``edges`` (float32, histogram_bin_edges'), by its own steps (bin_counts)."""
    bins = len(edges) - 1
    first, width, count = edges[0], np.subtract(edges[-1], edges[0], dtype=np.float32), np.float32(bins)
    # Each bin's right edge, the last bin's +inf: numpy never moves an element up out of the
    # last bin, and no finite element is at or past +inf (one comparison, not three passes).
    right = np.append(edges[1:-1], np.float32(np.inf))
    index_type = np.int32 if bins < 2**31 else np.intp  # half intp's bytes to read where it fits
    scaled = np.subtract(values, first, dtype=np.float32)
    np.divide(scaled, width, out=scaled)
    np.multiply(scaled, count, out=scaled)
    np.minimum(scaled, np.float32(bins - 1), out=scaled)  # numpy: a bin number of ``bins`` (the last edge) less one
    index = scaled.astype(index_type)
    index -= values < edges.take(index)
    index += values >= right.take(index)
    return index


def percentile_histograms(
    calibrator: HistogramCalibrater, make_reader: Callable[[], CalibrationDataReader], folder: str | None
) -> dict[str, tuple]:
    """``histogram_dict`` for a symmetric Percentile at or above TAIL_PERCENTILE: for each
    tensor a histogram onnxruntime's ``compute_percentile`` reads the same range off as off
    the whole one (tail_histogram), the others (undecided: a crossing too near, a tensor not
    float32 or empty) counted whole (``histograms``). The tails are kept in ``folder`` for the
    next percentile of the same prepared model."""
    bins = calibrator.num_bins
    names, extremes = calibrated_extremes(calibrator, make_reader, folder)
    edges = {name: bin_edges(e, True, bins) for name, e in extremes.items()}
    tailed = [n for n, e in extremes.items() if e.size and e.dtype == np.float32 and bins >= 3]
    path = None if folder is None else os.path.join(folder, f"tails-{bins}.pickle")
    tails = kept_pickle(path, lambda: tensor_tails(calibrator, make_reader, tailed, extremes, edges))
    found: dict[str, tuple] = {}
    for name in tailed:
        tail, size = tails[name], extremes[name].size
        index = bin_indices(tail.top, edges[name])
        histogram = percentile_tails.tail_histogram(tail, index, size, bins, calibrator.percentile)
        if histogram is not None:
            e = extremes[name]
            found[name] = (histogram, edges[name].astype(e.dtype), e.low, e.high)
    undecided = [name for name in names if name not in found]
    whole = histograms(calibrator, make_reader, [(True, bins)], folder, undecided)[True, bins] if undecided else {}
    return {name: found[name] if name in found else whole[name] for name in names if name in found or name in whole}


def bin_edges(e: Extremes, magnitudes: bool, bins: int) -> np.ndarray:
    """The edges HistogramCollector bins a tensor (of Extremes ``e``) over: its magnitudes' or
    its values', in ``bins`` bins."""
    return np.histogram_bin_edges(np.empty(0, e.dtype), bins, range=outer_edges(e, magnitudes))


def tensor_tails(
    calibrator: HistogramCalibrater,
    make_reader: Callable[[], CalibrationDataReader],
    names: list[str],
    extremes: dict[str, Extremes],
    edges: dict[str, np.ndarray],
) -> dict[str, percentile_tails.Tail]:
    """Each of ``names``' Tail over the samples, fetched a group of tensors at a time
    (grouped_tensors), the samples' shares found in threads and added in the samples' order."""
    tails = {
        name: percentile_tails.Tail(percentile_tails.tail_keep(extremes[name].size), extremes[name].dtype)
        for name in names
    }
    providers = calibrator.execution_providers
    with ThreadPoolExecutor(COUNTING_THREADS) as pool:
        for fetched in grouped_tensors(calibrator.model, names, extremes, make_reader, providers):
            tasks = [(array, tails[name].keep, tails[name].floor(), edges[name]) for name, array in fetched]
            parts = pool.map(lambda task: percentile_tails.tail_part(*task), tasks)
            for (name, _), part in zip(fetched, parts, strict=True):
                tails[name].add(part)
            del fetched, tasks  # this group's tensors, before the next is run
    return tails


def histogram_dict(
    extremes: dict[str, Extremes],
    counts: dict[tuple[str, Binning], np.ndarray],
    edges: dict[tuple[str, Binning], np.ndarray],
    binning: Binning,
) -> dict[str, tuple]:
    """One binning's histograms as onnxruntime's collector keeps them: magnitudes as
    ``collect_absolute_value`` does, values as ``collect_value`` (a tensor empty in every
    sample gets the default bins its collector sets itself)."""
    magnitudes, bins = binning
    collector = HistogramCollector(
        method="percentile" if magnitudes else "entropy",
        symmetric=magnitudes,
        num_bins=bins,
        num_quantized_bins=128,
        percentile=99.999,
        scenario="same",
    )
    for name, e in extremes.items():
        key = (name, binning)
        if not e.size:
            collector.collect({name: [np.zeros(e.shape, e.dtype)]})
        elif magnitudes:
            collector.histogram_dict[name] = (counts[key], edges[key].astype(e.dtype), e.low, e.high)
        else:
            collector.histogram_dict[name] = (counts[key], edges[key], e.low, e.high, threshold(e))
    return collector.histogram_dict


def calibration_session(model: onnx.ModelProto | str, providers: list[str] | None) -> Any:
    """A session of ``model`` (or the model file at that path) as onnxruntime's calibrator
    runs its own: no optimization, so the tensors are those of the graph as written."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Kernels run in the order the graph lists them (each tensor's reductions right after it,
    # extremes_model), not the default order that ran every reduction last, every tensor
    # alive till then (120 MB against 34 MB for 28 tensors of 4.7 MB): the same kernels.
    options.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
    options.enable_cpu_mem_arena = False  # each run's tensors handed back, not kept for the next group's session
    if isinstance(model, str):
        return onnxruntime.InferenceSession(model, options, providers=providers)
    with tempfile.TemporaryDirectory(prefix="graphscan-calibration-") as folder:
        path = os.path.join(folder, "model.onnx")  # external data: a model past protobuf's 2 GB
        onnx.save_model(model, path, save_as_external_data=True, size_threshold=1024 * 1024)
        return onnxruntime.InferenceSession(path, options, providers=providers)


REDUCTIONS = 5  # extremes_model's outputs for each tensor


def extremes_model(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """``model`` answering, for each tensor of ``names`` in turn, REDUCTIONS small outputs
    computed in the graph: its least and greatest value, its least magnitude (the greatest
    is one of the extremes', Extremes.add), the sum of its values times 0 (NaN where any is
    NaN or infinite: a reduction's NaN rule is its own) and its shape. Each tensor's
    reductions follow its producer, so it is freed as the graph runs on."""
    reduced = copy.deepcopy(model)
    del reduced.graph.output[:]
    after: dict[str, list[onnx.NodeProto]] = {}  # a tensor's producer's output (or "": an input): its reductions
    produced = {output for node in model.graph.node for output in node.output}
    for k, name in enumerate(names):
        out = [f"graphscan_extremes_{k}_{part}" for part in ("low", "high", "least", "finite", "shape")]
        magnitude, zero = f"graphscan_extremes_{k}_abs", f"graphscan_extremes_{k}_zero"
        after.setdefault(name if name in produced else "", []).extend(
            [
                onnx.helper.make_node("ReduceMin", [name], [out[0]], keepdims=0),
                onnx.helper.make_node("ReduceMax", [name], [out[1]], keepdims=0),
                onnx.helper.make_node("Abs", [name], [magnitude]),
                onnx.helper.make_node("ReduceMin", [magnitude], [out[2]], keepdims=0),
                onnx.helper.make_node("Sub", [name, name], [zero]),
                onnx.helper.make_node("ReduceSum", [zero], [out[3]], keepdims=0),
                onnx.helper.make_node("Shape", [name], [out[4]]),
            ]
        )
        reduced.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in out)
    nodes = list(after.get("", []))
    for node in model.graph.node:
        nodes.append(node)
        for output in node.output:
            nodes.extend(after.get(output, []))
    del reduced.graph.node[:]
    reduced.graph.node.extend(nodes)
    return reduced


def fetch_groups(model: onnx.ModelProto, names: list[str], extremes: dict[str, Extremes]) -> list[list[str]]:
    """``names`` in the order the graph computes them, cut into groups of at most
    GROUP_BYTES of one sample's tensors (a larger tensor alone): each group is one run."""
    produced = {output: k for k, node in enumerate(model.graph.node) for output in node.output}
    ordered = sorted(names, key=lambda name: produced.get(name, -1))
    groups: list[list[str]] = [[]]
    held = 0
    for name in ordered:
        size = extremes[name].nbytes
        if groups[-1] and held + size > GROUP_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    return [g for g in groups if g]


def grouped_tensors(
    model: onnx.ModelProto,
    names: list[str],
    extremes: dict[str, Extremes],
    make_reader: Callable[[], CalibrationDataReader],
    providers: list[str] | None,
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """``names``' arrays on each sample of ``make_reader()``, a group at a time (fetch_groups),
    groups in the graph's order within a sample: one pass over the graph a sample, cut into
    segments (cut_segments), or, where a tensor carried between segments has no known type,
    prefix_runs. Each group's arrays are let go before the next is run, once the caller has
    let go of them too."""
    groups = fetch_groups(model, names, extremes)
    segments = cut_segments(model, groups)
    if segments is None:
        yield from prefix_runs(model, groups, make_reader, providers)
        return
    # A group whose tensors earlier segments made (or the sample holds) runs nothing of its own.
    sessions = [calibration_session(s.model, providers) if s.answers else None for s in segments]
    kept = [needed_after(segments, k) for k in range(len(segments))]
    for sample in samples_of(make_reader()):
        held = dict(sample)  # what later segments read: the sample's inputs, then tensors made
        for segment, session, still_read in zip(segments, sessions, kept, strict=True):
            if session is not None:
                feeds = {name: held[name] for name in segment.reads if name in held}  # an unfed input: its initializer
                held.update(zip(segment.answers, session.run(segment.answers, feeds), strict=True))
            fetched = [(name, held[name]) for name in segment.group]
            held = {name: array for name, array in held.items() if name in still_read}
            yield fetched
            del fetched
        del held


def prefix_runs(
    model: onnx.ModelProto,
    groups: list[list[str]],
    make_reader: Callable[[], CalibrationDataReader],
    providers: list[str] | None,
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """grouped_tensors' arrays from one run a group and a sample of the nodes the group needs
    (group_model), one group's session at a time, over every sample."""
    for group in groups:
        session = calibration_session(group_model(model, group), providers)
        for sample in samples_of(make_reader()):
            fetched = list(zip(group, session.run(group, sample), strict=True))
            yield fetched
            del fetched
        del session


def outer_edges(e: Extremes, magnitudes: bool) -> tuple[Any, Any]:
    """The range HistogramCollector bins a tensor over: its magnitudes' extremes (numpy's
    own range when none is given), or symmetric about 0 out to its greatest magnitude."""
    if magnitudes:
        return e.least, e.most
    return -threshold(e), threshold(e)


def threshold(e: Extremes) -> np.ndarray:
    """HistogramCollector.collect_value's threshold: the greatest magnitude, in the tensor's type."""
    return np.array(max(abs(e.low), abs(e.high)), dtype=e.dtype)
