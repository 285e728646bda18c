"""Saved answers of every kind the report draws, made once per session (about 3 s)."""

import importlib.util
import json
from pathlib import Path

import pytest

import graphscan
from tests.helpers import small_cnn_held_out

# matplotlib is the extra `report`, pinned in requirements.txt: CI has it. Where it is missing the
# pages cannot be drawn, and only tests/report/test_without_plotting.py runs.
PLOTTING = importlib.util.find_spec("matplotlib") is not None
needs_plotting = pytest.mark.skipif(
    not PLOTTING, reason="matplotlib is not installed here (pip install -r requirements.txt: the extra report)"
)


def save(folder, name, answer):
    path = Path(folder) / f"{name}.json"
    path.write_text(json.dumps(answer, allow_nan=False), encoding="utf-8")
    return path


def arm64_twin(answer):
    """runtime's answer as ``runtime --cpu arm64`` would give it where arm64 runs every Add
    float (the classes moved by hand, the counts derived from the node rows): a second CPU
    target's answer of the same model, without qemu."""
    moved = {"class": "float", "reason": {"code": "no_kernel", "detail": "made by hand: no Add kernel on this CPU"}}
    nodes = [
        dict(n, **(moved if n["wrapped"] else {"class": "float"})) if n["op_type"] == "Add" else dict(n)
        for n in answer["nodes"]
    ]
    by_op_type = {}
    for node in nodes:
        if node["class"] is not None:
            counts = by_op_type.setdefault(node["op_type"], {})
            counts[node["class"]] = counts.get(node["class"], 0) + 1
    classes = {name: sum(n["class"] == name for n in nodes) for name in ("int8", "int8_data", "float", "absorbed")}
    differs = [
        {"node": a["node"], "op_type": a["op_type"], "native": a["class"], "cpu": b["class"]}
        for a, b in zip(answer["nodes"], nodes, strict=True)
        if a["class"] != b["class"]
    ]
    twin = {key: value for key, value in answer.items() if key not in ("nodes", "unmapped")}
    twin.update(cpu={"name": "arm64", "onnxruntime": "1.32.0", "machine": "aarch64"}, classes=classes)
    twin.update(by_op_type={op: dict(sorted(c.items())) for op, c in sorted(by_op_type.items())})
    twin.update(wrapped_but_float=sum(n["wrapped"] and n["class"] == "float" for n in nodes))
    twin.update(nodes=nodes, unmapped=answer["unmapped"], differs_from_native=differs)
    return twin


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """tune on a small residual CNN (as tests/tune/test_tune.py's ``tuned``: 8 held-out
    samples, ``--min-speedup 0`` so that speed noise never refuses a row) with ``--report``,
    then runtime, check, trace and impact on the model it wrote, each answer saved as JSON;
    and runtime's answer as an arm64 target would give it."""
    folder = tmp_path_factory.mktemp("answers")
    fp32, calibration, held = small_cnn_held_out(folder)
    out = folder / "out"
    tune = graphscan.tune(
        str(fp32), calibrate=calibration, inputs=[str(held)], out=str(out), runs=3, min_speedup=0, report=True
    )
    model, prepared, sample = str(out / "model.onnx"), str(out / "prepared.onnx"), str(held / "h0.npz")
    runtime = graphscan.runtime(model)
    answers = {
        "tune": tune,
        "runtime": runtime,
        "check": graphscan.check(
            model, float_path=str(fp32), inputs=[sample], min_sqnr=10, min_int8=0.5, max_islands=3
        ),
        "trace": graphscan.trace(str(fp32), model),
        "impact": graphscan.impact(prepared, model, inputs=[sample]),
        "runtime_arm64": arm64_twin(runtime),
    }
    paths = {name: save(folder, name, answer) for name, answer in answers.items()}
    return {"folder": folder, "answers": answers, "paths": paths, "out": out, "float": fp32}
