"""runtime --time: where the time goes, and what the Q/DQ round trips cost; and when a
median time is too far off others of the same model to be the model's (``far_off``)."""

from __future__ import annotations

import bisect
import json
import os
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from graphscan import EXIT_NO_FILE, EXIT_RUNTIME, GraphIndex, GraphscanError, one_line, shown
from graphscan_ort.shared.answers import RuntimeTime
from graphscan_ort.shared.graph import body_reads
from graphscan_ort.shared.kernels import TIME_CLASSES, tensor_types, time_class
from graphscan_ort.shared.options import Timing
from graphscan_ort.shared.sessions import does_not_run, open_session, session_options, temporary_folder

if TYPE_CHECKING:
    from graphscan_ort.engines.classify import Classification

PROFILE_FLOOR_NODES = 200


# onnxruntime's profiler records at most this many events in one session and
# drops the rest: runs are spread over sessions so no profile comes near it.
PROFILER_EVENT_CAP = 1_000_000


# onnxruntime holds a session's events in memory until the profile is written
# (about 2.7 KB each: 2,000 runs of a 200-node chain held 1.1 GB in one session):
# each session gets at most this many, so memory stays bounded whatever --runs,
# while a big model is not rebuilt for every run or two.
SESSION_EVENTS = 200_000


def profile_events(path: str) -> Iterator[dict[str, Any]]:
    """The events of an onnxruntime profile file, one at a time: the file holds
    one event per line, so memory does not grow with the number of events."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip().rstrip(",")
            if line not in ("", "[", "]"):
                yield json.loads(line)


def kernel_name(event: dict[str, Any]) -> str | None:
    """The node a kernel event timed, or None for any other event."""
    name = event.get("name", "")
    return name[: -len("_kernel_time")] if event.get("cat") == "Node" and name.endswith("_kernel_time") else None


def profiled_session(
    model_bytes: bytes, subject: str, options: Any, provider: str, feeds: dict[str, np.ndarray], runs: int, folder: str
) -> str:
    """Run a profiling session ``runs`` + 1 times (the first a warm-up); the path of its profile
    and how many events it holds."""
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(folder, "profile")
    session = open_session(model_bytes, subject, options, provider)
    try:
        for _ in range(runs + 1):
            session.run(None, feeds)
    except Exception as exc:
        raise does_not_run(subject, exc)
    try:
        return session.end_profiling()
    except Exception as exc:  # the profile is written now: a full disk
        raise GraphscanError(
            f"cannot write onnxruntime's profile into the temporary folder {shown(folder)} ({one_line(exc)}): "
            "is it full? set TMPDIR",
            EXIT_NO_FILE,
        )


def kernel_totals(profile: str, runs: int, floor: float) -> tuple[dict[str, float], bool]:
    """``({node: microseconds}, complete)`` over the timed runs of a profile: each
    kernel event less ``floor`` (at least 0), the warm-up run left out. Streamed
    twice: once for the runs' start times, once for the kernels. ``complete``:
    every run is in the profile and it is below the profiler's cap."""
    starts, count = [], 0
    for event in profile_events(profile):
        count += 1
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            starts.append(event["ts"])
    starts.sort()
    totals: dict[str, float] = {}
    for event in profile_events(profile):
        name = kernel_name(event)
        if name is not None and bisect.bisect_right(starts, event["ts"]) >= 2:  # after the warm-up run started
            totals[name] = totals.get(name, 0.0) + max(event["dur"] - floor, 0.0)
    return totals, len(starts) == runs + 1 and count < PROFILER_EVENT_CAP


def profiled_totals(
    model_bytes: bytes,
    subject: str,
    make_options: Callable[[], Any],
    provider: str,
    feeds: dict[str, np.ndarray],
    runs: int,
    kernels_per_run: int,
    floor: float,
) -> dict[str, float]:
    """``{node name: microseconds over all runs}`` of ``runs`` profiled runs on one
    thread, spread over as many sessions (each with its warm-up run) as keep each
    profile far below PROFILER_EVENT_CAP: nothing is averaged over truncated data."""
    per_session = max(1, min(PROFILER_EVENT_CAP // 2, SESSION_EVENTS) // (kernels_per_run + 4) - 1)
    totals: dict[str, float] = {}
    done = 0
    with temporary_folder("graphscan-profile-") as folder:
        while done < runs:
            chunk = min(per_session, runs - done)
            profile = profiled_session(model_bytes, subject, make_options(), provider, feeds, chunk, folder)
            try:
                chunk_totals, complete = kernel_totals(profile, chunk, floor)
            finally:
                os.unlink(profile)
            if not complete:
                if chunk == 1:
                    raise GraphscanError(
                        f"{subject}: onnxruntime's profiler cannot record one whole run of it "
                        f"(at most {PROFILER_EVENT_CAP} events)",
                        EXIT_RUNTIME,
                    )
                per_session = max(1, chunk // 2)
                continue
            for name, spent in chunk_totals.items():
                totals[name] = totals.get(name, 0.0) + spent
            done += chunk
    return totals


def profiler_floor(provider: str, runs: int) -> float:
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
    runs = max(1, min(runs, 5))
    with temporary_folder("graphscan-profile-") as folder:
        options = session_options(threads=1, spinning=True)
        profile = profiled_session(
            model.SerializeToString(),
            "graphscan's profiler-floor model",
            options,
            provider,
            {"t0": np.zeros(1, np.float32)},
            runs,
            folder,
        )
        starts = sorted(e["ts"] for e in profile_events(profile) if e.get("name") == "model_run")
        durations = [
            e["dur"]
            for e in profile_events(profile)
            if kernel_name(e) is not None and bisect.bisect_right(starts, e["ts"]) >= 2
        ]
    return float(np.median(durations)) if durations else 0.0


def without_round_trips(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` with every activation Q -> DQ round trip removed.

    Applied to the optimized model, it removes exactly the round trips that
    onnxruntime runs as separate Q and DQ kernels: those it fused into integer
    kernels are no longer Q -> DQ pairs there. Readers of each DQ read the Q's
    input instead. A round trip stays when its DQ output is a graph output, is
    read by an If/Loop/Scan body (the body would read a name no longer made),
    or has another element type than the Q's input (a float16 model's Casts):
    graphscan's copy must be a valid model.
    """
    index = GraphIndex(model.graph)
    graph_outputs = {o.name for o in model.graph.output}
    read_by_bodies = set().union(*(body_reads(node) for node in model.graph.node if node.attribute))
    types = tensor_types(model.graph)
    undefined = onnx.TensorProto.UNDEFINED
    rename, drop = {}, set()
    for q in index.q_nodes:
        source = model.graph.node[q].input[0]
        if source in index.initializers:
            continue
        readers = [c for t in index.outputs[q] for c in index.consumers_of(t)]
        if not readers or not all(index.is_dq[c] for c in readers):
            continue
        made = [t for c in readers for t in index.outputs[c]]
        if any(t in graph_outputs or t in read_by_bodies for t in made):
            continue
        kinds = {types.get(t, undefined) for t in [source, *made]} - {undefined}
        if len(kinds) > 1:
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


def interleaved_wall_times(sessions: list[Any], feeds: dict[str, np.ndarray], runs: int) -> list[float]:
    """Median seconds per run of each session, timed in alternation so that
    the machine's drift falls on all of them alike."""
    import statistics

    return [statistics.median(t) for t in interleaved_runs(sessions, feeds, runs)]


def interleaved_runs(
    sessions: list[Any], feeds: dict[str, np.ndarray], runs: int, warm: bool = True
) -> list[list[float]]:
    """Seconds of each of ``runs`` runs of each session (after one warm-up run each, unless
    ``warm`` is False: they have just run these feeds), the sessions run in alternation:
    run k of every session was timed at one moment."""
    import time as clock

    times: list[list[float]] = [[] for _ in sessions]
    for session in sessions if warm else []:
        session.run(None, feeds)  # warm-up
    for _ in range(runs):
        for k, session in enumerate(sessions):
            start = clock.perf_counter()
            session.run(None, feeds)
            times[k].append(clock.perf_counter() - start)
    return times


# A median time lies far off others of one model when it is beyond both: this many scaled
# median absolute deviations from their median (1.4826 * MAD is a normal's standard
# deviation, and a few wild values cannot move it), and this factor above or below it.
FAR_OFF_MADS = 3.0
FAR_OFF_FACTOR = 2.0


def far_off(value: float, others: Sequence[float]) -> bool:
    """Whether ``value``, a median time of a model, lies far above ``others``, medians of the
    same model timed at other moments: more than FAR_OFF_MADS scaled MADs above their median
    and more than FAR_OFF_FACTOR times it. A busy machine only slows a run, so only a slow time
    is a disturbed moment; a time far below the others says they were the disturbed ones (a
    run busy throughout: tune's warnings say so). The factor keeps ordinary jitter from
    counting (the medians of a 0.02 ms model spread up to about 2 times across tune's rows on
    2 shared cores); the MADs keep a run noisy throughout from judging one row by it."""
    middle = statistics.median(others)
    spread = 1.4826 * statistics.median(abs(other - middle) for other in others)
    return value - middle > FAR_OFF_MADS * spread and value > FAR_OFF_FACTOR * middle


def runtime_time(
    found: Classification,
    path: str,
    feeds: dict[str, np.ndarray],
    defaulted: list[str],
    level: str,
    provider: str,
    int8_allowed: bool,
    timing: Timing,
) -> RuntimeTime:
    """The ``time`` object of ``runtime --time``: ``found``'s session profiled, and its
    optimized graph (``found.optimized``) timed with and without its round trips."""
    optimized_proto, optimized, rows, runs = found.optimized_model, found.optimized, found.rows, timing.runs
    floor = profiler_floor(provider, runs)
    by_name = profiled_totals(
        found.named_bytes,
        f"{shown(path)}: model",
        lambda: session_options(level, threads=1, int8_allowed=int8_allowed, spinning=True),
        provider,
        feeds,
        runs,
        len(optimized_proto.graph.node),
        floor,
    )
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
        return time_answer(floor, feeds, defaulted, runs, shares, node_us, removed, None)
    frozen = session_options(threads=1, spinning=True)
    sessions = [
        open_session(optimized_proto, f"{shown(path)} (as optimized by onnxruntime)", frozen, provider),
        open_session(ablated, f"graphscan's copy of {shown(path)} without Q/DQ round trips", frozen, provider),
    ]
    try:
        model_s, ablated_s = interleaved_wall_times(sessions, feeds, runs)
    except Exception as exc:
        raise does_not_run(f"{shown(path)}: model", exc)
    return time_answer(floor, feeds, defaulted, runs, shares, node_us, removed, (model_s, ablated_s))


def time_answer(
    floor: float,
    feeds: dict[str, np.ndarray],
    defaulted: list[str],
    runs: int,
    shares: dict[str, float | None],
    node_us: dict[str, float],
    removed: int,
    walls: tuple[float, float] | None,
) -> RuntimeTime:
    """The ``time`` object, with the method spelled out. ``walls``: the median wall seconds of
    the optimized graph and of it without its ``removed`` round trips (None: there are none,
    which cost nothing)."""
    model_s, ablated_s = walls if walls is not None else (None, None)
    if walls is None:
        cost: float | None = 0.0
    else:
        cost = 1.0 - walls[1] / walls[0] if walls[0] > 0 else None
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
