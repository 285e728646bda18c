"""tune against the one-shot a user does by hand, back to back: wall time and peak memory.

    python bench/bench_pagesize.py FLOAT.onnx --calibrate-glob 'cal/*.npz' --inputs-glob 'in/*.npz'
        [--rounds N] [--tune-args '...']

Each side runs as its own process under ``/usr/bin/time -v`` (wall time, maximum resident
set size), in turn, ``--rounds`` times (the machine is shared: medians):

  one-shot: this file with --one-shot: onnxruntime's ``quant_pre_process`` (without symbolic
            shape inference where it gives up, as on PP-OCRv4's detector), ``quantize_static``
            with its defaults on the calibration samples, then one run of each input in a
            default session of the written model;
  defaults: ``graphscan.py tune FLOAT --calibrate ... --inputs ... --out DIR``;
  whole:    the same with a target out of reach (``--target 1000``: 1000 dB of SQNR), so
            every stage runs (seeds, refinements, recovery, exclusions).

Prints one JSON object: each side's median time and greatest peak (and each round's,
``each``), tune's ratios to the one-shot, and whether the bounds hold (defaults at most 8x,
whole at most 20x, both at most 2 GiB). Run by hand; not a test. On PP-OCRv4's detector: 6
calibration pages at 1x3x768x896, 4 inputs of other sizes.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
BOUNDS = {"defaults": 8.0, "whole": 20.0}
MEMORY_BOUND_GIB = 2.0


def one_shot(float_path: str, calibrate: list[str], inputs: list[str], work: str) -> None:
    """What a user does by hand: pre-process, quantize with the defaults, run the inputs once."""
    import numpy as np
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(calibrate)

        def get_next(self) -> dict[str, Any] | None:
            path = next(self.left, None)
            if path is None:
                return None
            with np.load(path) as data:
                return {name: data[name] for name in data.files}

    prepared = os.path.join(work, "prepared.onnx")
    quantized = os.path.join(work, "int8.onnx")
    try:
        quant_pre_process(float_path, prepared)
    except Exception:  # symbolic shape inference gives up on some models (PP-OCRv4 det): the user skips it
        quant_pre_process(float_path, prepared, skip_symbolic_shape=True)
    quantize_static(prepared, quantized, Reader())
    session = ort.InferenceSession(quantized, providers=["CPUExecutionProvider"])
    for path in inputs:
        with np.load(path) as data:
            session.run(None, {name: data[name] for name in data.files})


def measured(command: list[str], accepted: tuple[int, ...]) -> dict[str, Any]:
    """Wall seconds and peak resident memory (GiB) of one process run under /usr/bin/time -v."""
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode not in accepted:
        raise SystemExit(f"bench_pagesize: {shlex.join(command[:4])}... exit {done.returncode}: {done.stderr[-400:]}")
    kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return {"seconds": seconds, "peak_gib": int(kib.group(1)) / 2**20 if kib else None, "exit": done.returncode}


def load_average() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--one-shot"]:
        float_path, work, *files = argv[1:]
        split = files.index("--")
        one_shot(float_path, files[:split], files[split + 1 :], work)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--calibrate-glob", required=True)
    parser.add_argument("--inputs-glob", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tune-args", default="", help="more arguments for both tune runs")
    parser.add_argument("--sides", default="one-shot,defaults,whole")
    args = parser.parse_args(argv)
    calibrate = sorted(glob.glob(args.calibrate_glob))
    inputs = sorted(glob.glob(args.inputs_glob))
    sides = args.sides.split(",")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    loads = []
    with tempfile.TemporaryDirectory(prefix="graphscan_bench_pagesize_") as tmp:
        tune = [sys.executable, str(REPO_ROOT / "graphscan.py"), "tune", args.model]
        tune += [a for c in calibrate for a in ("--calibrate", c)]
        tune += [a for i in inputs for a in ("--inputs", i)]
        tune += shlex.split(args.tune_args)
        for k in range(args.rounds):
            work = os.path.join(tmp, f"round-{k}")  # tune refuses an --out that holds another run's files
            os.makedirs(work)
            commands = {
                "one-shot": (
                    [sys.executable, __file__, "--one-shot", args.model, work, *calibrate, "--", *inputs],
                    (0,),
                ),
                "defaults": ([*tune, "--out", os.path.join(work, "defaults")], (0, 8)),
                "whole": ([*tune, "--target", "1000", "--out", os.path.join(work, "whole")], (0, 8)),
            }
            for side in sides:
                loads.append(load_average())
                runs[side].append(measured(*commands[side]))
    report: dict[str, Any] = {
        "model": args.model,
        "calibration_samples": len(calibrate),
        "inputs": len(inputs),
        "rounds": args.rounds,
        "load_average": [round(min(loads), 2), round(max(loads), 2)],
    }
    for side, measures in runs.items():
        report[side] = {
            "seconds": round(statistics.median(m["seconds"] for m in measures), 1),
            "peak_gib": round(max(m["peak_gib"] for m in measures), 3),
            "exits": sorted({m["exit"] for m in measures}),
            "each": [[round(m["seconds"], 1), round(m["peak_gib"], 3)] for m in measures],  # seconds, GiB a round
        }
    holds = True
    if "one-shot" in runs:
        for side, bound in BOUNDS.items():
            if side in report:
                ratio = report[side]["seconds"] / report["one-shot"]["seconds"]
                report[side]["ratio"] = round(ratio, 2)
                holds &= ratio <= bound
    for side in BOUNDS:
        if side in report:
            holds &= report[side]["peak_gib"] <= MEMORY_BOUND_GIB
    report["bounds"] = {"ratio": BOUNDS, "peak_gib": MEMORY_BOUND_GIB, "hold": holds}
    print(json.dumps(report))
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
