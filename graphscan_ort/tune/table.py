"""tune's table: the candidates Pareto-best first, the choice, and every detail a column
would cut, shown whole below it (rendered from the JSON answer, never the reverse)."""

from __future__ import annotations

import textwrap
from typing import Any, cast

from graphscan import TABLE_WIDTH, format_fields, metric_words, page, section, visible
from graphscan_ort.shared.agreement import BUILT_IN
from graphscan_ort.shared.answers import raced_on_speed


def tune_table(answer: dict[str, Any], top: int | None) -> str:
    """Candidates on the Pareto front first (the answer's order), then the choice."""
    target = answer["target"]
    described = answer["metric"]
    latency = answer["latency"]
    head = format_fields(
        [("model", answer["model"]), ("level", answer["environment"]["level"])]
        + ([("cpu", answer["cpu"]["name"]), ("speed on", latency["cpu"]["name"])] if "cpu" in answer else [])
        + [("float ms", answer["float"]["ms"])]
        + [("metric", " ".join(metric_words(described)))]
        + [("target", target["value"]), ("from", target["source"])]
        + [("confidence", answer["evaluation"]["confidence"]), ("rows compared", answer["evaluation"]["rows_compared"])]
        + [("latency at", shapes_text(latency["inputs"])), ("min speedup", latency["min_speedup"])]
        + [("chosen", answer["chosen"]), ("reached", answer["reached"]), ("output", answer["output"])]
    )
    steps = [[s["step"], s["ok"], briefly(s["detail"])] for s in answer["prepare"]]
    rows = [
        [
            c["id"],
            *quantizer_columns(c),
            c["rewrites"],
            len(arguments(c).get("nodes_to_exclude") or []) or None,
            c["metric_value"],
            c["metric_bound"],
            c["int8_kernels"],
            c["speedup"],
            "error" if c["error"] else ",".join(c["fails"] or []) or ("-" if c["fails"] is None else "none"),
            c["pareto"],
        ]
        for c in answer["candidates"]
    ]
    metric = described["name"] if described["name"] in BUILT_IN else "metric"  # a FILE.py:FUNCTION: whole above
    titles = ["id", "act", "pc", "method", "rw", "excl", metric, "bound", "int8", "speed", "fails", "front"]
    # What a column would cut is shown whole below: long details, exclusions, errors.
    whole = [
        f"{s['step']}: {s['detail']}" for s in answer["prepare"] if not s["ok"] or briefly(s["detail"]) != s["detail"]
    ]
    whole += [exclusion(c) for c in answer["candidates"] if arguments(c).get("nodes_to_exclude")]
    whole += [recovered(c) for c in answer["candidates"] if c.get("recovery")]
    whole += [f"candidate {c['id']}: {c['error']}" for c in answer["candidates"] if c["error"]]
    raced = [c for c in answer["candidates"] if c.get("raced")]  # answers before the race: no key
    on_speed = sorted(c["id"] for c in raced if raced_on_speed(c))
    on_samples = sorted(c["id"] for c in raced if not raced_on_speed(c))
    if on_speed:
        whole.append(
            f"{candidates(on_speed)}: raced out on speed (shown not above min speedup while another passed every "
            "guard), never run on the evaluation samples"
        )
    if on_samples:
        whole.append(
            f"{candidates(on_samples)}: raced out on their first evaluation samples (shown less accurate than a "
            "row as fast that passed every guard), never run on the rest"
        )
    whole += [f"warning: {w}" for w in answer["warnings"]]
    notes = "\n".join(textwrap.fill(visible(text), TABLE_WIDTH, subsequent_indent="  ") for text in whole)
    return page(
        head,
        section("prepare", ["step", "ok", "detail"], steps),
        section("candidates, Pareto-best first", titles, rows, top),
        section("times (ms), each candidate's beside its own float run", TIME_TITLES, time_rows(answer), top),
        *([f"in full:\n{notes}"] if notes else []),
    )


def candidates(ids: list[int]) -> str:
    """``candidate 3`` or ``candidates 3, 5``."""
    return f"candidate{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"


def arguments(candidate: dict[str, Any]) -> dict[str, Any]:
    """A candidate's quantizer arguments: quantize_static's, or quantize_dynamic's where it made it."""
    static = candidate["quantize_static"]
    return cast(dict[str, Any], static if static is not None else candidate["quantize_dynamic"])


def quantizer_columns(candidate: dict[str, Any]) -> list[Any]:
    """act, pc and method: a dynamic candidate's activations are quantized at run time (``dyn``), uncalibrated."""
    static = candidate["quantize_static"]
    if static is None:
        return ["dyn", "yes" if candidate["quantize_dynamic"].get("per_channel") else "no", "-"]
    return [static["activation_type"], "yes" if static["per_channel"] else "no", static["calibrate_method"]]


TIME_TITLES = ["id", "ms", "float ms", "speedup"]


def time_rows(answer: dict[str, Any]) -> list[list[Any]]:
    """Each candidate's ms beside the float model's own time in the same interleaved runs
    (speedup: the median of the run-by-run ratios), in the candidates' order."""
    return [[c["id"], c["ms"], c["float_ms"], c["speedup"]] for c in answer["candidates"]]


def briefly(detail: str) -> str:
    """A prepare step's detail up to its first ``; `` (what ran), the rest left to the notes."""
    head = detail.split("; ", 1)[0]
    return detail if head == detail else f"{head} (in full below)"


def exclusion(candidate: dict[str, Any]) -> str:
    """What an exclusion trial kept float and how each node runs, and the block it added."""
    how = candidate["excluded"] or {}
    kept = ", ".join(f"{node} ({how.get(node, '-')})" for node in arguments(candidate)["nodes_to_exclude"])
    trial = candidate["trial"]
    added = f"; trial: the {trial['block']} block {', '.join(trial['added'])}" if trial else ""
    return f"candidate {candidate['id']} keeps float: {kept}{added}"


def recovered(candidate: dict[str, Any]) -> str:
    """What a recovery row did: its step, its source, its gains in dB and in the metric, and
    whose speed it inherits."""
    done = candidate["recovery"]
    gains = ", ".join(
        f"{value:+.3g}{unit}" if value is not None else f"undefined{unit}"
        for value, unit in ((done["sqnr_gain_db"], " dB"), (done["metric_gain"], " in the metric"))
    )
    inherited = candidate.get("speed_from")
    speed = "" if inherited is None else f"; the same plan: candidate {inherited}'s speed, not timed again"
    return f"candidate {candidate['id']}: {done['step']} of candidate {done['from']} ({done['detail']}): {gains}{speed}"


def shapes_text(inputs: dict[str, Any]) -> str:
    """``x 1x3x736x1472`` for each input (several shapes: joined by ``|``)."""

    def dims(shape: list) -> str:
        if shape and isinstance(shape[0], list):
            return "|".join(dims(s) for s in shape)
        return "x".join(map(str, shape)) or "scalar"

    return " ".join(f"{name} {dims(shape)}" for name, shape in inputs.items())
