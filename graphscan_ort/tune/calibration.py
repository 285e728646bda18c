"""Calibration in bounded memory, with onnxruntime's own ranges.

onnxruntime's ``quantize_static`` holds what it calibrates for every sample at once: its
histogram calibrators (Percentile, Entropy, Distribution) keep every calibrated tensor of
every sample and stack them, so their peak grows with the number of samples (3.7 GB for
16 crops on PP-OCRv4's recognizer). ``calibrate`` writes the same ranges into a calibration
cache (``calibration_cache_path``) while holding one sample's tensors at a time, with
onnxruntime's own calibrator (its augmented model and its choice of tensors):

- MinMax: ``collect_data`` called on ``MINMAX_CHUNK`` samples at a time; each call reduces
  its samples and merges min with min and max with max, so the ranges are those of one call
  over all samples. ``CalibMovingAverage`` averages per call, not per sample, so that option
  gets a single call (MinMax keeps two numbers per tensor and sample, not the tensors).
  ``CalibMaxIntermediateOutputs`` is not the way: onnxruntime 1.32 drops the samples it
  collected without reducing them (github.com/microsoft/onnxruntime/issues/18893).
- histograms: two passes over the samples, first each tensor's extremes, then its
  histogram over those extremes one sample at a time. These are the bins onnxruntime's
  ``HistogramCollector`` sets over all samples at once, and a histogram over fixed bins is
  the sum of the samples' histograms, so the histogram is the same, count for count, and
  its own ``compute_collection_result`` turns it into the same ranges.

Example (``quantize_static`` then reads the ranges instead of calibrating)::

    arguments = {"calibrate_method": CalibrationMethod.Percentile}
    calibrate("prepared.onnx", arguments, lambda: SampleReader(samples), "cache.json")
    quantize_static("prepared.onnx", "int8.onnx", None, calibration_cache_path="cache.json", **arguments)
"""

from __future__ import annotations

import copy
import itertools
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
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
        if isinstance(calibrator, HistogramCalibrater):
            ranges = histogram_ranges(calibrator, make_reader, os.path.dirname(os.path.abspath(cache)))
        else:
            assert isinstance(calibrator, MinMaxCalibrater)
            ranges = minmax_ranges(calibrator, make_reader())
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


def calibrated_tensors(
    calibrator: HistogramCalibrater, reader: CalibrationDataReader
) -> Iterator[dict[str, np.ndarray]]:
    """Each sample's calibrated tensors, by name in the augmented model's output order."""
    names = [o.name for o in calibrator.infer_session.get_outputs()]
    wanted = [(i, name) for i, name in enumerate(names) if name in calibrator.tensors_to_calibrate]
    for sample in samples_of(reader):
        outputs = calibrator.infer_session.run(None, sample)
        yield {name: outputs[i] for i, name in wanted}


class Extremes:
    """One tensor over every sample: its shape (one, as onnxruntime stacks them), element
    type, element count, least and greatest value, and (``magnitudes``) least and greatest
    magnitude."""

    def __init__(self, array: np.ndarray, magnitudes: bool) -> None:
        self.shape, self.dtype, self.size, self.magnitudes = array.shape, array.dtype, 0, magnitudes
        self.low: Any = None  # numpy scalars of the tensor's type once a sample has elements
        self.high: Any = None
        self.least: Any = None
        self.most: Any = None

    def add(self, name: str, array: np.ndarray) -> None:
        if array.shape != self.shape:
            raise ValueError(f"{name}: the samples' arrays have an inhomogeneous shape ({self.shape}, {array.shape})")
        if array.size == 0:
            return
        low, high = array.min(), array.max()
        if not (np.isfinite(low) and np.isfinite(high)):
            raise ValueError(f"{name}: range of [{low}, {high}] is not finite")
        first = self.size == 0
        self.size += array.size
        self.low = low if first else min(self.low, low)
        self.high = high if first else max(self.high, high)
        if self.magnitudes:
            magnitude = np.absolute(array)
            least, most = magnitude.min(), magnitude.max()
            self.least = least if first else min(self.least, least)
            self.most = most if first else max(self.most, most)


def histogram_ranges(
    calibrator: HistogramCalibrater, make_reader: Callable[[], CalibrationDataReader], folder: str | None = None
) -> TensorsData:
    """onnxruntime's histogram ranges from two passes over the samples, one sample's tensors
    held at a time: the bins ``HistogramCollector.collect`` sets over all, then the counts.
    ``folder``: where the histograms are kept for the next calibration that bins alike
    (histogram_file: Percentile at 99.999, 99.99 and 99.9 differ only in the ranges read
    off them), and read from instead of running the samples again."""
    # HistogramCollector.collect: magnitudes for a symmetric Percentile, values otherwise.
    magnitudes = calibrator.method == "percentile" and calibrator.symmetric
    collector = HistogramCollector(
        method=calibrator.method,
        symmetric=calibrator.symmetric,
        num_bins=calibrator.num_bins,
        num_quantized_bins=calibrator.num_quantized_bins,
        percentile=calibrator.percentile,
        scenario=calibrator.scenario,
    )
    kept = None if folder is None else histogram_file(folder, magnitudes, calibrator.num_bins)
    if kept is not None and os.path.isfile(kept):
        with open(kept, "rb") as f:
            collector.histogram_dict = pickle.load(f)  # tune's own file in its own temporary folder
    else:
        collector.histogram_dict = histograms(calibrator, make_reader, collector, magnitudes)
        if kept is not None:
            with open(kept, "wb") as f:
                pickle.dump(collector.histogram_dict, f)
    calibrator.collector = collector
    return calibrator.compute_data()


def histogram_file(folder: str, magnitudes: bool, bins: int) -> str:
    """Where the histograms of one binning are kept in a calibration cache's folder (one
    prepared model's): what they count (magnitudes or values) and how many bins decide them,
    not the method nor the percentile read off them."""
    return os.path.join(folder, f"histograms-{'magnitudes' if magnitudes else 'values'}-{bins}.pickle")


def histograms(
    calibrator: HistogramCalibrater,
    make_reader: Callable[[], CalibrationDataReader],
    collector: HistogramCollector,
    magnitudes: bool,
) -> dict[str, tuple]:
    """The histogram of every calibrated tensor, as ``collector.histogram_dict`` holds it."""
    extremes: dict[str, Extremes] = {}
    for tensors in calibrated_tensors(calibrator, make_reader()):
        for name, array in tensors.items():
            extremes.setdefault(name, Extremes(array, magnitudes)).add(name, array)
    if not extremes:
        raise ValueError("No data is collected.")
    bounds = {name: outer_edges(e, magnitudes) for name, e in extremes.items() if e.size}
    counts: dict[str, np.ndarray] = {}
    edges: dict[str, np.ndarray] = {}
    for tensors in calibrated_tensors(calibrator, make_reader()):
        for name, array in tensors.items():
            if name not in bounds:
                continue
            values = np.absolute(array.ravel()) if magnitudes else array.ravel()
            hist, edges[name] = np.histogram(values, calibrator.num_bins, range=bounds[name])
            counts[name] = counts[name] + hist if name in counts else hist
    for name, e in extremes.items():
        if not e.size:  # every sample empty: onnxruntime's collector sets its default bins itself
            collector.collect({name: [np.zeros(e.shape, e.dtype)]})
        elif magnitudes:
            collector.histogram_dict[name] = (counts[name], edges[name].astype(e.dtype), e.low, e.high)
        else:
            collector.histogram_dict[name] = (counts[name], edges[name], e.low, e.high, threshold(e))
    return collector.histogram_dict


def outer_edges(e: Extremes, magnitudes: bool) -> tuple[Any, Any]:
    """The range HistogramCollector bins a tensor over: its magnitudes' extremes (numpy's
    own range when none is given), or symmetric about 0 out to its greatest magnitude."""
    if magnitudes:
        return e.least, e.most
    return -threshold(e), threshold(e)


def threshold(e: Extremes) -> np.ndarray:
    """HistogramCollector.collect_value's threshold: the greatest magnitude, in the tensor's type."""
    return np.array(max(abs(e.low), abs(e.high)), dtype=e.dtype)
