"""runtime: what onnxruntime really executes for each operator.

"Wrapped" is a structural proxy. onnxruntime decides at session build time
which DQ -> op -> Q groups become integer kernels, so the only honest answer
comes from the graph it saves after optimization. One session, built from a
copy of the model in which every node has a unique name; each original
compute node is then found in the optimized graph and its kernel classified.
"""

from __future__ import annotations

from graphscan import (
    EXIT_USAGE,
    RUNTIME_DEFAULT_RUNS,
    RUNTIME_LEVELS,
    GraphscanError,
    load_with_weights,
)
from graphscan_ort.engines.classify import (
    classify,
)
from graphscan_ort.engines.timing import runtime_time
from graphscan_ort.shared.inputs import model_samples, parse_shapes
from graphscan_ort.shared.sessions import inputs_hint, runtime_environment


def runtime(
    path: str,
    level: str = "extended",
    provider: str = "CPUExecutionProvider",
    int8_allowed: bool = False,
    timed: bool = False,
    inputs: str | None = None,
    shape: list[str] | None = None,
    seed: int = 0,
    runs: int = RUNTIME_DEFAULT_RUNS,
) -> dict:
    """Per compute node: the kernel onnxruntime runs for it and its class."""
    if level not in RUNTIME_LEVELS:
        raise GraphscanError(f"usage: --level must be one of {', '.join(RUNTIME_LEVELS)}", EXIT_USAGE)
    if runs < 1:
        raise GraphscanError("usage: --runs must be at least 1", EXIT_USAGE)
    model = load_with_weights(path)
    shapes = parse_shapes(shape)
    found = classify(model, path, level, provider, int8_allowed)
    answer = {
        "model": path,
        "environment": runtime_environment(level, provider, int8_allowed),
        **found.counts,
        "nodes": found.rows,
        "unmapped": found.unmapped,
    }
    if timed:
        samples, defaulted = model_samples(found.named, [inputs] if inputs else None, shapes, seed, 1)
        with inputs_hint(not inputs, 1, [path]):
            answer["time"] = runtime_time(
                found.named_bytes,
                found.optimized_model,
                path,
                found.rows,
                found.optimized,
                samples[0],
                defaulted,
                level,
                provider,
                int8_allowed,
                runs,
            )
    return answer
