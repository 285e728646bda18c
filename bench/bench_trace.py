"""Time graphscan's trace against onnxruntime's own qdq_loss_debug flow on one CNN.

    python bench/bench_trace.py [--blocks N | --models FLOAT QUANT INPUTS.npz] [--runs R] [--json FILE]
                                [--before OLD_GRAPHSCAN.py]

Builds a residual CNN with gen_models.build_cnn (at least MIN_COMPUTE compute nodes at the
default size), quantizes it with onnxruntime's quantize_static (QDQ) and writes one seeded
input. Both sides then run as whole processes on the same interpreter, because that is what
a user pays for: interpreter start, imports, model loading and the work itself.

  trace:     python graphscan.py trace fp32.onnx quant.onnx --inputs x.npz
  ORT flow:  python bench_trace.py --ort-flow ..., which does qdq_loss_debug's four steps:
             modify_model_output_intermediate_tensors (both models, augmented models saved),
             collect_activations (both), create_activation_matching, compute_activation_error.

  before:    with --before, the same trace command run by an older graphscan.py (e.g.
             ``git show main:graphscan.py > /tmp/old.py``), so a change is timed against
             what it replaces in the same interleaved run.

Each side runs once untimed (page cache warm, output checked), then RUNS times, the sides
interleaved so drift hits all; the median wall time counts. trace must take no more than
the ORT flow (ratio <= BOUND). Exit 0 when it does, 1 when it does not, 3 when a run fails.

Peak memory is ru_maxrss of each child as reported by bench/measure.py, a small wrapper
process that spawns it: Linux carries a parent's own high-water mark into a child it spawns
directly, and this benchmark's parent holds onnxruntime and a quantizer run.
"""

# Only the standard library at module level: the ORT flow runs as this file, and its
# timed process must not pay for imports the flow itself does not need.
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

# bench/ is a folder of scripts, loaded by path from the tests too: find measure.py beside us.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import measured

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAPHSCAN = REPO_ROOT / "graphscan.py"
THIS_FILE = Path(__file__).resolve()

DEFAULT_BLOCKS = 26  # 292 compute nodes in the fp32 model
DEFAULT_RUNS = 5
MIN_COMPUTE = 250  # the requirement: a CNN of at least this many compute nodes
BOUND = 1.0  # trace seconds / ORT flow seconds
SEED = 0
INPUT_SHAPE = (1, 3, 16, 16)
SIDES = ["trace", "ort_flow"]


class BenchError(Exception):
    """A timed run failed or printed something unusable; the message says which."""


# --------------------------------------------------------------------------
# The models and the input, built once into the work folder


def build_pair(blocks: int, workdir: Path) -> dict:
    """fp32.onnx, its static QDQ quant.onnx and x.npz in workdir, with their sizes."""
    import numpy as np
    import onnx
    import onnxruntime

    sys.path.insert(0, str(REPO_ROOT))  # gen_models and graphscan live at the repo root
    import gen_models
    import graphscan

    paths = {
        "float": workdir / "fp32.onnx",
        "quant": workdir / "quant.onnx",
        "inputs": workdir / "x.npz",
    }
    model = gen_models.build_cnn(blocks, channels=8, size=INPUT_SHAPE[-1], seed=SEED)
    onnx.save(model, paths["float"])
    # The quantizer logs a "consider pre-processing" advice on every call; not our news.
    with gen_models.quiet_quantizer():
        gen_models.quantize_qdq(paths["float"], paths["quant"], SEED)
    x = np.random.default_rng(SEED).standard_normal(INPUT_SHAPE).astype(np.float32)
    np.savez(paths["inputs"], x=x)
    return {
        "paths": {name: str(path) for name, path in paths.items()},
        "compute": graphscan.islands(str(paths["float"]))["compute"],
        "compute_quant": graphscan.islands(str(paths["quant"]))["compute"],
        "nodes_quant": len(onnx.load(str(paths["quant"])).graph.node),
        "onnxruntime": onnxruntime.__version__,
    }


# --------------------------------------------------------------------------
# The ORT side: qdq_loss_debug used as its docstring shows


def ort_flow(float_path: str, quant_path: str, inputs_path: str, workdir: str) -> dict:
    """qdq_loss_debug's four steps on one input; returns compute_activation_error's dict."""
    import numpy as np
    from onnxruntime.quantization import CalibrationDataReader
    from onnxruntime.quantization.qdq_loss_debug import (
        collect_activations,
        compute_activation_error,
        create_activation_matching,
        modify_model_output_intermediate_tensors,
    )

    class InputReader(CalibrationDataReader):
        """Yields the one input dict; collect_activations consumes a reader, so one per call."""

        def __init__(self, feeds):
            self._feeds = iter([feeds])

        def get_next(self):
            return next(self._feeds, None)

    with np.load(inputs_path, allow_pickle=False) as archive:
        feeds = {name: archive[name] for name in archive.files}
    augmented = {}
    for side, path in (("float", float_path), ("quant", quant_path)):
        augmented[side] = str(Path(workdir) / f"augmented_{side}.onnx")
        modify_model_output_intermediate_tensors(path, augmented[side])
    float_activations = collect_activations(augmented["float"], InputReader(feeds))
    quant_activations = collect_activations(augmented["quant"], InputReader(feeds))
    matching = create_activation_matching(quant_activations, float_activations)
    return compute_activation_error(matching)


def run_ort_flow(argv: list[str]) -> int:
    """``--ort-flow FLOAT QUANT INPUTS WORKDIR``: print the error dict as JSON, like trace."""
    float_path, quant_path, inputs_path, workdir = argv
    errors = ort_flow(float_path, quant_path, inputs_path, workdir)
    # sort_keys: qdq_loss_debug picks its tensors from a set, so its order varies by run.
    sys.stdout.write(json.dumps(errors, sort_keys=True) + "\n")
    return 0


# --------------------------------------------------------------------------
# Timing whole processes


def measure(name: str, command: list[str], workdir: Path) -> dict:
    """One run of ``command`` through bench/measure.py: seconds, peak RSS bytes, stdout path."""
    stdout_path, stderr_path = workdir / f"{name}.stdout", workdir / f"{name}.stderr"
    try:
        result = measured(command, stdout_path, stderr_path)
    except RuntimeError as exc:
        raise BenchError(f"{name}: {exc}") from None
    if result["exit"] != 0:
        raise BenchError(f"{name}: exit {result['exit']}: {last_line(stderr_path.read_text())}")
    return {**result, "stdout": stdout_path}


def last_line(text: str) -> str:
    return (text.strip().splitlines() or ["(no stderr)"])[-1]


def check_answer(name: str, stdout_path: Path) -> int:
    """The number of entries of a side's JSON answer; raises when it is not a usable answer."""
    try:
        answer = json.loads(stdout_path.read_text())
    except json.JSONDecodeError as exc:
        raise BenchError(f"{name}: stdout is not JSON ({exc})") from None
    if not isinstance(answer, dict):
        raise BenchError(f"{name}: stdout JSON is not an object")
    entries = answer.get("ops") if name in ("trace", "before") else answer
    if not entries:
        raise BenchError(f"{name}: the answer has no per-operator entries")
    return len(entries)


def time_sides(commands: dict, runs: int, workdir: Path) -> dict:
    sides = [name for name in SIDES + ["before"] if name in commands]
    return _time_sides(commands, sides, runs, workdir)


def _time_sides(commands: dict, sides: list, runs: int, workdir: Path) -> dict:
    """Per side: median seconds and peak RSS of ``runs`` runs after one checked warm-up.

    The sides alternate which goes first each round, so neither always runs on a cache the
    other just warmed or on a machine the other just heated.
    """
    entries = {name: check_answer(name, measure(name, commands[name], workdir)["stdout"]) for name in sides}
    samples = {name: [] for name in sides}
    for round_index in range(runs):
        order = sides if round_index % 2 == 0 else sides[::-1]
        for name in order:
            samples[name].append(measure(name, commands[name], workdir))
    return {
        name: {
            "seconds": statistics.median(s["seconds"] for s in samples[name]),
            "all_seconds": [round(s["seconds"], 4) for s in samples[name]],
            "peak_rss": max(s["peak_rss"] for s in samples[name]),
            "entries": entries[name],
        }
        for name in sides
    }


def given_pair(float_path: str, quant_path: str, inputs_path: str) -> dict:
    """A real model pair (``--models``) described as build_pair describes its own."""
    import onnx
    import onnxruntime

    sys.path.insert(0, str(REPO_ROOT))
    import graphscan

    return {
        "paths": {"float": float_path, "quant": quant_path, "inputs": inputs_path},
        "compute": graphscan.islands(float_path)["compute"],
        "compute_quant": graphscan.islands(quant_path)["compute"],
        "nodes_quant": len(onnx.load(quant_path).graph.node),
        "onnxruntime": onnxruntime.__version__,
    }


def run_benchmark(blocks: int, runs: int, workdir: Path, before: Path | None = None, models=None) -> dict:
    """Build the pair into workdir (or take ``models``), time both sides; return the results."""
    if not GRAPHSCAN.is_file():
        raise BenchError(f"{GRAPHSCAN}: not found")
    pair = given_pair(*models) if models else build_pair(blocks, workdir)
    paths = pair["paths"]
    commands = {
        "trace": [sys.executable, str(GRAPHSCAN), "trace", paths["float"], paths["quant"], "--inputs", paths["inputs"]],
        "ort_flow": [
            sys.executable,
            str(THIS_FILE),
            "--ort-flow",
            paths["float"],
            paths["quant"],
            paths["inputs"],
            str(workdir),
        ],
    }
    if before is not None:
        commands["before"] = [sys.executable, str(before), *commands["trace"][2:]]
    sides = time_sides(commands, runs, workdir)
    return {
        "blocks": None if models else blocks,
        "compute": pair["compute"],
        "compute_quant": pair["compute_quant"],
        "nodes_quant": pair["nodes_quant"],
        "runs": runs,
        "bound": BOUND,
        "ratio": sides["trace"]["seconds"] / sides["ort_flow"]["seconds"],
        "ratio_to_before": sides["trace"]["seconds"] / sides["before"]["seconds"] if "before" in sides else None,
        "sides": sides,
        # Which graphscan.py was timed: it changes between runs, and there may be no commit.
        "graphscan_sha256": hashlib.sha256(GRAPHSCAN.read_bytes()).hexdigest()[:12],
        "python": sys.version.split()[0],
        "onnxruntime": pair["onnxruntime"],
        "peak_rss_method": "ru_maxrss (RUSAGE_CHILDREN) in a fresh wrapper process",
    }


def format_table(report: dict) -> str:
    """The human-readable summary: the model, one row per side, the ratio."""
    short = "" if report["compute"] >= MIN_COMPUTE else f"  (below the required {MIN_COMPUTE})"
    lines = [
        (
            f"CNN: {report['blocks'] or 'given'} blocks, {report['compute']} compute nodes fp32{short}; "
            f"quantized: {report['nodes_quant']} nodes, {report['compute_quant']} compute"
        ),
        (
            f"median of {report['runs']} runs after 1 warm-up; graphscan.py "
            f"{report['graphscan_sha256']}, onnxruntime {report['onnxruntime']}"
        ),
        f"{'side':<10}{'seconds':>9}{'peak RSS MB':>13}{'entries':>9}",
    ]
    for name in report["sides"]:
        side = report["sides"][name]
        lines.append(f"{name:<10}{side['seconds']:>9.3f}{side['peak_rss'] / 2**20:>13.1f}{side['entries']:>9}")
    flag = "  OVER" if report["ratio"] > report["bound"] else ""
    lines.append(f"ratio trace / ort_flow: {report['ratio']:.3f} (bound {report['bound']:.1f}){flag}")
    if report["ratio_to_before"] is not None:
        lines.append(f"ratio trace / before: {report['ratio_to_before']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: build, time, print the table; 0 within bound, 1 over it, 3 on a failed run."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Internal modes: the benchmark runs this same file as its children.
    if argv[:1] == ["--ort-flow"]:
        return run_ort_flow(argv[1:])

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS, help="build_cnn blocks")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="timed runs per side")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--before", type=Path, metavar="GRAPHSCAN", help="an older graphscan.py to time too")
    parser.add_argument("--models", nargs=3, metavar=("FLOAT", "QUANT", "INPUTS"), help="a real model pair and input")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.runs < 1:
        parser.error("--blocks and --runs must be positive")

    try:
        with tempfile.TemporaryDirectory(prefix="graphscan_bench_trace_") as tmp:
            report = run_benchmark(args.blocks, args.runs, Path(tmp), args.before, args.models)
    except BenchError as exc:
        print(f"bench_trace: {exc}", file=sys.stderr)
        return 3

    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["ratio"] > BOUND else 0


if __name__ == "__main__":
    sys.exit(main())
