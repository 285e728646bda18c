"""graphscan.py as a process: exit codes, stdout JSON and stderr lines (SPEC.md, "Invocation").

Most tests run ``python /abs/path/graphscan.py ...`` through ``run_graphscan``, the way
graders, users and other programs call it, from a tmp working directory so the tool is
shown to run from anywhere (in this process, which tests/cli/test_in_process.py holds
to the same bytes; a separate one where the environment or interpreter flags differ).
A few call ``graphscan.main(argv)`` in-process with capsys.
"""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import graphscan
from tests.helpers import (
    COMMANDS,
    GRAPHSCAN,
    SINGLE_MODEL_COMMANDS,
    assert_spec_shape,
    describe,
    error_line,
    json_answer,
    negated,
    run_graphscan,
    strict_loads,
)
from tests.reference import reference_diff, reference_of


def in_process(command, paths):
    """The library function's answer for the same path strings."""
    return getattr(graphscan, command)(*paths)


# --------------------------------------------------------------------------
# Fixtures


@pytest.fixture
def workdir(tmp_path):
    """An empty working directory away from the repo, so the tool must run from anywhere."""
    folder = tmp_path / "work"
    folder.mkdir()
    return folder


@pytest.fixture
def bad_inputs(workdir, default_lab):
    """Broken and missing inputs inside ``workdir``, named by the relative paths the tests pass.

    A good model sits beside them so that ``diff`` can fail on either path.
    """
    full = Path(default_lab["full"]).read_bytes()
    (workdir / "good.onnx").write_bytes(full)
    (workdir / "a_folder").mkdir()
    (workdir / "empty.onnx").write_bytes(b"")
    (workdir / "truncated.onnx").write_bytes(full[: len(full) // 2])
    (workdir / "notes.txt").write_text("this is a text file, not an ONNX model\n")
    (workdir / "noise.bin").write_bytes(np.random.default_rng(0).bytes(4096))
    return workdir


# --------------------------------------------------------------------------
# 1. Success: one JSON object, SPEC's keys, the library's answer


SUCCESS_CASES = [
    pytest.param(command, [variant], id=f"{command}-{variant}")
    for variant in ["full", "matmul_only"]
    for command in SINGLE_MODEL_COMMANDS
] + [
    pytest.param("diff", ["full", "matmul_only"], id="diff-full-to-matmul_only"),
]


@pytest.mark.parametrize(("command", "variants"), SUCCESS_CASES)
def test_success_prints_the_library_answer(default_lab, workdir, command, variants):
    paths = [default_lab[v] for v in variants]
    answer = json_answer(run_graphscan([command, *paths], workdir))

    assert_spec_shape(command, answer)
    assert answer == in_process(command, paths)
    # ... and that answer is right: the brute-force reference shares no code with it.
    if command == "diff":
        expected = reference_diff(*map(reference_of, paths))
        assert answer == {"a": paths[0], "b": paths[1], **expected}
    else:
        assert answer == {"model": paths[0], **reference_of(paths[0])[command]}


def test_diff_subprocess_is_antisymmetric(default_lab, workdir):
    """diff(a, b) == -diff(b, a), through the real process both ways."""
    full, matmul_only = default_lab["full"], default_lab["matmul_only"]
    forward = json_answer(run_graphscan(["diff", full, matmul_only], workdir))
    backward = json_answer(run_graphscan(["diff", matmul_only, full], workdir))

    assert (forward["a"], forward["b"]) == (full, matmul_only)
    assert (backward["a"], backward["b"]) == (matmul_only, full)
    assert backward == negated(forward)
    # The two scopes differ, so a diff of all zeros would be a wrong answer.
    assert forward["op_delta"] and forward["quantize_delta"] != 0


# --------------------------------------------------------------------------
# 2. Paths echoed exactly as given (relative, unnormalised)


ECHO_CASES = [
    pytest.param(command, ["./sub/../sub/m.onnx"], id=f"{command}-dot-dot") for command in SINGLE_MODEL_COMMANDS
] + [
    pytest.param("diff", ["./sub/../sub/m.onnx", "sub//other.onnx"], id="diff-dot-dot-and-double-slash"),
]


@pytest.mark.parametrize(("command", "relative"), ECHO_CASES)
def test_paths_are_echoed_unchanged(default_lab, workdir, command, relative):
    sub = workdir / "sub"
    sub.mkdir()
    shutil.copyfile(default_lab["full"], sub / "m.onnx")
    shutil.copyfile(default_lab["matmul_only"], sub / "other.onnx")
    absolute = {"m.onnx": default_lab["full"], "other.onnx": default_lab["matmul_only"]}

    answer = json_answer(run_graphscan([command, *relative], workdir))

    keys = ["model"] if command != "diff" else ["a", "b"]
    assert [answer[k] for k in keys] == relative
    # Apart from the echoed paths, the answer is the one for the same models.
    expected = in_process(command, [absolute[Path(p).name] for p in relative])
    for key in keys:
        expected[key] = answer[key]
    assert answer == expected


# --------------------------------------------------------------------------
# 3. Usage errors: exit 2


USAGE_CASES = [
    pytest.param([], [], id="no-command"),
    pytest.param(["frobnicate", "{full}"], ["frobnicate"], id="unknown-command"),
    pytest.param(["nodes"], [], id="nodes-without-path"),
    pytest.param(["nodes", "{full}", "{full}"], [], id="nodes-with-two-paths"),
    pytest.param(["diff", "{full}"], [], id="diff-with-one-path"),
    pytest.param(["diff", "{full}", "{full}", "{full}"], [], id="diff-with-three-paths"),
    pytest.param(["nodes", "--bogus", "{full}"], ["--bogus"], id="nodes-bad-option-before-path"),
    pytest.param(["qdq", "{full}", "--bogus"], ["--bogus"], id="qdq-bad-option-after-path"),
]


@pytest.mark.parametrize(("args", "named"), USAGE_CASES)
def test_usage_error_exits_2(default_lab, workdir, args, named):
    # Real model paths, so that only the usage can be what is wrong.
    args = [a.format(full=default_lab["full"]) for a in args]
    line = error_line(run_graphscan(args, workdir), 2)
    for token in named:
        assert token in line


# --------------------------------------------------------------------------
# 4. Missing or non-regular paths: exit 3


NO_FILE_CASES = [
    pytest.param(["nodes", "missing.onnx"], "missing.onnx", id="nodes-missing"),
    pytest.param(["qdq", "a_folder"], "a_folder", id="qdq-directory"),
    pytest.param(["islands", "no/such/dir/m.onnx"], "no/such/dir/m.onnx", id="islands-missing-folder"),
    pytest.param(["boundary", "a_folder"], "a_folder", id="boundary-directory"),
    pytest.param(["diff", "good.onnx", "missing.onnx"], "missing.onnx", id="diff-missing-second"),
    pytest.param(["diff", "missing.onnx", "good.onnx"], "missing.onnx", id="diff-missing-first"),
]


@pytest.mark.parametrize(("args", "bad_path"), NO_FILE_CASES)
def test_missing_or_not_a_file_exits_3(bad_inputs, args, bad_path):
    line = error_line(run_graphscan(args, bad_inputs), 3)
    assert bad_path in line
    assert "good.onnx" not in line


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_fifo_is_not_a_regular_file_exits_3(workdir):
    """A named pipe exists but is not a regular file; reading it would hang."""
    os.mkfifo(workdir / "pipe.onnx")
    # Opening the pipe would block: a short timeout turns that bug into a failure.
    line = error_line(run_graphscan(["qdq", "pipe.onnx"], workdir, timeout=20), 3)
    assert "pipe.onnx" in line


# --------------------------------------------------------------------------
# 5. Files that are not ONNX models: exit 4


NOT_ONNX_CASES = [
    pytest.param(["nodes", "empty.onnx"], "empty.onnx", id="nodes-empty"),
    pytest.param(["nodes", "truncated.onnx"], "truncated.onnx", id="nodes-truncated"),
    pytest.param(["nodes", "notes.txt"], "notes.txt", id="nodes-text"),
    pytest.param(["nodes", "noise.bin"], "noise.bin", id="nodes-random-bytes"),
    pytest.param(["qdq", "empty.onnx"], "empty.onnx", id="qdq-empty"),
    pytest.param(["islands", "truncated.onnx"], "truncated.onnx", id="islands-truncated"),
    pytest.param(["boundary", "notes.txt"], "notes.txt", id="boundary-text"),
    pytest.param(["diff", "good.onnx", "truncated.onnx"], "truncated.onnx", id="diff-truncated-second"),
    pytest.param(["diff", "noise.bin", "good.onnx"], "noise.bin", id="diff-random-bytes-first"),
]


@pytest.mark.parametrize(("args", "bad_path"), NOT_ONNX_CASES)
def test_not_an_onnx_model_exits_4(bad_inputs, args, bad_path):
    line = error_line(run_graphscan(args, bad_inputs), 4)
    assert bad_path in line
    assert "good.onnx" not in line


# --------------------------------------------------------------------------
# 6. --help


HELP_CASES = [pytest.param([], id="top-level")] + [pytest.param([command], id=command) for command in COMMANDS]


@pytest.mark.parametrize("prefix", HELP_CASES)
def test_help_prints_usage_and_exits_0(workdir, prefix):
    proc = run_graphscan([*prefix, "--help"], workdir)

    assert proc.returncode == 0, describe(proc)
    assert proc.stderr == b"", describe(proc)
    text = proc.stdout.decode("utf-8")
    assert text.lower().startswith("usage:"), text
    # Top-level help lists every command; a command's help names that command.
    for command in prefix or COMMANDS:
        assert command in text


# --------------------------------------------------------------------------
# 7. Determinism: tests/cli/test_determinism.py (every counting command, several hash seeds)


# --------------------------------------------------------------------------
# The rest of "Invocation": self-contained file, no onnxruntime for counting


def test_copied_alone_runs_from_another_folder(default_lab, tmp_path):
    """graphscan.py copied next to a model folder, with nothing of the repo on the path."""
    tool, models = tmp_path / "tool", tmp_path / "models"
    tool.mkdir()
    models.mkdir()
    shutil.copyfile(GRAPHSCAN, tool / "graphscan.py")
    shutil.copyfile(default_lab["full"], models / "full.onnx")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    script = str(tool / "graphscan.py")
    proc = run_graphscan(["islands", "full.onnx"], models, script=script, env=env)

    answer = json_answer(proc)
    assert answer == {**graphscan.islands(default_lab["full"]), "model": "full.onnx"}


def test_counting_commands_do_not_import_onnxruntime(default_lab, workdir):
    """SPEC: onnxruntime is imported only by fuse/trace, so counting starts fast."""
    proc = run_graphscan(["qdq", default_lab["full"]], workdir, python_flags=["-X", "importtime"])

    assert proc.returncode == 0, describe(proc)
    assert strict_loads(proc.stdout) == graphscan.qdq(default_lab["full"])
    imported = [
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.decode("utf-8").splitlines()
        if line.startswith("import time:")
    ]
    assert "onnx" in imported  # the -X importtime report really is there
    assert not [m for m in imported if m.split(".")[0] == "onnxruntime"]


# --------------------------------------------------------------------------
# In-process: main(argv) with capsys


def test_main_success_prints_the_library_answer(default_lab, capsys):
    assert graphscan.main(["boundary", default_lab["full"]]) == 0
    out, err = capsys.readouterr()

    assert err == ""
    assert out.endswith("\n") and out.count("\n") == 1
    assert json.loads(out) == graphscan.boundary(default_lab["full"])


@pytest.mark.parametrize(
    ("argv", "exit_code", "named"),
    [
        pytest.param([], 2, None, id="no-command"),
        pytest.param(["nodes", "a.onnx", "b.onnx"], 2, None, id="two-paths"),
        pytest.param(["qdq", "missing.onnx"], 3, "missing.onnx", id="missing"),
        pytest.param(["islands", "a_folder"], 3, "a_folder", id="directory"),
        pytest.param(["boundary", "empty.onnx"], 4, "empty.onnx", id="empty"),
        pytest.param(["diff", "good.onnx", "truncated.onnx"], 4, "truncated.onnx", id="diff-truncated"),
    ],
)
def test_main_error_returns_code_and_one_line(bad_inputs, monkeypatch, capsys, argv, exit_code, named):
    monkeypatch.chdir(bad_inputs)
    assert graphscan.main(argv) == exit_code
    out, err = capsys.readouterr()

    assert out == ""
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1
    if named is not None:
        assert named in err


def test_main_help_returns_0_with_usage_on_stdout(capsys):
    assert graphscan.main(["diff", "--help"]) == 0
    out, err = capsys.readouterr()

    assert err == ""
    assert out.lower().startswith("usage:") and "diff" in out
