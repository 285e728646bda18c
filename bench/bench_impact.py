"""Time graphscan's impact against the brute force (one session per variant), as whole processes.

    python bench/bench_impact.py [FLOAT QUANT] [--samples 4] [--size 320] [--work DIR]

Without FLOAT and QUANT it builds the ~300-node residual CNN of bench_runtime.py
(292 compute nodes, 1x3x32x32) and quantizes it with onnxruntime's defaults, so
the benchmark runs anywhere; given a model such as PP-OCRv4's det.onnx and its
quantized twin, the samples are 1x3xSIZExSIZE. SAMPLES text-like images (white
page, dark strokes, ImageNet-normalized as PP-OCR does) are written as .npz
files; then

  impact:  python graphscan.py impact FLOAT QUANT --inputs s0.npz ... --inputs sN.npz
  brute:   python bench_impact.py --brute FLOAT QUANT s0.npz ..., which runs
           tests/impact_reference.py: one edited model and one session per variant

run once each (each takes minutes on a 300-node CNN at 320x320). The script prints
both wall times, the ratio, the largest row difference between the two answers,
and the top 5 ops. Not run by CI. Exit 0 when the ratio is at most BOUND, 1 otherwise.

    python bench/bench_impact.py [FLOAT QUANT] --interleaved N

measures instead, in one process, every k-th variant (about N of them) both ways,
alternating one graphscan measurement and one brute-force variant (edit, session,
SAMPLES runs) so that the load of a shared machine hits both alike; it prints the
per-variant seconds of each and their ratio, plus each side's fixed cost.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GRAPHSCAN = REPO_ROOT / "graphscan.py"
BOUND = 0.3  # issue 9: impact seconds / brute-force seconds
BUILT_CNN_SIZE = 32  # bench_runtime.built_cnn's input is 1x3x32x32


def text_page(rng, size):
    """The tour's text-like page (docs/tour_model.py: one page generator for the tour and the bench)."""
    return tour_model().text_page(rng, size)


def write_samples(folder, count, size):
    return tour_model().write_samples(folder, count, size)


def tour_model():
    sys.path.insert(0, str(REPO_ROOT / "docs"))
    import tour_model

    return tour_model


def brute(float_path, quant_path, sample_paths):
    """The brute force as its own process: prints its answer as JSON."""
    import numpy as np
    import onnx

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import impact_reference

    samples = [dict(np.load(p)) for p in sample_paths]
    answer = impact_reference.reference_impact(onnx.load(float_path), onnx.load(quant_path), samples)
    print(json.dumps(answer))


def timed(command):
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(map(str, command))}\n{proc.stderr}")
    return seconds, json.loads(proc.stdout)


def largest_difference(answer, reference):
    """Largest |graphscan - brute force| in dB over every op and tensor row."""
    worst = abs(answer["output_sqnr_db"] - reference["baseline"])
    for row in answer["ops"]:
        worst = max(worst, abs(row["sqnr_db"] - reference["ops"][row["node"]]))
    for row in answer["tensors"]:
        kept, rounded, _ = reference["tensors"][row["tensor"]]
        worst = max(worst, abs(row["sqnr_db"] - kept))
        if rounded is not None:
            worst = max(worst, abs(row["rounding_sqnr_db"] - rounded))
    return worst


def interleaved(float_path, quant_path, sample_paths, count):
    """Per-variant seconds of graphscan and of the brute force, measured alternately."""
    import numpy as np
    import onnx

    sys.path.insert(0, str(REPO_ROOT))
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import impact_reference as ref

    import graphscan_ort.commands.impact
    import graphscan_ort.shared.metrics

    samples = [dict(np.load(p)) for p in sample_paths]
    start = time.perf_counter()
    float_model, quant_model = onnx.load(float_path), onnx.load(quant_path)
    names = [o.name for o in quant_model.graph.output]
    noise = graphscan_ort.shared.metrics.OutputNoise(
        graphscan_ort.shared.sessions.model_outputs(float_model, samples, float_path)
    )
    run = graphscan_ort.engines.attribution.ImpactRun(float_model, quant_model, samples, names, noise, quant_path)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    reference = ref.float_outputs(float_model, quant_model, samples)
    ref.sqnr(reference, ref.run(quant_model, samples))
    brute_setup = time.perf_counter() - start

    index = run.plan.index
    variants = [
        (v, lambda i=i: ref.unquantize_ops(float_model, quant_model, [index.names[i]]))
        for (i, _), v in zip(run.plan.op_rows, run.op_variants, strict=True)
    ]
    for (t, _, _, _), (kept, rounded) in zip(run.plan.tensor_rows, run.tensor_variants, strict=True):
        variants.append((kept, lambda t=t: ref.replace_dequantize(float_model, quant_model, t, False)))
        if rounded is not None:
            variants.append((rounded, lambda t=t: ref.replace_dequantize(float_model, quant_model, t, True)))
    picked = variants[:: max(1, len(variants) // count)]
    ours = theirs = worst = 0.0
    for variant, edit in picked:
        start = time.perf_counter()
        mine = run.measure(variant)[0]
        ours += time.perf_counter() - start
        start = time.perf_counter()
        brute = ref.sqnr(reference, ref.run(edit(), samples))
        theirs += time.perf_counter() - start
        if mine is not None and brute is not None:
            worst = max(worst, abs(mine - brute))
    n = len(picked)
    print(f"{len(variants)} variants, {n} measured both ways, alternating, {len(samples)} samples")
    print(f"graphscan: setup {setup:.2f} s, {ours / n:.4f} s per variant")
    print(f"brute force: setup {brute_setup:.2f} s, {theirs / n:.4f} s per variant")
    total_ours = setup + ours / n * len(variants)
    total_theirs = brute_setup + theirs / n * len(variants)
    print(
        f"per-variant ratio {ours / theirs:.3f}; projected totals {total_ours:.0f} s vs {total_theirs:.0f} s, "
        f"ratio {total_ours / total_theirs:.3f}; largest difference {worst:.4f} dB"
    )
    return 0 if total_ours / total_theirs <= BOUND else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("float", nargs="?")
    parser.add_argument("quant", nargs="?")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--size", type=int, default=320, help="sample height and width for a given model")
    parser.add_argument("--work", help="folder for the samples (and the built CNN); default: a temporary one")
    parser.add_argument("--interleaved", type=int, metavar="N")
    parser.add_argument("--brute", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.brute is not None:
        brute(args.float, args.quant, args.brute)
        return 0
    if (args.float is None) != (args.quant is None):
        parser.error("give both FLOAT and QUANT, or neither")
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(args.work or scratch)
        work.mkdir(parents=True, exist_ok=True)
        size = args.size
        if args.float is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import bench_runtime

            args.float, args.quant = bench_runtime.built_cnn(work)
            size = BUILT_CNN_SIZE
        samples = write_samples(work, args.samples, size)
        if args.interleaved:
            return interleaved(args.float, args.quant, samples, args.interleaved)
        return whole_processes(args.float, args.quant, samples)


def whole_processes(float_path, quant_path, samples):
    """Each side once as a whole process; exit status 0 when the ratio is within BOUND."""
    command = [sys.executable, GRAPHSCAN, "impact", float_path, quant_path]
    for path in samples:
        command += ["--inputs", path]
    impact_seconds, answer = timed(command)
    brute_seconds, reference = timed(
        [sys.executable, Path(__file__).resolve(), float_path, quant_path, "--brute", *samples]
    )
    ratio = impact_seconds / brute_seconds
    print(f"{quant_path}: {len(answer['ops'])} ops, {len(answer['tensors'])} tensors x 2, {len(samples)} samples")
    print(f"output SQNR {answer['output_sqnr_db']:.2f} dB")
    print(f"impact {impact_seconds:.1f} s, brute force {brute_seconds:.1f} s, ratio {ratio:.3f} (bound {BOUND})")
    print(f"largest row difference {largest_difference(answer, reference):.4f} dB")
    for row in answer["ops"][:5]:
        print(f"  {row['node']} ({row['op_type']}): {row['sqnr_db']:.2f} dB, gain {row['gain_db']:+.2f} dB")
    return 0 if ratio <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
