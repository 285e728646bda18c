"""Nodes kept float in every candidate of a stage: the user's, and the structural fixes that
are free in speed.

A detector's output Concat joins box pixels with class probabilities; one int8 scale over
it erases the probabilities, and keeping that one node float fixes it at the same speed.
Two structural seeds reach such fixes without a search:

- ``outputs``: the nodes that produce the graph's outputs;
- ``wide_concats``: the Concats whose inputs' float ranges (max - min over the calibration
  samples) differ by more than ``WIDE_CONCAT_FACTOR``: one scale cannot serve both.

The user's seeds (``--exclude NODE``, ``--keep-outputs-float``) go into every candidate.
"""

from __future__ import annotations

import numpy as np
import onnx

from graphscan import EXIT_USAGE, GraphscanError, shown
from graphscan_ort.engines.levels import part_ranges

# Inputs of one Concat whose ranges differ by more than this share one scale badly: the
# narrow one keeps fewer than 1/16 of the levels (16 of 256 at int8).
WIDE_CONCAT_FACTOR = 16.0


def output_producers(model: onnx.ModelProto) -> list[str]:
    """The nodes that produce the graph's outputs, in graph order."""
    outputs = {o.name for o in model.graph.output}
    return [node.name for node in model.graph.node if node.name and outputs & set(node.output)]


def wide_concats(model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], path: str) -> list[str]:
    """The Concats of ``model`` whose inputs' float ranges on ``samples`` differ by more than
    WIDE_CONCAT_FACTOR (inputs that never vary are left out)."""
    concats = [n for n in model.graph.node if n.op_type == "Concat" and n.name and n.domain in ("", "ai.onnx")]
    constants = {i.name for i in model.graph.initializer}
    tensors = sorted({x for n in concats for x in n.input if x and x not in constants})
    if not tensors:
        return []
    ranges, _ = part_ranges(model, tensors, samples, path)
    spans = {t: span(found) for t, found in ranges.items()}
    wide = []
    for node in concats:
        widths = [spans[x] for x in node.input if x in spans and spans[x] > 0]
        if len(widths) > 1 and max(widths) > WIDE_CONCAT_FACTOR * min(widths):
            wide.append(node.name)
    return wide


def span(ranges: list[tuple[float, float] | None]) -> float:
    """max - min over every part of a tensor (0 without a finite value)."""
    found = [r for r in ranges if r is not None]
    return max(hi for _, hi in found) - min(lo for lo, _ in found) if found else 0.0


def structural_seeds(
    model: onnx.ModelProto, samples: list[dict[str, np.ndarray]], path: str, given: list[str]
) -> list[tuple[str, list[str]]]:
    """``[(kind, nodes)]``: the outputs' producers and the wide Concats of ``model``, each
    without the nodes already ``given``; empty and repeated sets dropped."""
    seeds: list[tuple[str, list[str]]] = []
    for kind, nodes in (("outputs", output_producers(model)), ("wide_concats", wide_concats(model, samples, path))):
        added = [n for n in nodes if n not in given]
        if added and all(added != other for _, other in seeds):
            seeds.append((kind, added))
    return seeds


def user_seeds(model: onnx.ModelProto, exclude: list[str] | None, keep_outputs_float: bool, path: str) -> list[str]:
    """The nodes the user keeps float in every candidate; exit 2 naming a node ``model`` lacks."""
    names = {node.name for node in model.graph.node}
    for node in exclude or []:
        if node not in names:
            raise GraphscanError(f"usage: --exclude {node!r}: {shown(path)} has no node of that name", EXIT_USAGE)
    seeds = list(dict.fromkeys(exclude or []))
    if keep_outputs_float:
        seeds += [n for n in output_producers(model) if n not in seeds]
    return seeds
