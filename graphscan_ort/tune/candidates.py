"""The quantizer settings tune will try, calibrated once and reproducible.

A candidate is the keyword arguments of one ``quantize_static`` call, kept as
JSON (enums by name), so that a user can re-run exactly that call on the
prepared model with the same calibration data and get the same model.
Calibration runs once per prepared model and calibration method, one sample's
tensors at a time (calibration.py: onnxruntime's ranges, not its peak memory): the
ranges go into onnxruntime's own calibration cache (``calibration_cache_path``) and
every candidate of that method reads them. Neither the activation type nor
per-channel weights change the ranges, so the cache is exact for all of them.

The calibration refinements (``refinements``) change only the ranges: Entropy,
Percentile at other percentiles, MinMax with a moving average. They are tried on
the best candidate when no candidate meets the target, each with a cache of its own.
(Per-channel weights are already symmetric: ``WeightSymmetric`` defaults to True.)

Dynamic candidates (``dynamic_settings``) are ``quantize_dynamic`` calls: weights
stored as integers, activations quantized at run time (MatMulInteger), no
calibration. They are tried where the model has a MatMul with a constant weight,
the operator onnxruntime's dynamic defaults make integer among MatMul and Gemm.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import onnx
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_utils,
    quantize_dynamic,
    quantize_static,
)
from onnxruntime.quantization.onnx_model import ONNXModel

from graphscan_ort.shared.sessions import quiet
from graphscan_ort.tune.calibration import calibrate

# The axes of the search: activation type, per-channel weights, calibration method.
ACTIVATION_TYPES = ["QUInt8", "QInt8"]


PER_CHANNEL = [False, True]


METHODS = ["MinMax", "Percentile"]


ENUMS = {"activation_type": QuantType, "weight_type": QuantType, "calibrate_method": CalibrationMethod}


def candidate_settings() -> list[dict]:
    """Every combination, as ``quantize_static`` keyword arguments in JSON form, weights int8, QDQ."""
    return [
        {
            "quant_format": "QDQ",
            "activation_type": activation,
            "weight_type": "QInt8",
            "per_channel": per_channel,
            "calibrate_method": method,
        }
        for activation, per_channel, method in itertools.product(ACTIVATION_TYPES, PER_CHANNEL, METHODS)
    ]


STATIC, DYNAMIC = "quantize_static", "quantize_dynamic"  # a row holds one's arguments, the other null
Row = TypeVar("Row", bound=Mapping[str, Any])  # a candidate's row (trials.candidate_row)


def static_rows(rows: list[Row]) -> list[Row]:
    """The rows quantize_static made: the ones that calibration, seeds and exclusions refine."""
    return [r for r in rows if r[STATIC] is not None]


# onnxruntime's own defaults: what a user gets from quantize_static without options.
DEFAULT_SETTINGS = {"activation_type": "QInt8", "per_channel": False, "calibrate_method": "MinMax"}


def defaults_settings(settings: Mapping[str, Any], rewrites: bool) -> bool:
    """Whether quantize_static's ``settings`` are onnxruntime's defaults, without rewrites."""
    return not rewrites and all(settings.get(k) == v for k, v in DEFAULT_SETTINGS.items())


def default_row(rows: list[Row]) -> Row | None:
    """The row quantize_static made with onnxruntime's defaults, without rewrites (None: none)."""
    return next((r for r in static_rows(rows) if defaults_settings(r[STATIC], r["rewrites"])), None)


# quantize_dynamic's weight types: its default first, then the other (u8 weights).
DYNAMIC_WEIGHT_TYPES = ["QInt8", "QUInt8"]


def dynamic_settings(model: onnx.ModelProto) -> list[dict]:
    """``quantize_dynamic`` keyword arguments in JSON form, onnxruntime's defaults with each
    weight type, where ``model`` has work for it (none otherwise)."""
    return [{"weight_type": weight_type} for weight_type in DYNAMIC_WEIGHT_TYPES] if has_dynamic_work(model) else []


def has_dynamic_work(model: onnx.ModelProto) -> bool:
    """Whether ``model`` has a MatMul whose weight (second input) is a constant: what
    quantize_dynamic's defaults turn into MatMulInteger (onnxruntime has no dynamic Gemm)."""
    constants = {t.name for t in model.graph.initializer}
    constants |= {o for node in model.graph.node if node.op_type == "Constant" for o in node.output}
    return any(
        node.op_type == "MatMul" and len(node.input) > 1 and node.input[1] in constants for node in model.graph.node
    )


# Calibration settings that change only the ranges: (calibrate_method, extra_options).
REFINEMENTS: list[tuple[str, dict[str, Any]]] = [
    ("Entropy", {}),
    ("Percentile", {"CalibPercentile": 99.99}),
    ("Percentile", {"CalibPercentile": 99.9}),
    ("MinMax", {"CalibMovingAverage": True}),
]


def refinements(base: dict) -> list[dict]:
    """``base``'s settings with each calibration refinement instead of its own calibration."""
    plain = {k: v for k, v in base.items() if k not in ("calibrate_method", "extra_options", "nodes_to_exclude")}
    return [
        {**plain, "calibrate_method": method, **({"extra_options": options} if options else {})}
        for method, options in REFINEMENTS
    ]


def calibration_key(settings: dict) -> str:
    """What decides a candidate's ranges: its method and calibration options (one cache each)."""
    options = {k: v for k, v in (settings.get("extra_options") or {}).items() if k.startswith("Calib")}
    return settings["calibrate_method"] + "".join(f"-{k}={v}" for k, v in sorted(options.items()))


def file_digest(path: str) -> str:
    """The SHA-256 of a file's bytes: two candidates the quantizer made identical are measured once."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def keyword_arguments(settings: dict) -> dict:
    """``settings`` (JSON form) as the keyword arguments quantize_static takes."""
    arguments = {}
    for key, value in settings.items():
        if key == "quant_format":
            arguments[key] = QuantFormat[value]
        elif key in ENUMS:
            arguments[key] = ENUMS[key][value]
        elif key == "extra_options" and "TensorQuantOverrides" in value:
            arguments[key] = {**value, "TensorQuantOverrides": overrides_arguments(value["TensorQuantOverrides"])}
        else:
            arguments[key] = value
    return arguments


def overrides_arguments(overrides: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """TensorQuantOverrides in JSON form as quantize_static takes them: ``rmin`` and ``rmax``
    as numpy float32 (onnxruntime reads their dtype; a Python float fails)."""
    return {
        name: [{k: np.float32(v) if k in ("rmin", "rmax") else v for k, v in entry.items()} for entry in entries]
        for name, entries in overrides.items()
    }


def cache_path(folder: str, key: str) -> str:
    """Where the calibration ranges of ``key`` (``calibration_key``) are kept for every candidate."""
    return os.path.join(folder, f"calibration-{key}.json")


class SampleReader(CalibrationDataReader):
    """The calibration samples for one quantize_static call: a consumed reader yields nothing."""

    def __init__(self, samples: list[dict]) -> None:
        self.left = iter(samples)

    def get_next(self) -> dict | None:
        return next(self.left, None)


def quantize_candidate(
    prepared: str,
    output: str,
    settings: dict,
    make_reader: Callable[[], CalibrationDataReader],
    cache_folder: str,
) -> None:
    """``quantize_static(prepared, output, **settings)``; the first candidate of a
    calibration method fills the cache with onnxruntime's ranges in bounded memory
    (calibration.py; a new reader each pass: a consumed one yields nothing), and every
    candidate reads the ranges from it."""
    cache = cache_path(cache_folder, calibration_key(settings))
    arguments = keyword_arguments(settings)
    with quiet():
        if not os.path.isfile(cache):
            calibrate(prepared, arguments, make_reader, cache)
        with readers_renamed_quickly(), initializers_found_quickly():
            quantize_static(prepared, output, None, calibration_cache_path=cache, **arguments)


@contextlib.contextmanager
def readers_renamed_quickly() -> Iterator[None]:
    """onnxruntime's quantizer, its readers of a tensor renamed as onnxruntime does it, the
    readers found in a ReadersIndex of the graph's nodes, not by comparing every input of
    every node in Python: ``ONNXModel.replace_input_of_all_nodes`` runs once per quantized
    tensor, 2.2 s of a 38.7 s tune run on YOLOv8n at 320 (6,275 calls). Each reader is renamed
    by onnxruntime's own ``replace_node_input``; a name that method gave a node elsewhere (the
    quantizer's dedicated pairs, a bias) is searched for in every node, so the model it writes
    is the same, byte for byte. For QDQ: onnxruntime's QOperator quantizers also assign node
    inputs themselves, which no index follows."""
    original = ONNXModel.replace_input_of_all_nodes
    original_replace = ONNXModel.replace_node_input
    own_descriptor = ONNXModel.__dict__["replace_node_input"]  # the staticmethod itself, put back as it was
    given_elsewhere: set[str] = set()  # names replace_node_input gave outside an index's rename
    indexes: dict[int, ReadersIndex] = {}  # by id: each index holds its field, so no id is reused

    def replace_node_input(node: Any, old_input_name: str, new_input_name: str) -> None:
        given_elsewhere.add(new_input_name)
        original_replace(node, old_input_name, new_input_name)

    def replace_input_of_all_nodes(self: ONNXModel, old_input_name: str, new_input_name: str) -> None:
        nodes = self.model.graph.node
        index = indexes.get(id(nodes))
        if index is None:
            index = indexes[id(nodes)] = ReadersIndex(nodes)
        index.rename(old_input_name, new_input_name, old_input_name in given_elsewhere, original_replace)

    ONNXModel.replace_input_of_all_nodes = replace_input_of_all_nodes
    ONNXModel.replace_node_input = staticmethod(replace_node_input)
    try:
        yield
    finally:
        ONNXModel.replace_input_of_all_nodes = original
        ONNXModel.replace_node_input = own_descriptor


class ReadersIndex:
    """Where each tensor's readers sit in one graph's node field, kept current as the field
    grows by appends (how onnxruntime's quantizer adds its Q and DQ nodes) and as ``rename``
    renames. Rebuilt whole when the field shrank or the node indexed last is no longer there.
    A position found is checked to read the name still; a node that came to read a name by
    another edit in place is not indexed under it, so ``rename`` searches every node for a
    name it is told was given so."""

    def __init__(self, nodes: Any) -> None:
        self.nodes = nodes
        self.rebuild()

    def rebuild(self) -> None:
        self.readers: dict[str, list[int]] = {}
        self.indexed, self.last = 0, None
        self.extend()

    def extend(self) -> None:
        for k in range(self.indexed, len(self.nodes)):
            for name in self.nodes[k].input:
                self.add(name, k)
        self.indexed = len(self.nodes)
        self.last = self.nodes[-1] if self.indexed else None

    def add(self, name: str, k: int) -> None:
        positions = self.readers.setdefault(name, [])
        if not positions or positions[-1] != k:  # a node reading one name twice; readers_of drops the rest
            positions.append(k)

    def current(self) -> None:
        count = len(self.nodes)
        if count < self.indexed or (self.indexed and self.nodes[self.indexed - 1] is not self.last):
            self.rebuild()
        elif count > self.indexed:
            self.extend()

    def readers_of(self, name: str, everywhere: bool) -> list[int]:
        """The positions of the nodes that read ``name`` now (``everywhere``: found by reading
        every node, for a name some edit in place may have given)."""
        self.current()
        if everywhere:
            return [k for k, node in enumerate(self.nodes) if name in node.input]
        return [k for k in dict.fromkeys(self.readers.get(name, [])) if name in self.nodes[k].input]

    def rename(self, old: str, new: str, everywhere: bool, replace: Callable[[Any, str, str], None]) -> None:
        """``replace_input_of_all_nodes``: every reader of ``old`` renamed by ``replace``
        (onnxruntime's ``replace_node_input``), and indexed under ``new``."""
        for k in self.readers_of(old, everywhere):
            replace(self.nodes[k], old, new)
            self.add(new, k)
        self.readers.pop(old, None)


class FirstByName:
    """Where the first item of each name sits in one protobuf repeated field (a model's
    initializers), kept current as the field grows by appends, which is how onnxruntime's
    quantizer adds to it. Rebuilt whole when the field shrank, when the item indexed last is
    no longer there (a removal, then appends), or when a found item has another name. An item
    renamed in place is not followed (its new name is not found): onnxruntime's quantizer
    never does that, it names a tensor before it adds it, and tests/tune/test_candidates.py
    holds its models to the bytes it writes without the index."""

    def __init__(self, items: Any) -> None:
        self.items = items
        self.rebuild()

    def rebuild(self) -> None:
        self.first: dict[str, int] = {}
        self.indexed, self.last = 0, None
        self.extend()

    def extend(self) -> None:
        for k in range(self.indexed, len(self.items)):
            self.first.setdefault(self.items[k].name, k)
        self.indexed = len(self.items)
        self.last = self.items[-1].name if self.indexed else None

    def find(self, name: str) -> Any:
        """The first item named ``name``, or None: quant_utils.find_by_name's answer."""
        count = len(self.items)
        if count < self.indexed or (self.indexed and self.items[self.indexed - 1].name != self.last):
            self.rebuild()
        elif count > self.indexed:
            self.extend()
        k = self.first.get(name)
        if k is not None and self.items[k].name != name:
            self.rebuild()
            k = self.first.get(name)
        return None if k is None else self.items[k]


@contextlib.contextmanager
def initializers_found_quickly() -> Iterator[None]:
    """onnxruntime's quantizer, its lookups of an initializer by name (``find_by_name``, as
    each of its modules imported it, and ``ONNXModel.get_initializer``) answered from a
    FirstByName of the field, not by reading every initializer in Python: a quarter of a
    quantize_static call from a calibration cache on PP-OCRv4's detector (0.57-0.61 s, not
    0.76-0.90 s). The same item, so the same model, byte for byte. Lists (the quantizer's new
    nodes) are still searched by onnxruntime's own function."""
    original = quant_utils.find_by_name
    original_get = ONNXModel.get_initializer
    indexes: dict[int, FirstByName] = {}  # by id: each index holds its field, so no id is reused

    def find_by_name(item_name: str, item_list: Any) -> Any:
        if isinstance(item_list, list):
            return original(item_name, item_list)
        index = indexes.get(id(item_list))
        if index is None:
            index = indexes[id(item_list)] = FirstByName(item_list)
        return index.find(item_name)

    def get_initializer(self: ONNXModel, name: str) -> Any:
        return find_by_name(name, self.model.graph.initializer)

    importers = [
        module
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("onnxruntime.quantization") and getattr(module, "find_by_name", None) is original
    ]
    for module in importers:
        module.find_by_name = find_by_name  # type: ignore[attr-defined]
    ONNXModel.get_initializer = get_initializer
    try:
        yield
    finally:
        for module in importers:
            module.find_by_name = original  # type: ignore[attr-defined]
        ONNXModel.get_initializer = original_get


def quantize_dynamic_candidate(prepared: str, output: str, settings: dict, *_calibration: object) -> None:
    """``quantize_dynamic(prepared, output, **settings)``: nothing to calibrate (quantize_candidate's
    reader and cache are not used)."""
    with quiet():
        quantize_dynamic(prepared, output, **keyword_arguments(settings))
