"""runtime's cost, and what "wrapped is not int8" costs a real model.

    python bench/bench_runtime.py [--quant Q.onnx] [--float F.onnx] [--u8 U.onnx]
                                  [--shape 1,3,320,320] [--runs R] [--json FILE]

1. Cost of the command: `python graphscan.py runtime Q.onnx` as a whole process
   against the floor, a process that imports onnx and onnxruntime and builds one
   session saving its optimized graph (what runtime cannot avoid). Interleaved,
   median of RUNS. Requirement: ratio <= BOUND.
2. Speed of the models themselves (only when --float is given): float, the
   default-quantized model and the uint8-activation model, timed in one process,
   interleaved, median per run, at the default thread count and on one thread.

Without --quant it builds a ~300-node residual CNN (gen_models.build_cnn) and
quantizes it with onnxruntime's defaults, so the benchmark runs anywhere. The
README's figures for a real model name the files they were measured on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAPHSCAN = REPO_ROOT / "graphscan.py"
DEFAULT_RUNS = 7
DEFAULT_BLOCKS = 26  # 292 compute nodes in the fp32 model
BOUND = 1.5

FLOOR_SCRIPT = """
import sys, os, tempfile
import onnx, onnxruntime as ort
with tempfile.TemporaryDirectory() as folder:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.log_severity_level = 3
    options.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
    ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
"""


def built_cnn(workdir: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO_ROOT))
    import onnx

    import gen_models

    fp32, quant = workdir / "cnn.onnx", workdir / "cnn_qdq.onnx"
    onnx.save(gen_models.build_cnn(DEFAULT_BLOCKS, channels=8, size=32, seed=0), fp32)
    with gen_models.quiet_quantizer():
        gen_models.quantize_qdq(fp32, quant, seed=0)
    return fp32, quant


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"bench: {' '.join(map(str, argv))} failed: {done.stderr.decode()[:300]}")
    return elapsed


def command_cost(quant: Path, runs: int) -> dict:
    sides = {
        "runtime": [sys.executable, str(GRAPHSCAN), "runtime", str(quant)],
        "floor": [sys.executable, "-c", FLOOR_SCRIPT, str(quant)],
    }
    times = {name: [] for name in sides}
    for argv in sides.values():
        timed(argv)  # warm the page cache
    for _ in range(runs):
        for name, argv in sides.items():
            times[name].append(timed(argv))
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"seconds": medians, "ratio": medians["runtime"] / medians["floor"]}


def model_speed(paths: dict, shape: list[int], runs: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    x = np.random.default_rng(0).random(shape).astype(np.float32)
    result = {}
    for threads in (0, 1):
        sessions = {}
        for name, path in paths.items():
            options = ort.SessionOptions()
            options.log_severity_level = 3
            options.intra_op_num_threads = threads
            sessions[name] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            feed = {sessions[name].get_inputs()[0].name: x}
            sessions[name].run(None, feed)
        times = {name: [] for name in sessions}
        for _ in range(runs):
            for name, session in sessions.items():
                start = time.perf_counter()
                session.run(None, {session.get_inputs()[0].name: x})
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        result["default threads" if threads == 0 else "1 thread"] = {
            "ms": ms,
            "vs_float": {name: ms[name] / ms["float"] for name in ms},
        }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", type=Path)
    parser.add_argument("--float", type=Path)
    parser.add_argument("--u8", type=Path)
    parser.add_argument("--shape", default="1,3,320,320")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        fp32, quant = (args.float, args.quant) if args.quant else built_cnn(Path(folder))
        report = {
            "model": str(args.quant or "built ~300-node CNN"),
            "runs": args.runs,
            "command": command_cost(quant, args.runs),
        }
        if fp32:
            paths = {"float": fp32, "quant": quant}
            if args.u8:
                paths["quant_u8"] = args.u8
            shape = [int(d) for d in args.shape.split(",")] if args.quant else [1, 3, 32, 32]
            report["speed"] = {"shape": shape, **model_speed(paths, shape, args.runs * 3)}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["command"]["ratio"] <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
