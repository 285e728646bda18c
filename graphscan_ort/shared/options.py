"""Argument types and bounds that only the commands that run models take (--runs,
--threads, --tolerance); the ones check and the counting commands share with them are
the core's (graphscan.py: ``non_negative_int``, ``finite_float``, the argument groups)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from graphscan import EXIT_USAGE, RUNTIME_LEVELS, GraphscanError, Option, finite_float

if TYPE_CHECKING:
    import onnx

RUNTIME_DEFAULT_RUNS = 20  # runtime --time's runs, and tune's per candidate
# Bounds of --runs and --threads: beyond them onnxruntime fails, crashes (100,000
# threads segfaulted after 52 s) or takes forever, so they are usage errors at once.
MAX_RUNS = 100_000
MAX_THREADS = 1024


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (exit 2 otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text!r}")
        return value

    parse.__name__ = f"integer from {low} to {high}"
    return parse


def check_between(flag: str, value: int, low: int, high: int) -> None:
    """Exit 2 unless ``value`` (of option ``flag``, given in-process) is from ``low`` to ``high``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise GraphscanError(f"usage: {flag} must be an integer from {low} to {high}, not {value!r}", EXIT_USAGE)


def finite_non_negative(text: str) -> float:
    """argparse type of ``--tolerance``: a finite number >= 0 (NaN would never be exceeded)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Named:
    """A model and the path it was read from (or written at): every error about it names
    that path, so the two travel together as one argument."""

    model: onnx.ModelProto
    path: str


# Option groups as typed values: built once from the command line's keywords (already
# parsed by the types above) or an in-process call's, checked when built, and passed whole.


@dataclasses.dataclass(frozen=True)
class Timing:
    """The timing group (``--runs``): how many timed runs a latency takes. Its range lives
    here alone: the command line's option (``option``) and a group built in-process check it."""

    runs: int = RUNTIME_DEFAULT_RUNS

    def __post_init__(self) -> None:
        check_between("--runs", self.runs, 1, MAX_RUNS)

    @staticmethod
    def option(help_text: str, default: int | None = None) -> Option:
        """``--runs`` as a command declares it (``default``: None leaves it to the command's ``absent``)."""
        settings: dict[str, object] = {"type": int_between(1, MAX_RUNS)}
        if default is not None:
            settings["default"] = default
        return ("--runs", {**settings, "help": help_text})


@dataclasses.dataclass(frozen=True)
class Session:
    """The session group (``--level``, ``--threads``): the onnxruntime sessions a deployed
    measurement runs in ("disabled" is no deployment). Its ranges live here alone, as Timing's."""

    level: str = "all"
    threads: int = 1

    def __post_init__(self) -> None:
        check_between("--threads", self.threads, 1, MAX_THREADS)
        if self.level not in RUNTIME_LEVELS:
            raise GraphscanError(f"usage: --level must be one of {', '.join(RUNTIME_LEVELS)}", EXIT_USAGE)

    @staticmethod
    def threads_option(help_text: str) -> Option:
        """``--threads`` as a command declares it (default 1); ``--level`` is the core's level_option."""
        return ("--threads", {"type": int_between(1, MAX_THREADS), "default": 1, "help": help_text})
