"""The shared layer of the commands that run models.

One definition of each thing every such command needs: the onnxruntime
session (its options, and the one message that blames a model that does not
run), the pairing of a float model's outputs with a quantized model's, the
output SQNR, comparing outputs, and writing files atomically.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
import os
import re
import stat
from collections.abc import Iterator

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import (
    EXIT_INPUTS,
    EXIT_NO_FILE,
    EXIT_RUNTIME,
    RUNTIME_LEVELS,
    GraphscanError,
    as_text,
    one_line,
    shown,
    subgraphs,
)

CPU = "CPUExecutionProvider"
# onnxruntime's optimization levels by graphscan's names; "disabled" runs the graph as written.
LEVELS = {"disabled": "ORT_DISABLE_ALL", **RUNTIME_LEVELS}
# How onnxruntime and numpy say that an allocation failed.
OUT_OF_MEMORY = re.compile(r"bad_alloc|bad allocation|failed to allocate|out of memory|cannot allocate", re.I)


def session_options(
    level: str = "disabled",
    threads: int = 0,
    int8_allowed: bool = False,
    config: dict[str, str] | None = None,
    arena: bool = True,
) -> ort.SessionOptions:
    """onnxruntime session options, built one way for every command.

    ``level``: "disabled" (the graph as written) or a ``--level``; ``threads``:
    intra-op threads, one after another (0: onnxruntime's default);
    ``int8_allowed``: session.qdqisint8allowed=1; ``config``: more session
    config entries; ``arena``: onnxruntime's CPU memory arena. onnxruntime's
    own log is off: a failure is reported in graphscan's one line.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, LEVELS[level])
    options.log_severity_level = 4
    if int8_allowed:
        options.add_session_config_entry("session.qdqisint8allowed", "1")
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    options.enable_cpu_mem_arena = arena
    return options


def run_options() -> ort.RunOptions:
    """Run options with onnxruntime's log off, as in session_options."""
    options = ort.RunOptions()
    options.log_severity_level = 4
    return options


def does_not_run(subject: str, exc: BaseException) -> GraphscanError:
    """Exit 5 blaming ``subject``, a user's model (``"<path>: model"``) or one
    graphscan derived from it: it does not run in onnxruntime, and why."""
    if isinstance(exc, MemoryError) or OUT_OF_MEMORY.search(str(exc)):
        return GraphscanError(f"{subject} does not run in onnxruntime: out of memory ({one_line(exc)})", EXIT_RUNTIME)
    return GraphscanError(f"{subject} does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME)


@contextlib.contextmanager
def temporary_folder(prefix: str) -> Iterator[str]:
    """A new folder in the system's temporary folder, removed afterwards. No
    writable temporary folder is exit 3 saying so (and TMPDIR), not a crash;
    onnxruntime failing to write into it (a full disk) is exit 3 too, never
    a model that "does not run"."""
    import shutil
    import tempfile

    try:
        folder = tempfile.mkdtemp(prefix=prefix)
    except (OSError, ValueError) as exc:
        where = tempfile.tempdir or os.environ.get("TMPDIR") or "the temporary folder"
        raise GraphscanError(
            f"no writable temporary folder ({shown(where)}: {getattr(exc, 'strerror', None) or one_line(exc)}); "
            "set TMPDIR to one",
            EXIT_NO_FILE,
        )
    try:
        yield folder
    except GraphscanError as exc:
        if exc.exit_code == EXIT_RUNTIME and folder in str(exc):
            raise GraphscanError(
                f"cannot write into the temporary folder {shown(folder)} ({one_line(exc)}): is it full? set TMPDIR",
                EXIT_NO_FILE,
            ) from None
        raise
    except OSError as exc:
        raise GraphscanError(
            f"cannot write into the temporary folder {shown(folder)} ({exc.strerror or exc}): is it full? set TMPDIR",
            EXIT_NO_FILE,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def inputs_hint(generated: bool, size: int, paths: list[str]) -> Iterator[None]:
    """When one of the user's models (``paths``) does not run on inputs graphscan
    generated, say so in the same line, and how to give others: a model may run
    only at one size (a symbolic dimension that breaks a broadcast) or only on
    particular values (an audio model's sample rate)."""
    try:
        yield
    except GraphscanError as exc:
        subjects = tuple(f"{shown(path)}: model does not run" for path in paths)
        if not (generated and exc.exit_code == EXIT_RUNTIME and str(exc).startswith(subjects)):
            raise
        raise GraphscanError(
            f"{exc}; the inputs were generated (seeded normal data, symbolic dimensions {size}): if the model "
            "needs particular sizes or values, give them with --shape or --inputs",
            EXIT_RUNTIME,
        ) from None


def open_session(
    model: onnx.ModelProto | bytes,
    subject: str,
    options: ort.SessionOptions | None = None,
    provider: str = CPU,
) -> ort.InferenceSession:
    """A session of ``model``; exit 5 blaming ``subject`` when it cannot be built."""
    try:
        data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
        # onnxruntime prints "EP Error ... Falling back" on stdout when a session fails
        # in some ways: stdout is the answer's alone.
        with contextlib.redirect_stdout(io.StringIO()):
            return ort.InferenceSession(data, options or session_options(), providers=[provider])
    except Exception as exc:
        raise does_not_run(subject, exc)


def graph_names(graph: onnx.GraphProto) -> Iterator[str]:
    """Every name in ``graph`` and its If/Loop/Scan bodies: nodes, tensors, inputs, outputs, initializers."""
    for node in graph.node:
        yield node.name
        yield from node.input
        yield from node.output
        for body in subgraphs(node):
            yield from graph_names(body)
    for info in itertools.chain(graph.input, graph.output, graph.value_info):
        yield info.name
    for init in graph.initializer:
        yield init.name
    for sparse in graph.sparse_initializer:
        yield sparse.values.name


def fresh_prefix(*models: onnx.ModelProto, base: str = "graphscan") -> str:
    """``graphscan.``, or ``graphscan~1.``, ``graphscan~2.``, ...: the first prefix
    no name in ``models`` starts with, so no name graphscan derives can be one
    the models already use (a node named ``graphscan.where/x`` changed impact's answer)."""
    names = {as_text(name) for model in models for name in graph_names(model.graph)}
    prefix, k = f"{base}.", 0
    while any(name.startswith(prefix) for name in names):
        k += 1
        prefix = f"{base}~{k}."
    return prefix


def output_pairs(float_model: onnx.ModelProto, quant_model: onnx.ModelProto, a: str, b: str) -> list[tuple[str, str]]:
    """``[(float output, quantized output)]`` in the float model's order: by name
    when every float output has a quantized output of that name, else by
    position; exit 7 when neither fits. The one pairing of trace, impact and check."""
    first = [o.name for o in float_model.graph.output]
    second = [o.name for o in quant_model.graph.output]
    if set(first) <= set(second):
        return [(name, name) for name in first]
    if len(first) == len(second):
        return list(zip(first, second, strict=True))
    raise GraphscanError(
        f"{shown(a)} and {shown(b)}: the models' outputs differ ({', '.join(first)} vs {', '.join(second)})",
        EXIT_INPUTS,
    )


def model_outputs(
    model: onnx.ModelProto,
    samples: list[dict],
    path: str,
    names: list[str] | None = None,
    options: ort.SessionOptions | None = None,
) -> list:
    """Per sample, the outputs ``names`` (default: every graph output, in graph
    order) of ``model``, one session: run as written unless ``options`` say otherwise."""
    session = open_session(model, f"{shown(path)}: model", options or impact_options())
    names = names or [o.name for o in model.graph.output]
    outputs = []
    for feeds in samples:
        try:
            outputs.append(session.run(names, feeds))
        except Exception as exc:
            raise does_not_run(f"{shown(path)}: model", exc)
    return outputs


def output_sqnr(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    samples: list[dict],
    pairs: list[tuple[str, str]],
    float_path: str,
    quant_path: str,
    options: ort.SessionOptions,
) -> tuple[float | None, bool, bool]:
    """``(sqnr_db, exact, empty)`` of the quantized model's outputs against the
    float model's, paired by ``pairs`` and both run at ``options``: OutputNoise's
    definition, shared by impact's deployed figure, check and tune."""
    noise = OutputNoise(model_outputs(float_model, samples, float_path, [f for f, _ in pairs], options))
    sqnr, exact = noise.measure(model_outputs(quant_model, samples, quant_path, [q for _, q in pairs], options))
    return sqnr, exact, noise.empty


def deployed_options(level: str = "all") -> ort.SessionOptions:
    """A session as users run the model: onnxruntime's default settings (all
    optimizations, its own thread count), or another ``--level``. onnxruntime
    rewrites the graph there (WeightBiasQuantization can quantize a Conv that
    was excluded and fuse it into a QLinearConv), so accuracy is measured here."""
    return session_options(level)


def impact_options(threads: int = 0) -> ort.SessionOptions:
    """The options impact and check measure with: the graph as written, no
    pre-packing, no arena.

    onnxruntime pre-packs constant weights but not weights computed by a
    node or read from an input, and the two sum in different orders: without
    pre-packing, a node computes the same bits whatever segment it runs in
    (and the float model too, so a model compared with itself gives exactly
    null). Each session's arena would keep its largest run's memory for good,
    and impact holds dozens of sessions: 3.3 GB instead of 1.3 GB on PP-OCR det
    at 320x320 with 4 samples, at the same speed.
    """
    return session_options(threads=threads, config={"session.disable_prepacking": "1"}, arena=False)


class OutputNoise:
    """The output SQNR of quantized outputs against the float model's, summed
    over every output and sample: the one definition of impact, check and tune."""

    def __init__(self, float_outputs: list) -> None:
        self.reference = [[np.asarray(o, dtype=np.float64) for o in sample] for sample in float_outputs]
        self.signal = sum(energy(o) for sample in self.reference for o in sample)
        # No output value at all (a zero-size input): nothing can be verified.
        self.empty = not any(o.size for sample in self.reference for o in sample)

    def measure(self, quant_outputs: list) -> tuple[float | None, bool]:
        """``(sqnr_db, exact)``: ``10*log10(sum f^2 / sum (f - q)^2)`` over everything
        (None when undefined) and whether q equals f exactly."""
        noise = 0.0
        for reference, sample in zip(self.reference, quant_outputs, strict=True):
            for f, q in zip(reference, sample, strict=True):
                if f.shape != np.shape(q):
                    raise GraphscanError(
                        f"an output is {list(np.shape(q))} in the quantized model and {list(f.shape)} "
                        "in the float model",
                        EXIT_INPUTS,
                    )
                with np.errstate(all="ignore"):  # inf - inf: a NaN noise, an undefined SQNR
                    difference = f - np.asarray(q, dtype=np.float64)
                    noise += energy(difference)
        return decibels(self.signal, noise), noise == 0.0


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


def compare_outputs(expected, actual):
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
    pending = [(f"output {k}", e, a) for k, (e, a) in enumerate(zip(expected, actual))]
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


def np_size(value):
    """How many values an onnxruntime output holds (0 for an absent optional)."""
    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(np_size(v) for v in value)
    if isinstance(value, dict):
        return len(value)
    return np.asarray(value).size


# A temporary output file is named like this, beside the output: short (a
# 250-character output name still fits NAME_MAX), hidden, never ``*.onnx``.
TEMPORARY_PREFIX = ".graphscan-"


TEMPORARY_SUFFIX = ".partial"


def check_output_path(path):
    """Exit 3 unless ``path`` can be replaced: it is absent or a regular file,
    in a folder that exists. A device, FIFO or folder there is left untouched."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise GraphscanError(f"{shown(path)}: cannot write (no folder {shown(folder)})", EXIT_NO_FILE)
        return None
    except (OSError, ValueError) as exc:
        raise GraphscanError(f"{shown(path)}: cannot write ({getattr(exc, 'strerror', None) or exc})", EXIT_NO_FILE)
    if not stat.S_ISREG(mode):
        raise GraphscanError(f"{shown(path)}: exists and is not a regular file; left untouched", EXIT_NO_FILE)
    return mode


def write_atomically(data, path):
    """Write ``data`` to ``path`` so that it is either the old file or all of the new one.

    The bytes go to a temporary file in the target's folder, are fsynced,
    renamed over the target, and the folder is fsynced. A symbolic link is
    written through. A run killed half-way leaves at most one
    ``.graphscan-*.partial`` file, which is never taken for the output.
    """
    import tempfile

    target = os.path.realpath(path) if os.path.islink(path) else path
    old_mode = check_output_path(target)
    folder = os.path.dirname(os.path.abspath(target))
    if old_mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    else:
        mode = stat.S_IMODE(old_mode)
    temporary = None
    try:
        fd, temporary = tempfile.mkstemp(prefix=TEMPORARY_PREFIX, suffix=TEMPORARY_SUFFIX, dir=folder)
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(temporary, target)
        temporary = None
    except OSError as exc:
        raise GraphscanError(f"{shown(path)}: cannot write ({exc.strerror or exc})", EXIT_NO_FILE)
    finally:  # also on KeyboardInterrupt
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    fsync_folder(folder)


def fsync_folder(folder):
    """Make a rename in ``folder`` durable; file systems that cannot are not an error."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
