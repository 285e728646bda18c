"""graphscan's commands that run models, in onnxruntime, in four layers.

``graphscan.py`` (the onnx-only core beside this package) holds the counting
commands, the command registry and the exit codes; it imports a module of this
package only when a command that runs models is asked for. Imports go down the
layers, never sideways between commands (``tests/cli/test_layout.py``):

- ``shared``: sessions, inputs, metrics, graph editing, files and the kernel
  vocabulary of onnxruntime's optimized graph;
- ``engines``: what the commands measure with: runtime's mapping back from the
  optimized graph (``classify``), trace's combined model (``combined``,
  ``measures``), impact's derived model and its segments (``attribution``,
  ``segments``), and timing;
- ``commands``: ``fuse``, ``trace``, ``runtime``, ``impact`` and check's budgets
  that run the model (``check``), each declared in its own module;
- ``tune``: the tune pipeline (prepare, candidates, deployed, rewrites, command).

docs/DESIGN.md's layout section names every module.
"""
