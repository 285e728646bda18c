"""graphscan's commands that run models, in onnxruntime, in four layers.

``graphscan.py`` (the onnx-only core beside this package) holds the counting
commands, the command registry and the exit codes; it imports one module of this
package, ``extension`` (the one door: the package's commands and the two functions
the core calls), and only when a command that runs models is asked for. Imports
go down the layers, never sideways between commands (``tests/cli/test_layout.py``):

- ``shared``: sessions, inputs, metrics, graph editing, files, option types and
  the kernel vocabulary of onnxruntime's optimized graph;
- ``engines``: what the commands measure with: runtime's mapping back from the
  optimized graph (``classify``), trace's combined model (``combined``,
  ``measures``), impact's derived model and its segments (``attribution``,
  ``segments``), and timing;
- ``report``, beside the engines: a page drawn from answers alone (html, plots with
  matplotlib, the tune, runtime, check, trace and impact views, the island map, the
  plugin's pages), written by ``report``, tune's ``--report`` and the plugin;
- ``commands``: ``fuse``, ``trace``, ``runtime``, ``impact``, ``report`` and check's budgets
  that run the model (``check``), each declared in its own module;
- ``tune``: the tune pipeline (prepare, candidates, deployed, rewrites, command).

docs/DESIGN.md's layout section names every module.
"""

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at /dev/null for one block, then given back."""
    try:
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:  # no stderr to silence
        yield
        return
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# onnxruntime logs from C++ while it is imported, straight to descriptor 2: with an
# unwritable $HOME/.cache (HOME=/dev/null, a CI user) a coloured telemetry warning, two
# lines with raw escape codes. stderr is graphscan's one line, so the import is silenced
# here, before any module of the package imports onnxruntime; an ImportError still rises.
with _stderr_silenced():
    import onnxruntime  # noqa: F401
