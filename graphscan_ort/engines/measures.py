"""trace's measurements of one row: tensor types, errors, SQNR, clipped counts."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from graphscan_ort.shared.metrics import count_outside, sqnr_db_of_norms

# A tensor reduced in the graph is cut into flat slices of this many elements, and
# numpy measures a fetched one this many elements at a time.
TRACE_CHUNK_ELEMENTS = 2**19


def tensor_dims(type_proto: onnx.TypeProto | None) -> list[int | None] | None:
    """A tensor type's dims (None where unknown), or None without a shape."""
    if type_proto is None or type_proto.WhichOneof("value") != "tensor_type":
        return None
    tensor_type = type_proto.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    # A dim_param leaves dim_value 0: a size-0 dimension counts as unknown too.
    return [d.dim_value if d.dim_value > 0 else None for d in tensor_type.shape.dim]


def shapes_agree(first: onnx.TypeProto | None, second: onnx.TypeProto | None) -> bool | None:
    """True when two types' shapes are known and equal, False when known to differ, else None."""
    a, b = tensor_dims(first), tensor_dims(second)
    if a is None or b is None:
        return None
    if len(a) != len(b) or any(x is not None and y is not None and x != y for x, y in zip(a, b)):
        return False
    return True if None not in a and None not in b else None


NOT_TENSOR_KINDS = {
    "sequence_type": "a sequence",
    "optional_type": "an optional",
    "map_type": "a map",
    "sparse_tensor_type": "a sparse tensor",
    "opaque_type": "an opaque value",
}


def type_problem(type_proto: onnx.TypeProto | None) -> str | None:
    """Why a tensor of this type cannot be compared (None: it can, or its type is unknown)."""
    if type_proto is None:
        return None
    kind = type_proto.WhichOneof("value")
    if kind is None:
        return None
    if kind != "tensor_type":
        return NOT_TENSOR_KINDS.get(kind, kind)
    if type_proto.tensor_type.elem_type == onnx.TensorProto.STRING:
        return "a string tensor"
    return None


def comparable_dtype(type_proto: onnx.TypeProto | None) -> bool:
    """Whether a tensor of this type is measured (numbers; unknown types are tried)."""
    if type_proto is None or not type_proto.tensor_type.elem_type:
        return type_problem(type_proto) is None
    elem_type = type_proto.tensor_type.elem_type
    return elem_type not in (onnx.TensorProto.STRING, onnx.TensorProto.BOOL)


def tensor_bytes(type_proto: onnx.TypeProto | None) -> tuple[int, int] | None:
    """Bytes of a tensor whose type and dims are all known, else None."""
    dims: list[Any] | None = tensor_dims(type_proto)
    if dims is None or None in dims:
        return None
    itemsize = item_size(type_proto.tensor_type.elem_type)  # type: ignore[union-attr]  # not None: it has dims
    return None if itemsize is None else (math.prod(dims), math.prod(dims) * itemsize)


@functools.cache
def item_size(elem_type: int) -> int | None:
    """Bytes per element of an ONNX tensor type, None when unknown."""
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize if elem_type else None
    except (KeyError, ValueError, TypeError):
        return None


def value_info_of(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    elem_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    return onnx.helper.make_tensor_value_info(name, elem_type, list(array.shape))


def error_stats(reference: object, value: object, signal: bool) -> tuple[float | None, float | None]:
    """(max |ref - value|, SQNR in dB, or None without ``signal``), or Nones when
    they cannot be compared. Measured in float64, TRACE_CHUNK_ELEMENTS values at
    a time, so the float64 copies stay small; sums of squares by sum_of_squares."""
    if not (isinstance(reference, np.ndarray) and isinstance(value, np.ndarray)):
        return None, None
    if reference.shape != value.shape or not (real_numbers(reference) and real_numbers(value)):
        return None, None
    reference, value = reference.reshape(-1), value.reshape(-1)
    noise = energy = largest = 0.0
    with np.errstate(all="ignore"):  # NaN or infinite values give NaN statistics, not warnings on stderr
        for start in range(0, reference.size, TRACE_CHUNK_ELEMENTS):
            ref = reference[start : start + TRACE_CHUNK_ELEMENTS]
            # Each value is widened to float64 as it is read: the difference is exact.
            difference = np.subtract(ref, value[start : start + TRACE_CHUNK_ELEMENTS], dtype=np.float64)
            # max |d| without an |d| array; + 0.0 turns a -0.0 into 0.0, and a NaN stays.
            chunk_max = max(float(difference.max()), -float(difference.min())) + 0.0
            if math.isnan(chunk_max):
                return math.nan, None  # numpy's max keeps a NaN; the noise is NaN
            largest = max(largest, chunk_max)
            noise += sum_of_squares(difference)
            if signal:
                energy += sum_of_squares(ref)
    return largest, sqnr_db_of_norms(math.sqrt(energy), math.sqrt(noise)) if signal else None


# Up to this many values, a sum of squares is BLAS's dot, which OpenBLAS runs on
# one thread at that size; a longer one is numpy's einsum, one thread at any size
# (OpenBLAS's threads would compete with onnxruntime and change the sums with the cores).
DOT_ELEMENTS = 8192


def sum_of_squares(values: np.ndarray) -> float:
    """The sum of squares of a flat array, in float64."""
    if values.size <= DOT_ELEMENTS:
        wide = values.astype(np.float64, copy=False)
        return float(wide.dot(wide))
    return float(np.einsum("i,i->", values, values, dtype=np.float64))


def real_numbers(array: np.ndarray) -> bool:
    """Whether an array holds real numbers (integers or floats), what trace measures."""
    return np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)


class Comparison:
    """max |reference - value| (and, with ``signal``, the SQNR) of two tensors of
    the combined model: fetched and measured in numpy, or reduced in the graph."""

    def __init__(self, reference: str, value: str, signal: bool = False) -> None:
        self.reference, self.value, self.signal = reference, value, signal
        self.scalars: dict[str, Any] | None = None  # names of the in-graph results when reduced
        self.outcome: tuple[float | None, float | None] = (None, None)  # result() once the session gave what it reads

    def names(self) -> list[str]:
        """The combined model's tensors result() reads."""
        if self.scalars is None:
            return [self.reference, self.value]
        return [n for group in self.scalars.values() for n in ([group] if isinstance(group, str) else group)]

    def result(self, values: Mapping[str, Any]) -> tuple[float | None, float | None]:
        """``(max_abs, sqnr_db)`` from ``values``: the fetched arrays and the feeds."""
        if self.scalars is None:
            return error_stats(values.get(self.reference), values.get(self.value), self.signal)
        if "shapes" in self.scalars:
            first, second = (values[n] for n in self.scalars["shapes"])
            if list(first) != list(second):
                return None, None
        noise_squared = float(values[self.scalars["noise"]])
        if math.isnan(noise_squared):
            return math.nan, None  # numpy's max keeps a NaN; ReduceMax need not
        largest = float(values[self.scalars["max"]])
        max_abs = largest if largest > 0 else 0.0  # an empty tensor: numpy's initial=0.0
        if not self.signal:
            return max_abs, None
        return max_abs, sqnr_db_of_norms(math.sqrt(float(values[self.scalars["signal"]])), math.sqrt(noise_squared))


class ClipCount:
    """Fraction of a tensor's values outside ``[lo, hi]``: counted in numpy or in the graph."""

    def __init__(self, tensor: str, lo: float, hi: float) -> None:
        self.tensor, self.lo, self.hi = tensor, lo, hi
        self.scalars: list[str | int] | None = None
        self.outcome: float | None = None

    def names(self) -> list[str]:
        if self.scalars is None:
            return [self.tensor]
        return [n for n in self.scalars if isinstance(n, str)]

    def result(self, values: Mapping[str, Any]) -> float | None:
        if self.scalars is None:
            array = values.get(self.tensor)
            if not isinstance(array, np.ndarray) or not np.issubdtype(array.dtype, np.number):
                return None
            count, size = count_outside(array, self.lo, self.hi), array.size
        else:
            count, size = (int(values[n]) if isinstance(n, str) else n for n in self.scalars)
        return count / size if size else None
