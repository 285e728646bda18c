"""The ``graphscan`` fixture of graphscan's pytest plugin (graphscan_pytest.py): graphscan's
commands in this process, one typed method each, their answers kept for the test session.

    def test_the_detector_keeps_its_accuracy(graphscan):
        answer = graphscan.check("det.int8.onnx", float="det.onnx", inputs=["samples"], min_sqnr=10)
        assert answer["ok"]

A kept answer is given again only to the same call: the same command, each path as given,
the contents of every file the call reads (a model and its external data, each file of a
folder of samples, a metric's ``FILE.py``, a budget file) and the value of every option.
Each call returns its own copy. Standard library only at import (the plugin imports this
module at start-up); graphscan is imported by the first call.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the answers' types, for the methods: nothing is imported at run time
    import onnx

    from graphscan import BoundaryAnswer, CheckAnswer, DiffAnswer, IslandsAnswer, NodesAnswer, QdqAnswer
    from graphscan_ort.shared.answers import (
        FuseAnswer,
        ImpactAnswer,
        ReportAnswer,
        RuntimeAnswer,
        TraceAnswer,
        TuneAnswer,
    )

StrPath = str | os.PathLike[str]  # a path the methods take
ANSWER_PATHS = ("table", "report")  # the commands whose paths are saved answers; every other's are models
MODEL_OPTIONS = ("float_path",)  # the options that name a model


def graphscan_core() -> Any:
    """The graphscan module (imported on first use: the plugin's start-up costs nothing)."""
    import graphscan

    return graphscan


def user_metric_file(name: str | None) -> tuple[str, str] | None:
    """``(FILE.py, FUNCTION)`` of a user's metric ``FILE.py:FUNCTION``; None for any other name."""
    file, sep, function = (name or "").rpartition(":")
    return (file, function) if sep and file.endswith(".py") and function.isidentifier() else None


# ---------------------------------------------------------------------------
# The key of a call: what it is asked and everything it reads.


def call_key(command: str, paths: tuple[StrPath, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """The key a call's answer is kept under: the command, each path with what it reads, and
    each option by name with its value (in name order: the order keywords are given in
    changes nothing)."""
    models = command not in ANSWER_PATHS
    return (
        command,
        tuple(read_key(path, model=models) for path in paths),
        tuple((name, read_key(options[name], model=name in MODEL_OPTIONS)) for name in sorted(options)),
    )


def read_key(value: Any, model: bool = False) -> Any:
    """A value as the key holds it: a list item by item; a path (or a metric's
    ``FILE.py:FUNCTION``) as given, made absolute, and each file it reads with the digest of
    its contents; any other value by its type and repr (``1`` is not ``True``, a NaN is one
    value)."""
    if isinstance(value, (list, tuple)):
        return tuple(read_key(item, model) for item in value)
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        files = files_read(text, model)
        if files is None:
            return text
        return (text, os.path.abspath(text), tuple((file, content_digest(file)) for file in files))
    return (type(value).__name__, repr(value))


def files_read(path: str, model: bool) -> list[str] | None:
    """The files a call reads for ``path`` (None: it names none): the file and, for a model,
    its external data; each file of a folder; the file of a metric ``FILE.py:FUNCTION``."""
    if os.path.isfile(path):
        return [path, *(external_data(path) if model else [])]
    if os.path.isdir(path):
        try:
            names = sorted(os.listdir(path))
        except OSError:  # unreadable: the call says so
            return []
        return [os.path.join(path, name) for name in names if os.path.isfile(os.path.join(path, name))]
    metric = user_metric_file(path)
    return [metric[0]] if metric is not None and os.path.isfile(metric[0]) else None


def external_data(model: str) -> list[str]:
    """The external-data files ``model`` names, each ``location`` relative to the model's
    folder as onnx and onnxruntime read it; none when it is not a model (the call says so)."""
    core = graphscan_core()
    try:
        proto = core.load_model(model)  # a big model is skimmed: its weights are not read here
    except core.GraphscanError:
        return []
    folder = os.path.dirname(model)
    return sorted({os.path.join(folder, location) for location in external_locations(proto.graph)})


def external_locations(graph: onnx.GraphProto) -> Iterator[str]:
    """The ``location`` of every tensor of ``graph`` kept in external data: initializers,
    sparse ones and node attributes', in the bodies of If, Loop and Scan too."""
    import onnx

    tensors = list(graph.initializer)
    sparse = list(graph.sparse_initializer)
    for node in graph.node:
        for attribute in node.attribute:
            tensors += [attribute.t, *attribute.tensors]
            sparse += [attribute.sparse_tensor, *attribute.sparse_tensors]
        for body in graphscan_core().subgraphs(node):
            yield from external_locations(body)
    tensors += [part for s in sparse for part in (s.values, s.indices)]
    for tensor in tensors:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield from (entry.value for entry in tensor.external_data if entry.key == "location")


def content_digest(file: str) -> str | None:
    """The SHA-256 of the file's bytes (None: it cannot be read; the call says why): its
    contents, not its size and time, which a rewrite within the clock's step keeps."""
    try:
        with open(file, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


# ---------------------------------------------------------------------------
# The fixture's object.


class Graphscan:
    """graphscan's commands as typed methods, one per command of the core's registry
    (``graphscan.runtime(path)``, ``graphscan.check(path, float=..., inputs=..., min_int8=...)``):
    the paths as the command line takes them, the options as the function's keywords. An
    answer is kept for the test session under its call's key (call_key) and each call gets
    its own copy; a call that writes a file (fuse, ``trace(save=...)``, ``tune(out=...)``, report)
    runs every time. A bad input raises ``graphscan.GraphscanError`` with its one line and
    exit code."""

    def __init__(self, answers: dict[Any, Any]) -> None:
        self._answers = answers

    def _answer(
        self, command: Callable[..., Any], paths: tuple[StrPath, ...], options: dict[str, Any], writes: bool = False
    ) -> Any:
        if writes:  # a call that writes a file runs every time
            return command(*map(str, paths), **options)
        key = call_key(command.__name__, paths, options)
        if key not in self._answers:
            self._answers[key] = command(*map(str, paths), **options)
        return copy.deepcopy(self._answers[key])  # what one test does to its answer, no other sees

    def nodes(self, path: StrPath) -> NodesAnswer:
        """Op census and initializer dtypes."""
        return self._answer(graphscan_core().nodes, (path,), {})

    def qdq(self, path: StrPath) -> QdqAnswer:
        """Q/DQ counts, round trips, weight DQs."""
        return self._answer(graphscan_core().qdq, (path,), {})

    def islands(self, path: StrPath) -> IslandsAnswer:
        """Wrapped versus float compute nodes and the float islands."""
        return self._answer(graphscan_core().islands, (path,), {})

    def boundary(self, path: StrPath) -> BoundaryAnswer:
        """Per island, the DQs entering it and the Qs leaving it."""
        return self._answer(graphscan_core().boundary, (path,), {})

    def diff(self, a: StrPath, b: StrPath) -> DiffAnswer:
        """b minus a for the counts."""
        return self._answer(graphscan_core().diff, (a, b), {})

    def fuse(self, path: StrPath, output: StrPath, **options: Any) -> FuseAnswer:
        """MatMul+Add fused into Gemm, verified, written to ``output`` (every call writes it)."""
        return self._answer(graphscan_core().fuse, (path, output), options, writes=True)

    def trace(self, a: StrPath, b: StrPath, **options: Any) -> TraceAnswer:
        """Per-op isolated and propagated error of ``b`` (quantized) against ``a`` (float)."""
        return self._answer(graphscan_core().trace, (a, b), options, writes=options.get("save") is not None)

    def runtime(self, path: StrPath, **options: Any) -> RuntimeAnswer:
        """What onnxruntime runs for each node: int8, int8_data, float, absorbed."""
        return self._answer(graphscan_core().runtime, (path,), options)

    def check(self, path: StrPath, **options: Any) -> CheckAnswer:
        """The budgets measured and whether each holds (``float=`` is ``float_path=``)."""
        if "float" in options:
            options["float_path"] = options.pop("float")
        return self._answer(graphscan_core().check, (path,), options)

    def dot(self, path: StrPath, **options: Any) -> str:
        """The island map as Graphviz DOT text."""
        return self._answer(graphscan_core().dot, (path,), options)

    def impact(self, a: StrPath, b: StrPath, **options: Any) -> ImpactAnswer:
        """Output SQNR gained by keeping each op or tensor of ``b`` float."""
        return self._answer(graphscan_core().impact, (a, b), options)

    def tune(self, path: StrPath, **options: Any) -> TuneAnswer:
        """The fastest quantization accurate enough (with ``out=``, written there on every call)."""
        return self._answer(graphscan_core().tune, (path,), options, writes=options.get("out") is not None)

    def table(self, answer: StrPath, **options: Any) -> str:
        """A saved JSON answer shown as its command's table."""
        return self._answer(graphscan_core().table, (answer,), options)

    def report(self, answer: StrPath, *more: StrPath, **options: Any) -> ReportAnswer:
        """Saved answers drawn as one HTML page, written to ``out=`` (every call writes it)."""
        return self._answer(graphscan_core().report, (answer, *more), options, writes=True)
