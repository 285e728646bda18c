"""Nodes kept float in every candidate of a stage: the user's, and the structural fixes that
are free in speed.

A detector's output Concat joins box pixels with class probabilities; one int8 scale over
it erases the probabilities, and keeping that one node float fixes it at the same speed.
Two structural seeds reach such fixes without a search:

- ``outputs``: the nodes that produce the graph's outputs;
- ``wide_concats``: the Concats whose inputs' float ranges (max - min over the calibration
  samples) differ by more than ``WIDE_CONCAT_FACTOR``: one scale cannot serve both.

The user's seeds (``--exclude NODE``, ``--keep-outputs-float``) go into every candidate,
named as in the model the quantizer is given (``followed``): where preparing the model folded
a seed into another node (quant_pre_process folds a BatchNormalization into the Conv before
it, a MatMul and the Add after it into one Gemm), the node that now holds its arithmetic is
kept float, and the row says whose arithmetic it holds.
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
    WIDE_CONCAT_FACTOR (inputs that never vary are left out). A constant input counts by the
    spread of its values: the Concat's output scale spans them as it spans an activation's."""
    concats = [n for n in model.graph.node if n.op_type == "Concat" and n.name and n.domain in ("", "ai.onnx")]
    tensors = sorted({x for n in concats for x in n.input if x})
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


def followed(
    seeds: list[dict[str, str]], original: onnx.ModelProto, given: onnx.ModelProto, path: str
) -> list[dict[str, str]]:
    """The user's seeds (``{"node", "why"}``, nodes of ``original``) as nodes of ``given``, the
    model the quantizer is given: a seed folded into another node becomes that node, its
    entry ``{"node", "why", "folded": seed}``. Exit 2 for an ``--exclude`` of which nothing
    runs in ``given`` (folded into a constant, or removed); such an output producer of
    ``--keep-outputs-float`` is dropped (nothing to keep float)."""
    placed = []
    for seed in seeds:
        node = where_it_runs(seed["node"], original, given)
        if node is None and seed["why"] == "--exclude":
            raise GraphscanError(
                f"usage: --exclude {seed['node']!r}: preparing {shown(path)} for the quantizer removes it (nothing "
                "of it runs there: folded into a constant, or dropped); exclude a node that runs",
                EXIT_USAGE,
            )
        if node is not None:
            placed.append(seed if node == seed["node"] else {"node": node, "why": seed["why"], "folded": seed["node"]})
    return placed


def where_it_runs(name: str, original: onnx.ModelProto, given: onnx.ModelProto) -> str | None:
    """The node of ``given`` that computes what ``original``'s node ``name`` computed: itself,
    else the node that makes one of its outputs (a fold into the node before it keeps the
    folded node's output name), else, breadth first through readers that are gone too (fused
    with it), the node that makes theirs. None when nothing does: the outputs became constants,
    or the node was dropped and its readers, still there, read around it."""
    present = {node.name for node in given.graph.node}
    if name in present:
        return name
    made_by = {tensor: node.name for node in given.graph.node for tensor in node.output if tensor}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in original.graph.node:
        for tensor in node.input:
            readers.setdefault(tensor, []).append(node)
    queue = [node for node in original.graph.node if node.name == name]
    seen = {name}
    while queue:
        node = queue.pop(0)
        for tensor in node.output:
            if tensor in made_by:
                return made_by[tensor]
        for tensor in node.output:
            for reader in readers.get(tensor, []):
                if reader.name not in present and reader.name not in seen:
                    seen.add(reader.name)
                    queue.append(reader)
    return None
