"""check --cpu: the budgets that run the model, measured as a CPU target computes them
and trace --cpu, the rows as the target computes them with the operators whose numbers differ.

Without an install the fast tests hold the option's contract: ``native`` is today's
answer byte for byte, a missing or unknown target is one line, ``--cpu`` without a
budget that runs the model is refused. The ``targets`` tests (``pytest -m targets -p
no:xdist``, after ``python -m graphscan_ort.shared.targets install``) take their
expectations from runtime's own answer on that target and from plain onnxruntime
sessions opened inside it (tests/targets/probe.py).
"""

import json
import os
import platform
import re
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphscan
from graphscan_ort.commands import check as check_module
from graphscan_ort.engines import kernel_numbers
from graphscan_ort.shared import targets
from graphscan_ort.shared.options import Named
from tests import odd_outputs
from tests.helpers import main_error_line, run_main
from tests.targets.test_targets import INSTALL, MACHINES, empty_bin, fake_tools, host_has_vnni, needs

FLOAT, QUANT = "ops/fp32.onnx", "ops/full.onnx"
# Every budget that runs a model, each with what it needs.
MEASURED = [
    pytest.param(["--min-int8", "0.1"], id="min-int8"),
    pytest.param(["--float", FLOAT, "--min-sqnr", "10"], id="min-sqnr"),
    pytest.param(["--float", FLOAT, "--min-levels", "2"], id="min-levels"),
    pytest.param(["--float", FLOAT, "--min-metric", "0.5", "--metric", "cosine"], id="min-metric"),
]
ALL_MEASURED = ["--float", FLOAT, "--min-int8", "0.1", "--min-sqnr", "10", "--min-levels", "2"]
ALL_MEASURED += ["--min-metric", "0.5", "--metric", "cosine"]


def test_native_is_the_answer_without_cpu_byte_for_byte(capsys):
    """``--cpu native`` changes nothing: the same bytes, no ``cpu`` key."""
    plain = run_main(capsys, ["check", QUANT, *ALL_MEASURED])
    native = run_main(capsys, ["check", QUANT, *ALL_MEASURED, "--cpu", "native"])
    assert plain == native and plain[0] == 0, plain
    answer = json.loads(plain[1])
    assert "cpu" not in answer and [b["name"] for b in answer["budgets"]] == [
        "min_int8",
        "min_sqnr",
        "min_levels",
        "min_metric",
    ]


# every command line that runs a model on a target: check's budgets, and trace
ON_A_TARGET = [pytest.param(["check", QUANT, *p.values[0]], id=f"check-{p.id}") for p in MEASURED]
ON_A_TARGET += [pytest.param(["trace", FLOAT, QUANT], id="trace")]


@pytest.mark.parametrize("argv", ON_A_TARGET)
@pytest.mark.parametrize(
    ("target", "tools", "what"),
    [
        pytest.param("arm64", ["qemu-aarch64"], "the arm64 Python is not installed", id="arm64-not-installed"),
        pytest.param("x86-avx2", [], "qemu-x86_64 is not installed", id="x86-avx2-without-qemu"),
    ],
)
def test_a_missing_target_names_the_install_command(capsys, monkeypatch, tmp_path, argv, target, tools, what):
    monkeypatch.setenv("GRAPHSCAN_TARGETS", str(tmp_path / "none"))
    folder = empty_bin(tmp_path)
    fake_tools(folder, *tools)
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    line = main_error_line(capsys, [*argv, "--cpu", target], graphscan.EXIT_USAGE)
    assert re.fullmatch(rf"graphscan: usage: CPU target {target}: {what}.*\(install it: {INSTALL}\)", line), line


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            lambda capsys: main_error_line(capsys, ["check", QUANT, "--min-int8", "0", "--cpu", "sparc"], 2),
            id="command-line",
        ),
        pytest.param(lambda capsys: in_process_error(cpu="sparc", min_int8=0.0), id="in-process"),
    ],
)
def test_an_unknown_target_is_a_usage_error_naming_the_targets(capsys, call):
    line = call(capsys)
    assert re.search(r"argument (--cpu|cpu=): invalid choice: 'sparc'", line), line
    assert all(name in line for name in targets.TARGETS), line


def in_process_error(**keywords):
    with pytest.raises(graphscan.GraphscanError) as raised:
        graphscan.check(QUANT, **keywords)
    assert raised.value.exit_code == graphscan.EXIT_USAGE
    return str(raised.value)


@pytest.mark.parametrize("target", [pytest.param(t, id=t) for t in targets.TARGETS if t != targets.NATIVE])
def test_cpu_without_a_budget_that_runs_the_model_is_refused(capsys, target):
    """The graph's counts are the same on every CPU: a target there would be ignored, so it is refused."""
    line = main_error_line(capsys, ["check", QUANT, "--max-float", "3", "--cpu", target], graphscan.EXIT_USAGE)
    assert line == "graphscan: usage: --cpu: only with --min-int8, --min-sqnr, --min-levels or --min-metric"


def test_checks_help_names_every_target():
    """The core declares --cpu without importing the targets: its help must still name them all."""
    words = dict(graphscan.CHECK.flat_options())["--cpu"]["help"]
    assert all(re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", words) for name in targets.TARGETS), words


# -- trace --cpu: the target's rows, and where its kernels compute other numbers


def test_trace_native_is_the_answer_without_cpu(capsys):
    plain = run_main(capsys, ["trace", FLOAT, QUANT])
    assert plain == run_main(capsys, ["trace", FLOAT, QUANT, "--cpu", "native"]) and plain[0] == 0, plain


def native_trace_folder(tmp_path):
    """The U8S8 conv pair traced natively with --save: its single-op models and their outputs here."""
    float_path, quant_path = qdq_conv(tmp_path)
    folder, feeds = tmp_path / "ops", tmp_path / "x.npz"
    np.savez(feeds, x=np.random.default_rng(1).normal(0, 0.5, (1, 64, 16, 16)).astype(np.float32))
    graphscan.trace(float_path, quant_path, inputs=str(feeds), save=str(folder))
    native = tmp_path / "native.npz"
    assert kernel_numbers.saved_outputs(str(folder), str(native)) == 1
    return float_path, quant_path, feeds, folder, native


@pytest.mark.parametrize(
    ("target", "lsb", "count", "cause"),
    [
        pytest.param("x86-avx2", 1, 5, kernel_numbers.U8S8_CAUSE, id="x86-avx2-one-lsb"),
        pytest.param("x86-avx2", 3, 1, kernel_numbers.U8S8_CAUSE, id="x86-avx2-three-lsb"),
        pytest.param("arm64", 2, 7, None, id="arm64-no-known-cause"),
    ],
)
def test_differences_are_counted_in_steps_of_the_output_scale(tmp_path, target, lsb, count, cause):
    """A target's outputs moved by ``lsb`` steps of the output's scale (0.2) on ``count`` values:
    exactly those are reported, with the U8S8 cause only for a U8S8 Conv on x86 without VNNI."""
    *_, folder, native = native_trace_folder(tmp_path)
    with np.load(native) as saved:
        moved = {stem: saved[stem].copy() for stem in saved.files}
    stem = json.loads((folder / "index.json").read_text())["conv"]
    flat = moved[stem].reshape(-1)
    flat[np.arange(count) * 37] += np.float32(lsb * 0.2)
    there = tmp_path / "there.npz"
    np.savez(there, **moved)
    rows = kernel_numbers.differences(str(folder), str(native), str(there), target, {"conv": "Conv"})
    assert [(r["node"], r["op_type"], r["values"], r["differing"]) for r in rows] == [("conv", "Conv", 16384, count)]
    assert rows[0]["max_lsb"] == pytest.approx(lsb, abs=1e-5) and rows[0]["max_abs"] == pytest.approx(lsb * 0.2)
    assert rows[0]["cause"] == cause and (rows[0]["remedy"] is None) == (cause is None)


def single_conv(activation, weight):
    """A single-op model as trace saves one: input Q->DQ of ``activation``'s type, weight DQ of
    ``weight``'s, the Conv, output Q->DQ."""
    zero = {TensorProto.UINT8: np.uint8(128), TensorProto.INT8: np.int8(0)}
    kinds = {TensorProto.UINT8: np.uint8, TensorProto.INT8: np.int8}
    initializers = [
        numpy_helper.from_array(np.ones((2, 2, 1, 1), kinds[weight]), "wq"),
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(zero[weight]), "wz"),
        numpy_helper.from_array(np.array(zero[activation]), "xz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "s", "wz"], ["wd"]),
        helper.make_node("Conv", ["xd", "wd"], ["c"], "conv"),
        helper.make_node("QuantizeLinear", ["c", "s", "xz"], ["cq"]),
        helper.make_node("DequantizeLinear", ["cq", "s", "xz"], ["y"]),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 3, 3]) for n in ("x", "y")]
    return helper.make_model(helper.make_graph(nodes, "conv", io[:1], io[1:], initializers))


@pytest.mark.parametrize(
    ("activation", "weight", "target", "known"),
    [
        pytest.param(TensorProto.UINT8, TensorProto.INT8, "x86-avx2", True, id="u8s8-x86-avx2"),
        pytest.param(TensorProto.INT8, TensorProto.INT8, "x86-avx2", True, id="s8s8-x86-avx2-runs-as-u8s8"),
        pytest.param(TensorProto.UINT8, TensorProto.UINT8, "x86-avx2", False, id="u8u8-no-saturation"),
        pytest.param(TensorProto.UINT8, TensorProto.INT8, "arm64", False, id="u8s8-arm64-sums-in-32-bits"),
    ],
)
def test_the_known_cause_is_eight_bit_activations_times_int8_weights_on_x86_avx2(activation, weight, target, known):
    cause, remedy = kernel_numbers.known_cause(single_conv(activation, weight), target)
    assert (cause, remedy) == ((kernel_numbers.U8S8_CAUSE, kernel_numbers.U8S8_REMEDY) if known else (None, None))


@pytest.mark.parametrize(
    ("native_value", "target_value", "differing"),
    [
        pytest.param(np.nan, np.nan, 0, id="nan-on-both-is-no-difference"),
        pytest.param(1.0, np.nan, 1, id="nan-on-the-target-differs"),
        pytest.param(np.inf, 1.0, 1, id="infinity-against-a-number-differs"),
    ],
)
def test_a_nan_in_both_is_no_difference_and_a_lone_nan_has_no_size(tmp_path, native_value, target_value, differing):
    """One value set on each side: a NaN in both is the same number; a NaN or an infinity
    against a number differs, and the row's sizes (max_abs, max_lsb) are null, never NaN."""
    *_, folder, native = native_trace_folder(tmp_path)
    stem = json.loads((folder / "index.json").read_text())["conv"]
    with np.load(native) as saved:
        here = {name: saved[name].copy() for name in saved.files}
    there = {name: value.copy() for name, value in here.items()}
    here[stem].reshape(-1)[3], there[stem].reshape(-1)[3] = native_value, target_value
    np.savez(native, **here)
    np.savez(tmp_path / "there.npz", **there)
    rows = kernel_numbers.differences(str(folder), str(native), str(tmp_path / "there.npz"), "arm64", {"conv": "Conv"})
    assert [r["differing"] for r in rows] == ([differing] if differing else [])
    assert all(r["max_abs"] is None and r["max_lsb"] is None for r in rows)


def test_equal_outputs_are_no_difference(tmp_path):
    *_, folder, native = native_trace_folder(tmp_path)
    assert kernel_numbers.differences(str(folder), str(native), str(native), "x86-avx2", {"conv": "Conv"}) == []


# -- the runner's protocol, with this interpreter standing in for a target


@pytest.fixture
def stand_in(monkeypatch):
    """``x86-avx2`` run by this interpreter without qemu: whatever check hands over in files
    (samples, both models' outputs) must come back unchanged."""

    def command(target, argv):
        return [sys.executable, *argv], dict(os.environ, PYTHONPATH=str(targets.repository()))

    monkeypatch.setattr(targets, "missing", lambda target: None)
    monkeypatch.setattr(targets, "command", command)


def test_budgets_through_the_runner_are_the_native_budgets(capsys, stand_in):
    """The same interpreter behind the runner: every value equals native's, and ``cpu``
    follows ``float`` as runtime's follows ``environment``."""
    native = json.loads(run_main(capsys, ["check", QUANT, *ALL_MEASURED])[1])
    code, out, err = run_main(capsys, ["check", QUANT, *ALL_MEASURED, "--cpu", "x86-avx2"])
    assert code == 0, err
    answer = json.loads(out)
    assert list(answer) == ["model", "float", "cpu", "budgets", "ok"]
    assert answer["cpu"] == {"name": "x86-avx2", "onnxruntime": ort.__version__, "machine": platform.machine()}
    assert answer["budgets"] == native["budgets"]


@pytest.mark.parametrize("kind", ["string", "sequence"])
@pytest.mark.parametrize("declared", [pytest.param(True, id="declared"), pytest.param(False, id="undeclared")])
def test_an_output_that_is_not_numbers_is_refused_through_the_runner_as_natively(
    capsys, stand_in, tmp_path, kind, declared
):
    """A STRING or sequence output cannot come back in an .npz: refused in the same one line
    as natively, by its declared type here or by its value in the target."""
    float_path, quant_path = tmp_path / "float.onnx", tmp_path / "quant.onnx"
    odd_outputs.odd_model(float_path, kind, False, declared)
    odd_outputs.odd_model(quant_path, kind, True, declared)
    argv = ["check", quant_path, "--float", float_path, "--min-sqnr", "20", "--inputs", odd_outputs.sample(tmp_path)]
    line = main_error_line(capsys, [*argv, "--cpu", "x86-avx2"], 2)
    assert line == main_error_line(capsys, argv, 2) == odd_outputs.refusal(float_path, kind)


def test_trace_through_the_runner_is_the_native_trace(capsys, stand_in, tmp_path):
    """The same interpreter behind the runner: trace's rows are native's, no operator differs,
    and the answer gains ``cpu`` and ``differs_from_native`` after native's keys."""
    native = json.loads(run_main(capsys, ["trace", FLOAT, QUANT])[1])
    code, out, err = run_main(capsys, ["trace", FLOAT, QUANT, "--cpu", "x86-avx2"])
    assert code == 0, err
    answer = json.loads(out)
    assert list(answer) == [*native, "cpu", "differs_from_native"]
    assert {k: answer[k] for k in native} == native and answer["differs_from_native"] == []
    assert answer["cpu"] == {"name": "x86-avx2", "onnxruntime": ort.__version__, "machine": platform.machine()}


def test_a_saved_target_answer_is_shown_with_its_cpu(capsys, tmp_path):
    answer = json.loads(run_main(capsys, ["check", QUANT, "--min-int8", "0"])[1])
    cpu = {"name": "arm64", "onnxruntime": "1", "machine": "aarch64"}
    answer = {"model": answer["model"], "float": None, "cpu": cpu}
    answer |= {"budgets": [{"name": "min_int8", "value": 1.0, "limit": 0.0, "ok": True}], "ok": True}
    saved = tmp_path / "check.json"
    saved.write_text(json.dumps(answer))
    code, out, err = run_main(capsys, ["table", saved])
    assert code == 0, err
    assert re.search(r"\bcpu arm64\b", out), out


def test_a_saved_trace_on_a_target_leads_with_what_differs(capsys, tmp_path):
    answer = json.loads(run_main(capsys, ["trace", FLOAT, QUANT])[1])
    answer["cpu"] = {"name": "x86-avx2", "onnxruntime": "1", "machine": "x86_64"}
    node = answer["ops"][0]["node"]
    row = {"node": node, "op_type": "Conv", "values": 8, "differing": 3, "max_abs": 0.5, "max_lsb": 2.0}
    answer["differs_from_native"] = [{**row, "cause": "U8S8 saturates", "remedy": "reduce_range"}]
    saved = tmp_path / "trace.json"
    saved.write_text(json.dumps(answer))
    code, out, err = run_main(capsys, ["table", saved])
    assert code == 0, err
    assert re.search(r"\bcpu x86-avx2\b", out), out
    first = out.split("\n\n")[1].splitlines()
    assert first[0] == "ops whose numbers differ on x86-avx2 from native"
    assert first[2].split()[:4] == [node, "Conv", "3", "2"] and "U8S8 saturates" in first[2], first


# -- on the targets themselves (pytest -m targets)


def int8_share(nodes):
    """check's min_int8 by its definition: of the nodes that run a kernel, those running int8 or int8_data."""
    running = [n for n in nodes if n["class"] != "absorbed"]
    return sum(n["class"] in ("int8", "int8_data") for n in running) / len(running)


@pytest.mark.targets
@needs("arm64")
def test_min_int8_on_arm64_is_the_share_of_runtimes_arm64_classes(capsys):
    runtime = json.loads(run_main(capsys, ["runtime", QUANT, "--cpu", "arm64"])[1])
    code, out, err = run_main(capsys, ["check", QUANT, "--min-int8", "0", "--cpu", "arm64"])
    assert code == 0, err
    answer = json.loads(out)
    assert answer["cpu"] == {"name": "arm64", "onnxruntime": ort.__version__, "machine": MACHINES["arm64"]}
    assert answer["budgets"][0]["value"] == int8_share(runtime["nodes"])


def qdq_conv(folder, channels=64, size=16, seed=0):
    """A float Conv (64 channels, 3x3) and its QDQ form, uint8 activations and int8 weights of
    spread 40: at level all onnxruntime fuses a U8S8 QLinearConv, whose adjacent u8*s8 pairs
    overflow the 16 bits AVX2's vpmaddubsw sums them in. The Conv is named alike in both, so
    trace isolates it."""
    rng = np.random.default_rng(seed)
    weights = np.clip(np.round(rng.normal(0, 40, (channels, channels, 3, 3))), -127, 127).astype(np.int8)
    ws, shape = np.full(channels, 0.01, np.float32), [1, channels, size, size]
    conv = {"pads": [1, 1, 1, 1]}
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "y")]
    real = numpy_helper.from_array(weights.astype(np.float32) * ws[:, None, None, None], "w")
    float_conv = helper.make_node("Conv", ["x", "w"], ["y"], "conv", **conv)
    float_graph = helper.make_graph([float_conv], "f", io[:1], io[1:], [real])
    initializers = [
        numpy_helper.from_array(weights, "wq"),
        numpy_helper.from_array(ws, "ws"),
        numpy_helper.from_array(np.zeros(channels, np.int8), "wz"),
        numpy_helper.from_array(np.array(0.01, np.float32), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "xz"),
        numpy_helper.from_array(np.array(0.2, np.float32), "ys"),
        numpy_helper.from_array(np.array(128, np.uint8), "yz"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
        helper.make_node("Conv", ["xd", "wd"], ["c"], "conv", **conv),
        helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"]),
        helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"]),
    ]
    quant_graph = helper.make_graph(nodes, "q", io[:1], io[1:], initializers)
    paths = folder / "conv_fp32.onnx", folder / "conv_qdq.onnx"
    for graph, path in zip((float_graph, quant_graph), paths, strict=True):
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return str(paths[0]), str(paths[1])


def plain_outputs(target, path, feeds):
    return [np.array(values) for values in targets.run(target, "tests.targets.probe:outputs", [path, feeds])["result"]]


@pytest.mark.targets
@pytest.mark.parametrize("target", [pytest.param(t, marks=needs(t), id=t) for t in ["x86-avx2", "arm64"]])
def test_the_outputs_check_measures_on_a_target_are_a_plain_sessions(tmp_path, target):
    """The must-hold: both models' outputs behind min_sqnr and min_metric under a target
    equal, bit for bit, a default onnxruntime session opened inside that target."""
    float_path, quant_path = qdq_conv(tmp_path)
    float_model, quant_model = graphscan.load_with_weights(float_path), graphscan.load_with_weights(quant_path)
    reference, candidate = Named(float_model, float_path), Named(quant_model, quant_path)
    runs = check_module.checked_samples(reference, candidate, graphscan.Samples())
    on = graphscan.CpuTarget(target).runner()
    paired = check_module.outputs_on_target(on, reference, candidate, runs, "all")
    assert on.facts is not None and on.facts["machine"] == MACHINES[target]
    feeds = str(tmp_path / "feeds.npz")
    np.savez(feeds, **runs.samples[0])
    for path, got in ((float_path, paired.reference.outputs[0]), (quant_path, paired.candidate[0])):
        plain = plain_outputs(target, path, feeds)
        assert len(plain) == len(got)
        for expected, value in zip(plain, got, strict=True):
            np.testing.assert_array_equal(np.asarray(value, np.float64).ravel(), expected)
    if target != "x86-avx2":
        return  # arm64 sums U8S8 in 32 bits as a VNNI host does: its outputs need not differ
    if not host_has_vnni():
        pytest.skip("this host has no VNNI: it computes U8S8 as x86-avx2 does, so the outputs cannot differ")
    native = plain_outputs("native", quant_path, feeds)
    assert (native[0] != np.asarray(paired.candidate[0][0], np.float64).ravel()).any(), "the target was not used"


@pytest.mark.targets
@pytest.mark.parametrize("target", [pytest.param(t, marks=needs(t), id=t) for t in ["x86-avx2", "arm64"]])
def test_trace_on_a_target_names_the_operators_whose_numbers_differ(capsys, tmp_path, target):
    """x86 without VNNI saturates the U8S8 Conv: trace names it, with as many differing values
    and as many LSB as plain sessions of the whole model here and there show, and the known
    cause; arm64 sums in 32 bits as a VNNI host does: nothing differs."""
    float_path, quant_path = qdq_conv(tmp_path)
    feeds = str(tmp_path / "x.npz")
    np.savez(feeds, x=np.random.default_rng(1).normal(0, 0.5, (1, 64, 16, 16)).astype(np.float32))
    code, out, err = run_main(capsys, ["trace", float_path, quant_path, "--inputs", feeds, "--cpu", target])
    assert code == 0, err
    answer = json.loads(out)
    assert answer["cpu"]["machine"] == MACHINES[target] and [r["node"] for r in answer["ops"]] == ["conv"]
    if not host_has_vnni():
        pytest.skip("this host has no VNNI: it computes U8S8 as x86-avx2 does, so nothing can differ from native")
    there, here = plain_outputs(target, quant_path, feeds)[0], plain_outputs("native", quant_path, feeds)[0]
    differing = int((there != here).sum())
    if target == "arm64":
        assert differing == 0 and answer["differs_from_native"] == []
        return
    assert differing > 0
    (row,) = answer["differs_from_native"]
    assert (row["node"], row["differing"], row["cause"]) == ("conv", differing, kernel_numbers.U8S8_CAUSE)
    assert row["max_lsb"] == pytest.approx(np.abs(there - here).max() / 0.2, abs=1e-5)
