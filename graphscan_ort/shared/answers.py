"""The answers of the commands that run models, key for key as docs/SPEC.md lists them.

Each command returns one of these (a TypedDict is a plain dict at run time, so the
JSON is what it always was); a key SPEC.md adds or removes changes its type here.
The counting commands' answers are typed in graphscan.py beside them. (No
``from __future__ import annotations`` here: TypedDict reads NotRequired at run time.)
"""

from typing import Any, NotRequired, TypedDict

# -- fuse


class Fused(TypedDict):
    matmul: str
    add: str
    gemm: str


class Skipped(TypedDict):
    node: str
    reason: str


class FuseAnswer(TypedDict):
    model: str
    output: str
    fused: list[Fused]
    skipped: list[Skipped]
    max_abs_error: float


# -- trace


class NodeError(TypedDict):
    node: str
    max_abs: float


class Unmatched(TypedDict):
    node: str
    op_type: str
    reason: str


class TraceOp(TypedDict):
    node: str
    op_type: str
    wrapped: bool
    reference: str | None
    isolated_max_abs: float | None
    propagated_max_abs: float | None
    isolated_lsb: float | None
    sqnr_db: float | None
    clipped: NotRequired[float | None]  # only on rows whose output has a Q
    levels: NotRequired[float | None]  # the worst part's float range in steps of the output Q's scale


class TraceMeasures(TypedDict):
    ops: list[TraceOp]
    outputs: dict[str, float | None]
    worst_isolated: NodeError | None
    first_over: NodeError | None
    unmatched: list[Unmatched]


class CpuFacts(TypedDict):
    name: str
    onnxruntime: str
    machine: str


class KernelDifference(TypedDict):
    node: str
    op_type: str
    values: int
    differing: int
    max_abs: float
    max_lsb: float | None
    cause: str | None
    remedy: str | None


class TraceAnswer(TraceMeasures):
    a: str
    b: str
    inputs: dict[str, list[int]]
    defaulted: list[str]
    cpu: NotRequired[CpuFacts]  # with --cpu other than native only
    differs_from_native: NotRequired[list[KernelDifference]]  # with --cpu other than native only


# -- runtime


class Reason(TypedDict):
    code: str
    detail: str


NodeRow = TypedDict(
    "NodeRow",
    {
        "node": str,
        "op_type": str,
        "wrapped": bool,
        "class": str | None,  # int8, int8_data, float, absorbed; None when unmapped
        "kernel": str | None,
        "runs_in": str | None,
        "reason": Reason | None,
    },
)


class Environment(TypedDict):
    onnxruntime: str
    provider: str
    level: str
    threads: NotRequired[int]  # tune's
    machine: str
    int8_allowed: NotRequired[bool]  # runtime's


class WallMs(TypedDict):
    model: float | None
    without_round_trips: float | None


class RuntimeTime(TypedDict):
    method: str
    inputs: dict[str, list[int]]
    defaulted: list[str]
    runs: int
    profiler_floor_us: float
    shares: dict[str, float | None]
    nodes: dict[str, float]
    wall_ms: WallMs
    round_trip_cost: float | None


class RuntimeCounts(TypedDict):
    compute: int
    wrapped: int
    classes: dict[str, int]
    wrapped_but_float: int
    float_but_int8: int
    by_op_type: dict[str, dict[str, int]]


class ClassChange(TypedDict):
    node: str
    op_type: str
    native: str | None
    cpu: str | None


class RuntimeAnswer(RuntimeCounts):
    model: str
    environment: Environment
    cpu: NotRequired[CpuFacts]  # with --cpu other than native only
    nodes: list[NodeRow]
    unmapped: list[str]
    differs_from_native: NotRequired[list[ClassChange]]  # with --cpu other than native only
    time: NotRequired[RuntimeTime]  # with --time only


# -- impact


class OpGain(TypedDict):
    node: str
    op_type: str
    sqnr_db: float | None
    gain_db: float | None


class TensorGain(TypedDict):
    tensor: str
    producer: str | None
    consumers: list[str]
    sqnr_db: float | None
    gain_db: float | None
    rounding_sqnr_db: float | None
    rounding_gain_db: float | None
    clipped: float | None


class Exclusion(TypedDict):
    target_sqnr_db: float
    nodes: list[str]
    sqnr_db: float | None
    reached: bool


class WeightsMatched(TypedDict):
    matched: int
    total: int


class WorstPart(TypedDict):
    output: str | None
    part: int
    node: str | None  # the node whose values the part holds


class ImpactMeasures(TypedDict):
    samples: int
    output_sqnr_db: float | None  # the worst part's (parts.py), the ranking's baseline
    pooled_sqnr_db: float | None
    worst_part: WorstPart | None
    deployed_output_sqnr_db: float | None
    weights: WeightsMatched
    warnings: list[str]
    ops: list[OpGain]
    tensors: list[TensorGain]
    exclude: NotRequired[Exclusion]  # with --target-sqnr only


class ImpactAnswer(ImpactMeasures):
    a: str
    b: str
    inputs: dict[str, Any]  # a shape per input, or a list of shapes when the samples differ
    defaulted: list[str]


# -- tune


class PrepareStep(TypedDict):
    step: str
    ok: bool
    detail: str
    max_abs_error: float | None


class Candidate(TypedDict):
    id: int
    quantize_static: dict[str, Any] | None  # quantize_static's keyword arguments, enums by name (null: dynamic)
    quantize_dynamic: dict[str, Any] | None  # quantize_dynamic's, for a dynamic candidate (null otherwise)
    rewrites: bool
    kept_float: list[dict[str, str]]  # seeds kept float in it: {"node", "why"} (+ "folded": the seed node holds)
    trial: dict[str, Any] | None  # the fallback search's block: {"block": kind, "added": [node, ...]}
    post_step: dict[str, list[str]] | None  # applied after quantize_static: {"float_inputs": [node, ...]}
    excluded: dict[str, str] | None  # per excluded node, what it runs: float, float_inputs or int8
    same_as: int | None  # the candidate whose model the quantizer made byte for byte: measured once
    speed_from: int | None  # the candidate whose timing it carries: the same plan in onnxruntime (null: timed)
    recovery: dict[str, Any] | None  # recovery.py: {"step", "from", "detail", "sqnr_gain_db", "metric_gain", "helps"}
    # (bias_correction also "speed_from": the row whose timing it inherits, null when timed)
    sqnr_db: float | None  # the worst part's output SQNR (parts.py)
    pooled_sqnr_db: float | None  # every output and sample summed
    worst_part: WorstPart | None
    metric_value: float | None  # the --metric agreement (sqnr: the SQNR again)
    metric_bound: float | None  # its one-sided lower bound at the run's confidence, corrected for the rows compared
    metric_events: int | None  # a user's metric's (value, events)
    metric_worst: dict[str, Any] | None  # {"sample", "value"}: the metric's worst evaluation sample
    metric_spread: list[float] | None  # [25th, 75th] percentiles of the metric sample by sample
    levels: dict[str, Any] | None  # {"value", "tensor", "part", "node"}: the fewest levels of a quantized tensor
    broken_parts: list[dict[str, Any]] | None  # output parts below a floor: {"output", "part", "node", "why"}
    int8_fraction: float | None
    int8_kernels: int | None
    wrapped_but_float: dict[str, int] | None
    ms: float | None
    float_ms: float | None  # the float model's time, interleaved with this candidate's: speedup = float_ms / ms
    speedup: float | None
    speedup_spread: list[float] | None  # quartiles of the run-by-run speedups
    bytes: int | None
    float_weights: int | None  # Conv/ConvTranspose/MatMul/Gemm weights not stored as integers
    fails: list[str] | None  # the guards broken: slower, larger, float_weights
    pareto: bool
    error: str | None
    raced: str | None  # why a grid row was not measured on every evaluation sample (raced_on_speed: on none)


# How a row raced on its speed alone begins its ``raced`` (tune's Trials.raced_out): the
# answer's one sign of the two races, for the table and the report.
RACED_ON_SPEED = "not measured for accuracy"


def raced_on_speed(row: Any) -> bool:
    """Whether a tune row was raced on its speed, never run on an evaluation sample (else, where
    ``raced``, on its first samples)."""
    return bool((row.get("raced") or "").startswith(RACED_ON_SPEED))


class Calibration(TypedDict):
    samples: int
    methods: list[str]


class Shown(TypedDict):
    confidence: float  # one-sided, --confidence
    rows_compared: int  # the rows measured: each bound is corrected for them (Bonferroni)
    method: str | None  # the chosen row's: student_t, wilson, paired_student_t or defaults_row (null: none)


class Evaluation(TypedDict):
    samples: int
    held_out: bool
    inputs: dict[str, Any]
    defaulted: list[str]
    events: int | None  # what the chosen row's user metric says its value rests on
    confidence: float  # as Shown: how the verdict was reached
    rows_compared: int
    method: str | None


class FloatTime(TypedDict):
    ms: float
    bytes: int


class Target(TypedDict):
    value: float | None  # in the metric's unit; None: undefined, never reached
    source: str  # "user", "defaults" (onnxruntime's default settings) or "float" (its own agreement)


class Latency(TypedDict):
    inputs: dict[str, Any]  # the shapes timed
    samples: int
    first_runs: int  # every row's first timing
    runs: int  # the retime stage's, of the written row and its rivals (--runs)
    min_speedup: float | None  # None: no slower guard (an emulated --cpu without --min-speedup)
    cpu: NotRequired[CpuFacts]  # with --cpu other than native only: the CPU the speed was timed on, this one


TuneChoice = TypedDict(  # noqa: UP013 (a class body's "float" key would shadow the builtin below it)
    "TuneChoice",
    {
        "float": FloatTime,
        "prepare": list[PrepareStep],
        "candidates": list[Candidate],
        "metric": dict[str, Any],
        "target": Target,
        "target_sqnr_db": float | None,
        "latency": Latency,
        "chosen": int | None,
        "reached": bool,
        "written": list[str],
        "warnings": list[str],
    },
)


class TuneAnswer(TuneChoice):
    model: str
    environment: Environment
    cpu: NotRequired[CpuFacts]  # with --cpu other than native only: the CPU of the accuracy and kernels
    calibration: Calibration
    evaluation: Evaluation
    output: str


# -- report


class ReportedAnswer(TypedDict):
    path: str
    command: str


class ReportAnswer(TypedDict):
    answers: list[ReportedAnswer]
    output: str
    bytes: int
    sections: list[str]  # the page's sections, by id, in order
    notes: list[str]  # what the page leaves out or shows as text, each with why
