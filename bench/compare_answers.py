"""Are two versions of graphscan answering byte for byte the same?

    python bench/compare_answers.py [--baseline REF] [--models DIR ...] [--json FILE]

Runs every command and every option that answers on the same models with the
graphscan of git revision REF (default: HEAD, exported with ``git archive``)
and with the working tree's (copied when the run starts, so the tree can change
while it runs), each as a whole process from the same folder, and
compares exit code and stdout byte for byte (fuse: the written file too).
``runtime --time`` answers measure time, so their timing fields are compared
only by key and type. Table and DOT text are compared as well (a restructuring
must not change them either).

Models: the committed ``ops/``, lab models that gen_models.py builds with other
layer counts, hand-built chains, a CNN, and each ``--models DIR`` holding
``float.onnx``, ``quant.onnx`` and ``sample*.npz`` (real models, kept out of the
repository). Exit 0 when every case is identical, 1 otherwise. Run by hand.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TIME_KEYS = {"profiler_floor_us", "shares", "nodes", "wall_ms", "round_trip_cost", "method"}


def export_revision(revision: str, folder: Path) -> Path:
    """The tracked files of ``revision`` under ``folder``."""
    data = subprocess.run(["git", "archive", revision], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(folder, filter="data")
    return folder


def snapshot_tree(folder: Path) -> Path:
    """A copy of the working tree's graphscan.py and graphscan_ort package under ``folder``."""
    folder.mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "graphscan.py", folder / "graphscan.py")
    if (REPO_ROOT / "graphscan_ort").is_dir():
        shutil.copytree(
            REPO_ROOT / "graphscan_ort", folder / "graphscan_ort", ignore=shutil.ignore_patterns("__pycache__")
        )
    return folder / "graphscan.py"


def build_models(folder: Path) -> dict:
    """``{"single": [paths], "pairs": [(float, quant, [npz...])], "float": [paths]}`` of the models compared."""
    sys.path.insert(0, str(REPO_ROOT))
    import numpy as np
    import onnx

    import gen_models
    from tests.helpers import chain_model

    single, pairs, floats = [], [], []
    ops = REPO_ROOT / "ops"
    single += sorted(str(p.relative_to(REPO_ROOT)) for p in ops.glob("*.onnx"))
    floats += ["ops/fp32.onnx", "ops/gemm.onnx"]
    for quant in ("full", "matmul_only", "excluded", "gemm_full"):
        base = "ops/gemm.onnx" if quant == "gemm_full" else "ops/fp32.onnx"
        pairs.append((base, f"ops/{quant}.onnx", []))
    for layers, dim, exclude in ((4, 16, "fc2_matmul"), (6, 8, "fc3_add")):
        lab = folder / f"lab{layers}"
        lab.mkdir(parents=True)
        with gen_models.quiet_quantizer():
            gen_models.build_lab(lab, layers, dim, 0, exclude)
        names = sorted(p.name for p in lab.glob("*.onnx"))
        single += [str(lab / n) for n in names]
        rng = np.random.default_rng(layers)
        samples = []
        for k in range(2):
            sample = lab / f"sample{k}.npz"
            np.savez(sample, x=rng.standard_normal((3, dim)).astype(np.float32))
            samples.append(str(sample))
        for quant in ("full", "matmul_only", "excluded"):
            pairs.append((str(lab / "fp32.onnx"), str(lab / f"{quant}.onnx"), samples))
        floats.append(str(lab / "fp32.onnx"))
    chains = folder / "chains"
    chains.mkdir(parents=True)
    single.append(chain_model(chains / "chain.onnx", ["a", "qdq", "b", "c", "qdq", "d"]))
    single.append(chain_model(chains / "sigmoid.onnx", ["qdq", "s1", "qdq", "s2"], op_type="Sigmoid"))
    cnn, cnn_q = folder / "cnn.onnx", folder / "cnn_qdq.onnx"
    onnx.save(gen_models.build_cnn(6, channels=4, size=16, seed=0), cnn)
    with gen_models.quiet_quantizer():
        gen_models.quantize_qdq(cnn, cnn_q, seed=0)
    single += [str(cnn), str(cnn_q)]
    floats.append(str(cnn))
    pairs.append((str(cnn), str(cnn_q), []))
    return {"single": single, "pairs": pairs, "float": floats}


def cases(models: dict, real: list[Path], out: Path) -> list[tuple[str, list[str]]]:
    """``[(name, argv)]``: every command and option that answers, on every model it takes."""
    result = []
    for path in models["single"]:
        for command in ("nodes", "qdq", "islands", "boundary"):
            result.append((f"{command} {path}", [command, path]))
            result.append((f"{command} table {path}", [command, path, "--format", "table", "--top", "2"]))
        result.append((f"dot {path}", ["dot", path]))
        result.append((f"dot collapse {path}", ["dot", path, "--collapse"]))
        result.append((f"dot runtime {path}", ["dot", path, "--runtime"]))
        for level in ("basic", "extended", "all"):
            result.append((f"runtime {level} {path}", ["runtime", path, "--level", level]))
        result.append((f"runtime int8 {path}", ["runtime", path, "--int8-allowed"]))
        result.append((f"runtime table {path}", ["runtime", path, "--format", "table"]))
        result.append((f"runtime time {path}", ["runtime", path, "--time", "--runs", "2"]))
        budgets = ["--max-float", "3", "--max-islands", "1", "--max-crossings", "4"]
        result.append((f"check {path}", ["check", path, *budgets]))
        result.append((f"check int8 {path}", ["check", path, "--min-int8", "0.5"]))
    singles = models["single"]
    for a, b in itertools.pairwise(singles):
        result.append((f"diff {a} {b}", ["diff", a, b]))
        result.append((f"diff table {a} {b}", ["diff", a, b, "--format", "table"]))
    for k, path in enumerate(models["float"]):
        target = str(out / f"fused{k}.onnx")
        result.append((f"fuse {path}", ["fuse", path, target]))
        result.append((f"fuse seed {path}", ["fuse", path, target, "--seed", "3", "--format", "table"]))
    pairs = list(models["pairs"])
    for folder in real:
        samples = sorted(str(p) for p in folder.glob("sample*.npz"))
        pairs.append((str(folder / "float.onnx"), str(folder / "quant.onnx"), samples))
    for a, b, samples in pairs:
        name = f"{a} {b}"
        result.append((f"trace {name}", ["trace", a, b]))
        result.append((f"trace seed {name}", ["trace", a, b, "--seed", "3", "--tolerance", "0"]))
        result.append((f"trace table {name}", ["trace", a, b, "--format", "table", "--top", "3"]))
        result.append((f"impact {name}", ["impact", a, b]))
        result.append((f"impact target {name}", ["impact", a, b, "--target-sqnr", "60", "--max-exclude", "2"]))
        result.append((f"impact table {name}", ["impact", a, b, "--format", "table", "--top", "3"]))
        result.append((f"check sqnr {name}", ["check", b, "--float", a, "--min-sqnr", "20"]))
        if samples:
            many = [arg for s in samples[:2] for arg in ("--inputs", s)]
            result.append((f"trace inputs {name}", ["trace", a, b, "--inputs", samples[0]]))
            result.append((f"impact inputs {name}", ["impact", a, b, *many, "--top", "5"]))
            result.append((f"check inputs {name}", ["check", b, "--float", a, "--min-sqnr", "20", *many]))
    return result


def timing_masked(stdout: bytes) -> object:
    """A ``runtime --time`` answer with its measured times replaced by their types."""
    answer = json.loads(stdout)
    time = answer.get("time")
    if isinstance(time, dict):
        for key in TIME_KEYS & set(time):
            value = time[key]
            time[key] = sorted(value) if isinstance(value, dict) else type(value).__name__
    return answer


def run(script: Path, argv: list[str], output: Path | None) -> tuple[int, bytes, bytes | None]:
    proc = subprocess.run(
        [sys.executable, str(script), *argv], cwd=REPO_ROOT, capture_output=True, timeout=1200, check=False
    )
    written = output.read_bytes() if output is not None and output.exists() else None
    if output is not None and output.exists():
        output.unlink()
    return proc.returncode, proc.stdout, written


def compare(baseline: Path, current: Path, name: str, argv: list[str]) -> str | None:
    """None when both answer the same, else what differs."""
    output = Path(argv[2]) if argv[0] == "fuse" else None
    first, second = run(baseline, argv, output), run(current, argv, output)
    if first[0] != second[0]:
        return f"exit {first[0]} vs {second[0]}"
    if first == second:
        return None
    if "--time" in argv and first[0] == 0 and timing_masked(first[1]) == timing_masked(second[1]):
        return None
    if first[2] != second[2]:
        return "written file differs"
    return f"stdout differs:\n  {first[1][:300]!r}\n  {second[1][:300]!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with (default: HEAD)")
    parser.add_argument("--models", action="append", default=[], type=Path, help="a folder of real models")
    parser.add_argument("--only", help="run only cases whose name contains this text")
    parser.add_argument("--json", type=Path, help="write every case's result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="graphscan-compare-") as tmp:
        tmp = Path(tmp)
        baseline = export_revision(args.baseline, tmp / "baseline") / "graphscan.py"
        current = snapshot_tree(tmp / "current")
        models = build_models(tmp / "models")
        (tmp / "out").mkdir()
        todo = [c for c in cases(models, args.models, tmp / "out") if not args.only or args.only in c[0]]
        results = {}
        for name, case_argv in todo:
            results[name] = compare(baseline, current, name, case_argv)
            if results[name]:
                print(f"DIFFERS {name}: {results[name]}", flush=True)
    differing = sum(1 for r in results.values() if r)
    print(f"{len(results)} cases, {len(results) - differing} identical, {differing} differ (baseline {args.baseline})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
