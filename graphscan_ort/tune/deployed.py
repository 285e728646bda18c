"""tune's measurements: a candidate as it will be deployed.

Accuracy, kernels and speed are all taken from onnxruntime sessions at the
level users run (default: onnxruntime's own default, all optimizations) with
``threads`` intra-op threads:

- ``sqnr_db``: the output SQNR against the float model, by the one definition
  impact and check use (``metrics.OutputNoise``, outputs paired by name);
- ``int8_fraction``, ``int8_kernels`` and ``wrapped_but_float`` by reason, from
  the runtime command's classes at that level;
- ``ms``: the median wall time of ``runs`` runs on the first sample, timed in
  alternation with the float model in this process; ``speedup`` is the float
  model's ms over the candidate's;
- ``bytes``: the file's size.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import onnx

from graphscan import shown
from graphscan_ort.engines.classify import classify, runtime_counts
from graphscan_ort.engines.timing import interleaved_wall_times
from graphscan_ort.shared.kernels import int8_fraction
from graphscan_ort.shared.metrics import OutputNoise, output_pairs
from graphscan_ort.shared.sessions import model_outputs, open_session, session_options


def kernel_counts(model: onnx.ModelProto, path: str, level: str) -> dict:
    """int8 share, int8 kernels and the reasons wrapped nodes run float, from runtime's classification."""
    rows = classify(model, path, level=level).rows
    classes = runtime_counts(rows)["classes"]
    reasons = Counter(
        row["reason"]["code"] if row["reason"] else None for row in rows if row["wrapped"] and row["class"] == "float"
    )
    return {
        "int8_fraction": int8_fraction(classes),
        "int8_kernels": classes["int8"],
        "wrapped_but_float": dict(sorted(reasons.items())),
    }


def measure_candidate(
    float_model: onnx.ModelProto,
    quant_model: onnx.ModelProto,
    float_path: str,
    quant_path: str,
    samples: list[dict],
    level: str = "all",
    threads: int = 1,
    runs: int = 20,
    references: dict[tuple[str, ...], OutputNoise] | None = None,
) -> dict:
    """``{"sqnr_db", "int8_fraction", "int8_kernels", "wrapped_but_float", "ms", "float_ms", "speedup", "bytes"}``
    of ``quant_model`` (written at ``quant_path``) against ``float_model`` (read from ``float_path``);
    ``references`` keeps the float model's outputs from one candidate to the next."""
    options = session_options(level, threads=threads)
    pairs = output_pairs(float_model, quant_model, float_path, quant_path)
    # output_sqnr's definition, with the float model's outputs kept in ``references``
    # (by the outputs paired): they are the same for every candidate, so they run once.
    references = {} if references is None else references
    wanted = tuple(f for f, _ in pairs)
    if wanted not in references:
        references[wanted] = OutputNoise(model_outputs(float_model, samples, float_path, list(wanted), options))
    quant_outputs = model_outputs(quant_model, samples, quant_path, [q for _, q in pairs], options)
    sqnr, exact = references[wanted].measure(quant_outputs)
    if exact:  # outputs equal to float's: infinitely accurate (null in the JSON), never the worst
        sqnr = math.inf
    sessions = [
        open_session(float_model, f"{shown(float_path)}: model", session_options(level, threads=threads)),
        open_session(quant_model, f"{shown(quant_path)}: model", session_options(level, threads=threads)),
    ]
    float_s, quant_s = interleaved_wall_times(sessions, samples[0], runs)
    return {
        "sqnr_db": sqnr,
        **kernel_counts(quant_model, quant_path, level),
        "ms": quant_s * 1e3,
        "float_ms": float_s * 1e3,
        "speedup": float_s / quant_s if quant_s > 0 else None,
        "bytes": os.path.getsize(quant_path),
    }
