"""A model cut into consecutive segments, one per group of tensors calibration fetches.

calibration's histograms fetch a sample's calibrated tensors a group at a time (at most
GROUP_BYTES a run). ``cut_segments`` makes one model per group of the nodes that group needs
and no earlier group ran, reading what earlier segments made: the same kernels on the same
values (calibration's sessions optimize nothing), so a sample's groups take one pass over
the graph. ``group_model`` is the whole prefix a group needs, for a graph whose carried
tensors have no type onnx knows (a segment's inputs must be typed).
"""

from __future__ import annotations

from typing import NamedTuple

import onnx

from graphscan_ort.shared.graph import declared_values, element_types, node_reads


class Segment(NamedTuple):
    """One group's run (grouped_tensors): a model of the nodes it runs, the tensors it reads
    (the sample's inputs, or tensors earlier segments made), the group's tensors and the
    tensors it answers (the group's it makes, and those a later segment reads)."""

    model: onnx.ModelProto
    group: list[str]
    reads: list[str]
    answers: list[str]


def needed_after(segments: list[Segment], k: int) -> set[str]:
    """The tensors a segment after the k-th reads or fetches."""
    return {name for later in segments[k + 1 :] for name in [*later.reads, *later.group]}


def cut_segments(model: onnx.ModelProto, groups: list[list[str]]) -> list[Segment] | None:
    """``model`` cut into one Segment a group: each runs the nodes its group's tensors need
    that no earlier segment ran, reading the rest from the segments that made them (the same
    kernels on the same values: one pass over the graph, not one a group); None where a
    tensor carried between segments has no element type (carried_types)."""
    graph = model.graph
    producer = {output: k for k, node in enumerate(graph.node) for output in node.output}
    initializers = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    ran: set[int] = set()
    runs: list[list[int]] = []
    for group in groups:
        runs.append(sorted(needed_nodes(graph, producer, group, ran)))
        ran.update(runs[-1])
    made = [{o for k in run for o in graph.node[k].output if o} for run in runs]
    # A graph input may also be an initializer: its default, which a sample may override.
    inputs = {value.name for value in graph.input}
    outside = [
        {n for k in run for n in node_reads(graph.node[k]) if n not in mine and (n not in initializers or n in inputs)}
        for run, mine in zip(runs, made, strict=True)
    ]
    # A read no top-level node makes is a graph input, or a name a body defines for itself.
    reads = [sorted(n for n in reading if n in producer or n in inputs) for reading in outside]
    carried = {n for reading in reads for n in reading if n in producer}
    types = carried_types(model, carried)
    if any(not types.get(n) for n in carried):
        return None
    segments = []
    for k, (run, mine) in enumerate(zip(runs, made, strict=True)):
        later = {n for reading in reads[k + 1 :] for n in reading} | {n for g in groups[k + 1 :] for n in g}
        answers = sorted(n for n in mine if n in later or n in groups[k])
        segments.append(Segment(segment_model(model, run, reads[k], answers, types), groups[k], reads[k], answers))
    return segments


def carried_types(model: onnx.ModelProto, carried: set[str]) -> dict[str, int]:
    """The element types of tensors ``carried`` between segments: as the model declares them
    (the calibrator's model is typed), else as onnx's shape inference finds them (it copies
    the whole model, weights included: run only where a declaration is missing)."""
    declared = {
        v.name: v.type.tensor_type.elem_type for v in declared_values(model.graph) if v.type.HasField("tensor_type")
    }
    if all(declared.get(name) for name in carried):
        return declared
    return element_types(model)


def needed_nodes(graph: onnx.GraphProto, producer: dict[str, int], names: list[str], ran: set[int]) -> set[int]:
    """The nodes (their places in ``graph``) ``names`` need that are not in ``ran``."""
    kept: set[int] = set()
    wanted = list(names)
    while wanted:
        k = producer.get(wanted.pop())
        if k is None or k in kept or k in ran:
            continue
        kept.add(k)
        wanted.extend(node_reads(graph.node[k]))
    return kept


def segment_model(
    model: onnx.ModelProto, run: list[int], reads: list[str], answers: list[str], types: dict[str, int]
) -> onnx.ModelProto:
    """The nodes ``run`` of ``model`` as a model of their own, reading ``reads`` (graph inputs
    as declared, tensors made elsewhere typed by ``types``) and answering ``answers``."""
    graph = model.graph
    declared = {value.name: value for value in graph.input}
    nodes = [graph.node[k] for k in run]
    inputs = [
        declared[name] if name in declared else onnx.helper.make_tensor_value_info(name, types[name], None)
        for name in reads
    ]
    return nodes_as_model(model, nodes, inputs, answers)


def group_model(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """``model`` cut to the nodes ``names`` need, answering ``names``: a group's run computes
    no more of the graph than its tensors ask."""
    graph = model.graph
    producer = {output: k for k, node in enumerate(graph.node) for output in node.output}
    kept = needed_nodes(graph, producer, names, set())
    nodes = [node for k, node in enumerate(graph.node) if k in kept]
    return nodes_as_model(model, nodes, list(graph.input), names)


def nodes_as_model(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], answers: list[str]
) -> onnx.ModelProto:
    """``nodes`` of ``model`` as a model of their own reading ``inputs`` and answering
    ``answers``, with the initializers they read, ``model``'s opsets and functions."""
    graph = model.graph
    read = {name for node in nodes for name in node_reads(node)}
    cut = onnx.helper.make_graph(
        nodes,
        graph.name,
        inputs,
        [onnx.helper.make_empty_tensor_value_info(name) for name in answers],
        [t for t in graph.initializer if t.name in read],
        sparse_initializer=[t for t in graph.sparse_initializer if t.values.name in read],
    )
    made = onnx.helper.make_model(cut, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    made.functions.extend(model.functions)
    return made
