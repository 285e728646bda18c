"""runtime --time: where the time goes, and what the Q/DQ round trips cost."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx

from graphscan import GraphIndex, shown
from graphscan_ort.common import does_not_run, open_session, session_options
from graphscan_ort.runtime import TIME_CLASSES, time_class

PROFILE_FLOOR_NODES = 200


def profile_events(session):
    """The profiler's per-kernel events: ``[(run number, node name, op, microseconds)]``."""
    profile = session.end_profiling()
    try:
        with open(profile) as f:
            events = json.load(f)
    finally:
        os.unlink(profile)
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    kernels = []
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        run_number = sum(1 for start in runs if start <= event["ts"]) - 1
        kernels.append((run_number, event["name"][: -len("_kernel_time")], event["args"].get("op_name"), event["dur"]))
    return kernels


def profiled_runs(model_bytes, subject, options, provider, feeds, runs):
    """Kernel events of ``runs`` profiled runs after one warm-up run, on one
    thread; a failure blames ``subject``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="graphscan-profile-") as folder:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(folder, "profile")
        session = open_session(model_bytes, subject, options, provider)
        try:
            for _ in range(runs + 1):
                session.run(None, feeds)
        except Exception as exc:
            raise does_not_run(subject, exc)
        return [event for event in profile_events(session) if event[0] >= 1]


def profiler_floor(provider, runs):
    """The profiler's own cost per kernel event, in microseconds.

    Measured as the median duration of a chain of Identity kernels on one
    float: work that takes no time, so what the profiler reports is its floor.
    """
    chain = [
        onnx.helper.make_node("Identity", [f"t{k}"], [f"t{k + 1}"], name=f"n{k}") for k in range(PROFILE_FLOOR_NODES)
    ]
    graph = onnx.helper.make_graph(
        chain,
        "floor",
        [onnx.helper.make_tensor_value_info("t0", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info(f"t{PROFILE_FLOOR_NODES}", onnx.TensorProto.FLOAT, [1])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    events = profiled_runs(
        model.SerializeToString(),
        "graphscan's profiler-floor model",
        session_options(threads=1),
        provider,
        {"t0": np.zeros(1, np.float32)},
        max(1, min(runs, 5)),
    )
    return float(np.median([duration for _, _, _, duration in events])) if events else 0.0


def without_round_trips(model):
    """A copy of ``model`` with every activation Q -> DQ round trip removed.

    Applied to the optimized model, it removes exactly the round trips that
    onnxruntime runs as separate Q and DQ kernels: those it fused into integer
    kernels are no longer Q -> DQ pairs there. Readers of each DQ read the Q's
    input instead; round trips whose DQ output is a graph output stay.
    """
    index = GraphIndex(model.graph)
    graph_outputs = {o.name for o in model.graph.output}
    rename, drop = {}, set()
    for q in index.q_nodes:
        source = model.graph.node[q].input[0]
        if source in index.initializers:
            continue
        readers = [c for t in index.outputs[q] for c in index.consumers_of(t)]
        if not readers or not all(index.is_dq[c] for c in readers):
            continue
        if any(t in graph_outputs for c in readers for t in index.outputs[c]):
            continue
        drop.add(q)
        for dq in readers:
            drop.add(dq)
            for t in index.outputs[dq]:
                rename[t] = source
    ablated = onnx.ModelProto()
    ablated.CopyFrom(model)
    del ablated.graph.node[:]
    for i, node in enumerate(model.graph.node):
        if i in drop:
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.input[:] = [rename.get(t, t) for t in node.input]
        ablated.graph.node.append(copy)
    return ablated, len(drop)


def interleaved_wall_times(sessions, feeds, runs):
    """Median seconds per run of each session, timed in alternation so that
    the machine's drift falls on all of them alike."""
    import statistics
    import time as clock

    times = [[] for _ in sessions]
    for session in sessions:
        session.run(None, feeds)  # warm-up
    for _ in range(runs):
        for k, session in enumerate(sessions):
            start = clock.perf_counter()
            session.run(None, feeds)
            times[k].append(clock.perf_counter() - start)
    return [statistics.median(t) for t in times]


def runtime_time(
    named_bytes, optimized_proto, path, rows, optimized, feeds, defaulted, level, provider, int8_allowed, runs
):
    """The ``time`` object of ``runtime --time``."""
    floor = profiler_floor(provider, runs)
    options = session_options(level, threads=1, int8_allowed=int8_allowed)
    events = profiled_runs(named_bytes, f"{shown(path)}: model", options, provider, feeds, runs)
    by_name = {}
    for _, name, _, duration in events:
        by_name[name] = by_name.get(name, 0.0) + max(duration - floor, 0.0)
    totals = dict.fromkeys(TIME_CLASSES, 0.0)
    for name, spent in by_name.items():
        j = optimized.by_name.get(name)
        if j is not None:
            totals[time_class(optimized, j)] += spent
    whole = sum(totals.values())
    shares = {kind: (spent / whole if whole else None) for kind, spent in totals.items()}
    node_us = {
        row["node"]: by_name[row["runs_in"]] / runs
        for row in rows
        if row["class"] in ("int8", "int8_data", "float") and row["runs_in"] in by_name
    }
    # Both timed from the optimized graph as saved, with no further
    # optimization, so the only difference is the round trips removed.
    ablated, removed = without_round_trips(optimized_proto)
    if not removed:
        return time_answer(floor, feeds, defaulted, runs, shares, node_us, removed, None, None, 0.0)
    frozen = session_options(threads=1)
    sessions = [
        open_session(optimized_proto, f"{shown(path)} (as optimized by onnxruntime)", frozen, provider),
        open_session(ablated, f"graphscan's copy of {shown(path)} without Q/DQ round trips", frozen, provider),
    ]
    try:
        model_s, ablated_s = interleaved_wall_times(sessions, feeds, runs)
    except Exception as exc:
        raise does_not_run(f"{shown(path)}: model", exc)
    cost = 1.0 - ablated_s / model_s if model_s > 0 else None
    return time_answer(floor, feeds, defaulted, runs, shares, node_us, removed, model_s, ablated_s, cost)


def time_answer(floor, feeds, defaulted, runs, shares, node_us, removed, model_s, ablated_s, cost):
    """The ``time`` object, with the method spelled out."""
    return {
        "method": (
            f"onnxruntime profiler, one thread, {runs} runs after one warm-up; each kernel event minus "
            f"the profiler's floor ({floor:.2f} us, the median event of a {PROFILE_FLOOR_NODES}-Identity "
            f"chain), at least 0. round_trip_cost: 1 - median wall time of the optimized graph "
            f"without its {removed} activation Q/DQ round-trip nodes / median wall time of the "
            f"optimized graph, both run as saved (no further optimization), timed alternately "
            f"without the profiler (0 when there are none)"
        ),
        "inputs": {name: list(array.shape) for name, array in feeds.items()},
        "defaulted": defaulted,
        "runs": runs,
        "profiler_floor_us": floor,
        "shares": shares,
        "nodes": node_us,
        "wall_ms": {
            "model": model_s * 1e3 if model_s is not None else None,
            "without_round_trips": ablated_s * 1e3 if ablated_s is not None else None,
        },
        "round_trip_cost": cost,
    }
