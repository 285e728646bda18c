"""Every ONNX file that ships inside the installed onnx package, through graphscan.

onnx's backend test data (``onnx/backend/test/data``: model-zoo "light" models,
PyTorch exports, hand-made "simple" graphs with sequences, strings and training
ops) is a corpus of real files nobody shaped for graphscan. Each file must get
SPEC.md's keys from the four single-model commands and ``diff``, a JSON answer
that round-trips, and the laws of STYLE.md's "Invariants over examples". A few
are also run as a process, and a few are quantized with onnxruntime so the
QDQ laws are checked on graphs other than the lab's MLP.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import graphscan
from conftest import (
    ISLAND_KEYS,
    PER_ISLAND_KEYS,
    SINGLE_MODEL_COMMANDS,
    SPEC_KEYS,
    assert_counts_are_integers,
)

GRAPHSCAN = str(Path(__file__).resolve().parent.parent / "graphscan.py")
CORPUS_ROOT = Path(onnx.__file__).parent / "backend" / "test" / "data"
CORPUS = sorted(CORPUS_ROOT.rglob("*.onnx"))

DELTA_KEYS = SPEC_KEYS["diff"][3:]

# A handful run as a real process: one or two per folder, odd ones included
# (a 1746-node zoo model, string inputs, sequence ops, a training-domain op).
SUBPROCESS_SAMPLE = [
    "light/light_densenet121.onnx",
    "pytorch-converted/test_Conv2d/model.onnx",
    "pytorch-operator/test_operator_params/model.onnx",
    "simple/test_gradient_of_add_and_mul/model.onnx",
    "simple/test_strnorm_model_monday_casesensintive_lower/model.onnx",
]
# Quantized with onnxruntime's quantize_static (QDQ). test_Tanh is kept on
# purpose: onnxruntime 1.32's quantizer raises on it, so the skip path is exercised.
QUANTIZE_SAMPLE = [
    "light/light_bvlc_alexnet.onnx",
    "light/light_squeezenet.onnx",
    "pytorch-converted/test_BatchNorm2d_eval/model.onnx",
    "pytorch-converted/test_Conv2d/model.onnx",
    "pytorch-converted/test_Linear/model.onnx",
    "pytorch-converted/test_Tanh/model.onnx",
    "pytorch-operator/test_operator_addmm/model.onnx",
    "pytorch-operator/test_operator_mm/model.onnx",
]
CALIBRATION_BATCHES = 2


def corpus_id(path):
    return path.relative_to(CORPUS_ROOT).as_posix()


def corpus_params(paths=CORPUS):
    return [pytest.param(path, id=corpus_id(path)) for path in paths]


def sample_paths(relatives):
    return [CORPUS_ROOT / relative for relative in relatives]


# --------------------------------------------------------------------------
# Checks shared by the corpus and its quantized copies


def assert_spec_shape(command, answer):
    """SPEC.md's keys at every level, integer counts, and a JSON round trip."""
    assert sorted(answer) == sorted(SPEC_KEYS[command])
    for entry in answer.get("islands", []):
        assert sorted(entry) == sorted(ISLAND_KEYS)
    for entry in answer.get("per_island", []):
        assert sorted(entry) == sorted(PER_ISLAND_KEYS)
    assert_counts_are_integers(answer)
    text = json.dumps(answer)
    assert json.loads(text) == answer


def answers_of(path):
    """The four single-model answers and ``diff(path, path)``, each SPEC-shaped."""
    path = str(path)
    answers = {command: getattr(graphscan, command)(path) for command in SINGLE_MODEL_COMMANDS}
    answers["diff"] = graphscan.diff(path, path)
    for command, answer in answers.items():
        assert_spec_shape(command, answer)
    return answers


def assert_invariants(answers):
    """The laws every model obeys, whatever its origin."""
    nodes, qdq, islands, boundary = (answers[c] for c in SINGLE_MODEL_COMMANDS)

    assert nodes["nodes"] == sum(nodes["op_types"].values())
    assert nodes["nodes"] == islands["compute"] + qdq["quantize"] + qdq["dequantize"]
    assert islands["wrapped"] + islands["float"] == islands["compute"]
    assert islands["island_count"] == len(islands["islands"]) == boundary["island_count"]
    assert sum(entry["size"] for entry in islands["islands"]) == islands["float"]
    assert boundary["crossings"] == sum(
        entry["in_dequantize"] + entry["out_quantize"] for entry in boundary["per_island"]
    )
    assert 0 <= qdq["round_trips"] <= qdq["quantize"]
    assert 0 <= qdq["weight_dequantize"] <= qdq["dequantize"]

    for entry in islands["islands"]:
        assert entry["nodes"] == sorted(entry["nodes"])
        assert entry["size"] == len(entry["nodes"]) > 0
        assert entry["op_types"] == sorted(entry["op_types"])
        assert len(entry["op_types"]) == entry["size"]
    firsts = [entry["nodes"][0] for entry in islands["islands"]]
    assert firsts == sorted(firsts)
    # boundary lists the same islands in the same order.
    assert [e["nodes"] for e in boundary["per_island"]] == [e["nodes"] for e in islands["islands"]]

    same = answers["diff"]
    assert same["op_delta"] == {}
    assert all(same[key] == 0 for key in DELTA_KEYS)


# --------------------------------------------------------------------------
# 1. The whole corpus, in-process


def test_corpus_is_present():
    """The corpus comes from the pinned onnx wheel; an empty glob must not pass silently."""
    folders = {path.relative_to(CORPUS_ROOT).parts[0] for path in CORPUS}
    assert {"light", "pytorch-converted", "pytorch-operator", "simple"} <= folders
    assert len(CORPUS) >= 100
    for relative in SUBPROCESS_SAMPLE + QUANTIZE_SAMPLE:
        assert (CORPUS_ROOT / relative).is_file(), relative


@pytest.mark.parametrize("path", corpus_params())
def test_corpus_file_answers_and_invariants(path):
    answers = answers_of(path)
    for command in SINGLE_MODEL_COMMANDS:
        assert answers[command]["model"] == str(path)
    assert (answers["diff"]["a"], answers["diff"]["b"]) == (str(path), str(path))
    assert_invariants(answers)
    # The counted nodes are exactly the top-level graph's nodes.
    model = onnx.load(str(path), load_external_data=False)
    assert answers["nodes"]["nodes"] == len(model.graph.node)
    assert sum(answers["nodes"]["initializers"].values()) == len(model.graph.initializer)


# --------------------------------------------------------------------------
# 2. A sample as a real process


@pytest.mark.parametrize("command", SINGLE_MODEL_COMMANDS)
@pytest.mark.parametrize("path", corpus_params(sample_paths(SUBPROCESS_SAMPLE)))
def test_corpus_sample_as_a_process(path, command, tmp_path):
    proc = subprocess.run(
        [sys.executable, GRAPHSCAN, command, str(path)],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    report = f"exit {proc.returncode}\nstdout: {proc.stdout[:500]!r}\nstderr: {proc.stderr!r}"
    assert proc.returncode == 0, report
    assert proc.stderr == b"", report
    text = proc.stdout.decode("utf-8")
    assert text.endswith("\n") and text.count("\n") == 1, report
    answer = json.loads(text)
    assert_spec_shape(command, answer)
    assert answer == getattr(graphscan, command)(str(path))


# --------------------------------------------------------------------------
# 3. A sample quantized by onnxruntime: the QDQ laws on foreign graphs


def input_shape(value_info):
    """Concrete shape of a graph input: symbolic or unknown dimensions become 1."""
    dims = value_info.type.tensor_type.shape.dim
    return [dim.dim_value if dim.HasField("dim_value") and dim.dim_value > 0 else 1 for dim in dims]


def calibration_reader(model, seed=0):
    """A new, seeded CalibrationDataReader of random float inputs (a consumed reader is empty)."""
    from onnxruntime.quantization import CalibrationDataReader

    initializers = {init.name for init in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]

    class RandomReader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(seed)
            self._batches = iter(
                [
                    {i.name: rng.standard_normal(input_shape(i)).astype(np.float32) for i in inputs}
                    for _ in range(CALIBRATION_BATCHES)
                ]
            )

        def get_next(self):
            return next(self._batches, None)

    return RandomReader()


def brief(exc):
    """An exception's first line, cut in the middle if long (onnxruntime's cause comes last)."""
    line = graphscan.one_line(exc)
    return line if len(line) <= 240 else f"{line[:80]} ... {line[-150:]}"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Factory: a corpus file quantized (static, QDQ) into a tmp folder, or a skip reason.

    Module-scoped so each file is quantized once; the reason is kept too, so a
    file the quantizer refuses is skipped with the quantizer's own message.
    """
    built = {}

    def build(path):
        if path not in built:
            from onnxruntime.quantization import QuantFormat, quantize_static

            model = onnx.load(str(path))
            initializers = {init.name for init in model.graph.initializer}
            kinds = {
                i.type.tensor_type.elem_type
                for i in model.graph.input
                if i.name not in initializers
            }
            if kinds - {onnx.TensorProto.FLOAT}:
                built[path] = (None, f"non-float graph inputs {sorted(kinds)}")
            else:
                target = tmp_path_factory.mktemp("quantized") / "model.onnx"
                try:
                    quantize_static(
                        str(path),
                        str(target),
                        calibration_reader(model),
                        quant_format=QuantFormat.QDQ,
                    )
                    built[path] = (target, None)
                except Exception as exc:  # the quantizer's limits are not graphscan's
                    reason = f"quantize_static raised {type(exc).__name__}: {brief(exc)}"
                    built[path] = (None, reason)
        return built[path]

    return build


@pytest.mark.parametrize("path", corpus_params(sample_paths(QUANTIZE_SAMPLE)))
def test_quantized_corpus_invariants(path, quantized):
    target, reason = quantized(path)
    if target is None:
        pytest.skip(reason)
    answers = answers_of(target)
    assert_invariants(answers)
    qdq = answers["qdq"]
    # onnxruntime wraps every quantized activation in one Q->DQ pair and stores
    # weights already quantized: the DQs that are not weights are the round trips.
    assert qdq["dequantize"] - qdq["weight_dequantize"] == qdq["round_trips"]

    before = answers_of(path)
    forward = graphscan.diff(str(path), str(target))
    backward = graphscan.diff(str(target), str(path))
    assert_spec_shape("diff", forward)
    assert backward["op_delta"] == {op: -d for op, d in forward["op_delta"].items()}
    for key in DELTA_KEYS:
        assert backward[key] == -forward[key], key
    assert forward["quantize_delta"] == qdq["quantize"] - before["qdq"]["quantize"]
    assert forward["dequantize_delta"] == qdq["dequantize"] - before["qdq"]["dequantize"]
    assert forward["float_delta"] == answers["islands"]["float"] - before["islands"]["float"]
    assert forward["island_delta"] == (
        answers["islands"]["island_count"] - before["islands"]["island_count"]
    )
