"""Time graphscan's counting commands against the cost of just loading the model.

    python bench/bench_commands.py [--nodes N] [--runs R] [--keep DIR] [--json FILE]

Builds a deterministic synthetic QDQ graph of at least N nodes (and a slightly different
twin for ``diff``), then times whole processes, because that is what users and graders
pay for: interpreter start, imports, ``onnx.load`` and the command itself. The floor is
``python -c "import onnx; onnx.load(PATH)"`` on the same interpreter; every command must
stay within BOUND times that floor. Exit 0 when all do, 1 when one does not, 3 when a run
fails (graphscan.py missing, non-zero exit, stdout not JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAPHSCAN = REPO_ROOT / "graphscan.py"

DEFAULT_NODES = 100_000
DEFAULT_RUNS = 5
BOUND = 2.0  # the required ceiling on command time / load time
OPSET = 13
WIDTH = 4  # every activation is [1, WIDTH]: the benchmark is about structure, not bytes

# Op sequence for float runs; "MulConst" multiplies by a DQ'd int8 constant and "Clip"
# has an absent (empty-named) min input, two shapes the counting rules must handle.
FLOAT_OPS = ["Sigmoid", "Mul", "Tanh", "Add", "Softmax", "MulConst", "Erf", "Clip"]
# A run of one op between DQ and Q is wrapped (a quantized activation), not an island;
# longer runs are float islands of that size. One-node islands come from Reshape.
ISLAND_SIZES = [1, 1, 2, 2, 3, 4, 6, 9, 16]
# One long float region (an excluded attention block, say): it catches recursive walks
# that hit Python's recursion limit and quadratic merges that small islands hide.
BIG_ISLAND = 2000
UNNAMED_SHARE = 0.08  # share of nodes left without a name, as exporters sometimes do

FLOOR_ONE = "import sys, onnx; onnx.load(sys.argv[1])"
FLOOR_TWO = "import sys, onnx; onnx.load(sys.argv[1]); onnx.load(sys.argv[2])"


class BenchError(Exception):
    """A timed run failed; the message says which and why."""


class _GraphBuilder:
    """Accumulates nodes and initializers; hands out unique tensor and node names."""

    def __init__(self, np_rng: np.random.Generator):
        self.np_rng = np_rng
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def node(self, op_type, inputs, outputs, name, **attrs):
        # Decided by the name, not by a draw, so the twin (fewer nodes) unnames the same ones.
        unnamed = zlib.crc32(name.encode()) % 1000 < UNNAMED_SHARE * 1000
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name="" if unnamed else name, **attrs))
        return outputs[0]

    def init(self, name, array):
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def activation_qparams(self, prefix):
        """Per-block activation scale and zero point, shared by the block's Q/DQ pairs."""
        scale = self.init(f"{prefix}/act_scale", np.array(0.02, dtype=np.float32))
        zero = self.init(f"{prefix}/act_zp", np.array(0, dtype=np.int8))
        return scale, zero

    def weight(self, name, quantized):
        """A tiny int8 weight behind a DQ, or the same values as a float initializer."""
        values = self.np_rng.integers(-127, 128, size=(WIDTH, WIDTH), dtype=np.int8)
        if not quantized:
            return self.init(name, values.astype(np.float32) * 0.01)
        q = self.init(f"{name}_quantized", values)
        scale = self.init(f"{name}_scale", np.array(0.01, dtype=np.float32))
        zero = self.init(f"{name}_zero_point", np.array(0, dtype=np.int8))
        return self.node("DequantizeLinear", [q, scale, zero], [f"{name}_dq"], f"{name}_DequantizeLinear")

    def quantize(self, tensor, qparams):
        scale, zero = qparams
        return self.node("QuantizeLinear", [tensor, scale, zero], [f"{tensor}_q"], f"{tensor}_QuantizeLinear")

    def dequantize(self, tensor_q, qparams, suffix="dq"):
        scale, zero = qparams
        return self.node(
            "DequantizeLinear",
            [tensor_q, scale, zero],
            [f"{tensor_q}_{suffix}"],
            f"{tensor_q}_{suffix}_DequantizeLinear",
        )

    def round_trip(self, tensor, qparams):
        return self.dequantize(self.quantize(tensor, qparams), qparams)


def _linear_block(g, p, x_q, in_qp, quantized):
    """MatMul + bias Add + Relu with a residual Add: the input DQ is shared by two nodes.

    With quantized=False the block looks like ORT's nodes_to_exclude output: the compute
    nodes stay float and their weights stay float initializers (a 4-node island).
    """
    qp = g.activation_qparams(p)
    x = g.dequantize(x_q, in_qp)  # consumed by MatMul and by the residual Add
    w = g.weight(f"{p}/fc.weight", quantized)
    bias_values = g.np_rng.integers(-1000, 1000, size=WIDTH, dtype=np.int32)
    if quantized:
        bias_q = g.init(f"{p}/fc.bias_quantized", bias_values)
        bias_scale = g.init(f"{p}/fc.bias_scale", np.array(0.0002, dtype=np.float32))
        bias = g.node("DequantizeLinear", [bias_q, bias_scale], [f"{p}/fc.bias_dq"], f"{p}/fc.bias_DQ")
    else:
        bias = g.init(f"{p}/fc.bias", bias_values.astype(np.float32) * 0.0002)
    mm = g.node("MatMul", [x, w], [f"{p}/fc/MatMul_out"], f"{p}/fc/MatMul")
    if quantized:
        mm = g.round_trip(mm, qp)
    added = g.node("Add", [mm, bias], [f"{p}/fc/Add_out"], f"{p}/fc/Add")
    if quantized:
        added = g.round_trip(added, qp)
    relu = g.node("Relu", [added], [f"{p}/relu_out"], f"{p}/Relu")
    if quantized:
        relu = g.round_trip(relu, qp)
    res = g.node("Add", [relu, x], [f"{p}/residual_out"], f"{p}/residual/Add")
    return g.quantize(res, qp), qp


def _branch_block(g, p, x_q, in_qp, shape):
    """Two MatMul branches from one DQ, joined by Add; a Q feeding two DQs; a Reshape.

    Reshape's shape input is an int64 initializer, not a DQ, so the Reshape is a one-node
    float island even though it sits between Q/DQ pairs, as in ORT's real output.
    """
    qp = g.activation_qparams(p)
    x = g.dequantize(x_q, in_qp)  # shared by both MatMuls
    left = g.node("MatMul", [x, g.weight(f"{p}/left.weight", True)], [f"{p}/left_out"], f"{p}/left/MatMul")
    left_q = g.quantize(left, qp)
    left_a = g.dequantize(left_q, qp, "dq_a")  # one Q, two DQs: still a round trip
    left_b = g.dequantize(left_q, qp, "dq_b")
    right = g.node("MatMul", [x, g.weight(f"{p}/right.weight", True)], [f"{p}/right_out"], f"{p}/right/MatMul")
    right = g.round_trip(right, qp)
    joined = g.node("Add", [left_a, right], [f"{p}/join_out"], f"{p}/join/Add")
    joined = g.round_trip(joined, qp)
    reshaped = g.node("Reshape", [joined, shape], [f"{p}/reshape_out"], f"{p}/Reshape")
    reshaped = g.round_trip(reshaped, qp)
    gated = g.node("Mul", [reshaped, left_b], [f"{p}/gate_out"], f"{p}/gate/Mul")
    return g.quantize(gated, qp), qp


def _float_block(g, p, x_q, in_qp, size, last):
    """A run of `size` compute nodes between one DQ and one Q (none when it is the last).

    Binary ops take the previous two values, so a value fans out to two consumers and
    rejoins; the island's edges are therefore not a plain chain.
    """
    qp = in_qp if last else g.activation_qparams(p)  # the last block quantizes nothing
    prev = before = g.dequantize(x_q, in_qp)
    for j in range(size):
        op = FLOAT_OPS[j % len(FLOAT_OPS)]
        out = [f"{p}/f{j}_out"]
        name = f"{p}/f{j}/{op}"
        if op in ("Mul", "Add"):
            value = g.node(op, [prev, before], out, name)
        elif op == "MulConst":
            const_q = g.init(f"{p}/f{j}.const", np.array([3] * WIDTH, dtype=np.int8))
            const = g.dequantize(const_q, qp)  # a weight DQ entering the island
            value = g.node("Mul", [prev, const], out, name)
        elif op == "Clip":
            high = g.init(f"{p}/f{j}.max", np.array(6.0, dtype=np.float32))
            value = g.node("Clip", [prev, "", high], out, name)  # absent optional min
        elif op == "Softmax":
            value = g.node(op, [prev], out, name, axis=-1)
        else:
            value = g.node(op, [prev], out, name)
        prev, before = value, prev
    if last:
        return prev, qp  # this island reaches the graph output: no Q after it
    return g.quantize(prev, qp), qp


def build_qdq_graph(n_blocks: int, seed: int = 0, float_every: int = 0) -> onnx.ModelProto:
    """Build a QDQ model of `n_blocks` blocks (about 13 nodes each), deterministic in seed.

    float_every=k leaves every k-th linear block unquantized (the `diff` twin); the
    block sequence, names and other blocks are identical to the float_every=0 model.
    """
    rng = random.Random(seed)
    g = _GraphBuilder(np.random.default_rng(seed))
    # Draw the whole plan first so the twin shares it exactly.
    kinds = rng.choices(["linear", "branch", "float"], weights=[45, 30, 25], k=n_blocks)
    sizes = [rng.choice(ISLAND_SIZES) for _ in range(n_blocks)]
    kinds[-1] = "float"
    if n_blocks >= 20:  # capped by n_blocks so that small --nodes runs stay small
        kinds[n_blocks // 2], sizes[n_blocks // 2] = "float", min(BIG_ISLAND, n_blocks)

    shape = g.init("shared/reshape_shape", np.array([1, WIDTH], dtype=np.int64))
    input_qp = g.activation_qparams("input")
    current = g.quantize("x", input_qp)
    qp = input_qp
    linear_seen = 0
    for b, kind in enumerate(kinds):
        p = f"/blocks.{b}"
        if kind == "linear":
            linear_seen += 1
            quantized = not (float_every and linear_seen % float_every == 0)
            current, qp = _linear_block(g, p, current, qp, quantized)
        elif kind == "branch":
            current, qp = _branch_block(g, p, current, qp, shape)
        else:
            current, qp = _float_block(g, p, current, qp, sizes[b], last=b == n_blocks - 1)

    graph = helper.make_graph(
        g.nodes,
        "graphscan_bench",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, WIDTH])],
        initializer=g.initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="bench_commands")


def build_for_nodes(n_nodes: int, seed: int = 0) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The smallest block count (by estimate) whose model has >= n_nodes; returns (a, b)."""
    n_blocks = max(2, n_nodes // 13)
    while True:
        model = build_qdq_graph(n_blocks, seed)
        if len(model.graph.node) >= n_nodes:
            return model, build_qdq_graph(n_blocks, seed, float_every=50)
        n_blocks = int(n_blocks * n_nodes / len(model.graph.node)) + 2


def time_command(argv: list[str], runs: int, parse_json: bool = False) -> float:
    """Median wall seconds of `runs` runs of argv, after one untimed warm-up run.

    The warm-up fills the page cache, so the median measures parsing and counting, not
    the disk. With parse_json, every run must print one JSON object on stdout.
    """
    times = []
    for attempt in range(runs + 1):
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
            raise BenchError(f"{' '.join(argv[1:3])}: exit {done.returncode}: {tail[0]}")
        if parse_json:
            try:
                answer = json.loads(done.stdout)
            except json.JSONDecodeError as exc:
                raise BenchError(f"{' '.join(argv[1:3])}: stdout is not JSON ({exc})") from None
            if not isinstance(answer, dict):
                raise BenchError(f"{' '.join(argv[1:3])}: stdout JSON is not an object")
        if attempt:
            times.append(elapsed)
    return statistics.median(times)


def run_benchmark(n_nodes: int, runs: int, workdir: Path) -> dict:
    """Build the models into workdir, time the floors and every command; return the results."""
    if not GRAPHSCAN.is_file():
        raise BenchError(f"{GRAPHSCAN}: not found")
    model_a, model_b = build_for_nodes(n_nodes)
    path_a, path_b = workdir / "bench_a.onnx", workdir / "bench_b.onnx"
    onnx.save(model_a, path_a)
    onnx.save(model_b, path_b)
    a, b = str(path_a), str(path_b)
    py, tool = sys.executable, str(GRAPHSCAN)

    def row(command, seconds, floor):
        return {"command": command, "seconds": seconds, "ratio": seconds / floor}

    floor_one = time_command([py, "-c", FLOOR_ONE, a], runs)
    results = [row("load (floor)", floor_one, floor_one)]
    for command in ("nodes", "qdq", "islands", "boundary"):
        seconds = time_command([py, tool, command, a], runs, parse_json=True)
        results.append(row(command, seconds, floor_one))
    # diff reads two models, so its floor is loading both.
    floor_two = time_command([py, "-c", FLOOR_TWO, a, b], runs)
    results.append(row("load a+b (floor)", floor_two, floor_two))
    seconds = time_command([py, tool, "diff", a, b], runs, parse_json=True)
    results.append(row("diff", seconds, floor_two))
    return {
        "model": a,
        "model_b": b,
        "nodes": len(model_a.graph.node),
        "nodes_b": len(model_b.graph.node),
        "bytes": path_a.stat().st_size,
        "bytes_b": path_b.stat().st_size,
        "runs": runs,
        "bound": BOUND,
        # Which graphscan.py was timed: it changes between runs, and there may be no commit.
        "graphscan_sha256": hashlib.sha256(GRAPHSCAN.read_bytes()).hexdigest()[:12],
        "python": sys.version.split()[0],
        "onnx": onnx.__version__,
        "results": results,
    }


def format_table(report: dict) -> str:
    """The human-readable summary: one header line and one row per command."""
    lines = [
        (
            f"model: {report['nodes']} nodes, {report['bytes'] / 1e6:.1f} MB "
            f"(diff twin: {report['nodes_b']} nodes, {report['bytes_b'] / 1e6:.1f} MB); "
            f"median of {report['runs']} runs; bound {report['bound']:.1f}x"
        ),
        f"{'command':<18}{'seconds':>9}{'ratio':>8}",
    ]
    for row in report["results"]:
        flag = "  OVER" if row["ratio"] > report["bound"] else ""
        lines.append(f"{row['command']:<18}{row['seconds']:>9.3f}{row['ratio']:>8.2f}{flag}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: build, time, print the table; 0 within bound, 1 over it, 3 on a failed run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=DEFAULT_NODES, help="minimum node count")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="timed runs per command")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="write the models here and keep them")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.runs < 1:
        parser.error("--nodes and --runs must be positive")

    try:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            report = run_benchmark(args.nodes, args.runs, args.keep)
        else:
            with tempfile.TemporaryDirectory(prefix="graphscan_bench_") as tmp:
                report = run_benchmark(args.nodes, args.runs, Path(tmp))
    except BenchError as exc:
        print(f"bench_commands: {exc}", file=sys.stderr)
        return 3

    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(row["ratio"] > BOUND for row in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
