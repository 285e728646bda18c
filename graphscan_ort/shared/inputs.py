"""Model inputs: what every command that runs a model feeds it.

The declared inputs of a model, ``--shape NAME=D0,D1,...``, ``--inputs
FILE.npz`` (one sample per file) and seeded data. Every problem with them is
exit 7 naming the file or option, never a failure blamed on a healthy model.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Literal

import numpy as np
import onnx

from graphscan import (
    EXIT_INPUTS,
    EXIT_NO_FILE,
    GraphscanError,
    check_readable,
    dtype_name,
    one_line,
    shown,
    value_inputs,
)
from graphscan_ort.shared.options import Named

if TYPE_CHECKING:
    import zipfile


class InputSpec:
    """One graph input a run must feed: name, numpy dtype (None when it is not
    a plain numeric tensor) and dims (None for a symbolic or -1 dimension)."""

    def __init__(self, info: onnx.ValueInfoProto) -> None:
        self.name = info.name
        self.kind = info.type.WhichOneof("value")
        tensor_type = info.type.tensor_type
        self.dtype = None
        self.dims = None
        if self.kind == "tensor_type" and tensor_type.elem_type:
            try:
                self.dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
            except (KeyError, ValueError, TypeError):
                self.dtype = None
            if tensor_type.HasField("shape"):
                # Some exporters write -1 for "any size": symbolic, like dim_param.
                self.dims = [
                    d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor_type.shape.dim
                ]
        self.type_text = (
            dtype_name(tensor_type.elem_type) if self.kind == "tensor_type" else str(self.kind or "untyped")
        )

    @property
    def numeric(self) -> bool:
        return self.dtype is not None and (np.issubdtype(self.dtype, np.number) or np.issubdtype(self.dtype, np.bool_))

    def describe(self) -> str:
        dims = "?" if self.dims is None else "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"
        return f"{self.type_text} {dims}"


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    return [InputSpec(info) for info in value_inputs(model.graph)]


def parse_shapes(values: list[str] | None) -> dict[str, list[int]]:
    """``--shape NAME=D0,D1,...`` options as ``{name: [dims]}`` (exit 7 when unreadable)."""
    shapes = {}
    for text in values or ():
        name, sep, dims = text.rpartition("=")
        try:
            parsed = [int(d) for d in dims.split(",")] if dims.strip() else []
        except ValueError:
            parsed = None
        if not sep or not name or parsed is None or any(d < 0 for d in parsed):
            raise GraphscanError(f"--shape {text!r}: expected NAME=D0,D1,... with non-negative integers", EXIT_INPUTS)
        if name in shapes:
            raise GraphscanError(f"--shape: {name!r} given twice", EXIT_INPUTS)
        shapes[name] = parsed
    return shapes


def resolve_shape(spec: InputSpec, shapes: dict[str, list[int]], default_size: int) -> tuple[list[int], bool]:
    """The concrete shape to generate for ``spec``, and whether a default was used."""
    if spec.name in shapes:
        wanted = shapes[spec.name]
        fits = spec.dims is None or (
            len(wanted) == len(spec.dims) and all(d is None or d == w for d, w in zip(spec.dims, wanted))
        )
        if not fits:
            raise GraphscanError(
                f"--shape {spec.name}={','.join(map(str, wanted))}: the model declares {spec.describe()}",
                EXIT_INPUTS,
            )
        return list(wanted), False
    if spec.dims is None:
        raise GraphscanError(
            f"input {spec.name!r} has no declared shape; give it with --shape or --inputs", EXIT_INPUTS
        )
    defaulted = any(d is None for d in spec.dims)
    return [default_size if d is None else d for d in spec.dims], defaulted


GENERATION_CHUNK = 1 << 20  # values drawn at a time


def seeded_array(rng: np.random.Generator, shape: list[int], dtype: np.dtype | None) -> np.ndarray:
    """``rng.standard_normal(shape).astype(dtype)``, the same values, drawn a chunk
    at a time: no float64 copy of the whole input (it doubled a float32 input's memory)."""
    array = np.empty(shape, dtype)
    flat = array.reshape(-1)
    for start in range(0, flat.size, GENERATION_CHUNK):
        stop = min(flat.size, start + GENERATION_CHUNK)
        flat[start:stop] = rng.standard_normal(stop - start).astype(dtype)
    return array


def seeded_feeds(
    specs: list[InputSpec], shapes: dict[str, list[int]], seed: int, default_size: int
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Seeded data for every input: normal for floats, small integers otherwise.

    Returns ``(feeds, defaulted)``; ``defaulted`` names the inputs whose
    symbolic dimensions were set to ``default_size`` because nothing said otherwise.
    """
    unknown = sorted(set(shapes) - {s.name for s in specs})
    if unknown:
        raise GraphscanError(f"--shape: the model has no input {', '.join(map(repr, unknown))}", EXIT_INPUTS)
    rng = np.random.default_rng(seed)
    feeds, defaulted = {}, []
    for spec in specs:
        if not spec.numeric:
            # --inputs can give a string tensor; a sequence, map or optional nothing can.
            hint = "; give it with --inputs" if spec.dtype is not None else ", and --inputs holds only tensors"
            raise GraphscanError(
                f"input {spec.name!r} is {spec.describe()}: graphscan can only generate numeric tensors{hint}",
                EXIT_INPUTS,
            )
        shape, was_defaulted = resolve_shape(spec, shapes, default_size)
        if was_defaulted:
            defaulted.append(spec.name)
        size = math.prod(shape) * np.dtype(spec.dtype).itemsize
        if size > MAX_INPUT_BYTES:  # numpy cannot even allocate some: dims of 2**63 and more
            raise GraphscanError(
                f"input {spec.name!r} at {shape}: {size:,} bytes, above the {MAX_INPUT_BYTES:,} graphscan generates",
                EXIT_INPUTS,
            )
        feeds[spec.name] = seeded_array(rng, shape, spec.dtype)
    return feeds, defaulted


# A member whose declared size is above this is refused before it is read.
MAX_INPUT_BYTES = 8 * 1024**3


def read_npz_inputs(path: str, specs: list[InputSpec]) -> dict[str, np.ndarray]:
    """The arrays ``specs`` need from the .npz at ``path``, each checked against
    its declared dtype and shape before its data is read; other members are
    never read."""
    import zipfile

    check_readable(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise GraphscanError(f"{shown(path)}: not an .npz file ({one_line(exc)})", EXIT_INPUTS)
    with archive:
        members = {}
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                raise GraphscanError(f"{shown(path)}: member {info.filename!r} is not a .npy array", EXIT_INPUTS)
            members[info.filename[: -len(".npy")]] = info
        missing = [s.name for s in specs if s.name not in members]
        if missing:
            raise GraphscanError(f"{shown(path)}: no array for input {', '.join(missing)}", EXIT_INPUTS)
        return {spec.name: read_npy_member(path, archive, members[spec.name], spec) for spec in specs}


NPY_HEADER_READERS = {(1, 0): "read_array_header_1_0", (2, 0): "read_array_header_2_0"}


def read_npy_member(path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo, spec: InputSpec) -> np.ndarray:
    """One member's array, refused before its data is read when it cannot feed ``spec``."""
    name = spec.name
    try:
        with archive.open(info) as f:
            version = np.lib.format.read_magic(f)
            read_header = NPY_HEADER_READERS.get(version)
            if read_header is None:
                raise GraphscanError(f"{shown(path)}: array {name!r} has .npy format {version}", EXIT_INPUTS)
            shape, fortran, dtype = getattr(np.lib.format, read_header)(f)
            if dtype.hasobject:
                raise GraphscanError(f"{shown(path)}: array {name!r} holds Python objects", EXIT_INPUTS)
            if any(d < 0 for d in shape):  # else the size below is negative and the read unbounded
                raise GraphscanError(f"{shown(path)}: array {name!r} declares shape {list(shape)}", EXIT_INPUTS)
            check_array_fits(path, spec, dtype, shape)
            count = math.prod(shape)
            if count * dtype.itemsize > min(MAX_INPUT_BYTES, info.file_size):
                raise GraphscanError(
                    f"{shown(path)}: array {name!r} declares {count * dtype.itemsize} bytes but the member holds "
                    f"{info.file_size}",
                    EXIT_INPUTS,
                )
            data = f.read(count * dtype.itemsize)
    except GraphscanError:
        raise
    except Exception as exc:
        raise GraphscanError(f"{shown(path)}: cannot read array {name!r} ({one_line(exc)})", EXIT_INPUTS)
    if len(data) != count * dtype.itemsize:
        raise GraphscanError(f"{shown(path)}: array {name!r} is truncated", EXIT_INPUTS)
    array = np.frombuffer(data, dtype=dtype)
    order: Literal["C", "F"] = "F" if fortran else "C"
    # np.require, not np.ascontiguousarray: that one turns a 0-d array into shape [1].
    array = np.require(array.reshape(shape, order=order), requirements="C").astype(dtype.newbyteorder("="), copy=False)
    return array.astype(object) if spec.dtype == np.dtype(object) else array  # onnxruntime's strings


def check_array_fits(path: str, spec: InputSpec, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """Exit 7 unless an array of ``dtype`` and ``shape`` can feed ``spec``."""
    # A string input takes a unicode or bytes array (onnxruntime converts it).
    is_text = spec.type_text == "STRING" and np.dtype(dtype).kind in "US"
    if not is_text and (spec.dtype is None or np.dtype(dtype).newbyteorder("=") != np.dtype(spec.dtype)):
        raise GraphscanError(
            f"{shown(path)}: array {spec.name!r} is {np.dtype(dtype).name} {list(shape)}, "
            f"the model wants {spec.describe()}",
            EXIT_INPUTS,
        )
    if spec.dims is not None and (
        len(shape) != len(spec.dims) or any(d is not None and d != s for d, s in zip(spec.dims, shape))
    ):
        raise GraphscanError(
            f"{shown(path)}: array {spec.name!r} has shape {list(shape)}, the model wants {spec.describe()}",
            EXIT_INPUTS,
        )


def model_samples(
    model: onnx.ModelProto,
    inputs: list[str] | None = None,
    shapes: dict[str, list[int]] | None = None,
    seed: int = 0,
    default_size: int = 1,
) -> tuple[list[dict[str, np.ndarray]], list[str]]:
    """The samples a command runs on: ``(list of feeds, defaulted input names)``.

    ``inputs``: a list of .npz paths, one sample each, or folders of them (``sample_files``);
    without any, one seeded sample with symbolic dimensions from ``shapes`` (``--shape``) or
    ``default_size``.
    """
    specs = input_specs(model)
    shapes = shapes or {}
    if inputs:
        if shapes:
            raise GraphscanError("--shape and --inputs: give one or the other", EXIT_INPUTS)
        return [read_npz_inputs(path, specs) for path in sample_files(inputs)], []
    feeds, defaulted = seeded_feeds(specs, shapes, seed, default_size)
    return [feeds], defaulted


def check_same_inputs(reference: Named, candidate: Named) -> None:
    """Exit 7 unless both models declare the same inputs (names, types, fixed dims)."""
    specs = [{s.name: s for s in input_specs(m.model)} for m in (reference, candidate)]
    a, b = reference.path, candidate.path
    if sorted(specs[0]) != sorted(specs[1]):
        raise GraphscanError(
            f"{shown(a)} and {shown(b)}: the models' inputs differ "
            f"({', '.join(sorted(specs[0]))} vs {', '.join(sorted(specs[1]))})",
            EXIT_INPUTS,
        )
    for name, first in specs[0].items():
        second = specs[1][name]
        same_rank = first.dims is None or second.dims is None or len(first.dims) == len(second.dims)
        dims_agree = same_rank and all(
            x is None or y is None or x == y for x, y in zip(first.dims or (), second.dims or ())
        )
        if first.type_text != second.type_text or not dims_agree:
            raise GraphscanError(
                f"{shown(a)} and {shown(b)}: input {name!r} is {first.describe()} in one "
                f"and {second.describe()} in the other",
                EXIT_INPUTS,
            )


def check_calibrates(samples: list[dict[str, np.ndarray]], files: list[str]) -> None:
    """Exit 7 naming ``--calibrate`` and the file of the first sample that cannot calibrate.

    onnxruntime's calibrators range every tensor by its min and max over every value: a float
    array holding a NaN or an infinity gives the tensors it reaches a NaN or infinite range
    (the quantizer refuses the scale, MinMax drops a NaN sample unsaid, an infinity widens
    every scale after it), and a sample whose arrays hold no value at all (a zero batch)
    ranges nothing (every scale 1.0). Evaluation samples are measured over their finite
    values and need neither rule."""
    for sample, file in zip(samples, files, strict=True):
        if all(array.size == 0 for array in sample.values()):
            shapes = ", ".join(f"{name} {list(array.shape)}" for name, array in sample.items())
            raise GraphscanError(
                f"--calibrate {shown(file)}: its arrays hold no value ({shapes}): a sample without values calibrates "
                "nothing",
                EXIT_INPUTS,
            )
        for name, array in sample.items():
            if array.dtype.kind != "f":
                continue
            bad = array.size - int(np.count_nonzero(np.isfinite(array)))
            if bad:
                raise GraphscanError(
                    f"--calibrate {shown(file)}: array {name!r} holds {bad} NaN or infinite values of {array.size}: "
                    "calibration ranges every tensor by its min and max, which they make NaN or infinite",
                    EXIT_INPUTS,
                )


def inputs_answer(samples: list[dict[str, np.ndarray]]) -> dict[str, list[int] | list[list[int]]]:
    """``{input: shape}``; a list of shapes, one per sample, when the samples differ."""
    answer = {}
    for name in samples[0]:
        shapes = [list(sample[name].shape) for sample in samples]
        answer[name] = shapes[0] if all(s == shapes[0] for s in shapes) else shapes
    return answer


def sample_files(paths: list[str]) -> list[str]:
    """``paths`` with every folder replaced by the .npz files in it, sorted: a folder of
    calibration samples is what users have. A folder without any is exit 7."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            try:
                names = os.listdir(path)
            except OSError as exc:  # unreadable: as a file that cannot be read
                raise GraphscanError(f"{shown(path)}: cannot read ({exc.strerror or exc})", EXIT_NO_FILE)
            found = sorted(os.path.join(path, name) for name in names if name.endswith(".npz"))
            if not found:
                raise GraphscanError(f"{shown(path)}: a folder without .npz samples", EXIT_INPUTS)
            files += found
        else:
            files.append(path)
    return files
