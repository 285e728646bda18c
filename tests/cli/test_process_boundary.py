"""Issue 10, the process boundary: strict JSON, one line on every failure
(SIGINT, a stdout that cannot be written, paths with newlines, internal errors),
option values, --inputs problems for trace and fuse, and hostile big files.

Process-level promises are checked on the real process (tests/helpers.py);
SIGINT is sent by the process to itself at a chosen moment through an audit
hook, so the test does not depend on timing.
"""

import os
import platform
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.commands.trace as trace_command
from tests.helpers import (
    INTERRUPT_AT,
    ROOT,
    TERMINATE_AT,
    describe,
    error_line,
    json_answer,
    replace_command,
    run_graphscan,
    strict_loads,
)

NAN = float("nan")


def main_result(capsys, argv):
    """graphscan.main(argv) in-process: (exit code, stdout, stderr lines)."""
    code = graphscan.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def nan_model(path):
    """x [1, 4] -> Mul by NaN -> Relu -> y: every value NaN."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "nan"], ["m"], name="mul"), helper.make_node("Relu", ["m"], ["y"], name="relu")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.array([np.nan], np.float32), "nan")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


# --------------------------------------------------------------------------
# Item 4: strict JSON, null for NaN and infinity


def test_strict_json_turns_every_non_finite_float_into_null():
    answer = {"a": [NAN, float("inf"), -float("inf"), 1.5], "b": {"c": NAN, "d": [{"e": float("-inf")}]}, "f": "NaN"}
    assert strict_loads(graphscan._strict_json(answer)) == {
        "a": [None, None, None, 1.5],
        "b": {"c": None, "d": [{"e": None}]},
        "f": "NaN",
    }


def test_main_prints_null_where_a_command_returns_nan(monkeypatch, capsys):
    def nan_answer(path):
        return {"model": path, "value": NAN, "rows": [{"x": float("inf")}]}

    replace_command(monkeypatch, "nodes", nan_answer)
    code, out, err = main_result(capsys, ["nodes", "m.onnx"])
    assert (code, err) == (0, [])
    assert strict_loads(out) == {"model": "m.onnx", "value": None, "rows": [{"x": None}]}


def test_trace_of_a_nan_model_is_strict_json(tmp_path):
    model = nan_model(tmp_path / "nan.onnx")
    answer = json_answer(run_graphscan(["trace", model, model]))  # json_answer refuses NaN tokens
    assert answer["outputs"]["y"] is None or answer["outputs"]["y"] == 0.0


# --------------------------------------------------------------------------
# Item 5: SIGINT, stdout that cannot be written, newlines in paths, one_line


@pytest.mark.parametrize(
    ("command", "event", "argument"),
    [
        pytest.param("nodes", "import", "onnx", id="nodes-while-importing-onnx"),
        pytest.param("nodes", "open", "{model}", id="nodes-while-loading"),
        pytest.param("fuse", "import", "onnxruntime", id="fuse-before-running"),
        pytest.param("trace", "import", "onnxruntime", id="trace-before-running"),
        pytest.param("fuse", "os.rename", "*", id="fuse-while-renaming-its-output"),
    ],
)
@pytest.mark.parametrize(
    ("signal_at", "code", "line"),
    [
        pytest.param(INTERRUPT_AT, graphscan.EXIT_INTERRUPTED, b"graphscan: interrupted\n", id="sigint"),
        pytest.param(TERMINATE_AT, graphscan.EXIT_TERMINATED, b"graphscan: terminated\n", id="sigterm"),
    ],
)
def test_sigint_and_sigterm_are_one_line_and_their_exit_code(
    tmp_path, small_lab, command, event, argument, signal_at, code, line
):
    paths = {
        "nodes": [small_lab["full"]],
        "fuse": [small_lab["fp32"], tmp_path / "out.onnx"],
        "trace": [small_lab["fp32"], small_lab["full"]],
    }
    args = [command, *paths[command]]
    if argument == "{model}":
        argument = str(paths[command][0])
    proc = run_graphscan(args, python_flags=("-c", signal_at, event, argument))
    assert proc.returncode == code, proc.stderr
    assert proc.stderr == line
    assert proc.stdout == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no temporary file


REWIRE_STDOUT = {
    "closed": "os.close(1)",
    "reader-gone": "r, w = os.pipe(); os.close(r); os.dup2(w, 1); os.close(w)",
    "dev-full": "os.dup2(os.open('/dev/full', os.O_WRONLY), 1)",
}


STDOUT_CASES = [
    *(
        pytest.param(command, how, id=f"{command.lstrip('-')}-{how}")
        for command in ["islands", "--help"]
        for how in REWIRE_STDOUT
    ),
    pytest.param("fuse", "closed", id="fuse-closed"),  # refused before the output is written
]


@pytest.mark.parametrize(("command", "how"), STDOUT_CASES)
def test_stdout_that_cannot_be_written_is_one_line_exit_3(tmp_path, small_lab, how, command):
    rewire = f"import os, sys; {REWIRE_STDOUT[how]}; os.execv(sys.executable, [sys.executable] + sys.argv[1:])"
    args = {
        "islands": [command, small_lab["full"]],
        "fuse": [command, small_lab["fp32"], tmp_path / "out.onnx"],
        "--help": [command],
    }[command]
    line = error_line(run_graphscan(args, python_flags=("-c", rewire)), graphscan.EXIT_NO_FILE)
    assert "stdout" in line
    if how == "closed":  # known before any work: nothing is written
        assert not (tmp_path / "out.onnx").exists()


def test_stdout_that_is_none_is_one_line_exit_3(small_lab, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdout", None)  # how Python starts with >&-
    code = graphscan.main(["nodes", str(small_lab["full"])])
    assert code == graphscan.EXIT_NO_FILE
    assert capsys.readouterr().err == "graphscan: cannot write the answer: stdout is closed\n"


def newline_cases(tmp_path, small_lab):
    junk = tmp_path / "bad\nname.onnx"
    junk.write_bytes(b"\xff\x00 not a model")
    for name in ["in\r.npz", "in\n.npz"]:
        (tmp_path / name).write_bytes(b"not a zip file")
    return {
        "missing-model": (["nodes", tmp_path / "no\nsuch.onnx"], 3, tmp_path / "no\nsuch.onnx"),
        "not-onnx": (["qdq", junk], 4, junk),
        "fuse-output-folder": (
            ["fuse", small_lab["fp32"], tmp_path / "no\ndir" / "o.onnx"],
            3,
            tmp_path / "no\ndir" / "o.onnx",
        ),
        "trace-inputs": (
            ["trace", small_lab["fp32"], small_lab["full"], "--inputs", tmp_path / "in\r.npz"],
            7,
            tmp_path / "in\r.npz",
        ),
        "fuse-inputs": (
            ["fuse", small_lab["fp32"], tmp_path / "o.onnx", "--inputs", tmp_path / "in\n.npz"],
            7,
            tmp_path / "in\n.npz",
        ),
    }


@pytest.mark.parametrize("case", ["missing-model", "not-onnx", "fuse-output-folder", "trace-inputs", "fuse-inputs"])
def test_path_with_a_newline_is_shown_escaped_on_one_line(tmp_path, small_lab, capsys, case):
    argv, code, path = newline_cases(tmp_path, small_lab)[case]
    got, out, err = main_result(capsys, argv)
    assert (got, out, len(err)) == (code, "", 1)
    assert repr(str(path)) in err[0]


def test_shown_leaves_ordinary_paths_alone():
    assert graphscan.shown("dir/model v2.onnx") == "dir/model v2.onnx"
    assert graphscan.shown("a\nb") == "'a\\nb'"
    assert graphscan.shown(b"a\xffb".decode("utf-8", "surrogateescape")) == "'a\\udcffb'"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(RuntimeError("first\nsecond"), "graphscan: internal error: RuntimeError: first", id="internal"),
        pytest.param(graphscan.GraphscanError("a\nb\u2028c", 3), "graphscan: a\\nb\\u2028c", id="user-error"),
    ],
)
def test_error_messages_with_line_breaks_stay_one_line(monkeypatch, capsys, error, expected):
    def failing(path):
        raise error

    replace_command(monkeypatch, "nodes", failing)
    code, out, err = main_result(capsys, ["nodes", "m.onnx"])
    assert (code, out, err) == (getattr(error, "exit_code", 1), "", [expected])


@pytest.mark.parametrize(
    ("error", "code", "expected"),
    [
        pytest.param(RuntimeError("first\nsecond"), 1, "gen_models: error: RuntimeError: first", id="internal"),
        pytest.param(KeyboardInterrupt(), 130, "gen_models: interrupted", id="sigint"),
    ],
)
def test_gen_models_errors_are_one_line(tmp_path, monkeypatch, capsys, error, code, expected):
    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(gen_models, "build_lab", failing)
    assert gen_models.main(["--out", str(tmp_path / "ops")]) == code
    _out, err = capsys.readouterr()
    assert err.splitlines() == [expected]
    assert os.listdir(tmp_path / "ops") == []  # the staging folder is gone


# --------------------------------------------------------------------------
# Item 8: option values


BAD_OPTIONS = [
    pytest.param("trace", "--seed", "-1", id="trace-seed-negative"),
    pytest.param("trace", "--seed", "1.5", id="trace-seed-not-int"),
    pytest.param("trace", "--tolerance", "nan", id="trace-tolerance-nan"),
    pytest.param("trace", "--tolerance", "inf", id="trace-tolerance-inf"),
    pytest.param("trace", "--tolerance", "-0.5", id="trace-tolerance-negative"),
    pytest.param("fuse", "--seed", "-1", id="fuse-seed-negative"),
]


@pytest.mark.parametrize(("command", "option", "value"), BAD_OPTIONS)
def test_bad_option_values_are_usage_errors(tmp_path, small_lab, capsys, command, option, value):
    paths = [small_lab["fp32"], small_lab["full"]] if command == "trace" else [small_lab["fp32"], tmp_path / "o.onnx"]
    code, out, err = main_result(capsys, [command, *paths, f"{option}={value}"])
    assert (code, out, len(err)) == (graphscan.EXIT_USAGE, "", 1)
    assert option in err[0]


# --------------------------------------------------------------------------
# Item 6: --inputs that cannot feed the model, for trace and fuse; -1 dimensions


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def bad_inputs(folder, case):
    """An .npz for input x [N, 8] (float32) that cannot feed it."""
    path = folder / f"{case}.npz"
    if case == "not-npy-member":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("x.npy", b"")
            archive.writestr("notes.txt", "hello")
        return path
    arrays = {
        "wrong-dtype": np.zeros((2, 8), np.float64),
        "wrong-shape": np.zeros((2, 7), np.float32),
        "wrong-rank": np.zeros((2, 8, 1), np.float32),
        "zero-d": np.array(1.0, np.float32),
        "string-array": np.array([["a"] * 8] * 2),
    }
    return write_npz(path, x=arrays[case])


@pytest.mark.parametrize(
    "case", ["wrong-dtype", "wrong-shape", "wrong-rank", "zero-d", "string-array", "not-npy-member"]
)
@pytest.mark.parametrize("command", ["trace", "fuse"])
def test_inputs_that_cannot_feed_the_model_are_exit_7(tmp_path, small_lab, capsys, command, case):
    npz = bad_inputs(tmp_path, case)
    paths = [small_lab["fp32"], small_lab["full"]] if command == "trace" else [small_lab["fp32"], tmp_path / "o.onnx"]
    code, out, err = main_result(capsys, [command, *paths, "--inputs", npz])
    assert (code, out, len(err)) == (graphscan.EXIT_INPUTS, "", 1)
    assert err[0].startswith(f"graphscan: {npz}: ")  # the file is blamed, not a model
    assert not (tmp_path / "o.onnx").exists()


def with_minus_one_batch(source, target):
    model = onnx.load(source)
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    dim.Clear()
    dim.dim_value = -1  # some exporters write this for "any size"
    onnx.save(model, target)
    return target


def test_minus_one_declared_dimension_is_symbolic_in_trace(tmp_path, small_lab):
    fp32 = with_minus_one_batch(small_lab["fp32"], tmp_path / "fp32.onnx")
    full = with_minus_one_batch(small_lab["full"], tmp_path / "full.onnx")
    answer = json_answer(run_graphscan(["trace", fp32, full]))
    assert answer["inputs"] == {"x": [trace_command.TRACE_SYMBOLIC_DIM_SIZE, 8]}
    assert answer["ops"] and all(row["propagated_max_abs"] is not None for row in answer["ops"])


# --------------------------------------------------------------------------
# Item 10: a file truncated while it is read; junk refused from its first bytes

TRUNCATE_WHILE_SKIMMING = """
import os, sys
script, argv = sys.argv[1], sys.argv[2:]
sys.path.insert(0, os.path.dirname(script))
import graphscan
graphscan._SKIM_THRESHOLD = 0  # the big-file path, on a small file
skim = graphscan._skim_model
def truncating(buffer):
    os.truncate(argv[1], 0)  # another process empties the file mid-read
    return skim(buffer)
graphscan._skim_model = truncating
sys.exit(graphscan.main(argv))
"""


def test_file_truncated_while_skimmed_is_exit_4_not_sigbus(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(gen_models.build_mlp(3, 64, seed=0), path)  # ~50 KB: pages past the first
    proc = run_graphscan(["nodes", path], python_flags=("-c", TRUNCATE_WHILE_SKIMMING))
    assert proc.returncode != -signal.SIGBUS, "killed by SIGBUS"
    assert "changed while being read" in error_line(proc, graphscan.EXIT_NOT_ONNX)


JUNK_HEADS = [
    pytest.param(b"", id="zeros"),
    pytest.param(b"\xff" * 16, id="ff-bytes"),
    pytest.param(b"\x08\x00", id="ir-version-then-zeros"),
    pytest.param(b"hello, world\n", id="text"),
]


@pytest.mark.parametrize("head", JUNK_HEADS)
@pytest.mark.parametrize("command", ["nodes", "fuse"])
def test_gib_of_junk_is_refused_from_its_first_bytes(tmp_path, head, command):
    path = tmp_path / "junk.onnx"
    path.write_bytes(head)
    os.truncate(path, 1024**3)  # sparse: 1 GiB of zeros after the head, no disk used
    started = time.perf_counter()
    refuse = {
        "nodes": lambda: graphscan.nodes(str(path)),
        "fuse": lambda: graphscan.fuse(str(path), str(tmp_path / "o.onnx")),
    }
    with pytest.raises(graphscan.GraphscanError) as caught:
        refuse[command]()
    elapsed = time.perf_counter() - started
    assert caught.value.exit_code == graphscan.EXIT_NOT_ONNX
    assert elapsed < 0.5, f"{elapsed:.2f} s to refuse"
    assert not (tmp_path / "o.onnx").exists()


def relu_log_model(path, quantized):
    """``y = Log(Relu(x))``: -inf wherever x <= 0, in the float model and in its QDQ copy alike,
    so the difference of the outputs holds ``-inf - -inf`` (numpy would warn on stderr)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
    ]
    nodes, tensor = [], "x"
    for k, op in enumerate(["Relu", "Log"]):
        if quantized:
            nodes += [
                helper.make_node("QuantizeLinear", [tensor, "s", "z"], [f"q{k}"], name=f"q{k}"),
                helper.make_node("DequantizeLinear", [f"q{k}", "s", "z"], [f"d{k}"], name=f"dq{k}"),
            ]
            tensor = f"d{k}"
        out = "y" if op == "Log" else "r"
        nodes.append(helper.make_node(op, [tensor], [out], name=op.lower()))
        tensor = out
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 8]) for n in ("x", "y")]
    model = helper.make_model(helper.make_graph(nodes, "g", io[:1], io[1:], inits if quantized else []))
    model.opset_import[0].version = 17
    save(model, path)
    return str(path)


@pytest.mark.parametrize("command", ["trace", "impact", "check"])
def test_infinite_outputs_give_null_and_nothing_on_stderr(tmp_path, command):
    a, b = relu_log_model(tmp_path / "a.onnx", False), relu_log_model(tmp_path / "b.onnx", True)
    argv = {"check": ["check", b, "--float", a, "--min-sqnr", "1"]}.get(command, [command, a, b])
    proc = run_graphscan(argv)
    assert proc.returncode == (8 if command == "check" else 0), describe(proc)
    assert proc.stderr == b"", describe(proc)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        pytest.param(["fuse", "{fp32}", "{out}"], 0, id="fuse-answers"),
        pytest.param(["runtime", "{missing}"], 3, id="runtime-fails"),
    ],
)
def test_an_unwritable_home_cache_leaves_stderr_to_graphscan(tmp_path, small_lab, argv, code):
    """With HOME=/dev/null (a CI user without a home), onnxruntime 1.32 logged a coloured
    telemetry warning on stderr as it was imported: two lines of raw escape codes before
    graphscan's own one line, or instead of a clean stderr."""
    paths = {"fp32": small_lab["fp32"], "out": tmp_path / "out.onnx", "missing": tmp_path / "missing.onnx"}
    argv = [str(a).format(**{k: str(v) for k, v in paths.items()}) for a in argv]
    proc = run_graphscan(argv, env={**os.environ, "HOME": "/dev/null"})
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == (1 if code else 0) and b"\x1b" not in proc.stderr, proc.stderr


ARENAS_AFTER_THREADS = """
import ctypes, sys, tempfile, threading
sys.path.insert(0, sys.argv[1])
import graphscan
if sys.argv[3] == "main":
    assert graphscan.main(["nodes", sys.argv[2]]) == 0
def allocate():
    kept = [bytearray(32 << 10) for _ in range(200)]  # below glibc's mmap threshold: from an arena
    del kept
threads = [threading.Thread(target=allocate) for _ in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
path = tempfile.mktemp()
report = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, report)
libc.fclose(report)
print(open(path).read().count("<heap nr="), file=sys.stderr)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")
def test_a_command_leaves_one_malloc_arena_for_threads_to_share(tmp_path):
    """After main() ran a command, threads that allocate share the one arena (glibc keeps
    what each arena freed: tune's page-size peak was 0.6 GiB higher with one per thread);
    without main() the same threads make arenas of their own."""
    onnx.save(gen_models.build_mlp(2, 8, 0, ("N",)), tmp_path / "m.onnx")
    script = tmp_path / "arenas.py"
    script.write_text(ARENAS_AFTER_THREADS)

    def arenas(how):
        done = subprocess.run(
            [sys.executable, str(script), str(ROOT), str(tmp_path / "m.onnx"), how],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(done.stderr.strip().splitlines()[-1])

    assert arenas("main") == 1
    assert arenas("alone") > 1
