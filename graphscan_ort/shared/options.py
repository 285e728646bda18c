"""The option groups and argument types only the commands that run models take: ``Timing``
(``--runs``: runtime --time, tune) and ``finite_non_negative`` (``--tolerance``,
``--min-gain``, ``--min-speedup``); the others are the core's (graphscan.py, "Option
groups"). And ``Named``: a model and the path it was read from, the one argument every error
about a model names it by."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from graphscan import Option, Takes, finite_float, int_between

if TYPE_CHECKING:
    import onnx

RUNTIME_DEFAULT_RUNS = 20  # runtime --time's runs, and tune's per candidate
# The bound of --runs: beyond it a latency takes forever, so it is a usage error at once.
MAX_RUNS = 100_000


def finite_non_negative(text: str) -> float:
    """argparse type of ``--tolerance``, ``--min-gain``, ``--min-speedup``: a finite number >= 0
    (NaN would never be exceeded)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Timing:
    """How many timed runs a latency takes (``--runs``)."""

    runs: int = RUNTIME_DEFAULT_RUNS

    @classmethod
    def taken(cls, help_text: str) -> Takes:
        options: tuple[Option, ...] = (
            (
                "--runs",
                {
                    "type": int_between(1, MAX_RUNS),
                    "help": f"{help_text}, 1 to {MAX_RUNS} (default: {RUNTIME_DEFAULT_RUNS})",
                },
            ),
        )
        return Takes("timing", options, lambda given: cls(given["runs"] or RUNTIME_DEFAULT_RUNS))


@dataclasses.dataclass(frozen=True)
class Named:
    """A model and the path it was read from (or written at): every error about it names
    that path, so the two travel together as one argument."""

    model: onnx.ModelProto
    path: str
