"""The option groups (graphscan.py, "Option groups"): each declares its options and builds itself
from their values, the command line's and an in-process call's through one door. The ranges are
docs/SPEC.md's: ``--runs`` 1 to 100,000, ``--threads`` 1 to 1,024, ``--level`` of the command's
levels, ``--seed`` an integer >= 0, ``--cpu`` native, x86-avx2 or arm64."""

from __future__ import annotations

import pytest

import graphscan
from graphscan_ort.shared.options import Timing

# (command, flag, keyword, value, valid): each a value the command line and a call must treat alike.
VALUES = [
    ("runtime", "--runs", "runs", 1, True),
    ("runtime", "--runs", "runs", 100_000, True),
    ("runtime", "--runs", "runs", 0, False),
    ("runtime", "--runs", "runs", 100_001, False),
    ("runtime", "--runs", "runs", -3, False),
    ("runtime", "--runs", "runs", 2.5, False),
    ("tune", "--threads", "threads", 1, True),
    ("tune", "--threads", "threads", 1024, True),
    ("tune", "--threads", "threads", 0, False),
    ("tune", "--threads", "threads", 1025, False),
    ("runtime", "--level", "level", "basic", True),
    ("runtime", "--level", "level", "disabled", False),
    ("check", "--level", "level", "disabled", True),
    ("check", "--level", "level", "everything", False),
    ("trace", "--seed", "seed", 0, True),
    ("trace", "--seed", "seed", -1, False),
    ("trace", "--cpu", "cpu", "arm64", True),
    ("trace", "--cpu", "cpu", "sparc", False),
    ("tune", "--min-speedup", "min_speedup", 0, True),
    ("tune", "--min-speedup", "min_speedup", -1, False),
]
# What each command needs besides the option tried, and what enables it (--runs: only with --time).
BESIDE = {
    "runtime": (["--time"], {"timed": True}),
    "tune": (["--calibrate", "c.npz"], {"calibrate": ["c.npz"]}),
    "check": (["--min-sqnr", "0", "--float", "f.onnx"], {"min_sqnr": 0, "float_path": "f.onnx"}),
    "trace": ([], {}),
}


def built_from_command_line(command: str, flag: str, value: object) -> dict | graphscan.GraphscanError:
    arguments, _ = BESIDE[command]
    paths = ["m.onnx"] * len(graphscan._load_command(command).paths)
    try:
        args = graphscan._build_parser(command).parse_args([command, *paths, *arguments, flag, str(value)])
        return graphscan._command_keywords(graphscan._load_command(command), args)
    except graphscan.GraphscanError as exc:
        return exc


def built_in_process(command: str, keyword: str, value: object) -> dict | graphscan.GraphscanError:
    _, keywords = BESIDE[command]
    try:
        return graphscan._in_process_keywords(graphscan._load_command(command), {**keywords, keyword: value})
    except graphscan.GraphscanError as exc:
        return exc


@pytest.mark.parametrize(
    ("command", "flag", "keyword", "value", "valid"),
    [pytest.param(*case, id=f"{case[0]}{case[1]}={case[3]}") for case in VALUES],
)
def test_the_command_line_and_a_call_build_the_same_group_or_refuse_alike(command, flag, keyword, value, valid):
    """One validator: a value the command line refuses (exit 2, one line) a call refuses in the
    same words but for how the option is named; a value it takes builds the same group."""
    here, there = built_from_command_line(command, flag, value), built_in_process(command, keyword, value)
    if valid:
        assert isinstance(here, dict) and here == there
        return
    assert isinstance(here, graphscan.GraphscanError) and isinstance(there, graphscan.GraphscanError)
    assert here.exit_code == there.exit_code == graphscan.EXIT_USAGE
    assert str(here).replace(f"argument {flag}:", f"argument {keyword}=:") == str(there)


@pytest.mark.parametrize("value", [True, "many"], ids=["bool", "text"])
def test_a_call_takes_no_value_the_command_line_would_not_parse(value):
    """In process a count is read as the command line reads its text: True is not a count."""
    refused = built_in_process("runtime", "runs", value)
    assert isinstance(refused, graphscan.GraphscanError) and refused.exit_code == graphscan.EXIT_USAGE


@pytest.mark.parametrize(
    ("command", "keyword", "expected"),
    [
        pytest.param("runtime", "session", graphscan.Session("extended", 1), id="runtime-session"),
        pytest.param("runtime", "timing", Timing(20), id="runtime-timing"),
        pytest.param("tune", "session", graphscan.Session("all", 1), id="tune-session"),
        pytest.param("check", "session", graphscan.Session("all", 1), id="check-session"),
        pytest.param("trace", "samples", graphscan.Samples(None, None, 0), id="trace-samples"),
        pytest.param("trace", "cpu", graphscan.CpuTarget("native"), id="trace-cpu"),
    ],
)
def test_a_group_left_out_is_built_with_the_documented_defaults(command, keyword, expected):
    """SPEC's defaults: runtime at level extended, tune and check's sessions at all, one thread,
    20 timed runs, seed 0, the native CPU; the same from the command line and in process."""
    arguments, keywords = BESIDE[command]
    paths = ["m.onnx"] * len(graphscan._load_command(command).paths)
    declared = graphscan._load_command(command)
    args = graphscan._build_parser(command).parse_args([command, *paths, *arguments])
    assert graphscan._command_keywords(declared, args)[keyword] == expected
    assert graphscan._in_process_keywords(declared, keywords)[keyword] == expected


def test_an_unknown_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'run'"):
        graphscan._in_process_keywords(graphscan._load_command("runtime"), {"run": 3})


def test_a_one_sample_command_takes_one_file_from_either_side(tmp_path):
    """trace runs one sample: two --inputs are refused on the command line and in a call alike
    (exit 2), a folder is exit 7 naming the option as given."""
    for given in (built_from_command_line("trace", "--inputs", "a.npz"), built_in_process("trace", "inputs", "a.npz")):
        assert isinstance(given, dict) and given["samples"].inputs == ["a.npz"]
    two = built_in_process("trace", "inputs", ["a.npz", "b.npz"])
    assert isinstance(two, graphscan.GraphscanError) and two.exit_code == graphscan.EXIT_USAGE
    folder = built_in_process("trace", "inputs", str(tmp_path))
    assert isinstance(folder, graphscan.GraphscanError) and folder.exit_code == graphscan.EXIT_INPUTS
    assert str(folder).startswith(f"inputs= {tmp_path}: a folder")
