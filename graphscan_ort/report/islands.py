"""The island map on a page: ``graphscan dot`` of the answer's model, drawn by Graphviz's
``dot`` into inline SVG when it is on the PATH, else the DOT text and a one-line hint.

The model is the one the answer names (runtime's and check's ``model``, trace's and
impact's ``b``, tune's ``model.onnx`` in its ``output``), found as the answer names it from
the current folder, else beside the saved answer; when neither is a file, the section says
so and draws nothing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from graphscan import GraphIndex, GraphscanError, dot, load_model
from graphscan_ort.report.html import Html, code, details, join, paragraph, pre

COLLAPSE_OVER = 500  # compute nodes above which the map draws wrapped runs as one box (dot --collapse)
RENDER_SECONDS = 120  # Graphviz on a big graph: past this the DOT text is shown instead
HINT = "install Graphviz (apt-get install graphviz, brew install graphviz) and run report again to draw it"


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """A model an answer names: as the answer names it, and where it is read from (None: not found)."""

    named: str
    path: str | None


def named_model(command: str, answer: Mapping[str, Any]) -> str | None:
    """The quantized model an answer is about, as it names it (None: none written)."""
    if command == "tune":
        return os.path.join(answer["output"], "model.onnx") if "model.onnx" in answer["written"] else None
    if command in ("trace", "impact", "diff"):
        return str(answer["b"])
    if command == "fuse":
        return str(answer["output"])
    model = answer.get("model")
    return model if isinstance(model, str) else None


def locate(named: str, beside: str | None) -> ModelFile:
    """``named`` from the current folder, else relative to the folder ``beside`` (a saved answer's)."""
    candidates = [named] + ([os.path.join(beside, named)] if beside and not os.path.isabs(named) else [])
    return ModelFile(named, next((path for path in candidates if os.path.isfile(path)), None))


def island_map(model: ModelFile) -> tuple[Html, str | None]:
    """The map's HTML and, when it is not drawn, a note saying why."""
    if model.path is None:
        note = f"the island map of {model.named} is left out: no such file from here or beside the answer"
        return paragraph(note, class_="note"), note
    try:
        compute = len(GraphIndex(load_model(model.path).graph).compute_nodes)
        text = dot(model.path, collapse=compute > COLLAPSE_OVER)
    except GraphscanError as exc:
        note = f"the island map of {model.named} is left out: {exc}"
        return paragraph(note, class_="note"), note
    drawn, why = render(text)
    said = paragraph(
        "graphscan dot ",
        code(model.named),
        f" ({compute} compute nodes" + (", wrapped runs collapsed" if compute > COLLAPSE_OVER else "") + "): "
        "float islands are the dashed clusters, wrapped nodes green, float ones orange.",
    )
    if drawn is not None:
        return join([said, Html(f'<div class="map">{drawn}</div>'), details("the DOT text", pre(text))]), None
    note = f"the island map of {model.named} is DOT text: {why}"
    return join([said, paragraph(why, class_="note"), pre(text)]), note


def render(text: str) -> tuple[str | None, str]:
    """Graphviz's SVG of ``text`` (None and why when it cannot be had)."""
    graphviz = shutil.which("dot")
    if graphviz is None:
        return None, f"Graphviz's dot is not on the PATH: {HINT}"
    try:
        done = subprocess.run(
            [graphviz, "-Tsvg"], input=text.encode(), capture_output=True, timeout=RENDER_SECONDS, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"Graphviz's dot took over {RENDER_SECONDS} s; render the DOT below yourself (dot -Tsvg)"
    except OSError as exc:
        return None, f"Graphviz's dot did not start ({exc.strerror or exc}): {HINT}"
    svg = done.stdout.decode("utf-8", "replace")
    if done.returncode != 0 or "<svg" not in svg:
        why = done.stderr.decode("utf-8", "replace").strip().splitlines()[:1]
        return None, f"Graphviz's dot failed ({why[0] if why else f'exit {done.returncode}'})"
    return svg[svg.index("<svg") :], ""
