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
the runtime's own semantics. Labels depend on the inputs' shapes and on the values of
the inputs that can decide a shape on the way (``value_inputs``: a Slice's ends, a Split's
sizes, a NonZero's data, ...), and are kept per both: a model fed only floats that reach no
such place is labelled once per shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from graphscan_ort.shared.graph import body_reads, default_opset, fresh_prefix, with_outputs
from graphscan_ort.shared.sessions import does_not_run, open_session, run_options

# Operators that move elements without changing them: a part is followed through them.
PASS_THROUGH = ("Concat", "Split", "Reshape", "Transpose", "Squeeze", "Unsqueeze")
# ConstantOfShape, which gives each traced input its ids, exists from opset 9.
MIN_OPSET = 9
# Where the values of an input, not only its shape, decide the shape of an output (of the
# standard domain; None: every input). Any operator of another domain but ai.onnx.ml, and
# any with a body (If, Loop, Scan), is taken to decide shapes by all it reads.
SHAPE_FROM_VALUES: dict[str, tuple[int, ...] | None] = {
    "AffineGrid": (1,),
    "BlackmanWindow": (0,),
    "CenterCropPad": (1,),
    "Col2Im": (1, 2),
    "Compress": (1,),
    "ConstantOfShape": (0,),
    "DFT": (1, 2),
    "Expand": (1,),
    "HammingWindow": (0,),
    "HannWindow": (0,),
    "ImageDecoder": (0,),
    "MaxUnpool": (2,),
    "MelWeightMatrix": None,
    "NonMaxSuppression": None,
    "NonZero": (0,),
    "OneHot": (1,),
    "Pad": (1, 3),
    "Range": None,
    "Reshape": (1,),
    "Resize": (1, 2, 3),
    "SequenceAt": (1,),
    "SequenceErase": (1,),
    "SequenceInsert": (2,),
    "Slice": (1, 2, 3, 4),
    "Split": (1,),
    "SplitToSequence": (1,),
    "Squeeze": (1,),
    "STFT": (1, 2, 3),
    "StringNormalizer": (0,),
    "StringSplit": (0,),
    "Tile": (1,),
    "TopK": (1,),
    "Unique": (0,),
    "Unsqueeze": (1,),
    "Upsample": (1,),
    **{f"Reduce{kind}": (1,) for kind in ("L1", "L2", "LogSum", "LogSumExp", "Max", "Mean", "Min", "Prod", "Sum")},
    "ReduceSumSquare": (1,),
}
# Their output's values depend on their input's shape alone.
SHAPE_READERS = ("Shape", "Size")


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
        labelled = [tensor for tensor, trace in self.traces.items() if trace.label is not None]
        self.deciding = value_inputs(model, labelled) if labelled else set()
        self.session: ort.InferenceSession | None = None

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
        """Each tensor's part id per element on ``sample`` (None: one part)."""
        key = self.key(sample)
        if key not in self.kept:
            found: dict[str, np.ndarray | None] = dict.fromkeys(self.traces)
            model = self.labelled()
            if model is not None:
                values = iter(self.run(model, sample))
                for tensor, trace in self.traces.items():
                    if trace.label is not None:
                        found[tensor] = np.asarray(next(values))
            self.kept[key] = found
        return self.kept[key]

    def key(self, sample: dict[str, np.ndarray]) -> tuple:
        """What the labels on ``sample`` depend on: every input's shape, and the values of
        the inputs that can decide a shape (``self.deciding``)."""
        return tuple(
            (name, np.shape(value), value_bytes(value) if name in self.deciding else None)
            for name, value in sorted(sample.items())
        )

    def run(self, model: onnx.ModelProto, sample: dict[str, np.ndarray]) -> list:
        """The labelled copy's outputs on ``sample``, in one session kept for every sample."""
        subject = "graphscan's copy of the model that labels its parts"
        if self.session is None:
            self.session = open_session(model, subject)
        try:
            return self.session.run(None, sample, run_options())
        except Exception as exc:
            raise does_not_run(subject, exc)


def value_bytes(value: np.ndarray) -> tuple[str, bytes]:
    """An input's values as a key: its element type and bytes."""
    array = np.asarray(value)
    return array.dtype.str, np.ascontiguousarray(array).tobytes()


def value_inputs(model: onnx.ModelProto, tensors: Sequence[str]) -> set[str]:
    """The graph inputs whose values, not only their shapes, can change the parts of
    ``tensors``: those that reach a place deciding a shape (SHAPE_FROM_VALUES) of a node
    the tensors come from, through any operator but Shape and Size, which read a shape alone."""
    producer = {out: node for node in model.graph.node for out in node.output if out}
    shaped, valued = set(tensors), set[str]()  # tensors whose shape, or whose values, matter
    pending = [(tensor, False) for tensor in tensors]
    while pending:
        tensor, by_value = pending.pop()
        node = producer.get(tensor)
        if node is None:
            continue
        if by_value and node.op_type in SHAPE_READERS and node.domain in ("", "ai.onnx"):
            reads = [(node.input[0], False)]
        else:
            deciding = shape_deciding(node)
            reads = [(x, by_value or k in deciding) for k, x in enumerate(node.input) if x]
            reads += [(x, True) for x in body_reads(node)]
        for x, value in reads:
            seen = valued if value else shaped
            if x not in seen:
                seen.add(x)
                pending.append((x, value))
    return valued & {value.name for value in model.graph.input}


def shape_deciding(node: onnx.NodeProto) -> range | tuple[int, ...]:
    """The positions of ``node``'s inputs whose values can decide its outputs' shapes."""
    everything = range(len(node.input))
    bodies = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
    if bodies or node.domain not in ("", "ai.onnx", "ai.onnx.ml"):
        return everything
    if node.domain == "ai.onnx.ml":
        return ()
    positions = SHAPE_FROM_VALUES.get(node.op_type, ())
    return everything if positions is None else positions
