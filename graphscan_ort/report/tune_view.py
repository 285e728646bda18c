"""tune's answer as sections of a page: its front (speed against the metric, each figure
with its uncertainty, the target, the chosen row, the refused rows apart), every row's
settings, the warnings, accuracy by part against onnxruntime's defaults, and what the
chosen model runs. Drawn from the answer alone (docs/SPEC.md's keys), nothing measured."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from graphscan import metric_words, part_words
from graphscan_ort.report.html import (
    Html,
    Section,
    bullets,
    code,
    figure,
    join,
    paragraph,
    table,
)
from graphscan_ort.report.plots import FrontPoint, Lines, front_chart, grouped_bars
from graphscan_ort.shared.answers import raced_on_speed

Row = Mapping[str, Any]
# The seeds a user asks for (tune's --exclude, --keep-outputs-float): onnxruntime's defaults
# row keeps them too; the structural seeds (outputs, wide_concats) make a row of their own.
USER_SEEDS = ("--exclude", "--keep-outputs-float")


def tune_sections(answer: Mapping[str, Any], suffix: str = "") -> list[Section]:
    """The front, accuracy by part and what the chosen model runs; ``suffix`` keeps the ids of
    a second tune answer on one page apart."""
    return [
        Section(f"tune{suffix}", "tune: speed against accuracy", front(answer)),
        Section(f"accuracy{suffix}", "accuracy by part", accuracy_by_part(answer)),
        Section(f"kernels{suffix}", "what the chosen model runs", chosen_kernels(answer)),
    ]


def chosen_row(answer: Mapping[str, Any]) -> Row | None:
    return next((row for row in answer["candidates"] if row["id"] == answer["chosen"]), None)


def defaults_row(rows: Sequence[Row]) -> Row | None:
    """The row of onnxruntime's defaults (docs/SPEC.md, Target): ``quantize_static`` with int8
    activations, per tensor, MinMax, no other option, without rewrites; no trial, recovery or
    node kept float but the user's seeds (None: none was made)."""
    user_seeds = {kept["node"] for row in rows for kept in row["kept_float"] if kept["why"] in USER_SEEDS}
    found = []
    for row in rows:
        static = row["quantize_static"]
        if static is None or row["rewrites"] or row["trial"] or row["recovery"] or row["post_step"]:
            continue
        settings = (static.get("activation_type"), static.get("per_channel"), static.get("calibrate_method"))
        plain = not static.get("extra_options") and set(static.get("nodes_to_exclude") or []) <= user_seeds
        if settings == ("QInt8", False, "MinMax") and plain:
            found.append(row)
    return min(found, key=lambda row: row["id"], default=None)


def settings_words(row: Row) -> str:
    """A row's settings in words: what the quantizer was given and what was done after."""
    static, dynamic = row["quantize_static"], row["quantize_dynamic"]
    if static is None:
        words = [f"quantize_dynamic, {dynamic.get('weight_type', 'QInt8')} weights"]
        arguments = dynamic
    else:
        channel = "per channel" if static.get("per_channel") else "per tensor"
        quantized = f"{static.get('activation_type')} activations, {static.get('weight_type')} weights"
        words = [f"{quantized}, {channel}, {static.get('calibrate_method')}"]
        if static.get("extra_options"):
            words.append("extra " + json.dumps(static["extra_options"], sort_keys=True)[:120])
        arguments = static
    if row["rewrites"]:
        words.append("rewrites")
    excluded = arguments.get("nodes_to_exclude") or []
    if excluded:
        words.append(f"{len(excluded)} node{'s' if len(excluded) != 1 else ''} kept float")
    if row["trial"]:
        words.append(f"trial: {row['trial'].get('block')} block")
    if row["recovery"]:
        words.append(f"recovery: {row['recovery'].get('step')} of row {row['recovery'].get('from')}")
    if row["post_step"]:
        words.append("then float inputs")
    if row["same_as"] is not None:
        words.append(f"same model as row {row['same_as']}")
    if row.get("speed_from") is not None:
        words.append(f"timed as row {row['speed_from']} (the same plan)")
    return "; ".join(words)


def refusal(row: Row, answer: Mapping[str, Any]) -> str | None:
    """Why a row is refused, in words (None: it is not): the quantizer's error, each guard it
    breaks, each output part it breaks."""
    if row["error"]:
        return f"the quantizer or onnxruntime refused it: {row['error']}"
    reasons = []
    for fail in row["fails"] or []:
        if fail == "slower":
            floor = answer["latency"]["min_speedup"]
            shown = "not measured" if row["speedup"] is None else f"{row['speedup']:.3g}"
            reasons.append(f"slower: speedup {shown}, not above {floor:g}" if floor is not None else "slower")
        elif fail == "larger":
            reasons.append(f"larger: {row['bytes']} bytes, float {answer['float']['bytes']}")
        elif fail == "float_weights":
            reasons.append(f"float_weights: {row['float_weights']} weights not stored as integers")
        else:
            reasons.append(fail)
    # a broken part is no guard, but such a row is never reached (docs/SPEC.md, Verdict)
    reasons += [f"breaks {part_words(part)}: {part['why']}" for part in row["broken_parts"] or []]
    return "; ".join(reasons) or None


def status(row: Row, answer: Mapping[str, Any]) -> str:
    if row["id"] == answer["chosen"]:
        return "chosen" + (" (reached)" if answer["reached"] else " (target not reached)")
    if refusal(row, answer):
        return "refused"
    return "on the front" if row["pareto"] else ""


def points(answer: Mapping[str, Any]) -> list[FrontPoint]:
    """A mark for every row with a metric value; a row without one has nothing to draw."""
    return [
        FrontPoint(
            id=row["id"],
            speedup=row["speedup"],
            spread=row["speedup_spread"],
            value=row["metric_value"],
            bound=row["metric_bound"],
            refused=refusal(row, answer) is not None,
            chosen=row["id"] == answer["chosen"],
            pareto=row["pareto"],
            title=f"row {row['id']}: {settings_words(row)}",
        )
        for row in answer["candidates"]
        if row["metric_value"] is not None
    ]


def unplotted(answer: Mapping[str, Any]) -> list[str]:
    """The rows the chart cannot hold, each with why; the rows raced out on speed in one line."""
    said = []
    for row in answer["candidates"]:
        if row["metric_value"] is None and not row.get("raced"):  # answers before the race have no such key
            why = refusal(row, answer) if row["error"] else "its metric is undefined (or, for sqnr, infinite)"
            said.append(f"row {row['id']}: {why}")
    raced = sorted((row for row in answer["candidates"] if row.get("raced")), key=lambda row: row["id"])
    on_speed = [row for row in raced if raced_on_speed(row)]
    on_samples = [row for row in raced if not raced_on_speed(row)]
    if on_speed:
        speeds = sorted(row["speedup"] for row in on_speed)
        span = (
            f"{speeds[0]:.3g}x" if f"{speeds[0]:.3g}" == f"{speeds[-1]:.3g}" else f"{speeds[0]:.3g}-{speeds[-1]:.3g}x"
        )
        said.append(f"{row_ids(on_speed)}: raced out on speed ({span}): not measured for accuracy")
    if on_samples:
        said.append(
            f"{row_ids(on_samples)}: raced out on their first evaluation samples (less accurate there than a row as "
            "fast): not measured on the rest"
        )
    return said


def row_ids(rows: list[Mapping[str, Any]]) -> str:
    """``row 3`` or ``rows 3, 5``."""
    return f"row{'s' if len(rows) > 1 else ''} {', '.join(str(row['id']) for row in rows)}"


def front(answer: Mapping[str, Any]) -> Html:
    metric = " ".join(metric_words(answer["metric"]))
    target = answer["target"]
    label = "target undefined" if target["value"] is None else f"target {target['value']:.4g} ({target['source']})"
    evaluation = answer["evaluation"]
    lines = Lines(target["value"], label, answer["latency"]["min_speedup"], metric)
    drawn = points(answer)
    chart = figure(
        front_chart(drawn, lines) if drawn else "",
        f"{len(drawn)} of {len(answer['candidates'])} rows drawn. Error bars: the speedup's quartiles run by run, "
        f"and the metric from its one-sided lower bound (confidence {evaluation['confidence']:g}, corrected for "
        f"{evaluation['rows_compared']} rows compared) up to its value. Hover a mark for its settings."
        + (
            " The target is onnxruntime's defaults' own value: a row meets it by the paired comparison with that "
            "row, sample by sample, not by its bar against the line."
            if target["source"] == "defaults"
            else ""
        ),
    )
    rows = answer["candidates"]
    refused = [row for row in rows if refusal(row, answer)]
    return join(
        [
            facts(answer),
            chart,
            bullets(unplotted(answer)),
            Html("<h3>refused rows</h3>") if refused else "",
            table(["id", "why"], [[row["id"], refusal(row, answer)] for row in refused]) if refused else "",
            Html("<h3>every row</h3>"),
            settings_table(answer),
            Html("<h3>warnings</h3>"),
            bullets(answer["warnings"]) or paragraph("none", class_="note"),
        ]
    )


def facts(answer: Mapping[str, Any]) -> Html:
    """What the run was: the model and metric, the target and the verdict, the samples, the files."""
    evaluation, target, chosen = answer["evaluation"], answer["target"], answer["chosen"]
    held = "held out" if evaluation["held_out"] else "the calibration samples"
    verdict = "reached" if answer["reached"] else "not reached"
    samples = f"{evaluation['samples']} evaluation samples ({held}), {answer['calibration']['samples']} calibration"
    timed = f"speed timed at {shapes(answer['latency']['inputs'])}, float {answer['float']['ms']:.4g} ms"
    said = [
        join(["model ", code(answer["model"]), ", metric ", code(" ".join(metric_words(answer["metric"])))]),
        f"target {fmt(target['value'])} from {target['source']}; {verdict}; chosen row: {fmt(chosen)}",
        f"{samples} samples; {timed}",
        join(["written into ", code(answer["output"]), ": ", ", ".join(answer["written"]) or "nothing"]),
    ]
    return bullets(said)


def fmt(value: float | None) -> str:
    """A figure in a sentence: 4 significant digits, ``none`` for null."""
    return "none" if value is None else f"{value:.4g}"


def shapes(inputs: Mapping[str, Any]) -> str:
    """``x 1x3x320x320`` for ``{"x": [1, 3, 320, 320]}`` (a list of shapes: each)."""
    said = []
    for name, shape in inputs.items():
        listed = shape if shape and isinstance(shape[0], list) else [shape]
        said.append(f"{name} " + " or ".join("x".join(map(str, one)) for one in listed))
    return ", ".join(said)


def settings_table(answer: Mapping[str, Any]) -> Html:
    rows = answer["candidates"]
    header = ["id", "status", "metric", "bound", "speedup", "quartiles", "SQNR worst dB", "pooled dB", "int8", "MB"]
    header.append("settings")
    body = [
        [
            row["id"],
            status(row, answer),
            row["metric_value"],
            row["metric_bound"],
            row["speedup"],
            "" if row["speedup_spread"] is None else " to ".join(f"{q:.3g}" for q in row["speedup_spread"]),
            row["sqnr_db"],
            row["pooled_sqnr_db"],
            row["int8_kernels"],
            None if row["bytes"] is None else row["bytes"] / 1e6,
            settings_words(row),
        ]
        for row in rows
    ]
    classes = [
        "chosen" if row["id"] == answer["chosen"] else "refused" if refusal(row, answer) else None for row in rows
    ]
    return table(header, body, classes, id_="rows")


def accuracy_by_part(answer: Mapping[str, Any]) -> Html:
    """The chosen row against onnxruntime's defaults row, by what the answer holds: each row's
    worst part (its SQNR and name) and the SQNR pooled over every part."""
    chosen, defaults = chosen_row(answer), defaults_row(answer["candidates"])
    compared = [(f"chosen (row {row['id']})", row) for row in [chosen] if row is not None]
    compared += [(f"onnxruntime's defaults (row {row['id']})", row) for row in [defaults] if row is not None]
    note = paragraph(
        "tune's answer holds, for each row, the SQNR of its worst output part and the SQNR pooled over every part "
        "(docs/SPEC.md, Output SQNR), not every part's own: these are drawn. ",
        "impact and trace answers name every operator's share.",
        class_="note",
    )
    if not compared:
        return join([note, paragraph("no row was chosen and no row of onnxruntime's defaults was made")])
    chart = grouped_bars(
        ["worst part", "pooled over every part"],
        {name: [row["sqnr_db"], row["pooled_sqnr_db"]] for name, row in compared},
        "output SQNR (dB)",
        "parts",
    )
    header = ["row", "SQNR worst part dB", "worst part", "pooled dB", "broken parts", "fewest levels"]
    body = [
        [
            name,
            row["sqnr_db"],
            part_words(row["worst_part"]) if row["worst_part"] else None,
            row["pooled_sqnr_db"],
            ", ".join(f"{part_words(p)}: {p['why']}" for p in row["broken_parts"] or []) or "none",
            levels_words(row["levels"]),
        ]
        for name, row in compared
    ]
    missing = [] if defaults is not None else ["no row of onnxruntime's defaults is in the answer"]
    return join(
        [
            note,
            figure(chart, "n/a: an SQNR the answer holds as null (equal outputs, or undefined)"),
            table(header, body),
        ]
        + [bullets(missing)]
    )


def levels_words(levels: Mapping[str, Any] | None) -> str:
    if not levels:
        return "none varies"
    return f"{levels['value']:.3g} at {levels['tensor']} (part {levels['part']})"


def chosen_kernels(answer: Mapping[str, Any]) -> Html:
    """The chosen row's kernels, beside the defaults row's: int8 kernels, their share, and why
    wrapped nodes run float (runtime's reason codes)."""
    compared = [("chosen", chosen_row(answer)), ("onnxruntime's defaults", defaults_row(answer["candidates"]))]
    shown = [(name, row) for name, row in compared if row is not None]
    if not shown:
        return paragraph("no row was chosen")
    reasons = sorted({code for _, row in shown for code in row["wrapped_but_float"] or {}})
    header = ["", *(f"{name} (row {row['id']})" for name, row in shown)]
    body: list[list[object]] = [
        ["int8 kernels", *(row["int8_kernels"] for _, row in shown)],
        ["int8_fraction", *(row["int8_fraction"] for _, row in shown)],
    ]
    body += [
        [f"wrapped but float: {reason}", *((row["wrapped_but_float"] or {}).get(reason, 0) for _, row in shown)]
        for reason in reasons
    ]
    kept = [(name, row) for name, row in shown if row["excluded"]]
    said = [f"{name} keeps {', '.join(sorted(row['excluded']))} float" for name, row in kept]
    return join(
        [
            table(header, body),
            bullets(said),
            paragraph(
                "runtime's answer on the written model names every node, its kernel and its reason; give it to report "
                "beside this answer for the table by operator type.",
                class_="note",
            ),
        ]
    )
