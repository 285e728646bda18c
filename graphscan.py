#!/usr/bin/env python3
"""graphscan: count what really happened when an ONNX model was quantized.

A QDQ model keeps every operator and only wraps tensors in QuantizeLinear /
DequantizeLinear, so "quantized" and "runs in int8" can only be told apart by
counting the graph. The contract (keys, ordering, exit codes) is docs/SPEC.md.

    python graphscan.py <command> <model...>

Every command is a function ``path(s) -> dict``; ``main(argv) -> int`` is a
thin layer that prints one JSON object on stdout or one error line on stderr.
Only the standard library and onnx are imported at start.
"""

import argparse
import contextlib
import functools
import gc
import itertools
import json
import math
import os
import re
import signal
import stat
import sys
import time
from collections import Counter

EXIT_INTERRUPTED = 130  # SIGINT, as shells report it (128 + 2)


def exit_on_interrupt(signum, frame):
    """SIGINT where main() cannot catch it (importing onnx, shutting down): one line, exit 130."""
    try:
        os.write(2, b"graphscan: interrupted\n")
    finally:
        os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, exit_on_interrupt)  # importing onnx takes a moment

import onnx  # noqa: E402  (after the SIGINT handler on purpose)

EXIT_OK = 0
EXIT_INTERNAL = 1  # a bug in graphscan, still reported in one line
EXIT_USAGE = 2
EXIT_NO_FILE = 3  # no such file, not a regular file, or an output that cannot be written
EXIT_NOT_ONNX = 4  # not an ONNX model (or, for fuse/trace, its external data cannot be loaded)
EXIT_RUNTIME = 5  # fuse/trace: the model does not run in onnxruntime
EXIT_MISMATCH = 6  # fuse: the fused model does not reproduce the original
EXIT_INPUTS = 7  # the models' inputs differ, or --inputs / --shape cannot feed them
EXIT_BUDGET = 8  # check: a budget is broken (the JSON answer says which)

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"


class GraphscanError(Exception):
    """A user error: one line for stderr and the exit code that goes with it."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------
# Loading


def one_line(exc):
    """The first line of an exception's message, for a one-line stderr report."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def shown(path):
    """``path`` as error messages name it: unchanged when it prints on one line,
    else escaped as ``repr`` does (a newline in a file name shows as ``\\n``)."""
    path = os.fsdecode(path)
    return path if path.isprintable() else repr(path)


# Characters str.splitlines() breaks at: a message must never contain one.
LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def single_line(text):
    """``text`` with every line break escaped, so a report stays one line."""
    return LINE_BREAKS.sub(lambda m: repr(m.group())[1:-1], text)


def check_readable(path):
    """Raise exit 3 unless ``path`` is an existing regular file."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise GraphscanError(f"{shown(path)}: no such file ({getattr(exc, 'strerror', None) or exc})", EXIT_NO_FILE)
    if not stat.S_ISREG(mode):
        raise GraphscanError(f"{shown(path)}: not a regular file", EXIT_NO_FILE)


# Above this size a model is parsed without its tensor payloads (see skim_model).
SKIM_THRESHOLD = 64 * 1024 * 1024
# ModelProto's fields and their wire types (0 varint, 2 length-delimited): the
# first field of a model file is one of these, so a file that starts with
# anything else is refused before it is read further.
MODEL_FIELD_WIRES = {
    field.number: 0 if field.type in (field.TYPE_INT64, field.TYPE_INT32) else 2
    for field in onnx.ModelProto.DESCRIPTOR.fields
}


HEAD_BYTES = 64 * 1024  # how much of a file check_head reads


def check_head(head, path):
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
            key, pos = read_varint(head, pos)
            number, wire = key >> 3, key & 7
            if first and MODEL_FIELD_WIRES.get(number) != wire:
                problem = "it does not start with a ModelProto field"
            elif number == 0 or wire not in (0, 1, LENGTH_DELIMITED, 5):
                problem = f"malformed protobuf at byte {pos}"
            first = False
            if wire == 0:
                _, pos = read_varint(head, pos)
            elif wire == LENGTH_DELIMITED:
                length, pos = read_varint(head, pos)
                pos += length
            else:
                pos += 8 if wire == 1 else 4
    except IndexError:  # the head ends inside a field: nothing wrong so far
        pass
    except ValueError as exc:
        problem = str(exc)
    if problem is not None:
        raise GraphscanError(f"{shown(path)}: not an ONNX model ({problem})", EXIT_NOT_ONNX)


def load_model(path, weights=False):
    """Parse ``path`` as an ONNX model without touching external-data files.

    Without ``weights``, a big file is parsed without its initializers' data,
    reading only the bytes it keeps: a 2 GiB model costs megabytes, not two
    copies of its weights. Names, dims and data types of initializers are kept.
    """
    check_readable(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            check_head(os.pread(f.fileno(), HEAD_BYTES, 0), path)
            if weights or size < SKIM_THRESHOLD:
                return parse_model(f.read(), path)
            try:
                data = skim_model(FileBytes(f.fileno(), size))
            except (IndexError, ValueError) as exc:
                raise GraphscanError(f"{shown(path)}: not an ONNX model ({one_line(exc)})", EXIT_NOT_ONNX)
            return parse_model(data, path)
    except OSError as exc:
        raise GraphscanError(f"{shown(path)}: cannot read ({exc.strerror or exc})", EXIT_NO_FILE)


class FileBytes:
    """The bytes of an open file, indexed and sliced like ``bytes``, read on demand.

    Not a memory map: a file truncated while it is read gives a short read
    (``ValueError``, exit 4), never SIGBUS. Reads go through a window of
    ``WINDOW`` bytes, so the skimmer's byte-by-byte varints stay cheap.
    """

    WINDOW = 1 << 20
    FIELD_HEAD = 20  # a field's key and length varints take at most this many bytes

    def __init__(self, fd, size):
        self.fd, self.size = fd, size
        self.start, self.window = 0, b""

    def __len__(self):
        return self.size

    def _read(self, start, length):
        data = os.pread(self.fd, length, start)
        if len(data) != length:
            raise ValueError("the file is shorter than when it was opened (changed while being read)")
        return data

    def __getitem__(self, key):
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

    def _fill(self, start):
        self.start = start
        self.window = self._read(start, min(self.WINDOW, self.size - start))

    def window_at(self, pos):
        """``(window, its start)`` holding the head of the field at ``pos``."""
        window_end = self.start + len(self.window)
        if pos < self.start or (pos + self.FIELD_HEAD > window_end and window_end < self.size):
            self._fill(pos)
        return self.window, self.start


# Protobuf wire format, just enough to skip tensor payloads of big models.
MODEL_GRAPH = 7  # ModelProto.graph
GRAPH_INITIALIZER = 5  # GraphProto.initializer
# TensorProto float_data, int32_data, string_data, int64_data, raw_data,
# double_data, uint64_data: the payload; everything else is the header.
TENSOR_PAYLOAD = {4, 5, 6, 7, 9, 10, 11}
LENGTH_DELIMITED = 2


def read_varint(buf, pos):
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


def encode_varint(value):
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def wire_fields(buf, start, end):
    """Yield ``(field number, wire type, value start, value end, field start)`` for
    each field in ``buf[start:end]``; ``buf`` is ``bytes`` or a ``FileBytes``, whose
    fields are parsed inside its window of plain bytes."""
    file = buf if isinstance(buf, FileBytes) else None
    data, base, data_end = (b"", 0, 0) if file is not None else (buf, 0, len(buf))
    pos = start
    while pos < end:
        # A window is immutable bytes: still right for its range after the file's moved on.
        if file is not None and (pos < base or (pos + file.FIELD_HEAD > data_end and data_end < file.size)):
            data, base = file.window_at(pos)
            data_end = base + len(data)
        field_start = pos
        key, pos = read_varint(data, pos - base)
        if key >> 3 == 0:
            raise ValueError("field number 0")
        wire = key & 7
        value_start = pos
        if wire == 0:
            _, pos = read_varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == LENGTH_DELIMITED:
            length, pos = read_varint(data, pos)
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


def length_delimited(number, payload):
    return encode_varint(number << 3 | LENGTH_DELIMITED) + encode_varint(len(payload)) + payload


def skim_model(buf):
    """ModelProto bytes with every graph initializer reduced to its header."""
    out = bytearray()
    for number, wire, start, end, field_start in wire_fields(buf, 0, len(buf)):
        if number == MODEL_GRAPH and wire == LENGTH_DELIMITED:
            out += length_delimited(MODEL_GRAPH, skim_graph(buf, start, end))
        else:
            out += buf[field_start:end]
    return bytes(out)


def skim_graph(buf, start, end):
    out = bytearray()
    kept_from = start  # fields other than initializers are copied in runs, not one by one
    for number, wire, value_start, value_end, field_start in wire_fields(buf, start, end):
        if number == GRAPH_INITIALIZER and wire == LENGTH_DELIMITED:
            if field_start > kept_from:
                out += buf[kept_from:field_start]
            kept_from = value_end
            tensor, first, last = buf, value_start, value_end
            if last - first <= FileBytes.WINDOW:  # small: one read, then parsed as bytes
                tensor, first, last = buf[first:last], 0, last - first
            header = b"".join(
                tensor[f_start:f_end]
                for n, _, _, f_end, f_start in wire_fields(tensor, first, last)
                if n not in TENSOR_PAYLOAD
            )
            out += length_delimited(GRAPH_INITIALIZER, header)
    out += buf[kept_from:end]
    return bytes(out)


def parse_model(data, path):
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


# --------------------------------------------------------------------------
# The graph index: built once, every question answered from it in linear time


def as_text(value):
    """A protobuf string field as ``str``.

    Protobuf hands a string field that is not valid UTF-8 to Python as
    ``bytes``; graphscan shows it with U+FFFD for each bad byte, so it sorts
    and prints like every other name.
    """
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def as_texts(values):
    """``values`` with any ``bytes`` decoded; the list itself when all are ``str``."""
    if bytes in set(map(type, values)):
        return [as_text(v) for v in values]
    return values


def node_name(node, index):
    """The node's name, or ``<op_type>_<index>`` when it has none."""
    return as_text(node.name) or f"{as_text(node.op_type)}_{index}"


def dtype_name(data_type):
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

    def __init__(self, graph):
        self.graph = graph
        self.op_types, self.inputs, self.outputs = op_types, inputs, outputs = [], [], []
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
        self.op_types = op_types = as_texts(op_types)
        self.is_q = [op == QUANTIZE for op in op_types]
        self.is_dq = [op == DEQUANTIZE for op in op_types]
        self.q_nodes = [i for i, q in enumerate(self.is_q) if q]
        self.dq_nodes = [i for i, dq in enumerate(self.is_dq) if dq]
        self.compute_nodes = [i for i, (q, dq) in enumerate(zip(self.is_q, self.is_dq)) if not (q or dq)]

    def __len__(self):
        return len(self.op_types)

    def _inputs_of(self, node_indices):
        inputs = self.inputs
        return itertools.chain.from_iterable(inputs[i] for i in node_indices)

    def _outputs_of(self, node_indices):
        outputs = self.outputs
        return itertools.chain.from_iterable(outputs[i] for i in node_indices)

    # Who reads each tensor, as three sets over disjoint groups of readers;
    # each name is hashed once, and every rule below is a set operation in C.
    @functools.cached_property
    def read_by_q(self):
        return set(self._inputs_of(self.q_nodes))

    @functools.cached_property
    def read_by_dq(self):
        return set(self._inputs_of(self.dq_nodes))

    @functools.cached_property
    def read_by_compute(self):
        return set(self._inputs_of(self.compute_nodes))

    @functools.cached_property
    def wrapped(self):
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
    def floating(self):
        floating, wrapped = [False] * len(self), self.wrapped
        for i in self.compute_nodes:
            floating[i] = not wrapped[i]
        return floating

    @functools.cached_property
    def float_nodes(self):
        floating = self.floating
        return [i for i in self.compute_nodes if floating[i]]

    @functools.cached_property
    def producer(self):
        """``{tensor: index of the node producing it}``."""
        return {t: i for i, outs in enumerate(self.outputs) for t in outs}

    @functools.cached_property
    def float_producer(self):
        return self._producer_among(self.float_nodes)

    @functools.cached_property
    def dq_producer(self):
        return self._producer_among(self.dq_nodes)

    def _producer_among(self, node_indices):
        outputs = self.outputs
        return {t: i for i in node_indices for t in outputs[i]}

    @functools.cached_property
    def consumers(self):
        """``{tensor: [node indices]}`` over every node."""
        return self._consumers(range(len(self)))

    @functools.cached_property
    def float_consumers(self):
        return self._consumers(self.float_nodes)

    @functools.cached_property
    def q_consumers_of_float(self):
        """``{tensor made by a float node: [Q nodes reading it]}``."""
        float_outputs = set(self._outputs_of(self.float_nodes))
        inputs = self.inputs
        readers = [i for i in self.q_nodes if not float_outputs.isdisjoint(inputs[i])]
        return self._consumers(readers)

    def _consumers(self, node_indices):
        table = {}
        for i in node_indices:
            for tensor in self.inputs[i]:
                users = table.get(tensor)
                if users is None:
                    table[tensor] = [i]
                elif users[-1] != i:  # a node reading one tensor twice is one consumer
                    users.append(i)
        return table

    @functools.cached_property
    def initializers(self):
        """Names of the graph's initializers."""
        return {init.name for init in self.graph.initializer}

    @functools.cached_property
    def names(self):
        """Every node's name; ``name(i)`` is cheaper when only a few are needed."""
        return [self.name(i) for i in range(len(self))]

    def name(self, i):
        return node_name(self.graph.node[i], i)

    def is_compute(self, i):
        return not (self.is_q[i] or self.is_dq[i])

    def producer_of(self, tensor):
        """Index of the node producing ``tensor``, or None."""
        return self.producer.get(tensor)

    def consumers_of(self, tensor):
        return self.consumers.get(tensor, ())


def float_components(index):
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


def float_islands(index):
    """Float islands as ``(node indices, sorted names)`` in SPEC.md's order.

    Each island's names are sorted, and the list by those names, which puts
    the island with the smallest first name first.
    """
    islands = []
    for component in float_components(index):
        named = sorted((index.name(i), i) for i in component)
        islands.append(([i for _, i in named], [name for name, _ in named]))
    islands.sort(key=lambda island: island[1])
    return islands


def boundary_of(index, island):
    """Distinct DQ nodes feeding the island and distinct Q nodes it feeds."""
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


def count_round_trips(index):
    """Q nodes whose output is consumed, and consumed only by DQ nodes."""
    read_by_non_dq = index.read_by_q | index.read_by_compute
    read_by_dq_only = index.read_by_dq - read_by_non_dq
    outputs = index.outputs
    return sum(
        1 for i in index.q_nodes if not read_by_dq_only.isdisjoint(outputs[i]) and read_by_non_dq.isdisjoint(outputs[i])
    )


def count_weight_dequantize(index):
    """DQ nodes whose first input is an initializer (a stored int8 weight)."""
    initializers, inputs, gaps = index.initializers, index.inputs, index.inputs_with_gaps
    count = 0
    for i in index.dq_nodes:
        first = (gaps[i] if i in gaps else inputs[i])[:1]  # input 0 as written
        count += bool(first) and first[0] in initializers
    return count


# --------------------------------------------------------------------------
# Answers from an index (used by the commands and by gen_models.py)


def census(op_types):
    """``{op_type: count}`` with keys sorted."""
    return dict(sorted(Counter(op_types).items()))


def initializer_census(graph):
    """``{dtype_name: count}`` over the graph's initializers, keys sorted."""
    counts = Counter(dtype_name(init.data_type) for init in graph.initializer)
    return dict(sorted(counts.items()))


def qdq_counts(index):
    return {
        "quantize": len(index.q_nodes),
        "dequantize": len(index.dq_nodes),
        "round_trips": count_round_trips(index),
        "weight_dequantize": count_weight_dequantize(index),
    }


def island_report(index, islands):
    compute = len(index.compute_nodes)
    wrapped = compute - len(index.float_nodes)
    entries = []
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


def boundary_report(index, islands):
    per_island = []
    for members, names in islands:
        in_dq, out_q = boundary_of(index, members)
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


def index_model(path):
    return GraphIndex(load_model(path).graph)


def nodes(path):
    """Op census and initializer dtype census."""
    model = load_model(path)
    op_types = as_texts([node.op_type for node in model.graph.node])  # no index needed
    return {
        "model": path,
        "nodes": len(op_types),
        "op_types": census(op_types),
        "initializers": initializer_census(model.graph),
    }


def qdq(path):
    """Q and DQ counts, activation round trips and weight DQs."""
    return {"model": path, **qdq_counts(index_model(path))}


def islands(path):
    """Wrapped versus float compute nodes and the float islands."""
    index = index_model(path)
    return {"model": path, **island_report(index, float_islands(index))}


def boundary(path):
    """Per island, the distinct DQs entering it and Qs leaving it."""
    index = index_model(path)
    return {"model": path, **boundary_report(index, float_islands(index))}


def summary(index):
    """The numbers ``diff`` compares, from one index.

    Only what diff reports: islands need no names, weight DQs are not compared.
    """
    return {
        "op_types": census(index.op_types),
        "quantize": len(index.q_nodes),
        "dequantize": len(index.dq_nodes),
        "round_trips": count_round_trips(index),
        "island_count": len(float_components(index)),
        "float": len(index.float_nodes),
    }


def diff_summaries(a, b):
    """b minus a for two ``summary`` dicts; op_delta keeps non-zero entries."""
    op_types = sorted(set(a["op_types"]) | set(b["op_types"]))
    op_delta = {}
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


def diff(a, b):
    """What changed from model ``a`` to model ``b`` (every delta is b - a)."""
    before = summary(index_model(a))
    after = summary(index_model(b))
    return {"a": a, "b": b, **diff_summaries(before, after)}


# --------------------------------------------------------------------------
# Model inputs: what every command that runs a model feeds it
#
# One layer for fuse, trace, runtime and impact: the declared inputs of a
# model, --shape NAME=D0,D1,..., --inputs FILE.npz (several for impact), and
# seeded data. Every problem with them is exit 7 naming the file or option,
# never a failure blamed on a healthy model.


class InputSpec:
    """One graph input a run must feed: name, numpy dtype (None when it is not
    a plain numeric tensor) and dims (None for a symbolic or -1 dimension)."""

    def __init__(self, info):
        self.name = info.name
        self.kind = info.type.WhichOneof("value")
        tensor_type = info.type.tensor_type
        self.dtype = None
        self.dims = None
        if self.kind == "tensor_type" and tensor_type.elem_type:
            try:
                self.dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
            except (KeyError, ValueError, TypeError):
                self.dtype = None
            if tensor_type.HasField("shape"):
                # Some exporters write -1 for "any size": symbolic, like dim_param.
                self.dims = [
                    d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor_type.shape.dim
                ]
        self.type_text = (
            dtype_name(tensor_type.elem_type) if self.kind == "tensor_type" else str(self.kind or "untyped")
        )

    @property
    def numeric(self):
        import numpy as np

        return self.dtype is not None and (np.issubdtype(self.dtype, np.number) or np.issubdtype(self.dtype, np.bool_))

    def describe(self):
        dims = "?" if self.dims is None else "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"
        return f"{self.type_text} {dims}"


def value_inputs(graph):
    """The graph inputs that are not initializers: what a run must be fed."""
    initializers = {init.name for init in graph.initializer}
    return [info for info in graph.input if info.name not in initializers]


def input_specs(model):
    return [InputSpec(info) for info in value_inputs(model.graph)]


def parse_shapes(values):
    """``--shape NAME=D0,D1,...`` options as ``{name: [dims]}`` (exit 7 when unreadable)."""
    shapes = {}
    for text in values or ():
        name, sep, dims = text.rpartition("=")
        try:
            parsed = [int(d) for d in dims.split(",")] if dims.strip() else []
        except ValueError:
            parsed = None
        if not sep or not name or parsed is None or any(d < 0 for d in parsed):
            raise GraphscanError(f"--shape {text!r}: expected NAME=D0,D1,... with non-negative integers", EXIT_INPUTS)
        if name in shapes:
            raise GraphscanError(f"--shape: {name!r} given twice", EXIT_INPUTS)
        shapes[name] = parsed
    return shapes


def resolve_shape(spec, shapes, default_size):
    """The concrete shape to generate for ``spec``, and whether a default was used."""
    if spec.name in shapes:
        wanted = shapes[spec.name]
        fits = spec.dims is None or (
            len(wanted) == len(spec.dims) and all(d is None or d == w for d, w in zip(spec.dims, wanted))
        )
        if not fits:
            raise GraphscanError(
                f"--shape {spec.name}={','.join(map(str, wanted))}: the model declares {spec.describe()}",
                EXIT_INPUTS,
            )
        return list(wanted), False
    if spec.dims is None:
        raise GraphscanError(
            f"input {spec.name!r} has no declared shape; give it with --shape or --inputs", EXIT_INPUTS
        )
    defaulted = any(d is None for d in spec.dims)
    return [default_size if d is None else d for d in spec.dims], defaulted


def seeded_feeds(specs, shapes, seed, default_size):
    """Seeded data for every input: normal for floats, small integers otherwise.

    Returns ``(feeds, defaulted)``; ``defaulted`` names the inputs whose
    symbolic dimensions were set to ``default_size`` because nothing said otherwise.
    """
    import numpy as np

    unknown = sorted(set(shapes) - {s.name for s in specs})
    if unknown:
        raise GraphscanError(f"--shape: the model has no input {', '.join(map(repr, unknown))}", EXIT_INPUTS)
    rng = np.random.default_rng(seed)
    feeds, defaulted = {}, []
    for spec in specs:
        if not spec.numeric:
            # --inputs can give a string tensor; a sequence, map or optional nothing can.
            hint = "; give it with --inputs" if spec.dtype is not None else ", and --inputs holds only tensors"
            raise GraphscanError(
                f"input {spec.name!r} is {spec.describe()}: graphscan can only generate numeric tensors{hint}",
                EXIT_INPUTS,
            )
        shape, was_defaulted = resolve_shape(spec, shapes, default_size)
        if was_defaulted:
            defaulted.append(spec.name)
        feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    return feeds, defaulted


# A member whose declared size is above this is refused before it is read.
MAX_INPUT_BYTES = 8 * 1024**3


def read_npz_inputs(path, specs):
    """The arrays ``specs`` need from the .npz at ``path``, each checked against
    its declared dtype and shape before its data is read; other members are
    never read."""
    import zipfile

    check_readable(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise GraphscanError(f"{shown(path)}: not an .npz file ({one_line(exc)})", EXIT_INPUTS)
    with archive:
        members = {}
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                raise GraphscanError(f"{shown(path)}: member {info.filename!r} is not a .npy array", EXIT_INPUTS)
            members[info.filename[: -len(".npy")]] = info
        missing = [s.name for s in specs if s.name not in members]
        if missing:
            raise GraphscanError(f"{shown(path)}: no array for input {', '.join(missing)}", EXIT_INPUTS)
        return {spec.name: read_npy_member(path, archive, members[spec.name], spec) for spec in specs}


NPY_HEADER_READERS = {(1, 0): "read_array_header_1_0", (2, 0): "read_array_header_2_0"}


def read_npy_member(path, archive, info, spec):
    """One member's array, refused before its data is read when it cannot feed ``spec``."""
    import numpy as np

    name = spec.name
    try:
        with archive.open(info) as f:
            version = np.lib.format.read_magic(f)
            read_header = NPY_HEADER_READERS.get(version)
            if read_header is None:
                raise GraphscanError(f"{shown(path)}: array {name!r} has .npy format {version}", EXIT_INPUTS)
            shape, fortran, dtype = getattr(np.lib.format, read_header)(f)
            if dtype.hasobject:
                raise GraphscanError(f"{shown(path)}: array {name!r} holds Python objects", EXIT_INPUTS)
            check_array_fits(path, spec, dtype, shape)
            count = math.prod(shape)
            if count * dtype.itemsize > min(MAX_INPUT_BYTES, info.file_size):
                raise GraphscanError(
                    f"{shown(path)}: array {name!r} declares {count * dtype.itemsize} bytes but the member holds "
                    f"{info.file_size}",
                    EXIT_INPUTS,
                )
            data = f.read(count * dtype.itemsize)
    except GraphscanError:
        raise
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: cannot read array {name!r} ({one_line(exc)})", EXIT_INPUTS)
    if len(data) != count * dtype.itemsize:
        raise GraphscanError(f"{shown(path)}: array {name!r} is truncated", EXIT_INPUTS)
    array = np.frombuffer(data, dtype=dtype)
    order = "F" if fortran else "C"
    # np.require, not np.ascontiguousarray: that one turns a 0-d array into shape [1].
    array = np.require(array.reshape(shape, order=order), requirements="C").astype(dtype.newbyteorder("="), copy=False)
    return array.astype(object) if spec.dtype == np.dtype(object) else array  # onnxruntime's strings


def check_array_fits(path, spec, dtype, shape):
    """Exit 7 unless an array of ``dtype`` and ``shape`` can feed ``spec``."""
    import numpy as np

    # A string input takes a unicode or bytes array (onnxruntime converts it).
    is_text = spec.type_text == "STRING" and np.dtype(dtype).kind in "US"
    if not is_text and (spec.dtype is None or np.dtype(dtype).newbyteorder("=") != np.dtype(spec.dtype)):
        raise GraphscanError(
            f"{shown(path)}: array {spec.name!r} is {np.dtype(dtype).name} {list(shape)}, "
            f"the model wants {spec.describe()}",
            EXIT_INPUTS,
        )
    if spec.dims is not None and (
        len(shape) != len(spec.dims) or any(d is not None and d != s for d, s in zip(spec.dims, shape))
    ):
        raise GraphscanError(
            f"{shown(path)}: array {spec.name!r} has shape {list(shape)}, the model wants {spec.describe()}",
            EXIT_INPUTS,
        )


def model_samples(model, inputs=None, shapes=None, seed=0, default_size=1):
    """The samples a command runs on: ``(list of feeds, defaulted input names)``.

    ``inputs``: a list of .npz paths, one sample each; without any, one seeded
    sample with symbolic dimensions from ``shapes`` (``--shape``) or ``default_size``.
    """
    specs = input_specs(model)
    shapes = shapes or {}
    if inputs:
        if shapes:
            raise GraphscanError("--shape and --inputs: give one or the other", EXIT_INPUTS)
        return [read_npz_inputs(path, specs) for path in inputs], []
    feeds, defaulted = seeded_feeds(specs, shapes, seed, default_size)
    return [feeds], defaulted


def random_inputs(model, seed, symbolic_size):
    """Seeded normal data for every graph input, symbolic dims set to ``symbolic_size``."""
    return seeded_feeds(input_specs(model), {}, seed, symbolic_size)[0]


def check_same_inputs(float_model, quant_model, a, b):
    """Exit 7 unless both models declare the same inputs (names, types, fixed dims)."""
    specs = [{s.name: s for s in input_specs(m)} for m in (float_model, quant_model)]
    if sorted(specs[0]) != sorted(specs[1]):
        raise GraphscanError(
            f"{shown(a)} and {shown(b)}: the models' inputs differ "
            f"({', '.join(sorted(specs[0]))} vs {', '.join(sorted(specs[1]))})",
            EXIT_INPUTS,
        )
    for name, first in specs[0].items():
        second = specs[1][name]
        same_rank = first.dims is None or second.dims is None or len(first.dims) == len(second.dims)
        dims_agree = same_rank and all(
            x is None or y is None or x == y for x, y in zip(first.dims or (), second.dims or ())
        )
        if first.type_text != second.type_text or not dims_agree:
            raise GraphscanError(
                f"{shown(a)} and {shown(b)}: input {name!r} is {first.describe()} in one "
                f"and {second.describe()} in the other",
                EXIT_INPUTS,
            )


# --------------------------------------------------------------------------
# fuse: MatMul + Add -> Gemm, verified with onnxruntime before anything is written

FUSE_RELATIVE_TOLERANCE = 1e-5
FUSE_SEED = 0
SYMBOLIC_DIM_SIZE = 2  # size given to symbolic dimensions of verification inputs

SKIP_OUTPUT_SHARED = "output used elsewhere or a graph output"
SKIP_C_NOT_INITIALIZER = "the Add's other input is not an initializer"
SKIP_A_NOT_RANK_2 = "A is not rank 2"
SKIP_B_NOT_2D = "B is not a 2-D initializer"
SKIP_C_NOT_BROADCAST = "C does not broadcast to (M, N)"
SKIP_TYPE = "Gemm runs only FLOAT, FLOAT16 or DOUBLE"
# The types onnx's Gemm accepts in every opset and onnxruntime's CPU Gemm runs
# (it has no integer kernel, although Gemm-9 and later declare int32/int64).
GEMM_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE}


def static_shapes(model):
    """``{tensor: [dim_value or None, ...]}`` for every tensor whose rank is known."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    shapes = {}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def broadcasts_to(c_shape, m, n):
    """Whether C of ``c_shape`` unidirectionally broadcasts to (m, n); m may be unknown."""
    if len(c_shape) > 2:
        return False
    return all(dim == 1 or (target is not None and dim == target) for dim, target in zip(reversed(c_shape), (n, m)))


def gemm_plan(index, model, shapes, initializer_types, graph_outputs, matmul):
    """``(add_index, c_name, None)`` if MatMul ``matmul`` can fuse, else ``(None, None, reason)``."""
    node = model.graph.node[matmul]
    product = node.output[0]
    consumers = index.consumers_of(product)
    if len(consumers) != 1 or index.op_types[consumers[0]] != "Add" or product in graph_outputs:
        return None, None, SKIP_OUTPUT_SHARED
    add = consumers[0]
    others = [t for t in model.graph.node[add].input if t != product]
    if len(others) != 1 or others[0] not in index.initializers:
        return None, None, SKIP_C_NOT_INITIALIZER
    a_shape = shapes.get(node.input[0])
    if a_shape is None or len(a_shape) != 2:
        return None, None, SKIP_A_NOT_RANK_2
    b_name = node.input[1]
    if b_name not in index.initializers or len(shapes[b_name]) != 2:
        return None, None, SKIP_B_NOT_2D
    if not broadcasts_to(shapes[others[0]], a_shape[0], shapes[b_name][1]):
        return None, None, SKIP_C_NOT_BROADCAST
    if initializer_types[b_name] not in GEMM_TYPES:
        return None, None, SKIP_TYPE
    return add, others[0], None


def unique_name(wanted, taken):
    name, n = wanted, 1
    while name in taken:
        name, n = f"{wanted}_{n}", n + 1
    taken.add(name)
    return name


def fuse_matmul_add(model):
    """A copy of ``model`` with every legal MatMul+Add replaced by one Gemm.

    Returns ``(fused_model, fused, skipped)`` as the ``fuse`` answer lists them.
    The Gemm takes the Add's place and output name, so downstream is untouched.
    """
    index = GraphIndex(model.graph)
    shapes = static_shapes(model)
    initializer_types = {init.name: init.data_type for init in model.graph.initializer}
    taken = set(index.names)
    graph_outputs = {output.name for output in model.graph.output}
    replace, drop, fused, skipped = {}, set(), [], []
    for i, op_type in enumerate(index.op_types):
        if op_type != "MatMul":
            continue
        add, c_name, reason = gemm_plan(index, model, shapes, initializer_types, graph_outputs, i)
        if reason:
            skipped.append({"node": index.names[i], "reason": reason})
            continue
        matmul = model.graph.node[i]
        gemm_name = unique_name(f"{index.names[i]}_gemm", taken)
        replace[add] = onnx.helper.make_node(
            "Gemm",
            [matmul.input[0], matmul.input[1], c_name],
            [model.graph.node[add].output[0]],
            name=gemm_name,
        )
        drop.add(i)
        fused.append({"matmul": index.names[i], "add": index.names[add], "gemm": gemm_name})
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    for i, node in enumerate(model.graph.node):
        if i not in drop:
            out.graph.node.append(replace.get(i, node))
    dropped_tensors = {model.graph.node[i].output[0] for i in drop}
    kept_info = [v for v in model.graph.value_info if v.name not in dropped_tensors]
    del out.graph.value_info[:]
    out.graph.value_info.extend(kept_info)
    return out, fused, skipped


def run_model(model, feeds, path):
    """All graph outputs of ``model`` on ``feeds``, with ORT's own fusions off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4  # errors are reported in our one line, not ORT's log
    run_options = ort.RunOptions()
    run_options.log_severity_level = 4
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run(None, feeds, run_options)
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: model does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME)


def compare_outputs(expected, actual):
    """How far ``actual`` is from ``expected`` (two lists of onnxruntime outputs).

    Returns ``(max_abs_error, scale, compared, problem)``. Floats: NaN and
    +-Inf must sit at the same places with the same value, then the largest
    |expected - actual| and |expected| are taken over the finite values only.
    Everything else (integers, booleans, strings, sequences, optionals, maps)
    must be equal. ``compared``: how many values were compared this way;
    ``problem``: the first difference that no tolerance excuses, or None.
    """
    import numpy as np

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


def load_with_weights(path):
    """The model with its weights, external data read by onnx's checked loader."""
    model = load_model(path, weights=True)
    from onnx import external_data_helper

    if any(external_data_helper.uses_external_data(t) for t in model.graph.initializer):
        try:
            external_data_helper.load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
        except Exception as exc:
            raise GraphscanError(f"{shown(path)}: cannot load external data ({one_line(exc)})", EXIT_NOT_ONNX)
    return model


ORT_OLDEST_OPSET = 7  # onnxruntime has no kernel for older default-domain opsets


def check_original(model, path):
    """Exit 4 unless the model to fuse passes the checker itself: a broken original
    (a cycle, two producers of a tensor, an opset that does not exist) is the
    input's fault, not the fusion's."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: not a valid ONNX model ({one_line(exc)})", EXIT_NOT_ONNX)
    # The checker passes default-domain opsets that do not exist (above onnx's
    # newest) and ones older than any onnxruntime runs.
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and not ORT_OLDEST_OPSET <= opset.version <= onnx.defs.onnx_opset_version():
            raise GraphscanError(
                f"{shown(path)}: opset {opset.version} of the default domain: onnx defines up to "
                f"{onnx.defs.onnx_opset_version()} and onnxruntime runs {ORT_OLDEST_OPSET} and newer",
                EXIT_NOT_ONNX,
            )


def fuse(path, output, inputs=None, shape=None, seed=FUSE_SEED):
    """Fuse MatMul+Add into Gemm, verify with onnxruntime, then write ``output``.

    The verification sample is ``inputs`` (an .npz) or seeded data whose
    symbolic dimensions come from ``shape`` (``--shape NAME=D0,...``) or are 2.
    """
    model = load_with_weights(path)
    check_original(model, path)
    check_output_path(os.path.realpath(output) if os.path.islink(output) else output)
    fused_model, fused, skipped = fuse_matmul_add(model)
    try:
        onnx.checker.check_model(fused_model, full_check=True)
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: fused model fails the checker ({one_line(exc)})", EXIT_MISMATCH)
    samples, _ = model_samples(model, [inputs] if inputs else None, parse_shapes(shape), seed, SYMBOLIC_DIM_SIZE)
    feeds = samples[0]
    expected = run_model(model, feeds, path)
    actual = run_model(fused_model, feeds, f"the fused model of {shown(path)}")
    error, scale, compared, problem = compare_outputs(expected, actual)
    if problem is None and not compared and any(np_size(e) for e in expected):
        raise GraphscanError(
            f"{shown(path)}: cannot verify the fused model: the original's outputs are all NaN or "
            f"infinite on this input (give others with --inputs); nothing written",
            EXIT_MISMATCH,
        )
    if problem is None and error > FUSE_RELATIVE_TOLERANCE * max(scale, 1.0):
        problem = f"by {error:.3g} (allowed {FUSE_RELATIVE_TOLERANCE:g} relative)"
    if problem is not None:
        raise GraphscanError(
            f"{shown(path)}: fused model differs from the original {problem}; nothing written", EXIT_MISMATCH
        )
    write_atomically(fused_model.SerializeToString(), output)
    return {
        "model": path,
        "output": output,
        "fused": fused,
        "skipped": skipped,
        "max_abs_error": error,
    }


def np_size(value):
    """How many values an onnxruntime output holds (0 for an absent optional)."""
    import numpy as np

    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(np_size(v) for v in value)
    if isinstance(value, dict):
        return len(value)
    return np.asarray(value).size


# --------------------------------------------------------------------------
# trace: the operator where a quantized model's error is born
#
# graphscan's combined model holds the quantized model, the float model (its
# tensors renamed under FLOAT_PREFIX), every operator's single-op model reading
# the float references, and the statistics of every row. Its nodes are ordered
# so the two models advance together and each row is measured as soon as its
# tensors exist; onnxruntime frees a tensor after its last reader. It runs in
# sessions of at most TRACE_SEGMENT_NODES nodes, so neither the tensors held nor
# the sessions grow with the number of operators. No session per operator.

TRACE_TOLERANCE = 1e-2
TRACE_SYMBOLIC_DIM_SIZE = 1
# A comparison whose tensors have at most TRACE_FETCH_ELEMENTS elements each is
# fetched and measured in numpy (np.linalg.norm, as trace always did), while
# the fetched bytes stay under TRACE_FETCH_BUDGET; every other one is reduced to
# scalars inside the graph, in float64. The maxima and counts are exact either
# way; a sum of squares may differ from numpy's in the last digit.
TRACE_FETCH_ELEMENTS = 2**16
TRACE_FETCH_BUDGET = 16 * 2**20
# A tensor reduced in the graph is cut into flat slices of this many elements.
TRACE_CHUNK_ELEMENTS = 2**19
# graphscan's combined model runs in sessions of at most this many nodes.
TRACE_SEGMENT_NODES = 5000
QDQ_SUFFIX = re.compile(r"_(?:QuantizeLinear_Input|QuantizeLinear_Output|DequantizeLinear_Output)(?:_\d+)?$")
ROW_PREFIX = "graphscan.row{}/"  # tensors of row k's single-op model inside the combined graph
FLOAT_PREFIX = "graphscan.float/"  # the float model's tensors inside the combined graph
STATS_PREFIX = "graphscan.stats/"  # the statistics graphscan adds
ROW_NODE = re.compile(r"graphscan\.row(\d+)/")
# How onnxruntime and numpy say that an allocation failed.
OUT_OF_MEMORY = re.compile(r"bad_alloc|bad allocation|failed to allocate|out of memory|cannot allocate", re.I)
# Representable range of each integer type a QuantizeLinear can produce.
Q_RANGES = {
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT16: (-32768, 32767),
    onnx.TensorProto.UINT16: (0, 65535),
    onnx.TensorProto.INT4: (-8, 7),
    onnx.TensorProto.UINT4: (0, 15),
}


def value_names(graph):
    """Graph inputs that are not initializers, and every node output."""
    names = {info.name for info in value_inputs(graph)}
    names.update(t for node in graph.node for t in node.output if t)
    return names


def inferred_types(model, feeds):
    """``{tensor: TypeProto}`` from onnx shape inference with the graph inputs set
    to the shapes fed. Big initializers enter as typed inputs, so their payloads
    are never copied; a model inference cannot handle gives what it declares."""
    graph = model.graph
    shell = onnx.ModelProto(ir_version=model.ir_version)
    shell.opset_import.extend(model.opset_import)
    shell.functions.extend(model.functions)
    body = shell.graph
    body.node.extend(graph.node)
    initializers = {init.name for init in graph.initializer}
    for info in graph.input:
        if info.name in initializers:
            continue
        copy = body.input.add()
        copy.CopyFrom(info)
        array = feeds.get(info.name)
        if copy.type.HasField("tensor_type") and hasattr(array, "shape"):
            copy.type.tensor_type.shape.Clear()
            copy.type.tensor_type.shape.SetInParent()
            for size in array.shape:
                copy.type.tensor_type.shape.dim.add().dim_value = size
    for init in graph.initializer:
        if math.prod(init.dims) <= 64:  # small: shape inputs whose values inference reads
            body.initializer.append(init)
        else:
            body.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    body.output.extend(graph.output)
    body.value_info.extend(graph.value_info)
    with contextlib.suppress(Exception):  # else what the model declares is all there is
        body = onnx.shape_inference.infer_shapes(shell, strict_mode=False, data_prop=True).graph
    infos = itertools.chain(body.input, body.value_info, body.output)
    return {info.name: info.type for info in infos if info.type.WhichOneof("value")}


def tensor_dims(type_proto):
    """A tensor type's dims (None where unknown), or None without a shape."""
    if type_proto is None or type_proto.WhichOneof("value") != "tensor_type":
        return None
    tensor_type = type_proto.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    # A dim_param leaves dim_value 0: a size-0 dimension counts as unknown too.
    return [d.dim_value if d.dim_value > 0 else None for d in tensor_type.shape.dim]


def shapes_agree(first, second):
    """True when two types' shapes are known and equal, False when known to differ, else None."""
    a, b = tensor_dims(first), tensor_dims(second)
    if a is None or b is None:
        return None
    if len(a) != len(b) or any(x is not None and y is not None and x != y for x, y in zip(a, b)):
        return False
    return True if None not in a and None not in b else None


NOT_TENSOR_KINDS = {
    "sequence_type": "a sequence",
    "optional_type": "an optional",
    "map_type": "a map",
    "sparse_tensor_type": "a sparse tensor",
    "opaque_type": "an opaque value",
}


def type_problem(type_proto):
    """Why a tensor of this type cannot be compared (None: it can, or its type is unknown)."""
    if type_proto is None:
        return None
    kind = type_proto.WhichOneof("value")
    if kind is None:
        return None
    if kind != "tensor_type":
        return NOT_TENSOR_KINDS.get(kind, kind)
    if type_proto.tensor_type.elem_type == onnx.TensorProto.STRING:
        return "a string tensor"
    return None


def comparable_dtype(type_proto):
    """Whether a tensor of this type is measured (numbers; unknown types are tried)."""
    if type_proto is None or not type_proto.tensor_type.elem_type:
        return type_problem(type_proto) is None
    elem_type = type_proto.tensor_type.elem_type
    return elem_type not in (onnx.TensorProto.STRING, onnx.TensorProto.BOOL)


def tensor_bytes(type_proto):
    """Bytes of a tensor whose type and dims are all known, else None."""
    dims = tensor_dims(type_proto)
    if dims is None or None in dims:
        return None
    itemsize = item_size(type_proto.tensor_type.elem_type)
    return None if itemsize is None else (math.prod(dims), math.prod(dims) * itemsize)


@functools.cache
def item_size(elem_type):
    """Bytes per element of an ONNX tensor type, None when unknown."""
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize if elem_type else None
    except (KeyError, ValueError, TypeError):
        return None


class ReferenceMatcher:
    """Finds the float tensor a quantized-model tensor should be compared with.

    Like the quantized side, the float side is taken as the next op sees it:
    after its own Q->DQ, if the "float" model has one (comparing two
    quantized models, or a model with itself, then gives zeros where equal).
    """

    def __init__(self, float_graph, types=None):
        self.graph = float_graph
        self.types = types or {}
        self.index = GraphIndex(float_graph)
        self.tensors = value_names(float_graph)
        self.by_node = {}
        for i, node in enumerate(float_graph.node):
            for k, tensor in enumerate(node.output):
                if tensor:
                    self.by_node[(self.index.names[i], k)] = tensor

    def reference(self, tensor, producer_name=None, output_index=None, want=None):
        """Same name without ORT's QDQ suffixes, else the same node's same output.

        A candidate whose shape is known to differ from ``want`` (the quantized
        tensor's type) is passed over: a name reused with another meaning.
        """
        stripped = QDQ_SUFFIX.sub("", tensor)
        candidates = [stripped] if stripped in self.tensors else []
        candidates.append(self.by_node.get((producer_name, output_index)))
        for candidate in candidates:
            if candidate is not None and shapes_agree(self.types.get(candidate), want) is not False:
                return output_chain(self.index, self.graph, candidate)[1]
        return None


def has_subgraph(node):
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def subgraphs(node):
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def first_output(node):
    """The first output a node writes ("" when it writes none): optional ones may be left out."""
    return next((t for t in node.output if t), "")


class OpModel:
    """The single-op model of one operator of the quantized model.

    ``nodes`` are indices into the quantized graph: each input's own Q->DQ
    chain (or weight DQ), the operator, and its output Q->DQ if any.
    ``feeds`` maps each model input (a quantized-model tensor name) to the
    float reference fed in (``None``: the quantized model's own value, used
    only when no reference exists). ``output`` is what the next op sees.
    ``weight_nodes`` are the chains that start at an initializer: their value
    is the quantized model's own, so the combined graph reuses it.
    """

    def __init__(self, index, graph, i, matcher, initializer_protos, types, out_chain):
        self.index, self.graph, self.row = index, graph, i
        chain, self.weight_nodes = [], set()
        for tensor in index.inputs[i]:
            source, links = data_source(index, graph, tensor)
            if links and source in index.initializers:
                self.weight_nodes.update(links)
            chain += [j for j in links if j not in chain]
        out_chain, self.output = out_chain
        self.nodes = chain + [i] + out_chain
        produced = {t for j in self.nodes for t in index.outputs[j]}
        self.initializers, self.feeds = [], {}
        for j in self.nodes:
            for tensor in index.inputs[j]:
                if tensor in produced or tensor in self.feeds or tensor in self.initializers:
                    continue
                if tensor in index.initializers:
                    self.initializers.append(tensor)
                else:
                    self.feeds[tensor] = tensor_reference(index, matcher, tensor, types)
        self.output_scale = output_scale(graph, out_chain, initializer_protos)

    def node_protos(self, rename=None, name_prefix="", skip=()):
        """Copies of the model's nodes but ``skip``, every tensor passed through ``rename``."""
        rename = rename or (lambda t: t)
        protos = []
        for j in self.nodes:
            if j in skip:
                continue
            node = onnx.NodeProto()
            node.CopyFrom(self.graph.node[j])
            node.name = name_prefix + self.index.names[j]
            node.input[:] = [rename(t) if t else t for t in node.input]
            node.output[:] = [rename(t) if t else t for t in node.output]
            protos.append(node)
        return protos


def input_chain(index, graph, tensor):
    """Indices of the Q/DQ nodes between ``tensor`` and its data source, source first."""
    chain = []
    producer = index.producer_of(tensor)
    while producer is not None and not index.is_compute(producer) and producer not in chain:
        chain.append(producer)
        producer = index.producer_of(graph.node[producer].input[0])
    return chain[::-1]


def data_source(index, graph, tensor):
    """``(source tensor, Q/DQ chain)``: where ``tensor``'s data comes from once
    every Q/DQ in front of it is skipped (a compute output, a graph input or an
    initializer), and the Q/DQ nodes skipped, source first."""
    chain = input_chain(index, graph, tensor)
    return (graph.node[chain[0]].input[0] if chain else tensor), chain


def output_chain(index, graph, tensor):
    """The Q->DQ pair right after ``tensor`` and the tensor the next op sees."""
    for q in index.consumers_of(tensor):
        if index.is_q[q]:
            for dq in index.consumers_of(graph.node[q].output[0]):
                if index.is_dq[dq]:
                    return [q, dq], graph.node[dq].output[0]
    return [], tensor


class InitializerTable(dict):
    """Initializers by name; each one-element value is read once (every Q and DQ asks)."""

    def __init__(self, graph):
        super().__init__((init.name, init) for init in graph.initializer)
        self.scalars = {}

    def scalar(self, name):
        if name not in self.scalars:
            init = self.get(name)
            values = None if init is None or math.prod(init.dims) != 1 else onnx.numpy_helper.to_array(init)
            self.scalars[name] = None if values is None else (values.reshape(-1)[0], init.data_type)
        return self.scalars[name]


def scalar_initializer(initializer_protos, name):
    """``(value, data_type)`` of a one-element initializer, else None."""
    return initializer_protos.scalar(name)


def output_scale(graph, out_chain, initializer_protos):
    """The output Q's scale as a float, when it is a scalar initializer."""
    if not out_chain:
        return None
    scale = scalar_initializer(initializer_protos, graph.node[out_chain[0]].input[1])
    return None if scale is None else float(scale[0])


def clip_range(graph, q_node, initializer_protos):
    """``(lo, hi)``: what a per-tensor Q represents, ``(qmin - zp) * s`` to
    ``(qmax - zp) * s``; None for a per-channel or non-integer Q."""
    node = graph.node[q_node]
    scale = scalar_initializer(initializer_protos, node.input[1])
    if scale is None:
        return None
    if len(node.input) > 2 and node.input[2]:
        zero_point = scalar_initializer(initializer_protos, node.input[2])
        if zero_point is None:
            return None
        zero, data_type = int(zero_point[0]), zero_point[1]
    else:
        declared = [a.i for a in node.attribute if a.name == "output_dtype" and a.i]
        zero, data_type = 0, (declared[0] if declared else onnx.TensorProto.UINT8)
    if data_type not in Q_RANGES:
        return None
    qmin, qmax = Q_RANGES[data_type]
    s = float(scale[0])
    return (qmin - zero) * s, (qmax - zero) * s


def tensor_reference(index, matcher, tensor, types=None):
    want = (types or {}).get(tensor)
    producer = index.producer_of(tensor)
    if producer is None:
        return matcher.reference(tensor, want=want)
    return matcher.reference(tensor, index.names[producer], index.outputs[producer].index(tensor), want)


def value_info_of(name, array):
    elem_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    return onnx.helper.make_tensor_value_info(name, elem_type, list(array.shape))


def error_stats(reference, value):
    """(max |ref - value|, SQNR in dB) or Nones when they cannot be compared."""
    import numpy as np

    if not (isinstance(reference, np.ndarray) and isinstance(value, np.ndarray)):
        return None, None
    if reference.shape != value.shape:
        return None, None
    if not (np.issubdtype(reference.dtype, np.number) and np.issubdtype(value.dtype, np.number)):
        return None, None
    ref = reference.astype(np.float64)
    difference = ref - value
    noise = float(np.linalg.norm(difference))
    signal = float(np.linalg.norm(ref))
    max_abs = float(np.max(np.abs(difference), initial=0.0))
    return max_abs, sqnr_db(signal, noise)


def sqnr_db(signal, noise):
    return 20.0 * math.log10(signal / noise) if noise > 0 and signal > 0 else None


# --------------------------------------------------------------------------
# trace: graphscan's combined model


def rename_graph(graph, rename, node_prefix):
    """Rename every tensor of ``graph`` and of its subgraphs in place."""
    for node in graph.node:
        if node.name:
            node.name = node_prefix + node.name
        node.input[:] = [rename(t) if t else t for t in node.input]
        node.output[:] = [rename(t) if t else t for t in node.output]
        for body in subgraphs(node):
            rename_graph(body, rename, node_prefix)
    for info in itertools.chain(graph.input, graph.output, graph.value_info):
        info.name = rename(info.name)
    for init in graph.initializer:
        init.name = rename(init.name)
    for sparse in graph.sparse_initializer:
        sparse.values.name = rename(sparse.values.name)


def node_reads(node):
    """Every tensor name ``node`` reads: its inputs, then its bodies' reads at any
    depth (their outer-scope reads among them, and a body output may name an
    outer value too)."""
    names = [t for t in node.input if t]
    if not len(node.attribute):
        return names
    for body in subgraphs(node):
        for inner in body.node:
            names.extend(node_reads(inner))
        names.extend(o.name for o in body.output)
    return names


def schedule(entries):
    """``entries`` (rank, graph, k, reads or None) for node ``graph.node[k]``, as ``(graph, k, reads, writes)``
    in an order that runs each node after its inputs, the ready node of lowest
    rank first (ties: as listed). onnxruntime's PRIORITY_BASED order then runs
    them exactly so."""
    import heapq

    producers, reads, writes = {}, [], []
    for e, (_, graph, k, known) in enumerate(entries):
        node = graph.node[k]
        reads.append(node_reads(node) if known is None else known)
        writes.append([t for t in node.output if t])
        for t in writes[-1]:
            producers[t] = e
    waiting, readers = [0] * len(entries), [[] for _ in entries]
    for e in range(len(entries)):
        needed = {producers[t] for t in reads[e] if t in producers} - {e}
        waiting[e] = len(needed)
        for producer in needed:
            readers[producer].append(e)
    ready = [(entry[0], e) for e, entry in enumerate(entries) if not waiting[e]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, e = heapq.heappop(ready)
        order.append(e)
        for reader in readers[e]:
            waiting[reader] -= 1
            if not waiting[reader]:
                heapq.heappush(ready, (entries[reader][0], reader))
    placed = set(order)
    order += [e for e in range(len(entries)) if e not in placed]  # a cycle: onnxruntime says so
    return [(entries[e][1], entries[e][2], reads[e], writes[e]) for e in order]


class Comparison:
    """max |reference - value| (and, with ``signal``, the SQNR) of two tensors of
    the combined model: fetched and measured in numpy, or reduced in the graph."""

    def __init__(self, reference, value, signal=False):
        self.reference, self.value, self.signal = reference, value, signal
        self.scalars = None  # names of the in-graph results when reduced

    def result(self, values):
        """``(max_abs, sqnr_db)`` from the session's results ``values``."""
        if self.scalars is None:
            return error_stats(values.get(self.reference), values.get(self.value))
        if "shapes" in self.scalars:
            first, second = (values[n] for n in self.scalars["shapes"])
            if list(first) != list(second):
                return None, None
        noise_squared = float(values[self.scalars["noise"]])
        if math.isnan(noise_squared):
            return math.nan, None  # numpy's max keeps a NaN; ReduceMax need not
        largest = float(values[self.scalars["max"]])
        max_abs = largest if largest > 0 else 0.0  # an empty tensor: numpy's initial=0.0
        if not self.signal:
            return max_abs, None
        return max_abs, sqnr_db(math.sqrt(float(values[self.scalars["signal"]])), math.sqrt(noise_squared))


class ClipCount:
    """Fraction of a tensor's values outside ``[lo, hi]``: counted in numpy or in the graph."""

    def __init__(self, tensor, lo, hi):
        self.tensor, self.lo, self.hi = tensor, lo, hi
        self.scalars = None

    def result(self, values):
        import numpy as np

        if self.scalars is None:
            array = values.get(self.tensor)
            if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.number):
                return None
            wide = array.astype(np.float64)
            count, size = int(np.count_nonzero((wide < self.lo) | (wide > self.hi))), array.size
        else:
            count, size = (int(values[n]) if isinstance(n, str) else n for n in self.scalars)
        return count / size if size else None


class CombinedModel:
    """Builds graphscan's combined model and says what to fetch from it.

    Quantized nodes keep their names; the float model's tensors and nodes are
    renamed under FLOAT_PREFIX (the fed inputs are shared); row k's single-op
    model lives under ``ROW_PREFIX.format(k)``; statistics under STATS_PREFIX.
    """

    def __init__(self, float_model, quant_model, feeds, float_types, quant_types):
        self.float_model, self.quant_model, self.feeds = float_model, quant_model, feeds
        # Nodes are kept inside GraphProtos (the models' own, graphscan's pool),
        # never as one Python object each: 100,000 rows cost megabytes.
        self.pool = onnx.GraphProto()
        self.float_graph = None
        self.entries = [(rank, quant_model.graph, rank, None) for rank in range(len(quant_model.graph.node))]
        self.fetch, self.fetch_set = [], set()
        self.fetch_rank = {}  # fetched float tensor -> lowest rank of a row that fetches it
        self.budget = TRACE_FETCH_BUDGET
        self.reduced = False  # whether any measurement is reduced in the graph
        self.count = 0
        self.types = dict(quant_types)
        self.types.update((self.float_name(t), info) for t, info in float_types.items())
        self.end = len(quant_model.graph.node)

    def float_name(self, tensor):
        return tensor if tensor in self.feeds else FLOAT_PREFIX + tensor

    def fetched(self, rank, names):
        for name in names:
            if name not in self.fetch_set and name not in self.feeds:
                self.fetch.append(name)
                self.fetch_set.add(name)
            self.fetch_rank[name] = min(rank, self.fetch_rank.get(name, rank))

    def fits(self, names):
        """Whether ``names`` can be fetched: each small and of known size, all
        within what is left of the budget (then charged to it)."""
        new = list(dict.fromkeys(n for n in names if n not in self.fetch_set and n not in self.feeds))
        sizes = [tensor_bytes(self.types.get(n)) for n in new]
        if any(size is None or size[0] > TRACE_FETCH_ELEMENTS for size in sizes):
            return False
        cost = sum(size[1] for size in sizes)
        if cost > self.budget:
            return False
        self.budget -= cost
        return True

    def add_node(self, rank, op_type, inputs, **attributes):
        self.count += 1
        output = f"{STATS_PREFIX}{op_type}_{self.count}"
        self.add_nodes(rank, [onnx.helper.make_node(op_type, inputs, [output], name=output, **attributes)])
        return output

    def add_nodes(self, rank, nodes):
        for node in nodes:
            self.pool.node.append(node)
            self.entries.append((rank, self.pool, len(self.pool.node) - 1, node_reads(node)))

    def add_constant(self, array):
        import numpy as np

        self.count += 1
        name = f"{STATS_PREFIX}constant_{self.count}"
        self.pool.initializer.append(onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def as_double(self, rank, tensor):
        return self.add_node(rank, "Cast", [tensor], to=onnx.TensorProto.DOUBLE)

    def compare(self, rank, reference, value, signal=False, fetch=False):
        """A Comparison of two tensors (fetched when ``fetch``, else reduced in
        the graph), or None when their types rule it out."""
        first, second = self.types.get(reference), self.types.get(value)
        if not (comparable_dtype(first) and comparable_dtype(second)) or shapes_agree(first, second) is False:
            return None
        comparison = Comparison(reference, value, signal)
        if fetch:
            self.fetched(rank, [reference, value])
            return comparison
        scalars, agree = {}, shapes_agree(first, second)
        if agree is None:
            # Shapes only known at run time: compare flat prefixes of one
            # length (each cut to the other's size), so the Sub always runs,
            # and fetch both shapes.
            flat, one, start = self.add_constant([-1]), self.add_constant([1]), self.add_constant([0])
            ref, val = self.add_node(rank, "Reshape", [reference, flat]), self.add_node(rank, "Reshape", [value, flat])
            ref_size = self.add_node(rank, "Reshape", [self.add_node(rank, "Size", [ref]), one])
            val_size = self.add_node(rank, "Reshape", [self.add_node(rank, "Size", [val]), one])
            pieces = [
                (
                    self.add_node(rank, "Slice", [ref, start, val_size]),
                    self.add_node(rank, "Slice", [val, start, ref_size]),
                )
            ]
            scalars["shapes"] = [self.add_node(rank, "Shape", [reference]), self.add_node(rank, "Shape", [value])]
        else:
            pieces = self.chunks(rank, [reference, value], math.prod(tensor_dims(first)))
        maxima, noises, signals = [], [], []
        for ref_piece, val_piece in pieces:
            ref, val = self.as_double(rank, ref_piece), self.as_double(rank, val_piece)
            difference = self.add_node(rank, "Sub", [ref, val])
            maxima.append(self.add_node(rank, "ReduceMax", [self.add_node(rank, "Abs", [difference])], keepdims=0))
            noises.append(self.add_node(rank, "ReduceSumSquare", [difference], keepdims=0))
            if signal:
                signals.append(self.add_node(rank, "ReduceSumSquare", [ref], keepdims=0))
        scalars["max"] = self.combine(rank, "Max", maxima)
        scalars["noise"] = self.combine(rank, "Sum", noises)
        if signal:
            scalars["signal"] = self.combine(rank, "Sum", signals)
        comparison.scalars = scalars
        self.reduced = True
        self.fetched(rank, [n for group in scalars.values() for n in ([group] if isinstance(group, str) else group)])
        return comparison

    def chunks(self, rank, tensors, elements):
        """Yield ``tensors`` (of ``elements`` values each) as tuples of flat slices
        of at most TRACE_CHUNK_ELEMENTS, each slice's nodes made as it is asked
        for, so each slice is measured and freed before the next is cut."""
        if elements <= TRACE_CHUNK_ELEMENTS:
            yield tuple(tensors)
            return
        flat = self.add_constant([-1])
        flats = [self.add_node(rank, "Reshape", [t, flat]) for t in tensors]
        for begin in range(0, elements, TRACE_CHUNK_ELEMENTS):
            starts, ends = self.add_constant([begin]), self.add_constant([begin + TRACE_CHUNK_ELEMENTS])
            yield tuple(self.add_node(rank, "Slice", [t, starts, ends]) for t in flats)

    def combine(self, rank, op_type, scalars):
        return scalars[0] if len(scalars) == 1 else self.add_node(rank, op_type, scalars)

    def clip_count(self, rank, tensor, lo, hi, fetch):
        """A ClipCount of ``tensor``; counted in numpy when ``fetch`` (its row is fetched)."""
        import numpy as np

        count = ClipCount(tensor, lo, hi)
        type_proto = self.types.get(tensor)
        if not comparable_dtype(type_proto):
            return None
        if fetch:
            self.fetched(rank, [tensor])
            return count
        if type_proto is not None and type_proto.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            # For a float32 t, t < lo exactly when t < the least float32 >= lo
            # (and t > hi when t > the largest float32 <= hi): no float64 copy.
            low, high = np.float32(lo), np.float32(hi)
            low = np.nextafter(low, np.float32(np.inf)) if low < lo else low
            high = np.nextafter(high, np.float32(-np.inf)) if high > hi else high
            values, bounds = tensor, (np.float32(low), np.float32(high))
        else:
            values, bounds = self.as_double(rank, tensor), (np.float64(lo), np.float64(hi))
        outside = self.add_node(
            rank,
            "Or",
            [
                self.add_node(rank, "Less", [values, self.add_constant(bounds[0])]),
                self.add_node(rank, "Greater", [values, self.add_constant(bounds[1])]),
            ],
        )
        elements = tensor_bytes(type_proto)
        wide = elements is None or elements[0] >= 2**31
        flags = self.add_node(rank, "Cast", [outside], to=onnx.TensorProto.INT64 if wide else onnx.TensorProto.INT32)
        total = self.add_node(rank, "ReduceSum", [flags], keepdims=0)
        count.scalars = [total, elements[0] if elements else self.add_node(rank, "Size", [tensor])]
        self.reduced = True
        self.fetched(rank, [n for n in count.scalars if isinstance(n, str)])
        return count

    def add_row(self, k, row, quant_index, save):
        """Row ``k``'s single-op model and measurements: ``(isolated, propagated,
        clip, single-op output)``, each None where it does not apply. A row's
        tensors are all fetched (``save`` fetches every row) or all reduced."""
        rank = row.i
        reference = self.float_name(row.reference) if row.reference is not None else None
        isolated = propagated = clip = op_output = None
        fed = {}
        if row.op is not None:
            prefix = ROW_PREFIX.format(k)
            fed = {t: (self.float_name(r) if r is not None else t) for t, r in row.op.feeds.items()}
            # Initializers and dequantized weights are the quantized model's own tensors.
            keep = set(row.op.initializers)
            keep.update(t for j in row.op.weight_nodes for t in quant_index.outputs[j])

            def rename(tensor):
                return fed.get(tensor) or (tensor if tensor in keep else prefix + tensor)

            self.add_nodes(rank, row.op.node_protos(rename, prefix, skip=row.op.weight_nodes))
            op_output = rename(row.op.output)
            self.types.setdefault(op_output, self.types.get(row.op.output))
        needed = [reference, op_output, row.seen] if reference is not None else []
        needed += [row.output] if row.clip is not None else []
        fetch = (save and row.op is not None) or self.fits([n for n in needed if n])
        if reference is not None:
            if op_output is not None:
                isolated = self.compare(rank, reference, op_output, fetch=fetch)
            if row.seen:
                # Ranked after what makes the value, so the reference waits for it.
                seen_rank = max(rank, quant_index.producer.get(row.seen, rank))
                propagated = self.compare(seen_rank, reference, row.seen, signal=True, fetch=fetch)
        if row.clip is not None:
            clip = self.clip_count(rank, row.output, *row.clip, fetch=fetch)
        if save and row.op is not None:
            self.fetched(rank, fed.values())
        return isolated, propagated, clip, op_output

    def add_float_model(self):
        """The float graph, renamed, each node ranked by the first row that needs it;
        nodes no row needs are left out."""
        graph = onnx.GraphProto()
        graph.CopyFrom(self.float_model.graph)
        rename_graph(graph, self.float_name, FLOAT_PREFIX)
        wanted = {}  # float tensor -> lowest rank of a reader
        for rank, source, _, reads in self.entries:
            if source is not self.pool:
                continue  # only graphscan's own nodes read float tensors
            for tensor in reads:
                if tensor.startswith(FLOAT_PREFIX):
                    wanted[tensor] = min(rank, wanted.get(tensor, rank))
        for name, rank in self.fetch_rank.items():
            if name.startswith(FLOAT_PREFIX):
                wanted[name] = min(rank, wanted.get(name, rank))
        ranked = []
        for k in range(len(graph.node) - 1, -1, -1):
            node = graph.node[k]
            ranks = [wanted[t] for t in node.output if t in wanted]
            if not ranks:
                continue
            rank = min(ranks)
            reads = node_reads(node)
            for tensor in reads:
                wanted[tensor] = min(rank, wanted.get(tensor, rank))
            ranked.append((rank, graph, k, reads))
        self.entries.extend(reversed(ranked))
        self.float_graph = graph

    def header(self):
        """An empty ModelProto with what every segment shares: IR, opsets, functions."""
        model = onnx.ModelProto()
        for field in ("ir_version", "producer_name", "producer_version", "domain", "model_version"):
            setattr(model, field, getattr(self.quant_model, field))
        model.ir_version = max(model.ir_version, self.float_model.ir_version)
        model.opset_import.extend(self.quant_model.opset_import)
        quant_opsets = {o.domain or "ai.onnx" for o in model.opset_import}
        model.opset_import.extend(
            o for o in self.float_model.opset_import if (o.domain or "ai.onnx") not in quant_opsets
        )
        model.functions.extend(self.quant_model.functions)
        known = {(f.domain, f.name) for f in model.functions}
        model.functions.extend(f for f in self.float_model.functions if (f.domain, f.name) not in known)
        return model

    def unscheduled(self):
        """When every row is fetched (each tensor small, all within the budget)
        and the nodes fit one segment, order cannot matter to memory: the whole
        combined model as built, copied in bulk, no schedule to pay for."""
        if self.reduced or len(self.entries) > TRACE_SEGMENT_NODES:
            return None
        model = self.header()
        graph = model.graph
        graph.name = "graphscan_combined"
        graph.node.extend(self.quant_model.graph.node)
        graph.node.extend(self.pool.node)
        graph.node.extend([source.node[k] for _, source, k, _ in self.entries if source is self.float_graph])
        for source in (self.quant_model.graph, self.float_graph, self.pool):
            graph.initializer.extend(source.initializer)
            graph.sparse_initializer.extend(source.sparse_initializer)
        graph.input.extend(declared_input(name, value) for name, value in self.feeds.items())
        graph.output.extend(onnx.ValueInfoProto(name=t) for t in self.fetch)
        return model

    def segments(self):
        """The scheduled nodes cut into runs of at most TRACE_SEGMENT_NODES."""
        order = schedule(self.entries)
        self.entries = None
        return [order[k : k + TRACE_SEGMENT_NODES] for k in range(0, len(order), TRACE_SEGMENT_NODES)]

    def initializer_protos(self):
        """``{name: TensorProto}`` of every initializer a node may read."""
        protos = {}
        for graph in (self.quant_model.graph, self.float_graph, self.pool):
            if graph is not None:
                protos.update((init.name, init) for init in graph.initializer)
                protos.update((sparse.values.name, sparse) for sparse in graph.sparse_initializer)
        return protos


def float_in_quant_opset(float_model, quant_model, a, b):
    """The float model at the quantized model's default opset, so both run in one session."""

    def default_opset(model):
        return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)

    wanted, have = default_opset(quant_model), default_opset(float_model)
    if wanted is None or have is None or wanted == have:
        return float_model
    try:
        return onnx.version_converter.convert_version(float_model, wanted)
    except Exception as exc:
        raise GraphscanError(
            f"{a}: opset {have} cannot join {b}'s opset {wanted} in graphscan's combined model ({one_line(exc)})",
            EXIT_RUNTIME,
        )


SHARED_ARENA = []  # [True] once this process registered onnxruntime's shared CPU arena, [False] if it cannot


def shared_arena():
    """Whether every segment's session can allocate from one onnxruntime CPU arena
    that grows only by what is asked. Separate arenas would each keep their own
    high-water mark (and glibc the pages they free), so memory would grow with
    the number of segments. Registered once per process."""
    import onnxruntime as ort

    if not SHARED_ARENA:
        try:
            memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, 1, -1, -1))  # 1: kSameAsRequested
            SHARED_ARENA.append(True)
        except Exception:
            SHARED_ARENA.append(False)
    return SHARED_ARENA[0]


def session_options():
    """onnxruntime options for graphscan's combined model: the graph as written, run in our order."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if shared_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED  # the order schedule() chose
    # Else onnxruntime gives each DQ read by our statistics a copy of its own,
    # appended after every other node, which would run last and hold memory.
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    options.log_severity_level = 4  # errors are reported in our one line, not ORT's log
    return options


def declared_input(name, value):
    """A graph input typed from the value an earlier segment gave it."""
    import numpy as np

    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.STRING, list(value.shape))
        return value_info_of(name, value)
    if isinstance(value, list):
        elem_type = onnx.helper.np_dtype_to_tensor_dtype(value[0].dtype) if value else onnx.TensorProto.FLOAT
        return onnx.helper.make_tensor_sequence_value_info(name, elem_type, None)
    raise GraphscanError(f"tensor {name!r} cannot be passed between graphscan's sessions", EXIT_RUNTIME)


def run_combined(combined, feeds, a, b, rows):
    """Run graphscan's combined model; ``{fetched name: value}``.

    The scheduled nodes run in segments of at most TRACE_SEGMENT_NODES, one
    session each, the tensors a later segment reads handed over: the session
    size, like the tensors, stays bounded however many operators there are.
    A failure is blamed on the model it comes from: the float model, the
    quantized one, or graphscan's own single-op model of a row's node.
    """
    import onnxruntime as ort

    options, run_options = session_options(), ort.RunOptions()
    run_options.log_severity_level = 4
    whole = combined.unscheduled()
    if whole is not None:
        values = run_segment(whole, combined.feeds, combined.fetch, options, run_options, a, b, rows)
        return dict(zip(combined.fetch, values))
    segments = combined.segments()
    initializers = combined.initializer_protos()
    fetch = combined.fetch_set
    last_reader, constants = {}, {}
    for s, segment in enumerate(segments):
        for graph, k, reads, writes in segment:
            for tensor in reads:
                last_reader[tensor] = s
            if not reads and len(writes) == 1 and graph.node[k].op_type == "Constant":
                constants[writes[0]] = graph.node[k]
    # A Constant is copied into each segment that reads it, never handed over:
    # onnxruntime makes it an initializer (a MatMul then prepacks it), so a fed
    # copy would change the arithmetic.
    last_reader = {t: s for t, s in last_reader.items() if t not in constants}
    live, results = dict(feeds), {}
    for s, segment in enumerate(segments):
        model = combined.header()
        graph = model.graph
        graph.name = f"graphscan_segment_{s}"
        graph.node.extend([source.node[k] for source, k, _, _ in segment])
        reads = dict.fromkeys(itertools.chain.from_iterable(r for _, _, r, _ in segment))
        written = list(itertools.chain.from_iterable(w for _, _, _, w in segment))
        produced = set(written)
        copied = [t for t in reads if t in constants and t not in produced]
        graph.node.extend(constants[t] for t in copied)
        produced.update(copied)
        inputs = [t for t in reads if t in live and t not in produced]
        graph.input.extend(declared_input(t, live[t]) for t in inputs)
        for tensor in reads:
            proto = initializers.get(tensor)
            if proto is None or tensor in produced or tensor in live:
                continue
            (graph.sparse_initializer if isinstance(proto, onnx.SparseTensorProto) else graph.initializer).append(proto)
        outputs = [t for t in written if t in fetch or last_reader.get(t, -1) > s]
        if not outputs:
            continue
        graph.output.extend(onnx.ValueInfoProto(name=t) for t in outputs)
        values = run_segment(model, {t: live[t] for t in inputs}, outputs, options, run_options, a, b, rows)
        del model, graph
        for tensor, value in zip(outputs, values):
            if tensor in fetch:
                results[tensor] = value
            if last_reader.get(tensor, -1) > s:
                live[tensor] = value
        for tensor in [t for t in live if last_reader.get(t, -1) <= s]:
            del live[tensor]
    return results


class SingleOpModelError(GraphscanError):
    """graphscan's own single-op model of row ``row`` does not run (``reason``: onnxruntime's line)."""

    def __init__(self, message, row, reason):
        super().__init__(message, EXIT_RUNTIME)
        self.row, self.reason = row, reason


def run_segment(model, feeds, outputs, options, run_options, a, b, rows):
    """One session of graphscan's combined model; blames failures as run_combined says."""
    import onnxruntime as ort

    combined = f"graphscan's combined model of {shown(a)} and {shown(b)}"
    try:
        data = model.SerializeToString()
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        del data  # the session has its own copy; the run needs the memory
        if not outputs:  # nothing to compare (the session was still built and checked)
            return []
        return session.run(outputs, feeds, run_options)
    except MemoryError as exc:
        raise GraphscanError(f"{combined}: out of memory ({one_line(exc)})", EXIT_RUNTIME)
    except Exception as exc:
        text = str(exc)
        if OUT_OF_MEMORY.search(text):
            raise GraphscanError(f"{combined}: out of memory ({one_line(exc)})", EXIT_RUNTIME)
        node = re.search(r"Name:'([^']*)'|[Nn]ode \(([^)]*)\)", text)
        node = (node.group(1) or node.group(2) or "") if node else ""
        row = ROW_NODE.match(node)
        if row:
            k = int(row.group(1))
            message = (
                f"{shown(b)}: graphscan's own single-op model for node {rows[k].name!r} does not run in onnxruntime"
            )
            raise SingleOpModelError(f"{message} ({one_line(exc)})", k, one_line(exc))
        if node.startswith(FLOAT_PREFIX):
            message = f"{shown(a)}: model does not run in onnxruntime"
        elif node.startswith(STATS_PREFIX):
            message = f"{combined} does not run in onnxruntime"
        else:
            message = f"{shown(b)}: model does not run in onnxruntime"
        raise GraphscanError(f"{message} ({one_line(exc)})", EXIT_RUNTIME)


REASON_ABSORBED = "its output is compared with a quantized node of another type (absorbed)"
REASON_NO_TWIN = "no quantized node of the same name and op_type"
REASON_SUBGRAPH = "has a subgraph (If/Loop/Scan): only its outputs are compared, it is not isolated"
REASON_NOT_TENSOR = "its output is {}: not compared"
REASON_SINGLE_OP = "graphscan's own single-op model of this node does not run in onnxruntime ({}): not isolated"
# Single-op models that fail (a reference whose shape inference could not check
# it) are dropped, the run repeated, at most this many times.
TRACE_RETRIES = 8


def unmatched_float_nodes(float_index, quant_index, rows):
    """Float compute nodes with no quantized counterpart of the same name and op_type.

    Nodes with subgraphs are listed too: trace compares their outputs but
    builds no single-op model for them (their bodies read outer tensors).
    """
    quant = {(quant_index.names[i], quant_index.op_types[i]) for i in range(len(quant_index))}
    referenced = {}
    for row in rows:
        if row["reference"] is None:
            continue
        source, _ = data_source(float_index, float_index.graph, row["reference"])
        producer = float_index.producer_of(source)
        if producer is not None:
            referenced.setdefault(producer, set()).add(row["op_type"])
    unmatched = []
    for i in range(len(float_index)):
        if not float_index.is_compute(i):
            continue
        name, op_type = float_index.names[i], float_index.op_types[i]
        if has_subgraph(float_index.graph.node[i]):
            reason = REASON_SUBGRAPH
        elif (name, op_type) in quant or op_type in referenced.get(i, ()):
            continue
        else:
            reason = REASON_ABSORBED if i in referenced else REASON_NO_TWIN
        unmatched.append({"node": name, "op_type": op_type, "reason": reason})
    return unmatched


# --------------------------------------------------------------------------
# trace: --save


def file_stems(names):
    """A file stem per name, all different even on a case-insensitive file system.

    A name made only of ``[A-Za-z0-9._-]`` is its own stem; any other gets its
    unsafe characters turned into ``_`` and a hash of the name appended.
    """
    import hashlib

    stems, taken = [], set()
    for name in names:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:120]
        if safe != name or safe.strip(".") == "":
            safe = f"{safe}-{hashlib.sha1(name.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}"
        stem, n = safe, 1
        while stem.casefold() in taken:
            n += 1
            stem = f"{safe}-{n}"
        taken.add(stem.casefold())
        stems.append(stem)
    return stems


def standalone_model(quant_model, op, input_arrays, output_array):
    """``op`` as a model of its own, for ``--save``: typed from the arrays it ran on."""
    wanted = set(op.initializers)
    initializers = [init for init in quant_model.graph.initializer if init.name in wanted]
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            op.node_protos(),
            op.index.names[op.row],
            [value_info_of(name, input_arrays[name]) for name in op.feeds],
            [value_info_of(op.output, output_array)],
            initializers,
        ),
        opset_imports=quant_model.opset_import,
    )
    model.ir_version = quant_model.ir_version
    return model


def npz_bytes(inputs, reference):
    """The ``--save`` .npz: arrays under generated keys (``input0``, ...,
    ``reference``) and ``names.json`` mapping each key back to its tensor name,
    so any tensor name round-trips."""
    import io
    import zipfile

    import numpy as np

    keys = {f"input{k}": name for k, name in enumerate(inputs)}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for key, name in keys.items():
            with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(inputs[name]), allow_pickle=False)
        with archive.open("reference.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, np.asarray(reference), allow_pickle=False)
        names = {"inputs": {name: key for key, name in keys.items()}, "reference": "reference"}
        archive.writestr("names.json", json.dumps(names, ensure_ascii=False))
    return buffer.getvalue()


def save_op_models(folder, quant_model, rows, op_models, arrays_by_row):
    """Write ``<stem>.onnx`` and ``<stem>.npz`` for every row that has a single-op
    model, and ``index.json`` mapping each row's node to its stem."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise GraphscanError(f"{shown(folder)}: cannot create ({exc.strerror or exc})", EXIT_NO_FILE)
    saved = [(row, op, arrays) for row, op, arrays in zip(rows, op_models, arrays_by_row) if op and arrays]
    stems = file_stems([row["node"] for row, _, _ in saved])
    for stem, (_row, op, (arrays, reference, isolated)) in zip(stems, saved):
        model = standalone_model(quant_model, op, arrays, isolated)
        write_atomically(model.SerializeToString(), os.path.join(folder, stem + ".onnx"))
        write_atomically(npz_bytes(arrays, reference), os.path.join(folder, stem + ".npz"))
    index = {row["node"]: stem for stem, (row, _, _) in zip(stems, saved)}
    write_atomically(json.dumps(index, ensure_ascii=False).encode("utf-8"), os.path.join(folder, "index.json"))


# --------------------------------------------------------------------------
# trace: the rows


class TraceRow:
    """One compute node of the quantized model: its float reference, single-op
    model (None where it has no reference or has a subgraph), the tensor it
    writes and what the next op sees, and why it is not compared, if so."""

    def __init__(self, index, graph, i, matcher, initializer_protos, types):
        node = graph.node[i]
        self.i, self.name = i, index.names[i]
        self.output = first_output(node)
        self.problem = type_problem(types.get(self.output)) if self.output else None
        self.reference = self.op = None
        self.out_chain, self.seen = output_chain(index, graph, self.output) if self.output else ([], "")
        if self.output and not self.problem:
            self.reference = tensor_reference(index, matcher, self.output, types)
        if self.reference is not None and not has_subgraph(node):
            self.op = OpModel(index, graph, i, matcher, initializer_protos, types, (self.out_chain, self.seen))
        self.clip = clip_range(graph, self.out_chain[0], initializer_protos) if self.out_chain else None


def plan_rows(quant_model, quant_index, matcher, types):
    """A TraceRow per compute node of the quantized model, in graph order."""
    graph = quant_model.graph
    initializer_protos = InitializerTable(graph)
    return [TraceRow(quant_index, graph, i, matcher, initializer_protos, types) for i in quant_index.compute_nodes]


def output_pairs(float_model, quant_model, a, b):
    """``[(float output, quantized output)]``: by name, else by position (exit 7 when neither fits)."""
    first = [o.name for o in float_model.graph.output]
    second = [o.name for o in quant_model.graph.output]
    if set(first) <= set(second):
        return [(name, name) for name in first]
    if len(first) == len(second):
        return list(zip(first, second))
    raise GraphscanError(
        f"{a} and {b}: the models' outputs differ ({', '.join(first)} vs {', '.join(second)})", EXIT_INPUTS
    )


def row_answer(index, row, isolated, propagated, clipped):
    """One ``ops`` row of the trace answer."""
    isolated_max, _ = isolated
    propagated_max, sqnr = propagated
    scale = row.op.output_scale if row.op else None
    return {
        "node": index.names[row.i],
        "op_type": index.op_types[row.i],
        "wrapped": index.wrapped[row.i],
        "reference": row.reference,
        "isolated_max_abs": isolated_max,
        "propagated_max_abs": propagated_max,
        "isolated_lsb": isolated_max / scale if isolated_max is not None and scale else None,
        "sqnr_db": sqnr,
        "clipped": clipped,
    }


def trace(a, b, inputs=None, seed=0, tolerance=TRACE_TOLERANCE, save=None, shape=None):
    """Per operator of ``b`` (quantized): isolated and propagated error against ``a`` (float)."""
    try:
        return trace_models(a, b, inputs, seed, tolerance, save, shape)
    except MemoryError as exc:
        raise GraphscanError(
            f"graphscan's combined model of {a} and {b}: out of memory ({one_line(exc)})", EXIT_RUNTIME
        )


def trace_models(a, b, inputs, seed, tolerance, save, shape):
    """``trace``'s work: plan the rows, run graphscan's combined model, answer."""
    float_model, quant_model = load_with_weights(a), load_with_weights(b)
    check_same_inputs(float_model, quant_model, a, b)
    samples, defaulted = model_samples(
        float_model, [inputs] if inputs else None, parse_shapes(shape), seed, TRACE_SYMBOLIC_DIM_SIZE
    )
    feeds = samples[0]
    pairs = output_pairs(float_model, quant_model, a, b)
    float_types, quant_types = inferred_types(float_model, feeds), inferred_types(quant_model, feeds)
    quant_index = GraphIndex(quant_model.graph)
    matcher = ReferenceMatcher(float_model.graph, float_types)
    plan = plan_rows(quant_model, quant_index, matcher, quant_types)

    float_for_session = float_in_quant_opset(float_model, quant_model, a, b)
    failed = {}  # row index -> onnxruntime's reason its single-op model failed
    while True:
        combined = CombinedModel(float_for_session, quant_model, feeds, float_types, quant_types)
        measured = [combined.add_row(k, row, quant_index, save is not None) for k, row in enumerate(plan)]
        output_comparisons = {}
        for f, q in pairs:
            reference = combined.float_name(f)
            output_comparisons[f] = combined.compare(combined.end, reference, q, fetch=combined.fits([reference, q]))
        combined.add_float_model()
        try:
            values = run_combined(combined, feeds, a, b, plan)
            break
        except SingleOpModelError as failure:
            if failure.row in failed or len(failed) >= TRACE_RETRIES:
                raise
            failed[failure.row] = failure.reason
            plan[failure.row].op = None  # traced without it: its isolated error is null
    values.update(feeds)

    rows, saved = [], []
    for row, (isolated, propagated, clip, op_output) in zip(plan, measured):
        nothing = (None, None)
        rows.append(
            row_answer(
                quant_index,
                row,
                isolated.result(values) if isolated else nothing,
                propagated.result(values) if propagated else nothing,
                clip.result(values) if clip else None,
            )
        )
        arrays = None
        if save is not None and isolated is not None and rows[-1]["isolated_max_abs"] is not None:
            inputs_of_op = {t: values[combined.float_name(r) if r is not None else t] for t, r in row.op.feeds.items()}
            arrays = (inputs_of_op, values[combined.float_name(row.reference)], values[op_output])
        saved.append(arrays)
    if save is not None:
        save_op_models(save, quant_model, rows, [row.op for row in plan], saved)
    return {
        "a": a,
        "b": b,
        "inputs": {name: list(array.shape) for name, array in feeds.items()},
        "defaulted": defaulted,
        "ops": rows,
        "outputs": {
            f: (comparison.result(values)[0] if comparison else None) for f, comparison in output_comparisons.items()
        },
        "worst_isolated": worst_isolated(rows),
        "first_over": first_over(rows, tolerance),
        "unmatched": unmatched_float_nodes(matcher.index, quant_index, rows)
        + [
            {"node": row.name, "op_type": quant_index.op_types[row.i], "reason": REASON_NOT_TENSOR.format(row.problem)}
            for row in plan
            if row.problem
        ]
        + [
            {
                "node": plan[k].name,
                "op_type": quant_index.op_types[plan[k].i],
                "reason": REASON_SINGLE_OP.format(reason),
            }
            for k, reason in sorted(failed.items())
        ],
    }


def worst_isolated(rows):
    measured = [r for r in rows if r["isolated_max_abs"] is not None]
    if not measured:
        return None
    worst = max(measured, key=lambda r: r["isolated_max_abs"])  # first of equals
    return {"node": worst["node"], "max_abs": worst["isolated_max_abs"]}


def first_over(rows, tolerance):
    for r in rows:
        if r["isolated_max_abs"] is not None and r["isolated_max_abs"] > tolerance:
            return {"node": r["node"], "max_abs": r["isolated_max_abs"]}
    return None


# --------------------------------------------------------------------------
# runtime: what onnxruntime really executes for each operator
#
# "Wrapped" is a structural proxy. onnxruntime decides at session build time
# which DQ -> op -> Q groups become integer kernels, so the only honest answer
# comes from the graph it saves after optimization. One session, built from a
# copy of the model in which every node has a unique name; each original
# compute node is then found in the optimized graph and its kernel classified.

RUNTIME_LEVELS = {"basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}
RUNTIME_DEFAULT_RUNS = 20
RUNTIME_CLASSES = ["int8", "int8_data", "float", "absorbed"]
TIME_CLASSES = ["int8", "int8_data", "float", "quantize", "dequantize"]
# Providers that run one kernel per node, so their optimized graph maps back
# to the model's nodes. Providers that compile subgraphs into one opaque
# kernel (TensorRT, OpenVINO, QNN, CoreML, ...) cannot answer per node.
PER_NODE_PROVIDERS = {"CPUExecutionProvider", "CUDAExecutionProvider", "DmlExecutionProvider", "ROCMExecutionProvider"}
# Kernels that compute on integers.
INT8_KERNELS = {
    "QGemm",
    "MatMulInteger",
    "ConvInteger",
    "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul",
    "QAttention",
    "QEmbedLayerNormalization",
    "DynamicQuantizeLSTM",
    "MatMulNBits",
}
QUANTIZE_KERNELS = {QUANTIZE, "DynamicQuantizeLinear"}
# Integer element types that quantized data is stored in.
QUANTIZED_TYPES = set(Q_RANGES)
# onnxruntime's CPU QDQ fusions (qdq_selector_action_transformer.cc, 1.32):
# op types whose DQ -> op -> Q group can become an integer kernel or drop its
# Q/DQ. Any other wrapped op type keeps a float kernel on this provider.
# fmt: off
QDQ_FUSIONS = {
    "CPUExecutionProvider": {
        "AveragePool", "LeakyRelu", "GlobalAveragePool", "Sigmoid", "Softmax",  # QLinear unary
        "Add", "Mul", "Concat", "Conv", "MatMul", "Gemm", "Where", "Split",
        "Resize", "MaxPool", "ReduceMax", "ReduceMin", "Expand", "Flatten", "Gather",  # Q/DQ dropped
        "GatherElements", "Reshape", "Slice", "Squeeze", "Tile", "Transpose", "Unsqueeze", "ArgMax",
    },
}
# fmt: on
# Ops whose fused kernel takes int8 weights beside uint8 activations: the
# weight operand does not count when operand types are compared.
WEIGHT_OPERANDS = {"Conv": {1, 2}, "MatMul": {1}, "Gemm": {1, 2}}
# Fusions that take int8 activations only with session.qdqisint8allowed=1
# (onnxruntime's ConvSelector and MatMulSelector; QGemm takes them always).
INT8_GATED_FUSIONS = {"Conv", "MatMul"}
# Layout nodes onnxruntime inserts between a kernel and the tensor it makes.
LAYOUT_KERNELS = {"ReorderOutput", "ReorderInput"}
ORT_NAME_SUFFIX = re.compile(r"(?:_token_\d+|_nchwc|/[A-Za-z0-9]*Fusion/?|/duplicated)$")

REASON_LEVEL = "level"
REASON_NO_KERNEL = "no_kernel"
REASON_MIXED = "mixed_types"
REASON_INT8 = "int8_activations"
REASON_OTHER = "other"


def strip_ort_suffixes(name):
    """A node name without the suffixes onnxruntime appends when it rewrites a node."""
    while True:
        stripped = ORT_NAME_SUFFIX.sub("", name)
        if stripped == name:
            return name
        name = stripped


def session_names(model):
    """A copy of ``model`` in which every node has a unique name.

    Unnamed nodes get their SPEC name (``<op_type>_<i>``); a name that is taken
    (or repeated) gets ``~<i>`` appended. Returns the copy and the names.
    """
    named = onnx.ModelProto()
    named.CopyFrom(model)
    taken = {as_text(node.name) for node in model.graph.node if node.name}
    seen, names = set(), []
    for i, node in enumerate(named.graph.node):
        name = node_name(node, i)
        if name in seen or (not node.name and name in taken):
            name = f"{name}~{i}"
        seen.add(name)
        names.append(name)
        node.name = name
    return named, names


def runtime_session_options(level, int8_allowed, threads=None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, RUNTIME_LEVELS[level])
    options.log_severity_level = 3
    if int8_allowed:
        options.add_session_config_entry("session.qdqisint8allowed", "1")
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return options


def check_provider(provider):
    """Exit 2 for a provider that is not here or cannot be mapped per node."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if provider not in available:
        raise GraphscanError(f"usage: provider {provider} is not available here ({', '.join(available)})", EXIT_USAGE)
    if provider not in PER_NODE_PROVIDERS:
        raise GraphscanError(
            f"usage: provider {provider} compiles subgraphs into its own kernels, so its graph "
            f"cannot be mapped back to nodes (per-node providers: {', '.join(sorted(PER_NODE_PROVIDERS))})",
            EXIT_USAGE,
        )


def build_session(model_bytes, path, options, provider):
    import onnxruntime as ort

    try:
        return ort.InferenceSession(model_bytes, options, providers=[provider])
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: model does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME)


def optimized_model(model_bytes, path, level, provider, int8_allowed):
    """The model onnxruntime runs, as it saves it after optimizing ``model_bytes``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="graphscan-runtime-") as folder:
        options = runtime_session_options(level, int8_allowed)
        options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
        build_session(model_bytes, path, options, provider)
        try:
            with open(options.optimized_model_filepath, "rb") as f:
                return parse_model(f.read(), path)
        except OSError as exc:
            raise GraphscanError(
                f"{shown(path)}: onnxruntime saved no optimized graph ({exc.strerror or exc})", EXIT_RUNTIME
            )


class OptimizedGraph:
    """The optimized graph with the lookups the mapping needs, and its tensor types."""

    def __init__(self, graph):
        self.graph = graph
        self.index = GraphIndex(graph)
        self.by_name = {}
        self.by_stripped = {}
        for i, node in enumerate(graph.node):
            self.by_name.setdefault(node.name, i)
            self.by_stripped.setdefault(strip_ort_suffixes(node.name), []).append(i)
        self.types = tensor_types(graph)

    def op_type(self, i):
        return self.index.op_types[i]

    def kernel_producer(self, tensor):
        """The node making ``tensor``, looking through inserted layout nodes."""
        producer = self.index.producer_of(tensor)
        while producer is not None and self.op_type(producer) in LAYOUT_KERNELS:
            producer = self.index.producer_of(self.graph.node[producer].input[0])
        return producer

    def element_type(self, tensor):
        return self.types.get(tensor, onnx.TensorProto.UNDEFINED)


def tensor_types(graph):
    """``{tensor: element type}`` for the optimized graph.

    onnxruntime saves value_info for most float tensors but not for the
    integer tensors its Q/DQ rewrites make, so those are derived here: a Q
    makes its zero point's type, integer kernels keep their first input's.
    """
    types = {}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    for init in graph.initializer:
        types[init.name] = init.data_type
    for node in graph.node:
        outputs = [t for t in node.output if t and t not in types]
        if not outputs:
            continue
        derived = derived_output_type(node, types)
        for tensor in outputs:
            types[tensor] = derived
    return types


def derived_output_type(node, types):
    op = node.op_type
    if op == QUANTIZE:
        return (
            types.get(node.input[2], onnx.TensorProto.UINT8)
            if len(node.input) > 2 and node.input[2]
            else onnx.TensorProto.UINT8
        )
    if op == DEQUANTIZE:
        return types.get(node.input[1], onnx.TensorProto.FLOAT) if len(node.input) > 1 else onnx.TensorProto.FLOAT
    if op == "DynamicQuantizeLinear":
        return onnx.TensorProto.UINT8
    if op in ("MatMulInteger", "ConvInteger"):
        return onnx.TensorProto.INT32
    if op in ("Shape", "Size"):
        return onnx.TensorProto.INT64
    first = next((t for t in node.input if t), None)
    return types.get(first, onnx.TensorProto.UNDEFINED)


def kernel_class(optimized, j):
    """int8 / int8_data / float for a kernel of the optimized graph (Q and DQ excluded)."""
    op = optimized.op_type(j)
    if op in INT8_KERNELS or op.startswith(("QLinear", "NhwcQLinear")):
        return "int8"
    if op not in QUANTIZE_KERNELS:
        first = next((t for t in optimized.graph.node[j].input if t), None)
        if first is not None and optimized.element_type(first) in QUANTIZED_TYPES:
            return "int8_data"
    return "float"


def time_class(optimized, j):
    op = optimized.op_type(j)
    if op in QUANTIZE_KERNELS:
        return "quantize"
    if op == DEQUANTIZE:
        return "dequantize"
    return kernel_class(optimized, j)


def find_in_optimized(index, names, optimized, i):
    """``(optimized node index or None, how)`` for compute node ``i`` of the original.

    By name, by name without onnxruntime's suffixes, by output tensor (also
    through the Q after it), by its Q/DQ signature (the quantized tensors its
    DQs read), by neighbours (the one node of its op type reading its input).
    """
    name = names[i]
    if name in optimized.by_name:
        return optimized.by_name[name], "name"
    stripped = optimized.by_stripped.get(name, [])
    if len(stripped) == 1:
        return stripped[0], "name"
    graph = index.graph
    for tensor in index.outputs[i]:
        producer = optimized.kernel_producer(tensor)
        if producer is not None:
            return producer, "tensor"
    for tensor in index.outputs[i]:
        # The Q after it keeps its name even when its tensors are renamed
        # (onnxruntime's int8 -> uint8 rewrite): the node was folded into it.
        for q in index.consumers_of(tensor):
            if not index.is_q[q]:
                continue
            if names[q] in optimized.by_name:
                return optimized.by_name[names[q]], "tensor"
            # The Q itself was fused: whatever makes its output took the node in.
            producer = optimized.kernel_producer(graph.node[q].output[0])
            if producer is not None:
                return producer, "tensor"
    signature = set()
    for tensor in index.inputs[i]:
        source, chain = data_source(index, graph, tensor)
        signature.add(graph.node[chain[-1]].input[0] if chain else source)
    readers = set()
    for tensor in signature:
        readers.update(j for j in optimized.index.consumers_of(tensor) if optimized.index.is_compute(j))
    if len(readers) == 1:
        return readers.pop(), "signature"
    op_type = index.op_types[i]
    neighbours = {
        j for tensor in index.inputs[i] for j in optimized.index.consumers_of(tensor) if optimized.op_type(j) == op_type
    }
    if len(neighbours) == 1:
        return neighbours.pop(), "neighbours"
    return None, None


def tensors_gone(index, optimized, i):
    """Whether node ``i``'s outputs are gone from the optimized graph or were
    folded into constants (initializers)."""
    live = optimized.index
    return all(
        t in live.initializers or (live.producer_of(t) is None and not live.consumers_of(t)) for t in index.outputs[i]
    )


def absorbed_by_neighbours(index, found):
    """Nodes not found whose upstream and downstream neighbours run in one
    kernel were fused into it (a Cast and a Mul inside a fused MatMul).
    Repeated until nothing changes, so chains of such nodes resolve."""
    changed = True
    while changed:
        changed = False
        for i in index.compute_nodes:
            if found[i][0] is not None:
                continue
            upstream = {found[p][0] for t in index.inputs[i] if (p := index.producer_of(t)) in found}
            downstream = {found[c][0] for t in index.outputs[i] for c in index.consumers_of(t) if c in found}
            shared = (upstream & downstream) - {None}
            if len(shared) == 1:
                found[i] = (shared.pop(), "neighbours")
                changed = True


def map_to_kernels(index, names, optimized):
    """Per compute node: ``(optimized node or None, absorbed?, unmapped reason or None)``.

    When several nodes land on one kernel, the one found by name runs it (else
    the first in graph order) and the others were fused into it.
    """
    found = {}
    for i in index.compute_nodes:
        found[i] = find_in_optimized(index, names, optimized, i)
    runner = {}
    for i in index.compute_nodes:
        j, how = found[i]
        if j is None or not optimized.index.is_compute(j):
            continue
        current = runner.get(j)
        if current is None or (how == "name" and found[current][1] != "name"):
            runner[j] = i
    absorbed_by_neighbours(index, found)
    mapping = {}
    for i in index.compute_nodes:
        j, how = found[i]
        if j is None:
            if tensors_gone(index, optimized, i):
                mapping[i] = (None, True, None)  # removed: folded or an Identity
            else:
                mapping[i] = (
                    None,
                    False,
                    "not found in the optimized graph by name, tensor, Q/DQ signature or neighbours",
                )
        else:
            mapping[i] = (j, runner.get(j) != i, None)
    return mapping


def operand_types(optimized, j, op_type):
    """Integer types of kernel ``j``'s DQ-fed inputs and Q-read outputs in the optimized graph.

    Returns ``(inputs, weights, outputs, complete)``: lists of type names;
    ``complete`` says whether every input came from a DQ and every output
    went only to Qs, as a fusion needs.
    """
    live, graph = optimized.index, optimized.graph
    inputs, weights, outputs, complete = [], [], [], True
    for k, tensor in enumerate(graph.node[j].input):
        if not tensor:
            continue
        producer = live.producer_of(tensor)
        if producer is None or not live.is_dq[producer]:
            complete = False
            continue
        source = graph.node[producer].input[0]
        kind = dtype_name(optimized.element_type(source)).lower()
        (weights if k in WEIGHT_OPERANDS.get(op_type, ()) else inputs).append(kind)
    for tensor in live.outputs[j]:
        readers = live.consumers_of(tensor)
        if not readers or not all(live.is_q[r] for r in readers):
            complete = False
        outputs += [
            dtype_name(optimized.element_type(graph.node[r].output[0])).lower() for r in readers if live.is_q[r]
        ]
    return inputs, weights, outputs, complete


def float_reason(op_type, optimized, j, level, provider, int8_allowed):
    """Why a wrapped node still runs a float kernel: ``{"code", "detail"}``."""
    if level == "basic":
        return {"code": REASON_LEVEL, "detail": "QDQ fusions run at the extended level and above"}
    if op_type not in QDQ_FUSIONS.get(provider, ()):
        return {"code": REASON_NO_KERNEL, "detail": f"{provider} has no QDQ fusion for {op_type}"}
    if j is None:
        return {"code": REASON_OTHER, "detail": "its kernel was not found in the optimized graph"}
    inputs, weights, outputs, complete = operand_types(optimized, j, op_type)
    detail = f"inputs {', '.join(inputs) or '-'}"
    if weights:
        detail += f"; weights {', '.join(weights)}"
    detail += f"; outputs {', '.join(outputs) or '-'}"
    if not complete:
        return {
            "code": REASON_OTHER,
            "detail": "in the optimized graph not every input comes from a "
            f"DequantizeLinear or not every output goes only to QuantizeLinear ({detail})",
        }
    if len(set(inputs + outputs)) > 1:
        return {"code": REASON_MIXED, "detail": detail}
    if op_type in INT8_GATED_FUSIONS and set(inputs) == {"int8"} and not int8_allowed:
        return {
            "code": REASON_INT8,
            "detail": f"{detail}; int8 activations need session.qdqisint8allowed=1 (--int8-allowed)",
        }
    return {"code": REASON_OTHER, "detail": f"{detail}; the fusion's other conditions failed"}


def classify_nodes(index, names, optimized, level, provider, int8_allowed):
    """The ``nodes`` rows of the runtime answer, in graph order, and the unmapped names."""
    mapping = map_to_kernels(index, names, optimized)
    rows, unmapped = [], []
    for i in index.compute_nodes:
        j, absorbed, unmapped_reason = mapping[i]
        wrapped = index.wrapped[i]
        kernel = optimized.op_type(j) if j is not None else None
        runs_in = optimized.graph.node[j].name if j is not None else None
        reason = None
        if unmapped_reason:
            kind = None
            reason = {"code": "unmapped", "detail": unmapped_reason}
            unmapped.append(index.name(i))
        elif absorbed or not optimized.index.is_compute(j):
            kind = "absorbed"
        else:
            kind = kernel_class(optimized, j)
            if kind == "float" and wrapped:
                reason = float_reason(index.op_types[i], optimized, j, level, provider, int8_allowed)
        rows.append(
            {
                "node": index.name(i),
                "op_type": index.op_types[i],
                "wrapped": wrapped,
                "class": kind,
                "kernel": kernel,
                "runs_in": runs_in,
                "reason": reason,
            }
        )
    return rows, unmapped


def runtime_counts(rows):
    classes = Counter(row["class"] for row in rows)
    by_op_type = {}
    for row in rows:
        if row["class"]:
            counts = by_op_type.setdefault(row["op_type"], {})
            counts[row["class"]] = counts.get(row["class"], 0) + 1
    return {
        "compute": len(rows),
        "wrapped": sum(row["wrapped"] for row in rows),
        "classes": {kind: classes.get(kind, 0) for kind in RUNTIME_CLASSES},
        "wrapped_but_float": sum(1 for row in rows if row["wrapped"] and row["class"] == "float"),
        "float_but_int8": sum(1 for row in rows if not row["wrapped"] and row["class"] == "int8"),
        "by_op_type": {op: dict(sorted(counts.items())) for op, counts in sorted(by_op_type.items())},
    }


def runtime_environment(level, provider, int8_allowed):
    import platform

    import onnxruntime as ort

    return {
        "onnxruntime": ort.__version__,
        "provider": provider,
        "level": level,
        "machine": platform.machine(),
        "int8_allowed": int8_allowed,
    }


def runtime(
    path,
    level="extended",
    provider="CPUExecutionProvider",
    int8_allowed=False,
    time=False,
    inputs=None,
    shape=None,
    runs=RUNTIME_DEFAULT_RUNS,
):
    """Per compute node: the kernel onnxruntime runs for it and its class."""
    if level not in RUNTIME_LEVELS:
        raise GraphscanError(f"usage: --level must be one of {', '.join(RUNTIME_LEVELS)}", EXIT_USAGE)
    if runs < 1:
        raise GraphscanError("usage: --runs must be at least 1", EXIT_USAGE)
    model = load_with_weights(path)
    shapes = parse_shapes(shape)
    check_provider(provider)
    named, names = session_names(model)
    named_bytes = named.SerializeToString()
    optimized_proto = optimized_model(named_bytes, path, level, provider, int8_allowed)
    optimized = OptimizedGraph(optimized_proto.graph)
    index = GraphIndex(named.graph)
    rows, unmapped = classify_nodes(index, names, optimized, level, provider, int8_allowed)
    answer = {
        "model": path,
        "environment": runtime_environment(level, provider, int8_allowed),
        **runtime_counts(rows),
        "nodes": rows,
        "unmapped": unmapped,
    }
    if time:
        samples, defaulted = model_samples(named, [inputs] if inputs else None, shapes, 0, 1)
        answer["time"] = runtime_time(
            named_bytes,
            optimized_proto,
            path,
            rows,
            optimized,
            samples[0],
            defaulted,
            level,
            provider,
            int8_allowed,
            runs,
        )
    return answer


# ---- runtime --time: where the time goes, and what the round trips cost

PROFILE_FLOOR_NODES = 200


def profile_events(session):
    """The profiler's per-kernel events: ``[(run number, node name, op, microseconds)]``."""
    profile = session.end_profiling()
    try:
        with open(profile) as f:
            events = json.load(f)
    finally:
        os.unlink(profile)
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    kernels = []
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        run = sum(1 for start in runs if start <= event["ts"]) - 1
        kernels.append((run, event["name"][: -len("_kernel_time")], event["args"].get("op_name"), event["dur"]))
    return kernels


def profiled_runs(model_bytes, path, options, provider, feeds, runs):
    """Kernel events of ``runs`` profiled runs after one warm-up run, on one thread."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="graphscan-profile-") as folder:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(folder, "profile")
        session = build_session(model_bytes, path, options, provider)
        try:
            for _ in range(runs + 1):
                session.run(None, feeds)
        except Exception as exc:
            raise GraphscanError(f"{shown(path)}: model does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME)
        return [event for event in profile_events(session) if event[0] >= 1]


def profiler_floor(provider, runs):
    """The profiler's own cost per kernel event, in microseconds.

    Measured as the median duration of a chain of Identity kernels on one
    float: work that takes no time, so what the profiler reports is its floor.
    """
    import numpy as np
    import onnxruntime as ort

    nodes = [
        onnx.helper.make_node("Identity", [f"t{k}"], [f"t{k + 1}"], name=f"n{k}") for k in range(PROFILE_FLOOR_NODES)
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "floor",
        [onnx.helper.make_tensor_value_info("t0", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info(f"t{PROFILE_FLOOR_NODES}", onnx.TensorProto.FLOAT, [1])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    events = profiled_runs(
        model.SerializeToString(),
        "graphscan's profiler-floor model",
        options,
        provider,
        {"t0": np.zeros(1, np.float32)},
        max(1, min(runs, 5)),
    )
    return float(np.median([duration for _, _, _, duration in events])) if events else 0.0


def without_round_trips(model):
    """A copy of ``model`` with every activation Q -> DQ round trip removed.

    Applied to the optimized model, it removes exactly the round trips that
    onnxruntime runs as separate Q and DQ kernels: those it fused into integer
    kernels are no longer Q -> DQ pairs there. Readers of each DQ read the Q's
    input instead; round trips whose DQ output is a graph output stay.
    """
    index = GraphIndex(model.graph)
    graph_outputs = {o.name for o in model.graph.output}
    rename, drop = {}, set()
    for q in index.q_nodes:
        source = model.graph.node[q].input[0]
        if source in index.initializers:
            continue
        readers = [c for t in index.outputs[q] for c in index.consumers_of(t)]
        if not readers or not all(index.is_dq[c] for c in readers):
            continue
        if any(t in graph_outputs for c in readers for t in index.outputs[c]):
            continue
        drop.add(q)
        for dq in readers:
            drop.add(dq)
            for t in index.outputs[dq]:
                rename[t] = source
    ablated = onnx.ModelProto()
    ablated.CopyFrom(model)
    del ablated.graph.node[:]
    for i, node in enumerate(model.graph.node):
        if i in drop:
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[:] = [rename.get(t, t) for t in node.input]
        ablated.graph.node.append(copy)
    return ablated, len(drop)


def interleaved_wall_times(sessions, feeds, runs):
    """Median seconds per run of each session, timed in alternation so that
    the machine's drift falls on all of them alike."""
    import statistics
    import time as clock

    times = [[] for _ in sessions]
    for session in sessions:
        session.run(None, feeds)  # warm-up
    for _ in range(runs):
        for k, session in enumerate(sessions):
            start = clock.perf_counter()
            session.run(None, feeds)
            times[k].append(clock.perf_counter() - start)
    return [statistics.median(t) for t in times]


def runtime_time(
    named_bytes, optimized_proto, path, rows, optimized, feeds, defaulted, level, provider, int8_allowed, runs
):
    """The ``time`` object of ``runtime --time``."""
    floor = profiler_floor(provider, runs)
    options = runtime_session_options(level, int8_allowed, threads=1)
    events = profiled_runs(named_bytes, path, options, provider, feeds, runs)
    by_name = {}
    for _, name, _, duration in events:
        by_name[name] = by_name.get(name, 0.0) + max(duration - floor, 0.0)
    totals = dict.fromkeys(TIME_CLASSES, 0.0)
    for name, spent in by_name.items():
        j = optimized.by_name.get(name)
        if j is not None:
            totals[time_class(optimized, j)] += spent
    whole = sum(totals.values())
    shares = {kind: (spent / whole if whole else None) for kind, spent in totals.items()}
    node_us = {
        row["node"]: by_name[row["runs_in"]] / runs
        for row in rows
        if row["class"] in ("int8", "int8_data", "float") and row["runs_in"] in by_name
    }
    # Both timed from the optimized graph as saved, with no further
    # optimization, so the only difference is the round trips removed.
    ablated, removed = without_round_trips(optimized_proto)
    if not removed:
        return time_answer(floor, feeds, defaulted, runs, shares, node_us, removed, None, None, 0.0)
    frozen = runtime_session_options("basic", False, threads=1)
    frozen.graph_optimization_level = type(frozen.graph_optimization_level).ORT_DISABLE_ALL
    sessions = [
        build_session(
            optimized_proto.SerializeToString(), f"{shown(path)} (as optimized by onnxruntime)", frozen, provider
        ),
        build_session(
            ablated.SerializeToString(), f"graphscan's copy of {shown(path)} without Q/DQ round trips", frozen, provider
        ),
    ]
    try:
        model_s, ablated_s = interleaved_wall_times(sessions, feeds, runs)
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: model does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME)
    cost = 1.0 - ablated_s / model_s if model_s > 0 else None
    return time_answer(floor, feeds, defaulted, runs, shares, node_us, removed, model_s, ablated_s, cost)


def time_answer(floor, feeds, defaulted, runs, shares, node_us, removed, model_s, ablated_s, cost):
    """The ``time`` object, with the method spelled out."""
    return {
        "method": (
            f"onnxruntime profiler, one thread, {runs} runs after one warm-up; each kernel event minus "
            f"the profiler's floor ({floor:.2f} us, the median event of a {PROFILE_FLOOR_NODES}-Identity "
            f"chain), at least 0. round_trip_cost: 1 - median wall time of the optimized graph "
            f"without its {removed} activation Q/DQ round-trip nodes / median wall time of the "
            f"optimized graph, both run as saved (no further optimization), timed alternately "
            f"without the profiler (0 when there are none)"
        ),
        "inputs": {name: list(array.shape) for name, array in feeds.items()},
        "defaulted": defaulted,
        "runs": runs,
        "profiler_floor_us": floor,
        "shares": shares,
        "nodes": node_us,
        "wall_ms": {
            "model": model_s * 1e3 if model_s is not None else None,
            "without_round_trips": ablated_s * 1e3 if ablated_s is not None else None,
        },
        "round_trip_cost": cost,
    }


# --------------------------------------------------------------------------
# check: a gate for CI. Each budget is measured and compared with its limit;
# the answer is the same JSON whether the budgets hold (exit 0) or not (exit 8).

# name: (what it measures, direction). "max" holds when value <= limit.
BUDGETS = {
    "max_float": ("float compute nodes (islands)", "max"),
    "max_islands": ("float islands (islands)", "max"),
    "max_crossings": ("boundary crossings (boundary)", "max"),
    "min_int8": ("fraction of the nodes that run a kernel which run an int8 or int8_data kernel (runtime)", "min"),
    "min_sqnr": ("output SQNR in dB against --float (impact's definition)", "min"),
}


def read_budget_file(path):
    """``{budget: limit}`` from a JSON file; an unknown key or a non-number is a usage error."""
    check_readable(path)
    try:
        with open(path, encoding="utf-8") as f:
            limits = json.load(f)
    except OSError as exc:
        raise GraphscanError(f"{shown(path)}: cannot read ({exc.strerror or exc})", EXIT_NO_FILE)
    except ValueError as exc:
        raise GraphscanError(f"usage: {shown(path)}: not JSON ({one_line(exc)})", EXIT_USAGE)
    if not isinstance(limits, dict):
        raise GraphscanError(f"usage: {shown(path)}: expected a JSON object of budgets", EXIT_USAGE)
    unknown = sorted(set(limits) - set(BUDGETS))
    if unknown:
        raise GraphscanError(
            f"usage: {shown(path)}: unknown budget {', '.join(unknown)} (known: {', '.join(BUDGETS)})", EXIT_USAGE
        )
    return {name: budget_limit(name, value, path) for name, value in limits.items()}


def budget_limit(name, value, where):
    """A budget's limit as a number, checked (exit 2 when it is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GraphscanError(f"usage: {where}: budget {name} must be a finite number, not {value!r}", EXIT_USAGE)
    if name in ("max_float", "max_islands", "max_crossings") and (value < 0 or value != int(value)):
        raise GraphscanError(f"usage: {where}: budget {name} must be a whole number >= 0", EXIT_USAGE)
    if name == "min_int8" and not 0 <= value <= 1:
        raise GraphscanError(f"usage: {where}: budget min_int8 is a fraction between 0 and 1", EXIT_USAGE)
    return int(value) if name.startswith("max_") else float(value)


def measured_sqnr(float_path, quant_path, inputs, shape, seed):
    """The quantized model's output SQNR against the float one, as ``impact``
    measures its baseline: ``inf`` when the outputs are equal, ``nan`` when the
    SQNR is undefined (NaN or Inf in the outputs, all-zero float outputs)."""
    float_model, quant_model = load_with_weights(float_path), load_with_weights(quant_path)
    check_same_inputs(float_model, quant_model, float_path, quant_path)
    if len(float_model.graph.output) != len(quant_model.graph.output):
        raise GraphscanError(
            f"{shown(float_path)} and {shown(quant_path)}: the models' outputs differ in number", EXIT_INPUTS
        )
    samples, _ = model_samples(float_model, inputs, parse_shapes(shape), seed, 1)
    noise = OutputNoise(float_outputs(float_model, samples, float_path))
    sqnr, exact = noise.measure(float_outputs(quant_model, samples, quant_path))
    if exact:
        return math.inf
    return math.nan if sqnr is None else sqnr


def budget_values(path, names, float_path, inputs, shape, seed):
    """The measured value of each budget in ``names``."""
    values = {}
    if {"max_float", "max_islands", "max_crossings"} & set(names):
        index = index_model(path)
        islands_found = float_islands(index)
        values["max_float"] = len(index.float_nodes)
        values["max_islands"] = len(islands_found)
        values["max_crossings"] = boundary_report(index, islands_found)["crossings"]
    if "min_int8" in names:
        classes = runtime(path)["classes"]
        running = classes["int8"] + classes["int8_data"] + classes["float"]
        values["min_int8"] = (classes["int8"] + classes["int8_data"]) / running if running else 0.0
    if "min_sqnr" in names:
        if float_path is None:
            raise GraphscanError("usage: --min-sqnr needs --float F.onnx", EXIT_USAGE)
        values["min_sqnr"] = measured_sqnr(float_path, path, inputs, shape, seed)
    return values


def budget_holds(name, value, limit):
    if BUDGETS[name][1] == "max":
        return value <= limit
    return value >= limit  # an SQNR of inf (equal outputs) holds, nan does not


def check(
    path,
    float=None,
    budget=None,
    max_float=None,
    max_islands=None,
    max_crossings=None,
    min_int8=None,
    min_sqnr=None,
    inputs=None,
    shape=None,
    seed=0,
):
    """Measure each budget given (options override the --budget file) and say which hold."""
    limits = read_budget_file(budget) if budget is not None else {}
    given = {
        "max_float": max_float,
        "max_islands": max_islands,
        "max_crossings": max_crossings,
        "min_int8": min_int8,
        "min_sqnr": min_sqnr,
    }
    for name, value in given.items():
        if value is not None:
            limits[name] = budget_limit(name, value, f"--{name.replace('_', '-')}")
    if not limits:
        raise GraphscanError(
            "usage: check needs at least one budget (--budget FILE or "
            f"--{' / --'.join(n.replace('_', '-') for n in BUDGETS)})",
            EXIT_USAGE,
        )
    check_readable(path)
    names = [name for name in BUDGETS if name in limits]  # a fixed order, whatever the file's
    values = budget_values(path, names, float, inputs, shape, seed)
    budgets = [
        {
            "name": name,
            "value": values[name] if math.isfinite(values[name]) else None,  # strict JSON
            "limit": limits[name],
            "ok": budget_holds(name, values[name], limits[name]),
        }
        for name in names
    ]
    return {"model": path, "float": float, "budgets": budgets, "ok": all(b["ok"] for b in budgets)}


# --format table: aligned plain text for people
#
# The JSON answer is the contract. A table is rendered from it after the
# command returns, so it can never change what a program reads; renderers
# are ``(answer, top) -> str`` and every line fits TABLE_WIDTH columns.

TABLE_WIDTH = 80
CUT = "..."
MIN_COLUMN = 8  # a column is never cut narrower than this


def middle_cut(text, width):
    """``text`` in at most ``width`` characters, its middle replaced by ``...``.

    Both ends stay: a layer's prefix and its op suffix are what tell names apart.
    """
    if len(text) <= width:
        return text
    if width <= len(CUT):
        return text[:width]
    keep = width - len(CUT)
    head = (keep + 1) // 2
    return text[:head] + CUT + text[len(text) - (keep - head) :]


def cell(value):
    """A value as table text: floats in 3 significant digits, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value).replace("\n", "\\n")  # one row per line, whatever a name holds


def is_number(value):
    """An int or float, not a bool: what a table aligns to the right."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_table(titles, rows, width=TABLE_WIDTH, cut_first=()):
    """Aligned columns, numbers to the right. Until each line fits ``width``, the
    columns titled in ``cut_first`` and then the widest ones are cut in the middle
    (never below MIN_COLUMN)."""
    texts = [[cell(v) for v in row] for row in rows]
    right = [
        any(is_number(row[k]) for row in rows) and all(is_number(row[k]) or row[k] is None for row in rows)
        for k in range(len(titles))
    ]
    widths = [max([len(t)] + [len(row[k]) for row in texts]) for k, t in enumerate(titles)]
    first = [k for k, t in enumerate(titles) if t in cut_first]

    def weight(k):  # cut_first columns go first; the first column (names) may keep twice any other's width
        if widths[k] <= MIN_COLUMN:
            return 0
        return widths[k] * (1000 if k in first else 1) / (2 if k == 0 else 1)

    while sum(widths) + 2 * (len(widths) - 1) > width and max(widths) > MIN_COLUMN:
        widths[max(range(len(widths)), key=weight)] -= 1
    lines = []
    for row in [list(titles)] + texts:
        parts = []
        for k, text in enumerate(row):
            text = middle_cut(text, widths[k])
            parts.append(text.rjust(widths[k]) if right[k] else text.ljust(widths[k]))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def format_fields(pairs, width=TABLE_WIDTH):
    """``key value`` pairs on as few lines as fit ``width``; long values cut in the middle."""
    lines, line = [], ""
    for key, value in pairs:
        text = f"{key} {middle_cut(cell(value), width - len(key) - 1)}"
        if line and len(line) + 3 + len(text) > width:
            lines.append(line)
            line = ""
        line = f"{line}   {text}" if line else text
    return "\n".join(lines + [line])


def format_names(names, width=TABLE_WIDTH, indent="  "):
    """Names separated by commas, wrapped to ``width``, each cut to fit one line."""
    lines, line = [], ""
    for name in names:
        name = middle_cut(cell(name), width - len(indent) - 1)
        if line and len(indent) + len(line) + len(name) + 3 > width:  # 3: ', ' now, ',' if wrapped
            lines.append(indent + line + ",")
            line = ""
        line = f"{line}, {name}" if line else name
    return "\n".join(lines + [indent + line])


def limited(rows, top):
    """The first ``top`` rows (all without ``--top``) and a note on what was left out."""
    if top is None or top >= len(rows):
        return rows, ""
    return rows[:top], f"({len(rows) - top} more not shown; --top {top})"


def section(title, titles, rows, top=None, cut_first=()):
    """A titled table of ``rows`` (``(none)`` when empty), cut to ``top`` rows with a note."""
    shown, note = limited(rows, top)
    parts = [title, format_table(titles, shown, cut_first=cut_first) if shown else "  (none)"]
    return "\n".join(parts + ([note] if note else []))


def page(*blocks):
    """Blocks of text separated by blank lines; empty blocks left out."""
    return "\n\n".join(b for b in blocks if b)


def by_count(counts):
    """``{key: count}`` items, largest count first, ties by key."""
    return sorted(counts.items(), key=lambda item: (-abs(item[1]), item[0]))


def graph_positions(path):
    """``{node name: position in graph.node}``, to show names in graph order."""
    return {name: i for i, name in enumerate(index_model(path).names)}


def islands_by_size(members, positions):
    """JSON positions of islands, largest first, ties by their first node in graph order."""

    def first(k):
        return min(positions.get(name, -1) for name in members[k])

    return sorted(range(len(members)), key=lambda k: (-len(members[k]), first(k)))


def op_summary(op_types):
    """``"Add 2, Relu"``: op types by count, largest first."""
    return ", ".join(f"{op} {n}" if n > 1 else op for op, n in by_count(Counter(op_types)))


def nodes_table(answer, top):
    """Op types and initializer dtypes, largest count first."""
    return page(
        format_fields([("model", answer["model"]), ("nodes", answer["nodes"]), ("op types", len(answer["op_types"]))]),
        section("op_type census", ["op_type", "count"], by_count(answer["op_types"]), top),
        section("initializers", ["dtype", "count"], by_count(answer["initializers"])),
    )


def qdq_table(answer, top):
    """The four Q/DQ counts."""
    counts = [(key, answer[key]) for key in ("quantize", "dequantize", "round_trips", "weight_dequantize")]
    return page(format_fields([("model", answer["model"])]), format_table(["Q/DQ", "count"], counts))


def island_rows(members, positions, extra):
    """One row per island, largest first: #, size, extra columns, first and last node in graph order."""
    rows = []
    for k in islands_by_size(members, positions):
        ordered = sorted(members[k], key=lambda name: positions.get(name, -1))
        rows.append([k + 1, len(ordered), *extra(k), ordered[0], ordered[-1]])
    return rows


def islands_table(answer, top):
    """Islands largest first, then each shown island's members in graph order."""
    positions = graph_positions(answer["model"])
    islands_list = answer["islands"]
    members = [island["nodes"] for island in islands_list]
    rows = island_rows(members, positions, lambda k: [op_summary(islands_list[k]["op_types"])])
    shown, _ = limited(rows, top)
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


def boundary_table(answer, top):
    """DQs in and Qs out per island, largest island first."""
    positions = graph_positions(answer["model"])
    per_island = answer["per_island"]
    members = [island["nodes"] for island in per_island]
    rows = island_rows(members, positions, lambda k: [per_island[k]["in_dequantize"], per_island[k]["out_quantize"]])
    return page(
        format_fields(
            [("model", answer["model"]), ("island_count", answer["island_count"]), ("crossings", answer["crossings"])]
        ),
        section("crossings per island, largest first", ["#", "size", "DQ in", "Q out", "first", "last"], rows, top),
    )


def diff_table(answer, top):
    """The count deltas, then op types by the size of their change."""
    deltas = [(key, answer[key]) for key in answer if key.endswith("_delta") and key != "op_delta"]
    return page(
        format_fields([("a", answer["a"]), ("b", answer["b"])]),
        format_table(["b - a", "delta"], deltas),
        section("op_delta, largest change first", ["op_type", "delta"], by_count(answer["op_delta"]), top),
    )


def fuse_table(answer, top):
    """What was fused and what was skipped, in graph order."""
    fused = [[f["matmul"], f["add"], f["gemm"]] for f in answer["fused"]]
    skipped = [[s["node"], s["reason"]] for s in answer["skipped"]]
    return page(
        format_fields(
            [
                ("model", answer["model"]),
                ("output", answer["output"]),
                ("fused", len(fused)),
                ("skipped", len(skipped)),
                ("max_abs_error", answer["max_abs_error"]),
            ]
        ),
        section("fused", ["matmul", "add", "gemm"], fused, top),
        section("skipped", ["matmul", "reason"], skipped, top),
    )


def input_fields(inputs, defaulted=None):
    """``inputs`` of a trace/impact answer as header pairs: the shapes, then the
    inputs whose symbolic dimensions were set to 1 because nothing said otherwise."""
    pairs = [(f"input {name}", "x".join(map(str, shape))) for name, shape in inputs.items()]
    if defaulted:
        pairs.append(("defaulted to 1", ", ".join(defaulted)))
    return pairs


def largest_first(rows, key):
    """Rows with a value for ``key``, largest first (ties keep their order)."""
    return sorted((r for r in rows if r.get(key) is not None), key=lambda r: -r[key])


def trace_table(answer, top):
    """Rows in graph order; with ``top``, the largest isolated and the largest propagated errors."""
    columns = ["node", "op_type", "wrap", "isolated", "propag.", "lsb", "sqnr_db"]  # short: 80 columns
    keys = ["node", "op_type", "wrapped", "isolated_max_abs", "propagated_max_abs", "isolated_lsb", "sqnr_db"]
    if any("clipped" in row for row in answer["ops"]):
        columns.append("clipped")
        keys.append("clipped")

    def rows(ops):
        return [[row.get(key) for key in keys] for row in ops]

    def headline(key):
        value = answer.get(key)
        return (key, f"{value['node']} ({value['max_abs']:.3g})" if value else None)

    head = format_fields(
        [("a", answer["a"]), ("b", answer["b"])]
        + input_fields(answer["inputs"], answer.get("defaulted"))
        + [(f"output {name} max_abs", error) for name, error in answer["outputs"].items()]
        + [headline("worst_isolated"), headline("first_over"), ("ops", len(answer["ops"]))]
    )
    if top is None:
        body = [section("ops in graph order", columns, rows(answer["ops"]), cut_first=["op_type"])]
    else:
        body = [
            section(
                "ops by isolated error",
                columns,
                rows(largest_first(answer["ops"], "isolated_max_abs")),
                top,
                ["op_type"],
            ),
            section(
                "ops by propagated error",
                columns,
                rows(largest_first(answer["ops"], "propagated_max_abs")),
                top,
                ["op_type"],
            ),
        ]
    unmatched = [[u["node"], u["op_type"], u["reason"]] for u in answer["unmatched"]]
    return page(head, *body, section("unmatched float nodes", ["node", "op_type", "reason"], unmatched, top))


def node_us(answer, node):
    """A node's kernel microseconds per run, when ``--time`` measured it."""
    return (answer.get("time") or {}).get("nodes", {}).get(node["node"])


def runtime_table(answer, top):
    """Classes by op type and nodes in graph order (slowest first with ``top`` and ``--time``)."""
    env = answer["environment"]
    head = format_fields(
        [
            ("model", answer["model"]),
            ("onnxruntime", env.get("onnxruntime")),
            ("provider", env.get("provider")),
            ("level", env.get("level")),
            ("machine", env.get("machine")),
            ("int8_allowed", env.get("int8_allowed")),
            ("compute", answer["compute"]),
            ("wrapped", answer["wrapped"]),
        ]
        + [(name, answer["classes"].get(name, 0)) for name in RUNTIME_CLASSES]
        + [("wrapped_but_float", answer["wrapped_but_float"]), ("float_but_int8", answer["float_but_int8"])]
    )
    by_op = sorted(answer["by_op_type"].items(), key=lambda item: (-sum(item[1].values()), item[0]))
    op_rows = [[op] + [counts.get(name, 0) for name in RUNTIME_CLASSES] for op, counts in by_op]
    timed = "time" in answer
    nodes_list = answer["nodes"]
    title = "nodes in graph order"
    if timed and top is not None:
        nodes_list = sorted(nodes_list, key=lambda n: -(node_us(answer, n) or 0))
        title = "nodes by kernel time"
    node_rows = [
        [n["node"], n["op_type"], n["wrapped"], n["class"], n["kernel"], (n.get("reason") or {}).get("code")]
        + ([node_us(answer, n)] if timed else [])
        for n in nodes_list
    ]
    node_titles = ["node", "op_type", "wrapped", "class", "kernel", "reason"] + (["us"] if timed else [])
    blocks = [
        head,
        section("by op_type", ["op_type"] + RUNTIME_CLASSES, op_rows),
        section(title, node_titles, node_rows, top, ["op_type"]),
    ]
    if timed:
        time = answer["time"]
        numbers = [[key, time[key]] for key in ("runs", "profiler_floor_us", "round_trip_cost")]
        numbers += [[f"wall_ms {key}", value] for key, value in time["wall_ms"].items()]
        numbers += [[f"share {kind}", share] for kind, share in time["shares"].items()]
        blocks.append(section("time", ["what", "value"], numbers))
        blocks.append("method: " + time["method"])
    return page(*blocks)


def impact_table(answer, top):
    """Ops and tensors in the answer's order (largest gain first), and the exclusion found."""
    head = format_fields(
        [("a", answer["a"]), ("b", answer["b"])]
        + input_fields(answer["inputs"], answer.get("defaulted"))
        + [("samples", answer["samples"]), ("output_sqnr_db", answer["output_sqnr_db"])]
    )
    ops = [[r["node"], r["op_type"], r["sqnr_db"], r["gain_db"]] for r in answer["ops"]]
    tensors = [
        [r["tensor"], r["producer"], r["gain_db"], r["rounding_gain_db"], r["clipped"]] for r in answer["tensors"]
    ]
    blocks = [
        head,
        section("ops by output gain when kept float", ["node", "op_type", "sqnr_db", "gain_db"], ops, top),
        section(
            "tensors by output gain when kept float",
            ["tensor", "producer", "gain_db", "rounding", "clipped"],
            tensors,
            top,
        ),
    ]
    exclude = answer.get("exclude")
    if exclude is not None:
        blocks.append(
            format_fields([(key, exclude[key]) for key in ("target_sqnr_db", "sqnr_db", "reached")])
            + "\nnodes_to_exclude:\n"
            + format_names(exclude["nodes"])
        )
    return page(*blocks)


def generic_table(answer, top):
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


TABLE_RENDERERS = {
    "nodes": nodes_table,
    "qdq": qdq_table,
    "islands": islands_table,
    "boundary": boundary_table,
    "diff": diff_table,
    "fuse": fuse_table,
    "trace": trace_table,
    "runtime": runtime_table,
    "impact": impact_table,
}


def render_table(command, answer, top=None):
    """The answer of ``command`` as text for a terminal (commands without a renderer get a generic one)."""
    return TABLE_RENDERERS.get(command, generic_table)(answer, top)


# --------------------------------------------------------------------------
# dot: the island map as a Graphviz picture (for people; the JSON is the contract)
#
# Compute nodes only: every Q/DQ chain between two of them is folded into the
# edge's label (Q→DQ is a round trip), chains that start at an initializer
# (weights) are hidden, and each float island is a cluster.

COLOURS = {  # node kind: (fill colour, its name in the picture's legend)
    "int8": ("#1b9e77", "dark green"),
    "int8_data": ("#a6dba0", "light green"),
    "wrapped": ("#a6dba0", "green"),
    "float": ("#f4a582", "orange"),
    "absorbed": ("#d9d9d9", "grey"),
    "unknown": ("#ffffff", "white"),
}
DOT_NAME_WIDTH = 32  # node labels cut in the middle beyond this
COLLAPSE_HINT = 500  # compute nodes above which --collapse is worth it


def dot_quote(text):
    """A DOT string literal in ASCII: backslashes and quotes escaped, newlines as \\n,
    ``&`` and every non-ASCII character as an HTML entity (Graphviz decodes them), so
    the DOT prints on any terminal."""
    text = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("&", "&amp;")
    return '"' + text.encode("ascii", "xmlcharrefreplace").decode("ascii") + '"'


def dot_attributes(**attributes):
    """``[key="value", ...]`` with every value quoted."""
    return "[" + ", ".join(f"{key}={dot_quote(str(value))}" for key, value in attributes.items()) + "]"


def folded_edges(index):
    """``[(source id, target id, label)]`` between compute nodes (``n<i>``), graph
    inputs (``in<k>``) and outputs (``out<k>``), each Q/DQ chain folded into the
    label; chains from initializers are dropped. Distinct, in graph order."""
    graph = index.graph
    input_ids = {info.name: f"in{k}" for k, info in enumerate(value_inputs(graph))}
    edges = {}

    def link(tensor, target):
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


def wrapped_runs(index, edges, kinds):
    """Groups of wrapped compute nodes of one kind joined by edges between them
    (a float node always ends a group), in graph order; only groups of two or more."""
    group = {i: i for i in index.compute_nodes if index.wrapped[i]}

    def root(i):
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    for source, target, _ in edges:
        if source.startswith("n") and target.startswith("n"):
            p, i = int(source[1:]), int(target[1:])
            if p in group and i in group and kinds[p] == kinds[i]:
                group[root(i)] = root(p)
    members = {}
    for i in group:
        members.setdefault(root(i), []).append(i)
    return [run for run in members.values() if len(run) > 1]


def runtime_classes(path):
    """``{node name: runtime class}`` from the ``runtime`` command (issue 8)."""
    runtime_command = globals().get("runtime")
    if runtime_command is None:
        raise GraphscanError(
            "usage: dot --runtime needs the runtime command, which this graphscan.py does not have", EXIT_USAGE
        )
    return {node["node"]: node["class"] for node in runtime_command(path)["nodes"]}


def unlinked_groups(index, edges, kinds):
    """Wrapped compute nodes no edge of the picture touches (Constants that only
    set a Q's scale or zero point), grouped by kind in graph order; groups of two or more."""
    linked = {ident for source, target, _ in edges for ident in (source, target)}
    groups = {}
    for i in index.compute_nodes:
        if index.wrapped[i] and f"n{i}" not in linked:
            groups.setdefault(kinds[i], []).append(i)
    return [members for members in groups.values() if len(members) > 1]


def node_kinds(index, path, runtime_colours):
    """``{compute node: kind}``: wrapped/float, or the runtime command's class."""
    if not runtime_colours:
        return {i: "wrapped" if index.wrapped[i] else "float" for i in index.compute_nodes}
    by_name = runtime_classes(path)
    kinds = {i: by_name.get(index.names[i]) for i in index.compute_nodes}
    return {i: kind if kind in COLOURS else "unknown" for i, kind in kinds.items()}


def dot_header(path, index, kinds, island_count):
    """The picture's title (with its colour legend) and default styles."""
    counts = Counter(kinds.values())
    legend = ", ".join(f"{counts[kind]} {kind} ({COLOURS[kind][1]})" for kind in COLOURS if counts[kind])
    title = (
        f"{path}: {len(index.compute_nodes)} compute nodes ({legend}), {island_count} float islands;"
        " edge labels: the Q/DQ between two nodes (Q→DQ = a round trip)"
    )
    # pack: disconnected parts (lone Constants, islands of one) are laid out in a grid, not one wide row.
    graph = dot_attributes(label=title, labelloc="t", fontname="Helvetica", pack="true", packmode="array_u8")
    return [
        f"  graph {graph};",
        "  node " + dot_attributes(shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10") + ";",
        "  edge " + dot_attributes(fontname="Helvetica", fontsize="8") + ";",
    ]


def dot(path, runtime_colours=False, collapse=False):
    """The island map of ``path`` as Graphviz DOT text."""
    index = index_model(path)
    names = index.names
    kinds = node_kinds(index, path, runtime_colours)
    islands = float_islands(index)
    edges = folded_edges(index)
    boxes = unlinked_groups(index, edges, kinds) + (wrapped_runs(index, edges, kinds) if collapse else [])
    box_of = {i: k for k, members in enumerate(boxes) for i in members}

    def node_line(i):
        label = middle_cut(names[i], DOT_NAME_WIDTH) + "\n" + index.op_types[i]
        return f"n{i} {dot_attributes(label=label, tooltip=names[i], fillcolor=COLOURS[kinds[i]][0])};"

    lines = ["digraph graphscan {"] + dot_header(path, index, kinds, len(islands))
    for k, info in enumerate(value_inputs(index.graph)):
        lines.append(f"  in{k} {dot_attributes(label=info.name, shape='ellipse', style='')};")
    for k, output in enumerate(index.graph.output):
        lines.append(f"  out{k} {dot_attributes(label=output.name, shape='ellipse', style='')};")
    for number, (members, _) in enumerate(islands, 1):
        in_dq, out_q = boundary_of(index, members)
        label = (
            f"island {number}: {len(members)} nodes, {len(in_dq) + len(out_q)} crossings "
            f"({len(in_dq)} DQ in, {len(out_q)} Q out)"
        )
        lines.append(f"  subgraph cluster_island_{number} {{")
        lines.append("    graph " + dot_attributes(label=label, style="dashed", color="#b2182b") + ";")
        lines += ["    " + node_line(i) for i in sorted(members)]
        lines.append("  }")
    lines += ["  " + node_line(i) for i in index.compute_nodes if index.wrapped[i] and i not in box_of]
    for k, members in enumerate(boxes):
        first, last = (middle_cut(names[members[j]], DOT_NAME_WIDTH) for j in (0, -1))
        ops = middle_cut(op_summary(index.op_types[i] for i in members), 2 * DOT_NAME_WIDTH)
        label = f"{len(members)} {kinds[members[0]]} nodes: {ops}\n{first}\n…\n{last}"
        tooltip = "\n".join(names[i] for i in members)  # every member, for the reader (and the tests)
        colour = COLOURS[kinds[members[0]]][0]
        lines.append(f"  box{k} {dot_attributes(label=label, tooltip=tooltip, fillcolor=colour, penwidth='2')};")

    def drawn_as(ident):
        i = int(ident[1:]) if ident.startswith("n") else None
        return f"box{box_of[i]}" if i in box_of else ident

    drawn = set()
    for source, target, label in edges:
        key = (drawn_as(source), drawn_as(target), label)
        if key[0] != key[1] and key not in drawn:
            drawn.add(key)
            lines.append(f"  {key[0]} -> {key[1]}" + (f" {dot_attributes(label=label)};" if label else ";"))
    lines.append("}")
    return "\n".join(lines) + "\n"


# impact: which operator's quantization costs the output, and what to exclude
#
# One derived model answers every "what if X stayed float" question: the
# quantized model with Where(on, alternative, DQ(Q(t))) on exactly the edges a
# variant changes, each Where with its own boolean input. One session of it
# runs once per variant and sample; no session per variant.

IMPACT_SYMBOLIC_DIM_SIZE = 1
IMPACT_PREFIX = "graphscan."  # every node and tensor the derived model adds
ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")  # what the quantizer folds into a Q
DQ_OUTPUT_SUFFIX = re.compile(r"_DequantizeLinear_Output(?:_\d+)?$")


def constant_arrays(graph):
    """``{tensor: LazyArray}`` for initializers and Constant nodes with a ``value``."""
    arrays = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for attribute in node.attribute:
                if attribute.name == "value":
                    arrays[node.output[0]] = attribute.t
    return {name: LazyArray(proto) for name, proto in arrays.items()}


class LazyArray:
    """A TensorProto turned into numpy only when asked (most are never read)."""

    def __init__(self, proto):
        self.proto = proto

    @functools.cached_property
    def array(self):
        return onnx.numpy_helper.to_array(self.proto)


def quant_range(q_node, constants):
    """``(lo, hi, elem_type)``: the float range a Q can represent, or None when
    its scale or zero point is not a scalar constant."""
    import numpy as np

    scale = constants.get(q_node.input[1]) if len(q_node.input) > 1 else None
    if scale is None or scale.array.size != 1:
        return None
    zero = constants.get(q_node.input[2]) if len(q_node.input) > 2 and q_node.input[2] else None
    if zero is not None:
        if zero.array.size != 1:
            return None
        qtype, zp = zero.proto.data_type, float(zero.array.reshape(-1)[0])
    else:
        attrs = {a.name: a.i for a in q_node.attribute if a.type == onnx.AttributeProto.INT}
        qtype, zp = attrs.get("output_dtype") or onnx.TensorProto.UINT8, 0.0
    if qtype not in Q_RANGES:
        return None
    qmin, qmax = Q_RANGES[qtype]
    s = float(np.float64(scale.array.reshape(-1)[0]))
    return (qmin - zp) * s, (qmax - zp) * s, scale.proto.data_type


def float_activation(float_index, quant_index, tensor):
    """The Relu/Clip/LeakyRelu the quantizer absorbed into the Q of ``tensor``.

    Returns the float model's node (None when nothing was absorbed): its
    producer of the name (without ORT's QDQ suffix when the float model has
    no tensor of that name, as for a renamed graph output) is an activation
    while the quantized model's producer is another op type.
    """
    float_producer = float_index.producer_of(tensor)
    if float_producer is None:
        float_producer = float_index.producer_of(QDQ_SUFFIX.sub("", tensor))
    quant_producer = quant_index.producer_of(tensor)
    if float_producer is None or quant_producer is None:
        return None
    op_type = float_index.op_types[float_producer]
    if op_type not in ACTIVATIONS or quant_index.op_types[quant_producer] == op_type:
        return None
    return float_index.graph.node[float_producer]


def activation_bounds(node, float_constants):
    """``(lo, hi)`` such that Clip(t, lo, hi) is ``node`` (Relu or Clip); None otherwise."""
    if node.op_type == "Relu":
        return 0.0, math.inf
    if node.op_type != "Clip":
        return None
    bounds = [-math.inf, math.inf]
    for a in node.attribute:  # opset < 11
        if a.name in ("min", "max"):
            bounds[a.name == "max"] = a.f
    for k, name in enumerate(node.input[1:3]):
        if name:
            value = float_constants.get(name)
            if value is None or value.array.size != 1:
                return None
            bounds[k] = float(value.array.reshape(-1)[0])
    return tuple(bounds)


class ImpactPlan:
    """The sites of ``impact``: every DQ(Q(t)) pair, every weight DQ with a
    float twin, the op rows and the tensor rows, all as quantized-graph indices.

    ``op_rows``: ``[(node, [(input position, ("pair", dq) | ("weight", name))])]``.
    ``tensor_rows``: ``[(t, [(q, dq)], first Q's range or None, absorbed node or None)]``.
    """

    def __init__(self, float_model, quant_model):
        graph, fgraph = quant_model.graph, float_model.graph
        self.index = index = GraphIndex(graph)
        self.float_index = GraphIndex(fgraph)
        self.constants = constant_arrays(graph)
        self.float_constants = constant_arrays(fgraph)
        float_inits = {init.name: init for init in fgraph.initializer}
        quant_inits = {init.name: init for init in graph.initializer}
        self.pair_of = {}  # dq -> (q, t)
        for dq in index.dq_nodes:
            q = index.producer_of(graph.node[dq].input[0])
            if q is not None and index.is_q[q]:
                self.pair_of[dq] = (q, graph.node[q].input[0])
        self.weight_of = {}  # dq -> float initializer name
        for dq in index.dq_nodes:
            source = graph.node[dq].input[0]
            twin = float_inits.get(DQ_OUTPUT_SUFFIX.sub("", graph.node[dq].output[0]))
            scale = self.constants.get(graph.node[dq].input[1]) if len(graph.node[dq].input) > 1 else None
            if (
                source in quant_inits
                and twin is not None
                and list(twin.dims) == list(quant_inits[source].dims)
                and (scale is None or scale.proto.data_type == twin.data_type)  # Where needs one type
            ):
                self.weight_of[dq] = twin.name
        self.op_rows = []
        for i in index.compute_nodes:
            edges = []
            for pos, tensor in enumerate(graph.node[i].input):
                dq = index.producer_of(tensor) if tensor else None
                if dq in self.pair_of:
                    edges.append((pos, ("pair", dq)))
                elif dq in self.weight_of:
                    edges.append((pos, ("weight", self.weight_of[dq])))
            if edges:
                self.op_rows.append((i, edges))
        rows = {}
        for dq, (q, t) in sorted(self.pair_of.items(), key=lambda item: item[1][0]):
            producer = index.producer_of(t)
            if t in quant_inits or (producer is not None and index.op_types[producer] == "Constant"):
                continue  # a weight, not an activation
            rows.setdefault(t, []).append((q, dq))
        self.tensor_rows = []
        for t, pairs in rows.items():
            q_range = quant_range(graph.node[pairs[0][0]], self.constants)
            self.tensor_rows.append((t, pairs, q_range, self.absorbed(t)))

    def absorbed(self, tensor):
        return float_activation(self.float_index, self.index, tensor)


class SwitchedModelBuilder:
    """Builds the derived model: DQ outputs renamed, Where on each changed edge.

    Every Where reads its own boolean graph input, and the bounds of each
    Clip are scalar graph inputs: a variant is a few inputs set on the host,
    with no Or or scalar nodes running for every variant. ``defaults`` holds
    each added input's value while no variant is on.
    """

    def __init__(self, plan, quant_model):
        self.plan = plan
        self.model = onnx.ModelProto()
        self.model.CopyFrom(quant_model)
        self.graph = self.model.graph
        self.nodes = []  # new nodes, appended after the graph (ORT sorts topologically)
        self.defaults = {}
        self.cache = {}

    def scalar_input(self, name, value, elem_type):
        import numpy as np

        self.graph.input.append(onnx.helper.make_tensor_value_info(name, elem_type, []))
        self.defaults[name] = np.array(value, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem_type))
        return name

    def constant(self, name, value, elem_type):
        import numpy as np

        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        self.graph.initializer.append(onnx.numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def node(self, op_type, inputs, output, **attributes):
        name = output if output.startswith(IMPACT_PREFIX) else f"{IMPACT_PREFIX}keep/{output}"
        self.nodes.append(onnx.helper.make_node(op_type, inputs, [output], name=name, **attributes))
        return output

    def where(self, alternative, raw, output=None):
        """``Where(on, alternative, raw)`` with a new condition input; returns (output, condition)."""
        key = ("where", alternative, raw, output)
        if key not in self.cache:
            condition = self.scalar_input(f"{IMPACT_PREFIX}on/{len(self.defaults)}", False, onnx.TensorProto.BOOL)
            output = output or f"{IMPACT_PREFIX}where/{condition}"
            self.cache[key] = (self.node("Where", [condition, alternative, raw], output), condition)
        return self.cache[key]


def float_value(builder, plan, t, absorbed):
    """float(t) as a tensor of the derived model: t, or the absorbed activation on t."""
    if absorbed is None:
        return t
    name = f"graphscan.float/{t}"
    if ("float", t) not in builder.cache:
        node = onnx.NodeProto()
        node.CopyFrom(absorbed)
        node.name = name
        inputs = [t]
        for k, extra in enumerate(absorbed.input[1:], start=1):
            if extra and extra in plan.float_constants:
                value = plan.float_constants[extra]
                extra = builder.constant(f"graphscan.float/{t}/{k}", value.array, value.proto.data_type)
            inputs.append(extra)
        node.input[:] = inputs
        node.output[:] = [name]
        builder.nodes.append(node)
        builder.cache[("float", t)] = name
    return name


def tensor_alternative(builder, plan, t, q_range, absorbed):
    """``(value, rounding settings)``: what readers of DQ(Q(t)) take when their
    Where is on: float(t), or Clip(t, lo, hi) with the settings applied (None
    when the Q's range is unknown)."""
    if q_range is None:
        return float_value(builder, plan, t, absorbed), None
    lo, hi, elem_type = q_range
    bounds = (-math.inf, math.inf) if absorbed is None else activation_bounds(absorbed, plan.float_constants)
    prefix = f"graphscan.range/{t}"
    if bounds is None:  # LeakyRelu (or a Clip with computed bounds): its own node
        lo_name = builder.constant(prefix + "/lo", lo, elem_type)
        hi_name = builder.constant(prefix + "/hi", hi, elem_type)
        clipped = builder.node("Clip", [t, lo_name, hi_name], f"graphscan.round/{t}")
        alternative, condition = builder.where(clipped, float_value(builder, plan, t, absorbed), f"graphscan.alt/{t}")
        return alternative, {condition: True}
    # Clip(t, -inf, inf) is t and Clip(t, 0, inf) is Relu(t), exactly; the
    # rounding variant binds the Q's range instead.
    low = builder.scalar_input(prefix + "/lo", bounds[0], elem_type)
    high = builder.scalar_input(prefix + "/hi", bounds[1], elem_type)
    dtype = builder.defaults[low].dtype
    import numpy as np

    rounding = {low: np.array(lo, dtype), high: np.array(hi, dtype)}
    return builder.node("Clip", [t, low, high], f"graphscan.alt/{t}"), rounding


def switched_model(plan, quant_model, float_model):
    """The derived model and its variants: ``(model, defaults, op_variants, tensor_variants)``.

    A variant is ``{input name: value}`` to bind instead of ``defaults``.
    ``op_variants[k]`` un-quantizes op row k; ``tensor_variants[m]`` is
    ``(float(t) variant, rounding-only variant or None)`` for tensor row m.
    """
    builder = SwitchedModelBuilder(plan, quant_model)
    graph, index = builder.graph, plan.index
    float_inits = {init.name: init for init in float_model.graph.initializer}
    alternatives, rounding = {}, {}  # per dq: float(t) (or its Clip), per tensor row: settings
    row_of = {}
    for m, (t, pairs, q_range, absorbed) in enumerate(plan.tensor_rows):
        alternative, rounding[m] = tensor_alternative(builder, plan, t, q_range, absorbed)
        for _, dq in pairs:
            alternatives[dq], row_of[dq] = alternative, m
    for _, edges in plan.op_rows:  # pairs only ops read: weights kept as Constant -> Q -> DQ
        for _, (kind, source) in edges:
            if kind == "pair" and source not in alternatives:
                t = plan.pair_of[source][1]
                alternatives[source] = float_value(builder, plan, t, plan.absorbed(t))
    raw = {}
    for dq in alternatives:
        raw[dq] = f"graphscan.dq/{graph.node[dq].output[0]}"
        graph.node[dq].output[0] = raw[dq]
    op_rows = {i: k for k, (i, _) in enumerate(plan.op_rows)}
    op_variants = [{} for _ in plan.op_rows]
    tensor_on = [{} for _ in plan.tensor_rows]
    # Graph outputs and names If/Loop/Scan bodies read from outside keep the
    # DQ's name, now given to the switched value.
    kept_names = {o.name for o in graph.output}.union(*(body_reads(node) for node in graph.node))
    for dq, alternative in alternatives.items():
        output = quant_model.graph.node[dq].output[0]
        m = row_of.get(dq)
        for reader in index.consumers_of(output):
            if m is None and reader not in op_rows:
                continue  # nobody would switch it
            node = graph.node[reader]
            value, condition = builder.where(alternative, raw[dq], f"graphscan.where/{reader}/{output}")
            node.input[:] = [value if t == output else t for t in node.input]
            if reader in op_rows:
                op_variants[op_rows[reader]][condition] = True
            if m is not None:
                tensor_on[m][condition] = True
        if output in kept_names:
            if m is None:
                builder.node("Identity", [raw[dq]], output)
            else:
                _, condition = builder.where(alternative, raw[dq], output)
                tensor_on[m][condition] = True
    for k, (i, edges) in enumerate(plan.op_rows):
        node = graph.node[i]
        for pos, (kind, source) in edges:
            if kind == "weight":
                weight = f"graphscan.weight/{source}"
                if ("weight", source) not in builder.cache:
                    copy = onnx.TensorProto()
                    copy.CopyFrom(float_inits[source])
                    copy.name = weight
                    graph.initializer.append(copy)
                    builder.cache[("weight", source)] = weight
                value, condition = builder.where(weight, node.input[pos], f"graphscan.where/{i}/{pos}")
                node.input[pos] = value
                op_variants[k][condition] = True
    graph.node.extend(builder.nodes)
    tensor_variants = [(on, None if rounding[m] is None else {**on, **rounding[m]}) for m, on in enumerate(tensor_on)]
    return builder.model, builder.defaults, op_variants, tensor_variants


# A variant changes the graph only from its sites on, and only along their
# cone. The derived model's data-dependent nodes are cut into segments of
# about equal work, each its own session: "plain" (the quantized model's
# nodes, no switch machinery) or with the Where and Clip nodes of some or all
# of its sites (see SegmentPlan). The baseline run keeps every value that
# crosses a segment boundary as an OrtValue; a variant runs only the segments
# of its cone, switched only where its own sites are, and reads every other
# value from the baseline's without a copy. Nodes that read no data (weight
# DQs, Constants) run once, before everything.
IMPACT_SEGMENTS = 16
SWITCH_GROUPS = 8
PLAIN, FULL = "plain", "switched"  # segment versions besides the groups 0 .. SWITCH_GROUPS - 1
ORT_TENSOR_TYPES = {onnx.TensorProto.DataType.Name(t).lower(): t for t in onnx.TensorProto.DataType.values()}


class Unsegmentable(Exception):
    """A value crosses a segment boundary that a segment's inputs cannot declare (not a tensor)."""


def body_reads(node):
    """Every name the If/Loop/Scan bodies of ``node`` read or output (any depth)."""
    return set(node_reads(node)[len([t for t in node.input if t]) :])


def outer_reads(node, defined):
    """The names ``node`` reads from its graph: its inputs, then the names from ``defined`` its bodies read."""
    return [t for t in node.input if t] + sorted(body_reads(node) & defined)


def topological_nodes(nodes, reads):
    """``nodes`` in an order where every producer comes first; each node stays
    where it was unless a node it reads from comes later. ``reads(node)``: the
    names it reads, bodies included."""
    producer = {t: k for k, node in enumerate(nodes) for t in node.output if t}
    emitted, order = [False] * len(nodes), []
    for root in range(len(nodes)):
        stack = [(root, False)]
        while stack:
            k, ready = stack.pop()
            if emitted[k]:
                continue
            if ready:
                emitted[k] = True
                order.append(k)
                continue
            stack.append((k, True))
            for t in reversed(reads(nodes[k])):
                j = producer.get(t)
                if j is not None and not emitted[j] and j != k:
                    stack.append((j, False))
    return [nodes[k] for k in order]


def known_shapes(model, nodes, sample):
    """``{tensor: dims}`` for every tensor whose shape inference gives in full,
    with the graph inputs shaped as in ``sample``."""
    import numpy as np

    typed = onnx.ModelProto()
    typed.CopyFrom(model)
    del typed.graph.node[:]
    typed.graph.node.extend(nodes)
    for info in typed.graph.input:
        if info.name in sample and info.type.HasField("tensor_type"):
            shape = info.type.tensor_type.shape
            del shape.dim[:]
            for size in np.shape(sample[info.name]):
                shape.dim.add().dim_value = size
    with contextlib.suppress(Exception):  # else: the shapes the model already declares
        typed = onnx.shape_inference.infer_shapes(typed, strict_mode=False, data_prop=True)
    shapes = {init.name: list(init.dims) for init in model.graph.initializer}
    for info in [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes[info.name] = [d.dim_value for d in tensor.shape.dim]
    return shapes


def node_work(node, shapes):
    """A node's rough work: its output elements, times the length of the sums
    behind each for Conv, ConvTranspose, MatMul and Gemm; None when unknown."""
    outputs = [shapes.get(t) for t in node.output if t]
    if not outputs or None in outputs:
        return None
    elements = sum(math.prod(dims) for dims in outputs)
    read = [shapes.get(t) if t else None for t in node.input]
    if node.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm") and (len(read) < 2 or None in read[:2]):
        return None
    if node.op_type == "Conv":
        return elements * math.prod(read[1][1:])
    if node.op_type == "ConvTranspose":  # each input element feeds M/group x kernel outputs
        return math.prod(read[0]) * math.prod(read[1][1:])
    if node.op_type == "MatMul":
        return elements * (read[0][-1] if read[0] else 1)
    if node.op_type == "Gemm":
        trans = any(a.name == "transA" and a.i for a in node.attribute)
        return elements * (read[0][0 if trans else -1] if read[0] else 1)
    return elements


def equal_work_chunks(nodes, works, count):
    """``nodes`` (in order) cut into at most ``count`` runs of about equal work;
    a node of unknown work counts as the median node."""
    import statistics

    known = [w for w in works if w is not None]
    fill = statistics.median(known) if known else 1
    works = [max(1, fill if w is None else w) for w in works]
    total, done, cut, starts = sum(works), 0, 1, [0]
    for i, work in enumerate(works):
        while cut < count and done >= total * cut / count:
            if i > starts[-1]:
                starts.append(i)
            cut += 1
        done += work
    return [nodes[a:b] for a, b in zip(starts, [*starts[1:], len(nodes)])]


class SegmentPlan:
    """The cut of a derived model into segments of data-dependent nodes; which
    segments a variant needs, in which version; each version's model.

    ``constant_nodes`` read no data and run once. ``selections`` are the
    weights' Wheres, ``(output, condition, on, off)``: both choices are
    constants, so the runner binds one instead of running a node. A segment's
    machinery is split in SWITCH_GROUPS groups by the position of the node it
    feeds: version g of a segment has only group g's machinery, version FULL
    all of it, PLAIN none. With ``count`` 1 the one segment is the whole model.
    """

    def __init__(self, model, data_inputs, switches, machinery, count, sample):
        graph = self.graph = model.graph
        self.machinery = machinery  # names of the nodes graphscan added
        self.initializers = {init.name: init for init in graph.initializer if init.name not in data_inputs}
        defined = {t for node in graph.node for t in node.output if t}
        defined |= {i.name for i in graph.input} | set(self.initializers)
        nodes = list(graph.node)  # one wrapper per node: ids below name them
        self.reads = {id(node): outer_reads(node, defined) for node in nodes}
        nodes = topological_nodes(nodes, lambda node: self.reads[id(node)])
        data_tensors = set(data_inputs)
        self.constant_nodes, self.selections, dependent = [], [], []
        for node in nodes:
            reads_data = not data_tensors.isdisjoint(self.reads[id(node)])
            selection = node.op_type == "Where" and node.name in machinery and node.input[0] in switches
            if count > 1 and selection and not reads_data:  # a weight's Where
                self.selections.append((node.output[0], *node.input))
                continue
            # Other machinery runs only in a switched segment.
            if count == 1 or node.name in machinery or reads_data:
                data_tensors.update(t for t in node.output if t)
                dependent.append(node)
            else:
                self.constant_nodes.append(node)
        if count == 1 or not dependent:
            self.chunks = [dependent]
        else:
            shapes = known_shapes(model, nodes, sample)
            self.chunks = equal_work_chunks(dependent, [node_work(n, shapes) for n in dependent], count)
        self.segment_of = {id(node): j for j, chunk in enumerate(self.chunks) for node in chunk}
        self.made_by = {t: node for node in nodes for t in node.output if t}
        self.consumers = {}
        for node in nodes:
            for t in self.reads[id(node)]:
                self.consumers.setdefault(t, []).append(node)
        graph_outputs = self.graph_outputs = [o.name for o in graph.output]
        wanted = set(graph_outputs) | {t for selection in self.selections for t in selection[2:]}
        self.leaving = [[] for _ in self.chunks]
        for j in reversed(range(len(self.chunks))):
            made = [t for node in self.chunks[j] for t in node.output if t]
            self.leaving[j] = [t for t in made if t in wanted]
            wanted.update(t for node in self.chunks[j] for t in self.reads[id(node)])
        # by now, wanted: every name a segment or a selection reads, and the outputs
        self.constant_outputs = [t for node in self.constant_nodes for t in node.output if t in wanted]
        self.groups = self.switch_groups(graph_outputs)
        self.downstream = {}  # id(node) -> bit mask of the segments its value reaches
        for node in reversed(dependent):
            mask = 1 << self.segment_of[id(node)]
            for t in node.output:
                for reader in self.consumers.get(t, ()):
                    mask |= self.downstream.get(id(reader), 0)
            self.downstream[id(node)] = mask
        self.template = onnx.ModelProto()
        self.template.CopyFrom(model)
        self.template.ClearField("graph")

    def switch_groups(self, graph_outputs):
        """``{id(machinery node): groups}``: the groups of the nodes of its own
        segment it feeds; every group when a later segment, a body or the graph
        outputs read it."""
        groups, every = {}, frozenset(range(SWITCH_GROUPS))
        for chunk in self.chunks:
            readers = [node for node in chunk if node.name not in self.machinery]
            own = {id(node): k * SWITCH_GROUPS // len(readers) for k, node in enumerate(readers)}
            for node in reversed(chunk):
                if node.name not in self.machinery:
                    continue
                fed = set()
                for t in node.output:
                    for reader in self.consumers.get(t, ()):
                        fed.update([own[id(reader)]] if id(reader) in own else groups.get(id(reader), every))
                    if t in graph_outputs:
                        fed = every
                groups[id(node)] = frozenset(fed) or every
        return groups

    def needs(self, names):
        """``{segment: version}`` a variant setting the inputs ``names`` runs,
        in order: the segments of its cone, each PLAIN or switched as little as
        its own machinery needs."""
        active, seeds, stack, seen = [], [], list(names), set(names)
        while stack:  # forward through constant nodes, selections and switch machinery
            for node in self.consumers.get(stack.pop(), ()):
                dependent = id(node) in self.segment_of
                if dependent and node.name not in self.machinery:
                    seeds.append(node)
                    continue
                if dependent:
                    active.append(node)
                for t in node.output:
                    if t and t not in seen:
                        seen.add(t)
                        stack.append(t)
        # The machinery feeding active nodes (e.g. the Clip computing float(t)).
        feeding, stack = {id(n): n for n in active}, list(active)
        while stack:
            for t in self.reads[id(stack.pop())]:
                node = self.made_by.get(t)
                machine = node is not None and node.name in self.machinery and id(node) in self.segment_of
                if machine and id(node) not in feeding:
                    feeding[id(node)] = node
                    stack.append(node)
        versions = {}
        for node in feeding.values():
            j = self.segment_of[id(node)]
            versions[j] = versions.get(j, self.groups[id(node)]) & self.groups[id(node)]
        versions = {j: min(common) if common else FULL for j, common in versions.items()}
        cone = 0
        for node in seeds + active:
            cone |= self.downstream[id(node)]
        for j in range(len(self.chunks)):
            if cone >> j & 1:
                versions.setdefault(j, PLAIN)
        return dict(sorted(versions.items()))

    def segment_model(self, j, version, types):
        """``(model, inputs, outputs, aliases)`` of segment j in ``version``:
        ``j`` None is the constant nodes, ``("from", k)`` segments k to the last
        as one (making the graph outputs only). ``types``: ``{name: ORT type}``
        of every value it may read. Machinery a version leaves out passes one
        input on: its output is an ``alias`` ``(name, source)`` for the runner,
        or an Identity where a body reads it."""
        if j is None:
            chunk, leaving = self.constant_nodes, self.constant_outputs
        elif isinstance(j, tuple):
            chunk = [node for later in self.chunks[j[1] :] for node in later]
            leaving = [t for node in chunk for t in node.output if t in self.graph_outputs]
        else:
            chunk, leaving = self.chunks[j], self.leaving[j]
        dropped = {}
        for node in chunk:
            if node.name in self.machinery and not (version == FULL or version in self.groups[id(node)]):
                source = node.input[2] if node.op_type == "Where" else node.input[0]
                for t in node.output:
                    dropped[t] = dropped.get(source, source)
        nodes, reads = [], []
        for node in chunk:
            if any(t in dropped for t in node.output):
                continue
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.input[:] = [dropped.get(t, t) for t in node.input]
            nodes.append(copy)
            reads += [dropped.get(t, t) for t in node.input if t]
            reads += self.reads[id(node)][len([t for t in node.input if t]) :]  # read by its bodies
        for t in dict.fromkeys(t for t in reads if t in dropped):  # a body reads a dropped name
            nodes.append(onnx.helper.make_node("Identity", [dropped[t]], [t], name=f"{IMPACT_PREFIX}body/{t}"))
            reads.append(dropped[t])
        made = {t for node in nodes for t in node.output if t}
        outputs, aliases = [], []
        for t in leaving:
            source = dropped.get(t, t)
            if source in made and source not in outputs:
                outputs.append(source)
            if source != t:
                aliases.append((t, source))
        inputs = [t for t in dict.fromkeys(reads) if t not in made and t not in self.initializers]
        infos = []
        for t in inputs:
            kind = types.get(t, "")
            if not (kind.startswith("tensor(") and kind[7:-1] in ORT_TENSOR_TYPES):
                raise Unsegmentable(t)
            infos.append(onnx.helper.make_tensor_value_info(t, ORT_TENSOR_TYPES[kind[7:-1]], None))
        model = onnx.ModelProto()
        model.CopyFrom(self.template)
        model.graph.CopyFrom(
            onnx.helper.make_graph(
                nodes,
                f"graphscan.segment/{segment_name(j)}/{version}",
                infos,
                [onnx.ValueInfoProto(name=t) for t in outputs],
                [self.initializers[t] for t in dict.fromkeys(reads) if t in self.initializers],
            )
        )
        return model, inputs, outputs, aliases


def segment_name(j):
    """``constants``, ``3`` or ``from-3``: which nodes a segment model holds."""
    return "constants" if j is None else "-".join(map(str, j)) if isinstance(j, tuple) else str(j)


def impact_session(model, path, message, threads=0):
    """An onnxruntime session with graph optimizations off; exit 5 with ``message`` if it cannot be built."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # onnxruntime pre-packs constant weights but not weights computed by a
    # node or read from an input, and the two sum in different orders: without
    # pre-packing, a node computes the same bits whatever segment it runs in
    # (and the float model too, so a model compared with itself gives exactly null).
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.intra_op_num_threads = threads
    options.log_severity_level = 4
    # Each session's arena would keep its largest run's memory for good, and
    # impact holds dozens of sessions: 3.3 GB instead of 1.3 GB on PP-OCR det
    # at 320x320 with 4 samples, at the same speed.
    options.enable_cpu_mem_arena = False
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise GraphscanError(f"{path}: {message} ({one_line(exc)})", EXIT_RUNTIME)


class SegmentRunner:
    """Runs the derived model as its chain of segment sessions, per sample.

    ``baseline``: per sample, ``{name: OrtValue}`` of every value that crosses
    a segment boundary with no variant on; ``run(settings)``: the graph outputs
    per sample with ``settings`` bound instead of the defaults.
    """

    def __init__(self, plan, defaults, samples, outputs, path):
        import concurrent.futures
        import threading

        import numpy as np
        import onnxruntime as ort

        self.plan, self.path, self.outputs = plan, path, list(outputs)
        self.message = f"graphscan's derived model of {path}"
        self.value = ort.OrtValue.ortvalue_from_numpy
        self.true = self.value(np.array(True))
        threads = min(len(samples), os.cpu_count() or 1)
        self.threads = 1 if threads > 1 else 0  # samples run side by side instead
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)
        self.sessions, self.lock = {}, threading.Lock()
        self.seconds = {}  # ("build" or "run", segment, version) -> seconds of its build, of its last run
        shared = {name: self.value(array) for name, array in defaults.items()}
        for _, _, on, off in plan.selections:
            for name in (on, off):
                if name in plan.initializers:
                    shared[name] = self.value(onnx.numpy_helper.to_array(plan.initializers[name]))
        if plan.constant_nodes:
            shared.update(self.step(None, PLAIN, shared))
        self.constants = shared
        shared = {**shared, **{output: shared[off] for output, _, _, off in plan.selections}}
        initial = [
            {**{n: self.value(np.require(a, requirements="C")) for n, a in s.items()}, **shared} for s in samples
        ]
        every = dict.fromkeys(range(len(plan.chunks)), PLAIN)
        self.baseline = list(self.pool.map(lambda values: self.chain(values, every), initial))

    def session(self, j, version, values):
        """The session of segment j (None: the constant nodes) in ``version``, built on first use."""
        with self.lock:
            if (j, version) not in self.sessions:
                types = {name: value.data_type() for name, value in values.items()}
                start = time.perf_counter()
                model, inputs, outputs, aliases = self.plan.segment_model(j, version, types)
                session = outputs and impact_session(model, self.path, f"{self.message} cannot be built", self.threads)
                self.sessions[j, version] = (session, inputs, outputs, aliases)
                self.seconds["build", j, version] = time.perf_counter() - start
            return self.sessions[j, version]

    def version(self, j, wanted):
        """The version of segment j to run for a variant that ``wanted`` it: a
        group's only once the full version is known to cost more per run (all
        samples, twice) than building the group's. Results are the same either
        way; only the time differs."""
        if wanted in (PLAIN, FULL) or (j, wanted) in self.sessions:
            return wanted
        full, plain = self.seconds.get(("run", j, FULL)), self.seconds.get(("run", j, PLAIN))
        if full is None or plain is None:
            return FULL
        return wanted if 2 * (full - plain) * len(self.baseline) > self.seconds["build", j, FULL] else FULL

    def step(self, j, version, values):
        """``{name: OrtValue}`` that segment j makes (aliases included) from ``values``."""
        session, inputs, outputs, aliases = self.session(j, version, values)
        start = time.perf_counter()
        try:
            results = session.run_with_ort_values(outputs, {t: values[t] for t in inputs}) if outputs else []
        except Exception as exc:
            raise GraphscanError(
                f"{self.path}: {self.message} does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME
            )
        self.seconds["run", j, version] = time.perf_counter() - start
        made = dict(zip(outputs, results))
        for t, source in aliases:
            made[t] = made[source] if source in made else values[source]
        return made

    def merged(self, versions):
        """``versions`` with its plain tail, when it runs every segment to the
        last, as one session: one run per sample instead of one per segment."""
        last, tail = len(self.plan.chunks) - 1, None
        for j in range(last, -1, -1):
            if versions.get(j) != PLAIN:
                break
            tail = j
        if tail is None or tail == last:
            return versions
        return {**{j: v for j, v in versions.items() if j < tail}, ("from", tail): PLAIN}

    def chain(self, values, versions):
        values = dict(values)
        for j, version in versions.items():
            values.update(self.step(j, version, values))
        return values

    def run(self, settings=None):
        """Per sample, the graph outputs (numpy) with ``settings`` bound."""
        settings = settings or {}
        versions = {j: self.version(j, wanted) for j, wanted in self.plan.needs(list(settings)).items()}
        versions = self.merged(versions)
        bound = {name: self.true if value is True else self.value(value) for name, value in settings.items()}
        for output, condition, on, _ in self.plan.selections:
            if settings.get(condition) is True:
                bound[output] = self.constants[on]

        def one(baseline):
            values = self.chain({**baseline, **bound}, versions)
            return [values[name].numpy() for name in self.outputs]

        if len(self.baseline) == 1:
            return [one(self.baseline[0])]
        return list(self.pool.map(one, self.baseline))


class OutputNoise:
    """Output SQNR against the float model's outputs, summed over samples and outputs."""

    def __init__(self, float_outputs):
        import numpy as np

        self.reference = [[np.asarray(o, dtype=np.float64) for o in sample] for sample in float_outputs]
        self.signal = sum(energy(o) for sample in self.reference for o in sample)

    def measure(self, quant_outputs):
        """``(sqnr_db, exact)``: ``20*log10(||f|| / ||f - q||)`` over everything
        (None when undefined) and whether q equals f exactly."""
        import numpy as np

        noise = 0.0
        for reference, sample in zip(self.reference, quant_outputs):
            for f, q in zip(reference, sample):
                if f.shape != np.shape(q):
                    raise GraphscanError(
                        f"an output is {list(np.shape(q))} in the quantized model and {list(f.shape)} "
                        "in the float model",
                        EXIT_INPUTS,
                    )
                difference = f - np.asarray(q, dtype=np.float64)
                noise += energy(difference)
        return decibels(self.signal, noise), noise == 0.0


def energy(values):
    """The sum of squares of a float64 array, by numpy's own pairwise sum, not
    BLAS: the same bits whatever the thread count, and no BLAS threads left
    spinning on the cores onnxruntime's runs need (np.vdot made each variant
    of PP-OCR det 1.6x slower)."""
    import numpy as np

    return float(np.sum(np.square(values)))


def decibels(signal, noise):
    """``10*log10(signal / noise)`` of two energies; None when it is not a finite number."""
    if not (noise > 0 and signal > 0 and math.isfinite(signal) and math.isfinite(noise)):
        return None
    return 10.0 * math.log10(signal / noise)


def gain(sqnr, baseline):
    return sqnr - baseline if sqnr is not None and baseline is not None else None


def ranked(rows, exact, baseline_exact):
    """Row order: larger gain first, graph order among equals. A variant whose
    output equals the float model's (sqnr null) while the baseline does not
    counts as the largest gain; rows without a gain come last."""

    def key(k):
        if exact[k] and not baseline_exact:
            return (0, 0.0, k)
        if rows[k]["gain_db"] is None:
            return (2, 0.0, k)
        return (1, -rows[k]["gain_db"], k)

    return sorted(range(len(rows)), key=key)


class ValueStats:
    """What impact keeps of one tensor's values over all samples, instead of
    the values: how many lie outside its Q's [lo, hi] (``clipped``), whether
    all are finite, and the smallest and largest in the tensor's own type."""

    def __init__(self, q_range):
        self.lo, self.hi, _ = q_range
        self.total = self.outside = 0
        self.finite, self.dtype, self.low, self.high = True, None, None, None

    def add(self, value):
        import numpy as np

        value = np.asarray(value)
        self.dtype = value.dtype  # the same for every sample: the model's type of the tensor
        self.total += value.size
        if not value.size:
            return
        self.finite = self.finite and bool(np.all(np.isfinite(value)))
        low, high = value.min(), value.max()
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)
        lo, hi, value = self.lo, self.hi, value.astype(np.float64)
        self.outside += int(np.count_nonzero((value < lo) | (value > hi)))

    @property
    def clipped(self):
        """Fraction of the values outside the Q's [lo, hi] (None without values)."""
        return self.outside / self.total if self.total else None


def paired_outputs(float_model, quant_model, a, b):
    """The quantized model's output names, in the float model's output order."""
    float_names = [o.name for o in float_model.graph.output]
    quant_names = [o.name for o in quant_model.graph.output]
    if sorted(float_names) == sorted(quant_names):
        return float_names
    if len(float_names) == len(quant_names):
        return quant_names
    raise GraphscanError(
        f"{a} and {b}: the models' outputs differ ({len(float_names)} vs {len(quant_names)})", EXIT_INPUTS
    )


def inputs_answer(samples):
    """``{input: shape}``; a list of shapes, one per sample, when the samples differ."""
    answer = {}
    for name in samples[0]:
        shapes = [list(sample[name].shape) for sample in samples]
        answer[name] = shapes[0] if all(s == shapes[0] for s in shapes) else shapes
    return answer


def exclusion(measure, candidates, baseline, target, max_exclude):
    """``{"target_sqnr_db", "nodes", "sqnr_db", "reached"}``: ``candidates``
    (``(node, variant)`` in rank order) are added one at a time and the combined
    model measured after each addition, until the target or ``max_exclude``."""
    nodes, combined = [], {}
    sqnr, exact = baseline

    def met():
        return exact or (sqnr is not None and sqnr >= target)

    for name, variant in candidates:
        if met() or (max_exclude is not None and len(nodes) >= max_exclude):
            break
        nodes.append(name)
        combined.update(variant)
        sqnr, exact = measure(dict(combined))
    return {"target_sqnr_db": target, "nodes": nodes, "sqnr_db": sqnr, "reached": met()}


def float_outputs(float_model, samples, path):
    """The float model's outputs (graph order) per sample, one session."""
    session = impact_session(float_model, path, "model does not run in onnxruntime")
    names = [o.name for o in float_model.graph.output]
    outputs = []
    for feeds in samples:
        try:
            outputs.append(session.run(names, feeds))
        except Exception as exc:
            raise GraphscanError(f"{path}: model does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME)
    return outputs


def tensor_stats(model, samples, ranges, path):
    """``{tensor: ValueStats}`` of ``model``'s own tensors (``ranges``: ``{tensor:
    Q range}``), one session; each sample's values are dropped once counted."""
    stats = {t: ValueStats(q_range) for t, q_range in ranges.items()}
    computed = [t for t in ranges if t not in samples[0]]
    if computed:
        exposed = onnx.ModelProto()
        exposed.CopyFrom(model)
        del exposed.graph.output[:]
        exposed.graph.output.extend(onnx.ValueInfoProto(name=t) for t in computed)
        session = impact_session(exposed, path, "model does not run in onnxruntime")
    for feeds in samples:
        for t in ranges.keys() & feeds.keys():
            stats[t].add(feeds[t])
        if not computed:
            continue
        try:
            outputs = session.run(computed, feeds)
        except Exception as exc:
            raise GraphscanError(f"{path}: model does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME)
        for t, value in zip(computed, outputs):
            stats[t].add(value)
        del outputs
    return stats


def segment_runner(model, defaults, machinery, samples, outputs, path):
    """A SegmentRunner of the derived ``model``, cut in IMPACT_SEGMENTS, or in
    one segment when a value crossing a cut is not a tensor."""

    def runner(count):
        plan = SegmentPlan(model, list(samples[0]), set(defaults), machinery, count, samples[0])
        return SegmentRunner(plan, defaults, samples, outputs, path)

    try:
        return runner(IMPACT_SEGMENTS)
    except Unsegmentable:
        return runner(1)


def variant_key(variant):
    """A hashable ``variant``: equal keys set the same inputs to the same values."""
    return tuple(
        sorted((name, True if value is True else (value.dtype.str, value.tobytes())) for name, value in variant.items())
    )


def same_clip(stats, kept, rounded):
    """Whether ``Clip(t, *kept)`` and ``Clip(t, *rounded)`` (bounds: numpy
    scalars of t's type) are equal bit for bit for every value of t (``stats``:
    its ValueStats): t is finite and, on each side, the two bounds are the
    same number or no value of t reaches either."""
    (kept_lo, kept_hi), (lo, hi) = kept, rounded
    same_lo, same_hi = kept_lo.tobytes() == lo.tobytes(), kept_hi.tobytes() == hi.tobytes()
    if stats.dtype != lo.dtype or not stats.finite:
        return False
    if stats.low is None:  # no values at all
        return True
    return bool((same_lo or stats.low > max(kept_lo, lo)) and (same_hi or stats.high < min(kept_hi, hi)))


class ImpactRun:
    """The derived model of ``quant_model`` as segment sessions, ready to measure variants.

    ``baseline``: ``(sqnr_db, exact)`` of the quantized model as it is;
    ``stats``: per tensor row with a known range, the ValueStats of its values;
    ``measure(variant)``: ``(sqnr_db, exact)`` with ``variant`` on, run once per distinct variant.
    """

    def __init__(self, float_model, quant_model, samples, output_names, noise, path):
        self.noise = noise
        self.plan = plan = ImpactPlan(float_model, quant_model)
        derived, self.defaults, self.op_variants, self.tensor_variants = switched_model(plan, quant_model, float_model)
        machinery = {node.name for node in derived.graph.node if node.name.startswith(IMPACT_PREFIX)}
        self.runner = segment_runner(derived, self.defaults, machinery, samples, output_names, path)
        del derived
        self.measured = {}
        self.baseline = self.measure({})
        ranges = {t: q_range for t, _, q_range, _ in plan.tensor_rows if q_range is not None}
        self.stats = tensor_stats(quant_model, samples, ranges, path)

    def measure(self, variant):
        key = variant_key(variant)
        if key not in self.measured:
            self.measured[key] = self.noise.measure(self.runner.run(variant))
        return self.measured[key]

    def rounding_variant(self, m):
        """Tensor row m's rounding-only variant, or its float(t) variant when the
        two are the same run: t's values never reach the Clip bounds that differ."""
        kept, rounded = self.tensor_variants[m]
        if rounded is None:
            return None
        changed = [(name, value) for name, value in rounded.items() if name not in kept]
        if len(changed) != 2 or any(value is True for _, value in changed):
            return rounded  # a Clip node of its own (after LeakyRelu): not a bound change
        (low, lo), (high, hi) = changed
        stats = self.stats[self.plan.tensor_rows[m][0]]
        return kept if same_clip(stats, (self.defaults[low], self.defaults[high]), (lo, hi)) else rounded


def impact(a, b, inputs=None, seed=0, shape=None, target_sqnr=None, max_exclude=None, top=None):
    """Per operator and per activation tensor of ``b`` (quantized): the output
    SQNR against ``a`` (float) if it stayed float; optionally what to exclude."""
    if max_exclude is not None and target_sqnr is None:
        raise GraphscanError("usage: --max-exclude needs --target-sqnr", EXIT_USAGE)
    float_model, quant_model = load_with_weights(a), load_with_weights(b)
    check_same_inputs(float_model, quant_model, a, b)
    samples, defaulted = model_samples(float_model, inputs, parse_shapes(shape), seed, IMPACT_SYMBOLIC_DIM_SIZE)
    output_names = paired_outputs(float_model, quant_model, a, b)

    noise = OutputNoise(float_outputs(float_model, samples, a))
    run = ImpactRun(float_model, quant_model, samples, output_names, noise, b)
    plan, baseline, measure = run.plan, run.baseline, run.measure
    op_variants, tensor_variants = run.op_variants, run.tensor_variants

    index = plan.index
    op_rows, op_exact = [], []
    for (i, _), variant in zip(plan.op_rows, op_variants):
        sqnr, exact = measure(variant)
        op_rows.append(
            {"node": index.names[i], "op_type": index.op_types[i], "sqnr_db": sqnr, "gain_db": gain(sqnr, baseline[0])}
        )
        op_exact.append(exact)
    tensor_rows, tensor_exact = [], []
    for m, ((t, pairs, q_range, _), (kept, _)) in enumerate(zip(plan.tensor_rows, tensor_variants)):
        sqnr, exact = measure(kept)
        rounded = run.rounding_variant(m)
        rounding = measure(rounded)[0] if rounded is not None else None
        producer = index.producer_of(t)
        readers = sorted({r for _, dq in pairs for r in index.consumers_of(index.outputs[dq][0])})
        tensor_rows.append(
            {
                "tensor": t,
                "producer": index.names[producer] if producer is not None else None,
                "consumers": [index.names[r] for r in readers],
                "sqnr_db": sqnr,
                "gain_db": gain(sqnr, baseline[0]),
                "rounding_sqnr_db": rounding,
                "rounding_gain_db": gain(rounding, baseline[0]),
                "clipped": run.stats[t].clipped if q_range else None,
            }
        )
        tensor_exact.append(exact)
    op_order = ranked(op_rows, op_exact, baseline[1])
    tensor_order = ranked(tensor_rows, tensor_exact, baseline[1])
    answer = {
        "a": a,
        "b": b,
        "inputs": inputs_answer(samples),
        "defaulted": defaulted,
        "samples": len(samples),
        "output_sqnr_db": baseline[0],
        "ops": [op_rows[k] for k in op_order][:top],
        "tensors": [tensor_rows[k] for k in tensor_order][:top],
    }
    if target_sqnr is not None:
        candidates = [
            (op_rows[k]["node"], op_variants[k])
            for k in op_order
            if (op_exact[k] and not baseline[1]) or (op_rows[k]["gain_db"] or 0.0) > 0
        ]
        answer["exclude"] = exclusion(measure, candidates, baseline, target_sqnr, max_exclude)
    return answer


# --------------------------------------------------------------------------
# Command line


def non_negative_int(text):
    """argparse type of ``--seed``, ``--top``, ``--max-exclude``: an integer >= 0 (exit 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def finite_non_negative(text):
    """argparse type of ``--tolerance``: a finite number >= 0 (NaN would never be exceeded)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


SEED_OPTION = ("--seed", {"type": non_negative_int, "default": 0, "help": "seed of the random inputs (default: 0)"})

TRACE_OPTIONS = [
    ("--inputs", {"metavar": "FILE.npz", "help": "one array per graph input, by name"}),
    SEED_OPTION,
    ("--tolerance", {"type": finite_non_negative, "default": TRACE_TOLERANCE, "help": "first_over threshold"}),
    ("--save", {"metavar": "DIR", "help": "write each op's single-op model and inputs here"}),
    (
        "--shape",
        {
            "action": "append",
            "metavar": "NAME=D0,D1,...",
            "help": "shape of a generated input (repeatable; symbolic dims default to 1)",
        },
    ),
]

RUNTIME_OPTIONS = [
    (
        "--level",
        {
            "choices": list(RUNTIME_LEVELS),
            "default": "extended",
            "help": "onnxruntime graph optimization level (default: extended)",
        },
    ),
    ("--provider", {"default": "CPUExecutionProvider", "help": "execution provider (default: CPUExecutionProvider)"}),
    ("--int8-allowed", {"action": "store_true", "help": "set session.qdqisint8allowed=1"}),
    (
        "--time",
        {"action": "store_true", "help": "profile kernel time per class and measure the Q/DQ round trips' cost"},
    ),
    ("--inputs", {"metavar": "FILE.npz", "help": "--time: one array per graph input, by name"}),
    (
        "--shape",
        {"metavar": "NAME=D0,D1,...", "action": "append", "help": "--time: shape of a graph input (repeatable)"},
    ),
    (
        "--runs",
        {"type": int, "default": RUNTIME_DEFAULT_RUNS, "help": f"--time: timed runs (default: {RUNTIME_DEFAULT_RUNS})"},
    ),
]

CHECK_OPTIONS = [
    ("--float", {"metavar": "F.onnx", "help": "the float model, for --min-sqnr"}),
    ("--budget", {"metavar": "FILE.json", "help": "budgets as a JSON object (options override it)"}),
    ("--max-float", {"type": int, "metavar": "N", "help": "at most N float compute nodes"}),
    ("--max-islands", {"type": int, "metavar": "N", "help": "at most N float islands"}),
    ("--max-crossings", {"type": int, "metavar": "N", "help": "at most N boundary crossings"}),
    (
        "--min-int8",
        {"type": float, "metavar": "FRACTION", "help": "at least this fraction of kernels run int8 (runtime)"},
    ),
    ("--min-sqnr", {"type": float, "metavar": "DB", "help": "output SQNR against --float of at least DB"}),
    ("--inputs", {"metavar": "FILE.npz", "action": "append", "help": "--min-sqnr: one sample per file (repeatable)"}),
    ("--shape", {"metavar": "NAME=D0,D1,...", "action": "append", "help": "--min-sqnr: shape of a graph input"}),
    SEED_OPTION,
]

# Commands whose exit code depends on the answer (the JSON is printed either way).
ANSWER_EXIT_CODES = {"check": lambda answer: EXIT_OK if answer["ok"] else EXIT_BUDGET}

DOT_OPTIONS = [
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
            "help": f"draw each connected group of wrapped nodes as one box (for over {COLLAPSE_HINT} compute nodes)",
        },
    ),
]

FUSE_OPTIONS = [
    ("--inputs", {"metavar": "FILE.npz", "help": "verify on these arrays (one per graph input, by name)"}),
    (
        "--shape",
        {
            "metavar": "NAME=D0,D1,...",
            "action": "append",
            "help": "shape of an input's seeded data (repeatable; symbolic dimensions are 2 otherwise)",
        },
    ),
    SEED_OPTION,
]


def finite_float(text):
    """argparse type: a finite number (NaN and infinities are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


IMPACT_OPTIONS = [
    (
        "--inputs",
        {
            "metavar": "FILE.npz",
            "action": "append",
            "help": "one sample: one array per graph input, by name (repeatable)",
        },
    ),
    ("--seed", {"type": int, "default": 0, "help": "seed of the random sample without --inputs (default: 0)"}),
    ("--shape", {"metavar": "NAME=D0,D1,...", "action": "append", "help": "shape of a random input (repeatable)"}),
    (
        "--target-sqnr",
        {"metavar": "DB", "type": finite_float, "help": "find the nodes to exclude to reach this output SQNR"},
    ),
    (
        "--max-exclude",
        {"metavar": "N", "type": non_negative_int, "help": "at most N excluded nodes (with --target-sqnr)"},
    ),
    (
        "--top",
        {"metavar": "N", "type": non_negative_int, "help": "list only the first N ops and tensors (all are measured)"},
    ),
]

# name: (function, positional paths, help, options)
COMMANDS = {
    "nodes": (nodes, ["model"], "op census and initializer dtypes", []),
    "qdq": (qdq, ["model"], "Q/DQ counts, round trips, weight DQs", []),
    "islands": (islands, ["model"], "int8-wrapped vs float nodes, float islands", []),
    "boundary": (boundary, ["model"], "DQs entering and Qs leaving each island", []),
    "diff": (diff, ["a", "b"], "b minus a for the counts above", []),
    "fuse": (fuse, ["model", "output"], "fuse MatMul+Add into Gemm, verified, into output", FUSE_OPTIONS),
    "trace": (trace, ["a", "b"], "per-op isolated and propagated error of b (quantized) vs a (float)", TRACE_OPTIONS),
    "runtime": (
        runtime,
        ["model"],
        "what onnxruntime really runs per node: int8, int8_data, float, absorbed",
        RUNTIME_OPTIONS,
    ),
    "check": (
        check,
        ["model"],
        "a CI gate: exit 8 when a budget (float nodes, islands, crossings, int8 share, SQNR) is broken",
        CHECK_OPTIONS,
    ),
    "dot": (dot, ["model"], "Graphviz DOT picture of the island map (DOT text, not JSON)", DOT_OPTIONS),
    "impact": (
        impact,
        ["a", "b"],
        "output SQNR gained by keeping each op or tensor of b (quantized) float",
        IMPACT_OPTIONS,
    ),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises a one-line usage error instead of printing usage."""

    def error(self, message):
        raise GraphscanError(f"usage: {message}", EXIT_USAGE)

    def print_help(self, file=None):
        """Help on stdout like an answer: argparse would silently drop a failed write."""
        if file is None:
            write_answer(self.format_help())
        else:
            super().print_help(file)


FORMATS = ["json", "table"]
TEXT_COMMANDS = {"dot"}  # answer text for people instead of a JSON object


def option_dest(flag, settings):
    """The keyword an option is passed as: its ``dest``, else the flag in snake_case."""
    return settings.get("dest") or flag.lstrip("-").replace("-", "_")


def build_parser():
    parser = OneLineParser(
        prog="graphscan.py",
        description="Count what quantization did to an ONNX graph; one JSON object on stdout.",
        epilog=(
            "exit codes: 0 ok, 1 internal error, 2 usage, 3 no such file (or output or stdout "
            "not writable), 4 not an ONNX model, 5 model does not run in onnxruntime, "
            "6 fused model does not reproduce the original, "
            "7 inputs do not match the models, 8 check: a budget is broken, 130 interrupted"
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=OneLineParser)
    for name, (_, paths, help_text, options) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        for path in paths:
            command.add_argument(path, help="path to an .onnx file")
        for flag, settings in options:
            command.add_argument(flag, **settings)
        if name in TEXT_COMMANDS:
            continue
        output = command.add_argument_group("output (tables are for people; the JSON is the contract)")
        output.add_argument("--format", choices=FORMATS, default="json", help="json (default) or table")
        if "--top" not in (flag for flag, _ in options):  # a command's own --top also limits its JSON
            output.add_argument(
                "--top", type=non_negative_int, metavar="N", help="table: only the N largest rows of each long list"
            )
    return parser


def run(argv):
    """Parse ``argv``, run the command, return the text to print and the exit code
    (raises GraphscanError).

    The text is the answer's JSON, or with ``--format table`` a table rendered
    from that same answer; ``dot`` answers DOT text.
    """
    args = build_parser().parse_args(argv)
    if args.command is None:
        raise GraphscanError(f"usage: a command is required ({', '.join(COMMANDS)})", EXIT_USAGE)
    function, paths, _, options = COMMANDS[args.command]
    fmt, top = getattr(args, "format", "json"), getattr(args, "top", None)
    if fmt == "json" and top is not None and "--top" not in (flag for flag, _ in options):
        raise GraphscanError("usage: --top only limits tables; add --format table", EXIT_USAGE)
    keywords = {option_dest(f, s): getattr(args, option_dest(f, s)) for f, s in options}
    answer = function(*(getattr(args, p) for p in paths), **keywords)
    if args.command in TEXT_COMMANDS:
        return answer.rstrip("\n"), EXIT_OK
    exit_code = ANSWER_EXIT_CODES.get(args.command, lambda _: EXIT_OK)(answer)
    if fmt == "table":
        return render_table(args.command, answer, top), exit_code
    return strict_json(answer), exit_code


def strict_json(answer):
    """One strict JSON text for ``answer``: NaN and +-Infinity become ``null``.

    Strict parsers reject those tokens, so no answer may carry them. The
    sanitizing walk runs only when ``allow_nan=False`` finds one.
    """
    try:
        return json.dumps(answer, allow_nan=False)
    except ValueError:
        return json.dumps(finite_or_null(answer), allow_nan=False)


def finite_or_null(value):
    """``value`` with every non-finite float, at any depth, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(item) for item in value]
    return value


def report(line):
    """One line on stderr; a closed or full stderr cannot make it a traceback."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(f"graphscan: {single_line(line)}\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def write_answer(text):
    """Write the answer on stdout, or raise exit 3 when stdout cannot take it
    (closed, a pipe whose reader left, a full disk)."""
    stream = sys.stdout
    # JSON is ASCII; a table shows names as they are, escaped where the terminal cannot.
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        stream.flush()
    except (OSError, ValueError) as exc:
        discard_stdout(stream)
        raise GraphscanError(
            f"cannot write the answer to stdout ({getattr(exc, 'strerror', None) or one_line(exc)})", EXIT_NO_FILE
        )


def discard_stdout(stream):
    """Point stdout's descriptor at /dev/null, so the interpreter's final flush
    of what could not be written does not print an error of its own."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):  # not a real file (a test's capture)
        return
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv=None):
    """Run one command; print its JSON answer or one error line. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # A short run that builds a million small objects: the cyclic collector
    # would only rescan them again and again (about a third of the time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if sys.stdout is None:  # checked first: files opened now could take descriptor 1
            raise GraphscanError("cannot write the answer: stdout is closed", EXIT_NO_FILE)
        text, exit_code = run(argv)
        write_answer(text + "\n")
    except GraphscanError as exc:
        report(str(exc))
        return exc.exit_code
    except SystemExit as exc:  # argparse after printing --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except KeyboardInterrupt:
        report("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: still one line, never a traceback
        report(f"internal error: {type(exc).__name__}: {one_line(exc)}")
        return EXIT_INTERNAL
    finally:
        if gc_was_enabled:
            gc.enable()
    return exit_code


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # main() reports it in one line
    try:
        code = main()
    except KeyboardInterrupt:  # in the instant between main()'s own handlers
        code = EXIT_INTERRUPTED
    signal.signal(signal.SIGINT, exit_on_interrupt)  # no traceback during shutdown either
    sys.exit(code)
