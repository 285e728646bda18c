"""The fallback search's blocks: which nodes to keep float together, in what order.

impact measures, for each operator of a quantized model, the output SQNR gained by
keeping it float alone. A block is a set of operators tried together:

- ``node``: one operator impact ranks (gain at least ``MIN_GAIN_DB``);
- ``tail``: the last k operators in graph order (a model's head), k = 2, 4, 8, ...;
- ``around``: one of the best-ranked operators with the operators next to it;
- ``part``: the node the worst output part comes from, with 0, 1 and 3 of its nearest
  upstream operators: tried first, in that order (``part_blocks``).

Estimates rank them. The quantization noise of independent operators adds in power,
so an operator whose gain is g dB carries the share ``1 - 10**(-g/10)`` of the output
noise; a block removes the sum of its shares, and gains ``-10*log10(1 - sum)`` dB.
Its cost is what keeping it float costs in speed, counted as its weights' elements
(plus one per operator). The next block is the cheapest one estimated to reach the
target, else the one that buys most estimated gain per cost: a search by gain per
unit of speed, that stops as soon as the target is measured as met.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx

from graphscan import GraphIndex, data_source
from graphscan_ort.shared.parts import TensorParts

TOP_AROUND = 3  # the best-ranked operators that get an "around" block


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str  # node, tail or around
    nodes: tuple[str, ...]  # in graph order
    shares: tuple[float, ...]  # each node's share of the output noise (0 for unranked)
    cost: float

    def gain(self, kept: frozenset[str] = frozenset(), kept_share: float = 0.0) -> float:
        """Estimated dB gained by adding this block to the nodes ``kept`` (which already
        removed ``kept_share`` of the noise)."""
        new = sum(s for n, s in zip(self.nodes, self.shares, strict=True) if n not in kept)
        left = 1.0 - kept_share
        if left <= 0:
            return 0.0
        removed = min(new / left, 1.0 - 1e-12)
        return -10.0 * math.log10(1.0 - removed)


def noise_share(gain_db: float | None) -> float:
    """The share of the output noise an operator carries, from the dB its exclusion gains."""
    if gain_db is None or gain_db <= 0:
        return 0.0
    if math.isinf(gain_db):
        return 1.0
    return 1.0 - 10.0 ** (-gain_db / 10.0)


def weight_elements(model: onnx.ModelProto) -> dict[str, int]:
    """Per node name, the elements of the initializers it reads (its weights and bias)."""
    sizes = {t.name: math.prod(t.dims) for t in model.graph.initializer}
    return {node.name: sum(sizes.get(tensor, 0) for tensor in node.input) for node in model.graph.node}


def search_blocks(model: onnx.ModelProto, ranked: Sequence[Mapping[str, Any]], min_gain: float) -> list[Block]:
    """Every block of ``model`` (the model the quantizer was given) from impact's
    ``ranked`` operators, single nodes first in impact's order, then tails, then the
    neighbourhoods of the best-ranked; a set of nodes appears once."""
    order = [node.name for node in model.graph.node]
    position = {name: k for k, name in enumerate(order)}
    ranked_names = [r["node"] for r in ranked if r["node"] in position]
    share = {r["node"]: noise_share(r["gain_db"]) for r in ranked if r["node"] in position}
    elements = weight_elements(model)

    def block(kind: str, names: Iterable[str]) -> Block:
        nodes = tuple(sorted(set(names), key=position.__getitem__))
        return Block(kind, nodes, tuple(share.get(n, 0.0) for n in nodes), sum(1 + elements[n] for n in nodes))

    blocks = [block("node", [r["node"]]) for r in ranked if r["node"] in position and (r["gain_db"] or 0) >= min_gain]
    in_order = sorted(ranked_names, key=position.__getitem__)
    size = 2
    while size < len(in_order):
        blocks.append(block("tail", in_order[-size:]))
        size *= 2
    neighbours = adjacency(model, set(ranked_names))
    for node in [b.nodes[0] for b in blocks if b.kind == "node"][:TOP_AROUND]:
        blocks.append(block("around", [node, *neighbours.get(node, ())]))
    unique: dict[tuple[str, ...], Block] = {}
    for b in blocks:
        unique.setdefault(b.nodes, b)
    return list(unique.values())


PART_SIZES = (1, 2, 4)  # the worst part's node with this many operators upstream of it


def part_blocks(model: onnx.ModelProto, node: str | None, kept: frozenset[str]) -> list[Block]:
    """Blocks around the worst output part's node (shared/parts.py), tried before impact's
    ranking when the outputs have several parts: that node, then it with its nearest upstream
    operators (breadth first through the tensors it reads), ``PART_SIZES`` of them in all,
    nodes already ``kept`` apart. The part a target fails on is where the fix most likely is,
    whatever a pooled ranking says."""
    graph = model.graph
    producer = {out: n for n in graph.node for out in n.output if out}
    by_name = {n.name: n for n in graph.node if n.name}
    outputs = [o.name for o in graph.output]
    if node not in by_name or sum(map(len, TensorParts(model, outputs).sources.values())) < 2:
        return []  # one part in all: its neighbourhood is the model's tail, which the ranking's blocks cover
    found: list[str] = []
    queue, seen = [by_name[node]], {node}
    while queue and len(found) < max(PART_SIZES):
        current = queue.pop(0)
        if current.name not in kept:
            found.append(current.name)
        for tensor in current.input:
            upstream = producer.get(tensor)
            if upstream is not None and upstream.name and upstream.name not in seen:
                seen.add(upstream.name)
                queue.append(upstream)
    elements = weight_elements(model)
    blocks, taken = [], set()
    for size in PART_SIZES:
        nodes = tuple(found[:size])
        if nodes and nodes not in taken:
            taken.add(nodes)
            blocks.append(Block("part", nodes, (0.0,) * len(nodes), sum(1 + elements[n] for n in nodes)))
    return blocks


def adjacency(model: onnx.ModelProto, names: set[str]) -> dict[str, set[str]]:
    """Per operator of ``names``, the operators of ``names`` it reads from or feeds,
    looking through Q and DQ nodes (the core's ``data_source``: a given model may hold
    some)."""
    graph = model.graph
    index = GraphIndex(graph)
    neighbours: dict[str, set[str]] = {name: set() for name in names}
    for node in graph.node:
        if node.name not in names:
            continue
        for tensor in node.input:
            j = index.producer_of(data_source(index, graph, tensor)[0])
            producer = graph.node[j].name if j is not None else None
            if producer in names and producer != node.name:
                neighbours[node.name].add(producer)
                neighbours[producer].add(node.name)
    return neighbours


def next_block(
    blocks: list[Block],
    tried: set[tuple[str, ...]],
    kept: frozenset[str],
    kept_share: float,
    needed: float | None,
    room: int | None = None,
) -> Block | None:
    """The next block to try: of those not tried that add a node not yet kept (at most
    ``room`` of them), the cheapest estimated to gain ``needed`` dB (None: no estimate in
    dB, for metrics other than sqnr), else the one with the most estimated gain per cost;
    None when none is left."""
    left = [
        b
        for b in blocks
        if b.nodes not in tried and not set(b.nodes) <= kept and (room is None or len(set(b.nodes) - kept) <= room)
    ]
    if not left:
        return None
    if needed is not None:
        enough = [b for b in left if b.gain(kept, kept_share) >= needed]
        if enough:
            return min(enough, key=lambda b: b.cost)
    return max(left, key=lambda b: b.gain(kept, kept_share) / b.cost)
