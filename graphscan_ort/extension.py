"""The one door from graphscan.py into this package.

The core (graphscan.py) imports nothing of the package but this module, and only
when a command that runs models is asked for; everything else of the package
imports the core, never this module. It hands the core the declarations of the
package's commands and the two functions the core's own commands call. Each is
imported when it is asked for, so a run imports only the modules it needs.
``tests/cli/test_layout.py`` holds the door shut everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx

    from graphscan import Command
    from graphscan_ort.engines.classify import Classification


def fuse() -> Command:
    from graphscan_ort.commands.fuse import COMMAND

    return COMMAND


def trace() -> Command:
    from graphscan_ort.commands.trace import COMMAND

    return COMMAND


def runtime() -> Command:
    from graphscan_ort.commands.runtime import COMMAND

    return COMMAND


def impact() -> Command:
    from graphscan_ort.commands.impact import COMMAND

    return COMMAND


def tune() -> Command:
    from graphscan_ort.tune.command import COMMAND

    return COMMAND


# The package's commands: the core's registry names each with its summary alone.
DECLARED: dict[str, Callable[[], Command]] = {
    "fuse": fuse,
    "trace": trace,
    "runtime": runtime,
    "impact": impact,
    "tune": tune,
}


def command(name: str) -> Command:
    """The declaration of the package's command ``name``; its module is imported now."""
    return DECLARED[name]()


def check_measurements() -> Callable[..., tuple[dict[str, float], dict[str, dict[str, Any]], Any]]:
    """check's budgets that run the model (``commands/check.measurements``: values, what each
    row says beside its value, and the CPU target's facts or None), imported now."""
    from graphscan_ort.commands.check import measurements

    return measurements


def runtime_classifier() -> Callable[[onnx.ModelProto, str], Classification]:
    """What onnxruntime runs for each node of a model (``engines/classify.classify``, the
    runtime command's classes), imported now: ``dot --runtime`` colours by it."""
    from graphscan_ort.engines.classify import classify

    return classify
