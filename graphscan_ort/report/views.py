"""The answers of runtime, check, trace and impact as sections of a page, drawn from the
answers alone (docs/SPEC.md's keys): what runs by operator type (a column per CPU target
when several runtime answers of one model are given), the budgets, the worst operators and
the gain of keeping each one float."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from graphscan import NATIVE, part_words
from graphscan_ort.report.html import Html, bullets, code, figure, join, paragraph, table
from graphscan_ort.report.plots import CLASS_COLOURS, classes_chart, ranked_chart

Answer = Mapping[str, Any]
TOP = 20  # the operators a chart and its table show: the worst, or the most gained


def target_of(answer: Answer) -> str:
    """The CPU target an answer was measured on (``native`` without ``cpu``)."""
    cpu = answer.get("cpu")
    return str(cpu["name"]) if cpu else NATIVE


def what_runs(answers: Sequence[Answer], salt: str) -> Html:
    """runtime's answers of one model, one per CPU target: per operator type, the nodes of
    each class, a column per target; why the wrapped nodes that run float do; what differs."""
    by_target = {target_of(answer): answer["by_op_type"] for answer in answers}
    ops = sorted({op for by_op_type in by_target.values() for op in by_op_type})
    header = ["op type"] + [f"{target}: {name}" for target in by_target for name in CLASS_COLOURS]
    body = [
        [op, *(by_target[target].get(op, {}).get(name, 0) for target in by_target for name in CLASS_COLOURS)]
        for op in ops
    ]
    body.append(["all", *(answer["classes"].get(name, 0) for answer in answers for name in CLASS_COLOURS)])
    first = answers[0]
    said = [
        f"{target_of(a)}: {a['compute']} compute nodes, {a['wrapped']} wrapped, {a['wrapped_but_float']} wrapped but "
        f"float, {a['float_but_int8']} float but int8, {len(a['unmapped'])} unmapped; onnxruntime "
        f"{a['environment']['onnxruntime']}, {a['environment']['provider']}, level {a['environment']['level']}"
        for a in answers
    ]
    return join(
        [
            paragraph("model ", code(first["model"])),
            bullets(said),
            figure(classes_chart(by_target, salt), "nodes per operator type and runtime class"),
            table(header, body),
            Html("<h3>why wrapped nodes run float</h3>"),
            *(reasons(answer, len(answers) > 1) for answer in answers),
            *(differences(answer) for answer in answers if answer.get("differs_from_native")),
        ]
    )


def reasons(answer: Answer, named: bool) -> Html:
    """The wrapped nodes that run float, by operator type and reason code, with a detail and a
    node for each."""
    groups: Counter[tuple[str, str]] = Counter()
    example: dict[tuple[str, str], Mapping[str, Any]] = {}
    for node in answer["nodes"]:
        if node["wrapped"] and node["class"] == "float" and node["reason"]:
            key = (node["op_type"], node["reason"]["code"])
            groups[key] += 1
            example.setdefault(key, node)
    title = paragraph(f"on {target_of(answer)}:") if named else Html("")
    if not groups:
        return join([title, paragraph("none: every wrapped node runs an integer kernel or is absorbed", class_="note")])
    body = [
        [op, reason, count, example[(op, reason)]["node"], example[(op, reason)]["reason"]["detail"]]
        for (op, reason), count in sorted(groups.items(), key=lambda item: (-item[1], item[0]))
    ]
    return join([title, table(["op type", "reason", "nodes", "for example", "detail"], body)])


def differences(answer: Answer) -> Html:
    rows = [[d["node"], d["op_type"], d["native"], d["cpu"]] for d in answer["differs_from_native"]]
    return join(
        [
            paragraph(f"nodes whose class on {target_of(answer)} differs from native:"),
            table(["node", "op type", "native", target_of(answer)], rows),
        ]
    )


def budgets(answer: Answer) -> Html:
    """check's budgets, each with its value, limit and whether it holds."""
    rows, classes = [], []
    for budget in answer["budgets"]:
        detail = []
        if budget.get("worst_part"):
            detail.append(f"worst {part_words(budget['worst_part'])}")
        if budget.get("metric"):
            detail.append(" ".join(f"{key} {value}" for key, value in budget["metric"].items()))
        if budget.get("tensor"):
            detail.append(f"at {budget['tensor']}")
        rows.append([budget["name"], budget["value"], budget["limit"], "holds" if budget["ok"] else "broken", *detail])
        classes.append("passed" if budget["ok"] else "failed")
    width = max((len(row) for row in rows), default=4)
    rows = [row + [""] * (width - len(row)) for row in rows]
    on = f" on {answer['cpu']['name']}" if answer.get("cpu") else ""
    verdict = "every budget holds" if answer["ok"] else "a budget is broken (exit 8)"
    header = ["budget", "value", "limit", "verdict"] + ["detail"] * (width - 4)
    against = ["; float model ", code(answer["float"])] if answer["float"] else []
    return join(
        [paragraph("model ", code(answer["model"]), *against, f"{on}: {verdict}"), table(header, rows, classes)]
    )


def worst_operators(answer: Answer, salt: str) -> Html:
    """trace's rows with the lowest SQNR (each operator alone on perfect inputs against its
    float reference), the worst first."""
    measured = [row for row in answer["ops"] if row["sqnr_db"] is not None and math.isfinite(row["sqnr_db"])]
    worst = sorted(measured, key=lambda row: row["sqnr_db"])[:TOP]
    said = [
        f"{len(answer['ops'])} operators of {answer['b']} against {answer['a']}; {len(measured)} with a finite SQNR",
    ]
    if answer["worst_isolated"]:
        said.append(
            f"largest isolated error: {answer['worst_isolated']['node']} ({answer['worst_isolated']['max_abs']:.4g})"
        )
    if answer["first_over"]:
        said.append(f"first over the tolerance: {answer['first_over']['node']} ({answer['first_over']['max_abs']:.4g})")
    said += [f"output {name}: max |float - quantized| {value}" for name, value in answer["outputs"].items()]
    if not worst:
        return join([bullets(said), paragraph("no operator has a finite SQNR", class_="note")])
    chart = ranked_chart(
        [row["node"] for row in worst], [row["sqnr_db"] for row in worst], "SQNR (dB), lowest first", salt
    )
    header = [
        "node",
        "op type",
        "SQNR dB",
        "isolated max abs",
        "propagated max abs",
        "isolated LSB",
        "clipped",
        "levels",
    ]
    body = [
        [
            row["node"],
            row["op_type"],
            row["sqnr_db"],
            row["isolated_max_abs"],
            row["propagated_max_abs"],
            row["isolated_lsb"],
            row.get("clipped"),
            row.get("levels"),
        ]
        for row in worst
    ]
    return join([bullets(said), figure(chart, f"the {len(worst)} operators with the lowest SQNR"), table(header, body)])


def gains(answer: Answer, salt: str) -> Html:
    """impact's operators by the output SQNR gained when each is kept float, the most first."""
    ranked = [row for row in answer["ops"] if row["gain_db"] is not None][:TOP]
    said = [
        f"output SQNR of {answer['b']} against {answer['a']}: {fmt(answer['output_sqnr_db'])} dB (worst part"
        + (f", {part_words(answer['worst_part'])}" if answer["worst_part"] else "")
        + f"), pooled {fmt(answer['pooled_sqnr_db'])} dB, as deployed {fmt(answer['deployed_output_sqnr_db'])} dB "
        f"over {answer['samples']} sample(s)",
        *answer["warnings"],
    ]
    if "exclude" in answer:
        ex = answer["exclude"]
        said.append(
            f"to reach {ex['target_sqnr_db']} dB: keep {', '.join(ex['nodes']) or 'nothing'} float "
            f"({fmt(ex['sqnr_db'])} dB, {'reached' if ex['reached'] else 'not reached'})"
        )
    body = [[row["node"], row["op_type"], row["gain_db"], row["sqnr_db"]] for row in ranked]
    tensors = [
        [row["tensor"], row["producer"], row["gain_db"], row["rounding_gain_db"], row["clipped"]]
        for row in answer["tensors"][:TOP]
    ]
    parts = [bullets(said)]
    if ranked:
        chart = ranked_chart([row["node"] for row in ranked], [row["gain_db"] for row in ranked], "gain (dB)", salt)
        parts.append(figure(chart, f"the {len(ranked)} operators whose float copy gains the most output SQNR"))
    parts += [table(["node", "op type", "gain dB", "SQNR dB kept float"], body)]
    if tensors:
        parts += [
            Html("<h3>tensors kept float</h3>"),
            table(["tensor", "producer", "gain dB", "rounding gain dB", "clipped"], tensors),
        ]
    return join(parts)


def fmt(value: float | None) -> str:
    return "null" if value is None else f"{value:.4g}"
