"""runtime: what onnxruntime really executes for each operator.

"Wrapped" is a structural proxy. onnxruntime decides at session build time
which DQ -> op -> Q groups become integer kernels, so the only honest answer
comes from the graph it saves after optimization. One session, built from a
copy of the model in which every node has a unique name; each original
compute node is then found in the optimized graph and its kernel classified.
"""

from __future__ import annotations

import textwrap
from typing import Any, cast

from graphscan import (
    EXIT_USAGE,
    INSTALL_TARGETS,
    RUNTIME_LEVELS,
    TABLE_WIDTH,
    Command,
    CpuTarget,
    GraphscanError,
    OnlyWith,
    Samples,
    Session,
    format_fields,
    load_with_weights,
    page,
    section,
    visible,
)
from graphscan_ort.engines.classify import classes_answer, classify
from graphscan_ort.engines.timing import runtime_time
from graphscan_ort.shared.answers import ClassChange, NodeRow, RuntimeAnswer
from graphscan_ort.shared.inputs import model_samples, parse_shapes
from graphscan_ort.shared.kernels import RUNTIME_CLASSES
from graphscan_ort.shared.options import Timing
from graphscan_ort.shared.sessions import CPU, environment, inputs_hint


def differs(native: list[NodeRow], target: list[NodeRow]) -> list[ClassChange]:
    """The nodes whose class on the target is not their class natively, in graph order."""
    return [
        {"node": here["node"], "op_type": here["op_type"], "native": here["class"], "cpu": there["class"]}
        for here, there in zip(native, target, strict=True)
        if here["class"] != there["class"]
    ]


def runtime(
    path: str,
    provider: str,
    int8_allowed: bool,
    timed: bool,
    session: Session,
    samples: Samples,
    timing: Timing,
    cpu: CpuTarget,
) -> RuntimeAnswer:
    """Per compute node: the kernel onnxruntime runs for it and its class (on ``cpu``);
    with ``timed``, each class's kernel time and the round trips' cost (this machine only)."""
    if timed and not cpu.native:
        raise GraphscanError(
            f"usage: --time measures this machine's latency; under --cpu {cpu.name} onnxruntime is emulated, "
            "so its time is no latency (leave out --cpu to time natively)",
            EXIT_USAGE,
        )
    cpu.require()
    model = load_with_weights(path)
    shapes = parse_shapes(samples.shape)
    found = classify(model, path, session.level, provider, int8_allowed)
    if not cpu.native:
        return on_target(path, found.rows, session.level, provider, int8_allowed, cpu)
    answer: RuntimeAnswer = {
        "model": path,
        "environment": environment(session.level, provider, int8_allowed=int8_allowed),
        **found.counts,
        "nodes": found.rows,
        "unmapped": found.unmapped,
    }
    if timed:
        chosen, defaulted = model_samples(found.named, samples.inputs, shapes, samples.seed, 1)
        with inputs_hint(not samples.inputs, 1, [path]):
            answer["time"] = runtime_time(
                found, path, chosen[0], defaulted, session.level, provider, int8_allowed, timing
            )
    return answer


def on_target(
    path: str, native: list[NodeRow], level: str, provider: str, int8_allowed: bool, cpu: CpuTarget
) -> RuntimeAnswer:
    """runtime's answer from ``cpu``'s own session, with the nodes whose class differs from ``native``."""
    runner = cpu.runner()
    there = runner.call(classes_answer, path, level, provider, int8_allowed)
    answer = {"model": path, "environment": there.pop("environment"), "cpu": runner.facts, **there}
    answer["differs_from_native"] = differs(native, there["nodes"])
    return cast(RuntimeAnswer, answer)


def node_us(answer: dict[str, Any], node: dict[str, Any]) -> float | None:
    """A node's kernel microseconds per run, when ``--time`` measured it."""
    return (answer.get("time") or {}).get("nodes", {}).get(node["node"])


def runtime_table(answer: dict[str, Any], top: int | None) -> str:
    """Classes by op type and nodes in graph order (slowest first with ``top`` and ``--time``)."""
    env = answer["environment"]
    head = format_fields(
        [
            ("model", answer["model"]),
            ("onnxruntime", env.get("onnxruntime")),
            ("provider", env.get("provider")),
            ("level", env.get("level")),
            ("machine", env.get("machine")),
            *([("cpu", answer["cpu"].get("name"))] if "cpu" in answer else []),
            ("int8_allowed", env.get("int8_allowed")),
            ("compute", answer["compute"]),
            ("wrapped", answer["wrapped"]),
        ]
        + [(name, answer["classes"].get(name, 0)) for name in RUNTIME_CLASSES]
        + [("wrapped_but_float", answer["wrapped_but_float"]), ("float_but_int8", answer["float_but_int8"])]
    )
    by_op = sorted(answer["by_op_type"].items(), key=lambda item: (-sum(item[1].values()), item[0]))
    op_rows = [[op] + [counts.get(name, 0) for name in RUNTIME_CLASSES] for op, counts in by_op]
    timed = "time" in answer
    nodes_list = answer["nodes"]
    title = "nodes in graph order"
    if timed and top is not None:
        nodes_list = sorted(nodes_list, key=lambda n: -(node_us(answer, n) or 0))
        title = "nodes by kernel time"
    node_rows = [
        [n["node"], n["op_type"], n["wrapped"], n["class"], n["kernel"], (n.get("reason") or {}).get("code")]
        + ([node_us(answer, n)] if timed else [])
        for n in nodes_list
    ]
    node_titles = ["node", "op_type", "wrapped", "class", "kernel", "reason"] + (["us"] if timed else [])
    blocks = [
        head,
        section("by op_type", ["op_type"] + RUNTIME_CLASSES, op_rows),
        section(title, node_titles, node_rows, top, ["op_type"]),
    ]
    if "differs_from_native" in answer:
        changes = [[c["node"], c["op_type"], c["native"], c["cpu"]] for c in answer["differs_from_native"]]
        blocks.append(section("classes that differ from native", ["node", "op_type", "native", "cpu"], changes, top))
    if timed:
        timing = answer["time"]
        numbers = [[key, timing[key]] for key in ("runs", "profiler_floor_us", "round_trip_cost")]
        numbers += [[f"wall_ms {key}", value] for key, value in timing["wall_ms"].items()]
        numbers += [[f"share {kind}", share] for kind, share in timing["shares"].items()]
        blocks.append(section("time", ["what", "value"], numbers))
        blocks.append(textwrap.fill(visible("method: " + timing["method"]), TABLE_WIDTH))
    return page(*blocks)


COMMAND = Command(
    "runtime",
    runtime,
    options=(
        Session.taken(
            list(RUNTIME_LEVELS),
            "extended",
            "onnxruntime graph optimization level (default: extended, where each kernel maps back to a node;"
            " tune, and check's --min-sqnr and --min-metric, measure at all, as deployed)",
        ),
        ("--provider", {"default": CPU, "help": f"execution provider (default: {CPU})"}),
        ("--int8-allowed", {"action": "store_true", "help": "set session.qdqisint8allowed=1"}),
        (
            "--time",
            {
                "action": "store_true",
                "dest": "timed",
                "help": "profile kernel time per class and measure the Q/DQ round trips' cost",
            },
        ),
        CpuTarget.taken(
            "classify in onnxruntime built for this CPU, emulated (default: native; install the others: "
            f"{INSTALL_TARGETS})"
        ),
        Samples.taken(1, when="--time: "),
        Timing.taken("--time: timed runs"),
    ),
    only_with=(OnlyWith("--time", lambda built: built["timed"], ("inputs", "shape", "seed", "runs")),),
    table=runtime_table,
    answer=RuntimeAnswer,
)
