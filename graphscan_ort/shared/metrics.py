"""Comparing outputs: pairing, both models' paired outputs, the output SQNR, verification
of a changed model."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import (
    EXIT_INPUTS,
    EXIT_USAGE,
    GraphscanError,
    shown,
)
from graphscan_ort.shared.options import Named
from graphscan_ort.shared.parts import TensorParts
from graphscan_ort.shared.sessions import KeptRuns, model_outputs, model_runner, open_session


def output_pairs(reference: Named, candidate: Named) -> list[tuple[str, str]]:
    """``[(float output, quantized output)]`` in the float model's order: by name
    when every float output has a quantized output of that name, else by
    position; exit 7 when neither fits. The one pairing of trace, impact and check."""
    first = [o.name for o in reference.model.graph.output]
    second = [o.name for o in candidate.model.graph.output]
    if set(first) <= set(second):
        return [(name, name) for name in first]
    if len(first) == len(second):
        return list(zip(first, second, strict=True))
    raise GraphscanError(
        f"{shown(reference.path)} and {shown(candidate.path)}: the models' outputs differ "
        f"({', '.join(first)} vs {', '.join(second)})",
        EXIT_INPUTS,
    )


Outputs = list[dict[str, np.ndarray]]  # per sample: output name -> array

# What an output is when it is not a tensor of numbers, by its declared type.
DECLARED_KINDS = {
    "sequence_type": "a sequence",
    "map_type": "a map",
    "optional_type": "an optional",
    "sparse_tensor_type": "a sparse tensor",
}
NUMBERS = "biuf"  # numpy's kinds of the tensors the SQNR and the metrics measure


def declared_kind(model: onnx.ModelProto, name: str) -> str | None:
    """What ``model``'s output ``name`` is declared as when that is not a tensor of numbers
    (None: a tensor of numbers, or nothing declared)."""
    for output in model.graph.output:
        if output.name == name and output.HasField("type"):
            which = output.type.WhichOneof("value")
            if which == "tensor_type":
                elem_type = output.type.tensor_type.elem_type
                if elem_type == onnx.TensorProto.STRING:
                    return "a string tensor"
                if elem_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
                    return "a complex tensor"
                return None
            return DECLARED_KINDS.get(str(which))
    return None


def value_kind(value: Any) -> str | None:
    """What an onnxruntime output value is when it is not a tensor of numbers (None: it is)."""
    if value is None:
        return "an optional without a value"
    if isinstance(value, (list, tuple)):
        return "a sequence"
    if isinstance(value, dict):
        return "a map"
    dtype = np.asarray(value).dtype
    if dtype.kind in NUMBERS:
        return None
    return {"O": "a string tensor", "U": "a string tensor", "S": "a string tensor", "c": "a complex tensor"}.get(
        dtype.kind, f"a tensor of {dtype}"
    )


def require_numbers(named: Named, names: Sequence[str], outputs: Iterable[Sequence[Any]] = ()) -> None:
    """Exit 2 naming the first of ``named``'s outputs ``names`` that is not a tensor of numbers,
    by its declared type, then by its value in each sample's ``outputs`` (onnxruntime's lists in
    ``names``' order): the output SQNR and the metrics (impact, check's min_sqnr and min_metric,
    tune) measure numbers only."""
    declared = ((name, declared_kind(named.model, name)) for name in names)
    found = ((name, value_kind(value)) for sample in outputs for name, value in zip(names, sample, strict=True))
    for name, kind in itertools.chain(declared, found):
        if kind is not None:
            raise GraphscanError(
                f"usage: {shown(named.path)}: output {name!r} is {kind}, not a tensor of numbers: the output "
                "SQNR and the metrics measure numeric outputs only (measure a model cut to those, e.g. by "
                "onnx.utils.extract_model)",
                EXIT_USAGE,
            )


def named_outputs(outputs: Sequence[Sequence[np.ndarray]], names: Sequence[str]) -> Outputs:
    """Per sample, ``{name: array}`` from onnxruntime's lists of outputs in ``names``' order."""
    return [dict(zip(names, sample, strict=True)) for sample in outputs]


class FloatOutputs:
    """The float model's outputs on some samples, run once and kept: as ``OutputNoise``
    for the SQNR and by name for a metric, each made when first asked for."""

    def __init__(self, outputs: list, names: tuple[str, ...], layout: Layout | None = None) -> None:
        self.outputs, self.names, self.layout = outputs, names, layout

    @functools.cached_property
    def noise(self) -> OutputNoise:
        return OutputNoise(self.outputs, self.layout)

    @functools.cached_property
    def by_name(self) -> Outputs:
        return named_outputs(self.outputs, self.names)


@dataclasses.dataclass
class PairedOutputs:
    """Both models' outputs on the same samples: the quantized ones (``candidate``) in
    the order of the float ones they are paired with."""

    reference: FloatOutputs
    candidate: list

    def figures(self) -> SqnrFigures:
        """The quantized outputs' SQNR by part and pooled, as every answer states them
        (``OutputNoise.figures``, finished by ``answer_figures``)."""
        return answer_figures(self.reference.noise.figures(self.candidate), self.reference.noise.empty)

    def sample(self, k: int) -> PairedOutputs:
        """These outputs on sample ``k`` alone (its parts' labels kept)."""
        layout = self.reference.layout
        alone = None if layout is None else Layout(layout.names, layout.labels[k : k + 1], layout.sources)
        reference = FloatOutputs(self.reference.outputs[k : k + 1], self.reference.names, alone)
        return PairedOutputs(reference, self.candidate[k : k + 1])

    def candidate_by_name(self) -> Outputs:
        """The quantized outputs named by the float outputs they are paired with."""
        return named_outputs(self.candidate, self.reference.names)


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Where a caller may stop a candidate's run short of every sample (paired_outputs): after
    each count of samples in ``at`` (ascending), ``stop`` is asked with the outputs so far."""

    at: tuple[int, ...]
    stop: Callable[[PairedOutputs], bool]


def paired_outputs(
    reference_model: Named,
    candidate_model: Named,
    samples: list[dict],
    pairs: list[tuple[str, str]],
    options: ort.SessionOptions,
    kept: dict[tuple[str, ...], FloatOutputs] | None = None,
    candidate_session: ort.InferenceSession | None = None,
    checkpoints: Checkpoints | None = None,
) -> PairedOutputs:
    """Both models (the float ``reference_model``, the quantized ``candidate_model``) run
    on ``samples`` in sessions at ``options``, the outputs paired by ``pairs`` (``output_pairs``):
    the one run behind impact's deployed SQNR, check's min_sqnr and min_metric, and every
    tune candidate's accuracy; exit 2 for an output that is not a tensor of numbers
    (``require_numbers``). ``kept``: the float model's outputs already run, by the float
    outputs wanted; a new run is added to it (tune runs the float model once for all its
    candidates); ``candidate_session``: the candidate's session, open already (tune's, which
    saved its optimized graph and times it too), run instead of a new one; ``checkpoints``:
    the candidate's run may stop there, its outputs then those of the first samples alone."""
    names, candidate_names = tuple(f for f, _ in pairs), [q for _, q in pairs]
    require_numbers(reference_model, names)
    require_numbers(candidate_model, candidate_names)
    reference = kept.get(names) if kept is not None else None
    if reference is None:
        outputs = model_outputs(reference_model.model, samples, reference_model.path, list(names), options)
        require_numbers(reference_model, names, outputs)
        reference = FloatOutputs(outputs, names, output_layout(reference_model.model, names, samples))
        if kept is not None:
            kept[names] = reference
    if checkpoints is not None and candidate_session is None:  # one session for every stretch of samples
        candidate_session = open_session(candidate_model.model, f"{shown(candidate_model.path)}: model", options)
    stops = [] if checkpoints is None else [at for at in checkpoints.at if 0 < at < len(samples)]
    candidate: list = []
    for start, end in itertools.pairwise([0, *stops, len(samples)]):
        stretch = samples[start:end]
        candidate += model_outputs(
            candidate_model.model, stretch, candidate_model.path, candidate_names, options, candidate_session
        )
        require_numbers(candidate_model, candidate_names, candidate[start:])
        if checkpoints is not None and end < len(samples) and checkpoints.stop(PairedOutputs(reference, candidate[:])):
            break
    return PairedOutputs(reference, candidate)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which part (parts.py) each output element belongs to: per sample, per output, the
    part ids (None: the output is one part); per output, its name and the node each part's
    values come from."""

    names: list[str]
    labels: list[list[np.ndarray | None]]
    sources: list[list[str | None]]


def output_layout(model: onnx.ModelProto, names: Sequence[str], samples: list[dict]) -> Layout:
    """The parts of ``model``'s outputs ``names`` on ``samples``' shapes."""
    parts = TensorParts(model, names)
    labels = [[found[name] for name in names] for found in map(parts.labels, samples)]
    return Layout(list(names), labels, [parts.sources[name] for name in names])


@dataclasses.dataclass(frozen=True)
class SqnrFigures:
    """The output SQNR of quantized outputs, by part and pooled: ``worst_db`` (the worst
    part's, the figure impact, check and tune judge by), ``worst_part`` (``{output, part,
    node}``, None when no part is measurable), ``pooled_db`` (everything summed), and
    whether every value equals float's."""

    worst_db: float | None
    worst_part: dict[str, Any] | None
    pooled_db: float | None
    exact: bool


def answer_figures(figures: SqnrFigures, empty: bool) -> SqnrFigures:
    """``figures`` as every answer states them (impact, check, tune, the ``sqnr`` metric), one
    edge rule for all: no output value at all (``empty``: a zero-size sample) verifies
    nothing and is undefined (None); outputs equal to float's value by value are infinitely
    accurate (``inf``, worst and pooled), whatever their energy; otherwise a figure whose
    energies are not finite, or without signal, stays undefined (None)."""
    if empty:
        return SqnrFigures(None, None, None, False)
    if figures.exact:
        return dataclasses.replace(figures, worst_db=math.inf, pooled_db=math.inf)
    return figures


class OutputNoise:
    """The output SQNR of quantized outputs against the float model's: per part of each
    output (``Layout``; without one, each output is one part) and pooled over every output
    and sample; the one definition of impact, check and tune."""

    def __init__(self, float_outputs: list, layout: Layout | None = None) -> None:
        self.reference = [[np.asarray(o, dtype=np.float64) for o in sample] for sample in float_outputs]
        self.layout = layout
        self.counts = [len(sources) for sources in layout.sources] if layout else [1] * self.outputs()
        self.signals = self.part_sums(self.reference)
        self.signal = float(sum(sum(parts) for parts in self.signals))
        # No output value at all (a zero-size input): nothing can be verified.
        self.empty = not any(o.size for sample in self.reference for o in sample)

    def outputs(self) -> int:
        return len(self.reference[0]) if self.reference else 0

    def part_sums(self, values: Iterable[Iterable[np.ndarray]]) -> list[list[float]]:
        """Per output, per part, the sum of squares over samples of ``values`` (float64 arrays
        shaped like the outputs, one sample at a time: a generator keeps one in memory)."""
        sums = [np.zeros(count, dtype=np.float64) for count in self.counts]
        with np.errstate(all="ignore"):  # an overflow is an infinite energy, not a warning on stderr
            for k, sample in enumerate(values):
                for o, array in enumerate(sample):
                    labels = self.layout.labels[k][o] if self.layout else None
                    if labels is None:
                        sums[o][0] += energy(array)
                    else:
                        squares = np.square(array).reshape(-1)
                        sums[o] += np.bincount(labels.reshape(-1), squares, minlength=self.counts[o])
        return [[float(v) for v in parts] for parts in sums]

    def measure(self, quant_outputs: list) -> tuple[float | None, bool]:
        """``(sqnr_db, exact)``: the worst part's ``10*log10(sum f^2 / sum (f - q)^2)``
        (None when undefined) and whether q equals f exactly."""
        figures = self.figures(quant_outputs)
        return figures.worst_db, figures.exact

    def figures(self, quant_outputs: list) -> SqnrFigures:
        """The worst part's SQNR and which part it is, the pooled SQNR, and exactness."""
        noises = self.part_sums(
            (difference(f, q) for f, q in zip(reference, sample, strict=True))
            for reference, sample in zip(self.reference, quant_outputs, strict=True)
        )
        noise = float(sum(sum(parts) for parts in noises))
        worst_db, worst_part = self.worst(noises)
        return SqnrFigures(worst_db, worst_part, decibels(self.signal, noise), noise == 0.0)

    def worst(self, noises: list[list[float]]) -> tuple[float | None, dict[str, Any] | None]:
        """The lowest SQNR of a part that carries a signal and some noise, and its part;
        ``(None, None)`` when a part's energy is not finite or no part has both."""
        found: tuple[float, int, int] | None = None
        for o, (signals, part_noises) in enumerate(zip(self.signals, noises, strict=True)):
            for k, (signal, noise) in enumerate(zip(signals, part_noises, strict=True)):
                if not (math.isfinite(signal) and math.isfinite(noise)):
                    return None, None
                db = decibels(signal, noise)
                if db is not None and (found is None or db < found[0]):
                    found = (db, o, k)
        if found is None:
            return None, None
        db, o, k = found
        name = self.layout.names[o] if self.layout else None
        node = self.layout.sources[o][k] if self.layout else None
        return db, {"output": name, "part": k, "node": node}


def difference(f: np.ndarray, q: Any) -> np.ndarray:
    """``f - q`` in float64; exit 7 when the quantized output's shape is not the float one's."""
    if f.shape != np.shape(q):
        raise GraphscanError(
            f"an output is {list(np.shape(q))} in the quantized model and {list(f.shape)} in the float model",
            EXIT_INPUTS,
        )
    with np.errstate(all="ignore"):  # inf - inf: a NaN noise, an undefined SQNR
        return f - np.asarray(q, dtype=np.float64)


def energy(values: np.ndarray) -> float:
    """The sum of squares of a float64 array, by numpy's own pairwise sum, not
    BLAS: the same bits whatever the thread count, and no BLAS threads left
    spinning on the cores onnxruntime's runs need (np.vdot made each variant
    of PP-OCR det 1.6x slower)."""
    with np.errstate(all="ignore"):  # an overflow is an infinite energy, not a warning on stderr
        return float(np.sum(np.square(values)))


def decibels(signal_energy: float, noise_energy: float) -> float | None:
    """``10*log10(signal_energy / noise_energy)`` of two sums of squares; None
    when it is not a finite number."""
    if not (noise_energy > 0 and signal_energy > 0 and math.isfinite(signal_energy) and math.isfinite(noise_energy)):
        return None
    return 10.0 * math.log10(signal_energy / noise_energy)


def compare_outputs(expected: list[Any], actual: list[Any]) -> tuple[float, float, int, str | None]:
    """How far ``actual`` is from ``expected`` (two lists of onnxruntime outputs).

    Returns ``(max_abs_error, scale, compared, problem)``. Floats: NaN and
    +-Inf must sit at the same places with the same value, then the largest
    |expected - actual| and |expected| are taken over the finite values only.
    Everything else (integers, booleans, strings, sequences, optionals, maps)
    must be equal. ``compared``: how many values were compared this way;
    ``problem``: the first difference that no tolerance excuses, or None.
    """
    error = scale = 0.0
    compared = 0
    if len(expected) != len(actual):  # zip would compare the first ones only, and pass
        return error, scale, compared, f"{len(actual)} outputs instead of {len(expected)}"
    pending = [(f"output {k}", e, a) for k, (e, a) in enumerate(zip(expected, actual, strict=True))]
    while pending:
        where, e, a = pending.pop()
        if isinstance(e, (list, tuple)) or isinstance(a, (list, tuple)):
            if not (isinstance(e, (list, tuple)) and isinstance(a, (list, tuple)) and len(e) == len(a)):
                return error, scale, compared, f"at {where}: sequences of different lengths"
            pending.extend((f"{where}[{i}]", x, y) for i, (x, y) in enumerate(zip(e, a)))
            continue
        if isinstance(e, dict) or isinstance(a, dict):
            if not (isinstance(e, dict) and isinstance(a, dict) and sorted(e) == sorted(a)):
                return error, scale, compared, f"at {where}: maps with different keys"
            pending.extend((f"{where}[{key!r}]", e[key], a[key]) for key in e)
            continue
        if e is None or a is None:  # an optional without a value
            if (e is None) != (a is None):
                return error, scale, compared, f"at {where}: a value in one model only"
            continue
        e, a = np.asarray(e), np.asarray(a)
        if e.shape != a.shape or e.dtype != a.dtype:
            return error, scale, compared, f"at {where}: {a.dtype} {list(a.shape)} instead of {e.dtype} {list(e.shape)}"
        if e.dtype.kind not in "fc":
            if not np.array_equal(e, a):
                return error, scale, compared, f"at {where}: other values"
            compared += e.size
            continue
        finite = np.isfinite(e)
        if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(e[~finite], a[~finite], equal_nan=True):
            return error, scale, compared, f"at {where}: NaN or infinity at other places"
        if finite.any():
            e64, a64 = e[finite].astype(np.complex128 if e.dtype.kind == "c" else np.float64), a[finite]
            error = max(error, float(np.max(np.abs(e64 - a64))))
            scale = max(scale, float(np.max(np.abs(e64))))
            compared += int(finite.sum())
    return error, scale, compared, None


def np_size(value: Any) -> int:
    """How many values an onnxruntime output holds (0 for an absent optional)."""
    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(np_size(v) for v in value)
    if isinstance(value, dict):
        return len(value)
    return np.asarray(value).size


def sqnr_db_of_norms(signal_norm: float, noise_norm: float) -> float | None:
    """A tensor's SQNR in dB, ``20*log10(signal_norm / noise_norm)``, from two
    Euclidean norms (not energies: the output SQNR is common.decibels); None
    when either is 0 or not finite (an overflow to infinity in one model)."""
    if not (0 < noise_norm < math.inf and 0 < signal_norm < math.inf):
        return None
    return 20.0 * math.log10(signal_norm / noise_norm)


def float32_bounds(lo: float, hi: float) -> tuple[np.floating, np.floating]:
    """``(low, high)`` as float32 such that a float32 t is below ``lo`` exactly when
    t < low, and above ``hi`` exactly when t > high: a count without a float64 copy."""
    low, high = np.float32(lo), np.float32(hi)
    # Compared as float64: numpy compares a float32 with a Python float in float32.
    low = np.nextafter(low, np.float32(np.inf)) if float(low) < lo else low
    high = np.nextafter(high, np.float32(-np.inf)) if float(high) > hi else high
    return np.float32(low), np.float32(high)


# How far a changed model's outputs may move, relative to their magnitude (at least 1):
# float reassociation, never a real change.
VERIFY_RELATIVE_TOLERANCE = 1e-5


def count_outside(values: np.ndarray, lo: float, hi: float) -> int:
    """How many of ``values`` (a numeric array) lie outside ``[lo, hi]``, exactly,
    NaN counting as inside: the one "clipped" counter of trace and impact. A
    float32 array is compared with float32 bounds (no float64 copy), any other
    as float64."""
    if values.dtype == np.float32:
        data, (low, high) = values, float32_bounds(lo, hi)
    else:
        data, (low, high) = values.astype(np.float64), (np.float64(lo), np.float64(hi))
    return int(np.count_nonzero((data < low) | (data > high)))


# A prepared model (quant_pre_process, the opset, a rewrite) must reproduce the
# original's outputs to at least this output SQNR. Float reassociation (BatchNorm and
# constant folding, a reciprocal) costs 1e-7 to 1e-5 of the signal, 100 dB and more;
# int8 quantization noise is 20-50 dB, and any real change of a model far worse than 80.
PREPARE_MIN_SQNR_DB = 80.0


@dataclasses.dataclass
class Verification:
    """How a changed model compares with the original: the largest finite error, the
    output SQNR over the finite float values (None when undefined: no noise or no
    signal), how many values were compared, and the first problem no tolerance excuses
    (None: none), with the sample it was found on and whether the original's outputs
    held no value at all there."""

    max_abs_error: float
    compared: int
    problem: str | None
    sample: int | None
    empty: bool
    sqnr_db: float | None = None


def finite_energies(expected: list[Any], actual: list[Any]) -> tuple[float, float]:
    """``(sum f^2, sum (f - a)^2)`` over the finite values of the float outputs (the
    others compare_outputs holds equal), in float64."""
    signal = noise = 0.0
    for e, a in zip(expected, actual, strict=True):
        if isinstance(e, np.ndarray) and isinstance(a, np.ndarray) and e.dtype.kind == "f" and e.shape == a.shape:
            finite = np.isfinite(e) & np.isfinite(a)
            e64, a64 = e[finite].astype(np.float64), a[finite].astype(np.float64)
            signal += energy(e64)
            noise += energy(e64 - a64)
    return signal, noise


def verify(
    original: onnx.ModelProto,
    changed: onnx.ModelProto,
    samples: list[dict],
    subjects: tuple[str, str] = ("the model before the rewrite", "graphscan's rewritten model"),
    min_sqnr_db: float | None = None,
    kept: KeptRuns | None = None,
) -> Verification:
    """``changed`` against ``original`` on every sample, graph optimizations off: NaN and
    infinities at the same places, integers equal, then the finite outputs within the
    tolerance: VERIFY_RELATIVE_TOLERANCE of the outputs' magnitude (at least 1) for each
    value (fuse's rule); with ``min_sqnr_db``, that or an output SQNR of at least
    ``min_sqnr_db`` (prepare's: float reassociation passes one or the other, on big outputs
    and on tiny ones, a real change neither). The one check of a changed model.
    ``subjects`` name the two models when one does not run; ``kept``: ``original``'s runs,
    kept from one verification to the next (used only when they are that model's)."""
    worst, compared, empty, per_value = 0.0, 0, True, True
    signal = noise = 0.0
    # Another model's kept runs never stand in for this one's.
    run_original = kept if kept is not None and kept.model is original else KeptRuns(original, subjects[0], budget=0)
    run_changed = model_runner(changed, subjects[1])
    for k, feeds in enumerate(samples):
        expected = run_original(k, feeds)
        actual = run_changed(feeds)
        error, scale, counted, problem = compare_outputs(expected, actual)
        empty = empty and not any(np_size(e) for e in expected)
        if problem is None:
            more_signal, more_noise = finite_energies(expected, actual)
            signal, noise = signal + more_signal, noise + more_noise
        if problem is None and error > VERIFY_RELATIVE_TOLERANCE * max(scale, 1.0):
            per_value = False
            if min_sqnr_db is None:
                problem = f"by {error:.3g} (allowed {VERIFY_RELATIVE_TOLERANCE:g} relative)"
        if problem is not None:
            return Verification(error, compared + counted, problem, k, empty, decibels(signal, noise))
        worst, compared = max(worst, error), compared + counted
    sqnr = decibels(signal, noise)
    if min_sqnr_db is not None and not per_value and (sqnr is None or sqnr < min_sqnr_db):
        shown_sqnr = "undefined" if sqnr is None else f"{sqnr:.3g} dB"
        problem = (
            f"by {worst:.3g} (allowed {VERIFY_RELATIVE_TOLERANCE:g} relative), an output SQNR of {shown_sqnr} "
            f"(allowed {min_sqnr_db:g} dB and more)"
        )
        return Verification(worst, compared, problem, None, empty, sqnr)
    return Verification(worst, compared, None, None, empty, sqnr)


def verified(
    original: onnx.ModelProto,
    rewritten: onnx.ModelProto,
    samples: list[dict],
    min_sqnr_db: float = PREPARE_MIN_SQNR_DB,
    kept: KeptRuns | None = None,
) -> tuple[float, str | None]:
    """``(max_abs_error, problem or None)`` of a prepared model (a step of tune's prepare,
    a rewrite) against the original: ``verify`` at ``min_sqnr_db`` (``inf``: bit-exact), the
    problem naming its sample. Outputs with nothing finite to compare verify nothing: a
    problem too."""
    result = verify(original, rewritten, samples, min_sqnr_db=min_sqnr_db, kept=kept)
    if result.problem is not None:
        where = "" if result.sample is None else f"sample {result.sample}: "
        return result.max_abs_error, where + result.problem
    if not result.compared:
        why = "empty" if result.empty else "all NaN or infinite"
        return result.max_abs_error, f"nothing to compare: the original's outputs are {why} on these samples"
    return result.max_abs_error, None
