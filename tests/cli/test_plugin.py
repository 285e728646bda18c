"""graphscan for pytest (graphscan_pytest.py): gates from graphscan.toml, one item per
model and budget, sentences for failures, snapshots of what runs, the fixture, and a
plugin that is inert unless asked.

Each run is pytest in a temporary model repository with ``-p graphscan_pytest``, in this
process (pytester); once in a separate process after ``pip install .`` into a fresh venv,
where the pytest11 entry point loads it as users run it, and once in a bare interpreter
to show that loading the plugin imports nothing heavy.
"""

import json
import os
import shutil
import subprocess
import sys
import tomllib

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import QuantType, quantize_static

import gen_models
import graphscan
import graphscan_pytest
from graphscan_ort.tune.candidates import SampleReader, quiet
from tests.helpers import ROOT
from tests.lab import DEFAULT_LAB


@pytest.fixture(scope="module")
def repository(tmp_path_factory, build_case):
    """The lab's models and a small CNN quantized two ways (int8 and uint8 activations),
    with samples; limits are set from graphscan's own answers, so each budget's outcome is
    known: ``expected`` maps every item id to passed or failed."""
    folder = tmp_path_factory.mktemp("repository")
    (folder / "models").mkdir()
    lab = build_case(DEFAULT_LAB)
    for variant in ("fp32", "full", "matmul_only"):
        shutil.copy(lab[variant], folder / "models" / f"{variant}.onnx")
    onnx.save(gen_models.build_cnn(1, channels=8, size=8, seed=0), folder / "models" / "cnn.onnx")
    sample = {"x": np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    np.savez(folder / "cnn_sample.npz", **sample)
    np.savez(
        folder / "lab_sample.npz", x=np.random.default_rng(1).standard_normal((4, DEFAULT_LAB.dim)).astype(np.float32)
    )
    for name, activation in (("cnn.s8", QuantType.QInt8), ("cnn.u8", QuantType.QUInt8)):
        with quiet():
            quantize_static(
                str(folder / "models" / "cnn.onnx"), str(folder / "models" / f"{name}.onnx"), SampleReader([sample]),
                activation_type=activation,
            )  # fmt: skip
    models = folder / "models"
    truth = {
        "full": graphscan.check(
            str(models / "full.onnx"),
            float_path=str(models / "fp32.onnx"),
            inputs=[str(folder / "lab_sample.npz")],
            min_sqnr=-1000,
            min_int8=0,
            max_islands=1000,
            metric="cosine",
            min_metric=-1,
        ),
        "cnn.s8": graphscan.check(str(models / "cnn.s8.onnx"), min_int8=0, max_crossings=1000),
        "cnn.u8": graphscan.check(str(models / "cnn.u8.onnx"), min_int8=0, max_crossings=1000),
    }
    value = {m: {b["name"]: b["value"] for b in answer["budgets"]} for m, answer in truth.items()}
    islands = graphscan.islands(str(models / "matmul_only.onnx"))["island_count"]
    config = f"""
# the lab: everything holds at the measured value
[[model]]
path = "models/full.onnx"
float = "models/fp32.onnx"
inputs = ["lab_sample.npz"]
max_islands = {value["full"]["max_islands"]}
min_int8 = {value["full"]["min_int8"]!r}
min_sqnr = {value["full"]["min_sqnr"] - 0.01!r}
metric = "cosine"
min_metric = {value["full"]["min_metric"] - 1e-6!r}

# one broken budget, on purpose
[[model]]
path = "models/matmul_only.onnx"
max_islands = {islands - 1}
max_float = {2 * DEFAULT_LAB.layers}

[[model]]
path = "models/cnn.s8.onnx"
min_int8 = {value["cnn.s8"]["min_int8"]!r}
max_crossings = {value["cnn.s8"]["max_crossings"]}
snapshot = true

[[model]]
path = "models/cnn.u8.onnx"
min_int8 = {min(1.0, value["cnn.u8"]["min_int8"] + 0.01)!r}
snapshot = true
"""
    (folder / "graphscan.toml").write_text(config)
    expected = {
        "graphscan.toml::full.onnx::max_islands": "passed",
        "graphscan.toml::full.onnx::min_int8": "passed",
        "graphscan.toml::full.onnx::min_sqnr": "passed",
        "graphscan.toml::full.onnx::min_metric": "passed",
        "graphscan.toml::matmul_only.onnx::max_float": "passed",
        "graphscan.toml::matmul_only.onnx::max_islands": "failed",
        "graphscan.toml::cnn.s8.onnx::max_crossings": "passed",
        "graphscan.toml::cnn.s8.onnx::min_int8": "passed",
        "graphscan.toml::cnn.s8.onnx::snapshot": "passed",
        "graphscan.toml::cnn.u8.onnx::min_int8": "failed",
        "graphscan.toml::cnn.u8.onnx::snapshot": "passed",
    }
    return {"folder": folder, "expected": expected, "islands": islands}


@pytest.fixture
def run_pytest(pytester, monkeypatch):
    """``run(folder, *args)``: pytest in ``folder``, in this process (pytester's run, which
    restores every module and option after it), the plugin loaded with -p:
    ``(exit code, output)``."""

    def run(folder, *args):
        monkeypatch.chdir(folder)
        result = pytester.runpytest("-p", "graphscan_pytest", "-p", "no:cacheprovider", *args)
        return int(result.ret), "\n".join(result.outlines + result.errlines)

    return run


def item_outcomes(output):
    """``{item id: outcome}`` from ``-rA``'s summary lines (``PASSED id`` / ``FAILED id - ...``)."""
    found = {}
    for line in output.splitlines():
        for outcome in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(outcome + " "):
                found[line[len(outcome) + 1 :].split(" - ")[0].strip()] = outcome.lower()
    return found


def test_each_budget_is_an_item_that_passes_or_fails_as_graphscan_check_says(repository, run_pytest):
    folder = repository["folder"]
    run_pytest(folder, "--graphscan", "--snapshot-update")  # takes the snapshots first
    snapshot = folder / "graphscan_snapshots" / "cnn.s8.onnx.json"
    taken = snapshot.read_bytes()
    pinned = json.loads(taken)
    assert pinned["onnxruntime"] and pinned["provider"] == "CPUExecutionProvider"
    node = next(name for name, entry in pinned["nodes"].items() if entry["class"] == "int8")
    pinned["nodes"][node] = {"class": "float", "reason": "mixed_types"}  # as if a class had changed
    snapshot.write_text(json.dumps(pinned))
    code, output = run_pytest(folder, "--graphscan", "-rA")
    expected = {**repository["expected"], "graphscan.toml::cnn.s8.onnx::snapshot": "failed"}
    assert item_outcomes(output) == expected, output
    assert code == 1
    islands = repository["islands"]
    assert f"max_islands: {islands} > {islands - 1} (float islands)" in output  # a sentence, no traceback
    assert "Traceback" not in output and "def runtest" not in output
    assert "nodes that run a kernel run int8 kernels" in output
    assert f"{node}: float (mixed_types) -> int8" in output and "1 node(s) changed" in output  # a reviewable diff
    code, _ = run_pytest(folder, "--graphscan", "--graphscan-snapshot-update", "-k", "cnn.s8 and snapshot")
    assert code == 0 and snapshot.read_bytes() == taken  # accepted, and stable from run to run


def test_a_snapshot_names_each_change_and_refuses_another_onnxruntime():
    pinned = {
        "onnxruntime": "1.32.0", "provider": "CPUExecutionProvider", "level": "extended",
        "nodes": {"a": {"class": "int8", "reason": None}, "b": {"class": "float", "reason": "mixed_types"}},
    }  # fmt: skip
    same = json.loads(json.dumps(pinned))
    assert graphscan_pytest.snapshot_verdict(pinned, same, "m.json") is None
    moved = {**same, "nodes": {"a": {"class": "float", "reason": "no_kernel"}, "c": {"class": "int8", "reason": None}}}
    verdict = graphscan_pytest.snapshot_verdict(pinned, moved, "m.json")
    assert verdict.splitlines() == [
        "snapshot: 3 node(s) changed what they run (m.json; accept with --snapshot-update)",
        "  a: int8 -> float (no_kernel)",
        "  b: float (mixed_types) -> (absent)",
        "  c: (absent) -> int8",
    ]
    for key, value in (("onnxruntime", "1.31.0"), ("provider", "CUDAExecutionProvider"), ("level", "all")):
        verdict = graphscan_pytest.snapshot_verdict({**pinned, key: value}, same, "m.json")
        assert f"taken with {key} {value}, this session has {same[key]}" in verdict


def test_without_the_flag_nothing_is_collected(repository, run_pytest):
    code, output = run_pytest(repository["folder"], "--collect-only", "-q")
    assert code == 5 and "graphscan.toml" not in output  # no tests: the plugin added none


@pytest.mark.parametrize(
    ("body", "line", "words"),
    [
        ('path = "models/full.onnx"\nmax_islnds = 3', 3, "unknown key 'max_islnds'"),
        ('path = "models/full.onnx"\nmax_islands = "3"', 3, "max_islands must be int"),
        ('path = "models/gone.onnx"\nmax_islands = 3', 2, "no such file 'models/gone.onnx'"),
        ('path = "models/full.onnx"\nmin_sqnr = 3', 3, "min_sqnr needs float"),
        ('path = "models/full.onnx"\nmax_islands = -1', 3, "whole number >= 0"),
        ('path = "models/full.onnx"\nmin_metric = 0.5\nfloat = "models/fp32.onnx"', 3, "needs metric"),
    ],
    ids=["unknown-key", "wrong-type", "missing-file", "needs-float", "negative", "needs-metric"],
)
def test_a_bad_config_names_file_line_and_key(repository, body, line, words, tmp_path):
    for name in ("models", "lab_sample.npz"):
        (tmp_path / name).symlink_to(repository["folder"] / name)
    (tmp_path / "bad.toml").write_text(f"[[model]]\n{body}\n")
    with pytest.raises(graphscan_pytest.ConfigError) as raised:
        graphscan_pytest.read_config(tmp_path / "bad.toml")
    assert f"bad.toml:{line}: [[model]] 1: " in str(raised.value) and words in str(raised.value)


def test_a_bad_config_is_one_collection_error(repository, run_pytest):
    folder = repository["folder"]
    (folder / "bad.toml").write_text('[[model]]\npath = "models/full.onnx"\nmax_islnds = 3\n')
    code, output = run_pytest(folder, "--graphscan", "--graphscan-config", "bad.toml")
    (folder / "bad.toml").unlink()
    assert code == 2 and output.count("ERROR collecting") == 1, output
    assert "bad.toml:3: [[model]] 1: unknown key 'max_islnds'" in output and "Traceback" not in output


def test_the_fixture_answers_in_process_cached_by_file_content(repository, tmp_path, run_pytest):
    folder = repository["folder"]
    (folder / "test_hand.py").write_text(
        "import shutil\n"
        "def test_hand(graphscan, tmp_path):\n"
        "    first = graphscan.runtime('models/cnn.s8.onnx')\n"
        "    shutil.copy('models/cnn.s8.onnx', tmp_path / 'copy.onnx')\n"
        "    assert graphscan.runtime(tmp_path / 'copy.onnx') is first  # the same bytes: one answer\n"
        "    assert graphscan.runtime('models/cnn.u8.onnx') is not first\n"
        "    answer = graphscan.check('models/full.onnx', float='models/fp32.onnx', min_sqnr=-100)\n"
        "    assert answer['ok'] and answer['float'].endswith('fp32.onnx')\n"
        f"    assert graphscan.islands('models/matmul_only.onnx')['island_count'] == {repository['islands']}\n"
    )
    code, output = run_pytest(folder, "test_hand.py")
    (folder / "test_hand.py").unlink()
    assert code == 0, output


def test_the_plugin_imports_nothing_heavy_until_asked():
    """Loaded by every pytest run once installed: its import costs the standard library only."""
    heavy = "('onnx', 'onnxruntime', 'numpy', 'graphscan')"
    probe = f"import sys, graphscan_pytest; print(sorted(m for m in {heavy} if m in sys.modules))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert proc.stdout.strip() == "[]", proc.stderr
    assert list(graphscan.BUDGETS) == graphscan_pytest.BUDGET_KEYS  # one list of budgets


@pytest.mark.skipif(os.name != "posix", reason="venv layout with bin/")
def test_after_pip_install_the_entry_point_gates_the_repository(repository, fresh_install, run_pytest):
    """``pip install .`` into a fresh venv: ``pytest --graphscan -n 2`` there finds the plugin
    by its pytest11 entry point (no -p), and passes and fails exactly the expected items."""
    bin_dir = fresh_install
    folder = repository["folder"]
    run_pytest(folder, "--graphscan", "--snapshot-update")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(bin_dir / "python"), "-m", "pytest", "--graphscan", "-n", "2", "-rA", "-p", "no:cacheprovider"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert item_outcomes(proc.stdout) == repository["expected"], proc.stdout + proc.stderr
    assert proc.returncode == 1


def test_the_plugin_registers_once_when_its_entry_point_is_also_visible(repository, run_pytest, tmp_path, monkeypatch):
    """``pip install .`` in a clone leaves ``graphscan.egg-info`` beside the tests (or installs
    the dist): pytest then finds the pytest11 entry point as well as ``-p graphscan_pytest``,
    in either order of the README's commands. The one module registers once and gates as alone."""
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["entry-points"]
    dist = tmp_path / "site" / "graphscan-0.0.dist-info"  # what pip writes, with pyproject's own entry points
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: graphscan\nVersion: 0.0\n")
    lines = [f"{name} = {target}" for name, target in entry_points["pytest11"].items()]
    (dist / "entry_points.txt").write_text("\n".join(["[pytest11]", *lines, ""]))
    monkeypatch.syspath_prepend(tmp_path / "site")
    code, output = run_pytest(repository["folder"], "--graphscan", "-rA", "-k", "not snapshot")
    expected = {item: outcome for item, outcome in repository["expected"].items() if "snapshot" not in item}
    assert item_outcomes(output) == expected, output
    assert code == 1 and "already registered" not in output


def test_the_readmes_config_is_valid_and_gates_as_it_says(tmp_path, build_case, run_pytest):
    """README's "Gate your models in pytest" graphscan.toml, copied as a user would, with the
    lab's models at its paths: one item per budget and the snapshot, every one run."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    config = text.split("## Gate your models in pytest", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "graphscan.toml").write_text(config)
    lab = build_case(DEFAULT_LAB)
    (tmp_path / "models").mkdir()
    (tmp_path / "samples").mkdir()
    shutil.copy(lab["full"], tmp_path / "models" / "det.int8.onnx")
    shutil.copy(lab["fp32"], tmp_path / "models" / "det.onnx")
    np.savez(tmp_path / "samples" / "page0.npz", x=np.ones((2, DEFAULT_LAB.dim), np.float32))
    code, output = run_pytest(tmp_path, "--graphscan", "-rA")  # no snapshot taken: that item fails, saying so
    budgets = ["max_islands", "max_crossings", "min_int8", "min_sqnr", "min_metric", "snapshot"]
    assert set(item_outcomes(output)) == {f"graphscan.toml::det.int8.onnx::{b}" for b in budgets}, output
    assert "error" not in item_outcomes(output).values() and code in (0, 1)


def test_the_snapshot_file_is_syrupys_json_and_the_same_without_syrupy(monkeypatch):
    snapshot = {
        "level": "extended",
        "nodes": {"b": {"class": "int8", "reason": None}},
        "onnxruntime": "1",
        "provider": "p",
    }
    with_syrupy = graphscan_pytest.snapshot_text(snapshot)
    from syrupy.extensions.json import JSONSnapshotExtension

    assert with_syrupy.rstrip("\n") == str(JSONSnapshotExtension().serialize(snapshot)).rstrip("\n")
    monkeypatch.setitem(sys.modules, "syrupy.extensions.json", None)  # as if syrupy were not installed
    assert graphscan_pytest.snapshot_text(snapshot) == with_syrupy
