"""tune as a whole process against a plain loop doing the same work without tune's shortcuts.

    python bench/bench_tune.py FLOAT.onnx --calibrate-glob 'cal*.npz' --inputs-glob 'held*.npz' [--runs R]

Both sides quantize the same candidates of the same prepared models and measure
each the same way (graphscan_ort.tune.deployed.measure_candidate):

  tune:   python graphscan.py tune FLOAT --calibrate ... --inputs ... --out DIR
          --target -1000 --min-speedup 0 (met by the first stage: the same candidates as
          the loop, no refinements or exclusions)
  plain:  this file with --plain: for every candidate, quantize_static with a new
          reader and no calibration cache (so it calibrates every time), then the
          same measurement. The prepared models come from tune's own preparation.

The requirement (issue 18): tune takes at most 0.6x the plain loop's time (aim
0.5x) with 64 calibration samples on a real CNN. Run by hand; not a test.
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

REPO_ROOT = Path(__file__).resolve().parent.parent
BOUND = 0.6


def plain_loop(float_path: str, calibrate: list[str], inputs: list[str], work: str, runs: int) -> int:
    """Every candidate of tune's prepared models, calibrated every time; prints how many."""
    sys.path.insert(0, str(REPO_ROOT))
    import numpy as np
    import onnx
    from onnxruntime.quantization import quantize_static

    from graphscan import load_with_weights
    from graphscan_ort.shared.options import Named, Session, Timing
    from graphscan_ort.shared.sessions import quiet
    from graphscan_ort.tune.candidates import SampleReader, candidate_settings, keyword_arguments
    from graphscan_ort.tune.deployed import measure_candidate
    from graphscan_ort.tune.prepare import prepare

    evaluation = [dict(np.load(p)) for p in inputs]
    calibration = [dict(np.load(p)) for p in calibrate]
    original = load_with_weights(float_path)
    base, rewritten, _ = prepare(float_path, work, evaluation, original)
    models = [base] + ([rewritten] if rewritten is not base else [])
    count = 0
    for k, model in enumerate(models):
        prepared = os.path.join(work, f"prepared{k}.onnx")
        onnx.save(model, prepared)
        for settings in candidate_settings():
            target = os.path.join(work, f"plain{count}.onnx")
            with quiet():
                quantize_static(prepared, target, SampleReader(calibration), **keyword_arguments(settings))
            measured = Named(onnx.load(target), target)
            measure_candidate(Named(original, float_path), measured, evaluation, Session("all", 1), Timing(runs))
            count += 1
    print(count)
    return 0


def timed(command: list[str], accepted: tuple[int, ...] = (0,)) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode not in accepted:
        raise SystemExit(f"bench_tune: {command[:4]}... failed: {done.stderr.strip()[-300:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--plain"]:
        float_path, runs, work, *files = argv[1:]
        split = files.index("--")
        return plain_loop(float_path, files[:split], files[split + 1 :], work, int(runs))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--calibrate-glob", required=True)
    parser.add_argument("--inputs-glob", required=True)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args(argv)
    calibrate = sorted(glob.glob(args.calibrate_glob))
    inputs = sorted(glob.glob(args.inputs_glob))
    with tempfile.TemporaryDirectory(prefix="graphscan_bench_tune_") as tmp:
        tune_command = [sys.executable, str(REPO_ROOT / "graphscan.py"), "tune", args.model]
        tune_command += [a for c in calibrate for a in ("--calibrate", c)]
        tune_command += [a for i in inputs for a in ("--inputs", i)]
        tune_command += ["--out", os.path.join(tmp, "out"), "--runs", str(args.runs)]
        tune_command += ["--target", "-1000", "--min-speedup", "0"]
        plain_command = [
            sys.executable,
            __file__,
            "--plain",
            args.model,
            str(args.runs),
            tmp,
            *calibrate,
            "--",
            *inputs,
        ]
        tune_s = timed(tune_command, accepted=(0, 8))
        plain_s = timed(plain_command)
    report = {
        "model": args.model,
        "calibration_samples": len(calibrate),
        "evaluation_samples": len(inputs),
        "tune_seconds": round(tune_s, 2),
        "plain_seconds": round(plain_s, 2),
        "ratio": round(tune_s / plain_s, 3),
        "bound": BOUND,
    }
    print(json.dumps(report))
    return 0 if report["ratio"] <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
