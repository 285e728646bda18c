"""Peak memory of graphscan's trace against running both models once in onnxruntime.

    python bench/bench_trace_memory.py [--ops N] [--width W] [--det FLOAT QUANT [--shape S | --inputs X.npz]]

Two pairs, each measured as whole processes through a small wrapper (ru_maxrss of its
child, as bench/bench_trace.py does):

  chain: a generated chain of N elementwise ops on a [1, W] float32 tensor (W=65536 is
         256 KiB per activation), and its QDQ twin (Q->DQ after the input and every op);
  det:   any float/quantized pair given with --det, fed seeded data of --shape, or the
         sample of --inputs (an .npz: real data, as users trace).

  baseline: python bench_trace_memory.py --run-both FLOAT QUANT SHAPE|X.npz (both models
            loaded in onnxruntime with graph optimizations off, as trace does, each run once);
  trace:    python graphscan.py trace FLOAT QUANT --shape SHAPE (or --inputs X.npz).

The requirement (issue 10): trace's peak RSS at most BOUND times the baseline's.
Exit 0 when every pair is within it, 1 when one is not, 3 when a run fails.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAPHSCAN = REPO_ROOT / "graphscan.py"
THIS_FILE = Path(__file__).resolve()
BOUND = 3.0
DEFAULT_OPS = 2500
DEFAULT_WIDTH = 65536  # 256 KiB of float32 per activation
SCALE = 0.01  # every Q in the chain: int8, zero point 0
RSS_UNIT = 1 if sys.platform == "darwin" else 1024


def chain_models(ops: int, width: int):
    """A float chain of ``ops`` elementwise ops on x [1, width] and its QDQ twin.

    The ops alternate Add 0.5, Mul 0.9 and Sub 0.25 so the values stay in a
    bounded range; the QDQ twin names its tensors as onnxruntime's quantizer
    does (``t_QuantizeLinear_Output``, ``t_DequantizeLinear_Output``).
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    kinds = [("Add", 0.5), ("Mul", 0.9), ("Sub", 0.25)]

    def build(quantized):
        nodes, inits = (
            [],
            [
                numpy_helper.from_array(np.array(SCALE, np.float32), "scale"),
                numpy_helper.from_array(np.array(0, np.int8), "zero"),
            ],
        )

        def qdq(tensor):
            if not quantized:
                return tensor
            q, dq = f"{tensor}_QuantizeLinear_Output", f"{tensor}_DequantizeLinear_Output"
            nodes.append(
                helper.make_node("QuantizeLinear", [tensor, "scale", "zero"], [q], name=f"{tensor}_QuantizeLinear")
            )
            nodes.append(
                helper.make_node("DequantizeLinear", [q, "scale", "zero"], [dq], name=f"{tensor}_DequantizeLinear")
            )
            return dq

        current = qdq("x")
        for k in range(ops):
            op_type, value = kinds[k % len(kinds)]
            constant = f"c{k}"
            inits.append(numpy_helper.from_array(np.array(value, np.float32), constant))
            out = "y" if k == ops - 1 else f"t{k}"
            nodes.append(helper.make_node(op_type, [current, constant], [out], name=f"op{k}"))
            current = qdq(out) if k < ops - 1 else out
        graph = helper.make_graph(
            nodes,
            "chain",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
            inits,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return model

    return build(False), build(True)


def run_both(float_path: str, quant_path: str, shape: str) -> int:
    """``--run-both FLOAT QUANT NAME=D0,D1,...|X.npz``: load both in onnxruntime, run each once."""
    import numpy as np
    import onnxruntime as ort

    if shape.endswith(".npz"):
        with np.load(shape) as archive:
            feeds = {name: archive[name] for name in archive.files}
    else:
        name, dims = shape.split("=")
        feeds = {name: np.random.default_rng(0).standard_normal([int(d) for d in dims.split(",")]).astype(np.float32)}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    for path in (float_path, quant_path):
        ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]).run(None, feeds)
    return 0


def run_measured(argv: list[str]) -> int:
    """``--measure COMMAND...``: run COMMAND; print its seconds, peak RSS and exit code."""
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * RSS_UNIT
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss": peak,
                "exit": done.returncode,
                "stderr": done.stderr.strip().splitlines()[-1:],
            }
        )
    )
    return 0


def measure(command: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, str(THIS_FILE), "--measure", *command], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout)
    if result["exit"] != 0:
        raise RuntimeError(f"{' '.join(command)}: exit {result['exit']}: {result['stderr']}")
    return result


def measure_pair(float_path: str, quant_path: str, shape: str) -> dict:
    """Peak RSS and seconds of the baseline and of trace on one pair (``shape``: NAME=D0,...
    for seeded data, or an .npz sample)."""
    baseline = measure([sys.executable, str(THIS_FILE), "--run-both", float_path, quant_path, shape])
    given = ["--inputs", shape] if shape.endswith(".npz") else ["--shape", shape]
    trace = measure([sys.executable, str(GRAPHSCAN), "trace", float_path, quant_path, *given])
    return {"baseline": baseline, "trace": trace, "ratio": trace["peak_rss"] / baseline["peak_rss"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--measure"]:
        return run_measured(argv[1:])
    if argv[:1] == ["--run-both"]:
        return run_both(*argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=DEFAULT_OPS)
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH)
    parser.add_argument("--det", nargs=2, metavar=("FLOAT", "QUANT"))
    parser.add_argument("--shape", default="x=1,3,640,640", help="input shape for --det (seeded data)")
    parser.add_argument("--inputs", metavar="X.npz", help="the sample for --det instead of seeded data")
    args = parser.parse_args(argv)

    import onnx

    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="graphscan_bench_memory_") as tmp:
            float_model, quant_model = chain_models(args.ops, args.width)
            paths = [str(Path(tmp) / "chain.onnx"), str(Path(tmp) / "chain_qdq.onnx")]
            onnx.save(float_model, paths[0])
            onnx.save(quant_model, paths[1])
            results[f"chain {args.ops} ops x {args.width}"] = measure_pair(*paths, f"x=1,{args.width}")
        if args.det:
            given = args.inputs or args.shape
            results[f"{Path(args.det[1]).name} at {Path(given).name}"] = measure_pair(*args.det, given)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"bench_trace_memory: {exc}", file=sys.stderr)
        return 3
    print(f"{'pair':<36}{'both once MB':>14}{'trace MB':>10}{'ratio':>7}{'trace s':>9}")
    for name, r in results.items():
        print(
            f"{name:<36}{r['baseline']['peak_rss'] / 2**20:>14.1f}{r['trace']['peak_rss'] / 2**20:>10.1f}"
            f"{r['ratio']:>7.2f}{r['trace']['seconds']:>9.2f}"
        )
    return 0 if all(r["ratio"] <= BOUND for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
