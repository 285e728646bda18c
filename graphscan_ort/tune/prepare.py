"""tune's first step: the float model the quantizer is given, prepared and verified.

1. onnxruntime's own ``quant_pre_process``; when it fails on a model (its
   symbolic shape inference needs sympy, and gives up on some graphs), once
   more without symbolic shape inference. Which path was taken is recorded.
2. Every Constant node holding a tensor made an initializer (bit-exact): the
   quantizer stores only initializers as int8.
3. The default-domain opset raised to 13 with onnx's version converter when it
   is older: per-channel weights need it.
4. Every unnamed node named ``<op_type>_<position>``: exclusions name nodes.
5. A type for every tensor onnx's shape inference leaves untyped (the outputs of
   contrib operators such as com.microsoft's Gelu, and every tensor after them),
   from onnxruntime's symbolic shape inference: the quantizer needs the type of
   every tensor it quantizes. The model quantize_dynamic is given gets the same.
6. The rewrites of ``rewrites.py``.

Every step's model is verified against the original model on the evaluation
samples (``metrics.verified``): NaN and infinities where the original has them,
then an output SQNR of at least PREPARE_MIN_SQNR_DB (80 dB), which float
reassociation (BatchNorm and constant folding) passes and a real change does not;
outputs with nothing finite to compare verify nothing. A step that fails is
dropped with its reason and the next one starts from the last good model.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from typing import TYPE_CHECKING

import onnx

from graphscan import GraphscanError, node_name, one_line
from graphscan_ort.shared.answers import PrepareStep
from graphscan_ort.shared.graph import default_opset, fresh_name, graph_names
from graphscan_ort.shared.metrics import PREPARE_MIN_SQNR_DB, verified
from graphscan_ort.shared.sessions import KeptRuns, quiet
from graphscan_ort.tune.candidates import has_dynamic_work
from graphscan_ort.tune.rewrites import REWRITES

if TYPE_CHECKING:
    from collections.abc import Iterator

    import numpy as np

PER_CHANNEL_OPSET = 13
TYPES = ("types", "dynamic_types")  # the steps that type tensors for the quantizer


def pre_processed(source: str, target: str) -> tuple[str | None, str]:
    """``(path or None, what happened)`` of onnxruntime's quant_pre_process on ``source``."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    source, target = os.path.abspath(source), os.path.abspath(target)
    try:
        with quiet(), inside(os.path.dirname(target)):
            quant_pre_process(source, target)
        return target, "quant_pre_process"
    except Exception as first:
        try:
            with quiet():
                quant_pre_process(source, target, skip_symbolic_shape=True)
            return target, f"with skip_symbolic_shape=True; without it, it failed ({one_line(first)})"
        except Exception as second:
            return (
                None,
                f"quant_pre_process failed ({one_line(first)}), and without symbolic shapes ({one_line(second)})",
            )


@contextlib.contextmanager
def inside(folder: str) -> Iterator[None]:
    """Work in ``folder``: onnxruntime's symbolic shape inference, when it gives up, saves
    its partial model as ``sym_shape_infer_temp.onnx`` in the current folder, which is the
    user's (a process-wide change: tune runs its steps one at a time)."""
    with contextlib.chdir(folder):
        yield


def untyped(model: onnx.ModelProto) -> list[str]:
    """The top-level tensors a node makes that onnx's shape inference leaves without a type,
    in node order ([] when it cannot run at all: the quantizer runs it too, and says why)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        return []
    graph = inferred.graph
    known = {value.name for value in [*graph.input, *graph.output, *graph.value_info] if has_type(value)}
    known.update(init.name for init in graph.initializer)
    return [name for node in graph.node for name in node.output if name and name not in known]


def has_type(value: onnx.ValueInfoProto) -> bool:
    """Whether ``value`` says what it holds (a tensor: its element type)."""
    kind = value.type.WhichOneof("value")
    return kind is not None and (kind != "tensor_type" or value.type.tensor_type.elem_type != 0)


def typed(model: onnx.ModelProto, folder: str) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with the types onnxruntime's symbolic shape inference finds
    for its ``untyped`` tensors (it knows onnxruntime's contrib operators), and how many;
    ``model`` itself when none is untyped. Raises what the inference raises."""
    missing = untyped(model)
    if not missing:
        return model, 0
    inferred = symbolic_shapes(model, folder)
    found = {value.name: value for value in inferred.graph.value_info if has_type(value)}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.value_info.extend(found[name] for name in missing if name in found)
    return out, sum(name in found for name in missing)


def symbolic_shapes(model: onnx.ModelProto, folder: str) -> onnx.ModelProto:
    """onnxruntime's symbolic shape inference of ``model`` (merging symbolic dimensions where
    they conflict), run in ``folder``."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    with quiet(), inside(folder):
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=True)
    if inferred is None:  # it refuses opsets before 7 with a log line only
        raise ValueError("it handles opset 7 and later only")
    return inferred


def types_step(
    current: onnx.ModelProto, samples: list[dict[str, np.ndarray]], folder: str, name: str
) -> tuple[onnx.ModelProto, list[PrepareStep]]:
    """``typed`` as the step ``name``, bit-exact (a type changes no value): ``(model, steps)``,
    no step when every tensor already has a type, a failed one when the inference fails."""
    try:
        model, count = typed(current, folder)
    except Exception as exc:
        missing = untyped(current)
        detail = f"onnxruntime's symbolic shape inference failed ({one_line(exc)}); {len(missing)} tensors stay untyped"
        return current, [step(name, False, detail, None)]
    if model is current:
        return current, []
    left = len(untyped(model))
    if not count:
        detail = f"onnxruntime's symbolic shape inference typed none of the {left} untyped tensors"
        return current, [step(name, False, detail, None)]
    error, problem = checked(current, model, samples, min_sqnr_db=math.inf)
    detail = f"{count} tensors typed by onnxruntime's symbolic shape inference (onnx's leaves them untyped)"
    if left:
        detail += f"; {left} still untyped"
    return (current if problem else model), [step(name, problem is None, problem or detail, error)]


def typing_failures(steps: list[PrepareStep]) -> str:
    """``; step: detail`` for each typing step that failed: when the quantizer refuses every
    candidate, a tensor left without a type is the likely cause."""
    return "".join(f"; {s['step']}: {s['detail']}" for s in steps if s["step"] in TYPES and not s["ok"])


def constants_as_initializers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with every top-level Constant node that holds a tensor made an
    initializer of its output's name, and how many: onnxruntime's quantizer stores only
    initializers as int8, and quantizes a weight a Constant makes at run time, like an
    activation (PP-OCR's models keep every weight so)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    outputs = {o.name for o in graph.output}
    taken = {init.name for init in graph.initializer}
    kept, count = [], 0
    for node in graph.node:
        value = next((a for a in node.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
        name = node.output[0] if node.output else ""
        if (
            node.op_type != "Constant"
            or node.domain not in ("", "ai.onnx")
            or value is None
            or not name
            or name in outputs
            or name in taken
        ):
            kept.append(node)
        else:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value.t)
            tensor.name = name
            graph.initializer.append(tensor)
            if out.ir_version < 4:  # before IR 4 an initializer is also a graph input
                graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
            count += 1
    del graph.node[:]
    graph.node.extend(kept)
    return out, count


def named_nodes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` in which every unnamed top-level node has its SPEC name
    (``<op_type>_<position>``, made unique), and how many: the quantizer keeps node names,
    and ``nodes_to_exclude`` names nodes, so an unnamed one could never be excluded."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = set(graph_names(out.graph))
    count = 0
    for i, node in enumerate(out.graph.node):
        if not node.name:
            node.name = fresh_name(node_name(node, i), taken)
            count += 1
    return out, count


def folding_lost(original: onnx.ModelProto, pre_processed: onnx.ModelProto) -> str:
    """What dropping quant_pre_process costs: the nodes it had folded away, by op type."""
    before = Counter(node.op_type for node in original.graph.node)
    after = Counter(node.op_type for node in pre_processed.graph.node)
    lost = before - after
    if not lost:
        return "nothing it folds"
    folded = ", ".join(f"{count} {op}" for op, count in sorted(lost.items(), key=lambda item: (-item[1], item[0])))
    return f"the {sum(lost.values())} nodes it folds ({folded})"


def step(name: str, ok: bool, detail: str, error: float | None) -> PrepareStep:
    return {"step": name, "ok": ok, "detail": detail, "max_abs_error": error}


def checked(
    original: onnx.ModelProto,
    candidate: onnx.ModelProto,
    samples: list[dict],
    min_sqnr_db: float = PREPARE_MIN_SQNR_DB,
    kept: KeptRuns | None = None,
) -> tuple[float | None, str | None]:
    """``verified``, with a model that cannot even be run counted as a failure of the step;
    ``kept``: ``original``'s runs kept from one step's check to the next."""
    try:
        onnx.checker.check_model(candidate, full_check=True)
        return verified(original, candidate, samples, min_sqnr_db, kept)
    except GraphscanError as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"fails the checker ({one_line(exc)})"


def prepare(
    float_path: str, folder: str, samples: list[dict[str, np.ndarray]], original: onnx.ModelProto
) -> tuple[onnx.ModelProto, onnx.ModelProto, list[PrepareStep]]:
    """tune's first step on ``original``, the model at ``float_path`` as tune read it:
    ``(base, rewritten, steps)``, the model without rewrites, the model with every rewrite
    that verifies (``base`` itself when none does), and every step
    (``{"step", "ok", "detail", "max_abs_error"}``). Each step checked against the original
    reads its outputs, run once."""
    kept = KeptRuns(original, "the model before the rewrite")
    base, steps = prepared_base(float_path, folder, samples, original, kept)
    rewritten, rewrite_steps = with_rewrites(base, original, samples, kept)
    return base, rewritten, steps + rewrite_steps


def prepared_base(
    float_path: str,
    folder: str,
    samples: list[dict[str, np.ndarray]],
    original: onnx.ModelProto,
    kept: KeptRuns | None = None,
) -> tuple[onnx.ModelProto, list[PrepareStep]]:
    """quant_pre_process and the opset, each verified (``kept``: the original's runs, as
    checked takes them): ``(model, steps)``."""
    steps, current = [], original
    path, detail = pre_processed(float_path, os.path.join(folder, "pre_processed.onnx"))
    if path is None:
        steps.append(step("quant_pre_process", False, detail, None))
    else:
        model = onnx.load(path)
        error, problem = checked(original, model, samples, kept=kept)
        if problem:
            detail = f"{detail}; {problem}; dropped, it costs {folding_lost(original, model)}"
        steps.append(step("quant_pre_process", problem is None, detail, error))
        current = model if problem is None else current
    model, count = constants_as_initializers(current)
    if count:  # even when quant_pre_process failed: the quantizer quantizes initializers only
        # Bit-exact against the model before the step (not the original: quant_pre_process's
        # folding already reassociated the float sums, which no rename or move can undo).
        error, problem = checked(current, model, samples, min_sqnr_db=math.inf)
        if problem is None and error:  # the same tensors, moved: any difference is a bug
            problem = f"by {error:.3g}: moving constants must change nothing"
        detail = f"{count} Constant nodes as initializers (the quantizer quantizes initializer weights only)"
        steps.append(step("constants", problem is None, problem or detail, error))
        current = model if problem is None else current
    if default_opset(current) < PER_CHANNEL_OPSET:
        try:
            model = onnx.version_converter.convert_version(current, PER_CHANNEL_OPSET)
            error, problem = checked(original, model, samples, kept=kept)
        except Exception as exc:
            error, problem = None, f"the version converter failed ({one_line(exc)})"
        detail = f"opset {default_opset(current)} -> {PER_CHANNEL_OPSET} (per-channel weights need it)"
        steps.append(step("opset", problem is None, problem or detail, error))
        current = model if problem is None else current
    model, count = named_nodes(current)
    if count:  # exclusions name nodes: an unnamed one could not be excluded
        error, problem = checked(current, model, samples, min_sqnr_db=math.inf)  # bit-exact, as above
        detail = f"{count} unnamed nodes named <op_type>_<position> (so that nodes_to_exclude can name them)"
        steps.append(step("names", problem is None, problem or detail, error))
        current = model if problem is None else current
    current, typing = types_step(current, samples, folder, "types")
    return current, steps + typing


def dynamic_base(
    original: onnx.ModelProto, samples: list[dict[str, np.ndarray]], folder: str
) -> tuple[onnx.ModelProto, list[PrepareStep]]:
    """The model quantize_dynamic is given: ``original`` with its Constant weights as
    initializers and its nodes named (both moves, bit-exact), never quant_pre_process,
    which fuses MatMul and Add into a Gemm that onnxruntime's dynamic quantizer leaves float;
    then typed (step ``dynamic_types``) where there is a MatMul for it to quantize. ``(model, steps)``."""
    model, _ = constants_as_initializers(original)
    model = named_nodes(model)[0]
    if not has_dynamic_work(model):
        return model, []
    return types_step(model, samples, folder, "dynamic_types")


def with_rewrites(
    base: onnx.ModelProto,
    original: onnx.ModelProto,
    samples: list[dict[str, np.ndarray]],
    kept: KeptRuns | None = None,
) -> tuple[onnx.ModelProto, list[PrepareStep]]:
    """``base`` with every rewrite that verifies (``kept``: the original's runs, as checked
    takes them): ``(model, steps)``."""
    steps, current = [], base
    for name, rewrite in REWRITES.items():
        model, count = rewrite(current)
        if not count:
            continue
        error, problem = checked(original, model, samples, kept=kept)
        steps.append(step(name, problem is None, problem or f"{count} nodes rewritten", error))
        current = model if problem is None else current
    return current, steps
