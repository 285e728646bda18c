"""Parts of a tensor: what a Concat joined, traced index by index to its inputs.

A detector's output ``[1, 4 + classes, anchors]`` joins box coordinates in pixels
with class probabilities in 0..1; one SQNR over both hears only the boxes, and one
quantization scale over both can erase the probabilities. A *part* of a tensor is
the set of its elements traced, index by index, to one input of a Concat through
Concat, Split, Reshape, Transpose, Squeeze and Unsqueeze; the trace stops at any
other operator. A tensor with no such Concat behind it is one part.

    parts = TensorParts(float_model, ["output0"])
    labels = parts.labels(sample)["output0"]      # int64, the output's shape: part ids
    parts.sources["output0"]                      # part k's values come from this node

The labels are computed by onnxruntime itself: a copy of the model carries, beside
the traced operators, the same operators applied to arrays of part ids (a Concat's
inputs get ids of their own), so every Reshape, Split or Transpose is followed with
the runtime's own semantics. Labels depend only on the inputs' shapes and are kept
per shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphscan_ort.shared.graph import default_opset, fresh_prefix, with_outputs
from graphscan_ort.shared.sessions import run_model

# Operators that move elements without changing them: a part is followed through them.
PASS_THROUGH = ("Concat", "Split", "Reshape", "Transpose", "Squeeze", "Unsqueeze")
# ConstantOfShape, which gives each traced input its ids, exists from opset 9.
MIN_OPSET = 9


@dataclasses.dataclass
class Trace:
    """Where a tensor's parts come from: its label tensor in the copy (None: one part) and
    the node each part's values come from, by part id."""

    label: str | None
    sources: list[str | None]


class TensorParts:
    """The parts of some tensors of ``model`` (graph outputs or inner tensors)."""

    def __init__(self, model: onnx.ModelProto, tensors: Sequence[str]) -> None:
        self.model = model
        self.producer = {out: node for node in model.graph.node for out in node.output if out}
        self.prefix = fresh_prefix(model)
        self.nodes: list[onnx.NodeProto] = []
        self.traces: dict[str, Trace] = {}
        self.memo: dict[str, Trace | None] = {}  # every tensor traced so far: its nodes are built once
        self.leaves: dict[str, str] = {}
        traced = default_opset(model) >= MIN_OPSET
        for tensor in tensors:
            self.traces[tensor] = self.trace(tensor) if traced else Trace(None, [self.source(tensor)])
        self.sources = {tensor: trace.sources for tensor, trace in self.traces.items()}
        self.kept: dict[tuple, dict[str, np.ndarray | None]] = {}

    def source(self, tensor: str) -> str | None:
        """The node whose values ``tensor`` holds: its producer, followed back through the
        operators that only move elements (None: a graph input or initializer)."""
        node = self.producer.get(tensor)
        while node is not None and node.op_type in PASS_THROUGH and node.op_type != "Concat" and node.input:
            tensor = node.input[0]
            node = self.producer.get(tensor)
        return None if node is None else node.name or node.output[0]

    def trace(self, tensor: str) -> Trace:
        """``tensor``'s trace; its label nodes are added to ``self.nodes`` when it has a Concat behind it."""
        found = self.traced(tensor)
        return found if found is not None else Trace(None, [self.source(tensor)])

    def traced(self, tensor: str) -> Trace | None:
        """The trace of ``tensor`` when a Concat lies behind it through PASS_THROUGH
        operators, else None (one part, nothing to label)."""
        memo = self.memo
        if tensor in memo:
            return memo[tensor]
        memo[tensor] = None  # a cycle cannot happen in a graph; this only guards the recursion
        node = self.producer.get(tensor)
        if node is None or node.op_type not in PASS_THROUGH or node.domain not in ("", "ai.onnx"):
            return None
        data = [x for x in node.input if x] if node.op_type == "Concat" else node.input[:1]
        inner = [self.traced(x) for x in data]
        if node.op_type != "Concat" and inner[0] is None:
            return None
        labels: list[str] = []
        sources: list[str | None] = []
        for x, trace in zip(data, inner, strict=True):
            label = self.leaf(x) if trace is None or trace.label is None else trace.label
            found = [self.source(x)] if trace is None else trace.sources
            if node.op_type == "Concat" and sources:
                label = self.offset(label, len(sources))
            labels.append(label)
            sources += found
        outputs = [self.name(f"label/{out}") if out else "" for out in node.output]
        extra = list(node.input[len(data) :]) if node.op_type != "Concat" else []
        self.nodes.append(
            helper.make_node(
                node.op_type, [*labels, *extra], outputs, name=self.name(f"node/{node.output[0]}"), domain=node.domain
            )
        )
        self.nodes[-1].attribute.extend(node.attribute)
        for out, label in zip(node.output, outputs, strict=True):
            if out:
                memo[out] = Trace(label, sources)
        return memo[tensor]

    def leaf(self, tensor: str) -> str:
        """Part ids 0 in the shape of ``tensor``."""
        if tensor in self.leaves:
            return self.leaves[tensor]
        shape, label = self.name(f"shape/{tensor}"), self.name(f"leaf/{tensor}")
        zero = helper.make_tensor("value", TensorProto.INT64, [1], [0])
        self.nodes.append(helper.make_node("Shape", [tensor], [shape], name=shape))
        self.nodes.append(helper.make_node("ConstantOfShape", [shape], [label], name=label, value=zero))
        self.leaves[tensor] = label
        return label

    def offset(self, label: str, by: int) -> str:
        """``label + by``: a later Concat input's ids follow the earlier ones'."""
        unique = f"{len(self.nodes)}/{label}"
        constant, shifted = self.name(f"offset/{unique}"), self.name(f"shifted/{unique}")
        self.nodes.append(
            helper.make_node(
                "Constant",
                [],
                [constant],
                name=constant,
                value=helper.make_tensor("value", TensorProto.INT64, [], [by]),
            )
        )
        self.nodes.append(helper.make_node("Add", [label, constant], [shifted], name=shifted))
        return shifted

    def name(self, suffix: str) -> str:
        return f"{self.prefix}parts/{suffix}"

    def labelled(self) -> onnx.ModelProto | None:
        """The model with every traced tensor's labels as outputs (None: nothing to label)."""
        wanted = [trace.label for trace in self.traces.values() if trace.label is not None]
        return with_outputs(self.model, wanted, self.nodes) if wanted else None

    def labels(self, sample: dict[str, np.ndarray]) -> dict[str, np.ndarray | None]:
        """Each tensor's part id per element on ``sample``'s shapes (None: one part)."""
        key = tuple(sorted((name, np.shape(value)) for name, value in sample.items()))
        if key not in self.kept:
            found: dict[str, np.ndarray | None] = dict.fromkeys(self.traces)
            model = self.labelled()
            if model is not None:
                values = iter(run_model(model, sample, "graphscan's copy of the model that labels its parts"))
                for tensor, trace in self.traces.items():
                    if trace.label is not None:
                        found[tensor] = np.asarray(next(values))
            self.kept[key] = found
        return self.kept[key]
