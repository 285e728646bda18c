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
import json
import os
import stat
import sys
from collections import Counter

import onnx

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NO_FILE = 3
EXIT_NOT_ONNX = 4
EXIT_INTERNAL = 1  # a bug in graphscan, reported in one line

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"


class GraphscanError(Exception):
    """A user error: one line for stderr and the exit code that goes with it."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------
# Loading


def load_model(path):
    """Parse ``path`` as an ONNX model without touching external-data files."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise GraphscanError(f"{path}: no such file ({exc.strerror or exc})", EXIT_NO_FILE)
    if not stat.S_ISREG(mode):
        raise GraphscanError(f"{path}: not a regular file", EXIT_NO_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise GraphscanError(f"{path}: cannot read ({exc.strerror or exc})", EXIT_NO_FILE)
    return parse_model(data, path)


def parse_model(data, path):
    """Turn bytes into a ModelProto, or raise exit 4 naming ``path``."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError, upb sometimes others
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GraphscanError(f"{path}: not an ONNX model ({reason})", EXIT_NOT_ONNX)
    # Protobuf parses an empty file, or one cut at a field boundary, as a
    # (partial) message: a model must at least carry a graph and an opset.
    if not data or not model.HasField("graph") or not model.opset_import:
        raise GraphscanError(
            f"{path}: not an ONNX model (no graph or opset_import)", EXIT_NOT_ONNX
        )
    return model


# --------------------------------------------------------------------------
# The graph index: built once, every question answered from it in linear time


def node_name(node, index):
    """The node's name, or ``<op_type>_<index>`` when it has none."""
    return node.name or f"{node.op_type}_{index}"


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
    """

    def __init__(self, graph):
        self.graph = graph
        nodes = list(graph.node)
        self.op_types = [node.op_type for node in nodes]
        self.names = [node_name(node, i) for i, node in enumerate(nodes)]
        self.inputs = [[t for t in node.input if t] for node in nodes]
        self.outputs = [[t for t in node.output if t] for node in nodes]
        self.initializers = {init.name for init in graph.initializer}
        self.producer = {}
        self.consumers = {}
        for i, outputs in enumerate(self.outputs):
            for tensor in outputs:
                self.producer[tensor] = i
        for i, inputs in enumerate(self.inputs):
            for tensor in inputs:
                self.consumers.setdefault(tensor, []).append(i)
        self.is_q = [op == QUANTIZE for op in self.op_types]
        self.is_dq = [op == DEQUANTIZE for op in self.op_types]
        self.wrapped = [self._is_wrapped(i) for i in range(len(nodes))]

    def __len__(self):
        return len(self.op_types)

    def is_compute(self, i):
        return not (self.is_q[i] or self.is_dq[i])

    def producer_of(self, tensor):
        """Index of the node producing ``tensor``, or None."""
        return self.producer.get(tensor)

    def consumers_of(self, tensor):
        return self.consumers.get(tensor, ())

    def _is_wrapped(self, i):
        # Wrapped: every input comes from a DQ and every output goes to Qs only
        # (an output nobody consumes, e.g. a bare graph output, is not wrapped).
        if not self.is_compute(i):
            return False
        for tensor in self.inputs[i]:
            producer = self.producer.get(tensor)
            if producer is None or not self.is_dq[producer]:
                return False
        for tensor in self.outputs[i]:
            consumers = self.consumers.get(tensor)
            if not consumers or not all(self.is_q[c] for c in consumers):
                return False
        return True

    def is_float(self, i):
        return self.is_compute(i) and not self.wrapped[i]

    def float_neighbours(self, i):
        """Float nodes sharing a tensor directly with float node ``i``."""
        for tensor in self.inputs[i]:
            producer = self.producer.get(tensor)
            if producer is not None and self.is_float(producer):
                yield producer
        for tensor in self.outputs[i]:
            for consumer in self.consumers.get(tensor, ()):
                if self.is_float(consumer):
                    yield consumer


def float_islands(index):
    """Connected components of float nodes, each a list of node indices.

    Each island is sorted by node name and the list by each island's names,
    which puts the island with the smallest first name first (SPEC.md).
    """
    seen = [False] * len(index)
    islands = []
    for start in range(len(index)):
        if seen[start] or not index.is_float(start):
            continue
        seen[start] = True
        island, stack = [], [start]
        while stack:
            i = stack.pop()
            island.append(i)
            for j in index.float_neighbours(i):
                if not seen[j]:
                    seen[j] = True
                    stack.append(j)
        island.sort(key=index.names.__getitem__)
        islands.append(island)
    islands.sort(key=lambda island: [index.names[i] for i in island])
    return islands


def boundary_of(index, island):
    """Distinct DQ nodes feeding the island and distinct Q nodes it feeds."""
    in_dequantize, out_quantize = set(), set()
    for i in island:
        for tensor in index.inputs[i]:
            producer = index.producer_of(tensor)
            if producer is not None and index.is_dq[producer]:
                in_dequantize.add(producer)
        for tensor in index.outputs[i]:
            for consumer in index.consumers_of(tensor):
                if index.is_q[consumer]:
                    out_quantize.add(consumer)
    return in_dequantize, out_quantize


def count_round_trips(index):
    """Q nodes whose output is consumed, and consumed only by DQ nodes."""
    count = 0
    for i in range(len(index)):
        if not index.is_q[i]:
            continue
        consumers = [c for t in index.outputs[i] for c in index.consumers_of(t)]
        if consumers and all(index.is_dq[c] for c in consumers):
            count += 1
    return count


def count_weight_dequantize(index):
    """DQ nodes whose first input is an initializer (a stored int8 weight)."""
    graph_nodes = index.graph.node
    return sum(
        1
        for i in range(len(index))
        if index.is_dq[i]
        and graph_nodes[i].input
        and graph_nodes[i].input[0] in index.initializers
    )


# --------------------------------------------------------------------------
# Answers from an index (used by the commands and by gen_models.py)


def census(index):
    """``{op_type: count}`` with keys sorted."""
    return dict(sorted(Counter(index.op_types).items()))


def initializer_census(graph):
    """``{dtype_name: count}`` over the graph's initializers, keys sorted."""
    counts = Counter(dtype_name(init.data_type) for init in graph.initializer)
    return dict(sorted(counts.items()))


def qdq_counts(index):
    return {
        "quantize": sum(index.is_q),
        "dequantize": sum(index.is_dq),
        "round_trips": count_round_trips(index),
        "weight_dequantize": count_weight_dequantize(index),
    }


def island_report(index, islands):
    compute = sum(1 for i in range(len(index)) if index.is_compute(i))
    wrapped = sum(index.wrapped)
    entries = []
    for island in islands:
        entries.append(
            {
                "nodes": [index.names[i] for i in island],
                "size": len(island),
                "op_types": sorted(index.op_types[i] for i in island),
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
    for island in islands:
        in_dq, out_q = boundary_of(index, island)
        per_island.append(
            {
                "nodes": [index.names[i] for i in island],
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
    index = GraphIndex(model.graph)
    return {
        "model": path,
        "nodes": len(index),
        "op_types": census(index),
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
    """The numbers ``diff`` compares, from one index."""
    report = island_report(index, float_islands(index))
    return {
        "op_types": census(index),
        **qdq_counts(index),
        "island_count": report["island_count"],
        "float": report["float"],
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
# fuse: MatMul + Add -> Gemm, verified with onnxruntime before anything is written

EXIT_RUNTIME = 5  # the model does not run in onnxruntime
EXIT_MISMATCH = 6  # the fused model does not reproduce the original

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


def gemm_plan(index, model, shapes, matmul):
    """``(add_index, c_name, None)`` if MatMul ``matmul`` can fuse, else ``(None, None, reason)``."""
    graph_outputs = {output.name for output in model.graph.output}
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
    replace, drop, fused, skipped = {}, set(), [], []
    for i, op_type in enumerate(index.op_types):
        if op_type != "MatMul":
            continue
        add, c_name, reason = gemm_plan(index, model, shapes, i)
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


def random_inputs(model, seed):
    """Seeded inputs for every graph input (symbolic dims get a fixed size)."""
    import numpy as np

    initializers = {init.name for init in model.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in model.graph.input:
        if info.name in initializers:
            continue
        tensor_type = info.type.tensor_type
        shape = [
            d.dim_value if d.HasField("dim_value") else SYMBOLIC_DIM_SIZE
            for d in tensor_type.shape.dim
        ]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        feeds[info.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def run_model(model, feeds, path):
    """All graph outputs of ``model`` on ``feeds``, with ORT's own fusions off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return session.run(None, feeds)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GraphscanError(f"{path}: model does not run in onnxruntime ({reason})", EXIT_RUNTIME)


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
    """The model with external-data weights loaded from its own folder."""
    model = load_model(path)
    from onnx import external_data_helper

    if any(external_data_helper.uses_external_data(t) for t in model.graph.initializer):
        try:
            external_data_helper.load_external_data_for_model(
                model, os.path.dirname(os.path.abspath(path))
            )
        except Exception as exc:
            raise GraphscanError(f"{path}: cannot load external data ({exc})", EXIT_NOT_ONNX)
    return model


def fuse(path, output):
    """Fuse MatMul+Add into Gemm, verify with onnxruntime, then write ``output``."""
    model = load_with_weights(path)
    fused_model, fused, skipped = fuse_matmul_add(model)
    try:
        onnx.checker.check_model(fused_model, full_check=True)
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GraphscanError(f"{path}: fused model fails the checker ({reason})", EXIT_MISMATCH)
    feeds = random_inputs(model, FUSE_SEED)
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
# Command line

COMMANDS = {
    "nodes": (nodes, ["model"], "op census and initializer dtypes"),
    "qdq": (qdq, ["model"], "Q/DQ counts, round trips, weight DQs"),
    "islands": (islands, ["model"], "int8-wrapped vs float nodes, float islands"),
    "boundary": (boundary, ["model"], "DQs entering and Qs leaving each island"),
    "diff": (diff, ["a", "b"], "b minus a for the counts above"),
    "fuse": (fuse, ["model", "output"], "fuse MatMul+Add into Gemm, verified, into output"),
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
            "6 fused model does not reproduce the original"
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", parser_class=OneLineParser)
    for name, (_, paths, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        for path in paths:
            command.add_argument(path, help="path to an .onnx file")
    return parser


def run(argv):
    """Parse ``argv`` and return the command's answer (raises GraphscanError)."""
    args = build_parser().parse_args(argv)
    if args.command is None:
        raise GraphscanError(
            f"usage: a command is required ({', '.join(COMMANDS)})", EXIT_USAGE
        )
    function, paths, _ = COMMANDS[args.command]
    return function(*(getattr(args, p) for p in paths))


def main(argv=None):
    """Run one command; print its JSON answer or one error line. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        answer = run(argv)
    except GraphscanError as exc:
        print(f"graphscan: {exc}", file=sys.stderr)
        return exc.exit_code
    except SystemExit as exc:  # argparse after printing --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except Exception as exc:  # a bug: still one line, never a traceback
        print(f"graphscan: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_INTERNAL
    sys.stdout.write(json.dumps(answer) + "\n")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
