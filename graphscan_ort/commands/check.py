"""check's budgets that run the model, one measurer each (MEASURERS, by the name of its row
in the core's BUDGETS table): the int8 share (runtime's classes), the output SQNR, the
levels and the ``--metric`` agreement (shared.agreement), on this CPU or on a CPU target
(``--cpu``).

On a target, its own interpreter runs the sessions (``CpuTarget.runner``): runtime's
classes for min_int8, both models' outputs for min_sqnr and min_metric (handed back in an
.npz and measured here by the same code as natively) and the float model's levels for
min_levels."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from graphscan import (
    EXIT_INPUTS,
    BudgetJob,
    GraphscanError,
    Measured,
    Samples,
    TargetRunner,
    load_with_weights,
    shown,
)
from graphscan_ort.engines.classify import classes_answer, classify
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
from graphscan_ort.shared.on_target import keyed_outputs, load_samples, read_outputs, save_samples
from graphscan_ort.shared.options import Named
from graphscan_ort.shared.sessions import CPU, deployed_options, inputs_hint, model_outputs


class Measuring:
    """One check's measuring of the budgets that run the model: the job (paths, samples,
    metric, sessions, CPU target), each model read once, both models' outputs run once for
    min_sqnr and min_metric alike, and what runs the sessions on the job's CPU (``runner``)."""

    def __init__(self, job: BudgetJob, runner: TargetRunner) -> None:
        self.job, self.runner = job, runner

    @functools.cached_property
    def candidate(self) -> Named:
        model = self.job.model if self.job.model is not None else load_with_weights(self.job.path)
        return Named(model, self.job.path)

    @functools.cached_property
    def reference(self) -> Named:
        assert self.job.float_path is not None, "check refuses a budget that needs --float without it"
        return Named(load_with_weights(self.job.float_path), self.job.float_path)

    @functools.cached_property
    def runs(self) -> CheckSamples:
        return checked_samples(self.reference, self.candidate, self.job.samples)

    @functools.cached_property
    def agreement(self) -> Metric:
        """The --metric, made from its choice (a built-in, or a user's function loaded)."""
        chosen = self.job.metric
        return metric(chosen.name, chosen.threshold, chosen.blank, chosen.layout)

    @functools.cached_property
    def outputs(self) -> PairedOutputs:
        """Both models' outputs on the samples, in sessions at the job's level, on its CPU."""
        if self.job.cpu.native:
            return deployed_outputs(self.reference, self.candidate, self.runs, self.job.session.level)
        return outputs_on_target(self.runner, self.reference, self.candidate, self.runs, self.job.session.level)


def min_int8(measuring: Measuring) -> Measured:
    """The fraction of compute nodes that run an int8 or int8_data kernel, as runtime classes them
    (on a target: its own optimized session, as runtime --cpu reads it)."""
    job = measuring.job
    if job.cpu.native:
        found = classify(measuring.candidate.model, job.path).counts["classes"]
    else:
        found = measuring.runner.call(classes_answer, job.path, "extended", CPU, False)["classes"]
    return Measured(int8_fraction(found))


def min_sqnr(measuring: Measuring) -> Measured:
    """The output SQNR against --float by impact's definition: the worst part's (``nan``, which
    never holds, when undefined: an empty sample verifies nothing)."""
    figures = measuring.outputs.figures()
    described = {"pooled_sqnr_db": figures.pooled_db, "worst_part": figures.worst_part}
    return Measured(math.nan if figures.worst_db is None else figures.worst_db, described)


def min_levels(measuring: Measuring) -> Measured:
    """The fewest steps of its scale the worst part of any quantized tensor spans."""
    if measuring.job.cpu.native:
        value, described = lowest_levels_budget(measuring.reference, measuring.candidate, measuring.runs)
    else:
        value, described = levels_on_target(
            measuring.runner, measuring.reference.path, measuring.job.path, measuring.runs
        )
    return Measured(value, described)


def min_metric(measuring: Measuring) -> Measured:
    """The --metric's agreement of the quantized model's outputs with the float model's."""
    value = paired_value(measuring.outputs, measuring.agreement.reading(measuring.reference.model))
    return Measured(math.nan if value is None else value, {"metric": measuring.agreement.describe()})


# Each budget that runs the model, by its name in the core's BUDGETS table: its measurer.
MEASURERS: dict[str, Callable[[Measuring], Measured]] = {
    "min_int8": min_int8,
    "min_sqnr": min_sqnr,
    "min_levels": min_levels,
    "min_metric": min_metric,
}


def measure(job: BudgetJob, names: Sequence[str]) -> tuple[dict[str, Measured], dict[str, Any] | None]:
    """Each budget of ``names`` (those that run the model), by its measurer, and the facts of
    the CPU target they ran on (None: native). A metric is made before any model runs: a bad
    --metric is exit 2 at once."""
    job.cpu.require()  # a missing target is one line naming the install command, before anything runs
    runner = job.cpu.runner(kept=True)  # one interpreter for every budget on an emulated CPU
    try:
        measuring = Measuring(job, runner)
        if job.metric.name is not None:  # given only with min_metric (the core's rule)
            measuring.agreement  # noqa: B018  (made now: a bad --metric is refused before any model runs)
        found = {name: MEASURERS[name](measuring) for name in names}
    finally:
        runner.close()
    return found, None if job.cpu.native else dict(runner.facts or {})


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
    runner: TargetRunner, reference: Named, candidate: Named, runs: CheckSamples, level: str
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
            count = runner.call(target_outputs, *arguments)
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
    runner: TargetRunner, float_path: str, quant_path: str, runs: CheckSamples
) -> tuple[float, dict[str, Any]]:
    """min_levels with the float model run on ``runner``'s CPU."""
    with tempfile.TemporaryDirectory(prefix="graphscan-check-") as folder:
        samples_file, names = save_samples(folder, runs.samples)
        value, described = runner.call(target_levels, float_path, quant_path, samples_file, names, runs.generated)
    return (math.inf if value is None else value), described
