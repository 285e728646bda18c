"""tune as a whole process against a plain loop doing the same work without tune's shortcuts.

    python bench/bench_tune.py FLOAT.onnx --calibrate-glob 'cal*.npz' --inputs-glob 'held*.npz' [--runs R]

Both sides make the same rows from the same prepared models and measure each the same way
(graphscan_ort.tune.deployed.measure_candidate):

  tune:   python graphscan.py tune FLOAT --calibrate ... --inputs ... --out DIR
          --target -1000 --min-speedup 0 (most often met by the grid; where every grid
          row breaks an output part, the search goes on, and its rows are made by both)
  plain:  this file with --plain and tune's answer: for every row tune made with
          quantize_static, that function with the row's arguments, a new reader and no
          calibration cache (so it calibrates every time), on the prepared model of the
          row's ``rewrites`` (an ``equalize`` row's: that model equalized), then the same
          measurement. The prepared models come from tune's own preparation. The loop does
          less than tune where a row's model takes more than quantize_static (a bias
          correction's, an exclusion's post step) and makes no dynamic row.

The requirement (issue 18): tune takes at most 0.6x the plain loop's time (aim
0.5x) with 64 calibration samples on a real CNN. Run by hand; not a test.

    python bench/bench_tune.py FLOAT.onnx --calibrate-glob 'cal*.npz' --rows [--repeats R]
    python bench/bench_tune.py --small --rows [--repeats R]

One row made from another's model (tune/requantize.py) against quantize_static for the same
row, on tune's prepared model (without rewrites; --small: gen_models' CNN, 4 blocks of 16
channels at 32x32, 8 seeded samples): the base is quantize_static's QUInt8 per-tensor MinMax
model, each row another calibration (Percentile at 99.999 and 99.9, MinMax's moving average,
Entropy) or MinMax with one tensor's range overridden. Every calibration is done before the
clock starts; both sides read the row's ranges from its cache and write the row's file, in
turn (quantize_static, then the plan, R times per row: the machine is shared), and the files
must be the same bytes. Prints the medians per row, their ratio, and the plan's one-off cost.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BOUND = 0.6


def plain_loop(float_path: str, answer_path: str, calibrate: list[str], inputs: list[str], work: str, runs: int) -> int:
    """Every row tune's answer (at ``answer_path``) made with quantize_static, calibrated
    every time; prints how many."""
    sys.path.insert(0, str(REPO_ROOT))
    import numpy as np
    import onnx
    from onnxruntime.quantization import quantize_static

    from graphscan import Session, load_with_weights
    from graphscan_ort.shared.options import Named, Timing
    from graphscan_ort.shared.sessions import quiet
    from graphscan_ort.tune.candidates import SampleReader, keyword_arguments
    from graphscan_ort.tune.deployed import measure_candidate
    from graphscan_ort.tune.equalize import equalized
    from graphscan_ort.tune.prepare import prepare

    with open(answer_path) as f:
        rows = [r for r in json.load(f)["candidates"] if r["quantize_static"] is not None and r["error"] is None]
    evaluation = [dict(np.load(p)) for p in inputs]
    calibration = [dict(np.load(p)) for p in calibrate]
    original = load_with_weights(float_path)
    base, rewritten, _ = prepare(float_path, work, evaluation, original)
    prepared: dict[tuple[bool, bool], str] = {}

    def prepared_path(rewrites: bool, equalize: bool) -> str:
        if (rewrites, equalize) not in prepared:
            model = rewritten if rewrites else base
            path = os.path.join(work, f"prepared-{rewrites}-{equalize}.onnx")
            onnx.save(equalized(model)[0] if equalize else model, path)
            prepared[rewrites, equalize] = path
        return prepared[rewrites, equalize]

    for count, row in enumerate(sorted(rows, key=lambda r: r["id"])):
        equalize = (row["recovery"] or {}).get("step") == "equalize"
        target = os.path.join(work, f"plain{count}.onnx")
        arguments = keyword_arguments(row["quantize_static"])
        with quiet():
            quantize_static(prepared_path(row["rewrites"], equalize), target, SampleReader(calibration), **arguments)
        measured = Named(onnx.load(target), target)
        measure_candidate(Named(original, float_path), measured, evaluation, Session("all", 1), Timing(runs))
    print(len(rows))
    return 0


def row_kinds(ranges: Any) -> list[dict[str, Any]]:
    """The rows of --rows beside the base (MinMax): their settings over the base's."""
    import numpy as np

    name = max(ranges.keys(), key=lambda n: float(np.ptp([np.asarray(v).item() for v in ranges[n].range_value])))
    low, high = (float(np.asarray(v).item()) for v in ranges[name].range_value)
    return [
        {"calibrate_method": "Percentile"},
        {"calibrate_method": "Percentile", "extra_options": {"CalibPercentile": 99.9}},
        {"calibrate_method": "MinMax", "extra_options": {"CalibMovingAverage": True}},
        {"calibrate_method": "Entropy"},
        {"extra_options": {"TensorQuantOverrides": {name: [{"rmin": low / 2, "rmax": high / 2}]}}},
    ]


def small_model(folder: str) -> tuple[str, list[dict[str, Any]]]:
    """gen_models' CNN (4 blocks, 16 channels, 32x32) in ``folder`` and 8 seeded samples."""
    import numpy as np
    import onnx

    sys.path.insert(0, str(REPO_ROOT))
    import gen_models

    path = os.path.join(folder, "small.onnx")
    onnx.save(gen_models.build_cnn(4, channels=16, size=32, seed=0), path)
    rng = np.random.default_rng(5)
    return path, [{"x": rng.standard_normal((1, 3, 32, 32)).astype(np.float32)} for _ in range(8)]


def rows_bench(model_path: str | None, calibrate: list[str], repeats: int) -> dict[str, Any]:
    """--rows: the medians of making each row by quantize_static and by the plan, in turn."""
    import statistics

    import numpy as np
    import onnx
    from onnxruntime.quantization import quantize_static
    from onnxruntime.quantization.calibrate import load_tensors_data

    sys.path.insert(0, str(REPO_ROOT))
    from graphscan import load_with_weights
    from graphscan_ort.shared.sessions import quiet
    from graphscan_ort.tune.candidates import (
        SampleReader,
        cache_path,
        calibration_key,
        keyword_arguments,
        quantize_candidate,
    )
    from graphscan_ort.tune.prepare import prepare
    from graphscan_ort.tune.requantize import RangePlan

    with tempfile.TemporaryDirectory(prefix="graphscan_bench_rows_") as work:
        if model_path is None:
            model_path, samples = small_model(work)
        else:
            samples = [dict(np.load(p)) for p in calibrate]
        prepared_model, _, _ = prepare(model_path, work, samples[:2], load_with_weights(model_path))
        prepared = os.path.join(work, "prepared.onnx")
        onnx.save(prepared_model, prepared)
        base = {"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8"}
        base |= {"per_channel": False, "calibrate_method": "MinMax"}
        base_path = os.path.join(work, "base.onnx")
        quantize_candidate(prepared, base_path, base, lambda: SampleReader(samples), work)
        base_ranges = load_tensors_data(cache_path(work, calibration_key(base)))
        start = time.perf_counter()
        plan = RangePlan(prepared, onnx.load(base_path), base, base_ranges)
        plan_s = time.perf_counter() - start
        if plan.refused:
            raise SystemExit(f"bench_tune: no plan: {plan.refused}")
        report: dict[str, Any] = {"model": model_path, "plan_seconds": round(plan_s, 4), "rows": []}
        for change in row_kinds(base_ranges):
            settings = {**base, **change}
            theirs, ours = os.path.join(work, "theirs.onnx"), os.path.join(work, "ours.onnx")
            quantize_candidate(prepared, theirs, settings, lambda: SampleReader(samples), work)  # calibrated here
            cache = cache_path(work, calibration_key(settings))
            arguments = keyword_arguments(settings)
            static_s, plan_row_s = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                with quiet():
                    quantize_static(prepared, theirs, None, calibration_cache_path=cache, **arguments)
                static_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                made = plan.requantized(settings, load_tensors_data(cache))
                if made is None:
                    raise SystemExit(f"bench_tune: the plan left {change} to quantize_static")
                onnx.save_model(made, ours)
                plan_row_s.append(time.perf_counter() - start)
            with open(theirs, "rb") as a, open(ours, "rb") as b:
                if a.read() != b.read():
                    raise SystemExit(f"bench_tune: {change}: the plan's file is not quantize_static's")
            static_m, plan_m = statistics.median(static_s), statistics.median(plan_row_s)
            report["rows"].append(
                {"row": change, "quantize_static_s": round(static_m, 4), "plan_s": round(plan_m, 4)}
                | {"ratio": round(plan_m / static_m, 4)}
            )
        report["median_ratio"] = statistics.median(r["ratio"] for r in report["rows"])
        return report


def timed(command: list[str], accepted: tuple[int, ...] = (0,)) -> tuple[float, str]:
    """``command``'s wall time and its stdout (its exit code one of ``accepted``)."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode not in accepted:
        raise SystemExit(f"bench_tune: {command[:4]}... failed: {done.stderr.strip()[-300:]}")
    return seconds, done.stdout


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--plain"]:
        float_path, answer_path, runs, work, *files = argv[1:]
        split = files.index("--")
        return plain_loop(float_path, answer_path, files[:split], files[split + 1 :], work, int(runs))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--calibrate-glob")
    parser.add_argument("--inputs-glob")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rows", action="store_true", help="one row by the plan against quantize_static")
    parser.add_argument("--small", action="store_true", help="--rows on gen_models' CNN instead of MODEL")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if args.rows:
        if not args.small and not (args.model and args.calibrate_glob):
            parser.error("--rows needs MODEL and --calibrate-glob, or --small")
        calibration = sorted(glob.glob(args.calibrate_glob)) if args.calibrate_glob else []
        print(json.dumps(rows_bench(None if args.small else args.model, calibration, args.repeats)))
        return 0
    if not (args.model and args.calibrate_glob and args.inputs_glob):
        parser.error("MODEL, --calibrate-glob and --inputs-glob are required")
    calibrate = sorted(glob.glob(args.calibrate_glob))
    inputs = sorted(glob.glob(args.inputs_glob))
    with tempfile.TemporaryDirectory(prefix="graphscan_bench_tune_") as tmp:
        tune_command = [sys.executable, str(REPO_ROOT / "graphscan.py"), "tune", args.model]
        tune_command += [a for c in calibrate for a in ("--calibrate", c)]
        tune_command += [a for i in inputs for a in ("--inputs", i)]
        tune_command += ["--out", os.path.join(tmp, "out"), "--runs", str(args.runs)]
        tune_command += ["--target", "-1000", "--min-speedup", "0"]
        answer_path = os.path.join(tmp, "answer.json")
        plain_command = [
            sys.executable,
            __file__,
            "--plain",
            args.model,
            answer_path,
            str(args.runs),
            tmp,
            *calibrate,
            "--",
            *inputs,
        ]
        tune_s, answer = timed(tune_command, accepted=(0, 8))
        with open(answer_path, "w") as f:
            f.write(answer)
        plain_s, made = timed(plain_command)
    report = {
        "model": args.model,
        "calibration_samples": len(calibrate),
        "evaluation_samples": len(inputs),
        "rows": int(made),
        "tune_seconds": round(tune_s, 2),
        "plain_seconds": round(plain_s, 2),
        "ratio": round(tune_s / plain_s, 3),
        "bound": BOUND,
    }
    print(json.dumps(report))
    return 0 if report["ratio"] <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
