#!/usr/bin/env python3
"""graphscan: count what really happened when an ONNX model was quantized.

A QDQ model keeps every operator and only wraps tensors in QuantizeLinear /
DequantizeLinear, so "quantized" and "runs in int8" can only be told apart by
counting the graph. The contract (keys, ordering, exit codes) is SPEC.md.

    python graphscan.py <command> <model...>

Every command is a function ``path(s) -> dict``; ``main(argv) -> int`` is a
thin layer that prints one JSON object on stdout or one error line on stderr.
Only the standard library and onnx are imported at start.
"""

import argparse
import functools
import gc
import itertools
import json
import math
import mmap
import os
import re
import stat
import sys
from collections import Counter

import onnx

EXIT_OK = 0
EXIT_INTERNAL = 1  # a bug in graphscan, still reported in one line
EXIT_USAGE = 2
EXIT_NO_FILE = 3  # no such file, not a regular file, or an output that cannot be written
EXIT_NOT_ONNX = 4  # not an ONNX model (or, for fuse/trace, its external data cannot be loaded)
EXIT_RUNTIME = 5  # fuse/trace: the model does not run in onnxruntime
EXIT_MISMATCH = 6  # fuse: the fused model does not reproduce the original
EXIT_INPUTS = 7  # trace: the models' inputs differ, or --inputs is unreadable or lacks one

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


def check_readable(path):
    """Raise exit 3 unless ``path`` is an existing regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise GraphscanError(f"{path}: no such file ({exc.strerror or exc})", EXIT_NO_FILE)
    if not stat.S_ISREG(mode):
        raise GraphscanError(f"{path}: not a regular file", EXIT_NO_FILE)


# Above this size a model is parsed without its tensor payloads (see skim_model).
SKIM_THRESHOLD = 64 * 1024 * 1024


def load_model(path, weights=False):
    """Parse ``path`` as an ONNX model without touching external-data files.

    Without ``weights``, a big file is memory-mapped and parsed without its
    initializers' data: a 2 GiB model costs megabytes, not two copies of
    its weights. Names, dims and data types of initializers are kept.
    """
    check_readable(path)
    try:
        with open(path, "rb") as f:
            if weights or os.fstat(f.fileno()).st_size < SKIM_THRESHOLD:
                return parse_model(f.read(), path)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                with memoryview(mapped) as view:
                    try:
                        data = skim_model(view)
                    except (IndexError, ValueError) as exc:
                        raise GraphscanError(
                            f"{path}: not an ONNX model ({one_line(exc)})", EXIT_NOT_ONNX
                        )
            return parse_model(data, path)
    except OSError as exc:
        raise GraphscanError(f"{path}: cannot read ({exc.strerror or exc})", EXIT_NO_FILE)


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
    """Yield ``(field number, wire type, value start, value end, field start)``."""
    pos = start
    while pos < end:
        field_start = pos
        key, pos = read_varint(buf, pos)
        wire = key & 7
        value_start = pos
        if wire == 0:
            _, pos = read_varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == LENGTH_DELIMITED:
            length, pos = read_varint(buf, pos)
            value_start = pos
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("truncated field")
        yield key >> 3, wire, value_start, pos, field_start


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
    for number, wire, value_start, value_end, field_start in wire_fields(buf, start, end):
        if number == GRAPH_INITIALIZER and wire == LENGTH_DELIMITED:
            header = b"".join(
                buf[f_start:f_end]
                for n, _, _, f_end, f_start in wire_fields(buf, value_start, value_end)
                if n not in TENSOR_PAYLOAD
            )
            out += length_delimited(GRAPH_INITIALIZER, header)
        else:
            out += buf[field_start:value_end]
    return bytes(out)


def parse_model(data, path):
    """Turn bytes into a ModelProto, or raise exit 4 naming ``path``."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError, upb sometimes others
        raise GraphscanError(f"{path}: not an ONNX model ({one_line(exc)})", EXIT_NOT_ONNX)
    # Protobuf parses an empty file, or one cut at a field boundary, as a
    # (partial) message: a model must at least carry a graph and an opset.
    if not data or not model.HasField("graph") or not model.opset_import:
        raise GraphscanError(
            f"{path}: not an ONNX model (no graph or opset_import)", EXIT_NOT_ONNX
        )
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
        self.compute_nodes = [
            i for i, (q, dq) in enumerate(zip(self.is_q, self.is_dq)) if not (q or dq)
        ]

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
        1
        for i in index.q_nodes
        if not read_by_dq_only.isdisjoint(outputs[i]) and read_by_non_dq.isdisjoint(outputs[i])
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
                    d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                    for d in tensor_type.shape.dim
                ]
        self.type_text = dtype_name(tensor_type.elem_type) if self.kind == "tensor_type" else str(self.kind)

    @property
    def numeric(self):
        import numpy as np

        return self.dtype is not None and (
            np.issubdtype(self.dtype, np.number) or np.issubdtype(self.dtype, np.bool_)
        )

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
            raise GraphscanError(
                f"--shape {text!r}: expected NAME=D0,D1,... with non-negative integers", EXIT_INPUTS
            )
        if name in shapes:
            raise GraphscanError(f"--shape: {name!r} given twice", EXIT_INPUTS)
        shapes[name] = parsed
    return shapes


def resolve_shape(spec, shapes, default_size):
    """The concrete shape to generate for ``spec``, and whether a default was used."""
    if spec.name in shapes:
        wanted = shapes[spec.name]
        if spec.dims is not None:
            if len(wanted) != len(spec.dims) or any(
                d is not None and d != w for d, w in zip(spec.dims, wanted)
            ):
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
            raise GraphscanError(
                f"input {spec.name!r} is {spec.describe()}: graphscan can only generate numeric "
                f"tensors; give it with --inputs",
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

    import numpy as np

    check_readable(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise GraphscanError(f"{path}: not an .npz file ({one_line(exc)})", EXIT_INPUTS)
    with archive:
        members = {}
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                raise GraphscanError(f"{path}: member {info.filename!r} is not a .npy array", EXIT_INPUTS)
            members[info.filename[: -len(".npy")]] = info
        missing = [s.name for s in specs if s.name not in members]
        if missing:
            raise GraphscanError(f"{path}: no array for input {', '.join(missing)}", EXIT_INPUTS)
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
                raise GraphscanError(f"{path}: array {name!r} has .npy format {version}", EXIT_INPUTS)
            shape, fortran, dtype = getattr(np.lib.format, read_header)(f)
            if dtype.hasobject:
                raise GraphscanError(f"{path}: array {name!r} holds Python objects", EXIT_INPUTS)
            check_array_fits(path, spec, dtype, shape)
            count = math.prod(shape)
            if count * dtype.itemsize > min(MAX_INPUT_BYTES, info.file_size):
                raise GraphscanError(
                    f"{path}: array {name!r} declares {count * dtype.itemsize} bytes but the member holds "
                    f"{info.file_size}",
                    EXIT_INPUTS,
                )
            data = f.read(count * dtype.itemsize)
    except GraphscanError:
        raise
    except Exception as exc:
        raise GraphscanError(f"{path}: cannot read array {name!r} ({one_line(exc)})", EXIT_INPUTS)
    if len(data) != count * dtype.itemsize:
        raise GraphscanError(f"{path}: array {name!r} is truncated", EXIT_INPUTS)
    array = np.frombuffer(data, dtype=dtype)
    order = "F" if fortran else "C"
    return np.ascontiguousarray(array.reshape(shape, order=order)).astype(dtype.newbyteorder("="), copy=False)


def check_array_fits(path, spec, dtype, shape):
    """Exit 7 unless an array of ``dtype`` and ``shape`` can feed ``spec``."""
    import numpy as np

    if spec.dtype is None or np.dtype(dtype).newbyteorder("=") != np.dtype(spec.dtype):
        raise GraphscanError(
            f"{path}: array {spec.name!r} is {np.dtype(dtype).name} {list(shape)}, the model wants {spec.describe()}",
            EXIT_INPUTS,
        )
    if spec.dims is not None and (
        len(shape) != len(spec.dims) or any(d is not None and d != s for d, s in zip(spec.dims, shape))
    ):
        raise GraphscanError(
            f"{path}: array {spec.name!r} has shape {list(shape)}, the model wants {spec.describe()}",
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
            f"{a} and {b}: the models' inputs differ ({', '.join(sorted(specs[0]))} vs {', '.join(sorted(specs[1]))})",
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
                f"{a} and {b}: input {name!r} is {first.describe()} in one and {second.describe()} in the other",
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


def static_shapes(model):
    """``{tensor: [dim_value or None, ...]}`` for every tensor whose rank is known."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    shapes = {}
    for info in list(graph.input) + list(graph.value_info) + list(graph.output):
        tensor_type = info.type.tensor_type
        if tensor_type.HasField("shape"):
            shapes[info.name] = [
                d.dim_value if d.HasField("dim_value") else None
                for d in tensor_type.shape.dim
            ]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def broadcasts_to(c_shape, m, n):
    """Whether C of ``c_shape`` unidirectionally broadcasts to (m, n); m may be unknown."""
    if len(c_shape) > 2:
        return False
    for dim, target in zip(reversed(c_shape), (n, m)):
        if dim != 1 and (target is None or dim != target):
            return False
    return True


def gemm_plan(index, model, shapes, graph_outputs, matmul):
    """``(add_index, c_name, None)`` if MatMul ``matmul`` can fuse, else ``(None, None, reason)``."""
    node = model.graph.node[matmul]
    product = node.output[0]
    consumers = index.consumers_of(product)
    if (
        len(consumers) != 1
        or index.op_types[consumers[0]] != "Add"
        or product in graph_outputs
    ):
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
    taken = set(index.names)
    graph_outputs = {output.name for output in model.graph.output}
    replace, drop, fused, skipped = {}, set(), [], []
    for i, op_type in enumerate(index.op_types):
        if op_type != "MatMul":
            continue
        add, c_name, reason = gemm_plan(index, model, shapes, graph_outputs, i)
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
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return session.run(None, feeds, run_options)
    except Exception as exc:
        raise GraphscanError(
            f"{path}: model does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME
        )


def max_abs_difference(expected, actual):
    """Largest |expected - actual| over all outputs, and the largest |expected|."""
    import numpy as np

    error = max((float(np.max(np.abs(e - a), initial=0.0)) for e, a in zip(expected, actual)), default=0.0)
    scale = max((float(np.max(np.abs(e), initial=0.0)) for e in expected), default=0.0)
    return error, scale


def write_atomically(data, path):
    """Write ``data`` to ``path`` through a temporary file beside it."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)
    except OSError as exc:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise GraphscanError(f"{path}: cannot write ({exc.strerror or exc})", EXIT_NO_FILE)


def load_with_weights(path):
    """The model with its weights, external data read by onnx's checked loader."""
    model = load_model(path, weights=True)
    from onnx import external_data_helper

    if any(external_data_helper.uses_external_data(t) for t in model.graph.initializer):
        try:
            external_data_helper.load_external_data_for_model(
                model, os.path.dirname(os.path.abspath(path))
            )
        except Exception as exc:
            raise GraphscanError(f"{path}: cannot load external data ({one_line(exc)})", EXIT_NOT_ONNX)
    return model


def fuse(path, output):
    """Fuse MatMul+Add into Gemm, verify with onnxruntime, then write ``output``."""
    model = load_with_weights(path)
    fused_model, fused, skipped = fuse_matmul_add(model)
    try:
        onnx.checker.check_model(fused_model, full_check=True)
    except Exception as exc:
        raise GraphscanError(f"{path}: fused model fails the checker ({one_line(exc)})", EXIT_MISMATCH)
    feeds = random_inputs(model, FUSE_SEED, SYMBOLIC_DIM_SIZE)
    expected = run_model(model, feeds, path)
    actual = run_model(fused_model, feeds, output)
    error, scale = max_abs_difference(expected, actual)
    if error > FUSE_RELATIVE_TOLERANCE * max(scale, 1.0):
        raise GraphscanError(
            f"{path}: fused model differs from the original by {error:.3g} "
            f"(allowed {FUSE_RELATIVE_TOLERANCE:g} relative); nothing written",
            EXIT_MISMATCH,
        )
    write_atomically(fused_model.SerializeToString(), output)
    return {
        "model": path,
        "output": output,
        "fused": fused,
        "skipped": skipped,
        "max_abs_error": error,
    }


# --------------------------------------------------------------------------
# trace: the operator where a quantized model's error is born
#
# Two onnxruntime sessions in all: the float model once, and the quantized
# model once with every operator's single-op model appended to its graph, fed
# from the float references. No session per operator.

TRACE_TOLERANCE = 1e-2
TRACE_SYMBOLIC_DIM_SIZE = 1
QDQ_SUFFIX = re.compile(
    r"_(?:QuantizeLinear_Input|QuantizeLinear_Output|DequantizeLinear_Output)(?:_\d+)?$"
)
ROW_PREFIX = "graphscan.row{}/"  # tensors of row k's single-op model inside the combined graph
FLOAT_PREFIX = "graphscan.float/"  # float references fed into the combined graph


def value_names(graph):
    """Graph inputs that are not initializers, and every node output."""
    names = {info.name for info in value_inputs(graph)}
    names.update(t for node in graph.node for t in node.output if t)
    return names


class ReferenceMatcher:
    """Finds the float tensor a quantized-model tensor should be compared with.

    Like the quantized side, the float side is taken as the next op sees it:
    after its own Q->DQ, if the "float" model has one (comparing two
    quantized models, or a model with itself, then gives zeros where equal).
    """

    def __init__(self, float_graph):
        self.graph = float_graph
        self.index = GraphIndex(float_graph)
        self.tensors = value_names(float_graph)
        self.by_node = {}
        for i, node in enumerate(float_graph.node):
            for k, tensor in enumerate(node.output):
                if tensor:
                    self.by_node[(self.index.names[i], k)] = tensor

    def reference(self, tensor, producer_name=None, output_index=None):
        """Same name without ORT's QDQ suffixes, else the same node's same output."""
        stripped = QDQ_SUFFIX.sub("", tensor)
        if stripped not in self.tensors:
            stripped = self.by_node.get((producer_name, output_index))
        if stripped is None:
            return None
        return output_chain(self.index, self.graph, stripped)[1]


def has_subgraph(node):
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


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

    def __init__(self, index, graph, i, matcher, initializer_protos):
        self.index, self.graph, self.row = index, graph, i
        chain, self.weight_nodes = [], set()
        for tensor in index.inputs[i]:
            source, links = data_source(index, graph, tensor)
            if links and source in index.initializers:
                self.weight_nodes.update(links)
            chain += [j for j in links if j not in chain]
        out_chain, self.output = output_chain(index, graph, graph.node[i].output[0])
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
                    self.feeds[tensor] = tensor_reference(index, matcher, tensor)
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


def output_scale(graph, out_chain, initializer_protos):
    """The output Q's scale as a float, when it is a scalar initializer."""
    if not out_chain:
        return None
    init = initializer_protos.get(graph.node[out_chain[0]].input[1])
    if init is None:
        return None
    values = onnx.numpy_helper.to_array(init)
    return float(values.reshape(-1)[0]) if values.size == 1 else None


def tensor_reference(index, matcher, tensor):
    producer = index.producer_of(tensor)
    if producer is None:
        return matcher.reference(tensor)
    return matcher.reference(tensor, index.names[producer], index.outputs[producer].index(tensor))


def run_with_outputs(model, feeds, outputs, path, extra_inputs=(), copy=True):
    """Run ``model`` exposing ``outputs`` (tensor names); returns ``{name: array}``.

    ``copy=False`` lets a caller's private model be changed in place.
    """
    exposed = model
    if copy:
        exposed = onnx.ModelProto()
        exposed.CopyFrom(model)
    graph_outputs = {o.name for o in exposed.graph.output}
    exposed.graph.input.extend(extra_inputs)
    exposed.graph.output.extend(
        onnx.ValueInfoProto(name=t) for t in outputs if t not in graph_outputs
    )
    names = [o.name for o in exposed.graph.output]
    return dict(zip(names, run_model(exposed, feeds, path)))


def combined_model(quant_model, op_models, float_values):
    """The quantized model with every single-op model appended, and their feeds."""
    combined = onnx.ModelProto()
    combined.CopyFrom(quant_model)
    feeds, extra_inputs, outputs = {}, [], {}
    for k, op in enumerate(op_models):
        if op is None:
            continue
        prefix = ROW_PREFIX.format(k)
        fed = {}
        for tensor, reference in op.feeds.items():
            if reference is None:
                fed[tensor] = tensor  # the quantized model's own value
                continue
            fed[tensor] = FLOAT_PREFIX + reference
            if fed[tensor] not in feeds:
                feeds[fed[tensor]] = float_values[reference]
                extra_inputs.append(value_info_of(fed[tensor], float_values[reference]))
        # Initializers and dequantized weights are the quantized model's own tensors.
        keep = set(op.initializers)
        keep.update(t for j in op.weight_nodes for t in op.index.outputs[j])

        def rename(tensor, prefix=prefix, fed=fed, keep=keep):
            return fed.get(tensor) or (tensor if tensor in keep else prefix + tensor)

        combined.graph.node.extend(op.node_protos(rename, prefix, skip=op.weight_nodes))
        outputs[k] = rename(op.output)
    return combined, feeds, extra_inputs, outputs


def value_info_of(name, array):
    elem_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    return onnx.helper.make_tensor_value_info(name, elem_type, list(array.shape))


def error_stats(reference, value):
    """(max |ref - value|, SQNR in dB) or Nones when they cannot be compared."""
    import numpy as np

    if reference is None or value is None or reference.shape != value.shape:
        return None, None
    if not (np.issubdtype(reference.dtype, np.number) and np.issubdtype(value.dtype, np.number)):
        return None, None
    ref = reference.astype(np.float64)
    difference = ref - value
    noise = float(np.linalg.norm(difference))
    signal = float(np.linalg.norm(ref))
    max_abs = float(np.max(np.abs(difference), initial=0.0))
    sqnr = 20.0 * math.log10(signal / noise) if noise > 0 and signal > 0 else None
    return max_abs, sqnr


REASON_ABSORBED = "its output is compared with a quantized node of another type (absorbed)"
REASON_NO_TWIN = "no quantized node of the same name and op_type"
REASON_SUBGRAPH = "has a subgraph (If/Loop/Scan): only its outputs are compared, it is not isolated"


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


def file_safe(name):
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def standalone_model(quant_model, op, input_arrays, output_array):
    """``op`` as a model of its own, for ``--save``: typed from the arrays it ran on."""
    wanted = set(op.initializers)
    initializers = [init for init in quant_model.graph.initializer if init.name in wanted]
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            op.node_protos(),
            file_safe(op.index.names[op.row]),
            [value_info_of(name, input_arrays[name]) for name in op.feeds],
            [value_info_of(op.output, output_array)],
            initializers,
        ),
        opset_imports=quant_model.opset_import,
    )
    model.ir_version = quant_model.ir_version
    return model


def save_op_models(folder, quant_model, rows, op_models, arrays_by_row):
    """Write ``<node>.onnx`` and ``<node>.npz`` for every row that has a single-op model."""
    import io

    import numpy as np

    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise GraphscanError(f"{folder}: cannot create ({exc.strerror or exc})", EXIT_NO_FILE)
    used = set()
    for row, op, saved in zip(rows, op_models, arrays_by_row):
        if op is None or saved is None:
            continue
        arrays, output_array = saved
        stem = file_safe(row["node"])
        if stem in used:  # two names that differ only in unsafe characters
            stem = f"{stem}_{op.row}"
        used.add(stem)
        model = standalone_model(quant_model, op, arrays, output_array)
        write_atomically(model.SerializeToString(), os.path.join(folder, stem + ".onnx"))
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        write_atomically(buffer.getvalue(), os.path.join(folder, stem + ".npz"))


def plan_rows(quant_model, quant_index, matcher):
    """Per compute node of the quantized model: its index, float reference and
    single-op model (None where it has no reference or has a subgraph)."""
    graph = quant_model.graph
    initializer_protos = {init.name: init for init in graph.initializer}
    rows = []
    for i in quant_index.compute_nodes:
        first_output = graph.node[i].output[0] if graph.node[i].output else ""
        reference = tensor_reference(quant_index, matcher, first_output) if first_output else None
        op = None
        if reference is not None and not has_subgraph(graph.node[i]):
            op = OpModel(quant_index, graph, i, matcher, initializer_protos)
        rows.append((i, reference, op))
    return rows


def row_answer(index, i, reference, op, ref_value, isolated, seen):
    """One ``ops`` row of the trace answer."""
    isolated_max, _ = error_stats(ref_value, isolated)
    propagated_max, sqnr = error_stats(ref_value, seen)
    scale = op.output_scale if op else None
    return {
        "node": index.names[i],
        "op_type": index.op_types[i],
        "wrapped": index.wrapped[i],
        "reference": reference,
        "isolated_max_abs": isolated_max,
        "propagated_max_abs": propagated_max,
        "isolated_lsb": isolated_max / scale if isolated_max is not None and scale else None,
        "sqnr_db": sqnr,
    }


def trace(a, b, inputs=None, seed=0, tolerance=TRACE_TOLERANCE, save=None):
    """Per operator of ``b`` (quantized): isolated and propagated error against ``a`` (float)."""
    float_model, quant_model = load_with_weights(a), load_with_weights(b)
    check_same_inputs(float_model, quant_model, a, b)
    feeds = model_samples(float_model, [inputs] if inputs else None, None, seed, TRACE_SYMBOLIC_DIM_SIZE)[0][0]
    quant_index = GraphIndex(quant_model.graph)
    matcher = ReferenceMatcher(float_model.graph)
    plan = plan_rows(quant_model, quant_index, matcher)
    op_models = [op for _, _, op in plan]
    output_names = [o.name for o in float_model.graph.output]

    # Session 1: the float model, exposing every reference a row needs.
    wanted_float = {ref for _, ref, _ in plan if ref} | set(output_names)
    for op in filter(None, op_models):
        wanted_float.update(ref for ref in op.feeds.values() if ref)
    float_values = {
        **feeds,
        **run_with_outputs(float_model, feeds, sorted(wanted_float - set(feeds)), a),
    }

    # Session 2: the quantized model with every single-op model appended.
    combined, row_feeds, extra_inputs, row_outputs = combined_model(quant_model, op_models, float_values)
    seen = {
        i: output_chain(quant_index, quant_model.graph, quant_model.graph.node[i].output[0])[1]
        for i, _, _ in plan
        if quant_model.graph.node[i].output
    }
    own_values = {t for op in filter(None, op_models) for t, ref in op.feeds.items() if ref is None}
    wanted_quant = set(seen.values()) | set(row_outputs.values()) | own_values | set(output_names)
    quant_values = run_with_outputs(
        combined, {**feeds, **row_feeds}, sorted(wanted_quant), b, extra_inputs, copy=False
    )
    quant_values.update(feeds)

    rows, saved = [], []
    for k, (i, reference, op) in enumerate(plan):
        ref_value = float_values.get(reference) if reference else None
        isolated = quant_values.get(row_outputs[k]) if op else None
        rows.append(row_answer(quant_index, i, reference, op, ref_value, isolated, quant_values.get(seen.get(i))))
        arrays = None
        if isolated is not None and ref_value is not None:
            arrays = {t: (float_values[r] if r else quant_values[t]) for t, r in op.feeds.items()}
            arrays = ({**arrays, "reference": ref_value}, isolated)
        saved.append(arrays)
    if save is not None:
        save_op_models(save, quant_model, rows, op_models, saved)
    return {
        "a": a,
        "b": b,
        "inputs": {name: list(array.shape) for name, array in feeds.items()},
        "ops": rows,
        "outputs": {
            name: error_stats(float_values[name], quant_values.get(name))[0] for name in output_names
        },
        "worst_isolated": worst_isolated(rows),
        "first_over": first_over(rows, tolerance),
        "unmatched": unmatched_float_nodes(matcher.index, quant_index, rows),
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
QUANT_RANGE = {  # (qmin, qmax) by the Q's integer type
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT16: (-32768, 32767),
    onnx.TensorProto.UINT16: (0, 65535),
    onnx.TensorProto.INT4: (-8, 7),
    onnx.TensorProto.UINT4: (0, 15),
}


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
    if qtype not in QUANT_RANGE:
        return None
    qmin, qmax = QUANT_RANGE[qtype]
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


def subgraph_reads(graph):
    """Every tensor name a node inside an If/Loop/Scan body reads (any depth)."""
    names = set()
    for node in graph.node:
        for attribute in node.attribute:
            for body in list(attribute.graphs) + ([attribute.g] if attribute.HasField("g") else []):
                names.update(t for inner in body.node for t in inner.input)
                names |= subgraph_reads(body)
    return names


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
    kept_names = {o.name for o in graph.output} | subgraph_reads(graph)
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
    tensor_variants = [
        (on, None if rounding[m] is None else {**on, **rounding[m]}) for m, on in enumerate(tensor_on)
    ]
    return builder.model, builder.defaults, op_variants, tensor_variants


# A variant changes the graph only from its sites on, and only along their
# cone. The derived model's data-dependent nodes are cut into segments, each
# an If with three versions: its outputs as cached from the baseline run, the
# segment as the quantized model has it ("plain": no switch machinery), and
# the segment with its switches ("switched"). A variant computes the segments
# its cone touches, with switches only where its own Where/Clip nodes are,
# and replays every other segment from the cache.
IMPACT_SEGMENTS = 16
SKIP = "graphscan.skip/{}"  # segment j replays its cached outputs
SWITCHED = "graphscan.switched/{}"  # segment j runs with its switch machinery
CACHE = "graphscan.cache/{}"
SEGMENT = "graphscan.{}{}/{}"  # version, segment, tensor


def topological_nodes(graph):
    """The graph's nodes in an order where every producer comes first; each
    node stays where it was unless a node it reads from comes later."""
    producer = {t: k for k, node in enumerate(graph.node) for t in node.output if t}
    emitted, order = [False] * len(graph.node), []
    for root in range(len(graph.node)):
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
            for t in reversed(graph.node[k].input):
                j = producer.get(t)
                if j is not None and not emitted[j] and j != k:
                    stack.append((j, False))
    return [graph.node[k] for k in order]


class Segments:
    """The cut of a derived model into segments of data-dependent nodes, and
    which segments each switch needs computed and switched."""

    def __init__(self, nodes, data_inputs, machinery, count):
        dependent_tensors = set(data_inputs)
        self.independent, dependent = [], []
        for node in nodes:
            # Machinery runs only in a switched segment, even a weight's Where.
            if node.name in machinery or any(t in dependent_tensors for t in node.input):
                dependent_tensors.update(t for t in node.output if t)
                dependent.append(node)
            else:
                self.independent.append(node)
        self.machinery = machinery  # names of the nodes graphscan added
        count = max(1, min(count, len(dependent)))
        size = len(dependent) / count
        self.chunks = [dependent[round(j * size) : round((j + 1) * size)] for j in range(count)]
        self.segment_of = {id(node): j for j, chunk in enumerate(self.chunks) for node in chunk}
        self.made_by = {t: node for node in nodes for t in node.output if t}
        self.consumers = {}
        for node in nodes:
            for t in node.input:
                self.consumers.setdefault(t, []).append(node)

    def leaving(self, j, graph_outputs):
        """Tensors segment j makes that later segments or the graph outputs read."""
        wanted = set(graph_outputs)
        for later in self.chunks[j + 1 :]:
            for node in later:
                wanted.update(node.input)
        return [t for node in self.chunks[j] for t in node.output if t and t in wanted]

    def needs(self, names):
        """``(computed, switched)`` segment sets for a variant setting the inputs ``names``."""
        active, seeds, stack, seen = [], [], list(names), set(names)
        while stack:  # forward through independent nodes and switch machinery
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
        feeding, stack = list(active), list(active)
        while stack:
            for t in stack.pop().input:
                node = self.made_by.get(t)
                if node is not None and node.name in self.machinery and id(node) in self.segment_of and node not in feeding:
                    feeding.append(node)
                    stack.append(node)
        switched = {self.segment_of[id(n)] for n in feeding}
        cone, stack, seen = set(switched), seeds + active, set()
        while stack:  # every node whose value the variant may change
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            cone.add(self.segment_of[id(node)])
            for t in node.output:
                stack.extend(self.consumers.get(t, ()))
        return cone, switched


def segment_versions(segments, j, leaving):
    """The switched and plain node lists of segment j; both make ``leaving``
    under their own prefixed names (a branch may not define an outer name)."""
    chunk = segments.chunks[j]
    made = {t for node in chunk for t in node.output if t}
    versions = []
    for version in ("switched", "plain"):
        prefix = lambda t, v=version: SEGMENT.format(v, j, t) if t in made else t  # noqa: E731
        dropped = {}
        if version == "plain":  # each switch-off machinery output is a copy of one input
            for node in chunk:
                if node.name in segments.machinery:
                    source = node.input[2] if node.op_type == "Where" else node.input[0]
                    for t in node.output:
                        dropped[t] = dropped.get(source, source)
        nodes = []
        for node in chunk:
            if version == "plain" and node.name in segments.machinery:
                continue
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.input[:] = [prefix(dropped.get(t, t)) for t in node.input]
            copy.output[:] = [prefix(t) for t in node.output]
            nodes.append(copy)
        outputs = []
        for t in leaving:
            if t in dropped:
                nodes.append(onnx.helper.make_node("Identity", [prefix(dropped[t])], [prefix(t) + "/copy"]))
                outputs.append(prefix(t) + "/copy")
            else:
                outputs.append(prefix(t))
        versions.append((nodes, outputs))
    return versions


def segmented_model(model, data_inputs, machinery, count=IMPACT_SEGMENTS):
    """``(model, caches, segments)``: ``model`` with its segments in Ifs.

    ``caches``: ``[(cache input, tensor)]`` to feed from the baseline run;
    ``segments`` answers which flags a variant needs (``segment_flags``).
    The model is returned as it was (``segments`` None) when it has If/Loop/Scan
    nodes (their bodies' outer reads are edges the cut cannot see), fewer than
    two segments, or a leaving tensor whose type shape inference does not give.
    """
    import numpy as np

    graph = model.graph
    if any(has_subgraph(node) for node in graph.node):
        return model, [], None
    nodes = topological_nodes(graph)
    segments = Segments(nodes, data_inputs, machinery, count)
    if len(segments.chunks) < 2:
        return model, [], None
    graph_outputs = [o.name for o in graph.output]
    leaving = [segments.leaving(j, graph_outputs) for j in range(len(segments.chunks))]
    # Inference reads nodes in list order, and outputs added by name only (the
    # probes) would hide their inferred type.
    typed = onnx.ModelProto()
    typed.CopyFrom(model)
    del typed.graph.node[:]
    typed.graph.node.extend(nodes)
    del typed.graph.output[:]
    typed.graph.output.extend(o for o in graph.output if o.type.tensor_type.elem_type)
    try:
        inferred = onnx.shape_inference.infer_shapes(typed, strict_mode=False)
    except Exception:
        return model, [], None
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    for v in list(inferred.graph.output) + list(inferred.graph.input):
        if v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    if not all(types.get(t) for out in leaving for t in out):
        return model, [], None

    segmented = onnx.ModelProto()
    segmented.CopyFrom(model)
    del segmented.graph.node[:]
    segmented.graph.node.extend(segments.independent)
    last = len(segments.chunks) - 1
    caches = []
    defaults = segments.flag_defaults = {}

    def flag(name):
        segmented.graph.input.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.BOOL, []))
        defaults[name] = np.array(False)
        return name

    def branch(name, nodes, outputs, out):
        return onnx.helper.make_graph(
            nodes, name, [], [onnx.helper.make_tensor_value_info(o, types[t], None) for o, t in zip(outputs, out)]
        )

    for j, out in enumerate(leaving):
        (switched, switched_out), (plain, plain_out) = segment_versions(segments, j, out)
        choose = onnx.helper.make_node(
            "If", [flag(SWITCHED.format(j))], out if j == last else [SEGMENT.format("run", j, t) for t in out],
            name=f"graphscan.run{j}",
            then_branch=branch(f"graphscan.switched{j}", switched, switched_out, out),
            else_branch=branch(f"graphscan.plain{j}", plain, plain_out, out),
        )
        if j == last:  # the outputs: always computed
            segmented.graph.node.append(choose)
            continue
        cached = []
        for t in out:
            caches.append((CACHE.format(t), t))
            segmented.graph.input.append(onnx.helper.make_tensor_value_info(caches[-1][0], types[t], None))
            cached.append(onnx.helper.make_node("Identity", [caches[-1][0]], [SEGMENT.format("cached", j, t)]))
        segmented.graph.node.append(
            onnx.helper.make_node(
                "If", [flag(SKIP.format(j))], out, name=f"graphscan.segment{j}",
                then_branch=branch(f"graphscan.cached{j}", cached, [SEGMENT.format("cached", j, t) for t in out], out),
                else_branch=onnx.helper.make_graph(
                    [choose], f"graphscan.computed{j}", [],
                    [onnx.helper.make_tensor_value_info(SEGMENT.format("run", j, t), types[t], None) for t in out],
                ),
            )
        )
    return segmented, caches, segments


def segment_flags(segments, variant):
    """The segment flags to turn on with ``variant``: skip every segment outside
    its cone, switch on the segments where its own machinery is."""
    if segments is None:
        return {}
    cone, switched = segments.needs(list(variant))
    flags = {SKIP.format(j): True for j in range(len(segments.chunks) - 1) if j not in cone}
    flags.update({SWITCHED.format(j): True for j in switched})
    return flags


def impact_session(model, path, message, threads=0):
    """An onnxruntime session with graph optimizations off; exit 5 with ``message`` if it cannot be built."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # onnxruntime pre-packs constant weights in the main graph but not inside an
    # If branch, and the two sum in different orders: without pre-packing, a
    # node computes the same bits wherever the segments put it (and the float
    # model too, so a model compared with itself gives exactly null).
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.intra_op_num_threads = threads
    options.log_severity_level = 4
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise GraphscanError(f"{path}: {message} ({one_line(exc)})", EXIT_RUNTIME)


class SwitchedRunner:
    """Runs the derived model once per (variant, sample), inputs bound once.

    ``defaults`` are the added scalar inputs' values while no variant is on;
    ``run(settings)`` binds ``settings`` instead for one run of every sample.
    """

    def __init__(self, model, defaults, samples, outputs, path):
        import numpy as np
        import onnxruntime as ort

        self.path = path
        self.message = f"graphscan's derived model of {path} does not run in onnxruntime"
        import concurrent.futures

        threads = min(len(samples), os.cpu_count() or 1)
        self.session = impact_session(
            model, path, f"graphscan's derived model of {path} cannot be built", 1 if threads > 1 else 0
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(threads)
        self.outputs = list(outputs)
        self.value = ort.OrtValue.ortvalue_from_numpy
        self.defaults = {name: self.value(array) for name, array in defaults.items()}
        self.true = self.value(np.array(True))
        empty = {}
        for info in model.graph.input:
            if info.name.startswith(CACHE.format("")):
                dtype = onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
                empty[info.name] = self.value(np.zeros((0,), dtype))
        self.bindings = []
        for feeds in samples:
            binding = self.session.io_binding()
            for name, array in feeds.items():
                binding.bind_cpu_input(name, array)
            for name, value in {**self.defaults, **empty}.items():  # caches: filled by cache()
                binding.bind_ortvalue_input(name, value)
            self.bindings.append(binding)

    def cache(self, values):
        """Bind ``values`` (per sample, ``{cache input: array}``) for the replayed segments."""
        self.cached = values
        for binding, sample in zip(self.bindings, values):
            for name, array in sample.items():
                binding.bind_cpu_input(name, array)

    def run(self, settings=None, extra_outputs=()):
        """Per sample, the graph outputs (then ``extra_outputs``) with ``settings`` bound.

        Samples run concurrently, each single-threaded: small kernels scale
        better across samples than across the threads of one kernel.
        """
        settings = {name: self.true if value is True else self.value(value) for name, value in (settings or {}).items()}

        def one(binding):
            for name, value in settings.items():
                binding.bind_ortvalue_input(name, value)
            binding.clear_binding_outputs()
            for name in self.outputs + list(extra_outputs):
                binding.bind_output(name)
            try:
                self.session.run_with_iobinding(binding)
            except Exception as exc:
                raise GraphscanError(f"{self.path}: {self.message} ({one_line(exc)})", EXIT_RUNTIME)
            finally:
                for name in settings:
                    binding.bind_ortvalue_input(name, self.defaults[name])
            return binding.copy_outputs_to_cpu()

        return list(self.pool.map(one, self.bindings))


class OutputNoise:
    """Output SQNR against the float model's outputs, summed over samples and outputs."""

    def __init__(self, float_outputs):
        import numpy as np

        self.reference = [[np.asarray(o, dtype=np.float64) for o in sample] for sample in float_outputs]
        self.signal = sum(float(np.vdot(o, o)) for sample in self.reference for o in sample)

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
                noise += float(np.vdot(difference, difference))
        return decibels(self.signal, noise), noise == 0.0


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


def clipped_fraction(values, q_range):
    """Fraction of ``values`` (one array per sample) outside the Q's [lo, hi]."""
    import numpy as np

    if q_range is None:
        return None
    lo, hi, _ = q_range
    total = outside = 0
    for value in values:
        value = np.asarray(value, dtype=np.float64)
        total += value.size
        outside += int(np.count_nonzero((value < lo) | (value > hi)))
    return outside / total if total else None


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


def tensor_values(model, samples, tensors, path):
    """``{tensor: [value per sample]}`` of ``model``'s own ``tensors``, one session."""
    if not tensors:
        return {}
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    del exposed.graph.output[:]
    exposed.graph.output.extend(onnx.ValueInfoProto(name=t) for t in tensors)
    session = impact_session(exposed, path, "model does not run in onnxruntime")
    values = {t: [] for t in tensors}
    for feeds in samples:
        try:
            outputs = session.run(list(tensors), feeds)
        except Exception as exc:
            raise GraphscanError(f"{path}: model does not run in onnxruntime ({one_line(exc)})", EXIT_RUNTIME)
        for t, value in zip(tensors, outputs):
            values[t].append(value)
    return values


class ImpactRun:
    """The derived model of ``quant_model`` in one session, ready to measure variants.

    ``baseline``: ``(sqnr_db, exact)`` of the quantized model as it is;
    ``probe_values``: per tensor row with a known range, its values per sample;
    ``measure(variant)``: ``(sqnr_db, exact)`` with ``variant`` on.
    """

    def __init__(self, float_model, quant_model, samples, output_names, noise, path):
        self.noise = noise
        self.plan = plan = ImpactPlan(float_model, quant_model)
        derived, defaults, self.op_variants, self.tensor_variants = switched_model(plan, quant_model, float_model)
        machinery = {node.name for node in derived.graph.node if node.name.startswith(IMPACT_PREFIX)}
        derived, caches, self.segments = segmented_model(derived, list(samples[0]), machinery)
        if self.segments is not None:
            defaults.update(self.segments.flag_defaults)
        exposed = {o.name for o in derived.graph.output}
        derived.graph.output.extend(onnx.ValueInfoProto(name=t) for _, t in caches if t not in exposed)
        self.runner = SwitchedRunner(derived, defaults, samples, output_names, path)

        fetched = [t for t in dict.fromkeys(t for _, t in caches) if t not in output_names]
        first = self.runner.run(extra_outputs=fetched)
        n_out = len(output_names)
        self.baseline = noise.measure([sample[:n_out] for sample in first])
        values = [dict(zip(output_names + fetched, sample)) for sample in first]
        del first
        self.runner.cache([{c: sample[t] for c, t in caches} for sample in values])
        del values
        # The tensors whose clipped fraction is reported, from the quantized model
        # itself: as graph outputs of the derived model they would all cross
        # segments and be copied on every replay.
        probes = [t for t, _, q_range, _ in plan.tensor_rows if q_range is not None and t not in samples[0]]
        self.probe_values = tensor_values(quant_model, samples, probes, path)
        self.probe_values.update({t: [sample[t] for sample in samples] for t in samples[0]})

    def measure(self, variant):
        return self.noise.measure(self.runner.run({**variant, **segment_flags(self.segments, variant)}))


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
    op_variants, tensor_variants, probe_values = run.op_variants, run.tensor_variants, run.probe_values

    index = plan.index
    op_rows, op_exact = [], []
    for (i, _), variant in zip(plan.op_rows, op_variants):
        sqnr, exact = measure(variant)
        op_rows.append(
            {"node": index.names[i], "op_type": index.op_types[i], "sqnr_db": sqnr, "gain_db": gain(sqnr, baseline[0])}
        )
        op_exact.append(exact)
    tensor_rows, tensor_exact = [], []
    for (t, pairs, q_range, _), (kept, rounded) in zip(plan.tensor_rows, tensor_variants):
        sqnr, exact = measure(kept)
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
                "clipped": clipped_fraction(probe_values.get(t, ()), q_range) if q_range else None,
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

TRACE_OPTIONS = [
    ("--inputs", {"metavar": "FILE.npz", "help": "one array per graph input, by name"}),
    ("--seed", {"type": int, "default": 0, "help": "seed of the random inputs (default: 0)"}),
    ("--tolerance", {"type": float, "default": TRACE_TOLERANCE, "help": "first_over threshold"}),
    ("--save", {"metavar": "DIR", "help": "write each op's single-op model and inputs here"}),
]

def non_negative_int(text):
    """argparse type: an integer >= 0 (anything else is a usage error)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def finite_float(text):
    """argparse type: a finite number (NaN and infinities are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


IMPACT_OPTIONS = [
    ("--inputs", {"metavar": "FILE.npz", "action": "append", "help": "one sample: one array per graph input, by name (repeatable)"}),
    ("--seed", {"type": int, "default": 0, "help": "seed of the random sample without --inputs (default: 0)"}),
    ("--shape", {"metavar": "NAME=D0,D1,...", "action": "append", "help": "shape of a random input (repeatable)"}),
    ("--target-sqnr", {"metavar": "DB", "type": finite_float, "help": "find the nodes to exclude to reach this output SQNR"}),
    ("--max-exclude", {"metavar": "N", "type": non_negative_int, "help": "at most N excluded nodes (with --target-sqnr)"}),
    ("--top", {"metavar": "N", "type": non_negative_int, "help": "list only the first N ops and tensors (all are measured)"}),
]

# name: (function, positional paths, help, options)
COMMANDS = {
    "nodes": (nodes, ["model"], "op census and initializer dtypes", []),
    "qdq": (qdq, ["model"], "Q/DQ counts, round trips, weight DQs", []),
    "islands": (islands, ["model"], "int8-wrapped vs float nodes, float islands", []),
    "boundary": (boundary, ["model"], "DQs entering and Qs leaving each island", []),
    "diff": (diff, ["a", "b"], "b minus a for the counts above", []),
    "fuse": (fuse, ["model", "output"], "fuse MatMul+Add into Gemm, verified, into output", []),
    "trace": (trace, ["a", "b"], "per-op isolated and propagated error of b (quantized) vs a (float)", TRACE_OPTIONS),
    "impact": (impact, ["a", "b"], "output SQNR gained by keeping each op or tensor of b (quantized) float", IMPACT_OPTIONS),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises a one-line usage error instead of printing usage."""

    def error(self, message):
        raise GraphscanError(f"usage: {message}", EXIT_USAGE)


def build_parser():
    parser = OneLineParser(
        prog="graphscan.py",
        description="Count what quantization did to an ONNX graph; one JSON object on stdout.",
        epilog=(
            "exit codes: 0 ok, 2 usage, 3 no such file (or output not writable), "
            "4 not an ONNX model, 5 model does not run in onnxruntime, "
            "6 fused model does not reproduce the original, "
            "7 trace inputs do not match the models"
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=OneLineParser)
    for name, (_, paths, help_text, options) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        for path in paths:
            command.add_argument(path, help="path to an .onnx file")
        for flag, settings in options:
            command.add_argument(flag, **settings)
    return parser


def run(argv):
    """Parse ``argv`` and return the command's answer (raises GraphscanError)."""
    args = build_parser().parse_args(argv)
    if args.command is None:
        raise GraphscanError(
            f"usage: a command is required ({', '.join(COMMANDS)})", EXIT_USAGE
        )
    function, paths, _, options = COMMANDS[args.command]
    dests = [flag.lstrip("-").replace("-", "_") for flag, _ in options]
    keywords = {dest: getattr(args, dest) for dest in dests}
    return function(*(getattr(args, p) for p in paths), **keywords)


def main(argv=None):
    """Run one command; print its JSON answer or one error line. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # A short run that builds a million small objects: the cyclic collector
    # would only rescan them again and again (about a third of the time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        text = json.dumps(run(argv))
    except GraphscanError as exc:
        print(f"graphscan: {exc}", file=sys.stderr)
        return exc.exit_code
    except SystemExit as exc:  # argparse after printing --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except Exception as exc:  # a bug: still one line, never a traceback
        print(f"graphscan: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    finally:
        if gc_was_enabled:
            gc.enable()
    sys.stdout.write(text + "\n")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
