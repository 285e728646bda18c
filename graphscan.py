#!/usr/bin/env python3
"""graphscan: count what really happened when an ONNX model was quantized.

A QDQ model keeps every operator and only wraps tensors in QuantizeLinear /
DequantizeLinear, so "quantized" and "runs in int8" can only be told apart by
counting the graph. The contract (keys, ordering, exit codes) is docs/SPEC.md.

    python graphscan.py <command> <model...>

This file is the onnx-only core: loading, the graph index and its counting
rules, the counting commands, tables and DOT, and the whole command line. It
can be copied alone next to any model folder. The commands that run models
(fuse, trace, runtime, impact, and check's runtime budgets) live in the
``graphscan_ort`` package beside it, imported only when one of them is asked
for; without it (or without onnxruntime) they are exit 2 with one line.

Every command is a function ``path(s) -> dict``; ``main(argv) -> int`` is a
thin layer that prints one JSON object on stdout or one error line on stderr.
Only the standard library and onnx are imported at start. ``__all__`` names
what the package and the pytest plugin may use of this file.
"""

from __future__ import annotations

# Ctrl-C is answered from the first moment this file runs: the handler comes
# before every other import (a traceback in the first milliseconds was exit 1).
import os
import signal
import sys

EXIT_INTERRUPTED = 130  # SIGINT, as shells report it (128 + 2)
EXIT_TERMINATED = 143  # SIGTERM (128 + 15): a CI timeout, a killed job


def _exit_on_interrupt(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM where main() cannot catch it (importing, shutting down): one
    line, exit 130 or 143; nothing is written yet or everything already is."""
    terminated = signum == signal.SIGTERM
    try:
        os.write(2, b"graphscan: terminated\n" if terminated else b"graphscan: interrupted\n")
    finally:
        os._exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _exit_on_interrupt)
    signal.signal(signal.SIGTERM, _exit_on_interrupt)
    # The graphscan_ort package imports this file as ``graphscan``: it must find
    # this very module, not load a second copy with classes of its own.
    if getattr(sys.modules.get(__name__), "__dict__", None) is globals():  # not under a runner like cProfile
        sys.modules.setdefault("graphscan", sys.modules[__name__])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import stat  # noqa: E402
import types  # noqa: E402
import typing  # noqa: E402
import unicodedata  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, MutableSequence, Sequence  # noqa: E402
from typing import TYPE_CHECKING, Any, NotRequired, TextIO, TypedDict  # noqa: E402

import onnx  # noqa: E402  (after the SIGINT handler on purpose)

if TYPE_CHECKING:  # names for annotations only: nothing here exists at runtime
    from typing import TypeVar

    from _typeshed import SupportsWrite

    StrSequence = TypeVar("StrSequence", bound=Sequence[str])

# What the graphscan_ort package and the pytest plugin may use of this file
# (tests/cli/test_layout.py fails on any other name they import); everything
# else is this file's own. Tests, bench/, gen_models.py and ops_report.py may
# reach further.

# errors, exit codes and interruptions: one line and its code
__all__ = [
    "EXIT_BUDGET",
    "EXIT_CODES",
    "EXIT_INPUTS",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_MISMATCH",
    "EXIT_NOT_ONNX",
    "EXIT_NO_FILE",
    "EXIT_OK",
    "EXIT_RUNTIME",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "INTERRUPTED",
    "GraphscanError",
    "interruption",
    "one_line",
    "shown",
    "stderr_line",
]
# loading (a saved answer too)
__all__ += ["check_readable", "load_model", "load_with_weights", "parse_model", "read_answer"]
# the index and its graph and Q/DQ vocabulary
__all__ += [
    "DEQUANTIZE",
    "QUANTIZE",
    "GraphIndex",
    "as_text",
    "data_source",
    "dtype_name",
    "node_name",
    "output_chain",
    "subgraphs",
    "value_inputs",
]
# the table kit
__all__ += [
    "TABLE_WIDTH",
    "format_fields",
    "format_names",
    "metric_words",
    "page",
    "part_words",
    "render_table",
    "section",
    "visible",
]
# the command kit: declarations, option groups and their types
__all__ += [
    "MAX_THREADS",
    "RUNTIME_LEVELS",
    "Command",
    "Given",
    "MetricChoice",
    "OnlyWith",
    "Option",
    "Samples",
    "Session",
    "Takes",
    "finite_float",
    "int_between",
    "non_negative_int",
    "only_with",
]
# the CPU targets: one object, its names and install command
__all__ += ["CPU_TARGETS", "INSTALL_TARGETS", "NATIVE", "CpuTarget", "TargetRunner"]
# check's budgets, as the plugin's config and the package's measurers read them
__all__ += [
    "BUDGETS",
    "CHECK",
    "FLOAT_BUDGETS",
    "NEEDS",
    "BudgetJob",
    "Explaining",
    "Measured",
    "budget_limit",
    "either_of",
    "unmet_need",
]
# the answers of the core's commands, as the plugin's fixture returns them
__all__ += ["BoundaryAnswer", "CheckAnswer", "DiffAnswer", "IslandsAnswer", "NodesAnswer", "QdqAnswer"]
# the commands as functions, and the command line
__all__ += [
    "boundary",
    "check",
    "console_main",
    "diff",
    "dot",
    "fuse",
    "impact",
    "islands",
    "main",
    "nodes",
    "qdq",
    "report",
    "runtime",
    "table",
    "trace",
    "tune",
]


EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_NO_FILE = 3
EXIT_NOT_ONNX = 4
EXIT_RUNTIME = 5
EXIT_MISMATCH = 6
EXIT_INPUTS = 7
EXIT_BUDGET = 8
# Every exit code and what it means, in one place: --help's epilog is built from
# it, and the tests hold README.md and docs/SPEC.md to it.
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_INTERNAL: "internal error",
    EXIT_USAGE: "usage",
    EXIT_NO_FILE: "no such file (or output or stdout not writable)",
    EXIT_NOT_ONNX: "not an ONNX model",
    EXIT_RUNTIME: "model does not run in onnxruntime",
    EXIT_MISMATCH: "fused model does not reproduce the original",
    EXIT_INPUTS: "inputs do not match the models",
    EXIT_BUDGET: "check: a budget is broken; tune: the target is not met",
    EXIT_INTERRUPTED: "interrupted",
    EXIT_TERMINATED: "terminated",
}

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
_PACKAGE = "graphscan_ort"  # the commands that run models, beside this file


class GraphscanError(Exception):
    """A user error: one line for stderr and the exit code that goes with it."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


INTERRUPTED: list[int] = []  # the signals (SIGINT, SIGTERM) that arrived while main() ran


class _Terminated(KeyboardInterrupt):
    """SIGTERM while main() runs: it unwinds as Ctrl-C does, so every temporary file
    and folder is removed and nothing is left half-written (exit 143, not 130)."""


def _note_interrupt(signum: int, frame: object) -> None:
    """main()'s SIGINT and SIGTERM handler: KeyboardInterrupt (Terminated), remembered
    (onnxruntime's C initialization turns it into an ImportError, which must not hide it).
    A signal that arrives while an interrupt unwinds is only remembered: a second Ctrl-C,
    or a CI runner's SIGTERM after its SIGINT, must not cut short the code that removes
    what the run made (the exit code still says terminated)."""
    INTERRUPTED.append(signum)
    if not isinstance(sys.exc_info()[1], KeyboardInterrupt):
        raise interruption()


def interruption() -> KeyboardInterrupt:
    """What the signals that arrived ask for: Terminated after a SIGTERM, else Ctrl-C's."""
    return _Terminated() if signal.SIGTERM in INTERRUPTED else KeyboardInterrupt()


# --------------------------------------------------------------------------
# Loading


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message, for a one-line stderr report."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def shown(path: str | bytes | os.PathLike) -> str:
    """``path`` as error messages name it: unchanged when it prints on one line,
    else escaped as ``repr`` does (a newline in a file name shows as ``\\n``)."""
    path = os.fsdecode(path)
    return path if path.isprintable() else repr(path)


# Characters str.splitlines() breaks at: a message must never contain one.
_LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def _single_line(text: str) -> str:
    """``text`` with every line break escaped, so a report stays one line."""
    return _LINE_BREAKS.sub(lambda m: repr(m.group())[1:-1], text)


def check_readable(path: str) -> None:
    """Raise exit 3 unless ``path`` is an existing regular file."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise GraphscanError(f"{shown(path)}: no such file ({getattr(exc, 'strerror', None) or exc})", EXIT_NO_FILE)
    if not stat.S_ISREG(mode):
        raise GraphscanError(f"{shown(path)}: not a regular file", EXIT_NO_FILE)


# Above this size a model is parsed without its tensor payloads (see _skim_model).
_SKIM_THRESHOLD = 64 * 1024 * 1024
# ModelProto's fields and their wire types (0 varint, 2 length-delimited): the
# first field of a model file is one of these, so a file that starts with
# anything else is refused before it is read further.
_MODEL_FIELD_WIRES = {
    field.number: 0 if field.type in (field.TYPE_INT64, field.TYPE_INT32) else 2
    for field in onnx.ModelProto.DESCRIPTOR.fields
}


_HEAD_BYTES = 64 * 1024  # how much of a file _check_head reads


def _check_head(head: bytes, path: str) -> None:
    """Exit 4 unless ``head``, a file's first bytes, reads as the start of a ModelProto.

    The first field must be one of ModelProto's, with its wire type, and every
    field that starts inside ``head`` must be well formed (a field number
    above 0, a wire type protobuf still writes). A zero-filled, random or
    text file is refused from its first bytes, in microseconds, before the
    rest of it is read or parsed.
    """
    pos, first, problem = 0, True, None
    try:
        while pos < len(head) and problem is None:
            key, pos = _read_varint(head, pos)
            number, wire = key >> 3, key & 7
            if first and _MODEL_FIELD_WIRES.get(number) != wire:
                problem = "it does not start with a ModelProto field"
            elif number == 0 or wire not in (0, 1, _LENGTH_DELIMITED, 5):
                problem = f"malformed protobuf at byte {pos}"
            first = False
            if wire == 0:
                _, pos = _read_varint(head, pos)
            elif wire == _LENGTH_DELIMITED:
                length, pos = _read_varint(head, pos)
                pos += length
            else:
                pos += 8 if wire == 1 else 4
    except IndexError:  # the head ends inside a field: nothing wrong so far
        pass
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        raise GraphscanError(f"{shown(path)}: not an ONNX model ({problem})", EXIT_NOT_ONNX)


def load_model(path: str, weights: bool = False) -> onnx.ModelProto:
    """Parse ``path`` as an ONNX model without touching external-data files.

    Without ``weights``, a big file is parsed without its initializers' data,
    reading only the bytes it keeps: a 2 GiB model costs megabytes, not two
    copies of its weights. Names, dims and data types of initializers are kept.
    """
    check_readable(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            _check_head(os.pread(f.fileno(), _HEAD_BYTES, 0), path)
            if weights or size < _SKIM_THRESHOLD:
                return parse_model(f.read(), path)
            try:
                data = _skim_model(_FileBytes(f.fileno(), size))
            except (IndexError, ValueError) as exc:
                raise GraphscanError(f"{shown(path)}: not an ONNX model ({one_line(exc)})", EXIT_NOT_ONNX)
            return parse_model(data, path)
    except OSError as exc:
        raise GraphscanError(f"{shown(path)}: cannot read ({exc.strerror or exc})", EXIT_NO_FILE)


class _FileBytes:
    """The bytes of an open file, indexed and sliced like ``bytes``, read on demand.

    Not a memory map: a file truncated while it is read gives a short read
    (``ValueError``, exit 4), never SIGBUS. Reads go through a window of
    ``WINDOW`` bytes, so the skimmer's byte-by-byte varints stay cheap.
    """

    WINDOW = 1 << 20
    FIELD_HEAD = 20  # a field's key and length varints take at most this many bytes

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.start, self.window = 0, b""

    def __len__(self) -> int:
        return self.size

    def _read(self, start: int, length: int) -> bytes:
        data = os.pread(self.fd, length, start)
        if len(data) != length:
            raise ValueError("the file is shorter than when it was opened (changed while being read)")
        return data

    def __getitem__(self, key: int | slice) -> Any:  # int for an index, bytes for a slice
        if isinstance(key, slice):
            start, stop, _ = key.indices(self.size)
            if stop <= start:
                return b""
            if start >= self.start and stop <= self.start + len(self.window):
                return self.window[start - self.start : stop - self.start]
            if stop - start > self.WINDOW:
                return self._read(start, stop - start)
            self._fill(start)
            return self.window[start - self.start : stop - self.start]
        if not 0 <= key < self.size:
            raise IndexError("read past the end of the file")
        offset = key - self.start
        if not 0 <= offset < len(self.window):
            self._fill(key)
            offset = 0
        return self.window[offset]

    def _fill(self, start: int) -> None:
        self.start = start
        self.window = self._read(start, min(self.WINDOW, self.size - start))

    def window_at(self, pos: int) -> tuple[bytes, int]:
        """``(window, its start)`` holding the head of the field at ``pos``."""
        window_end = self.start + len(self.window)
        if pos < self.start or (pos + self.FIELD_HEAD > window_end and window_end < self.size):
            self._fill(pos)
        return self.window, self.start


# Protobuf wire format, just enough to skip tensor payloads of big models.
_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER = 5  # GraphProto.initializer
# TensorProto float_data, int32_data, string_data, int64_data, raw_data,
# double_data, uint64_data: the payload; everything else is the header.
_TENSOR_PAYLOAD = {4, 5, 6, 7, 9, 10, 11}
_LENGTH_DELIMITED = 2


def _read_varint(buf: bytes | _FileBytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _wire_fields(buf: bytes | _FileBytes, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Yield ``(field number, wire type, value start, value end, field start)`` for
    each field in ``buf[start:end]``; ``buf`` is ``bytes`` or a ``FileBytes``, whose
    fields are parsed inside its window of plain bytes."""
    file = buf if isinstance(buf, _FileBytes) else None
    data, base, data_end = (b"", 0, 0) if file is not None else (buf, 0, len(buf))
    pos = start
    while pos < end:
        # A window is immutable bytes: still right for its range after the file's moved on.
        if file is not None and (pos < base or (pos + file.FIELD_HEAD > data_end and data_end < file.size)):
            data, base = file.window_at(pos)
            data_end = base + len(data)
        field_start = pos
        key, pos = _read_varint(data, pos - base)
        if key >> 3 == 0:
            raise ValueError("field number 0")
        wire = key & 7
        value_start = pos
        if wire == 0:
            _, pos = _read_varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == _LENGTH_DELIMITED:
            length, pos = _read_varint(data, pos)
            value_start = pos
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        pos += base
        if pos > end:
            raise ValueError("truncated field")
        yield key >> 3, wire, value_start + base, pos, field_start


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | _LENGTH_DELIMITED) + _encode_varint(len(payload)) + payload


def _skim_model(buf: bytes | _FileBytes) -> bytes:
    """ModelProto bytes with every graph initializer reduced to its header."""
    out = bytearray()
    for number, wire, start, end, field_start in _wire_fields(buf, 0, len(buf)):
        if number == _MODEL_GRAPH and wire == _LENGTH_DELIMITED:
            out += _length_delimited(_MODEL_GRAPH, _skim_graph(buf, start, end))
        else:
            out += buf[field_start:end]
    return bytes(out)


def _skim_graph(buf: bytes | _FileBytes, start: int, end: int) -> bytes:
    out = bytearray()
    kept_from = start  # fields other than initializers are copied in runs, not one by one
    for number, wire, value_start, value_end, field_start in _wire_fields(buf, start, end):
        if number == _GRAPH_INITIALIZER and wire == _LENGTH_DELIMITED:
            if field_start > kept_from:
                out += buf[kept_from:field_start]
            kept_from = value_end
            tensor, first, last = buf, value_start, value_end
            if last - first <= _FileBytes.WINDOW:  # small: one read, then parsed as bytes
                tensor, first, last = buf[first:last], 0, last - first
            header = b"".join(
                tensor[f_start:f_end]
                for n, _, _, f_end, f_start in _wire_fields(tensor, first, last)
                if n not in _TENSOR_PAYLOAD
            )
            out += _length_delimited(_GRAPH_INITIALIZER, header)
    out += buf[kept_from:end]
    return bytes(out)


def parse_model(data: bytes, path: str) -> onnx.ModelProto:
    """Turn bytes into a ModelProto, or raise exit 4 naming ``path``."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError, upb sometimes others
        raise GraphscanError(f"{shown(path)}: not an ONNX model ({one_line(exc)})", EXIT_NOT_ONNX)
    # Protobuf parses an empty file, or one cut at a field boundary, as a
    # (partial) message: a model must at least carry a graph and an opset.
    if not data or not model.HasField("graph") or not model.opset_import:
        raise GraphscanError(f"{shown(path)}: not an ONNX model (no graph or opset_import)", EXIT_NOT_ONNX)
    return model


def load_with_weights(path: str) -> onnx.ModelProto:
    """The model with its weights, external data read by onnx's checked loader."""
    model = load_model(path, weights=True)
    from onnx import external_data_helper

    if any(external_data_helper.uses_external_data(t) for t in model.graph.initializer):
        try:
            external_data_helper.load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
        except Exception as exc:
            raise GraphscanError(f"{shown(path)}: cannot load external data ({one_line(exc)})", EXIT_NOT_ONNX)
    _text_names(model.graph)
    return model


def as_text(value: str | bytes) -> str:
    """A protobuf string field as ``str``.

    Protobuf hands a string field that is not valid UTF-8 to Python as
    ``bytes``; graphscan shows it with U+FFFD for each bad byte, so it sorts
    and prints like every other name.
    """
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _as_texts(values: StrSequence) -> StrSequence | list[str]:
    """``values`` with any ``bytes`` decoded; the list itself when all are ``str``."""
    if bytes in set(map(type, values)):
        return [as_text(v) for v in values]
    return values


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs a node holds as attributes: the bodies of If, Loop and Scan."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def _text_names(graph: onnx.GraphProto) -> None:
    """Give every name of ``graph`` (and of its bodies) that is not valid UTF-8 its
    U+FFFD spelling, in place, as the answers show it: onnxruntime and the
    commands that run models take names as text."""

    def fixed(values: MutableSequence[str]) -> None:
        texts = _as_texts(values)
        if texts is not values:
            values[:] = texts

    for node in graph.node:
        for field in ("name", "op_type", "domain"):
            value = getattr(node, field)
            if isinstance(value, bytes):
                setattr(node, field, as_text(value))
        fixed(node.input)
        fixed(node.output)
        for body in subgraphs(node):
            _text_names(body)
    for item in itertools.chain(graph.input, graph.output, graph.value_info, graph.initializer):
        if isinstance(item.name, bytes):
            item.name = as_text(item.name)
    for sparse in graph.sparse_initializer:
        if isinstance(sparse.values.name, bytes):
            sparse.values.name = as_text(sparse.values.name)


# --------------------------------------------------------------------------
# The graph index: built once, every question answered from it in linear time


def node_name(node: onnx.NodeProto, index: int) -> str:
    """The node's name, or ``<op_type>_<index>`` when it has none."""
    return as_text(node.name) or f"{as_text(node.op_type)}_{index}"


def dtype_name(data_type: int) -> str:
    """onnx's name for a TensorProto data type; unknown numbers stay visible."""
    try:
        return onnx.TensorProto.DataType.Name(data_type)
    except ValueError:
        return f"DATA_TYPE_{data_type}"


class GraphIndex:
    """Producer/consumer tables of a model's top-level graph.

    Node ``i`` is ``graph.node[i]``. Graph inputs, initializers and graph
    outputs are not nodes, so they never appear as producers or consumers;
    empty tensor names (absent optional inputs/outputs) are skipped.
    One pass reads the nodes; every other table is built on first use, mostly
    by set operations that run in C, so a question pays only for what it
    needs. 100,000-node graphs are normal.
    """

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        op_types: list[str] = []
        inputs: list[list[str]] = []
        outputs: list[list[str]] = []
        self.op_types, self.inputs, self.outputs = op_types, inputs, outputs
        self.inputs_with_gaps = {}  # nodes with absent ("") inputs, as written
        for i, node in enumerate(graph.node):
            op_types.append(node.op_type)
            # Slicing a repeated field is far cheaper than iterating it.
            ins, outs = node.input[:], node.output[:]
            if "" in ins:
                self.inputs_with_gaps[i] = ins
                ins = [t for t in ins if t]
            inputs.append(ins)
            outputs.append([t for t in outs if t] if "" in outs else outs)
        self.op_types = op_types = _as_texts(op_types)
        self.is_q = [op == QUANTIZE for op in op_types]
        self.is_dq = [op == DEQUANTIZE for op in op_types]
        self.q_nodes = [i for i, q in enumerate(self.is_q) if q]
        self.dq_nodes = [i for i, dq in enumerate(self.is_dq) if dq]
        self.compute_nodes = [i for i, (q, dq) in enumerate(zip(self.is_q, self.is_dq)) if not (q or dq)]

    def __len__(self) -> int:
        return len(self.op_types)

    def _inputs_of(self, node_indices: Iterable[int]) -> Iterator[str]:
        inputs = self.inputs
        return itertools.chain.from_iterable(inputs[i] for i in node_indices)

    def _outputs_of(self, node_indices: Iterable[int]) -> Iterator[str]:
        outputs = self.outputs
        return itertools.chain.from_iterable(outputs[i] for i in node_indices)

    # Who reads each tensor, as three sets over disjoint groups of readers;
    # each name is hashed once, and every rule below is a set operation in C.
    @functools.cached_property
    def read_by_q(self) -> set[str]:
        return set(self._inputs_of(self.q_nodes))

    @functools.cached_property
    def read_by_dq(self) -> set[str]:
        return set(self._inputs_of(self.dq_nodes))

    @functools.cached_property
    def read_by_compute(self) -> set[str]:
        return set(self._inputs_of(self.compute_nodes))

    @functools.cached_property
    def wrapped(self) -> list[bool]:
        """Per node: every input comes from a DQ and every output goes to Qs only.

        An output nobody consumes (e.g. a bare graph output) is not wrapped.
        """
        dq_outputs = set(self._outputs_of(self.dq_nodes))
        read_by_q_only = self.read_by_q - self.read_by_dq - self.read_by_compute
        inputs, outputs = self.inputs, self.outputs
        wrapped = [False] * len(self)
        for i in self.compute_nodes:
            if dq_outputs.issuperset(inputs[i]) and read_by_q_only.issuperset(outputs[i]):
                wrapped[i] = True
        return wrapped

    @functools.cached_property
    def floating(self) -> list[bool]:
        floating, wrapped = [False] * len(self), self.wrapped
        for i in self.compute_nodes:
            floating[i] = not wrapped[i]
        return floating

    @functools.cached_property
    def float_nodes(self) -> list[int]:
        floating = self.floating
        return [i for i in self.compute_nodes if floating[i]]

    @functools.cached_property
    def producer(self) -> dict[str, int]:
        """``{tensor: index of the node producing it}``."""
        return {t: i for i, outs in enumerate(self.outputs) for t in outs}

    @functools.cached_property
    def float_producer(self) -> dict[str, int]:
        return self._producer_among(self.float_nodes)

    @functools.cached_property
    def dq_producer(self) -> dict[str, int]:
        return self._producer_among(self.dq_nodes)

    def _producer_among(self, node_indices: Iterable[int]) -> dict[str, int]:
        outputs = self.outputs
        return {t: i for i in node_indices for t in outputs[i]}

    @functools.cached_property
    def consumers(self) -> dict[str, list[int]]:
        """``{tensor: [node indices]}`` over every node."""
        return self._consumers(range(len(self)))

    @functools.cached_property
    def float_consumers(self) -> dict[str, list[int]]:
        return self._consumers(self.float_nodes)

    @functools.cached_property
    def q_consumers_of_float(self) -> dict[str, list[int]]:
        """``{tensor made by a float node: [Q nodes reading it]}``."""
        float_outputs = set(self._outputs_of(self.float_nodes))
        inputs = self.inputs
        readers = [i for i in self.q_nodes if not float_outputs.isdisjoint(inputs[i])]
        return self._consumers(readers)

    def _consumers(self, node_indices: Iterable[int]) -> dict[str, list[int]]:
        table: dict[str, list[int]] = {}
        for i in node_indices:
            for tensor in self.inputs[i]:
                users = table.get(tensor)
                if users is None:
                    table[tensor] = [i]
                elif users[-1] != i:  # a node reading one tensor twice is one consumer
                    users.append(i)
        return table

    @functools.cached_property
    def initializers(self) -> set[str]:
        """Names of the graph's initializers."""
        return {init.name for init in self.graph.initializer}

    @functools.cached_property
    def names(self) -> list[str]:
        """Every node's name; ``name(i)`` is cheaper when only a few are needed."""
        return [self.name(i) for i in range(len(self))]

    def name(self, i: int) -> str:
        return node_name(self.graph.node[i], i)

    def is_compute(self, i: int) -> bool:
        return not (self.is_q[i] or self.is_dq[i])

    def producer_of(self, tensor: str) -> int | None:
        """Index of the node producing ``tensor``, or None."""
        return self.producer.get(tensor)

    def consumers_of(self, tensor: str) -> list[int] | tuple[()]:
        return self.consumers.get(tensor, ())


def _float_components(index: GraphIndex) -> list[list[int]]:
    """Connected components of float nodes (lists of node indices), unordered."""
    producer, consumers = index.float_producer, index.float_consumers
    seen = [False] * len(index)
    components = []
    for start in index.float_nodes:
        if seen[start]:
            continue
        seen[start] = True
        component, stack = [], [start]
        while stack:
            i = stack.pop()
            component.append(i)
            for tensor in index.inputs[i]:
                p = producer.get(tensor)
                if p is not None and not seen[p]:
                    seen[p] = True
                    stack.append(p)
            for tensor in index.outputs[i]:
                for c in consumers.get(tensor, ()):
                    if not seen[c]:
                        seen[c] = True
                        stack.append(c)
        components.append(component)
    return components


def _float_islands(index: GraphIndex) -> list[tuple[list[int], list[str]]]:
    """Float islands as ``(node indices, sorted names)`` in SPEC.md's order.

    Each island's names are sorted, and the list by those names, which puts
    the island with the smallest first name first.
    """
    islands = []
    for component in _float_components(index):
        named = sorted((index.name(i), i) for i in component)
        islands.append(([i for _, i in named], [name for name, _ in named]))
    islands.sort(key=lambda island: island[1])
    return islands


def _boundary_of(index: GraphIndex, island: Iterable[int]) -> tuple[set[int], set[int]]:
    """Distinct DQ nodes feeding the island and distinct Q nodes it feeds."""
    out_quantize: set[int]
    in_dequantize, out_quantize = set(), set()
    dq_producer, q_consumers = index.dq_producer, index.q_consumers_of_float
    for i in island:
        for tensor in index.inputs[i]:
            p = dq_producer.get(tensor)
            if p is not None:
                in_dequantize.add(p)
        for tensor in index.outputs[i]:
            out_quantize.update(q_consumers.get(tensor, ()))
    return in_dequantize, out_quantize


def _count_round_trips(index: GraphIndex) -> int:
    """Q nodes whose output is consumed, and consumed only by DQ nodes."""
    read_by_non_dq = index.read_by_q | index.read_by_compute
    read_by_dq_only = index.read_by_dq - read_by_non_dq
    outputs = index.outputs
    return sum(
        1 for i in index.q_nodes if not read_by_dq_only.isdisjoint(outputs[i]) and read_by_non_dq.isdisjoint(outputs[i])
    )


def _count_weight_dequantize(index: GraphIndex) -> int:
    """DQ nodes whose first input is an initializer (a stored int8 weight)."""
    initializers, inputs, gaps = index.initializers, index.inputs, index.inputs_with_gaps
    count = 0
    for i in index.dq_nodes:
        first = (gaps[i] if i in gaps else inputs[i])[:1]  # input 0 as written
        count += bool(first) and first[0] in initializers
    return count


def value_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs that are not initializers: what a run must be fed."""
    initializers = {init.name for init in graph.initializer}
    return [info for info in graph.input if info.name not in initializers]


def _input_chain(index: GraphIndex, graph: onnx.GraphProto, tensor: str) -> list[int]:
    """Indices of the Q/DQ nodes between ``tensor`` and its data source, source first."""
    chain = []
    producer = index.producer_of(tensor)
    while producer is not None and not index.is_compute(producer) and producer not in chain:
        chain.append(producer)
        producer = index.producer_of(_written_input(graph.node[producer]))
    return chain[::-1]


def _written_input(node: onnx.NodeProto) -> str:
    """A node's input 0 as written: "" when it has none (a Q or DQ without inputs is
    malformed, but counted and drawn like any other: its chain starts nowhere)."""
    return node.input[0] if node.input else ""


def data_source(index: GraphIndex, graph: onnx.GraphProto, tensor: str) -> tuple[str, list[int]]:
    """``(source tensor, Q/DQ chain)``: where ``tensor``'s data comes from once
    every Q/DQ in front of it is skipped (a compute output, a graph input or an
    initializer), and the Q/DQ nodes skipped, source first."""
    chain = _input_chain(index, graph, tensor)
    return (_written_input(graph.node[chain[0]]) if chain else tensor), chain


def output_chain(index: GraphIndex, graph: onnx.GraphProto, tensor: str) -> tuple[list[int], str]:
    """The Q->DQ pair right after ``tensor`` and the tensor the next op sees (a Q or DQ
    that writes no output 0, which is malformed, makes no pair): _input_chain's mirror."""
    for q in index.consumers_of(tensor):
        if index.is_q[q]:
            for dq in index.consumers_of(_written_output(graph.node[q])):
                seen = _written_output(graph.node[dq])
                if index.is_dq[dq] and seen:
                    return [q, dq], seen
    return [], tensor


def _written_output(node: onnx.NodeProto) -> str:
    """A node's output 0 as written: "" when it has none or leaves it out."""
    return node.output[0] if node.output else ""


# --------------------------------------------------------------------------
# The answers' types: what docs/SPEC.md promises, key for key


class _Island(TypedDict):
    nodes: list[str]
    size: int
    op_types: list[str]


class _IslandBoundary(TypedDict):
    nodes: list[str]
    in_dequantize: int
    out_quantize: int


class _QdqCounts(TypedDict):
    quantize: int
    dequantize: int
    round_trips: int
    weight_dequantize: int


class _IslandReport(TypedDict):
    compute: int
    wrapped: int
    float: int
    island_count: int
    islands: list[_Island]


class _BoundaryReport(TypedDict):
    island_count: int
    crossings: int
    per_island: list[_IslandBoundary]


class NodesAnswer(TypedDict):
    model: str
    nodes: int
    op_types: dict[str, int]
    initializers: dict[str, int]


class QdqAnswer(_QdqCounts):
    model: str


class IslandsAnswer(_IslandReport):
    model: str


class BoundaryAnswer(_BoundaryReport):
    model: str


class _Summary(TypedDict):
    op_types: dict[str, int]
    quantize: int
    dequantize: int
    round_trips: int
    island_count: int
    float: int


class _Deltas(TypedDict):
    op_delta: dict[str, int]
    quantize_delta: int
    dequantize_delta: int
    round_trip_delta: int
    island_delta: int
    float_delta: int


class DiffAnswer(_Deltas):
    a: str
    b: str


class _Budget(TypedDict):
    name: str
    value: float | None
    limit: float
    ok: bool
    metric: NotRequired[dict[str, Any]]  # min_metric's: the metric's name and parameters
    pooled_sqnr_db: NotRequired[float | None]  # min_sqnr's: every output summed (value: the worst part's)
    worst_part: NotRequired[dict[str, Any] | None]  # min_sqnr's: {output, part, node} of the worst part
    tensor: NotRequired[str | None]  # min_levels': the quantized tensor whose part spans the fewest levels
    part: NotRequired[dict[str, Any] | None]  # min_levels': that part, {part, node}


class CheckAnswer(TypedDict):
    model: str
    float: str | None
    cpu: NotRequired[dict[str, str]]  # {name, onnxruntime, machine}: with --cpu other than native only
    budgets: list[_Budget]
    ok: bool


# --------------------------------------------------------------------------
# Answers from an index (used by the commands and by gen_models.py)


def _census(op_types: Iterable[str]) -> dict[str, int]:
    """``{op_type: count}`` with keys sorted."""
    return dict(sorted(Counter(op_types).items()))


def _initializer_census(graph: onnx.GraphProto) -> dict[str, int]:
    """``{dtype_name: count}`` over the graph's initializers, keys sorted."""
    counts = Counter(dtype_name(init.data_type) for init in graph.initializer)
    return dict(sorted(counts.items()))


def _qdq_counts(index: GraphIndex) -> _QdqCounts:
    return {
        "quantize": len(index.q_nodes),
        "dequantize": len(index.dq_nodes),
        "round_trips": _count_round_trips(index),
        "weight_dequantize": _count_weight_dequantize(index),
    }


def _island_report(index: GraphIndex, islands: list[tuple[list[int], list[str]]]) -> _IslandReport:
    compute = len(index.compute_nodes)
    wrapped = compute - len(index.float_nodes)
    entries: list[_Island] = []
    for members, names in islands:
        entries.append(
            {
                "nodes": names,
                "size": len(members),
                "op_types": sorted(index.op_types[i] for i in members),
            }
        )
    return {
        "compute": compute,
        "wrapped": wrapped,
        "float": compute - wrapped,
        "island_count": len(islands),
        "islands": entries,
    }


def _boundary_report(index: GraphIndex, islands: list[tuple[list[int], list[str]]]) -> _BoundaryReport:
    per_island: list[_IslandBoundary] = []
    for members, names in islands:
        in_dq, out_q = _boundary_of(index, members)
        per_island.append(
            {
                "nodes": names,
                "in_dequantize": len(in_dq),
                "out_quantize": len(out_q),
            }
        )
    crossings = sum(e["in_dequantize"] + e["out_quantize"] for e in per_island)
    return {
        "island_count": len(islands),
        "crossings": crossings,
        "per_island": per_island,
    }


# --------------------------------------------------------------------------
# Commands: path(s) -> dict, exactly the keys SPEC.md lists


def _index_model(path: str) -> GraphIndex:
    return GraphIndex(load_model(path).graph)


def nodes(path: str) -> NodesAnswer:
    """Op census and initializer dtype census."""
    model = load_model(path)
    op_types = _as_texts([node.op_type for node in model.graph.node])  # no index needed
    return {
        "model": path,
        "nodes": len(op_types),
        "op_types": _census(op_types),
        "initializers": _initializer_census(model.graph),
    }


def qdq(path: str) -> QdqAnswer:
    """Q and DQ counts, activation round trips and weight DQs."""
    return {"model": path, **_qdq_counts(_index_model(path))}


def islands(path: str) -> IslandsAnswer:
    """Wrapped versus float compute nodes and the float islands."""
    index = _index_model(path)
    return {"model": path, **_island_report(index, _float_islands(index))}


def boundary(path: str) -> BoundaryAnswer:
    """Per island, the distinct DQs entering it and Qs leaving it."""
    index = _index_model(path)
    return {"model": path, **_boundary_report(index, _float_islands(index))}


def _summary(index: GraphIndex) -> _Summary:
    """The numbers ``diff`` compares, from one index.

    Only what diff reports: islands need no names, weight DQs are not compared.
    """
    return {
        "op_types": _census(index.op_types),
        "quantize": len(index.q_nodes),
        "dequantize": len(index.dq_nodes),
        "round_trips": _count_round_trips(index),
        "island_count": len(_float_components(index)),
        "float": len(index.float_nodes),
    }


def _diff_summaries(a: _Summary, b: _Summary) -> _Deltas:
    """b minus a for two ``summary`` dicts; op_delta keeps non-zero entries."""
    op_types = sorted(set(a["op_types"]) | set(b["op_types"]))
    op_delta: dict[str, int] = {}
    for op in op_types:
        delta = b["op_types"].get(op, 0) - a["op_types"].get(op, 0)
        if delta:
            op_delta[op] = delta
    return {
        "op_delta": op_delta,
        "quantize_delta": b["quantize"] - a["quantize"],
        "dequantize_delta": b["dequantize"] - a["dequantize"],
        "round_trip_delta": b["round_trips"] - a["round_trips"],
        "island_delta": b["island_count"] - a["island_count"],
        "float_delta": b["float"] - a["float"],
    }


def diff(a: str, b: str) -> DiffAnswer:
    """What changed from model ``a`` to model ``b`` (every delta is b - a)."""
    before = _summary(_index_model(a))
    after = _summary(_index_model(b))
    return {"a": a, "b": b, **_diff_summaries(before, after)}


# --------------------------------------------------------------------------
# The graphscan_ort package: the commands that run models, imported on demand
# through one door (graphscan_ort/extension.py), the only module of it imported here


@contextlib.contextmanager
def _package_needed(needed_by: str) -> Iterator[None]:
    """Around an import of the graphscan_ort package: without the package or
    onnxruntime, exit 2 with one line saying what ``needed_by`` needs."""
    try:
        yield
    except ImportError as exc:
        # Ctrl-C inside onnxruntime's C initialization comes back as "initialization failed".
        if any(isinstance(e, KeyboardInterrupt) for e in (exc.__cause__, exc.__context__)) or INTERRUPTED:
            raise interruption() from None
        missing = getattr(exc, "name", None) or ""
        absent = isinstance(exc, ModuleNotFoundError) and missing.split(".")[0] == _PACKAGE
        if not absent and missing.split(".")[0] != "onnxruntime":
            raise  # an import inside graphscan_ort fails: a bug, not a missing install
        raise GraphscanError(
            f"usage: {needed_by} runs models: it needs the {_PACKAGE} package beside graphscan.py and "
            f"onnxruntime (pip install onnxruntime); {missing} cannot be imported",
            EXIT_USAGE,
        )


# --------------------------------------------------------------------------
# Option groups: each declares its options and builds itself from their values
#
# A command's options are its own (check's --float) or a group's (--inputs, --shape and
# --seed are the Samples group's). A group is a frozen dataclass whose ``taken`` says how a
# command takes it: the options it declares there (their help) and how their values build
# it. The command line and an in-process call (graphscan.check(path, min_sqnr=...), the
# plugin's fixture) go through one door (``_built_keywords``): each value checked by its
# option's own type, then each group built once. A command receives its groups built and
# checks none of them again.

RUNTIME_LEVELS = {"basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
# The bound of --threads: beyond it onnxruntime fails or crashes (100,000 threads
# segfaulted after 52 s), so it is a usage error at once.
MAX_THREADS = 1024

Option = tuple[str, dict]  # a flag and its argparse settings


def non_negative_int(text: str) -> int:
    """argparse type of ``--seed``, ``--top``, ``--max-exclude``: an integer >= 0 (exit 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """argparse type: a finite number (NaN and infinities are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (exit 2 otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text!r}")
        return value

    parse.__name__ = f"integer from {low} to {high}"
    return parse


@dataclasses.dataclass(frozen=True)
class Given:
    """What one command was given for one group's options: each value by keyword (None:
    not given), each checked by its option's type already; where it came from, to name an
    option in a message as the user gave it (``--inputs`` or ``inputs=``); the command."""

    values: Mapping[str, Any]
    flags: Mapping[str, str]  # keyword: flag
    command_line: bool
    command: str

    def __getitem__(self, key: str) -> Any:
        return self.values.get(key)

    def named(self, key: str) -> str:
        """How the user named option ``key``: its flag on the command line, ``key=`` in a call."""
        return self.flags[key] if self.command_line else f"{key}="


@dataclasses.dataclass(frozen=True)
class Takes:
    """A group as one command takes it: the keyword the command receives it as, the options
    it declares there (flags and argparse settings, no defaults: ``build`` fills in what is
    not given), and how their values build it."""

    keyword: str
    options: tuple[Option, ...]
    build: Callable[[Given], Any]


@dataclasses.dataclass(frozen=True)
class Samples:
    """Where a command's samples come from: ``--inputs`` files (or folders of them),
    else seeded data with ``--shape`` for symbolic dimensions and ``--seed``."""

    inputs: list[str] | None = None
    shape: list[str] | None = None
    seed: int = 0

    @classmethod
    def taken(cls, default_size: int, many: bool = False, when: str = "") -> Takes:
        """The group as a command takes it: ``many``: one sample per file, repeatable (else one
        file); ``default_size``: what a symbolic dimension is without --shape; ``when``: the
        option these apply with (``--time: ``), for the help."""
        inputs_help = "one array per graph input, by name" + (" (one sample per file, repeatable)" if many else "")
        options: tuple[Option, ...] = (
            ("--inputs", {"metavar": "FILE.npz", "action": "append", "help": when + inputs_help}),
            (
                "--shape",
                {
                    "metavar": "NAME=D0,D1,...",
                    "action": "append",
                    "help": f"{when}shape of a generated input (repeatable; symbolic dims default to {default_size})",
                },
            ),
            ("--seed", {"type": non_negative_int, "help": f"{when}seed of the generated inputs (default: 0)"}),
        )
        return Takes("samples", options, functools.partial(cls.built, many=many))

    @classmethod
    def built(cls, given: Given, many: bool) -> Samples:
        inputs = given["inputs"]
        if not many and inputs:  # one sample: one file, never a folder
            if len(inputs) > 1:
                raise GraphscanError(
                    f"usage: {given.command} runs one sample: give {given.named('inputs')} once", EXIT_USAGE
                )
            if os.path.isdir(inputs[0]):
                raise GraphscanError(
                    f"{given.named('inputs')} {shown(inputs[0])}: a folder; {given.command} runs one sample: "
                    "give one .npz file",
                    EXIT_INPUTS,
                )
        seed = given["seed"]
        return cls(inputs, given["shape"], 0 if seed is None else seed)


# The built-in metrics (graphscan_ort.shared.agreement) and the axes they read.
_METRIC_NAMES = "sqnr, top1 (argmax of the last axis), iou, ctc (see --layout), cosine"


@dataclasses.dataclass(frozen=True)
class MetricChoice:
    """The metric ``--metric``, ``--threshold``, ``--blank`` and ``--layout`` name (graphscan_ort's
    shared/agreement.py makes it, and refuses what does not fit it)."""

    name: str | None = None
    threshold: float | None = None
    blank: int | None = None
    layout: str | None = None

    @classmethod
    def taken(cls, when: str = "", default: str = "") -> Takes:
        """``when``: the option these apply with, for the help; ``default``: what no --metric means."""
        options: tuple[Option, ...] = (
            (
                "--metric",
                {
                    "metavar": "NAME|FILE.py:FUNCTION",
                    "help": f"{when}agreement with the float model: {_METRIC_NAMES}, or FUNCTION(reference, "
                    f"candidate) of a Python file{default}",
                },
            ),
            (
                "--threshold",
                {
                    "type": finite_float,
                    "metavar": "T",
                    "help": "--metric iou: the probability threshold (default: 0.5)",
                },
            ),
            (
                "--blank",
                {"type": non_negative_int, "metavar": "CLASS", "help": "--metric ctc: the blank class (default: 0)"},
            ),
            (
                "--layout",
                {
                    "choices": ["NTC", "TNC"],
                    "help": "--metric ctc: the output's axes, NTC [batch, time, classes] or TNC [time, batch, "
                    "classes] (default: told by its shape or declared dims)",
                },
            ),
        )
        return Takes(
            "metric", options, lambda given: cls(given["metric"], given["threshold"], given["blank"], given["layout"])
        )


@dataclasses.dataclass(frozen=True)
class Session:
    """The onnxruntime sessions a measurement runs in: ``--level`` (its graph optimization
    level; "disabled" is no deployment) and ``--threads`` (intra-op threads)."""

    level: str = "all"
    threads: int = 1

    @classmethod
    def taken(cls, levels: list[str], default: str, help_text: str, threads_help: str | None = None) -> Takes:
        """``--level`` of ``levels`` (``default`` when not given), and ``--threads`` when
        ``threads_help`` says what it is for (else one thread)."""
        options: tuple[Option, ...] = (("--level", {"choices": levels, "help": help_text}),)
        if threads_help is not None:
            threads = {"type": int_between(1, MAX_THREADS), "help": f"{threads_help}, 1 to {MAX_THREADS} (default: 1)"}
            options += (("--threads", threads),)

        def built(given: Given) -> Session:
            level, threads = given["level"], given["threads"]
            return cls(default if level is None else level, 1 if threads is None else threads)

        return Takes("session", options, built)


NATIVE = "native"  # this machine's CPU, in this process: every measurement without --cpu
CPU_TARGETS = (NATIVE, "x86-avx2", "arm64")  # the contract's names (graphscan_ort/shared/targets.py)
INSTALL_TARGETS = "python -m graphscan_ort.shared.targets install"

ReturnT = typing.TypeVar("ReturnT")


class TargetRunner(typing.Protocol):
    """Calls functions of graphscan on a CPU target (``CpuTarget.runner``), keeping the facts
    of the CPU that answered (name, onnxruntime, machine)."""

    @property
    def facts(self) -> Mapping[str, object] | None:
        """The CPU that answered the last call (None: none yet)."""
        ...

    def call(self, function: Callable[..., ReturnT], *args: Any) -> ReturnT:
        """``function(*args)`` on the target (a module-level function of graphscan whose
        arguments and answer are JSON)."""
        ...

    def close(self) -> None:
        """End what the runner started (an interpreter kept for many calls)."""
        ...

    def __enter__(self) -> TargetRunner: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclasses.dataclass(frozen=True)
class CpuTarget:
    """The CPU a command's measurements run on (``--cpu``): ``native`` is this machine, in this
    process; the others run onnxruntime built for that CPU, emulated (installed by
    graphscan_ort/shared/targets.py, reached through the package's door)."""

    name: str = NATIVE

    @property
    def native(self) -> bool:
        return self.name == NATIVE

    @classmethod
    def taken(cls, help_text: str) -> Takes:
        option = ("--cpu", {"choices": list(CPU_TARGETS), "help": help_text})
        return Takes("cpu", (option,), lambda given: cls(given["cpu"] or NATIVE))

    def require(self) -> None:
        """Exit 2 naming the install command when this target cannot run here."""
        if not self.native:
            with _package_needed(f"--cpu {self.name}"):
                from graphscan_ort.extension import require_target

            require_target(self.name)

    def runner(self, kept: bool = False) -> TargetRunner:
        """What calls functions on this target: in this process natively; else the target's
        interpreter, started for each call, or once for every call when ``kept`` (close it)."""
        with _package_needed(f"--cpu {self.name}"):
            from graphscan_ort.extension import target_runner

        return target_runner(self.name, kept)


# The rule several commands share: options that apply only with another are a usage error
# without it (never silently ignored).


@dataclasses.dataclass(frozen=True)
class OnlyWith:
    """Options that apply only with another: given without it they would be ignored, so they
    are a usage error. ``enabled`` tells, from the command's keywords built from what was
    given, whether ``flag`` is there; ``dependents`` are the options' keywords."""

    flag: str
    enabled: Callable[[Mapping[str, Any]], bool]
    dependents: tuple[str, ...]
    neutral: tuple[tuple[str, object], ...] = ()  # a dependent's value that changes nothing (--cpu native)

    def given(self, values: Mapping[str, Any], flags: Mapping[str, str]) -> dict[str, object]:
        """``{flag: value}`` of the dependents, a neutral value as not given."""
        return {
            flags[key]: None if (key, values.get(key)) in self.neutral else values.get(key) for key in self.dependents
        }


def only_with(flag: str, enabled: bool, given: Mapping[str, object]) -> None:
    """Exit 2 when options of ``given`` (``{flag: value}``) that apply only with
    ``flag`` are set while it is not: the one check of every "only with" rule."""
    named = [name for name, value in given.items() if value is not None]
    if named and not enabled:
        raise GraphscanError(f"usage: {', '.join(named)}: only with {flag}", EXIT_USAGE)


# --------------------------------------------------------------------------
# check: a gate for CI. Each budget is measured and compared with its limit;
# the answer is the same JSON whether the budgets hold (exit 0) or not (exit 8).


class Explaining(typing.Protocol):
    """What the pytest plugin knows when it words a budget's row (``_BudgetRule.detail``)."""

    float_name: str  # the float model's file name, as the config names it

    def int8_nodes(self) -> tuple[int, int]:
        """The nodes that run int8 or int8_data kernels, and those with the float ones."""
        ...

    def metric_words(self, described: Mapping[str, Any]) -> list[str]:
        """The row's metric in words, a user's file named as the config names it."""
        ...


@dataclasses.dataclass(frozen=True)
class _Counted:
    """What the counted budgets are read from: the index of the model and its float islands."""

    index: GraphIndex
    islands: list[tuple[list[int], list[str]]]


def part_words(part: Mapping[str, Any]) -> str:
    """An output's part in words, as every sentence names it: ``y part 1 (from concat)``."""
    return f"{part['output']} part {part['part']} (from {part['node']})"


def _where_part(row: Mapping[str, Any]) -> str:
    part = row.get("worst_part")
    return f", worst {part_words(part)}" if part else ""


def _where_levels(row: Mapping[str, Any]) -> str:
    part = row.get("part") or {}
    return f" at {row['tensor']}, part {part['part']} from {part['node']}" if part else ""


def _int8_detail(row: Mapping[str, Any], explaining: Explaining) -> str:
    integer, total = explaining.int8_nodes()
    return f"{integer} of {total} nodes run int8 or int8_data kernels"


@dataclasses.dataclass(frozen=True)
class _BudgetRule:
    """One budget of check, the one home of everything about it: its option and help, its
    limit's rule, how it is measured (counted here from the graph, else by the package's
    measurer of its name: graphscan_ort/commands/check.py), what else it needs, its table
    note and the plugin's sentence. check, the budget file, the plugin's config keys and its
    sentences, and the table are all derived from the BUDGETS table of these."""

    name: str  # the budget file's and the plugin's key; --max-float is its flag
    measures: str  # what the value counts, in words
    direction: str  # "max": holds when value <= limit; "min": when value >= limit
    value: type[int] | type[float]  # int: a whole number >= 0; float: any finite number (within ``between``)
    metavar: str
    help: str  # check's --help of its option
    key_help: str  # the plugin's config schema: what the key is
    between: tuple[float, float] | None = None  # the limit's closed range, when it has one
    # Counted from the graph here (None: measured by running the model, in the package).
    count: Callable[[_Counted], int] | None = None
    needs: tuple[str, ...] = ()  # check's keywords it cannot be measured without (float_path, metric)
    note: str | None = None  # the table's note of how it was measured (budgets with one note share it)
    # The plugin's words after the value (default: what it measures).
    detail: Callable[[Mapping[str, Any], Explaining], str] | None = None

    @property
    def flag(self) -> str:
        """check's option for it: ``--max-float``."""
        return "--" + self.name.replace("_", "-")

    @property
    def structural(self) -> bool:
        """Whether it is counted from the graph (the same on every CPU)."""
        return self.count is not None

    @property
    def needs_float(self) -> bool:
        """Whether it runs the float model too, on samples (--float, --inputs...)."""
        return "float_path" in self.needs

    @property
    def needs_metric(self) -> bool:
        """Whether it is measured by --metric."""
        return "metric" in self.needs

    def holds(self, value: float, limit: float) -> bool:
        """Whether ``value`` keeps within ``limit`` (an SQNR of inf, equal outputs, holds; nan never)."""
        return value <= limit if self.direction == "max" else value >= limit

    def words(self, row: Mapping[str, Any], explaining: Explaining) -> str:
        """What the plugin says after the value: ``54 of 292 nodes run int8 ...``."""
        return self.measures if self.detail is None else self.detail(row, explaining)


BUDGETS = {
    rule.name: rule
    for rule in (
        _BudgetRule(
            name="max_float",
            measures="float compute nodes",
            direction="max",
            value=int,
            metavar="N",
            help="at most N float compute nodes",
            key_help="at most N float compute nodes",
            count=lambda counted: len(counted.index.float_nodes),
        ),
        _BudgetRule(
            name="max_islands",
            measures="float islands",
            direction="max",
            value=int,
            metavar="N",
            help="at most N float islands",
            key_help="at most N float islands",
            count=lambda counted: len(counted.islands),
        ),
        _BudgetRule(
            name="max_crossings",
            measures="boundary crossings",
            direction="max",
            value=int,
            metavar="N",
            help="at most N boundary crossings",
            key_help="at most N boundary crossings",
            count=lambda counted: _boundary_report(counted.index, counted.islands)["crossings"],
        ),
        _BudgetRule(
            name="min_int8",
            measures="fraction of the compute nodes that run an int8 or int8_data kernel (runtime)",
            direction="min",
            value=float,
            metavar="FRACTION",
            help="at least this fraction of kernels run int8 (runtime)",
            key_help="at least this fraction of kernels int8",
            between=(0, 1),
            note="what runs at level extended (runtime's default: its classes map back to the model)",
            detail=_int8_detail,
        ),
        _BudgetRule(
            name="min_sqnr",
            measures="output SQNR in dB against --float: the worst part's (impact's definition)",
            direction="min",
            value=float,
            metavar="DB",
            help="output SQNR against --float of at least DB",
            key_help="output SQNR against float of at least DB",
            needs=("float_path",),
            note="both models in sessions at --level (default all)",
            detail=lambda row, explaining: f"dB, against {explaining.float_name}{_where_part(row)}",
        ),
        _BudgetRule(
            name="min_levels",
            measures="steps of its scale the worst part of every quantized tensor spans (trace's levels)",
            direction="min",
            value=float,
            metavar="N",
            help="every quantized tensor's worst part spans at least N steps of its scale (needs --float)",
            key_help="every quantized tensor's worst part spans at least N steps of its scale",
            needs=("float_path",),
            note="the float model's values at each quantized tensor, by part",
            detail=lambda row, explaining: f"steps of the scale{_where_levels(row)}",
        ),
        _BudgetRule(
            name="min_metric",
            measures="the --metric agreement with --float (a built-in metric or FILE.py:FUNCTION)",
            direction="min",
            value=float,
            metavar="X",
            help="the --metric agreement with --float of at least X",
            key_help="the metric's agreement with float of at least X",
            needs=("float_path", "metric"),
            note="both models in sessions at --level (default all)",
            detail=lambda row, explaining: (
                f"{', '.join(explaining.metric_words(row.get('metric', {})))} against {explaining.float_name}"
            ),
        ),
    )
}
# Budgets that run the model (graphscan_ort's measurers); those that run the float model too.
_RUNNING_BUDGETS = tuple(rule.name for rule in BUDGETS.values() if not rule.structural)
FLOAT_BUDGETS = tuple(rule.name for rule in BUDGETS.values() if rule.needs_float)
_METRIC_BUDGETS = tuple(rule.name for rule in BUDGETS.values() if rule.needs_metric)
# What a budget's needs are named by: check's flag and what it takes, the plugin's key and what it is.
NEEDS = {
    "float_path": ("--float F.onnx", "float = the float model"),
    "metric": ("--metric NAME|FILE.py:FUNCTION", "metric = NAME or FILE.py:FUNCTION"),
}


def unmet_need(names: Iterable[str], given: Collection[str]) -> tuple[str, str] | None:
    """The first budget of ``names`` and what it needs that ``given`` (keywords) lacks."""
    for name in names:
        for need in BUDGETS[name].needs:
            if need not in given:
                return name, need
    return None


def either_of(names: Iterable[str]) -> str:
    """Budgets' flags as one phrase: ``--min-sqnr, --min-levels or --min-metric``."""
    flags = [BUDGETS[name].flag for name in names]
    return f"{', '.join(flags[:-1])} or {flags[-1]}" if len(flags) > 1 else "".join(flags)


def _read_budget_file(path: str) -> dict[str, float]:
    """``{budget: limit}`` from a JSON file; an unknown key or a non-number is a usage error."""
    check_readable(path)
    try:
        with open(path, encoding="utf-8") as f:
            limits = json.load(f, object_pairs_hook=_unique_keys)
    except OSError as exc:
        raise GraphscanError(f"{shown(path)}: cannot read ({exc.strerror or exc})", EXIT_NO_FILE)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to be a budget file
        raise GraphscanError(f"usage: {shown(path)}: not a JSON budget file ({one_line(exc)})", EXIT_USAGE)
    if not isinstance(limits, dict):
        raise GraphscanError(f"usage: {shown(path)}: expected a JSON object of budgets", EXIT_USAGE)
    unknown = sorted(set(limits) - set(BUDGETS))
    if unknown:
        raise GraphscanError(
            f"usage: {shown(path)}: unknown budget {', '.join(unknown)} (known: {', '.join(BUDGETS)})", EXIT_USAGE
        )
    return {name: budget_limit(name, value, path) for name, value in limits.items()}


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object hook: a key given twice is an error, never the last value silently."""
    counts = Counter(key for key, _ in pairs)
    repeated = sorted(key for key, count in counts.items() if count > 1)
    if repeated:
        raise ValueError(f"key {', '.join(map(repr, repeated))} given twice")
    return dict(pairs)


def budget_limit(name: str, value: object, where: str) -> float:
    """A budget's limit as a number, checked (exit 2 when it is not one)."""
    try:
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite or not isinstance(value, (int, float)):
        huge = isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64
        text = "an integer too large for a budget" if huge else repr(value)
        raise GraphscanError(f"usage: {where}: budget {name} must be a finite number, not {text}", EXIT_USAGE)
    rule = BUDGETS[name]
    if rule.value is int and (value < 0 or value != int(value)):
        raise GraphscanError(f"usage: {where}: budget {name} must be a whole number >= 0", EXIT_USAGE)
    if rule.between is not None and not rule.between[0] <= value <= rule.between[1]:
        low, high = rule.between
        raise GraphscanError(f"usage: {where}: budget {name} is a fraction between {low:g} and {high:g}", EXIT_USAGE)
    return rule.value(value)


@dataclasses.dataclass(frozen=True)
class Budgets:
    """check's budgets: each limit given, by budget in the table's order (options override
    the ``--budget`` file)."""

    limits: Mapping[str, float]

    @classmethod
    def taken(cls) -> Takes:
        options: tuple[Option, ...] = (
            ("--budget", {"metavar": "FILE.json", "help": "budgets as a JSON object (options override it)"}),
            *(
                (rule.flag, {"type": rule.value, "metavar": rule.metavar, "help": rule.help})
                for rule in BUDGETS.values()
            ),
        )
        return Takes("budgets", options, cls.built)

    @classmethod
    def built(cls, given: Given) -> Budgets:
        limits = _read_budget_file(given["budget"]) if given["budget"] is not None else {}
        for name, rule in BUDGETS.items():
            if given[name] is not None:
                limits[name] = budget_limit(name, given[name], rule.flag)
        if not limits:
            flags = " / ".join(rule.flag for rule in BUDGETS.values())
            raise GraphscanError(f"usage: check needs at least one budget (--budget FILE or {flags})", EXIT_USAGE)
        return cls({name: limits[name] for name in BUDGETS if name in limits})

    def any_of(self, names: Iterable[str]) -> bool:
        """Whether any budget of ``names`` is given."""
        return any(name in self.limits for name in names)


@dataclasses.dataclass(frozen=True)
class BudgetJob:
    """What the budgets that run the model are measured on (graphscan_ort's measurers):
    the model (``model``: read with its weights already, or None), the float model, the
    samples, the metric, the sessions and the CPU target."""

    path: str
    model: onnx.ModelProto | None
    float_path: str | None
    samples: Samples
    metric: MetricChoice
    session: Session
    cpu: CpuTarget


@dataclasses.dataclass(frozen=True)
class Measured:
    """A budget's measured value and what its row says beside it (min_sqnr's worst part)."""

    value: float
    described: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _measured_budgets(job: BudgetJob, names: list[str]) -> tuple[dict[str, Measured], dict[str, Any] | None]:
    """Each budget of ``names``, measured (the model is read once), and the facts of the CPU
    target those that run the model ran on (None: native)."""
    found: dict[str, Measured] = {}
    facts = None
    running = [name for name in names if not BUDGETS[name].structural]
    if len(running) < len(names):
        # Read with its weights when a budget runs it: one read serves both.
        model = load_with_weights(job.path) if running else load_model(job.path)
        index = GraphIndex(model.graph)
        counted = _Counted(index, _float_islands(index))
        for name in names:
            count = BUDGETS[name].count
            if count is not None:
                found[name] = Measured(count(counted))
        job = dataclasses.replace(job, model=model)
    if running:
        with _package_needed(f"check {' and '.join(BUDGETS[name].flag for name in running)}"):
            from graphscan_ort.extension import measure_budgets

        measured, facts = measure_budgets(job, running)
        found.update(measured)
    return found, facts


def _check(
    path: str,
    float_path: str | None,
    budgets: Budgets,
    metric: MetricChoice,
    session: Session,
    samples: Samples,
    cpu: CpuTarget,
) -> CheckAnswer:
    """Measure each budget given and say which hold (the rules of CHECK's options applied)."""
    given = {key for key, value in (("float_path", float_path), ("metric", metric.name)) if value is not None}
    need = unmet_need(budgets.limits, given)
    if need is not None:
        name, what = need
        raise GraphscanError(f"usage: {BUDGETS[name].flag} needs {NEEDS[what][0]}", EXIT_USAGE)
    check_readable(path)
    names = list(budgets.limits)
    job = BudgetJob(path, None, float_path, samples, metric, session, cpu)
    measured, facts = _measured_budgets(job, names)
    rows: list[_Budget] = []
    for name in names:
        value, limit = measured[name].value, budgets.limits[name]
        row: _Budget = {
            "name": name,
            "value": value if math.isfinite(value) else None,  # strict JSON
            "limit": limit,
            "ok": BUDGETS[name].holds(value, limit),
        }
        row.update(measured[name].described)  # type: ignore[typeddict-item]
        rows.append(row)
    ok = all(row["ok"] for row in rows)
    if facts is None:  # native: the answer's bytes as before --cpu
        return {"model": path, "float": float_path, "budgets": rows, "ok": ok}
    return {"model": path, "float": float_path, "cpu": facts, "budgets": rows, "ok": ok}


# --------------------------------------------------------------------------
# Tables: --format table, aligned plain text for people
#
# The JSON answer is the contract. A table is rendered from it after the
# command returns, so it can never change what a program reads; renderers
# are ``(answer, top) -> str`` and every line fits TABLE_WIDTH columns.

TABLE_WIDTH = 80
_CUT = "..."
_MIN_COLUMN = 10  # a column is never cut narrower than this: words (Percentile, Sigmoid) stay whole


# What a terminal must never be sent raw: C0 and C1 controls and DEL (ESC can
# clear a screen, CR overwrite a row, BEL ring), line and paragraph separators,
# and the bidi controls that reorder what is shown.
_INVISIBLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(text: str) -> str:
    """``text`` with every _INVISIBLE character written as an escape (``\\n``, ``\\x1b``, ``\\u202e``)."""

    def escape(match: re.Match) -> str:
        char = match.group()
        return "\\n" if char == "\n" else f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"

    return _INVISIBLE.sub(escape, text)


def _char_width(char: str) -> int:
    """Columns a character takes in a terminal: 2 for wide East Asian ones, 0 for combining marks."""
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def _display_width(text: str) -> int:
    """Columns ``text`` takes in a terminal (``len`` for ASCII)."""
    return len(text) if text.isascii() else sum(map(_char_width, text))


def _fitted(text: str, width: int) -> str:
    """The longest start of ``text`` that fits ``width`` columns."""
    used = 0
    for k, char in enumerate(text):
        used += _char_width(char)
        if used > width:
            return text[:k]
    return text


def _middle_cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` columns, its middle replaced by ``...``.

    Both ends stay: a layer's prefix and its op suffix are what tell names apart.
    """
    if _display_width(text) <= width:
        return text
    if width <= len(_CUT):
        return _fitted(text, width)
    keep = width - len(_CUT)
    head = _fitted(text, (keep + 1) // 2)
    tail = _fitted(text[::-1], keep - _display_width(head))[::-1]
    return head + _CUT + tail


def _end_cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` columns: ``...`` and its end.

    Exporters put what tells names apart at the end (``/model.22/cv3.0/conv/Conv`` and
    ``/model.22/cv2.1/conv/Conv`` differ in their last part, ``p2o.Conv.41`` in its number);
    a file's name and a metric's function are at the end of their paths too.
    """
    if _display_width(text) <= width:
        return text
    keep = max(0, width - len(_CUT))
    mark = _CUT if width > len(_CUT) else ""
    if text.isascii():  # one column per character
        return mark + text[len(text) - (keep if mark else width) :]
    return mark + _fitted(text[::-1], keep if mark else width)[::-1]


def _distinct_width(texts: Collection[str], width: int) -> int:
    """The least width from ``width`` up at which _end_cut keeps ``texts`` apart: a table never
    shows two different names as one (the whole text always tells them apart). A longer end
    tells apart what a shorter one does, so the width is found by bisection."""
    distinct = set(texts)
    long = {text for text in distinct if _display_width(text) > width}
    if not long:
        return width

    def apart(w: int) -> bool:
        return len({_end_cut(text, w) for text in distinct}) == len(distinct)

    low, high = width, max(map(_display_width, long))  # apart(high): nothing is cut
    while low < high:
        middle = (low + high) // 2
        if apart(middle):
            high = middle
        else:
            low = middle + 1
    return high


def _padded(text: str, width: int, right: bool) -> str:
    """``text`` padded with spaces to ``width`` columns, on the left when ``right``."""
    pad = " " * max(0, width - _display_width(text))
    return pad + text if right else text + pad


def _cell(value: object) -> str:
    """A value as table text: floats in 3 significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return visible(str(value))  # one row per line and no terminal control, whatever a name holds


def _is_number(value: object) -> bool:
    """An int or float, not a bool: what a table aligns to the right."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _format_table(
    titles: Sequence[str], rows: Sequence[Sequence[object]], width: int = TABLE_WIDTH, cut_first: Sequence[str] = ()
) -> str:
    """Aligned columns, numbers to the right. Until each line fits ``width``, the
    columns titled in ``cut_first`` and then the widest ones are cut, keeping the end of
    each text (never below _MIN_COLUMN); a column cut so far that two of its different
    texts would look the same widens again until they do not."""
    texts = [[_cell(v) for v in row] for row in rows]
    right = [
        any(_is_number(row[k]) for row in rows) and all(_is_number(row[k]) or row[k] is None for row in rows)
        for k in range(len(titles))
    ]
    widths = [max([_display_width(t)] + [_display_width(row[k]) for row in texts]) for k, t in enumerate(titles)]
    first = [k for k, t in enumerate(titles) if t in cut_first]

    def weight(
        k: int,
    ) -> float:  # cut_first columns go first; the first column (names) may keep twice any other's width
        if widths[k] <= _MIN_COLUMN:
            return 0
        return widths[k] * (1000 if k in first else 1) / (2 if k == 0 else 1)

    while sum(widths) + 2 * (len(widths) - 1) > width and max(widths) > _MIN_COLUMN:
        widths[max(range(len(widths)), key=weight)] -= 1
    widths = [_distinct_width([row[k] for row in texts], w) for k, w in enumerate(widths)]
    lines = []
    for row in [list(titles)] + texts:
        parts = []
        for k, text in enumerate(row):
            parts.append(_padded(_end_cut(text, widths[k]), widths[k], right[k]))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def format_fields(pairs: Iterable[tuple[str, object]], width: int = TABLE_WIDTH) -> str:
    """``key value`` pairs on as few lines as fit ``width``; long values keep their end."""
    lines, line = [], ""
    for key, value in pairs:
        key = _end_cut(_cell(key), width // 2)  # an input's name can be long too
        text = f"{key} {_end_cut(_cell(value), width - _display_width(key) - 1)}"
        if line and _display_width(line) + 3 + _display_width(text) > width:
            lines.append(line)
            line = ""
        line = f"{line}   {text}" if line else text
    return "\n".join(lines + [line])


def format_names(names: Iterable[str], width: int = TABLE_WIDTH, indent: str = "  ") -> str:
    """Names separated by commas, wrapped to ``width``, each cut to fit one line."""
    lines, line = [], ""
    for name in names:
        name = _end_cut(_cell(name), width - len(indent) - 1)
        # 3: ', ' now, ',' if wrapped
        if line and len(indent) + _display_width(line) + _display_width(name) + 3 > width:
            lines.append(indent + line + ",")
            line = ""
        line = f"{line}, {name}" if line else name
    return "\n".join(lines + [indent + line])


def _limited(rows: Sequence[Sequence[Any]], top: int | None) -> tuple[Sequence[Sequence[Any]], str]:
    """The first ``top`` rows (all without ``--top``) and a note on what was left out."""
    if top is None or top >= len(rows):
        return rows, ""
    return rows[:top], f"({len(rows) - top} more not shown; --top {top})"


def section(
    title: str,
    titles: Sequence[str],
    rows: Sequence[Sequence[object]],
    top: int | None = None,
    cut_first: Sequence[str] = (),
) -> str:
    """A titled table of ``rows`` (``(none)`` when empty), cut to ``top`` rows with a note."""
    shown, note = _limited(rows, top)
    parts = [title, _format_table(titles, shown, cut_first=cut_first) if shown else "  (none)"]
    return "\n".join(parts + ([note] if note else []))


def page(*blocks: str) -> str:
    """Blocks of text separated by blank lines; empty blocks left out."""
    return "\n\n".join(b for b in blocks if b)


def _by_count(counts: Mapping[str, int]) -> list[tuple[str, int]]:
    """``{key: count}`` items, largest count first, ties by key."""
    return sorted(counts.items(), key=lambda item: (-abs(item[1]), item[0]))


def _graph_positions(path: str) -> dict[str, int]:
    """``{node name: position in graph.node}``, to show names in graph order; empty when
    the model is no longer readable (a saved answer's table keeps the JSON's order)."""
    if not isinstance(path, str):  # open() would take an int as a file descriptor
        raise TypeError(f"model is {type(path).__name__}, not a path")
    try:
        return {name: i for i, name in enumerate(_index_model(path).names)}
    except GraphscanError:
        return {}


def _islands_by_size(members: list[list[str]], positions: dict[str, int]) -> list[int]:
    """JSON positions of islands, largest first, ties by their first node in graph order."""

    def first(k: int) -> int:
        return min(positions.get(name, -1) for name in members[k])

    return sorted(range(len(members)), key=lambda k: (-len(members[k]), first(k)))


def _op_summary(op_types: Iterable[str]) -> str:
    """``"Add 2, Relu"``: op types by count, largest first."""
    return ", ".join(f"{op} {n}" if n > 1 else op for op, n in _by_count(Counter(op_types)))


def _nodes_table(answer: dict[str, Any], top: int | None) -> str:
    """Op types and initializer dtypes, largest count first."""
    return page(
        format_fields([("model", answer["model"]), ("nodes", answer["nodes"]), ("op types", len(answer["op_types"]))]),
        section("op_type census", ["op_type", "count"], _by_count(answer["op_types"]), top),
        section("initializers", ["dtype", "count"], _by_count(answer["initializers"])),
    )


def _qdq_table(answer: dict[str, Any], top: int | None) -> str:
    """The four Q/DQ counts."""
    counts = [(key, answer[key]) for key in ("quantize", "dequantize", "round_trips", "weight_dequantize")]
    return page(format_fields([("model", answer["model"])]), _format_table(["Q/DQ", "count"], counts))


def _island_rows(
    members: list[list[str]], positions: dict[str, int], extra: Callable[[int], Sequence[object]]
) -> list[list[object]]:
    """One row per island, largest first: #, size, extra columns, first and last node in graph order."""
    rows = []
    for k in _islands_by_size(members, positions):
        ordered = sorted(members[k], key=lambda name: positions.get(name, -1))
        rows.append([k + 1, len(ordered), *extra(k), ordered[0], ordered[-1]])
    return rows


def _islands_table(answer: dict[str, Any], top: int | None) -> str:
    """Islands largest first, then each shown island's members in graph order."""
    positions = _graph_positions(answer["model"])
    islands_list = answer["islands"]
    members = [island["nodes"] for island in islands_list]
    rows = _island_rows(members, positions, lambda k: [_op_summary(islands_list[k]["op_types"])])
    shown, _ = _limited(rows, top)
    listing = [
        f"island {row[0]} in graph order:\n"
        + format_names(sorted(members[row[0] - 1], key=lambda name: positions.get(name, -1)))
        for row in shown
    ]
    return page(
        format_fields(
            [("model", answer["model"])]
            + [(key, answer[key]) for key in ("compute", "wrapped", "float", "island_count")]
        ),
        section(
            "float islands, largest first (# = position in the JSON list + 1)",
            ["#", "size", "op_types", "first", "last"],
            rows,
            top,
            cut_first=["op_types"],
        ),
        *listing,
    )


def _boundary_table(answer: dict[str, Any], top: int | None) -> str:
    """DQs in and Qs out per island, largest island first."""
    positions = _graph_positions(answer["model"])
    per_island = answer["per_island"]
    members = [island["nodes"] for island in per_island]
    rows = _island_rows(members, positions, lambda k: [per_island[k]["in_dequantize"], per_island[k]["out_quantize"]])
    return page(
        format_fields(
            [("model", answer["model"]), ("island_count", answer["island_count"]), ("crossings", answer["crossings"])]
        ),
        section("crossings per island, largest first", ["#", "size", "DQ in", "Q out", "first", "last"], rows, top),
    )


def _diff_table(answer: dict[str, Any], top: int | None) -> str:
    """The count deltas, then op types by the size of their change."""
    deltas = [(key, answer[key]) for key in answer if key.endswith("_delta") and key != "op_delta"]
    return page(
        format_fields([("a", answer["a"]), ("b", answer["b"])]),
        _format_table(["b - a", "delta"], deltas),
        section("op_delta, largest change first", ["op_type", "delta"], _by_count(answer["op_delta"]), top),
    )


def _generic_table(answer: dict[str, Any], top: int | None) -> str:
    """Any answer: scalars as header fields, then each list or mapping as a table."""
    blocks = [format_fields([(k, v) for k, v in answer.items() if not isinstance(v, (list, dict))])]
    for key, value in answer.items():
        if isinstance(value, dict):
            blocks.append(section(key, ["key", "value"], list(value.items()), top))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            titles = list(value[0])
            blocks.append(section(key, titles, [[v.get(t) for t in titles] for v in value], top))
        elif isinstance(value, list):
            blocks.append(f"{key}:\n" + format_names(value))
    return page(*blocks)


def _check_table(answer: dict[str, Any], top: int | None) -> str:
    """The budgets, min_metric's naming its metric and parameters, and how the measured ones ran."""
    cpu = [("cpu", answer["cpu"]["name"])] if "cpu" in answer else []
    head = format_fields([("model", answer["model"]), ("float", answer["float"]), *cpu, ("ok", answer["ok"])])
    rows = [[_budget_title(b), b["value"], b["limit"], b["ok"]] for b in answer["budgets"]]
    return page(head, section("budgets", ["name", "value", "limit", "ok"], rows, top), *_budget_notes(answer))


def _budget_notes(answer: dict[str, Any]) -> list[str]:
    """How the answer's measured budgets ran, one line per note, naming every budget
    (of the table's, in its order) that shares it: ``min_sqnr, min_metric: both models ...``."""
    given = {b["name"] for b in answer["budgets"]}
    sharing: dict[str, list[str]] = {}
    for rule in BUDGETS.values():
        if rule.note is not None:
            sharing.setdefault(rule.note, []).append(rule.name)
    lines = [f"{', '.join(names)}: {note}" for note, names in sharing.items() if given & set(names)]
    return ["\n".join(lines)] if lines else []


def _budget_title(budget: dict[str, Any]) -> str:
    """``min_metric (iou, threshold 0.3)`` for min_metric; any other budget's name."""
    described = budget.get("metric")
    if not described:
        return budget["name"]
    return f"{budget['name']} ({', '.join(metric_words(described))})"


def metric_words(described: Mapping[str, Any]) -> list[str]:
    """A metric as an answer describes it (``{"name": "iou", "threshold": 0.3}``), in words:
    ``["iou", "threshold 0.3"]``, for the tables and the pytest plugin's sentences."""
    return [described.get("name", "?"), *(f"{key} {value}" for key, value in described.items() if key != "name")]


# --------------------------------------------------------------------------
# dot: the island map as a Graphviz picture (for people; the JSON is the contract)
#
# Compute nodes only: every Q/DQ chain between two of them is folded into the
# edge's label (Q→DQ is a round trip), chains that start at an initializer
# (weights) are hidden, and each float island is a cluster.

_COLOURS = {  # node kind: (fill colour, its name in the picture's legend)
    "int8": ("#1b9e77", "dark green"),
    "int8_data": ("#a6dba0", "light green"),
    "wrapped": ("#a6dba0", "green"),
    "float": ("#f4a582", "orange"),
    "absorbed": ("#d9d9d9", "grey"),
    "unknown": ("#ffffff", "white"),
}
_DOT_NAME_WIDTH = 32  # node labels cut in the middle beyond this
_COLLAPSE_HINT = 500  # compute nodes above which --collapse is worth it


def _dot_quote(text: str) -> str:
    """A DOT string literal in ASCII: backslashes and quotes escaped, newlines as \\n,
    ``&`` and every non-ASCII character as an HTML entity (Graphviz decodes them), so
    the DOT prints on any terminal."""
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("&", "&amp;")
    return '"' + text.encode("ascii", "xmlcharrefreplace").decode("ascii") + '"'


def _dot_attributes(**attributes: object) -> str:
    """``[key="value", ...]`` with every value quoted."""
    return "[" + ", ".join(f"{key}={_dot_quote(str(value))}" for key, value in attributes.items()) + "]"


def _folded_edges(index: GraphIndex) -> list[tuple[str, str, str]]:
    """``[(source id, target id, label)]`` between compute nodes (``n<i>``), graph
    inputs (``in<k>``) and outputs (``out<k>``), each Q/DQ chain folded into the
    label; chains from initializers are dropped. Distinct, in graph order."""
    graph = index.graph
    input_ids = {info.name: f"in{k}" for k, info in enumerate(value_inputs(graph))}
    edges: dict[tuple[str, str, str], None] = {}

    def link(tensor: str, target: str) -> None:
        source, chain = data_source(index, graph, tensor)
        producer = index.producer_of(source)
        if producer is not None and index.is_compute(producer):
            source_id = f"n{producer}"
        elif source in input_ids:
            source_id = input_ids[source]
        else:
            return  # a weight, or a chain that starts nowhere
        label = "→".join("Q" if index.is_q[j] else "DQ" for j in chain)
        edges.setdefault((source_id, target, label), None)

    for i in index.compute_nodes:
        for tensor in index.inputs[i]:
            link(tensor, f"n{i}")
    for k, output in enumerate(graph.output):
        link(output.name, f"out{k}")
    return list(edges)


def _wrapped_runs(index: GraphIndex, edges: list[tuple[str, str, str]], kinds: dict[int, str]) -> list[list[int]]:
    """Groups of wrapped compute nodes of one kind joined by edges between them
    (a float node always ends a group), in graph order; only groups of two or more."""
    group = {i: i for i in index.compute_nodes if index.wrapped[i]}

    def root(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    for source, target, _ in edges:
        if source.startswith("n") and target.startswith("n"):
            p, i = int(source[1:]), int(target[1:])
            if p in group and i in group and kinds[p] == kinds[i]:
                group[root(i)] = root(p)
    members: dict[int, list[int]] = {}
    for i in group:
        members.setdefault(root(i), []).append(i)
    return [group for group in members.values() if len(group) > 1]


def _runtime_classes(model: onnx.ModelProto, path: str) -> list[str | None]:
    """What onnxruntime runs for each compute node of ``model`` (the runtime
    command's class), in graph order.

    By position, not by name: runtime names unnamed and duplicate nodes its
    own way (``MatMul_8~8``), and a graph's position is the one identity both share.
    """
    with _package_needed("dot --runtime"):
        from graphscan_ort.extension import runtime_classifier

        classify = runtime_classifier()
    found = classify(model, path)
    return [node["class"] for node in found.rows]


def _unlinked_groups(index: GraphIndex, edges: list[tuple[str, str, str]], kinds: dict[int, str]) -> list[list[int]]:
    """Wrapped compute nodes no edge of the picture touches (Constants that only
    set a Q's scale or zero point), grouped by kind in graph order; groups of two or more."""
    linked = {ident for source, target, _ in edges for ident in (source, target)}
    groups: dict[str, list[int]] = {}
    for i in index.compute_nodes:
        if index.wrapped[i] and f"n{i}" not in linked:
            groups.setdefault(kinds[i], []).append(i)
    return [members for members in groups.values() if len(members) > 1]


def _node_kinds(index: GraphIndex, path: str, model: onnx.ModelProto | None = None) -> dict[int, str]:
    """``{compute node: kind}``: wrapped/float, or with ``model`` (the model with
    its weights) the runtime command's class."""
    if model is None:
        return {i: "wrapped" if index.wrapped[i] else "float" for i in index.compute_nodes}
    classes = _runtime_classes(model, path)
    if len(classes) != len(index.compute_nodes):
        raise GraphscanError(f"{shown(path)}: the runtime answer does not list every compute node", EXIT_INTERNAL)
    kinds = dict(zip(index.compute_nodes, classes))
    return {i: kind if kind in _COLOURS else "unknown" for i, kind in kinds.items()}


def _dot_header(path: str, index: GraphIndex, kinds: dict[int, str], island_count: int) -> list[str]:
    """The picture's title (with its colour legend) and default styles."""
    counts = Counter(kinds.values())
    legend = ", ".join(f"{counts[kind]} {kind} ({_COLOURS[kind][1]})" for kind in _COLOURS if counts[kind])
    title = (
        f"{visible(path)}: {len(index.compute_nodes)} compute nodes ({legend}), {island_count} float islands;"
        " edge labels: the Q/DQ between two nodes (Q→DQ = a round trip)"
    )
    # pack: disconnected parts (lone Constants, islands of one) are laid out in a grid, not one wide row.
    graph = _dot_attributes(label=title, labelloc="t", fontname="Helvetica", pack="true", packmode="array_u8")
    return [
        f"  graph {graph};",
        "  node " + _dot_attributes(shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10") + ";",
        "  edge " + _dot_attributes(fontname="Helvetica", fontsize="8") + ";",
    ]


def dot(path: str, runtime_colours: bool = False, collapse: bool = False) -> str:
    """The island map of ``path`` as Graphviz DOT text."""
    # Coloured by what runs, the model is read once, with its weights, for both.
    model = load_with_weights(path) if runtime_colours else load_model(path)
    index = GraphIndex(model.graph)
    names = [visible(name) for name in index.names]  # no terminal control or NUL in the DOT
    kinds = _node_kinds(index, path, model if runtime_colours else None)
    islands = _float_islands(index)
    edges = _folded_edges(index)
    boxes = _unlinked_groups(index, edges, kinds) + (_wrapped_runs(index, edges, kinds) if collapse else [])
    box_of = {i: k for k, members in enumerate(boxes) for i in members}

    def node_line(i: int) -> str:
        label = _middle_cut(names[i], _DOT_NAME_WIDTH) + "\n" + index.op_types[i]
        return f"n{i} {_dot_attributes(label=label, tooltip=names[i], fillcolor=_COLOURS[kinds[i]][0])};"

    lines = ["digraph graphscan {"] + _dot_header(path, index, kinds, len(islands))
    for k, info in enumerate(value_inputs(index.graph)):
        lines.append(f"  in{k} {_dot_attributes(label=visible(as_text(info.name)), shape='ellipse', style='')};")
    for k, output in enumerate(index.graph.output):
        lines.append(f"  out{k} {_dot_attributes(label=visible(as_text(output.name)), shape='ellipse', style='')};")
    for number, (members, _) in enumerate(islands, 1):
        in_dq, out_q = _boundary_of(index, members)
        label = (
            f"island {number}: {len(members)} nodes, {len(in_dq) + len(out_q)} crossings "
            f"({len(in_dq)} DQ in, {len(out_q)} Q out)"
        )
        lines.append(f"  subgraph cluster_island_{number} {{")
        lines.append("    graph " + _dot_attributes(label=label, style="dashed", color="#b2182b") + ";")
        lines += ["    " + node_line(i) for i in sorted(members)]
        lines.append("  }")
    lines += ["  " + node_line(i) for i in index.compute_nodes if index.wrapped[i] and i not in box_of]
    for k, members in enumerate(boxes):
        first, last = (_middle_cut(names[members[j]], _DOT_NAME_WIDTH) for j in (0, -1))
        ops = _middle_cut(_op_summary(index.op_types[i] for i in members), 2 * _DOT_NAME_WIDTH)
        label = f"{len(members)} {kinds[members[0]]} nodes: {ops}\n{first}\n…\n{last}"
        tooltip = "\n".join(names[i] for i in members)  # every member, for the reader (and the tests)
        colour = _COLOURS[kinds[members[0]]][0]
        lines.append(f"  box{k} {_dot_attributes(label=label, tooltip=tooltip, fillcolor=colour, penwidth='2')};")

    def drawn_as(ident: str) -> str:
        i = int(ident[1:]) if ident.startswith("n") else None
        return f"box{box_of[i]}" if i in box_of else ident

    drawn = set()
    for source, target, label in edges:
        key = (drawn_as(source), drawn_as(target), label)
        if key[0] != key[1] and key not in drawn:
            drawn.add(key)
            lines.append(f"  {key[0]} -> {key[1]}" + (f" {_dot_attributes(label=label)};" if label else ";"))
    lines.append("}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Declaring a command: its argument groups, the Command type, the core's commands
#
# A command is declared where it is implemented: the counting commands, check
# and dot below, the commands that run models in their modules of the
# graphscan_ort package.

_FORMATS = ["json", "table"]


@dataclasses.dataclass(frozen=True)
class _Output:
    """The output group (``--format``, ``--top``) of every command that answers JSON: the
    JSON, or a table for people with only the ``top`` largest rows of each long list."""

    format: str = "json"
    top: int | None = None

    @staticmethod
    def add_to(parser: argparse.ArgumentParser, own_top: bool) -> None:
        """Declare the group on ``parser`` (a command's own --top, which also limits its JSON, stays its own)."""
        output = parser.add_argument_group("output (tables are for people; the JSON is the contract)")
        output.add_argument("--format", choices=_FORMATS, default="json", help="json (default) or table")
        if not own_top:
            output.add_argument(
                "--top", type=non_negative_int, metavar="N", help="table: only the N largest rows of each long list"
            )

    @classmethod
    def parsed(cls, args: argparse.Namespace, own_top: bool) -> _Output:
        """The group as the command line gave it; --top of a JSON answer is a usage error."""
        chosen, top = getattr(args, "format", "json"), getattr(args, "top", None)
        if chosen == "json" and top is not None and not own_top:
            raise GraphscanError("usage: --top only limits tables; add --format table", EXIT_USAGE)
        return cls(chosen, top)


@dataclasses.dataclass(frozen=True)
class Command:
    """One command as the command line knows it.

    ``run`` is called with the ``paths`` (positional arguments) and one keyword per option
    of its own and per group it takes (``options``: each an option or a group's ``Takes``,
    in the order --help lists them), built from the command line or an in-process call's
    keywords alike (``_built_keywords``), each option left out given its declared default;
    ``only_with``: the rules of options that apply only with another; ``table`` renders
    the answer for people (None: the generic table); ``text``: the answer is text, not JSON
    (dot); ``exit_code``: the exit code an answer gives (check's 8); ``many``: the last path
    is one or more (report's ANSWER.json...), each a positional argument of ``run``.
    """

    name: str
    run: Callable[..., Any]  # its answer: a TypedDict of docs/SPEC.md (dot: text)
    paths: tuple[str, ...] = ("model",)
    options: tuple[Option | Takes, ...] = ()
    only_with: tuple[OnlyWith, ...] = ()
    table: Callable[[dict, int | None], str] | None = None
    text: bool = False
    exit_code: Callable[[dict], int] | None = None
    answer: Any = None  # the TypedDict of its answer: which command a saved answer is from
    path_help: str = "path to an .onnx file"
    epilog: str = ""  # --help's text after the options, its line breaks kept (tune's stages)
    many: bool = False

    def render(self, answer: dict, top: int | None = None) -> str:
        """The answer as text for a terminal: the command's own table, else the generic one."""
        return (self.table or _generic_table)(answer, top)

    @property
    def own_top(self) -> bool:
        """Whether the command has a --top of its own (which also limits its JSON)."""
        return any(flag == "--top" for flag, _ in self.own_options)

    @property
    def own_options(self) -> list[Option]:
        """The options that are the command's own, not a group's."""
        return [entry for entry in self.options if not isinstance(entry, Takes)]

    @property
    def groups(self) -> list[Takes]:
        """The option groups the command takes."""
        return [entry for entry in self.options if isinstance(entry, Takes)]

    def flat_options(self) -> list[Option]:
        """Every option, its own and its groups', in the order --help lists them."""
        return [option for entry in self.options for option in (entry.options if isinstance(entry, Takes) else [entry])]


_NODES = Command("nodes", nodes, table=_nodes_table, answer=NodesAnswer)
_QDQ = Command("qdq", qdq, table=_qdq_table, answer=QdqAnswer)
_ISLANDS = Command("islands", islands, table=_islands_table, answer=IslandsAnswer)
_BOUNDARY = Command("boundary", boundary, table=_boundary_table, answer=BoundaryAnswer)
_DIFF = Command("diff", diff, ("a", "b"), table=_diff_table, answer=DiffAnswer)

CHECK = Command(
    "check",
    _check,
    options=(
        ("--float", {"metavar": "F.onnx", "dest": "float_path", "help": "the float model, for --min-sqnr"}),
        Budgets.taken(),
        MetricChoice.taken(f"{either_of(_METRIC_BUDGETS)}: "),
        Session.taken(
            ["disabled", *RUNTIME_LEVELS],
            "all",
            "--min-sqnr, --min-metric: onnxruntime optimization level both models run at (default: all)",
        ),
        Samples.taken(1, many=True, when=f"{', '.join(BUDGETS[name].flag for name in FLOAT_BUDGETS)}: "),
        CpuTarget.taken(
            f"{', '.join(BUDGETS[name].flag for name in _RUNNING_BUDGETS)}: run the models in onnxruntime"
            f" built for this CPU, emulated: native (default), x86-avx2 or arm64 (install: {INSTALL_TARGETS})"
        ),
    ),
    only_with=(
        OnlyWith(
            either_of(FLOAT_BUDGETS),
            lambda built: built["budgets"].any_of(FLOAT_BUDGETS),
            ("float_path", "inputs", "shape", "seed", "level"),
        ),
        OnlyWith(
            either_of(_METRIC_BUDGETS),
            lambda built: built["budgets"].any_of(_METRIC_BUDGETS),
            ("metric", "threshold", "blank", "layout"),
        ),
        OnlyWith(
            either_of(_RUNNING_BUDGETS),
            lambda built: built["budgets"].any_of(_RUNNING_BUDGETS),
            ("cpu",),
            neutral=(("cpu", NATIVE),),
        ),
    ),
    exit_code=lambda answer: EXIT_OK if answer["ok"] else EXIT_BUDGET,
    table=_check_table,
    answer=CheckAnswer,
)

_DOT = Command(
    "dot",
    dot,
    options=(
        (
            "--runtime",
            {
                "action": "store_true",
                "dest": "runtime_colours",
                "help": "colour nodes by what onnxruntime runs (int8, int8_data, float, absorbed), "
                "from the runtime command",
            },
        ),
        (
            "--collapse",
            {
                "action": "store_true",
                "help": f"draw each connected group of wrapped nodes as one box (for over {_COLLAPSE_HINT} "
                "compute nodes)",
            },
        ),
    ),
    text=True,
)


# --------------------------------------------------------------------------
# Saved answers for table: which command an answer is from, by its keys and types


def _answer_keys(command: Command) -> tuple[frozenset[str], frozenset[str]]:
    """``(required, all)`` keys of ``command``'s answer (empty without a declared type)."""
    if command.answer is None:
        return frozenset(), frozenset()
    hints, required = _typed_fields(command.answer)  # the core's stringized NotRequired keys too
    return required, frozenset(hints)


# The Python types a JSON value of each annotated type may have (a float may be written 3).
_JSON_TYPES: dict[object, tuple[type, ...]] = {
    type(None): (type(None),),
    bool: (bool,),
    int: (int,),
    float: (int, float),
    str: (str,),
}


@functools.cache
def _typed_fields(hint: Any) -> tuple[dict[str, Any], frozenset[str]]:
    """A TypedDict's field types and required keys, read once per type (get_type_hints
    evaluates the annotations again on every call: 2.6 s for 100,000 island rows)."""
    hints = typing.get_type_hints(hint, include_extras=True)
    # Stringized annotations hide NotRequired from __required_keys__: read it here.
    required = frozenset(key for key in hint.__required_keys__ if typing.get_origin(hints[key]) is not NotRequired)
    return hints, required


def _misfit(value: object, hint: Any, where: str) -> str | None:
    """Where a JSON value is not of its answer's annotated type (``None``: it is). Types
    this does not know pass: the table renderer still refuses what it cannot show."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        problems = [_misfit(value, option, where) for option in args]
        return None if None in problems else next(p for p in problems if p)
    if origin in (NotRequired, typing.Required):
        return _misfit(value, args[0], where)
    if typing.is_typeddict(hint):
        hints, required = _typed_fields(hint)
        if not isinstance(value, dict) or not required <= value.keys() <= hints.keys():
            return f"{where} is not an object of the keys {', '.join(sorted(hints))}"
        return next((p for key in value if (p := _misfit(value[key], hints[key], f"{where}.{key}"))), None)
    if origin is list:
        if not isinstance(value, list):
            return f"{where} is not a list"
        return next((p for k, item in enumerate(value) if (p := _misfit(item, args[0], f"{where}[{k}]"))), None)
    if origin is dict:
        if not isinstance(value, dict):
            return f"{where} is not an object"
        return next((p for key, item in value.items() if (p := _misfit(item, args[1], f"{where}.{key}"))), None)
    expected = _JSON_TYPES.get(hint)
    if expected is None:
        return None
    if isinstance(value, expected) and (hint is bool or not isinstance(value, bool)):
        return None
    return f"{where} is {json.dumps(value)[:40]}, not {getattr(hint, '__name__', hint)}"


def _answer_command(answer: dict[str, Any], path: str) -> Command:
    """The command whose answer ``answer`` is, by its keys (the counting commands first,
    so a package command is imported only when no core one fits)."""
    keys = set(answer)
    for name in sorted(_COMMANDS, key=lambda name: _COMMANDS[name].package):
        if name == "table":
            continue
        try:
            command = _load_command(name)
        except GraphscanError:  # the package is missing: only the core's tables are here
            raise GraphscanError(
                f"usage: {shown(path)}: not the answer of a command of graphscan.py alone; the tables of the "
                f"commands that run models need the {_PACKAGE} package and onnxruntime",
                EXIT_USAGE,
            ) from None
        required, known = _answer_keys(command)
        if required and required <= keys <= known:
            problem = _misfit(answer, command.answer, "answer")
            if problem is not None:
                raise GraphscanError(f"usage: {shown(path)}: not a {command.name} answer ({problem})", EXIT_USAGE)
            return command
    raise GraphscanError(f"usage: {shown(path)}: not the JSON answer of a graphscan command", EXIT_USAGE)


def read_answer(path: str) -> tuple[Command, dict[str, Any]]:
    """The saved JSON answer at ``path`` and the command it is the answer of (``table`` and
    ``report`` read answers so): exit 3 when it cannot be read, 2 when it is not one."""
    check_readable(path)
    try:
        with open(path, encoding="utf-8") as f:
            answer = json.load(f, parse_constant=_not_strict_json)
    except OSError as exc:
        raise GraphscanError(f"{shown(path)}: cannot read ({exc.strerror or exc})", EXIT_NO_FILE)
    except (ValueError, RecursionError) as exc:
        raise GraphscanError(f"usage: {shown(path)}: not a JSON answer ({one_line(exc)})", EXIT_USAGE)
    if not isinstance(answer, dict):
        raise GraphscanError(f"usage: {shown(path)}: not the JSON answer of a graphscan command", EXIT_USAGE)
    return _answer_command(answer, path), answer


def table(path: str, top: int | None = None) -> str:
    """A saved JSON answer of any command rendered as that command's table (``--format table``)."""
    command, answer = read_answer(path)
    try:
        return command.render(answer, top)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # keys right, values not
        raise GraphscanError(
            f"usage: {shown(path)}: not a {command.name} answer ({type(exc).__name__}: {one_line(exc)})", EXIT_USAGE
        )


def _not_strict_json(token: str) -> None:
    """json's hook for NaN and +-Infinity: no answer holds them (_strict_json), so a file that
    does was not written by graphscan."""
    raise ValueError(f"{token} is not strict JSON")


_TABLE = Command(
    "table",
    table,
    ("answer",),
    options=(
        ("--top", {"type": non_negative_int, "metavar": "N", "help": "only the N largest rows of each long list"}),
    ),
    text=True,
    path_help="a saved JSON answer of any command",
)


# --------------------------------------------------------------------------
# The command line: the registry, the parser, main() and its signals
#
# _COMMANDS is the registry: each command's one-line summary (so --help lists
# every command even without the package) and, for the core's own, the function
# that returns its declaration; the package's come through its one door,
# graphscan_ort/extension.py, the only module the core imports.


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A command in the registry: its one-line summary and where it is declared."""

    summary: str
    # None: declared in the graphscan_ort package (it needs the package and onnxruntime),
    # handed over by graphscan_ort/extension.py, the package's one door.
    declared: Callable[[], Command] | None = None

    @property
    def package(self) -> bool:
        """Whether the command is the graphscan_ort package's."""
        return self.declared is None


_COMMANDS = {
    "nodes": _Entry("op census and initializer dtypes", lambda: _NODES),
    "qdq": _Entry("Q/DQ counts, round trips, weight DQs", lambda: _QDQ),
    "islands": _Entry("int8-wrapped vs float nodes, float islands", lambda: _ISLANDS),
    "boundary": _Entry("DQs entering and Qs leaving each island", lambda: _BOUNDARY),
    "diff": _Entry("b minus a for the counts above", lambda: _DIFF),
    "fuse": _Entry("fuse MatMul+Add into Gemm, verified, into output"),
    "trace": _Entry("per-op isolated and propagated error of b (quantized) vs a (float)"),
    "runtime": _Entry("what onnxruntime really runs per node: int8, int8_data, float, absorbed"),
    "check": _Entry(
        "a CI gate: exit 8 when a budget (float nodes, islands, crossings, int8 share, SQNR) is broken", lambda: CHECK
    ),
    "dot": _Entry("Graphviz DOT picture of the island map (DOT text, not JSON)", lambda: _DOT),
    "impact": _Entry("output SQNR gained by keeping each op or tensor of b (quantized) float"),
    "tune": _Entry(
        "quantize a float model every way and keep the fastest that is accurate enough, measured as deployed"
    ),
    "table": _Entry("a saved JSON answer of any command, shown as that command's table", lambda: _TABLE),
    "report": _Entry("one self-contained HTML page of saved answers: tune's front, what runs, the island map"),
}


def _load_command(name: str) -> Command:
    """The declaration of command ``name``; a package command's module is imported now."""
    declared = _COMMANDS[name].declared
    if declared is not None:
        return declared()
    with _package_needed(name):
        from graphscan_ort.extension import command

        return command(name)


def _command_function(name: str) -> Callable[..., Any]:
    """Command ``name`` as a plain function of this module, with one keyword per option as
    the command line takes them (``graphscan.check(path, min_sqnr=20, inputs=[...])``),
    built into its groups as the command line's are; a package command's module is
    imported when it is first called."""

    def command(*args: object, **keywords: object) -> Any:
        declared = _load_command(name)
        return declared.run(*args, **_in_process_keywords(declared, keywords))

    command.__name__ = command.__qualname__ = name
    command.__doc__ = f"The {name} command (docs/SPEC.md), run in this process."
    return command


check = _command_function("check")
fuse = _command_function("fuse")
trace = _command_function("trace")
runtime = _command_function("runtime")
impact = _command_function("impact")
tune = _command_function("tune")
report = _command_function("report")


def render_table(command: str, answer: dict, top: int | None = None) -> str:
    """The answer of ``command`` as text for a terminal: its own table, else a generic one."""
    return _load_command(command).render(answer, top)


class _OneLineParser(argparse.ArgumentParser):
    """argparse that raises a one-line usage error instead of printing usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise GraphscanError(f"usage: {message}", EXIT_USAGE)

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        """Help on stdout like an answer: argparse would silently drop a failed write."""
        if file is None:
            _write_answer(self.format_help())
        else:
            super().print_help(file)


def _option_dest(flag: str, settings: dict) -> str:
    """The keyword an option is passed as: its ``dest``, else the flag in snake_case."""
    return settings.get("dest") or flag.lstrip("-").replace("-", "_")


def _exit_code_epilog() -> str:
    """``--help``'s list of exit codes, from EXIT_CODES."""
    return "exit codes: " + ", ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items())


def _add_arguments(parser: argparse.ArgumentParser, command: Command) -> None:
    """``command``'s paths and options (its own and its groups'), then the output group (--format, --top)."""
    for path in command.paths:
        if command.many and path == command.paths[-1]:
            parser.add_argument(path, nargs="+", help=command.path_help)
        else:
            parser.add_argument(path, help=command.path_help)
    for flag, settings in command.flat_options():
        parser.add_argument(flag, **settings)
    if not command.text:
        _Output.add_to(parser, command.own_top)


def _invoked_as() -> str:
    """The name --help gives the program: ``graphscan`` as the console script
    (``pip install .``), else ``graphscan.py`` (run as a file, or main() in process)."""
    return "graphscan" if os.path.basename(sys.argv[0]) == "graphscan" else "graphscan.py"


def _build_parser(chosen: str | None = None) -> _OneLineParser:
    """The command line. With a ``chosen`` command only its parser is built (and its
    module imported): a parser costs milliseconds, and a run needs one. Without one,
    every command is declared by its summary, for --help and the usage errors."""
    parser = _OneLineParser(
        prog=_invoked_as(),
        description="Count what quantization did to an ONNX graph; one JSON object on stdout.",
        epilog=_exit_code_epilog(),
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=_OneLineParser)
    for name, entry in _COMMANDS.items():
        if chosen is None:
            sub.add_parser(name, help=entry.summary, description=entry.summary)
        elif name == chosen:
            command = _load_command(name)
            settings: dict[str, Any] = {"help": entry.summary, "description": entry.summary}
            if command.epilog:
                settings.update(epilog=command.epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
            _add_arguments(sub.add_parser(name, **settings), command)
    return parser


def _command_keywords(command: Command, args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``command.run`` from the parsed ``args``."""
    values = {
        _option_dest(flag, settings): getattr(args, _option_dest(flag, settings))
        for flag, settings in command.flat_options()
    }
    return _built_keywords(command, values, command_line=True)


def _in_process_keywords(command: Command, keywords: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``command.run`` from an in-process call's (``graphscan.check(...)``,
    the pytest plugin): each checked by the command line's own rule for its option (its
    argparse type or choices), so a call refuses what the command line refuses, in the same
    words, naming the keyword (``level=``) where the command line names the flag."""
    settings_of = {_option_dest(flag, settings): settings for flag, settings in command.flat_options()}
    unknown = sorted(set(keywords) - set(settings_of))
    if unknown:
        raise TypeError(f"{command.name}() got an unexpected keyword argument {unknown[0]!r}")
    values = {
        key: None if value is None else _keyword_value(key, value, settings_of[key]) for key, value in keywords.items()
    }
    return _built_keywords(command, values, command_line=False)


def _built_keywords(command: Command, values: Mapping[str, Any], command_line: bool) -> dict[str, Any]:
    """``command.run``'s keywords from each option's value (None: not given), every value
    checked by its type already: each group built from its options, each option of the
    command's own given or its declared default; then its only-with rules."""
    keywords: dict[str, Any] = {}
    for entry in command.options:
        if isinstance(entry, Takes):
            flags = {_option_dest(flag, settings): flag for flag, settings in entry.options}
            given = Given({key: values.get(key) for key in flags}, flags, command_line, command.name)
            keywords[entry.keyword] = entry.build(given)
        else:
            flag, settings = entry
            key = _option_dest(flag, settings)
            value = values.get(key)
            keywords[key] = _declared_default(settings) if value is None else value
    flag_of = {_option_dest(flag, settings): flag for flag, settings in command.flat_options()}
    for rule in command.only_with:
        only_with(rule.flag, rule.enabled(keywords), rule.given(values, flag_of))
    return keywords


def _declared_default(settings: dict) -> object:
    """What an option left out means: its declared default (a flag's False, else None)."""
    return settings.get("default", False if settings.get("action") == "store_true" else None)


def _keyword_value(key: str, value: object, settings: dict) -> object:
    """``value`` of keyword ``key`` by its option's ``settings``; exit 2 as the command line."""
    if settings.get("action") == "append":
        values = [value] if isinstance(value, (str, os.PathLike)) else value
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, (str, os.PathLike)) for v in values):
            raise GraphscanError(
                f"usage: argument {key}=: expected a list of strings or paths, not {value!r}", EXIT_USAGE
            )
        return [os.fspath(v) for v in values]
    rule = settings.get("type")
    if rule is not None and rule not in (int, float):  # plain numbers: budget_limit's own rule
        try:
            value = rule(str(value))
        except argparse.ArgumentTypeError as exc:
            raise GraphscanError(f"usage: argument {key}=: {exc}", EXIT_USAGE) from None
    choices = settings.get("choices")
    if choices is not None and value not in choices:
        shown_choices = ", ".join(map(repr, choices))
        raise GraphscanError(
            f"usage: argument {key}=: invalid choice: {value!r} (choose from {shown_choices})", EXIT_USAGE
        )
    return value


def _answer_text(argv: list[str]) -> tuple[str, int]:
    """Parse ``argv``, run the command, return the text to print and the exit code
    (raises GraphscanError).

    The text is the answer's JSON, or with ``--format table`` a table rendered
    from that same answer; ``dot`` answers DOT text.
    """
    chosen = argv[0] if argv and argv[0] in _COMMANDS else None
    args = _build_parser(chosen).parse_args(argv)
    if args.command is None:
        raise GraphscanError(f"usage: a command is required ({', '.join(_COMMANDS)})", EXIT_USAGE)
    command = _load_command(args.command)
    output = _Output.parsed(args, command.own_top)
    keywords = _command_keywords(command, args)
    paths = [getattr(args, p) for p in command.paths]
    if command.many:  # the last path's values, each a positional argument
        paths[-1:] = paths[-1]
    answer = command.run(*paths, **keywords)
    if command.text:
        return answer.rstrip("\n"), EXIT_OK
    exit_code = command.exit_code(answer) if command.exit_code else EXIT_OK
    if output.format == "table":
        return command.render(answer, output.top), exit_code
    return _strict_json(answer), exit_code


def _strict_json(answer: dict) -> str:
    """One strict JSON text for ``answer``: NaN and +-Infinity become ``null``.

    Strict parsers reject those tokens, so no answer may carry them. The
    sanitizing walk runs only when ``allow_nan=False`` finds one.
    """
    try:
        return json.dumps(answer, allow_nan=False)
    except ValueError:
        return json.dumps(_finite_or_null(answer), allow_nan=False)


def _finite_or_null(value: object) -> object:
    """``value`` with every non-finite float, at any depth, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def stderr_line(line: str) -> None:
    """One line on stderr; a closed or full stderr cannot make it a traceback."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(f"graphscan: {_single_line(line)}\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def _write_answer(text: str) -> None:
    """Write the answer on stdout, or raise exit 3 when stdout cannot take it
    (closed, a pipe whose reader left, a full disk)."""
    stream = sys.stdout
    # JSON is ASCII; a table shows names as they are, escaped where the terminal cannot.
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        stream.flush()
    except (OSError, ValueError) as exc:
        _discard_stdout(stream)
        raise GraphscanError(
            f"cannot write the answer to stdout ({getattr(exc, 'strerror', None) or one_line(exc)})", EXIT_NO_FILE
        )


def _discard_stdout(stream: TextIO) -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's final flush
    of what could not be written does not print an error of its own."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):  # not a real file (a test's capture)
        return
    os.dup2(devnull, fd)
    os.close(devnull)


# glibc's mallopt parameter for the number of malloc arenas.
M_ARENA_MAX = -8


def _one_malloc_arena() -> None:
    """One malloc arena for the whole process, where the C library is glibc. glibc gives
    threads that allocate arenas of their own (up to 8 per core) and keeps in each what was
    freed there; tune runs samples and counts in threads. Its every-stage run on PP-OCRv4's
    detector at page size peaked at 1.49-1.96 GiB with one arena (4 runs), 1.59-2.13 GiB
    without (7 runs), in the same time. Elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # a C library without mallopt
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1)


def main(argv: list[str] | None = None) -> int:
    """Run one command; print its JSON answer or one error line. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # A short run that builds a million small objects: the cyclic collector
    # would only rescan them again and again (about a third of the time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    _one_malloc_arena()
    try:
        if sys.stdout is None:  # checked first: files opened now could take descriptor 1
            raise GraphscanError("cannot write the answer: stdout is closed", EXIT_NO_FILE)
        with warnings.catch_warnings():
            # A warning on stderr would break "nothing but one line": NaN outputs
            # are answered as null, never as numpy's RuntimeWarning.
            warnings.simplefilter("ignore")
            text, exit_code = _answer_text(argv)
        _write_answer(text + "\n")
    except GraphscanError as exc:
        stderr_line(str(exc))
        return exc.exit_code
    except SystemExit as exc:  # argparse after printing --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated): unwound, nothing half-written
        terminated = isinstance(exc, _Terminated) or signal.SIGTERM in INTERRUPTED
        stderr_line("terminated" if terminated else "interrupted")
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except MemoryError:  # graphscan's own arrays or onnxruntime's: the model did not run here
        stderr_line(
            f"{argv[0] if argv else 'graphscan'}: out of memory (give smaller inputs with --shape, or fewer samples)"
        )
        return EXIT_RUNTIME
    except Exception as exc:  # a bug: still one line, never a traceback
        stderr_line(f"internal error: {type(exc).__name__}: {one_line(exc)}")
        return EXIT_INTERNAL
    finally:
        if gc_was_enabled:
            gc.enable()
    return exit_code


def console_main() -> None:
    """The ``graphscan`` command (and ``python graphscan.py``): main() with Ctrl-C as exit
    130 and SIGTERM as exit 143."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _note_interrupt)  # main() reports it in one line
    try:
        code = main()
    except KeyboardInterrupt as exc:  # in the instant between main()'s own handlers
        code = EXIT_TERMINATED if isinstance(exc, _Terminated) or signal.SIGTERM in INTERRUPTED else EXIT_INTERRUPTED
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_on_interrupt)  # no traceback during shutdown either
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # Python's own shutdown gives SIGINT back its default (a Ctrl-C there killed the
    # process, -2) and frees every object one by one: the answer is out, so leave now.
    os._exit(code)


if __name__ == "__main__":
    console_main()
