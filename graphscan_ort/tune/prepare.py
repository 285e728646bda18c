"""tune's first step: the float model the quantizer is given, prepared and verified.

1. onnxruntime's own ``quant_pre_process``; when it fails on a model (its
   symbolic shape inference needs sympy, and gives up on some graphs), once
   more without symbolic shape inference. Which path was taken is recorded.
2. The default-domain opset raised to 13 with onnx's version converter when it
   is older: per-channel weights need it.
3. The rewrites of ``rewrites.py``.

Every step's model is verified against the original model on the evaluation
samples (``metrics.verified``): NaN and infinities where the original has them,
then an output SQNR of at least PREPARE_MIN_SQNR_DB (80 dB), which float
reassociation (BatchNorm and constant folding) passes and a real change does not;
outputs with nothing finite to compare verify nothing. A step that fails is
dropped with its reason and the next one starts from the last good model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import onnx

from graphscan import GraphscanError, one_line
from graphscan_ort.shared.answers import PrepareStep
from graphscan_ort.shared.graph import default_opset
from graphscan_ort.shared.metrics import verified
from graphscan_ort.tune.rewrites import REWRITES

if TYPE_CHECKING:
    import numpy as np

PER_CHANNEL_OPSET = 13


def pre_processed(source: str, target: str) -> tuple[str | None, str]:
    """``(path or None, what happened)`` of onnxruntime's quant_pre_process on ``source``."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(source, target)
        return target, "quant_pre_process"
    except Exception as first:
        try:
            quant_pre_process(source, target, skip_symbolic_shape=True)
            return target, (f"quant_pre_process failed ({one_line(first)}); retried with skip_symbolic_shape=True")
        except Exception as second:
            return (
                None,
                f"quant_pre_process failed ({one_line(first)}), and without symbolic shapes ({one_line(second)})",
            )


def step(name: str, ok: bool, detail: str, error: float | None) -> PrepareStep:
    return {"step": name, "ok": ok, "detail": detail, "max_abs_error": error}


def checked(
    original: onnx.ModelProto, candidate: onnx.ModelProto, samples: list[dict]
) -> tuple[float | None, str | None]:
    """``verified``, with a model that cannot even be run counted as a failure of the step."""
    try:
        onnx.checker.check_model(candidate, full_check=True)
        return verified(original, candidate, samples)
    except GraphscanError as exc:
        return None, str(exc)
    except Exception as exc:
        return None, f"fails the checker ({one_line(exc)})"


def prepare(float_path: str, folder: str, samples: list[dict]) -> tuple[onnx.ModelProto, list[PrepareStep]]:
    """The prepared float model, rewrites included, and its steps (``{"step", "ok", "detail", "max_abs_error"}``)."""
    original = onnx.load(float_path)
    base, steps = prepared_base(float_path, folder, samples, original)
    rewritten, rewrite_steps = with_rewrites(base, original, samples)
    return rewritten, steps + rewrite_steps


def prepared_base(
    float_path: str, folder: str, samples: list[dict[str, np.ndarray]], original: onnx.ModelProto
) -> tuple[onnx.ModelProto, list[PrepareStep]]:
    """quant_pre_process and the opset, each verified: ``(model, steps)``."""
    steps, current = [], original
    path, detail = pre_processed(float_path, os.path.join(folder, "pre_processed.onnx"))
    if path is None:
        steps.append(step("quant_pre_process", False, detail, None))
    else:
        model = onnx.load(path)
        error, problem = checked(original, model, samples)
        steps.append(step("quant_pre_process", problem is None, f"{detail}; {problem}" if problem else detail, error))
        current = model if problem is None else current
    if default_opset(current) < PER_CHANNEL_OPSET:
        try:
            model = onnx.version_converter.convert_version(current, PER_CHANNEL_OPSET)
            error, problem = checked(original, model, samples)
        except Exception as exc:
            error, problem = None, f"the version converter failed ({one_line(exc)})"
        detail = f"opset {default_opset(current)} -> {PER_CHANNEL_OPSET} (per-channel weights need it)"
        steps.append(step("opset", problem is None, problem or detail, error))
        current = model if problem is None else current
    return current, steps


def with_rewrites(
    base: onnx.ModelProto, original: onnx.ModelProto, samples: list[dict[str, np.ndarray]]
) -> tuple[onnx.ModelProto, list[PrepareStep]]:
    """``base`` with every rewrite that verifies: ``(model, steps)``."""
    steps, current = [], base
    for name, rewrite in REWRITES.items():
        model, count = rewrite(current)
        if not count:
            continue
        error, problem = checked(original, model, samples)
        steps.append(step(name, problem is None, problem or f"{count} nodes rewritten", error))
        current = model if problem is None else current
    return current, steps
