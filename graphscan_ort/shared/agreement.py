"""Accuracy in the user's terms: how far a quantized model agrees with the float one.

A metric compares the float model's outputs with a candidate's, sample by sample,
and gives one number where higher is better, or None where it is undefined. The
built-in ones are label-free agreements (docs/SPEC.md defines each exactly), each
reading the axes it names:

- ``sqnr``: the output SQNR in dB (``metrics.OutputNoise``), the default; every
  element, no axis;
- ``top1``: the share of positions whose argmax over the class axis (the last
  axis) agrees; every other index is a position;
- ``iou``: the IoU of the two outputs thresholded at ``threshold`` (probability maps);
  every element, no axis;
- ``ctc``: the share of sequences whose greedy CTC decoding agrees (argmax over the
  last axis, repeats merged, ``blank`` dropped); time is the axis ``layout`` names
  (``[N, T, C]`` or ``[T, N, C]``), given or told by the output (``ctc_layout``);
- ``cosine``: the cosine similarity of all outputs, flattened; every element, no axis.

A user's metric is ``FILE.py:FUNCTION``, called as ``FUNCTION(reference, candidate)``
with one ``{output name: array}`` per sample, in order, and returning a finite number.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from graphscan import EXIT_INPUTS, EXIT_USAGE, INTERRUPTED, GraphscanError, interruption, one_line, shown
from graphscan_ort.shared.metrics import OutputNoise, Outputs, PairedOutputs, answer_figures

BUILT_IN = ["sqnr", "top1", "iou", "ctc", "cosine"]
DEFAULT_THRESHOLD = 0.5  # iou's, where --threshold is not given
DEFAULT_BLANK = 0  # ctc's blank class, where --blank is not given
# ctc's layouts: [batch, time, classes] or time first, [time, batch, classes] (PyTorch's CTC loss).
NTC, TNC = "NTC", "TNC"
LAYOUTS = [NTC, TNC]
# Below this many dB the default target (onnxruntime's defaults' SQNR) is poor: a
# real recognizer at 5.5 dB read 1 line of 36, a detector at 10.1 dB lost 2 of 5.
POOR_SQNR_DB = 20.0
DEFAULT_TARGET_FLOOR_DB = 10.0
# Where onnxruntime's defaults are poor, tune's default target is at least this (the worst
# part's SQNR): a YOLOv8 detector whose output Concat stays float, F1 0.85 against float on
# held-out photographs, has its class part at 10.0-12.4 dB; the same with one int8 scale over
# boxes and probabilities, F1 0.43, at 0.6 dB.


@dataclasses.dataclass(frozen=True)
class Metric:
    """A metric by name, with its parameters; ``function`` for a user's ``FILE.py:FUNCTION``."""

    name: str
    threshold: float | None = None
    blank: int | None = None
    layout: str | None = None
    function: Callable[[Outputs, Outputs], Any] | None = None
    # Per output, the names of its declared dims ("" where fixed or unnamed): ctc tells
    # the batch axis by them when the shape cannot (``reading``).
    declared: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def unit(self) -> str:
        return "dB" if self.name == "sqnr" else "agreement" if self.function is None else "user"

    def describe(self) -> dict[str, Any]:
        """The answer's ``metric``: its name and the parameters it uses (defaults filled in)."""
        answer: dict[str, Any] = {"name": self.name}
        if self.name == "iou":
            answer["threshold"] = DEFAULT_THRESHOLD if self.threshold is None else self.threshold
        if self.name == "ctc":
            answer["blank"] = DEFAULT_BLANK if self.blank is None else self.blank
            if self.layout is not None:  # told by the output otherwise, and the answer as before
                answer["layout"] = self.layout
        return answer

    def reading(self, model: onnx.ModelProto) -> Metric:
        """This metric as it reads ``model``'s outputs: with the names of their declared dims."""
        return dataclasses.replace(self, declared=tuple(declared_dims(model).items()))

    def value(self, reference: Outputs, candidate: Outputs) -> float | None:
        """The metric of ``candidate`` against ``reference`` (the float model's outputs)."""
        return self.measure(reference, candidate)[0]

    def measure(self, reference: Outputs, candidate: Outputs) -> tuple[float | None, int | None]:
        """``(value, events)``: the metric, and how many events it rests on when a user's
        metric says so by returning ``(value, events)`` (None otherwise)."""
        if self.function is not None:
            return user_value(self.name, self.function, reference, candidate)
        return self.built_in(reference, candidate), None

    def built_in(self, reference: Outputs, candidate: Outputs) -> float | None:
        check_fits(self, reference)
        if self.name == "iou":
            return iou(reference, candidate, self.threshold if self.threshold is not None else DEFAULT_THRESHOLD)
        if self.name == "ctc":
            layouts = ctc_layouts(reference, self.layout, dict(self.declared))
            return ctc(reference, candidate, self.blank if self.blank is not None else DEFAULT_BLANK, layouts)
        return {"sqnr": sqnr, "top1": top1, "cosine": cosine}[self.name](reference, candidate)


def metric(
    name: str | None, threshold: float | None = None, blank: int | None = None, layout: str | None = None
) -> Metric:
    """The metric ``--metric name`` asks for (None: sqnr); exit 2 for an unknown one, for
    parameters of another metric, or a ``FILE.py:FUNCTION`` that cannot be loaded."""
    name = name or "sqnr"
    if threshold is not None and name != "iou":
        raise GraphscanError("usage: --threshold: only with --metric iou", EXIT_USAGE)
    if blank is not None and name != "ctc":
        raise GraphscanError("usage: --blank: only with --metric ctc", EXIT_USAGE)
    if layout is not None and name != "ctc":
        raise GraphscanError("usage: --layout: only with --metric ctc", EXIT_USAGE)
    if layout is not None and layout not in LAYOUTS:
        raise GraphscanError(f"usage: --layout must be one of {', '.join(LAYOUTS)}, not {layout!r}", EXIT_USAGE)
    if threshold is not None and not math.isfinite(threshold):
        raise GraphscanError(f"usage: --threshold must be a finite number, not {threshold!r}", EXIT_USAGE)
    if blank is not None and blank < 0:
        raise GraphscanError(f"usage: --blank must be a class index >= 0, not {blank}", EXIT_USAGE)
    if name in BUILT_IN:
        return Metric(name, threshold, blank, layout)
    path, sep, function = name.rpartition(":")
    if not sep or not path.endswith(".py") or not function.isidentifier():
        raise GraphscanError(
            f"usage: --metric {name!r}: expected one of {', '.join(BUILT_IN)} or FILE.py:FUNCTION", EXIT_USAGE
        )
    return Metric(name, function=load_function(path, function, name))


def load_function(path: str, function: str, name: str) -> Callable[[Outputs, Outputs], Any]:
    """``function`` of the Python file at ``path``; exit 2 naming it when it cannot be had."""
    if not os.path.isfile(path):
        raise GraphscanError(f"usage: --metric {shown(name)}: no such file {shown(path)}", EXIT_USAGE)
    spec = importlib.util.spec_from_file_location(f"graphscan_user_metric_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise GraphscanError(f"usage: --metric {shown(name)}: {shown(path)} is not a Python file", EXIT_USAGE)
    module = importlib.util.module_from_spec(spec)
    try:
        # From its source, never from __pycache__: a cached file rewritten within the same
        # second at the same size is taken for the old one (a user's test editing its metric).
        code = compile(Path(path).read_bytes(), path, "exec", dont_inherit=True)
        with user_code():
            exec(code, module.__dict__)  # the user's own metric, as asked
    except (Exception, SystemExit) as exc:
        raise GraphscanError(
            f"usage: --metric {shown(name)}: {shown(path)} fails to load ({type(exc).__name__}: {one_line(exc)})",
            EXIT_USAGE,
        )
    found = getattr(module, function, None)
    if not callable(found):
        raise GraphscanError(f"usage: --metric {shown(name)}: {shown(path)} has no function {function}", EXIT_USAGE)
    return found


@contextlib.contextmanager
def user_code() -> Iterator[None]:
    """Around a user's metric file or function: what it prints goes to stderr, so stdout
    stays graphscan's one answer, also what reaches file descriptor 1 (a subprocess, C
    code); a Ctrl-C or SIGTERM that arrived while it ran is acted on, even when its code
    swallowed the interrupt (a bare ``except:``). A SystemExit it raises is the caller's."""
    interrupts = len(INTERRUPTED)
    with contextlib.suppress(Exception):
        sys.stdout.flush()  # graphscan's own text, if any, before the descriptor moves
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2 to move: sys.stdout alone is redirected
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
        if len(INTERRUPTED) > interrupts:
            raise interruption()


def user_value(
    name: str, function: Callable[[Outputs, Outputs], Any], reference: Outputs, candidate: Outputs
) -> tuple[float, int | None]:
    """A user's metric, called on fresh copies of every list, dict and array (a function that
    writes into its arguments, ``out=``, cannot change what graphscan measures next): its
    value, and its events when it returns ``(value, events)``."""
    try:
        with user_code():
            value = function(copy.deepcopy(reference), copy.deepcopy(candidate))
    except (Exception, SystemExit) as exc:
        raise GraphscanError(
            f"usage: --metric {shown(name)} raised {type(exc).__name__}: {one_line(exc)}", EXIT_USAGE
        ) from None
    events = None
    if isinstance(value, tuple) and len(value) == 2 and is_count(value[1]):
        value, events = value[0], int(value[1])
    try:
        finite = isinstance(value, (int, float, np.number)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise GraphscanError(
            f"usage: --metric {shown(name)} returned {value!r}: a metric returns a finite number "
            "(or a finite number and a count of events)",
            EXIT_USAGE,
        )
    return float(value), events


def is_count(value: Any) -> bool:
    """A count of events: an integer >= 0 (not a bool)."""
    return bool(isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0)


def paired_value(outputs: PairedOutputs, chosen: Metric | None) -> float | None:
    """``chosen``'s value of paired outputs (None: sqnr). The SQNR is the worst part's
    (``metrics.OutputNoise``, parts.py), ``inf`` when the outputs equal float's; the other
    metrics read the outputs by name."""
    layout = outputs.reference.layout
    if chosen is not None and layout is not None:
        check_layout_fits(chosen, dict(zip(layout.names, layout.sources, strict=True)))
    if chosen is None or (chosen.name == "sqnr" and chosen.function is None):
        return outputs.figures().worst_db
    return chosen.value(outputs.reference.by_name, outputs.candidate_by_name())


def paired_events(outputs: PairedOutputs, chosen: Metric) -> tuple[float | None, int | None]:
    """``paired_value`` with the events a user's metric reports (None for the others)."""
    if chosen.function is None:
        return paired_value(outputs, chosen), None
    return chosen.measure(outputs.reference.by_name, outputs.candidate_by_name())


def check_layout_fits(chosen: Metric, parts: Mapping[str, Sequence[str | None]]) -> None:
    """Exit 2 for ``top1`` on an output that joins several parts (``parts``: per output, the
    node each part comes from, parts.py): its positions do not all hold class scores (a
    detector's boxes and probabilities), so an argmax over its last axis compares unlike things."""
    if chosen.name != "top1" or chosen.function is not None:
        return
    for name, sources in parts.items():
        if len(sources) > 1:
            joined = ", ".join(str(source) for source in sources)
            raise GraphscanError(
                f"usage: --metric top1: output {name!r} joins {len(sources)} parts (from {joined}) with a Concat, "
                "so its positions are not all class scores; give a FILE.py:FUNCTION metric that reads it as the "
                "task does",
                EXIT_USAGE,
            )


def check_fits(chosen: Metric, reference: Outputs) -> None:
    """Exit 2 naming the output a built-in metric cannot measure (its shape or type)."""
    for outputs in reference[:1]:
        for name, array in outputs.items():
            value = np.asarray(array)
            if value.dtype.kind not in "biuf":
                raise GraphscanError(
                    f"usage: --metric {chosen.name}: output {name!r} is {value.dtype}, not numbers", EXIT_USAGE
                )
            least = {"top1": 1, "ctc": 2}.get(chosen.name, 0)
            if value.ndim < least:
                raise GraphscanError(
                    f"usage: --metric {chosen.name}: output {name!r} has {value.ndim} dimensions; "
                    f"{chosen.name} needs {least} or more (the class axis is the last"
                    + (": [T, C], [N, T, C] or [T, N, C])" if chosen.name == "ctc" else ")"),
                    EXIT_USAGE,
                )


def pairs(reference: Outputs, candidate: Outputs) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Every (output name, float array, candidate array), samples in order, outputs by name."""
    paired = []
    for ref, cand in zip(reference, candidate, strict=True):
        for name, value in ref.items():
            f, q = np.asarray(value), np.asarray(cand[name])
            if f.shape != q.shape:
                raise GraphscanError(
                    f"output {name!r} is {list(q.shape)} in the candidate and {list(f.shape)} in the float model",
                    EXIT_INPUTS,
                )
            paired.append((name, f, q))
    return paired


def sqnr(reference: Outputs, candidate: Outputs) -> float | None:
    """The output SQNR (``metrics.OutputNoise``: 10*log10(sum f^2 / sum (f - q)^2) over
    every output and sample), by ``metrics.answer_figures``' rule: ``inf`` when the outputs
    are equal, None when undefined (no signal, or a value that is not finite). Axes: none,
    every element alike."""
    pairs(reference, candidate)  # the shapes agree
    noise = OutputNoise([list(sample.values()) for sample in reference])
    figures = noise.figures([[c[name] for name in r] for r, c in zip(reference, candidate, strict=True)])
    return answer_figures(figures, noise.empty).worst_db


def top1(reference: Outputs, candidate: Outputs) -> float | None:
    """The share of positions (every index but the last axis, every output and sample)
    where the argmax over the last axis agrees. Axes: the classes the last, a position
    every index of the others. Ties go to the first maximum, as numpy's argmax; a position
    where the float model has a NaN is left out; None without any."""
    agree = total = 0
    for _, f, q in pairs(reference, candidate):
        if f.shape[-1] == 0:
            continue
        valid = ~np.isnan(f.astype(np.float64)).any(axis=-1)
        same = np.argmax(f, axis=-1) == np.argmax(np.nan_to_num(q, nan=-np.inf), axis=-1)
        q_nan = np.isnan(q.astype(np.float64)).any(axis=-1)
        agree += int(np.count_nonzero(same & valid & ~q_nan))
        total += int(np.count_nonzero(valid))
    return agree / total if total else None


def iou(reference: Outputs, candidate: Outputs, threshold: float = DEFAULT_THRESHOLD) -> float | None:
    """|F and Q| / |F or Q| of the masks f > threshold and q > threshold, pooled over every
    output and sample (NaN is never above). Axes: none, every element alike. Both masks
    empty everywhere: 1.0, they agree."""
    both = either = 0
    for _, f, q in pairs(reference, candidate):
        with np.errstate(invalid="ignore"):
            fm, qm = f > threshold, q > threshold
        both += int(np.count_nonzero(fm & qm))
        either += int(np.count_nonzero(fm | qm))
    return both / either if either else 1.0


def declared_dims(model: onnx.ModelProto) -> dict[str, tuple[str, ...]]:
    """Per output of ``model``, the names of its declared dims ("" where a dim has none);
    an output without a declared shape is left out."""
    found = {}
    for output in model.graph.output:
        if output.type.HasField("tensor_type") and output.type.tensor_type.HasField("shape"):
            found[output.name] = tuple(dim.dim_param for dim in output.type.tensor_type.shape.dim)
    return found


def is_batch_name(name: str) -> bool:
    """Whether a declared dim's name says it is the batch axis (``batch``, ``batch_size``, ``N``, ``B``)."""
    return name.lower() in {"n", "b", "bs"} or "batch" in name.lower()


def time_axis(ndim: int, layout: str) -> int:
    """The time axis of an output of ``ndim`` dimensions read in ``layout`` (both read
    ``[T, C]`` alike: one sequence)."""
    return 0 if layout == TNC else ndim - 2


def frames(shape: Sequence[int], layout: str) -> int:
    """How many frames each sequence of an output of ``shape`` has, read in ``layout``."""
    return int(shape[time_axis(len(shape), layout)])


def told_by_shape(shape: Sequence[int]) -> str | None:
    """The one layout whose sequences are longer than a frame, where the other's are not
    (``[1, T, C]``: NTC; ``[T, 1, C]``: TNC); None when both or neither are."""
    longer = [layout for layout in LAYOUTS if frames(shape, layout) > 1]
    return longer[0] if len(longer) == 1 else None


def told_by_names(dims: Sequence[str]) -> str | None:
    """The layout the declared dims' names tell: a batch name first (NTC) or second (TNC), alone."""
    batch = [k for k, name in enumerate(dims[:-1]) if is_batch_name(name)]
    return None if len(batch) != 1 else {0: NTC, 1: TNC}.get(batch[0])


def ctc_layout(name: str, shapes: Sequence[tuple[int, ...]], given: str | None, dims: Sequence[str] | None) -> str:
    """The layout ctc reads output ``name`` in, from its shape in every sample: ``given``
    (--layout), else as its shape or declared dims tell it (``told_layout``). Exit 2 when
    every sequence read is a single frame: what a wrong reading looks like (each time step
    of ``[T, 1, C]`` taken for a sequence)."""
    ndim = len(shapes[0])
    layout = given or (NTC if ndim == 2 else told_layout(name, shapes, dims))  # [T, C]: one sequence either way
    if all(frames(shape, layout) == 1 for shape in shapes):
        other = TNC if layout == NTC else NTC
        axes = "[T, C]" if ndim == 2 else "[T, N, C]" if layout == TNC else "[N, T, C]"
        fix = (
            f"time is its {'second' if other == NTC else 'first'} axis: give --layout {other}"
            if ndim > 2 and any(frames(shape, other) > 1 for shape in shapes)
            else "no CTC sequence"
        )
        raise GraphscanError(
            f"usage: --metric ctc: output {name!r} is {list(shapes[0])}: read as {axes}, every sequence is a "
            f"single frame, which decodes nothing to compare ({fix})",
            EXIT_USAGE,
        )
    return layout


def told_layout(name: str, shapes: Sequence[tuple[int, ...]], dims: Sequence[str] | None) -> str:
    """The layout of output ``name`` (3 dimensions or more) without --layout: the shape's,
    where only one layout has sequences longer than a frame; else that of the names of its
    declared dims (``dims``, when as many as the output has); exit 2 naming --layout when
    neither tells (``[26, 4, C]``, both readings decode sequences)."""
    told = {layout for layout in map(told_by_shape, shapes) if layout is not None}
    if len(told) == 1:
        return told.pop()
    named = told_by_names(dims) if dims is not None and len(dims) == len(shapes[0]) else None
    if not told and named is not None:
        return named
    if told or any(frames(shape, NTC) > 1 and frames(shape, TNC) > 1 for shape in shapes):
        raise GraphscanError(
            f"usage: --metric ctc: output {name!r} is {list(shapes[0])}: time may be its first axis ([T, N, C]) "
            "or its second ([N, T, C]), and neither its shape nor its declared dims tell; give --layout TNC or "
            "--layout NTC",
            EXIT_USAGE,
        )
    return NTC  # a single frame whichever the reading: ctc_layout refuses it


def ctc_layouts(reference: Outputs, given: str | None, declared: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """Per output of ``reference`` (the float model's), the layout ctc reads it in (``ctc_layout``)."""
    if not reference:
        return {}
    return {
        name: ctc_layout(name, [np.shape(sample[name]) for sample in reference], given, declared.get(name))
        for name in reference[0]
    }


def greedy_ctc(logits: np.ndarray, blank: int, layout: str = NTC) -> list[tuple[int, ...]]:
    """Every sequence's greedy CTC decoding: argmax over the last axis (the classes), time
    the axis before it (NTC) or the first (TNC), repeats merged, ``blank`` dropped."""
    best = np.argmax(np.nan_to_num(logits, nan=-np.inf), axis=-1)
    if layout == TNC:
        best = np.moveaxis(best, 0, -1)  # time last: [N..., T]
    rows = best.reshape(-1, best.shape[-1])
    decoded = []
    for row in rows:
        keep = np.ones(len(row), bool)
        keep[1:] = row[1:] != row[:-1]
        decoded.append(tuple(int(c) for c in row[keep & (row != blank)]))
    return decoded


def ctc(
    reference: Outputs, candidate: Outputs, blank: int = DEFAULT_BLANK, layouts: Mapping[str, str] | None = None
) -> float | None:
    """The share of sequences whose greedy CTC decoding equals the float model's, every
    output and sample pooled. Axes: the classes the last; per output, time the axis before
    it and a sequence every index before that (NTC, the default), or time the first and a
    sequence every index between (TNC, ``layouts[name]``); None without any sequence."""
    agree = total = 0
    for name, f, q in pairs(reference, candidate):
        if f.shape[-1] == 0:
            continue
        layout = (layouts or {}).get(name, NTC)
        for a, b in zip(greedy_ctc(f, blank, layout), greedy_ctc(q, blank, layout), strict=True):
            agree += a == b
            total += 1
    return agree / total if total else None


def cosine(reference: Outputs, candidate: Outputs) -> float | None:
    """f.q / (|f| |q|) of every output of every sample flattened and concatenated, in
    float64; None when a norm is 0 or a value is not finite. Axes: none, every element alike."""
    dot = ff = qq = 0.0
    with np.errstate(all="ignore"):
        for _, f, q in pairs(reference, candidate):
            f64, q64 = f.astype(np.float64).reshape(-1), q.astype(np.float64).reshape(-1)
            dot += float(np.dot(f64, q64))
            ff += float(np.dot(f64, f64))
            qq += float(np.dot(q64, q64))
    if not (ff > 0 and qq > 0 and all(map(math.isfinite, (dot, ff, qq)))):
        return None
    return dot / math.sqrt(ff * qq)
