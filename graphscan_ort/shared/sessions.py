"""onnxruntime sessions, one way for every command: options, the blame line, running."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import (
    EXIT_INPUTS,
    EXIT_NO_FILE,
    EXIT_RUNTIME,
    RUNTIME_LEVELS,
    GraphscanError,
    one_line,
    shown,
)
from graphscan_ort.shared.answers import Environment

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
    spinning: bool = False,
) -> ort.SessionOptions:
    """onnxruntime session options, built one way for every command.

    ``level``: "disabled" (the graph as written) or a ``--level``; ``threads``:
    intra-op threads, one after another (0: onnxruntime's default);
    ``int8_allowed``: session.qdqisint8allowed=1; ``config``: more session
    config entries; ``arena``: onnxruntime's CPU memory arena. onnxruntime's
    own log is off: a failure is reported in graphscan's one line.

    ``spinning``: the pool's threads busy-wait after a run for the next one, as
    in users' sessions; only sessions that are timed need that. graphscan opens
    dozens of sessions that each run a few times, and the spinning of the ones
    before starves the one running: impact on a 4-layer MLP took 0.7 s on 2 cores,
    0.06 s without, with the same answer (spinning decides when a thread works,
    never what it computes).
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
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
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


def model_outputs(
    model: onnx.ModelProto,
    samples: list[dict],
    path: str,
    names: list[str] | None = None,
    options: ort.SessionOptions | None = None,
    opened: ort.InferenceSession | None = None,
) -> list:
    """Per sample, the outputs ``names`` (default: every graph output, in graph
    order) of ``model``, one session: run as written unless ``options`` say otherwise;
    ``opened``: a session of ``model`` at ``options`` open already, run instead of a new one.
    A session of one intra-op thread (tune's, check's: a deployed session) runs the samples
    side by side on up to SAMPLE_WORKERS cores, each run on one thread as deployed: the same
    kernels, the same outputs, as many samples' tensors alive at once as runs."""
    run = sample_runner(model, path, names, options, opened)
    workers = min(SAMPLE_WORKERS, len(samples))
    if options is None or options.intra_op_num_threads != 1 or workers < 2:
        return [run(feeds) for feeds in samples]
    with ThreadPoolExecutor(workers) as pool:  # onnxruntime lets go of the GIL while it runs
        return list(pool.map(run, samples))


def usable_cores() -> int:
    """The cores this process may run on (1 where the platform cannot tell)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


# Samples run at once by model_outputs in one-thread sessions: one per usable core, up to 2
# (the outputs of every sample are held anyway; each run in flight adds its own tensors).
SAMPLE_WORKERS = min(2, usable_cores())


def each_sample_outputs(
    model: onnx.ModelProto,
    samples: list[dict],
    path: str,
    names: list[str] | None = None,
    options: ort.SessionOptions | None = None,
) -> Iterator[list]:
    """``model_outputs`` one sample at a time: a caller that reduces each sample's outputs
    holds one sample's, not every sample's (a model's inner tensors on a recognizer's 40
    crops up to 1105 wide: 3.6 GB at once)."""
    run = sample_runner(model, path, names, options)
    for feeds in samples:
        yield run(feeds)


def sample_runner(
    model: onnx.ModelProto,
    path: str,
    names: list[str] | None,
    options: ort.SessionOptions | None,
    opened: ort.InferenceSession | None = None,
) -> Callable[[dict], list]:
    """One session of ``model`` (``opened``, else a new one at ``options``, else impact's),
    as a function of one sample's feeds to its outputs ``names`` (default: every graph
    output); exit 5 blaming the model when it cannot be built or a run fails."""
    subject = f"{shown(path)}: model"
    session = opened or open_session(model, subject, options or impact_options())
    wanted = names or [o.name for o in model.graph.output]

    def run(feeds: dict) -> list:
        try:
            return session.run(wanted, feeds)
        except Exception as exc:
            raise does_not_run(subject, exc)

    return run


def sample_outputs(
    model: onnx.ModelProto, samples: list[dict], path: str, files: list[str], flag: str, keep: bool = True
) -> list:
    """``model_outputs`` of the float model on the user's samples, read from ``files``
    (given with ``flag``): a sample it does not run on, though it fits the declared inputs
    (a symbolic dimension the weights fix), is exit 7 naming that sample; the model ran
    nothing wrong. A session that cannot be built, or memory that runs out, still blames
    the model (exit 5). ``keep`` False: each sample only checked, no outputs held."""
    session = open_session(model, f"{shown(path)}: model", impact_options())
    outputs = []
    for feeds, file in zip(samples, files, strict=True):
        try:
            ran = session.run(None, feeds)
            if keep:
                outputs.append(ran)
        except Exception as exc:
            if isinstance(exc, MemoryError) or OUT_OF_MEMORY.search(str(exc)):
                raise does_not_run(f"{shown(path)}: model", exc)
            raise GraphscanError(
                f"{flag} {shown(file)}: {shown(path)} does not run on this sample, though it fits the declared "
                f"inputs ({one_line(exc)})",
                EXIT_INPUTS,
            )
    return outputs


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


SHARED_ARENA: list[bool] = []  # [True] once this process registered onnxruntime's shared CPU arena, [False] if not


def shared_arena() -> bool:
    """Whether sessions can take their tensors from one onnxruntime CPU arena the process
    shares (``session.use_env_allocators``), registered on first use: trace's combined model
    and levels' reductions, impact's segments. Separate arenas would each keep their own
    high-water mark, and without one, glibc keeps in pieces what every run freed. It grows by
    powers of two: growing by what is asked left as many pieces (impact's ranking of PP-OCRv4's
    detector on one page at 736x1120 peaked at 945 MB so, 554 MB by powers of two)."""
    if not SHARED_ARENA:
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        try:  # arena_extend_strategy 0: kNextPowerOfTwo
            ort.create_and_register_allocator(memory, ort.OrtArenaCfg({"arena_extend_strategy": 0}))
            SHARED_ARENA.append(True)
        except Exception:
            SHARED_ARENA.append(False)
    return SHARED_ARENA[0]


def shared_arena_options(threads: int = 0) -> ort.SessionOptions:
    """``impact_options`` on the shared arena (shared_arena), kept between runs; where it
    cannot be registered, impact_options as they are (no arena).

    For many sessions that each run many times (impact's segments): without an arena every
    run's tensors come from malloc. impact's ranking of PP-OCRv4's detector on one page at
    736x1120 peaked at 1,222 MB so, 554 MB on the shared arena, in the same time, with the
    same bits."""
    options = impact_options(threads)
    if shared_arena():
        options.enable_cpu_mem_arena = True
        options.add_session_config_entry("session.use_env_allocators", "1")
    return options


def shrink_shared_arena() -> None:
    """Gives the shared arena's free regions back to the system (a run of a one-node
    session that asks onnxruntime to shrink the arena after it): what a finished
    impact's sessions held is not kept for the rest of the process."""
    if not SHARED_ARENA or not SHARED_ARENA[0]:  # never registered: nothing to shrink
        return
    node = onnx.helper.make_node("Identity", ["x"], ["y"])
    scalar = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        [node],
        "graphscan.shrink",
        [onnx.helper.make_tensor_value_info("x", scalar, [])],
        [onnx.helper.make_tensor_value_info("y", scalar, [])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    session = open_session(model, "graphscan's arena", shared_arena_options(1))
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    session.run(["y"], {"x": np.zeros((), np.float32)}, options)


def run_model(model: onnx.ModelProto, feeds: dict[str, np.ndarray], subject: str) -> list[Any]:
    """All graph outputs of ``model`` on ``feeds``, with ORT's own fusions off;
    a failure blames ``subject``."""
    return model_runner(model, subject)(feeds)


def model_runner(model: onnx.ModelProto, subject: str) -> Callable[[dict[str, np.ndarray]], list[Any]]:
    """``run_model`` for many samples: one session, built at the first run (a model that
    cannot be built fails there, as run_model does), then each run on its feeds."""
    session: list[ort.InferenceSession] = []

    def run(feeds: dict[str, np.ndarray]) -> list[Any]:
        if not session:
            session.append(open_session(model, subject))
        try:
            return session[0].run(None, feeds, run_options())
        except Exception as exc:
            raise does_not_run(subject, exc)

    return run


# What KeptRuns holds at most of one model's outputs: past it, a sample is run again.
KEPT_RUNS_BYTES = 256 * 2**20


class KeptRuns:
    """``model_runner`` of a model compared with several others on the same samples
    (prepare verifies each of its steps against the original): sample ``k``'s outputs run
    once and kept, up to ``budget`` bytes in all (past that, run again each time)."""

    def __init__(self, model: onnx.ModelProto, subject: str, budget: int = KEPT_RUNS_BYTES) -> None:
        self.model, self.run = model, model_runner(model, subject)
        self.kept: dict[int, list[Any]] = {}
        self.held, self.budget = 0, budget

    def __call__(self, k: int, feeds: dict[str, np.ndarray]) -> list[Any]:
        if k in self.kept:
            return self.kept[k]
        outputs = self.run(feeds)
        size = sum(getattr(o, "nbytes", 0) for o in outputs)  # arrays; a sequence or map counts nothing
        if self.held + size <= self.budget:
            self.kept[k], self.held = outputs, self.held + size
        return outputs


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The quantizer and quant_pre_process print progress on stdout (stdout is graphscan's
    answer) and log advice, and whole tracebacks of what they refuse, through Python's
    logging: none of it reaches the user, whose stderr is graphscan's one line. A failure
    still raises, and graphscan reports it."""
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(disabled)


def environment(
    level: str, provider: str = CPU, threads: int | None = None, int8_allowed: bool | None = None
) -> Environment:
    """What a command's sessions ran on, as its answer's ``environment`` lists it:
    onnxruntime's version, the provider and level, tune's ``threads``, the machine,
    runtime's ``int8_allowed`` (those two only where given), in that order."""
    import platform

    answer: dict[str, Any] = {"onnxruntime": ort.__version__, "provider": provider, "level": level}
    if threads is not None:
        answer["threads"] = threads
    answer["machine"] = platform.machine()
    if int8_allowed is not None:
        answer["int8_allowed"] = int8_allowed
    return cast(Environment, answer)  # built key by key: threads comes before machine
