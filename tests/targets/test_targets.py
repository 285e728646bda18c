"""CPU targets: installing them, refusing when one is missing, and what runs on each.

The tests marked ``targets`` run onnxruntime under qemu (run by hand or in CI after
the suite: ``pytest -m targets -p no:xdist``); each skips, saying why, on a machine
where ``python -m graphscan_ort.shared.targets install`` has not run. Their
expectations come from plain onnxruntime sessions opened inside the target
(tests/targets/probe.py) and from integer arithmetic done in numpy, never from
graphscan's own classification.
"""

import importlib.metadata
import json
import os
import platform
import re
import stat
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphscan
from graphscan_ort.commands.runtime import differs
from graphscan_ort.shared import targets
from tests.helpers import main_error_line, run_main

INSTALL = re.escape(targets.INSTALL_COMMAND)
EMULATED = [t for t in targets.TARGETS if t != targets.NATIVE]
MACHINES = {"x86-avx2": "x86_64", "arm64": "aarch64"}


def needs(target):
    """Skip, saying why, when ``target`` is not installed on this machine."""
    problem = targets.missing(target)
    return pytest.mark.skipif(problem is not None, reason=f"{target}: {problem} ({targets.INSTALL_COMMAND})")


def empty_bin(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    return folder


def fake_tools(folder, *names):
    """Executables that only exist: ``missing`` looks tools up, it never runs them (one that
    is run fails at once, saying so)."""
    for name in names:
        tool = folder / name
        tool.write_text(f"#!/bin/sh\necho 'fake {name}' >&2\nexit 1\n")
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)


def fake_arm64(folder, versions=None):
    """An arm64 folder whose files look whole (what ``missing`` reads without starting it):
    the stamp, an executable interpreter, the ARM cpuinfo and each pinned package's
    metadata at ``versions`` (default: this environment's)."""
    versions = versions or {name: importlib.metadata.version(name) for name in targets.PINNED}
    python = folder / "sysroot" / targets.ARM64_PYTHON
    python.parent.mkdir(parents=True)
    python.write_text("")
    python.chmod(0o755)
    (folder / "cpuinfo").write_text(targets.ARM64_CPUINFO.format(i=0))
    for name, version in versions.items():
        info = folder / "site" / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (folder / targets.STAMP).write_text(json.dumps({"pins": versions}))
    return folder


# -- where the targets live


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({"GRAPHSCAN_TARGETS": "/t/here", "XDG_CACHE_HOME": "/c"}, "/t/here", id="override-wins"),
        pytest.param({"XDG_CACHE_HOME": "/c"}, "/c/graphscan/targets", id="xdg-cache-home"),
        pytest.param({"HOME": "/h"}, "/h/.cache/graphscan/targets", id="home-cache"),
        pytest.param({"GRAPHSCAN_TARGETS": "", "HOME": "/h"}, "/h/.cache/graphscan/targets", id="empty-override"),
    ],
)
def test_the_targets_folder_follows_the_environment(monkeypatch, env, expected):
    for name in ("GRAPHSCAN_TARGETS", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert str(targets.root()) == expected


# -- a missing target is one line naming the install command, exit 2


@pytest.mark.parametrize(
    ("target", "tools", "what"),
    [
        pytest.param("arm64", ["qemu-aarch64"], "the arm64 Python is not installed", id="arm64-not-installed"),
        pytest.param("arm64", [], "qemu-aarch64 is not installed", id="arm64-without-qemu"),
        pytest.param("x86-avx2", [], "qemu-x86_64 is not installed", id="x86-avx2-without-qemu"),
    ],
)
def test_runtime_on_a_missing_target_names_the_install_command(capsys, monkeypatch, tmp_path, target, tools, what):
    monkeypatch.setenv("GRAPHSCAN_TARGETS", str(tmp_path / "none"))
    folder = empty_bin(tmp_path)
    fake_tools(folder, *tools)
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    line = main_error_line(capsys, ["runtime", "ops/full.onnx", "--cpu", target], graphscan.EXIT_USAGE)
    assert re.fullmatch(rf"graphscan: usage: CPU target {target}: {what}.*\(install it: {INSTALL}\)", line), line


@pytest.mark.parametrize("target", EMULATED)
def test_an_emulated_target_is_never_timed(capsys, target):
    """Refused before anything is looked up, installed or not: emulated time is no latency."""
    line = main_error_line(capsys, ["runtime", "ops/full.onnx", "--cpu", target, "--time"], graphscan.EXIT_USAGE)
    assert "--time" in line and "latency" in line and target in line


def test_an_unknown_target_is_a_usage_error(capsys):
    line = main_error_line(capsys, ["runtime", "ops/full.onnx", "--cpu", "sparc"], graphscan.EXIT_USAGE)
    assert all(name in line for name in targets.TARGETS)


def test_native_answer_is_the_answer_without_cpu(capsys):
    """``--cpu native`` is today's runtime, byte for byte, with no key added."""
    plain = run_main(capsys, ["runtime", "ops/full.onnx"])
    native = run_main(capsys, ["runtime", "ops/full.onnx", "--cpu", "native"])
    assert plain == native and plain[0] == 0
    assert "cpu" not in json.loads(plain[1]) and "differs_from_native" not in json.loads(plain[1])


def test_targets_are_emulated_from_x86_64_only(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    for target in EMULATED:
        assert "x86-64 host" in targets.missing(target)
    assert targets.installed("native")


# -- the install command: what it needs, one line when that is missing


def install_line(capsys, code):
    assert targets.main(["install"]) == code
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith("graphscan: ")
    return captured.err.strip()


def test_install_without_apt_or_qemu_says_what_is_missing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHSCAN_TARGETS", str(tmp_path / "t"))
    monkeypatch.setenv("PATH", str(empty_bin(tmp_path)))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    line = install_line(capsys, graphscan.EXIT_USAGE)
    assert "qemu-user" in line and "apt-get is not here" in line
    assert not (tmp_path / "t").exists()


def test_install_as_a_user_says_it_needs_root(capsys, monkeypatch, tmp_path):
    tools = empty_bin(tmp_path)
    fake_tools(tools, "apt-get")
    monkeypatch.setenv("GRAPHSCAN_TARGETS", str(tmp_path / "t"))
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in install_line(capsys, graphscan.EXIT_USAGE)


def test_install_on_another_host_says_so(capsys, monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert "x86-64 host" in install_line(capsys, graphscan.EXIT_USAGE)


@pytest.mark.parametrize("argv", [pytest.param([], id="nothing"), pytest.param(["remove"], id="unknown")])
def test_the_targets_command_refuses_what_it_does_not_know(capsys, argv):
    assert targets.main(argv) == graphscan.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and targets.INSTALL_COMMAND in captured.err


def test_status_is_one_json_object_naming_every_target(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHSCAN_TARGETS", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(empty_bin(tmp_path)))  # nothing to start: status/install tests start them
    assert targets.main(["status"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert list(answer["targets"]) == list(targets.TARGETS)
    for state in answer["targets"].values():
        assert state["installed"] is (state["missing"] is None)


# -- differs_from_native, as a law


def rows(classes):
    return [{"node": f"n{i}", "op_type": "Conv", "class": kind} for i, kind in enumerate(classes)]


@pytest.mark.parametrize(
    ("native", "target"),
    [
        pytest.param(["int8", "float", None], ["int8", "float", None], id="same"),
        pytest.param(["float", "float", "int8"], ["int8", "float", "float"], id="both-ways"),
        pytest.param(["absorbed", "float"], ["int8", None], id="absorbed-and-unmapped"),
    ],
)
def test_differs_lists_exactly_the_nodes_whose_class_changed(native, target):
    changed = differs(rows(native), rows(target))
    expected = [i for i, (a, b) in enumerate(zip(native, target, strict=True)) if a != b]
    assert [change["node"] for change in changed] == [f"n{i}" for i in expected]
    assert [(c["native"], c["cpu"]) for c in changed] == [(native[i], target[i]) for i in expected]
    assert [c["node"] for c in differs(rows(target), rows(native))] == [c["node"] for c in changed]


# -- on the targets themselves (pytest -m targets)


@pytest.mark.targets
@pytest.mark.parametrize("target", [pytest.param(t, marks=needs(t), id=t) for t in EMULATED])
def test_runtime_on_a_target_reads_that_targets_own_session(capsys, target):
    """Classes from the target's session: its integer kernels are the QLinear ops its own
    optimized graph holds, and ``differs_from_native`` is exactly where the two answers part."""
    code, out, err = run_main(capsys, ["runtime", "ops/full.onnx", "--cpu", target])
    assert code == 0, err
    answer = json.loads(out)
    assert answer["cpu"] == {"name": target, "onnxruntime": ort.__version__, "machine": MACHINES[target]}
    assert answer["environment"]["machine"] == MACHINES[target]
    kernels = targets.run(target, "tests.targets.probe:optimized_op_types", ["ops/full.onnx"])["result"]
    integer = sorted(k for k in kernels if k.startswith("QLinear") or k in ("MatMulInteger", "ConvInteger"))
    assert sorted(n["kernel"] for n in answer["nodes"] if n["class"] == "int8") == integer
    # node for node: each fused kernel keeps the name of the node it replaced
    named = targets.run(target, "tests.targets.probe:integer_kernel_nodes", ["ops/full.onnx"])["result"]
    int8_nodes = sorted(n["node"] for n in answer["nodes"] if n["class"] == "int8")
    assert int8_nodes == sorted(name for names in named.values() for name in names)
    native = json.loads(run_main(capsys, ["runtime", "ops/full.onnx"])[1])
    assert [n["node"] for n in native["nodes"]] == [n["node"] for n in answer["nodes"]]
    pairs = zip(native["nodes"], answer["nodes"], strict=True)
    parted = [(a["node"], a["class"], b["class"]) for a, b in pairs if a["class"] != b["class"]]
    assert [(c["node"], c["native"], c["cpu"]) for c in answer["differs_from_native"]] == parted


@pytest.mark.targets
@pytest.mark.parametrize("target", [pytest.param(t, marks=needs(t), id=t) for t in EMULATED])
def test_an_error_inside_a_target_keeps_its_line_and_exit_code(tmp_path, target):
    with pytest.raises(graphscan.GraphscanError) as raised:
        targets.run(target, "graphscan:load_model", [str(tmp_path / "absent.onnx")])
    assert raised.value.exit_code == graphscan.EXIT_NO_FILE and "absent.onnx" in str(raised.value)


def u8s8_conv(folder, channels=64, size=16, seed=0):
    """A QLinearConv, uint8 activations and int8 weights (3x3, padded), with one input;
    weights of spread 40, so adjacent u8*s8 pairs overflow 16 bits (AVX2's vpmaddubsw saturates)."""
    rng = np.random.default_rng(seed)
    weights = np.clip(np.round(rng.normal(0, 40, (channels, channels, 3, 3))), -127, 127).astype(np.int8)
    scales = {"xs": np.float32(0.02), "ws": np.float32(0.01), "ys": np.float32(20.0)}
    initializers = [
        numpy_helper.from_array(weights, "w"),
        numpy_helper.from_array(np.array(scales["xs"]), "xs"),
        numpy_helper.from_array(np.array(128, np.uint8), "xz"),
        numpy_helper.from_array(np.full(channels, scales["ws"], np.float32), "ws"),
        numpy_helper.from_array(np.zeros(channels, np.int8), "wz"),
        numpy_helper.from_array(np.array(scales["ys"]), "ys"),
        numpy_helper.from_array(np.array(128, np.uint8), "yz"),
    ]
    shape = [1, channels, size, size]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph(
        [node],
        "u8s8",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, shape)],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, shape)],
        initializers,
    )
    model_path, feeds_path = folder / "u8s8.onnx", folder / "u8s8.npz"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), model_path)
    x = rng.integers(0, 256, shape).astype(np.uint8)
    np.savez(feeds_path, x=x)
    # The exact answer: int64 sums, then ONNX's requantization in float32 (round half to even).
    padded = np.pad(x[0].astype(np.int64) - 128, ((0, 0), (1, 1), (1, 1)))
    sums = np.zeros((channels, size, size), np.int64)
    for dy in range(3):
        for dx in range(3):
            window = padded[:, dy : dy + size, dx : dx + size]
            sums += np.einsum("oc,chw->ohw", weights[:, :, dy, dx].astype(np.int64), window)
    multiplier = scales["xs"] * scales["ws"] / scales["ys"]
    exact = np.clip(np.rint(sums.astype(np.float32) * multiplier) + 128, 0, 255).ravel()
    return str(model_path), str(feeds_path), exact


def host_has_vnni():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_vnni|avx_vnni)\b", flags))


@pytest.mark.targets
@needs("x86-avx2")
def test_x86_without_vnni_computes_other_u8s8_conv_outputs(tmp_path):
    """AVX2's 16-bit pair sums saturate: the x86-avx2 target misses the exact integer answer,
    where a VNNI host (32-bit sums) reaches it."""
    model, feeds, exact = u8s8_conv(tmp_path)
    avx2 = np.array(targets.run("x86-avx2", "tests.targets.probe:outputs", [model, feeds])["result"][0])
    assert (avx2 != exact).any()
    if not host_has_vnni():
        pytest.skip("this host has no VNNI: it computes as x86-avx2 does, so native is not the exact reference")
    native = np.array(targets.run("native", "tests.targets.probe:outputs", [model, feeds])["result"][0])
    np.testing.assert_array_equal(native, exact)


@pytest.mark.targets
@needs("arm64")
def test_arm64_computes_the_exact_u8s8_conv_outputs(tmp_path):
    model, feeds, exact = u8s8_conv(tmp_path)
    arm64 = np.array(targets.run("arm64", "tests.targets.probe:outputs", [model, feeds])["result"][0])
    np.testing.assert_array_equal(arm64, exact)


def test_the_table_names_the_target_and_the_changed_classes(capsys, tmp_path):
    """A target's answer read back by ``table``: its CPU in the head, each changed node a row."""
    answer = json.loads(run_main(capsys, ["runtime", "ops/full.onnx"])[1])
    first = answer["nodes"][0]
    answer["cpu"] = {"name": "arm64", "onnxruntime": ort.__version__, "machine": "aarch64"}
    answer["differs_from_native"] = [
        {"node": first["node"], "op_type": first["op_type"], "native": "float", "cpu": "int8"}
    ]
    saved = tmp_path / "arm64.json"
    saved.write_text(json.dumps(answer))
    code, out, err = run_main(capsys, ["table", saved])
    assert code == 0, err
    assert re.search(r"\bcpu arm64\b", out)
    tail = out.split("classes that differ from native\n", 1)[1].splitlines()
    assert tail[0].split() == ["node", "op_type", "native", "cpu"]
    assert tail[1].split() == [first["node"], first["op_type"], "float", "int8"] and len(tail) == 2


# -- the runner's protocol, with this interpreter standing in for a target's


@pytest.fixture
def stand_in(monkeypatch):
    """``x86-avx2`` run by this interpreter without qemu, its command line replaceable:
    the protocol (request and answer files, errors, crashes) is the same on every target."""
    interpreter = {"argv": None}

    def command(target, argv):
        env = dict(os.environ, PYTHONPATH=str(targets.repository()))
        return [sys.executable, *(interpreter["argv"] or argv)], env

    monkeypatch.setattr(targets, "missing", lambda target: None)
    monkeypatch.setattr(targets, "command", command)
    return interpreter


def test_a_function_runs_in_the_targets_interpreter_and_answers_json(stand_in, tmp_path):
    reply = targets.run("x86-avx2", "os.path:join", [str(tmp_path), "a"])
    assert reply["result"] == str(tmp_path / "a")
    assert reply["cpu"] == {"name": "x86-avx2", "onnxruntime": ort.__version__, "machine": platform.machine()}


@pytest.mark.parametrize(
    ("function", "args", "code", "words"),
    [
        pytest.param("graphscan:load_model", ["absent.onnx"], graphscan.EXIT_NO_FILE, "absent.onnx", id="user-error"),
        pytest.param("json:loads", ["{"], graphscan.EXIT_INTERNAL, "internal error: JSONDecodeError", id="bug"),
    ],
)
def test_an_error_in_the_target_comes_back_as_its_line_and_code(stand_in, function, args, code, words):
    with pytest.raises(graphscan.GraphscanError) as raised:
        targets.run("x86-avx2", function, args)
    assert raised.value.exit_code == code and words in str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("function", "args", "expected"),
    [
        pytest.param("os:abort", [], r"killed by SIGABRT without an answer", id="crash"),
        pytest.param(
            "sys:exit", ["MemoryError: std::bad_alloc"], r"stopped \(exit 1\) without an answer: .*bad_alloc", id="exit"
        ),
    ],
)
def test_an_interpreter_that_dies_in_a_call_is_one_line_naming_the_target(stand_in, function, args, expected):
    """It started (the install is whole): its end is the call's, exit 5, with its last words."""
    with pytest.raises(graphscan.GraphscanError) as raised:
        targets.run("x86-avx2", function, args)
    assert raised.value.exit_code == graphscan.EXIT_RUNTIME
    assert re.fullmatch(rf"CPU target x86-avx2: its interpreter was {expected}", str(raised.value)), raised.value


def test_a_targets_interpreter_runs_this_repositorys_graphscan_alone(monkeypatch):
    """The x86-avx2 command line: this interpreter under qemu's Haswell, with this repository
    first on its path, and neither the user's site-packages nor a startup file or another
    Python home read (a user's own onnxruntime there would be the one the target runs)."""
    monkeypatch.setattr(targets, "qemu", lambda arch: f"/opt/qemu-{arch}")
    monkeypatch.setenv("PYTHONSTARTUP", "/home/user/startup.py")
    monkeypatch.setenv("PYTHONHOME", "/elsewhere")
    monkeypatch.delenv("PYTHONNOUSERSITE", raising=False)
    line, env = targets.command(targets.X86_AVX2, ["-m", "x"])
    assert line == ["/opt/qemu-x86_64", "-cpu", targets.X86_AVX2_CPU, sys.executable, "-m", "x"]
    assert env["PYTHONNOUSERSITE"] == "1" and env["PYTHONPATH"] == str(targets.repository())
    assert "PYTHONSTARTUP" not in env and "PYTHONHOME" not in env
