"""The one door from graphscan.py into this package.

The core (graphscan.py) imports nothing of the package but this module, and only
when a command that runs models is asked for; everything else of the package
imports the core, never this module. It hands the core the declarations of the
package's commands and the functions the core's own commands and its CPU target
call, each typed by the core's own types. Each is imported when it is asked for, so
a run imports only the modules it needs. ``tests/cli/test_layout.py`` holds the door
shut everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx

    from graphscan import BudgetJob, Command, Measured, TargetRunner
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


def report() -> Command:
    from graphscan_ort.commands.report import COMMAND

    return COMMAND


# The package's commands: the core's registry names each with its summary alone.
DECLARED: dict[str, Callable[[], Command]] = {
    "fuse": fuse,
    "trace": trace,
    "runtime": runtime,
    "impact": impact,
    "tune": tune,
    "report": report,
}


def command(name: str) -> Command:
    """The declaration of the package's command ``name``; its module is imported now."""
    return DECLARED[name]()


def measure_budgets(job: BudgetJob, names: Sequence[str]) -> tuple[dict[str, Measured], dict[str, Any] | None]:
    """check's budgets ``names`` that run the model, each by its measurer
    (``commands/check.measure``), and the CPU target's facts (None: native)."""
    from graphscan_ort.commands.check import measure

    return measure(job, names)


def runtime_classifier() -> Callable[[onnx.ModelProto, str], Classification]:
    """What onnxruntime runs for each node of a model (``engines/classify.classify``, the
    runtime command's classes), imported now: ``dot --runtime`` colours by it."""
    from graphscan_ort.engines.classify import classify

    return classify


def require_target(name: str) -> None:
    """Exit 2 naming the install command when CPU target ``name`` cannot run here."""
    from graphscan_ort.shared.targets import require

    require(name)


def target_runner(name: str, kept: bool) -> TargetRunner:
    """What calls functions of graphscan on CPU target ``name`` (``targets.Runner``)."""
    from graphscan_ort.shared.targets import Runner

    return Runner(name, kept)
