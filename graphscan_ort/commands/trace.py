"""trace: the operator where a quantized model's error is born.

Each compute operator of the quantized model is compared with the float
model's tensor it stands for: alone on perfect inputs (isolated) and in the
chain (propagated). The engine (the matcher, the single-op models, the rows,
``compare``) is engines/trace.py; this module holds the declaration, the
path-level entry point and the table.
"""

from __future__ import annotations

import os
from typing import Any, cast

from graphscan import (
    EXIT_RUNTIME,
    Command,
    CpuTarget,
    GraphscanError,
    Samples,
    format_fields,
    load_with_weights,
    one_line,
    page,
    section,
)
from graphscan_ort.engines.kernel_numbers import differences, saved_outputs
from graphscan_ort.engines.levels import LEVELS_FLOOR
from graphscan_ort.engines.trace import TRACE_TOLERANCE, compare
from graphscan_ort.shared.answers import TraceAnswer
from graphscan_ort.shared.inputs import check_same_inputs, model_samples, parse_shapes
from graphscan_ort.shared.options import Named, finite_non_negative
from graphscan_ort.shared.sessions import inputs_hint, temporary_folder
from graphscan_ort.shared.tables import RED_FLAGS, input_fields, largest_first, smallest_first

TRACE_SYMBOLIC_DIM_SIZE = 1


def trace(a: str, b: str, tolerance: float, save: str | None, samples: Samples, cpu: CpuTarget) -> TraceAnswer:
    """Per operator of ``b`` (quantized): isolated and propagated error against ``a`` (float),
    both models run as ``cpu`` computes them (another target than native: with the operators
    whose numbers differ from this machine's)."""
    cpu.require()
    inputs = samples.inputs[0] if samples.inputs else None
    try:
        with inputs_hint(not inputs, TRACE_SYMBOLIC_DIM_SIZE, [a, b]):
            if not cpu.native:
                return on_target(a, b, inputs, samples, tolerance, save, cpu)
            return trace_models(a, b, inputs, samples.seed, tolerance, save, samples.shape)
    except MemoryError as exc:
        raise GraphscanError(
            f"graphscan's combined model of {a} and {b}: out of memory ({one_line(exc)})", EXIT_RUNTIME
        )


def on_target(
    a: str, b: str, inputs: str | None, samples: Samples, tolerance: float, save: str | None, cpu: CpuTarget
) -> TraceAnswer:
    """trace run inside ``cpu``'s interpreter, with ``differs_from_native``: each operator's
    single-op model (trace's --save) run on the same inputs here and there, compared in LSB."""
    with temporary_folder("graphscan-trace-") as work, cpu.runner(kept=True) as runner:
        folder = save if save is not None else os.path.join(work, "ops")
        answer: dict[str, Any] = dict(
            runner.call(trace_models, a, b, inputs, samples.seed, tolerance, folder, samples.shape)
        )
        here, there = os.path.join(work, "native.npz"), os.path.join(work, "target.npz")
        saved_outputs(folder, here)
        runner.call(saved_outputs, folder, there)
        op_types = {row["node"]: row["op_type"] for row in answer["ops"]}
        answer["cpu"] = runner.facts
        answer["differs_from_native"] = differences(folder, here, there, cpu.name, op_types)
    return cast(TraceAnswer, answer)


def trace_models(
    a: str, b: str, inputs: str | None, seed: int, tolerance: float, save: str | None, shape: list[str] | None
) -> TraceAnswer:
    """``trace``'s work: plan the rows, run graphscan's combined model, answer."""
    float_model, quant_model = load_with_weights(a), load_with_weights(b)
    check_same_inputs(Named(float_model, a), Named(quant_model, b))
    chosen, defaulted = model_samples(
        float_model, [inputs] if inputs else None, parse_shapes(shape), seed, TRACE_SYMBOLIC_DIM_SIZE
    )
    feeds = chosen[0]
    inputs_given = {name: list(array.shape) for name, array in feeds.items()}
    measures = compare(float_model, quant_model, feeds, a, b, tolerance, save)
    return {"a": a, "b": b, "inputs": inputs_given, "defaulted": defaulted, **measures}


def trace_table(answer: dict[str, Any], top: int | None) -> str:
    """Red flags first (worst SQNR, largest LSB error, most clipped), then rows in graph order;
    with ``top``, the N worst of each, and the largest isolated and propagated errors."""
    columns = ["node", "op_type", "wrap", "isolated", "propag.", "lsb", "sqnr_db"]  # short: 80 columns
    keys = ["node", "op_type", "wrapped", "isolated_max_abs", "propagated_max_abs", "isolated_lsb", "sqnr_db"]
    if any("clipped" in row for row in answer["ops"]):
        columns.append("clipped")
        keys.append("clipped")

    def rows(ops: list[dict[str, Any]]) -> list[list[Any]]:
        return [[row.get(key) for key in keys] for row in ops]

    def headline(key: str) -> tuple[str, str | None]:
        value = answer.get(key)
        return (key, f"{value['node']} ({value['max_abs']:.3g})" if value else None)

    head = format_fields(
        [("a", answer["a"]), ("b", answer["b"])]
        + ([("cpu", answer["cpu"].get("name"))] if "cpu" in answer else [])
        + input_fields(answer["inputs"], answer.get("defaulted"))
        + [(f"output {name} max_abs", error) for name, error in answer["outputs"].items()]
        + [headline("worst_isolated"), headline("first_over"), ("ops", len(answer["ops"]))]
    )
    ops = answer["ops"]
    # What locates a problem leads: an absolute error hides a Sigmoid 10^8 LSB
    # off (tiny values, SQNR near 0 dB) or a Conv whose values are all clipped.
    flags = [
        ("ops by SQNR, worst first", smallest_first(ops, "sqnr_db")),
        ("ops by isolated error in LSB, largest first", largest_first(ops, "isolated_lsb")),
        ("ops by clipped share, largest first", [r for r in largest_first(ops, "clipped") if r["clipped"] > 0]),
    ]
    body = [section(title, columns, rows(ranked), top or RED_FLAGS, ["op_type"]) for title, ranked in flags]
    # A part spanning a few steps of its scale is lost whatever its LSB error says: shown when any is.
    few = [r for r in smallest_first(ops, "levels") if r["levels"] < LEVELS_FLOOR]
    if few:
        title = f"ops whose output's worst part spans under {LEVELS_FLOOR:g} levels, fewest first"
        few_rows = [[r["node"], r["op_type"], r["isolated_lsb"], r["levels"]] for r in few]
        body.insert(0, section(title, ["node", "op_type", "lsb", "levels"], few_rows, top or RED_FLAGS, ["op_type"]))
    if top is None:
        body.append(section("ops in graph order", columns, rows(ops), cut_first=["op_type"]))
    else:
        body += [
            section("ops by isolated error", columns, rows(largest_first(ops, "isolated_max_abs")), top, ["op_type"]),
            section(
                "ops by propagated error", columns, rows(largest_first(ops, "propagated_max_abs")), top, ["op_type"]
            ),
        ]
    if "differs_from_native" in answer:  # a target's kernels computing other numbers lead
        title = f"ops whose numbers differ on {answer['cpu'].get('name')} from native"
        changed = answer["differs_from_native"]
        differ = [[d["node"], d["op_type"], d["differing"], d["max_lsb"], d["cause"]] for d in changed]
        body.insert(0, section(title, ["node", "op_type", "differing", "lsb", "cause"], differ, top, ["op_type"]))
    unmatched = [[u["node"], u["op_type"], u["reason"]] for u in answer["unmatched"]]
    return page(head, *body, section("unmatched float nodes", ["node", "op_type", "reason"], unmatched, top))


COMMAND = Command(
    "trace",
    trace,
    ("a", "b"),
    options=(
        Samples.taken(TRACE_SYMBOLIC_DIM_SIZE),
        ("--tolerance", {"type": finite_non_negative, "default": TRACE_TOLERANCE, "help": "first_over threshold"}),
        ("--save", {"metavar": "DIR", "help": "write each op's single-op model and inputs here"}),
        CpuTarget.taken(
            "run both models as this CPU target computes them (emulated: see runtime --cpu); "
            "names the operators whose numbers differ from this machine's"
        ),
    ),
    table=trace_table,
    answer=TraceAnswer,
)
