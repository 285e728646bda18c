"""Are two versions of graphscan answering byte for byte the same?

    python bench/compare_answers.py [--baseline REF] [--models DIR ...] [--only TEXT] [--show] [--json FILE]

Runs every command and every option that answers on the same models with the
graphscan of git revision REF (default: HEAD, exported with ``git archive``)
and with the working tree's (copied when the run starts, so the tree can change
while it runs), each as a whole process from the same folder, and compares
exit code, stdout and stderr byte for byte (fuse: the written file too). Table
and DOT text are compared as well (a restructuring must not change them either).
Beyond the answers it covers ``--help`` of graphscan and of every command; error
cases of every command (missing, junk and folder paths, bad option values,
samples that do not fit, metric files that do not load); short ``tune`` runs;
``table`` on saved answers; and the pytest plugin's failure and collection-error
sentences (``python -m pytest -p graphscan_pytest --graphscan`` in a folder of
gates, each checkout on PYTHONPATH).

Masked, and nothing else:

- stderr and pytest's output: the two checkouts' folders become ``<checkout>``
  (a traceback names its files); tune's progress line (written only to a
  terminal, so never here) is cut; pytest's duration becomes ``in <time>``.
- ``runtime --time``: the measured times (TIME_KEYS) are compared by key and type.
- ``tune``: its cases pass ``--min-speedup 0``, so no guard depends on timing.
  Candidates are compared as a map keyed by their settings (``quantize_static``,
  ``quantize_dynamic``, ``rewrites``, ``post_step``, ``excluded``), as their order is by speed; each
  row without TUNE_TIMED (``ms``, ``speedup``, ``speedup_spread``, and
  ``pareto``, which ranks by speed) and without ``slower`` in ``fails``;
  ``float.ms`` and ``chosen`` (the fastest row that meets the target) are
  masked, and the written folder is not compared. Every other figure of a row
  (``id``, ``sqnr_db``, ``metric_value``, ``int8_fraction``, ``int8_kernels``,
  ``bytes``, ``wrapped_but_float``, ``float_weights``, ``same_as``, the other
  ``fails``, ``error``) and the answer's ``target``, ``reached``, ``written``
  and ``warnings`` are compared as they are. The fallback search starts from the
  most accurate row, and rows of equal outputs tie, broken by speed: rows whose
  settings only one answer has are compared by their accuracy figures alone
  (TUNE_ACCURACY), as a sorted list.

Models: the committed ``ops/``, lab models that gen_models.py builds with other
layer counts, hand-built chains, a CNN, and each ``--models DIR`` holding
``float.onnx``, ``quant.onnx`` and ``sample*.npz`` (real models, kept out of the
repository). Exit 0 when every case is identical, 1 otherwise. Run by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
TIME_KEYS = {"profiler_floor_us", "shares", "nodes", "wall_ms", "round_trip_cost", "method"}
TUNE_TIMED = {"ms", "float_ms", "speedup", "speedup_spread", "pareto"}
# what is compared of a tune row whose settings the other answer lacks (paired_tune_rows)
TUNE_ACCURACY = ["sqnr_db", "metric_value", "int8_fraction", "int8_kernels", "wrapped_but_float", "float_weights"]
TUNE_ACCURACY += ["rewrites", "post_step", "excluded", "trial", "fails", "error"]
COMMANDS = ["nodes", "qdq", "islands", "boundary", "diff", "fuse", "trace", "runtime", "check", "dot", "impact"]
COMMANDS += ["tune", "table"]
# the plugin of the checkout on PYTHONPATH, never an installed one (its entry point is named graphscan)
PYTEST = ["-m", "pytest", "-p", "no:graphscan", "-p", "graphscan_pytest", "--graphscan", "-q"]
PYTEST += ["-p", "no:xdist", "-p", "no:cacheprovider"]
PROGRESS = re.compile(rb"\r[^\r\n]*?\x1b\[K")  # tune's progress line and its erasure (a terminal only)
DURATION = re.compile(rb" in \d+(\.\d+)?s\b")  # pytest's "1 failed in 2.31s"


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of both versions: graphscan's ``argv``, or pytest's in ``folder`` (kind ``pytest``).
    ``kind`` says what is masked: ``answer`` (nothing), ``time`` (runtime --time), ``tune``."""

    name: str
    argv: list[str]
    kind: str = "answer"
    written: Path | None = None  # a file (compared) or folder (not) the run writes, removed before and after
    folder: Path | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    code: int
    stdout: bytes
    stderr: bytes
    written: bytes | None


# ---------------------------------------------------------------------------
# The two versions and the models.


def export_revision(revision: str, folder: Path) -> Path:
    """The tracked files of ``revision`` under ``folder``."""
    data = subprocess.run(["git", "archive", revision], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(folder, filter="data")
    return folder


def snapshot_tree(folder: Path) -> Path:
    """A copy of the working tree's graphscan.py, the plugin's modules and graphscan_ort package in ``folder``."""
    folder.mkdir(parents=True)
    for name in ("graphscan.py", "graphscan_pytest.py", "graphscan_pytest_fixture.py", "graphscan_pytest_snapshots.py"):
        if (REPO_ROOT / name).is_file():
            shutil.copy2(REPO_ROOT / name, folder / name)
    if (REPO_ROOT / "graphscan_ort").is_dir():
        shutil.copytree(
            REPO_ROOT / "graphscan_ort", folder / "graphscan_ort", ignore=shutil.ignore_patterns("__pycache__")
        )
    return folder


def build_models(folder: Path) -> dict:
    """The models compared: ``{"single": [paths], "pairs": [(float, quant, [npz...])], "float":
    [paths], "lab": folder, "tune": folder}``, the last two lab folders with ``sample0.npz`` and
    ``sample1.npz`` (``lab``: width 16, for the error cases and the gates; ``tune``: width 64)."""
    sys.path.insert(0, str(REPO_ROOT))
    import numpy as np
    import onnx

    import gen_models
    from tests.helpers import chain_model

    single: list[str] = []
    pairs: list[tuple[str, str, list[str]]] = []
    floats: list[str] = []
    ops = REPO_ROOT / "ops"
    single += sorted(str(p.relative_to(REPO_ROOT)) for p in ops.glob("*.onnx"))
    floats += ["ops/fp32.onnx", "ops/gemm.onnx"]
    for quant in ("full", "matmul_only", "excluded", "gemm_full"):
        base = "ops/gemm.onnx" if quant == "gemm_full" else "ops/fp32.onnx"
        pairs.append((base, f"ops/{quant}.onnx", []))
    labs = {}
    # (layers, width, excluded): two labs for the counts, a wider one (its int8 models are smaller
    # than float, so tune's size guard passes and tune ends without a timing-dependent search)
    for layers, dim, exclude in ((4, 16, "fc2_matmul"), (6, 8, "fc3_add"), (3, 64, "fc2_matmul")):
        lab = folder / f"lab{layers}"
        lab.mkdir(parents=True)
        with gen_models.quiet_quantizer():
            gen_models.build_lab(lab, layers, dim, 0, exclude)
        rng = np.random.default_rng(layers)
        samples = []
        for k in range(2):
            sample = lab / f"sample{k}.npz"
            np.savez(sample, x=rng.standard_normal((3, dim)).astype(np.float32))
            samples.append(str(sample))
        labs[dim] = lab
        if dim == 64:
            continue
        single += [str(lab / n) for n in sorted(p.name for p in lab.glob("*.onnx"))]
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
    return {"single": single, "pairs": pairs, "float": floats, "lab": labs[16], "tune": labs[64]}


def build_bad_inputs(folder: Path, lab: Path) -> dict[str, str]:
    """Files graphscan must refuse, beside one metric file it accepts: ``{what: path}``.
    Samples are for ``lab``'s models (one input ``x`` of width 16)."""
    import numpy as np

    folder.mkdir(parents=True)
    files = {
        "junk_model": folder / "junk.onnx",
        "junk_sample": folder / "junk.npz",
        "wrong_name": folder / "wrong_name.npz",
        "wrong_width": folder / "wrong_width.npz",
        "metric": folder / "metric.py",
        "junk_answer": folder / "junk.json",
        "alien_answer": folder / "alien.json",
        "empty_folder": folder / "empty",
    }
    files["junk_model"].write_bytes(b"not an ONNX model\n")
    files["junk_sample"].write_bytes(b"not a sample\n")
    np.savez(files["wrong_name"], y=np.zeros((3, 16), np.float32))
    np.savez(files["wrong_width"], x=np.zeros((3, 5), np.float32))
    files["metric"].write_text(
        "def agree(reference, candidate):\n    return 1.0\n\n\n"
        "def broken(reference, candidate):\n    raise ValueError('broken on purpose')\n"
    )
    files["junk_answer"].write_text("{not json\n")
    files["alien_answer"].write_text('{"something": "else"}\n')
    files["empty_folder"].mkdir()
    return {what: str(path) for what, path in files.items()}


def saved_answers(script: Path, models: dict, folder: Path) -> list[str]:
    """Answers of several commands saved by ``script`` (the baseline), for ``table``."""
    folder.mkdir(parents=True)
    lab = models["lab"]
    saved = []
    for name, argv in [
        ("nodes", ["nodes", str(lab / "full.onnx")]),
        ("islands", ["islands", str(lab / "matmul_only.onnx")]),
        ("runtime", ["runtime", str(lab / "matmul_only.onnx")]),
        ("trace", ["trace", str(lab / "fp32.onnx"), str(lab / "full.onnx")]),
        ("impact", ["impact", str(lab / "fp32.onnx"), str(lab / "excluded.onnx")]),
        ("check", ["check", str(lab / "matmul_only.onnx"), "--max-float", "0", "--min-int8", "0.9"]),
        ("diff", ["diff", str(lab / "fp32.onnx"), str(lab / "full.onnx")]),
    ]:
        proc = subprocess.run([sys.executable, str(script), *argv], capture_output=True, check=False, cwd=REPO_ROOT)
        (folder / f"{name}.json").write_bytes(proc.stdout)
        saved.append(str(folder / f"{name}.json"))
    return saved


def build_gates(folder: Path, lab: Path, baseline: Path) -> dict[str, str]:
    """A folder of gates over ``lab``'s models whose budgets fail (each kind of sentence) and
    configs with mistakes (collection errors): ``{case name: config file}``. The snapshot of
    matmul_only.onnx is taken with ``baseline``, then one node's class is changed in it."""
    (folder / "models").mkdir(parents=True)
    for variant in ("fp32", "full", "matmul_only"):
        shutil.copy(lab / f"{variant}.onnx", folder / "models" / f"{variant}.onnx")
    shutil.copy(lab / "sample0.npz", folder / "sample.npz")
    (folder / "pytest.ini").write_text("[pytest]\n")  # the folder is pytest's rootdir, whatever is above it
    (folder / "snapshot.toml").write_text('[[model]]\npath = "models/matmul_only.onnx"\nsnapshot = true\n')
    env = {**os.environ, "PYTHONPATH": str(baseline)}
    update = [sys.executable, *PYTEST, "--graphscan-config", "snapshot.toml", "--graphscan-snapshot-update"]
    subprocess.run(update, cwd=folder, env=env, capture_output=True, check=True)
    # The one snapshot (the plugin may keep a record of what it wrote beside it: written.json).
    (snapshot,) = (p for p in (folder / "graphscan_snapshots").glob("*.json") if p.name != "written.json")
    pinned = json.loads(snapshot.read_text())
    node = sorted(pinned["nodes"])[0]
    pinned["nodes"][node]["class"] = "int8" if pinned["nodes"][node]["class"] != "int8" else "float"
    snapshot.write_text(json.dumps(pinned, indent=2, sort_keys=True) + "\n")
    configs = {
        "failing budgets": """
[[model]]
path = "models/full.onnx"
float = "models/fp32.onnx"
inputs = ["sample.npz"]
min_sqnr = 200
metric = "cosine"
min_metric = 1.5

[[model]]
path = "models/matmul_only.onnx"
max_float = 0
max_islands = 0
max_crossings = 0
min_int8 = 1.0
snapshot = true

[[model]]
path = "models/full.onnx"
snapshot = true
""",
        "unknown key": '[[model]]\npath = "models/full.onnx"\nmax_flaot = 1\n',
        "missing model": '[[model]]\npath = "models/none.onnx"\nmax_float = 1\n',
        "wrong type": '[[model]]\npath = "models/full.onnx"\nmax_float = "one"\n',
        "not toml": "[[model]\npath = \n",
        "no budget": '[[model]]\npath = "models/full.onnx"\n',
    }
    files = {}
    for k, (name, text) in enumerate(configs.items()):
        path = folder / f"gates{k}.toml"
        path.write_text(text.lstrip("\n"))
        files[name] = path.name
    return files


# ---------------------------------------------------------------------------
# The cases.


def answer_cases(models: dict, real: list[Path], out: Path) -> list[Case]:
    """Every command and option that answers, on every model it takes."""
    result = []
    for path in models["single"]:
        for command in ("nodes", "qdq", "islands", "boundary"):
            result.append(Case(f"{command} {path}", [command, path]))
            result.append(Case(f"{command} table {path}", [command, path, "--format", "table", "--top", "2"]))
        result.append(Case(f"dot {path}", ["dot", path]))
        result.append(Case(f"dot collapse {path}", ["dot", path, "--collapse"]))
        result.append(Case(f"dot runtime {path}", ["dot", path, "--runtime"]))
        for level in ("basic", "extended", "all"):
            result.append(Case(f"runtime {level} {path}", ["runtime", path, "--level", level]))
        result.append(Case(f"runtime int8 {path}", ["runtime", path, "--int8-allowed"]))
        result.append(Case(f"runtime table {path}", ["runtime", path, "--format", "table"]))
        result.append(Case(f"runtime time {path}", ["runtime", path, "--time", "--runs", "2"], kind="time"))
        budgets = ["--max-float", "3", "--max-islands", "1", "--max-crossings", "4"]
        result.append(Case(f"check {path}", ["check", path, *budgets]))
        result.append(Case(f"check int8 {path}", ["check", path, "--min-int8", "0.5"]))
    singles = models["single"]
    for a, b in itertools.pairwise(singles):
        result.append(Case(f"diff {a} {b}", ["diff", a, b]))
        result.append(Case(f"diff table {a} {b}", ["diff", a, b, "--format", "table"]))
    for k, path in enumerate(models["float"]):
        target = out / f"fused{k}.onnx"
        result.append(Case(f"fuse {path}", ["fuse", path, str(target)], written=target))
        argv = ["fuse", path, str(target), "--seed", "3", "--format", "table"]
        result.append(Case(f"fuse seed {path}", argv, written=target))
    pairs = list(models["pairs"])
    for folder in real:
        samples = sorted(str(p) for p in folder.glob("sample*.npz"))
        pairs.append((str(folder / "float.onnx"), str(folder / "quant.onnx"), samples))
    for a, b, samples in pairs:
        name = f"{a} {b}"
        result.append(Case(f"trace {name}", ["trace", a, b]))
        result.append(Case(f"trace seed {name}", ["trace", a, b, "--seed", "3", "--tolerance", "0"]))
        result.append(Case(f"trace table {name}", ["trace", a, b, "--format", "table", "--top", "3"]))
        result.append(Case(f"impact {name}", ["impact", a, b]))
        result.append(Case(f"impact target {name}", ["impact", a, b, "--target-sqnr", "60", "--max-exclude", "2"]))
        result.append(Case(f"impact table {name}", ["impact", a, b, "--format", "table", "--top", "3"]))
        result.append(Case(f"check sqnr {name}", ["check", b, "--float", a, "--min-sqnr", "20"]))
        if samples:
            many = [arg for s in samples[:2] for arg in ("--inputs", s)]
            result.append(Case(f"trace inputs {name}", ["trace", a, b, "--inputs", samples[0]]))
            result.append(Case(f"impact inputs {name}", ["impact", a, b, *many, "--top", "5"]))
            result.append(Case(f"check inputs {name}", ["check", b, "--float", a, "--min-sqnr", "20", *many]))
    return result


def help_cases() -> list[Case]:
    """``--help`` of graphscan and of every command, and the usage line of no command."""
    result = [Case("help", ["--help"]), Case("no command", []), Case("unknown command", ["bogus"])]
    result += [Case(f"help {command}", [command, "--help"]) for command in COMMANDS]
    result += [Case(f"no arguments {command}", [command]) for command in COMMANDS]
    return result


def error_cases(models: dict, bad: dict[str, str], out: Path) -> list[Case]:
    """A representative set of bad inputs per command: each must give the same one line and code."""
    lab = models["lab"]
    fp32, full, matmul = str(lab / "fp32.onnx"), str(lab / "full.onnx"), str(lab / "matmul_only.onnx")
    sample = str(lab / "sample0.npz")
    missing, folder, junk = "no/such/model.onnx", "ops", bad["junk_model"]
    fused = out / "error-fused.onnx"
    result = []
    paths = {"missing": missing, "folder": folder, "junk": junk}
    for what, path in paths.items():
        for command in ("nodes", "qdq", "islands", "boundary", "runtime", "dot"):
            result.append(Case(f"error {command} {what}", [command, path]))
        result.append(Case(f"error check {what}", ["check", path, "--max-float", "1"]))
        result.append(Case(f"error check float {what}", ["check", full, "--float", path, "--min-sqnr", "1"]))
        result.append(Case(f"error fuse {what}", ["fuse", path, str(fused)], written=fused))
        argv = ["tune", path, "--calibrate", sample, "--out", str(out / "tune-error")]
        result.append(Case(f"error tune {what}", argv, kind="tune", written=out / "tune-error"))
        result.append(Case(f"error table {what}", ["table", path]))
        for command in ("diff", "trace", "impact"):
            result.append(Case(f"error {command} a {what}", [command, path, full]))
            result.append(Case(f"error {command} b {what}", [command, fp32, path]))
    result.append(Case("error table junk json", ["table", bad["junk_answer"]]))
    result.append(Case("error table alien json", ["table", bad["alien_answer"]]))
    samples = {
        "missing": "no/such/sample.npz",
        "junk": bad["junk_sample"],
        "wrong name": bad["wrong_name"],
        "wrong width": bad["wrong_width"],
        "folder": bad["empty_folder"],
    }
    for what, path in samples.items():
        result.append(Case(f"error trace inputs {what}", ["trace", fp32, full, "--inputs", path]))
        result.append(Case(f"error impact inputs {what}", ["impact", fp32, full, "--inputs", path]))
        argv = ["check", full, "--float", fp32, "--min-sqnr", "1", "--inputs", path]
        result.append(Case(f"error check inputs {what}", argv))
        result.append(Case(f"error runtime inputs {what}", ["runtime", full, "--time", "--inputs", path]))
        result.append(Case(f"error fuse inputs {what}", ["fuse", fp32, str(fused), "--inputs", path], written=fused))
        argv = ["tune", fp32, "--calibrate", path, "--out", str(out / "tune-error"), "--runs", "1"]
        result.append(Case(f"error tune calibrate {what}", argv, kind="tune"))
    options = {
        "runtime": (
            [full, "--time"],
            [
                ["--runs", "0"],
                ["--runs", "-1"],
                ["--runs", "many"],
                ["--threads", "-1"],
                ["--level", "bogus"],
                ["--provider", "BogusExecutionProvider"],
                ["--shape", "x=1,2,3"],
                ["--shape", "x"],
                ["--shape", "y=3,16"],
                ["--seed", "-1"],
                ["--format", "bogus"],
                ["--top", "-1"],
            ],
        ),
        "trace": (
            [fp32, full],
            [
                ["--tolerance", "nan"],
                ["--tolerance", "-1"],
                ["--shape", "x=3,5"],
                ["--seed", "-1"],
                ["--save", bad["junk_model"]],
                ["--top", "-1"],
            ],
        ),
        "impact": (
            [fp32, full],
            [["--max-exclude", "-1"], ["--target-sqnr", "nan"], ["--min-gain", "nan"], ["--top", "-1"]],
        ),
        "check": (
            [full],
            [
                ["--min-int8", "1.5"],
                ["--min-int8", "nan"],
                ["--max-float", "-1"],
                ["--min-sqnr", "20"],
                ["--float", fp32, "--max-float", "1"],
                ["--level", "bogus", "--max-float", "1"],
                ["--budget", "no/such/budget.json"],
                ["--budget", bad["junk_answer"]],
                ["--budget", bad["alien_answer"]],
                ["--float", fp32, "--min-metric", "0.5", "--metric", "bogus"],
                ["--float", fp32, "--min-metric", "0.5", "--metric", "no/such/metric.py:agree"],
                ["--float", fp32, "--min-metric", "0.5", "--metric", f"{bad['metric']}:missing"],
                ["--float", fp32, "--min-metric", "0.5", "--metric", f"{bad['metric']}:broken"],
                ["--float", fp32, "--min-metric", "0.5", "--metric", "iou", "--threshold", "nan"],
                ["--float", fp32, "--min-metric", "0.5", "--metric", "ctc", "--blank", "-3"],
            ],
        ),
        "fuse": ([fp32, "no/such/folder/fused.onnx"], [[], ["--seed", "-1"]]),
        "dot": ([full], [["--format", "table"]]),
        "diff": ([fp32, full], [["--top", "0"]]),
        "tune": (
            [fp32, "--calibrate", sample, "--runs", "1"],
            [
                [],
                ["--out", "ops"],
                ["--out", bad["junk_model"]],
                ["--out", str(out / "tune-error"), "--runs", "0"],
                ["--out", str(out / "tune-error"), "--threads", "-1"],
                ["--out", str(out / "tune-error"), "--level", "bogus"],
                ["--out", str(out / "tune-error"), "--max-trials", "-1"],
                ["--out", str(out / "tune-error"), "--target", "nan"],
                ["--out", str(out / "tune-error"), "--metric", "bogus"],
                ["--out", str(out / "tune-error"), "--metric", "no/such/metric.py:agree"],
                ["--out", str(out / "tune-error"), "--metric", f"{bad['metric']}:missing"],
                ["--out", str(out / "tune-error"), "--metric", f"{bad['metric']}:broken"],
                ["--out", str(out / "tune-error"), "--inputs", bad["wrong_name"]],
                ["--out", str(out / "tune-error"), "--latency-inputs", bad["wrong_width"]],
            ],
        ),
    }
    for command, (given, variants) in options.items():
        for extra in variants:
            kind = "tune" if command == "tune" else "answer"
            written = out / "tune-error" if command == "tune" else None
            name = f"error {command} {' '.join(extra) or 'plain'}"
            result.append(Case(name, [command, *given, *extra], kind=kind, written=written))
    argv = ["tune", full, "--calibrate", sample, "--out", str(out / "tune-error")]
    quantized = Case("error tune quantized", argv, kind="tune", written=out / "tune-error")
    return [*result, quantized, Case("error nodes unknown option", ["nodes", matmul, "--bogus"])]


def tune_cases(models: dict, bad: dict[str, str], out: Path) -> list[Case]:
    """Short tune runs on the wide lab MLP (seconds each): a target reached without the search,
    one the fallback search tries once for, and agreement metrics, a user's among them."""
    lab = models["tune"]
    target = out / "tune"
    given = ["tune", str(lab / "fp32.onnx"), "--calibrate", str(lab / "sample0.npz"), "--inputs"]
    given += [str(lab / "sample1.npz"), "--runs", "1", "--min-speedup", "0", "--out", str(target)]
    variants = {
        "reached": ["--target-sqnr", "0"],
        "default target": [],
        "search": ["--target-sqnr", "200", "--max-trials", "1", "--max-exclude", "1"],
        "cosine": ["--metric", "cosine", "--target", "0.5"],
        "user metric": ["--metric", f"{bad['metric']}:agree", "--target", "0.5"],
        "level basic": ["--target-sqnr", "0", "--level", "basic"],
    }
    return [Case(f"tune {name}", [*given, *extra], kind="tune", written=target) for name, extra in variants.items()]


def table_cases(saved: list[str]) -> list[Case]:
    """``table`` on answers saved by the baseline: the same JSON shown by both versions."""
    tops: list[list[str]] = [[], ["--top", "2"]]
    return [Case(" ".join(["table", Path(s).stem, *top]), ["table", s, *top]) for s in saved for top in tops]


def pytest_cases(folder: Path, configs: dict[str, str]) -> list[Case]:
    """The plugin on each config of ``build_gates``: failure sentences and collection errors."""
    return [
        Case(f"pytest {name}", ["--graphscan-config", file], kind="pytest", folder=folder)
        for name, file in configs.items()
    ]


# ---------------------------------------------------------------------------
# Running and comparing.


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def run(checkout: Path, case: Case) -> Outcome:
    """``case`` run with the graphscan in ``checkout``, as a whole process."""
    if case.written is not None:
        remove(case.written)
    if case.kind == "pytest":
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        env["PYTHONPATH"] = str(checkout)  # graphscan_pytest and graphscan of this checkout, no other
        command, cwd = [sys.executable, *PYTEST, *case.argv], case.folder
    else:
        env, command, cwd = None, [sys.executable, str(checkout / "graphscan.py"), *case.argv], REPO_ROOT
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, timeout=1200, check=False)
    written = case.written.read_bytes() if case.written is not None and case.written.is_file() else None
    if case.written is not None:
        remove(case.written)
    return Outcome(proc.returncode, proc.stdout, proc.stderr, written)


def timing_masked(answer: dict) -> dict:
    """A ``runtime --time`` answer with its measured times replaced by their types."""
    time_ = answer.get("time")
    if isinstance(time_, dict):
        for key in TIME_KEYS & set(time_):
            value = time_[key]
            time_[key] = sorted(value) if isinstance(value, dict) else type(value).__name__
    return answer


def tune_masked(answer: dict) -> dict:
    """A tune answer with what depends on timing masked, its candidates keyed by their settings
    (see the module's docstring)."""
    rows = {}
    for row in answer.pop("candidates", []):
        masked = {key: (type(value).__name__ if key in TUNE_TIMED else value) for key, value in row.items()}
        # numbered in the order tried, which timing decides (the fastest rows are seeded)
        for key in ("id", "same_as", "speed_from"):
            if masked.get(key) is not None:
                masked[key] = "int"
        if isinstance(masked.get("fails"), list):
            masked["fails"] = [guard for guard in masked["fails"] if guard != "slower"]
        keys = ("quantize_static", "quantize_dynamic", "rewrites", "post_step", "excluded")
        settings = [row.get(key) for key in keys]
        rows[json.dumps(settings, sort_keys=True)] = masked
    answer["candidates"] = rows
    if isinstance(answer.get("float"), dict) and "ms" in answer["float"]:
        answer["float"]["ms"] = type(answer["float"]["ms"]).__name__
    if "chosen" in answer:
        answer["chosen"] = type(answer["chosen"]).__name__
    return answer


def paired_tune_rows(first: dict, second: dict) -> None:
    """Candidates whose settings only one of two tune answers has move to ``unmatched``, a sorted
    list of their accuracy figures (TUNE_ACCURACY): refinements and exclusions start from the most
    accurate row, and a tie in accuracy (rows with equal outputs) is broken by speed."""
    ours, theirs = first["candidates"], second["candidates"]
    shared = set(ours) & set(theirs)
    for answer in (first, second):
        alone = [row for key, row in answer["candidates"].items() if key not in shared]
        figures = [json.dumps({key: row.get(key) for key in TUNE_ACCURACY}, sort_keys=True) for row in alone]
        answer["unmatched"] = sorted(figures)
        answer["candidates"] = {key: row for key, row in answer["candidates"].items() if key in shared}


def masked(case: Case, outcome: Outcome, checkouts: list[Path]) -> dict[str, object]:
    """What is compared of one outcome, with only what ``case.kind`` may vary masked (a tune
    answer stays a dict, for paired_tune_rows)."""

    def anonymous(text: bytes) -> bytes:
        for checkout in checkouts:
            text = text.replace(str(checkout).encode(), b"<checkout>")
        return text

    stdout: bytes | dict = outcome.stdout
    stderr = PROGRESS.sub(b"", anonymous(outcome.stderr))
    if case.kind == "pytest":
        stdout = DURATION.sub(b" in <time>", anonymous(outcome.stdout))
    elif case.kind == "time" and outcome.stdout.startswith(b"{"):
        stdout = json.dumps(timing_masked(json.loads(outcome.stdout)), indent=1, sort_keys=True).encode()
    elif case.kind == "tune" and outcome.stdout.startswith(b"{"):
        stdout = tune_masked(json.loads(outcome.stdout))
    return {"exit": outcome.code, "stdout": stdout, "stderr": stderr, "written file": outcome.written}


def difference(a: object, b: object) -> str:
    """Where two compared values part, shown around their first differing byte."""
    if not (isinstance(a, bytes) and isinstance(b, bytes)):
        return f"{a!r} vs {b!r}"
    at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    start = max(0, at - 120)
    return f"at byte {at}:\n  {a[start : at + 180]!r}\n  {b[start : at + 180]!r}"


def compare(baseline: Path, current: Path, case: Case, show: bool = False) -> str | None:
    """None when both versions answer ``case`` the same, else what differs (``show``: print what
    the working tree's answered, masked, to see that a case tests what its name says)."""
    checkouts = [baseline, current]
    first = masked(case, run(baseline, case), checkouts)
    second = masked(case, run(current, case), checkouts)
    if isinstance(first["stdout"], dict) and isinstance(second["stdout"], dict):
        paired_tune_rows(first["stdout"], second["stdout"])
    for answer in (first, second):
        if isinstance(answer["stdout"], dict):
            answer["stdout"] = json.dumps(answer["stdout"], indent=1, sort_keys=True).encode()
    if show:
        print(f"== {case.name}: exit {second['exit']}", *(f"{k}: {second[k]!r:.1500}" for k in ("stdout", "stderr")))
    for key in first:
        if first[key] != second[key]:
            return f"{key} differs {difference(first[key], second[key])}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with (default: HEAD)")
    parser.add_argument("--models", action="append", default=[], type=Path, help="a folder of real models")
    parser.add_argument("--only", help="run only cases whose name contains this text")
    parser.add_argument("--show", action="store_true", help="print what each case answered (masked)")
    parser.add_argument("--json", type=Path, help="write every case's result here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="graphscan-compare-") as name:
        tmp = Path(name)
        baseline = export_revision(args.baseline, tmp / "baseline")
        current = snapshot_tree(tmp / "current")
        models = build_models(tmp / "models")
        bad = build_bad_inputs(tmp / "bad", models["lab"])
        out = tmp / "out"
        out.mkdir()
        configs = build_gates(tmp / "gates", models["lab"], baseline)
        saved = saved_answers(baseline / "graphscan.py", models, tmp / "saved")
        everything = [
            *answer_cases(models, args.models, out),
            *help_cases(),
            *error_cases(models, bad, out),
            *tune_cases(models, bad, out),
            *table_cases(saved),
            *pytest_cases(tmp / "gates", configs),
        ]
        # names without the temporary folder: the same in every run
        everything = [dataclasses.replace(case, name=case.name.replace(f"{tmp}/", "")) for case in everything]
        names = [case.name for case in everything]
        assert len(names) == len(set(names)), "two cases share a name"
        results = {}
        for case in everything:
            if args.only and args.only not in case.name:
                continue
            results[case.name] = compare(baseline, current, case, args.show)
            if results[case.name]:
                print(f"DIFFERS {case.name}: {results[case.name]}", flush=True)
    differing = sum(1 for r in results.values() if r)
    print(
        f"{len(results)} cases, {len(results) - differing} identical, {differing} differ "
        f"(baseline {args.baseline}, {time.monotonic() - started:.0f} s)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
