"""Every ONNX file that ships inside the installed onnx package, through graphscan.

onnx's backend test data (``onnx/backend/test/data``: model-zoo "light" models,
PyTorch exports, hand-made "simple" graphs with sequences, strings and training
ops) is a corpus of real files nobody shaped for graphscan. Each file must get
SPEC.md's keys from the four single-model commands and ``diff``, a JSON answer
that round-trips, and the laws of STYLE.md's "Invariants over examples". A few
are also run as a process, and a few are quantized with onnxruntime so the
QDQ laws are checked on graphs other than the lab's MLP.
"""

from pathlib import Path

import onnx
import pytest

import gen_models
import graphscan
from tests.helpers import (
    DELTA_KEYS,
    SINGLE_MODEL_COMMANDS,
    assert_laws,
    assert_spec_shape,
    json_answer,
    negated,
    run_graphscan,
)
from tests.reference import reference_of

CORPUS_ROOT = Path(onnx.__file__).parent / "backend" / "test" / "data"
CORPUS = sorted(CORPUS_ROOT.rglob("*.onnx"))

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
CALIBRATION_BATCHES = 2  # a corpus model is quantized to check laws, not accuracy


def corpus_id(path):
    return path.relative_to(CORPUS_ROOT).as_posix()


def corpus_params(paths=CORPUS):
    return [pytest.param(path, id=corpus_id(path)) for path in paths]


def sample_paths(relatives):
    return [CORPUS_ROOT / relative for relative in relatives]


# --------------------------------------------------------------------------
# Checks shared by the corpus and its quantized copies


def answers_of(path):
    """The four single-model answers and ``diff(path, path)``, each SPEC-shaped."""
    path = str(path)
    answers = {command: getattr(graphscan, command)(path) for command in SINGLE_MODEL_COMMANDS}
    answers["diff"] = graphscan.diff(path, path)
    for command, answer in answers.items():
        assert_spec_shape(command, answer)
    return answers


def assert_invariants(answers):
    """The laws every model obeys, whatever its origin, and diff(m, m) all zero."""
    assert_laws(answers)
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
    answer = json_answer(run_graphscan([command, path], cwd=tmp_path))
    assert_spec_shape(command, answer)
    assert answer == getattr(graphscan, command)(str(path))


# --------------------------------------------------------------------------
# 3. A sample quantized by onnxruntime: the QDQ laws on foreign graphs


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
            kinds = {i.type.tensor_type.elem_type for i in model.graph.input if i.name not in initializers}
            if kinds - {onnx.TensorProto.FLOAT}:
                built[path] = (None, f"non-float graph inputs {sorted(kinds)}")
            else:
                target = tmp_path_factory.mktemp("quantized") / "model.onnx"
                try:
                    quantize_static(
                        str(path),
                        str(target),
                        gen_models.calibration_reader(gen_models.input_shapes(model, batch=1), 0, CALIBRATION_BATCHES),
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
    expected = reference_of(target)
    for command in SINGLE_MODEL_COMMANDS:
        assert answers[command] == {"model": str(target), **expected[command]}, command
    qdq = answers["qdq"]
    # onnxruntime wraps every quantized activation in one Q->DQ pair and stores
    # weights already quantized: the DQs that are not weights are the round trips.
    assert qdq["dequantize"] - qdq["weight_dequantize"] == qdq["round_trips"]

    before = answers_of(path)
    forward = graphscan.diff(str(path), str(target))
    backward = graphscan.diff(str(target), str(path))
    assert_spec_shape("diff", forward)
    assert backward == negated(forward)
    assert forward["quantize_delta"] == qdq["quantize"] - before["qdq"]["quantize"]
    assert forward["dequantize_delta"] == qdq["dequantize"] - before["qdq"]["dequantize"]
    assert forward["float_delta"] == answers["islands"]["float"] - before["islands"]["float"]
    assert forward["island_delta"] == (answers["islands"]["island_count"] - before["islands"]["island_count"])
