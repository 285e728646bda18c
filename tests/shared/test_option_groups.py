"""The session and timing groups (shared/options.py): one range each, held alike by the command
line's option the group declares and by the group built in-process. The ranges are docs/SPEC.md's:
``--runs`` 1 to 100,000, ``--threads`` 1 to 1,024, ``--level`` basic, extended or all."""

from __future__ import annotations

import argparse

import pytest

import graphscan
from graphscan_ort.shared.options import Session, Timing

RUNS = [
    pytest.param(1, True, id="runs-1"),
    pytest.param(100_000, True, id="runs-100000"),
    pytest.param(0, False, id="runs-0"),
    pytest.param(100_001, False, id="runs-100001"),
    pytest.param(-3, False, id="runs-negative"),
]
THREADS = [
    pytest.param(1, True, id="threads-1"),
    pytest.param(1024, True, id="threads-1024"),
    pytest.param(0, False, id="threads-0"),
    pytest.param(1025, False, id="threads-1025"),
]


def command_line_takes(option: tuple[str, dict], value: object) -> bool:
    """Whether the option's declared argparse type takes ``value`` as the command line would."""
    try:
        option[1]["type"](str(value))
    except argparse.ArgumentTypeError:
        return False
    return True


def group_takes(build, value: object) -> bool:
    """Whether the group built from ``value`` stands; a refusal is a usage error (exit 2)."""
    try:
        build(value)
    except graphscan.GraphscanError as exc:
        refused = exc
    else:
        return True
    assert refused.exit_code == graphscan.EXIT_USAGE
    return False


@pytest.mark.parametrize(("runs", "valid"), RUNS)
def test_runs_are_refused_alike_by_the_declared_option_and_the_group(runs, valid):
    option = Timing.option("help")
    assert option[0] == "--runs"
    assert command_line_takes(option, runs) is valid
    assert group_takes(Timing, runs) is valid


@pytest.mark.parametrize(("threads", "valid"), THREADS)
def test_threads_are_refused_alike_by_the_declared_option_and_the_group(threads, valid):
    option = Session.threads_option("help")
    assert option[0] == "--threads" and option[1]["default"] == 1
    assert command_line_takes(option, threads) is valid
    assert group_takes(lambda n: Session("all", n), threads) is valid


@pytest.mark.parametrize("value", [True, 2.0, "4"], ids=["bool", "float", "text"])
def test_a_group_built_in_process_takes_only_integers(value):
    """In process a value is not parsed from text: True, 2.0 and "4" are not counts."""
    assert not group_takes(Timing, value)
    assert not group_takes(lambda n: Session("all", n), value)


@pytest.mark.parametrize(
    ("level", "valid"),
    [("basic", True), ("extended", True), ("all", True), ("disabled", False), ("everything", False)],
)
def test_a_session_runs_at_a_deployed_level_only(level, valid):
    """ "disabled" is no deployment: check's --level takes it, a measured session does not."""
    assert group_takes(lambda name: Session(name), level) is valid
