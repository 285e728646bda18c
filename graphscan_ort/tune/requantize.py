"""One graph, many ranges: a quantize_static row made from another row's model.

Most of tune's rows differ from an earlier row only in their calibration ranges: another
calibration method or percentile, an activation's range overridden (``TensorQuantOverrides``
``rmin``/``rmax``), or nothing at all (a row bias-corrected after the quantizer). From the
same tensors' ranges onnxruntime 1.32's QDQ quantizer makes the same graph; the range values
decide only these initializers:

- each quantized activation T's ``T_scale`` and ``T_zero_point`` (``calc_graph_quant_params``:
  its own range, a Relu's or Clip's input given its output's, a Softmax output [0, 1]; a
  tensor that takes its producer's parameters, after a Resize, MaxPool or Reshape, has none);
- each int32 bias B's ``B_quantized`` and ``B_quantized_scale``, its scale the input's scale
  times the weight's (``quantize_bias_static_impl``);
- a weight W's ``W_scale`` and ``W_quantized`` where that bias scale is too small for int32 and
  the quantizer widens the weight's scale (``_adjust_weight_quant_params_for_bias_tensors``).

Which tensors have ranges is structure: it decides which Relu and Clip the quantizer removes
(``try_replacing_upstream_output``), and so is an override that does more than set a range (a
type, a conversion, an axis, an initializer's own parameters).

``RangePlan`` is built once from a model quantize_static wrote (the *base*), the prepared model
it was given, its arguments and its ranges: onnxruntime's own quantizer decides what it
quantizes (its ``quantize_model`` up to where ranges first enter), the base's graph says which
scales each bias reads, and the plan must reproduce every one of those initializers of the base
from the base's own ranges, byte for byte, or it is never used. ``plan.requantized(settings,
ranges)`` is then the model quantize_static writes for those arguments and ranges: a copy of the
base with those initializers replaced, each computed by the quantizer's own methods; None where
the quantizer would make another graph, and quantize_static makes that row.
``quantize_by_plan`` is quantize_candidate's stand-in that does this for tune's rows.

Example::

    plan = RangePlan("prepared.onnx", onnx.load("minmax.onnx"), settings, minmax_ranges)
    model = plan.requantized({**settings, "calibrate_method": "Entropy"}, entropy_ranges)
    onnx.save_model(model, "entropy.onnx")  # the bytes quantize_static writes for them
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantType
from onnxruntime.quantization.base_quantizer import QuantizationParams
from onnxruntime.quantization.calibrate import TensorsData, load_tensors_data
from onnxruntime.quantization.onnx_model import ONNXModel
from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
from onnxruntime.quantization.quant_utils import (
    load_model_with_shape_infer,
    quantize_onnx_initializer,
    tensor_proto_to_array,
    update_opset_version,
)
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry
from onnxruntime.quantization.tensor_quant_overrides import TensorQuantOverridesHelper

from graphscan_ort.shared.sessions import quiet
from graphscan_ort.tune.calibration import calibrate
from graphscan_ort.tune.candidates import (
    cache_path,
    calibration_key,
    file_digest,
    initializers_found_quickly,
    keyword_arguments,
    quantize_candidate,
)

__all__ = ["FirstRow", "RangePlan", "quantize_by_plan", "structure_key"]

# TensorQuantOverrides keys that change only the values computed from a tensor's range.
RANGE_OVERRIDES = frozenset({"rmin", "rmax", "symmetric", "reduce_range", "scale", "zero_point"})

# quantize_static's arguments that never reach the quantizer's graph: they choose the ranges.
CALIBRATION_ARGUMENTS = ("calibrate_method", "calibration_providers")


def structure_key(settings: dict[str, Any]) -> str | None:
    """What of ``settings`` (quantize_static's arguments in JSON form) decides the quantized
    graph, as one string: every argument but the calibration's (method, ``Calib*`` options)
    and the range overrides. None where a row may not be made from another: QOperator,
    external data, SmoothQuant (it changes the model), an override of more than a range."""
    extra = dict(settings.get("extra_options") or {})
    overrides = extra.pop("TensorQuantOverrides", {})
    if (
        settings.get("quant_format", "QDQ") != "QDQ"
        or settings.get("use_external_data_format")
        or extra.get("SmoothQuant")
        or not range_only(overrides)
    ):
        return None
    graph = {k: v for k, v in settings.items() if k not in (*CALIBRATION_ARGUMENTS, "extra_options")}
    graph["extra_options"] = {k: v for k, v in extra.items() if not k.startswith("Calib")}
    return json.dumps(graph, sort_keys=True)


def range_only(overrides: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether every override sets only a tensor's range or how it is turned into a scale:
    one per-tensor entry of RANGE_OVERRIDES keys each (no type, conversion or axis)."""
    return all(len(entries) == 1 and set(entries[0]) <= RANGE_OVERRIDES for entries in overrides.values())


def overrides_of(settings: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """``settings``' TensorQuantOverrides as quantize_static takes them (none: {})."""
    return (keyword_arguments(settings).get("extra_options") or {}).get("TensorQuantOverrides", {})


class Decided(Exception):
    """Raised by ``Marking`` where quantize_model first reads an activation's scale."""


class Marking(QDQQuantizer):
    """onnxruntime's QDQ quantizer stopped once it has decided what to quantize: its
    quantize_model marks every activation, weight and bias and computes the weights'
    parameters, then adjusts weights to their biases' scales, the first step that reads an
    activation's scale; there it stops, its graph edits not begun."""

    def _adjust_weight_quant_params_for_bias_tensors(self) -> None:
        raise Decided


class Bias(NamedTuple):
    """An int32 bias as the base's graph has it: its float name, the scales its scale is the
    product of (the input's and the weight's, by initializer name), its weight, its beta."""

    name: str
    input_scale: str
    weight_scale: str
    weight: str
    beta: float


def copied(params: QuantizationParams) -> QuantizationParams:
    """A copy of ``params`` whose arrays the weight adjustment may change in place (deep: its
    checks in QuantizationParams() refuse the numpy scalar an adjusted per-tensor scale is)."""
    return copy.deepcopy(params)


def same_params(a: QuantizationParams, b: QuantizationParams) -> bool:
    """Whether two weights' parameters quantize alike (scale and zero point)."""
    return bool(np.array_equal(a["scale"], b["scale"]) and np.array_equal(a["zero_point"], b["zero_point"]))


def made_by(
    quantizer: QDQQuantizer, make: Callable[[], object], given: list[onnx.TensorProto]
) -> list[onnx.TensorProto]:
    """The initializers ``make()`` adds to ``quantizer``'s model, run with a model that holds only
    ``given``: the quantizer's methods add what they make to its model and look up a bias there,
    one name at a time (in the prepared model's hundreds, or the row's growing list, that was
    most of a row's time)."""
    sink = ONNXModel(onnx.ModelProto(graph=onnx.GraphProto(initializer=given)))
    model, quantizer.model = quantizer.model, sink
    try:
        make()
    finally:
        quantizer.model = model
    return list(sink.initializer())[len(given) :]


class RangePlan:
    """The initializers of a quantize_static model that depend on its ranges, and how the
    quantizer computes each (see the module). ``refused``: why no row is made from this base
    (None: usable)."""

    def __init__(self, prepared_path: str, base: onnx.ModelProto, settings: dict[str, Any], ranges: TensorsData):
        self.base, self.key, self.refused = base, structure_key(settings), None
        self.index = {init.name: k for k, init in enumerate(base.graph.initializer)}
        self.range_names = frozenset(ranges.keys())
        if self.key is None:
            self.refused = "its arguments change more than ranges"
            return
        try:
            with quiet():
                self.quantizer = marked(prepared_path, keyword_arguments(settings), ranges)
        except Exception as exc:  # quantize_static refused the base's own arguments: no plan
            self.refused = f"onnxruntime's quantizer refused the base's arguments ({exc})"
            return
        self.unadjusted = {name: copied(p) for name, p in self.quantizer.initializer_quant_params.items()}
        # Its graph is final once marked, and calc_graph_quant_params maps every tensor's readers
        # again for each Relu and Clip (a third of a row's time on PP-OCRv4's detector): once.
        readers = self.quantizer.model.input_name_to_nodes()
        self.quantizer.model.input_name_to_nodes = lambda: readers
        # The prepared model's initializers as the quantizer holds them (a bias it duplicated for a
        # second reader included); its model is swapped while it makes initializers (made_by).
        self.floats = {init.name: init for init in self.quantizer.model.initializer()}
        if any(name in self.floats for name in overrides_of(settings)):  # in every weight decided here
            self.refused = "the base overrides an initializer's own parameters"
            return
        self.activations = [
            name
            for name in self.quantizer.quantization_params
            if name not in self.floats and f"{name}_scale" in self.index and f"{name}_zero_point" in self.index
        ]
        self.biases, self.refused = self.bias_sites()
        self.weights: dict[str, QuantizationParams] = {}  # each bias's weight as the base holds it
        if self.refused is None:
            self.refused = self.reproduces(settings, ranges)

    def bias_sites(self) -> tuple[list[Bias], str | None]:
        """Each quantized bias with the scales the base's graph multiplies for it (its node's
        input 0 and 1, through their DequantizeLinear); why not, where the graph is not so."""
        if not self.quantizer.quantize_bias:
            return [], None
        producers = {o: node for node in self.base.graph.node for o in node.output}
        readers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.base.graph.node:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        sites = []
        for name, info in self.quantizer.bias_to_quantize.items():
            if self.floats[name].data_type != onnx.TensorProto.FLOAT:  # float16: a Cast, or a float32 scale
                return [], f"bias {name} is not float32"
            consumers = readers.get(name, [])
            dequantize = producers.get(name)
            if dequantize is None or dequantize.input[0] != f"{name}_quantized" or len(consumers) != 1:
                return [], f"bias {name} is not one DequantizeLinear read once"
            scales = []
            for operand in consumers[0].input[:2]:
                producer = producers.get(operand)
                if producer is None or producer.op_type != "DequantizeLinear":
                    return [], f"the node reading bias {name} reads {operand} not through a DequantizeLinear"
                scales.append(producer.input[1])
            sites.append(Bias(name, scales[0], scales[1], info.weight_name, float(info.beta)))
        return sites, None

    def reproduces(self, settings: dict[str, Any], ranges: TensorsData) -> str | None:
        """Why the plan does not reproduce the base from its own ranges (None: it does, every
        initializer it computes byte for byte, every bias's weight scale included)."""
        made = self.initializers(overrides_of(settings), ranges)  # no weight is widened yet: self.weights is empty
        if made is None:
            return "the quantizer's parameters for the base's own ranges could not be computed"
        self.weights = self.weight_params  # the base's adjusted weights, a row's compared with them
        for name, params in self.weights.items():
            made |= {init.name: init for init in self.scale_and_zero_point(name, params)}
        for name, init in made.items():
            if name not in self.index:
                return f"the base has no initializer {name}"
            if init.SerializeToString() != self.base.graph.initializer[self.index[name]].SerializeToString():
                return f"{name} computed from the base's own ranges differs from the base's"
        return None

    def requantized(self, settings: dict[str, Any], ranges: TensorsData) -> onnx.ModelProto | None:
        """The model quantize_static writes for ``settings`` (JSON form, the base's but for their
        calibration and range overrides) with calibration ranges ``ranges``; None where it would
        make another graph or refuse them (it is then quantize_static's to make, or to refuse in
        its own words)."""
        if structure_key(settings) != self.key:
            raise ValueError("requantized: the settings differ from the base's in more than ranges")
        overrides = overrides_of(settings)
        method = keyword_arguments(settings).get("calibrate_method", CalibrationMethod.MinMax)
        if (
            self.refused is not None
            or frozenset(ranges.keys()) != self.range_names
            or ranges.calibration_method != method  # quantize_static refuses a cache of another method
            or any(name in self.floats for name in overrides)
        ):
            return None
        made = self.initializers(overrides, ranges)
        if made is None or any(name not in self.index for name in made):
            return None
        model = onnx.ModelProto()
        model.CopyFrom(self.base)
        for name, init in made.items():
            model.graph.initializer[self.index[name]].CopyFrom(init)
        return model

    def initializers(
        self, overrides: dict[str, list[dict[str, Any]]], ranges: TensorsData
    ) -> dict[str, onnx.TensorProto] | None:
        """Every range-dependent initializer for ``ranges`` and ``overrides``, by name, made by the
        quantizer's own methods (None: the quantizer refuses them)."""
        made: dict[str, onnx.TensorProto] = {}
        try:
            with quiet():
                self.parameters(overrides, ranges)
                for name in self.activations:
                    params = self.quantizer.quantization_params[name].original
                    made |= {init.name: init for init in self.scale_and_zero_point(name, params)}
                for name, params in self.widened_weights().items():
                    made |= {init.name: init for init in self.scale_and_zero_point(name, params)}
                    if f"{name}_quantized" in self.index:  # not with AddQDQPairToWeight: a float weight
                        made[f"{name}_quantized"] = quantize_onnx_initializer(
                            self.floats[name],
                            params["quant_type"],
                            params["zero_point"],
                            params["scale"],
                            params.get("axis"),
                            block_size=params.get("block_size", 0),
                        )
                for bias in self.biases:
                    made |= {init.name: init for init in self.quantized_bias(bias, made)}
        except Exception:  # the quantizer refuses these ranges or overrides: quantize_static says why
            return None
        return made

    def scale_and_zero_point(self, name: str, params: QuantizationParams) -> list[onnx.TensorProto]:
        """``name``'s scale and zero point initializers for ``params``, as the quantizer makes them."""
        return made_by(self.quantizer, lambda: self.quantizer._make_scale_zp_initializers(name, params), [])

    def quantized_bias(self, bias: Bias, made: dict[str, onnx.TensorProto]) -> list[onnx.TensorProto]:
        """``bias`` quantized by the quantizer for the scales of this row (``made``, else the
        base's): its int32 values, scale and zero point."""
        input_scale = tensor_proto_to_array(self.current(bias.input_scale, made))
        weight_scale = tensor_proto_to_array(self.current(bias.weight_scale, made))

        def quantize() -> None:
            self.quantizer.quantize_bias_static_impl(bias.name, input_scale, weight_scale, bias.beta)

        return made_by(self.quantizer, quantize, [self.floats[bias.name]])

    def parameters(self, overrides: dict[str, list[dict[str, Any]]], ranges: TensorsData) -> None:
        """Set the quantizer's activation and weight parameters for ``ranges`` and
        ``overrides`` as quantize_static's run would have them (raises what it raises)."""
        quantizer = self.quantizer
        quantizer.tensors_range = TensorsData(ranges.calibration_method, dict(ranges.data))  # it edits its copy
        quantizer.tensor_quant_overrides = TensorQuantOverridesHelper(overrides)
        valid, why = quantizer.tensor_quant_overrides.is_valid(
            quantizer.initializers, quantizer.value_infos.keys(), quantizer.activation_qType
        )
        if not valid:
            raise ValueError(why)
        quantizer.quantization_params = quantizer.calc_graph_quant_params()
        quantizer.initializer_quant_params = {name: copied(p) for name, p in self.unadjusted.items()}

        def adjust() -> None:  # Marking's own stops there; it reads only the biases of the model
            QDQQuantizer._adjust_weight_quant_params_for_bias_tensors(quantizer)

        made_by(quantizer, adjust, [self.floats[bias.name] for bias in self.biases])

    @property
    def weight_params(self) -> dict[str, QuantizationParams]:
        """Each bias's weight's parameters after the quantizer's adjustment (parameters())."""
        params = self.quantizer.initializer_quant_params
        return {bias.weight: copied(params[bias.weight]) for bias in self.biases if bias.weight in params}

    def widened_weights(self) -> dict[str, QuantizationParams]:
        """The weights whose adjusted parameters differ from the base's (parameters() set)."""
        now = self.weight_params
        return {name: p for name, p in now.items() if name in self.weights and not same_params(p, self.weights[name])}

    def current(self, name: str, made: dict[str, onnx.TensorProto]) -> onnx.TensorProto:
        """Initializer ``name`` as this row has it: made anew, or the base's."""
        return made[name] if name in made else self.base.graph.initializer[self.index[name]]


def marked(prepared_path: str, arguments: dict[str, Any], ranges: TensorsData) -> Marking:
    """onnxruntime's QDQ quantizer built as quantize_static builds it for ``arguments`` and
    ``ranges`` (its model loaded and typed the same way, the opset moved alike), its
    quantize_model run up to where the activations' scales are first read (which tensors have
    ranges decides which Relu and Clip it removes there)."""
    extra = dict(arguments.get("extra_options") or {})
    weight_type = arguments.get("weight_type", QuantType.QInt8)  # quantize_static's defaults
    activation_type = arguments.get("activation_type", QuantType.QInt8)
    model = update_opset_version(
        load_model_with_shape_infer(Path(prepared_path)),
        weight_type,
        activation_type,
        tensor_quant_overrides=extra.get("TensorQuantOverrides"),
        block_size=extra.get("BlockSize", 0),
    )
    with initializers_found_quickly():  # the quantizer's own lookups, answered alike
        quantizer = Marking(
            model,
            arguments.get("per_channel", False),
            arguments.get("reduce_range", False),
            weight_type,
            activation_type,
            TensorsData(ranges.calibration_method, dict(ranges.data)),  # it edits its copy
            arguments.get("nodes_to_quantize") or [],
            arguments.get("nodes_to_exclude") or [],
            arguments.get("op_types_to_quantize") or list(set(QLinearOpsRegistry) | set(QDQRegistry)),
            extra,
        )
        with contextlib.suppress(Decided):
            quantizer.quantize_model()
    return quantizer


class FirstRow(NamedTuple):
    """The first row quantize_static made of a structure: its file, the file's SHA-256 as
    written (a post step may change the file after), its settings and ranges."""

    path: str
    digest: str
    settings: dict[str, Any]
    ranges: TensorsData


def quantize_by_plan(
    plans: dict[tuple[str, str], RangePlan | FirstRow],
    prepared: str,
    output: str,
    settings: dict[str, Any],
    make_reader: Callable[[], CalibrationDataReader],
    cache_folder: str,
    fallback: Callable[..., None] | None = None,
) -> None:
    """quantize_candidate's stand-in: a row that differs only in its ranges from an earlier row
    of the same prepared model (``plans``, kept by the caller for the whole run) is made from
    that row's model, the bytes quantize_static writes; any other is quantize_static's (by
    ``fallback``, quantize_candidate's signature; None: quantize_candidate), and the first of
    its structure is kept to make the next from (the plan is built at the second)."""
    fallback = fallback or quantize_candidate
    key = structure_key(settings)
    if key is None:
        fallback(prepared, output, settings, make_reader, cache_folder)
        return
    cache = cache_path(cache_folder, calibration_key(settings))
    if not os.path.isfile(cache):  # the same cache quantize_candidate fills and reads
        with quiet():
            calibrate(prepared, keyword_arguments(settings), make_reader, cache)
    ranges = load_tensors_data(cache)
    entry = plans.get((prepared, key))
    if isinstance(entry, FirstRow) and file_digest(entry.path) == entry.digest:
        entry = plans[(prepared, key)] = RangePlan(prepared, onnx.load(entry.path), entry.settings, entry.ranges)
    if isinstance(entry, RangePlan):
        model = entry.requantized(settings, ranges)
        if model is not None:
            onnx.save_model(model, output)
            return
    fallback(prepared, output, settings, make_reader, cache_folder)
    if isinstance(entry, FirstRow):  # its file changed since: this row's is the base
        plans[(prepared, key)] = RangePlan(prepared, onnx.load(output), settings, ranges)
    elif entry is None:
        plans[(prepared, key)] = FirstRow(output, file_digest(output), settings, ranges)
