"""check's budgets that run the model: the int8 share (runtime), the output SQNR and the
``--metric`` agreement (shared.agreement), on this CPU or on a CPU target (``--cpu``).

On a target, its own interpreter runs the sessions (``targets.run``): runtime's classes
for min_int8, both models' outputs for min_sqnr and min_metric (handed back in an .npz
and measured here by the same code as natively) and the float model's levels for
min_levels."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from typing import Any

import numpy as np
import onnx

from graphscan import (
    EXIT_INPUTS,
    EXIT_USAGE,
    FLOAT_BUDGETS,
    NO_METRIC,
    GraphscanError,
    MetricChoice,
    Samples,
    load_with_weights,
    shown,
)
from graphscan_ort.engines.classify import classify
from graphscan_ort.engines.levels import lowest_levels, quantized_activations, tensor_levels
from graphscan_ort.engines.trace import float_counterparts
from graphscan_ort.shared.agreement import Metric, metric, paired_value
from graphscan_ort.shared.inputs import check_same_inputs, model_samples, parse_shapes
from graphscan_ort.shared.kernels import int8_fraction
from graphscan_ort.shared.metrics import (
    FloatOutputs,
    PairedOutputs,
    output_layout,
    output_pairs,
    paired_outputs,
    require_numbers,
)
from graphscan_ort.shared.on_target import Target, keyed_outputs, load_samples, read_outputs, save_samples
from graphscan_ort.shared.options import Named
from graphscan_ort.shared.sessions import CPU, deployed_options, inputs_hint, model_outputs
from graphscan_ort.shared.targets import NATIVE, TARGETS, Facts, require


def measurements(
    path: str,
    names: list[str],
    float_path: str | None,
    samples: Samples,
    level: str = "all",
    model: onnx.ModelProto | None = None,
    chosen: MetricChoice = NO_METRIC,
    cpu: str = NATIVE,
) -> tuple[dict[str, float], dict[str, dict[str, Any]], Facts | None]:
    """The value of each budget in ``names`` (``min_int8``, ``min_sqnr``, ``min_levels``, ``min_metric``)
    for the quantized model at ``path`` (``model``: that model, when the caller already
    read it with its weights), what each budget's row says beside its value
    (min_metric's metric described, min_sqnr's pooled SQNR and worst part), and the CPU
    target's facts (None: native); ``level``: the optimization level min_sqnr and
    min_metric run at."""
    if cpu not in TARGETS:
        raise GraphscanError(f"usage: --cpu must be one of {', '.join(TARGETS)}", EXIT_USAGE)
    require(cpu)  # a missing target is one line naming the install command, before anything runs
    target = Target(cpu)
    values = {}
    described: dict[str, dict[str, Any]] = {}
    # The metric is checked before any model runs: a bad --metric is exit 2 at once.
    agreement = metric(chosen.name, chosen.threshold, chosen.blank, chosen.layout) if "min_metric" in names else None
    if "min_int8" in names:
        if cpu == NATIVE:
            model = load_with_weights(path) if model is None else model
            values["min_int8"] = int8_fraction(classify(model, path).counts["classes"])
        else:  # the target's own optimized session, as runtime --cpu reads it
            found_classes = target.run("graphscan_ort.commands.runtime:classes", [path, "extended", CPU, False])
            values["min_int8"] = int8_fraction(found_classes["classes"])
    if set(FLOAT_BUDGETS) & set(names):  # the budgets that run the float model too
        assert float_path is not None, "the core checks that the budgets that run --float come with it"
        model = load_with_weights(path) if model is None else model
        found, more = float_measurements(Named(model, path), float_path, names, samples, level, agreement, target)
        values.update(found)
        described.update(more)
    if agreement is not None:
        described["min_metric"] = {"metric": agreement.describe()}
    return values, described, target.facts


def float_measurements(
    quantized: Named,
    float_path: str,
    names: list[str],
    samples: Samples,
    level: str,
    agreement: Metric | None,
    target: Target | None = None,
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """min_sqnr, min_levels and min_metric: the budgets that run the float model too
    (both models on ``target``'s CPU)."""
    target = target or Target(NATIVE)
    reference = Named(load_with_weights(float_path), float_path)
    runs = checked_samples(reference, quantized, samples)
    values: dict[str, float] = {}
    described: dict[str, dict[str, Any]] = {}
    if "min_levels" in names:
        if target.native:
            values["min_levels"], described["min_levels"] = lowest_levels_budget(reference, quantized, runs)
        else:
            values["min_levels"], described["min_levels"] = levels_on_target(target, float_path, quantized.path, runs)
    if {"min_sqnr", "min_metric"} & set(names):
        if target.native:
            outputs = deployed_outputs(reference, quantized, runs, level)
        else:
            outputs = outputs_on_target(target, reference, quantized, runs, level)
        if "min_sqnr" in names:
            values["min_sqnr"] = measured_sqnr(outputs)
            figures = outputs.figures()
            pooled = math.inf if figures.exact else figures.pooled_db
            described["min_sqnr"] = {
                "pooled_sqnr_db": pooled if pooled is not None and math.isfinite(pooled) else None,
                "worst_part": figures.worst_part,
            }
        if agreement is not None:
            value = paired_value(outputs, agreement.reading(reference.model))
            values["min_metric"] = math.nan if value is None else value
    return values, described


@dataclasses.dataclass
class CheckSamples:
    """The samples both models run on: the ``--inputs`` ones, or one seeded sample (generated)."""

    samples: list[dict]
    generated: bool


def checked_samples(reference: Named, candidate: Named, given: Samples) -> CheckSamples:
    """The ``--inputs`` samples or one seeded sample, both models' inputs checked alike."""
    check_same_inputs(reference, candidate)
    samples, _ = model_samples(reference.model, given.inputs, parse_shapes(given.shape), given.seed or 0, 1)
    return CheckSamples(samples, not given.inputs)


def deployed_outputs(reference: Named, candidate: Named, runs: CheckSamples, level: str = "all") -> PairedOutputs:
    """Both models' outputs as users run them (a session at ``level``, onnxruntime's
    default "all"), paired as impact pairs them: run once for min_sqnr and min_metric alike."""
    pairs = output_pairs(reference, candidate)
    with inputs_hint(runs.generated, 1, [reference.path, candidate.path]):
        options = deployed_options(level)
        return paired_outputs(reference, candidate, runs.samples, pairs, options)


def lowest_levels_budget(reference: Named, candidate: Named, runs: CheckSamples) -> tuple[float, dict[str, Any]]:
    """min_levels' value (``inf`` when no quantized tensor has a part that varies) and what its
    row names: the tensor, its worst part and the node that part comes from."""
    with inputs_hint(runs.generated, 1, [reference.path]):
        steps = quantized_activations(candidate.model)
        named = float_counterparts(reference.model, candidate.model, steps, runs.samples[0] if runs.samples else {})
        unmatched = [tensor for tensor, found in named.items() if found is None]
        if unmatched:  # a budget that cannot measure a tensor would hold without looking at it
            shown_names = ", ".join(map(repr, unmatched[:3])) + (", ..." if len(unmatched) > 3 else "")
            raise GraphscanError(
                f"{shown(reference.path)}: {len(unmatched)} of {len(named)} quantized tensors of "
                f"{shown(candidate.path)} have no float tensor of the same name or node ({shown_names}): "
                "min_levels cannot measure them",
                EXIT_INPUTS,
            )
        found = lowest_levels(tensor_levels(reference.model, steps, runs.samples, reference.path, named))
    if found is None:
        return math.inf, {"tensor": None, "part": None}
    return found.levels, {"tensor": found.tensor, "part": {"part": found.part, "node": found.node}}


def measured_sqnr(outputs: PairedOutputs) -> float:
    """The quantized model's output SQNR against the float one by impact's definition
    (``metrics.OutputNoise``): ``inf`` when the outputs are equal, ``nan`` when the SQNR
    is undefined (NaN or Inf in the outputs, all-zero float outputs, an empty sample)."""
    sqnr, exact = outputs.sqnr()
    if outputs.reference.noise.empty:  # an empty sample verifies nothing: the budget does not hold
        return math.nan
    if exact:
        return math.inf
    return math.nan if sqnr is None else sqnr


# -- on a CPU target: the sessions run in its interpreter, the arrays come back in files


def target_outputs(
    float_path: str,
    quant_path: str,
    float_names: list[str],
    quant_names: list[str],
    level: str,
    samples_file: str,
    names: list[list[str]],
    answer: str,
) -> int:
    """Inside a CPU target: ``deployed_outputs``' sessions (both models at ``level``) on the
    saved samples, the outputs ``float_names`` and ``quant_names`` saved to ``answer``
    (.npz); the number of samples run."""
    samples = load_samples(samples_file, names)
    options = deployed_options(level)
    saved = {}
    for prefix, path, wanted in (("f", float_path, float_names), ("q", quant_path, quant_names)):
        model = load_with_weights(path)
        outputs = model_outputs(model, samples, path, wanted, options)
        require_numbers(Named(model, path), wanted, outputs)  # refused here as natively, never sent back
        saved.update(keyed_outputs(prefix, outputs))
    np.savez(answer, **saved)
    return len(samples)


def outputs_on_target(
    target: Target, reference: Named, candidate: Named, runs: CheckSamples, level: str
) -> PairedOutputs:
    """``deployed_outputs`` as ``target``'s CPU computes them: the same pairs, samples and
    sessions, run in its interpreter."""
    float_path, quant_path = reference.path, candidate.path
    pairs = output_pairs(reference, candidate)
    float_names, quant_names = [f for f, _ in pairs], [q for _, q in pairs]
    require_numbers(reference, float_names)
    require_numbers(candidate, quant_names)
    with tempfile.TemporaryDirectory(prefix="graphscan-check-") as folder:
        samples_file, names = save_samples(folder, runs.samples)
        answer = os.path.join(folder, "outputs.npz")
        arguments = [float_path, quant_path, float_names, quant_names, level, samples_file, names, answer]
        with inputs_hint(runs.generated, 1, [float_path, quant_path]):
            count = target.run(f"{__name__}:target_outputs", arguments)
        with np.load(answer) as saved:
            float_rows, quant_rows = (read_outputs(saved, prefix, count, len(pairs)) for prefix in "fq")
    layout = output_layout(reference.model, float_names, runs.samples)
    return PairedOutputs(FloatOutputs(float_rows, tuple(float_names), layout), quant_rows)


def target_levels(
    float_path: str, quant_path: str, samples_file: str, names: list[list[str]], generated: bool
) -> tuple[float | None, dict[str, Any]]:
    """Inside a CPU target: ``lowest_levels_budget`` on the saved samples (None: no part varies)."""
    runs = CheckSamples(load_samples(samples_file, names), generated)
    reference = Named(load_with_weights(float_path), float_path)
    value, described = lowest_levels_budget(reference, Named(load_with_weights(quant_path), quant_path), runs)
    return (value if math.isfinite(value) else None), described


def levels_on_target(
    target: Target, float_path: str, quant_path: str, runs: CheckSamples
) -> tuple[float, dict[str, Any]]:
    """min_levels with the float model run on ``target``'s CPU."""
    with tempfile.TemporaryDirectory(prefix="graphscan-check-") as folder:
        samples_file, names = save_samples(folder, runs.samples)
        value, described = target.run(
            f"{__name__}:target_levels", [float_path, quant_path, samples_file, names, runs.generated]
        )
    return (math.inf if value is None else value), described
