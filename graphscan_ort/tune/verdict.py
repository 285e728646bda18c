"""tune's verdict: what a model must be, part by part, before tune says "reached".

A metric over the whole output can pass a model whose class scores collapsed (a detector's
boxes carry the energy). So besides the target, the model tune writes with exit 0 has

- no part of an output (shared/parts.py) whose SQNR is below ``WORST_PART_FLOOR_DB``, and
- no part of an output's quantized tensor spanning fewer than ``LEVELS_FLOOR`` steps of its
  scale (engines/levels.py), on the evaluation samples.

A row lists what breaks these in ``broken_parts``; tune warns about every quantized tensor
below the levels floor in the model it writes. Each row also says how its metric varies
by sample (``metric_worst``, ``metric_spread``): a pooled figure on easy samples passed a
detector that failed on held-out ones.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx

from graphscan_ort.engines.levels import LEVELS_FLOOR, FloatRanges, TensorLevels, output_tensors, quantized_activations

# Below this SQNR a part of an output has lost its task, whatever the target says: a detector's
# collapsed class scores sat at 0.6 dB (F1 0.43 against float on held-out photographs), the same
# model with its output Concat kept float at 10 dB (F1 0.85); a recognizer at 5.5 dB read 1 line of 36.
WORST_PART_FLOOR_DB = 6.0
# Below this many evaluation samples, tune says how little its verdict rests on.
FEW_SAMPLES = 8


def levels_figures(candidate: onnx.ModelProto, ranges: FloatRanges) -> tuple[dict[str, Any] | None, list[dict]]:
    """A candidate's fewest levels ``{"value", "tensor", "part", "node"}`` (None: no
    quantized tensor varies), and the parts of its outputs' quantized tensors below
    LEVELS_FLOOR as ``broken_parts`` entries."""
    found = ranges.levels(quantized_activations(candidate))
    if not found:
        return None, []
    worst = min(found.values(), key=lambda level: (level.levels, level.tensor))
    broken = [
        broken_part(output, level, f"{level.levels:.3g} levels of its scale (floor {LEVELS_FLOOR:g})")
        for tensor, output in sorted(output_tensors(candidate).items())
        for level in [found.get(tensor)]
        if level is not None and level.levels < LEVELS_FLOOR
    ]
    return {"value": worst.levels, "tensor": worst.tensor, "part": worst.part, "node": worst.node}, broken


def broken_part(output: str | None, level: TensorLevels, why: str) -> dict[str, Any]:
    return {"output": output, "part": level.part, "node": level.node, "why": why}


def sqnr_broken(sqnr_db: float | None, worst_part: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The worst output part as a ``broken_parts`` entry when its SQNR is below the floor."""
    if worst_part is None or sqnr_db is None or sqnr_db >= WORST_PART_FLOOR_DB:
        return []
    why = f"SQNR {sqnr_db:.3g} dB (floor {WORST_PART_FLOOR_DB:g} dB)"
    return [{**worst_part, "why": why}]


def low_levels_warning(candidate: onnx.ModelProto, ranges: FloatRanges) -> list[str]:
    """One warning per quantized tensor of the written model whose worst part spans fewer
    than LEVELS_FLOOR steps: its values there are mostly lost."""
    found = ranges.levels(quantized_activations(candidate))
    outputs = output_tensors(candidate)
    return [
        f"{level.tensor}{f' (output {outputs[level.tensor]})' if level.tensor in outputs else ''}: part "
        f"{level.part} (from {level.node}) spans {level.levels:.3g} steps of its scale, below {LEVELS_FLOOR:g}: "
        "its values are mostly lost"
        for level in sorted(found.values(), key=lambda level: (level.levels, level.tensor))
        if level.levels < LEVELS_FLOOR
    ]


def spread(values: list[float | None]) -> tuple[dict[str, Any] | None, list[float] | None]:
    """``({"sample", "value"}`` of the worst sample, ``[25th, 75th]`` percentiles) of a
    metric taken sample by sample (undefined samples left out; None without any)."""
    defined = [(v, k) for k, v in enumerate(values) if v is not None and not math.isnan(v)]
    if not defined:
        return None, None
    value, sample = min(defined)
    low, high = np.percentile(np.asarray([v for v, _ in defined], dtype=np.float64), [25, 75], method="nearest")
    return {"sample": sample, "value": value}, [float(low), float(high)]
