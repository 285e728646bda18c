"""tune: from diagnosis to a quantized model measured as it will be deployed.

    graphscan tune FLOAT.onnx --calibrate FILE.npz [...] [--inputs FILE.npz ...] --out DIR

1. Prepare the float model (prepare.py): onnxruntime's quant_pre_process, the
   opset, the rewrites; each step verified against the original.
2. Quantize every candidate (candidates.py) of the prepared model with and
   without the rewrites, calibrating once per model and method; where a MatMul
   has a constant weight, also onnxruntime's quantize_dynamic (uncalibrated).
3. Measure each as deployed (deployed.py) on the --inputs samples, held out
   from calibration (or the calibration samples, said so).
4. Choose, of the candidates that pass the guards (guards.py: faster and no
   larger than float, integer weights) and whose --metric meets the target, the most
   accurate of those tied in speed with the fastest (choice.py)
   (default: sqnr, and the SQNR of onnxruntime's default settings on this model;
   an agreement metric's default target is float's own agreement, 1.0).
5. When none does: exclusions realized by the quantizer. impact ranks the
   operators of the most accurate candidate; blocks of them (blocks.py) are
   added to ``nodes_to_exclude`` in turn, the model re-quantized (same
   calibration), its exclusions made real (fallback.py) and measured as
   deployed, and an addition is kept only if it helps and breaks no guard the
   start passed (no block as costly is tried after one that does), until the target,
   --max-trials (default 8) or --max-exclude nodes.
   With ``--cpu`` another CPU target, each candidate's accuracy and kernels are that
   CPU's (deployed.OnTarget, one interpreter for the run); its speed is still timed
   here, and labelled so.
6. Write model.onnx and prepared.onnx into --out: built in a temporary folder
   beside it and renamed into place, so --out is absent or complete. Target not
   met: the most accurate candidate that passes the guards is written (exit 8);
   none passes: only prepared.onnx, ``chosen`` null (exit 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile

import numpy as np
import onnx
import onnxruntime as ort

from graphscan import (
    DEQUANTIZE,
    EXIT_BUDGET,
    EXIT_INPUTS,
    EXIT_NO_FILE,
    EXIT_OK,
    EXIT_USAGE,
    INSTALL_TARGETS,
    RUNTIME_LEVELS,
    Command,
    CpuTarget,
    Given,
    GraphscanError,
    MetricChoice,
    Option,
    Session,
    Takes,
    TargetRunner,
    finite_float,
    load_with_weights,
    non_negative_int,
    one_line,
    shown,
    subgraphs,
)
from graphscan_ort.report.plots import require_plotting
from graphscan_ort.shared.agreement import check_layout_fits
from graphscan_ort.shared.answers import TuneAnswer
from graphscan_ort.shared.files import check_out, place, write_atomically, write_failure
from graphscan_ort.shared.inputs import check_calibrates, input_specs, inputs_answer, read_npz_inputs, sample_files
from graphscan_ort.shared.kernels import INT8_KERNELS, QUANTIZE_KERNELS
from graphscan_ort.shared.metrics import named_outputs, require_numbers
from graphscan_ort.shared.options import Named, Timing, finite_non_negative
from graphscan_ort.shared.parts import TensorParts
from graphscan_ort.shared.sessions import environment, sample_outputs
from graphscan_ort.shared.targets import native_facts
from graphscan_ort.tune.bounds import DEFAULT_CONFIDENCE
from graphscan_ort.tune.candidates import METHODS
from graphscan_ort.tune.deployed import OnTarget
from graphscan_ort.tune.goal import Goal, metric_of
from graphscan_ort.tune.progress import Progress
from graphscan_ort.tune.seeds import user_seeds
from graphscan_ort.tune.stages import DEFAULT_MAX_TRIALS, stages_text, tune_in
from graphscan_ort.tune.table import tune_table
from graphscan_ort.tune.trials import Measure

REPORT = "report.html"  # --report's page, written into --out beside model.onnx


@dataclasses.dataclass(frozen=True)
class TuneSamples:
    """tune's samples: ``--calibrate`` (needed), held-out ``--inputs`` (default: the
    calibration samples) and ``--latency-inputs`` (default: the first evaluation sample),
    each a file or a folder of them."""

    calibrate: list[str]
    inputs: list[str] | None = None
    latency_inputs: list[str] | None = None

    @classmethod
    def taken(cls) -> Takes:
        options: tuple[Option, ...] = (
            (
                "--calibrate",
                {
                    "metavar": "FILE.npz",
                    "action": "append",
                    "help": "a calibration sample, one array per input, or a folder of them (repeatable)",
                },
            ),
            (
                "--inputs",
                {
                    "metavar": "FILE.npz",
                    "action": "append",
                    "help": "a held-out evaluation sample (repeatable; default: the calibration samples)",
                },
            ),
            (
                "--latency-inputs",
                {
                    "metavar": "FILE.npz",
                    "action": "append",
                    "help": "a sample at the deployed shape, timed for the speedup (repeatable; default: the first "
                    "--inputs sample)",
                },
            ),
        )
        return Takes("samples", options, cls.built)

    @classmethod
    def built(cls, given: Given) -> TuneSamples:
        if not given["calibrate"]:
            raise GraphscanError("usage: tune needs --calibrate FILE.npz (one sample per file, repeatable)", EXIT_USAGE)
        return cls(given["calibrate"], given["inputs"] or None, given["latency_inputs"] or None)


@dataclasses.dataclass(frozen=True)
class Search:
    """What tune aims at and how far it searches: the ``--metric``'s ``--target`` (or
    ``--target-sqnr``), the speedup a written model must beat (``--min-speedup``), the nodes
    kept float in every candidate (``--exclude``, ``--keep-outputs-float``), the fallback
    search's limits (``--max-exclude``, ``--max-trials``) and whether its front is drawn
    (``--report``: report.html in --out)."""

    target: float | None = None
    target_sqnr: float | None = None
    confidence: float = DEFAULT_CONFIDENCE
    min_speedup: float | None = None
    exclude: list[str] | None = None
    keep_outputs_float: bool = False
    max_exclude: int | None = None
    max_trials: int | None = None
    report: bool = False

    @classmethod
    def taken(cls) -> Takes:
        options: tuple[Option, ...] = (
            (
                "--target",
                {
                    "metavar": "X",
                    "type": finite_float,
                    "help": "the --metric to reach, in its unit (default: sqnr's is the SQNR of onnxruntime's "
                    "default settings; an agreement's is float's own, 1.0)",
                },
            ),
            ("--target-sqnr", {"metavar": "DB", "type": finite_float, "help": "--target of --metric sqnr"}),
            (
                "--confidence",
                {
                    "metavar": "P",
                    "type": confidence_level,
                    "help": "how sure the target must be shown met, one-sided, from 0.5 to 1 (default: "
                    f"{DEFAULT_CONFIDENCE:g}: exit 0 is wrong at most once in 20)",
                },
            ),
            (
                "--min-speedup",
                {
                    "metavar": "X",
                    "type": finite_non_negative,
                    "help": "a model written must be faster than float by more than this (default: 1, faster; 0: "
                    "any; none under an emulated --cpu)",
                },
            ),
            (
                "--exclude",
                {"metavar": "NODE", "action": "append", "help": "keep NODE float in every candidate (repeatable)"},
            ),
            (
                "--keep-outputs-float",
                {
                    "action": "store_true",
                    "help": "keep the nodes that produce the graph's outputs float in every candidate",
                },
            ),
            (
                "--max-exclude",
                {
                    "metavar": "N",
                    "type": non_negative_int,
                    "help": "at most N nodes kept float by the fallback search (default: no limit)",
                },
            ),
            (
                "--max-trials",
                {
                    "metavar": "N",
                    "type": non_negative_int,
                    "help": f"at most N re-quantizations in the fallback search (default: {DEFAULT_MAX_TRIALS})",
                },
            ),
            (
                "--report",
                {
                    "action": "store_true",
                    "help": f"also write {REPORT} into --out: the front, accuracy by part, what runs, the island map "
                    "(needs matplotlib: pip install 'graphscan[report]')",
                },
            ),
        )
        return Takes("search", options, cls.built)

    @classmethod
    def built(cls, given: Given) -> Search:
        confidence = given["confidence"]
        return cls(
            given["target"],
            given["target_sqnr"],
            DEFAULT_CONFIDENCE if confidence is None else confidence,
            given["min_speedup"],
            given["exclude"],
            bool(given["keep_outputs_float"]),
            given["max_exclude"],
            given["max_trials"],
            bool(given["report"]),
        )


def confidence_level(text: str) -> float:
    """argparse type of ``--confidence``: a probability from 0.5 (a point estimate) to below 1."""
    value = finite_float(text)
    if not 0.5 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a confidence from 0.5 to below 1, got {text!r}")
    return value


def tune(
    path: str,
    out: str | None,
    samples: TuneSamples,
    metric: MetricChoice,
    search: Search,
    session: Session,
    timing: Timing,
    cpu: CpuTarget,
) -> TuneAnswer:
    """Quantize ``path`` every way candidates.py knows, measure each as deployed (its accuracy
    and kernels on ``cpu``), write the best into ``out``."""
    if out is None:
        raise GraphscanError("usage: tune needs --out DIR", EXIT_USAGE)
    chosen_metric = metric_of(metric, search.target, search.target_sqnr)
    target = search.target_sqnr if search.target is None else search.target
    cpu.require()  # a missing target is one line naming the install command, before any work
    if search.report:
        require_plotting("tune --report")
    speedup_floor = speedup_guard(search.min_speedup, cpu)
    calibrate = sample_files(samples.calibrate)
    inputs = sample_files(samples.inputs) if samples.inputs else None
    latency_files = sample_files(samples.latency_inputs) if samples.latency_inputs else None
    parent = check_out(out)
    ort.set_default_logger_severity(4)  # the quantizer's own sessions log warnings on stderr
    model = load_with_weights(path)
    refuse_quantized(model, path)
    chosen_metric = chosen_metric.reading(model)  # ctc's layout may be told by the outputs' declared dims
    seeds = seed_rows(model, search.exclude, search.keep_outputs_float, path)
    specs = input_specs(model)
    calibration = [read_npz_inputs(p, specs) for p in calibrate]
    evaluation = [read_npz_inputs(p, specs) for p in inputs] if inputs else calibration
    latency = [read_npz_inputs(p, specs) for p in latency_files] if latency_files else evaluation[:1]
    # Every sample the user gave is run once before any work: one that does not run is named.
    calibrated = sample_outputs(model, calibration, path, calibrate, "--calibrate", keep=not inputs)
    evaluated = sample_outputs(model, evaluation, path, inputs, "--inputs") if inputs else calibrated
    if latency_files:
        sample_outputs(model, latency, path, latency_files, "--latency-inputs")
    require_numbers(Named(model, path), [o.name for o in model.graph.output], evaluated)
    reference = check_measurable(model, evaluated, path, inputs or calibrate)
    check_calibrates(calibration, calibrate)  # after: samples that measure nothing say so first
    check_layout_fits(chosen_metric, TensorParts(model, [o.name for o in model.graph.output]).sources)
    own = chosen_metric.value(reference, reference)  # fits every output, and float's own agreement
    try:
        work = tempfile.mkdtemp(prefix=".graphscan-tune-", dir=parent)
    except OSError as exc:
        raise GraphscanError(f"{shown(out)}: cannot write ({exc.strerror or exc})", EXIT_NO_FILE)
    progress = Progress()
    runner = None if cpu.native else cpu.runner(kept=True)
    try:
        on = None if runner is None else on_target(runner, work, evaluation, session)
        measure = Measure(Named(model, path), evaluation, session, timing, chosen_metric, latency, speedup_floor, on)
        goal = Goal(chosen_metric, target, own, search.confidence)
        limits = (search.max_exclude, search.max_trials)
        answer, verdict = tune_in(calibration, work, goal, measure, limits, progress, seeds)
        if search.report:
            answer["written"].append(REPORT)
        if on is not None:
            answer["warnings"] += speed_warnings(cpu, search.min_speedup)
        if not inputs:
            answer["warnings"].insert(
                0, "the evaluation samples are the calibration samples: give held-out --inputs to measure accuracy"
            )
        facts: dict = {}
        if runner is not None:  # the CPU the accuracy and kernels are from; the speed's, this one
            assert runner.facts is not None, "every candidate measured ran on the target"
            facts["cpu"] = runner.facts
            answer["latency"]["cpu"] = native_facts()
        result: TuneAnswer = {
            "model": path,
            "environment": environment(session.level, threads=session.threads),
            **facts,
            "calibration": {"samples": len(calibration), "methods": METHODS},
            "evaluation": {
                "samples": len(evaluation),
                "held_out": held_out(calibration, evaluation) if inputs else False,
                "inputs": inputs_answer(evaluation),
                "defaulted": [],
                "events": next((c["metric_events"] for c in answer["candidates"] if c["id"] == answer["chosen"]), None),
                **verdict,
            },
            **answer,
            "output": out,
        }
        if search.report:  # drawn from the answer, beside the model it names, before --out is in place
            write_report(result, work)
        place(work, out)
    except Exception as exc:
        if isinstance(exc, GraphscanError) or not write_failure(exc):
            raise
        why = getattr(exc, "strerror", None) or one_line(exc)
        raise GraphscanError(f"--out {shown(out)}: cannot write ({why})", EXIT_NO_FILE) from None
    finally:
        progress.close()
        if runner is not None:
            runner.close()
        shutil.rmtree(work, ignore_errors=True)  # also on Ctrl-C: nothing half-written
    return result


def write_report(answer: TuneAnswer, work: str) -> None:
    """``--report``: the page of ``answer`` into ``work``, beside the model it draws (renamed to --out with it)."""
    from graphscan_ort.report.page import tune_page

    write_atomically(tune_page(answer, work).encode("utf-8"), os.path.join(work, REPORT))


def speedup_guard(min_speedup: float | None, cpu: CpuTarget) -> float | None:
    """The speedup a model must beat (None: no ``slower`` guard): ``--min-speedup``, else 1
    natively and none on an emulated CPU target, whose time is no latency."""
    if min_speedup is not None:
        return float(min_speedup)
    return 1.0 if cpu.native else None


def on_target(runner: TargetRunner, work: str, evaluation: list[dict[str, np.ndarray]], session: Session) -> OnTarget:
    """The measurements on ``runner``'s CPU target, its files in a folder of ``work`` (removed with it)."""
    folder = os.path.join(work, "target")
    os.mkdir(folder)
    return OnTarget(runner, folder, evaluation, session)


def speed_warnings(cpu: CpuTarget, min_speedup: float | None) -> list[str]:
    """What a run on an emulated CPU target says of its speed figures."""
    name = cpu.name
    said = [
        f"ms, float_ms, speedup and speedup_spread are this machine's (latency.cpu), timed natively: {name} runs "
        "emulated, and an emulated CPU's time is no latency; the accuracy figures and the kernels are " + name + "'s"
    ]
    if min_speedup is None:
        said.append(
            f"the slower guard is off: {name}'s speed is not measured (give --min-speedup to guard by "
            "this machine's speedup)"
        )
    return said


def seed_rows(model: onnx.ModelProto, exclude: list[str] | None, keep_outputs_float: bool, path: str) -> list[dict]:
    """The user's seeds as rows' ``kept_float`` entries, ``{"node", "why"}`` each."""
    chosen = set(exclude or [])
    return [
        {"node": node, "why": "--exclude" if node in chosen else "--keep-outputs-float"}
        for node in user_seeds(model, exclude, keep_outputs_float, path)
    ]


def check_measurable(model: onnx.ModelProto, outputs: list, path: str, files: list[str]) -> list[dict[str, np.ndarray]]:
    """The float model's ``outputs`` on the evaluation samples, by name. Exit 7 unless they
    hold a finite value: NaN or infinity everywhere, or nothing at all (a zero-size input),
    measures no candidate."""
    values = [np.asarray(value) for sample in outputs for value in sample]
    if not any(value.size for value in values):
        why = "empty"
    elif not any(value.dtype.kind in "biuf" and np.isfinite(value.astype(np.float64)).any() for value in values):
        why = "NaN or infinite everywhere"
    else:
        return named_outputs(outputs, [o.name for o in model.graph.output])
    raise GraphscanError(
        f"{', '.join(map(shown, files))}: the float model's outputs are {why} on these samples: nothing to measure",
        EXIT_INPUTS,
    )


def refuse_quantized(model: onnx.ModelProto, path: str) -> None:
    """Exit 2 for a model that is already quantized: it holds Q or DQ nodes, or onnxruntime's
    integer operators (QLinear*, *Integer, DynamicQuantize*, MatMulNBits: the kernel
    vocabulary of shared.kernels). tune quantizes a float model; a quantized one given as the
    float reference would make every figure a comparison of two quantized models, and the
    quantizer fails on it (a dynamically quantized model's scales are not its tensors)."""
    held = sorted(quantized_operators(model.graph))
    if held:
        raise GraphscanError(
            f"usage: {shown(path)} is already quantized (it holds {', '.join(held)}): give tune the float model",
            EXIT_USAGE,
        )


def quantized_operators(graph: onnx.GraphProto) -> set[str]:
    """The op types of ``graph`` and its bodies that only a quantized model holds."""
    found = set()
    for node in graph.node:
        op = node.op_type
        if op == DEQUANTIZE or op in QUANTIZE_KERNELS or op in INT8_KERNELS or op.startswith("QLinear"):
            found.add(op)
        for body in subgraphs(node):
            found |= quantized_operators(body)
    return found


def sample_key(sample: dict[str, np.ndarray]) -> tuple[tuple[str, str, tuple[int, ...], bytes], ...]:
    """A sample's contents (names, dtypes, shapes and bytes), to compare samples by value."""
    return tuple((name, a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes()) for name, a in sorted(sample.items()))


def held_out(calibration: list[dict[str, np.ndarray]], evaluation: list[dict[str, np.ndarray]]) -> bool:
    """Whether no evaluation sample is also a calibration sample, by content, not by path:
    the same arrays given to --calibrate and --inputs are not held out."""
    calibrated = {sample_key(sample) for sample in calibration}
    return not any(sample_key(sample) in calibrated for sample in evaluation)


COMMAND = Command(
    "tune",
    tune,
    options=(
        TuneSamples.taken(),
        (
            "--out",
            {"metavar": "DIR", "help": f"absent or empty folder for model.onnx and prepared.onnx ({REPORT} too)"},
        ),
        MetricChoice.taken(default=" (default: sqnr)"),
        Search.taken(),
        CpuTarget.taken(
            "measure accuracy and kernels in onnxruntime built for this CPU, emulated; speed stays this machine's "
            f"(default: native; install the others: {INSTALL_TARGETS})"
        ),
        Session.taken(
            list(RUNTIME_LEVELS),
            "all",
            "deployed optimization level (default: all)",
            "intra-op threads of the measurements",
        ),
        Timing.taken("timed runs per candidate"),
    ),
    table=tune_table,
    exit_code=lambda answer: EXIT_OK if answer["reached"] else EXIT_BUDGET,
    answer=TuneAnswer,
    epilog=stages_text(),
)
