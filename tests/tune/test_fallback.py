"""Float fallback onnxruntime honours: an excluded Conv between quantized neighbours is
quantized again by a default session (WeightBiasQuantization); tune sees it with
runtime's classes and makes the exclusion real by unquantizing the node's inputs."""

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

import gen_models
import graphscan
import graphscan_ort.tune.stages as tune_stages
import graphscan_ort.tune.trials as tune_trials
from graphscan_ort.tune import fallback
from graphscan_ort.tune.candidates import keyword_arguments, quiet
from tests.helpers import calibration_reader, without_structural_seeds

EXCLUDED = ["b1_conv2", "b2_merge"]  # each reads a DQ and feeds a Q: onnxruntime quantizes them anyway


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fallback")
    onnx.save(gen_models.build_cnn(2, channels=16, size=8, seed=0), folder / "cnn.onnx")
    with quiet():
        quant_pre_process(str(folder / "cnn.onnx"), str(folder / "prepared.onnx"), skip_symbolic_shape=True)
    rng = np.random.default_rng(5)
    files = []
    for k in range(3):
        files.append(str(folder / f"s{k}.npz"))
        np.savez(files[-1], x=rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    return {
        "folder": folder,
        "float": str(folder / "cnn.onnx"),
        "prepared": str(folder / "prepared.onnx"),
        "files": files,
    }


def quantized(prepared, path, excluded):
    with quiet():
        quantize_static(
            prepared["prepared"], str(path), calibration_reader(prepared["files"][:2]), nodes_to_exclude=excluded
        )
    return onnx.load(path)


def runtime_classes(path):
    answer = graphscan.runtime(str(path), level="all")
    return {row["node"]: row["class"] for row in answer["nodes"]}


def test_an_excluded_conv_between_quantized_neighbours_runs_int8_until_its_inputs_are_float(prepared, tmp_path):
    model = quantized(prepared, tmp_path / "q.onnx", EXCLUDED)
    before = runtime_classes(tmp_path / "q.onnx")
    assert [before[n] for n in EXCLUDED] == ["int8", "int8"]  # nodes_to_exclude alone is not honoured
    given = onnx.load(prepared["prepared"])
    fixed, status, applied = fallback.honoured(model, str(tmp_path / "q.onnx"), "all", EXCLUDED, given)
    assert status == {"b1_conv2": "float_inputs", "b2_merge": "float_inputs"} and applied == EXCLUDED
    assert onnx.load(tmp_path / "q.onnx").SerializeToString() == fixed.SerializeToString()
    after = runtime_classes(tmp_path / "q.onnx")  # the file was rewritten: runtime confirms
    assert [after[n] for n in EXCLUDED] == ["float", "float"]
    assert {n: c for n, c in after.items() if n in before and n not in EXCLUDED and before[n] == "int8"} == {
        n: "int8" for n, c in before.items() if n not in EXCLUDED and c == "int8"
    }  # every other int8 node still runs int8


def test_a_node_that_runs_float_as_excluded_is_left_alone(prepared, tmp_path):
    model = quantized(prepared, tmp_path / "q.onnx", ["b1_conv1"])  # its output goes to a Relu, not a Q
    data = (tmp_path / "q.onnx").read_bytes()
    given = onnx.load(prepared["prepared"])
    same, status, applied = fallback.honoured(model, str(tmp_path / "q.onnx"), "all", ["b1_conv1"], given)
    assert status == {"b1_conv1": "float"} and applied == [] and same is model
    assert (tmp_path / "q.onnx").read_bytes() == data


def tune_with_one_trial(prepared, tmp_path, monkeypatch):
    """tune on the fixture's CNN with a target out of reach and no structural seeds, so that
    the one exclusion trial is the ranking's first node: the answer and that trial's row."""
    without_structural_seeds(monkeypatch)
    answer = graphscan.tune(
        prepared["float"],
        calibrate=prepared["files"][:2],
        inputs=prepared["files"][2:],
        out=str(tmp_path / "out"),
        target=500.0,
        runs=1,
        min_speedup=0,
    )
    (row,) = [c for c in answer["candidates"] if c["quantize_static"].get("nodes_to_exclude")]
    return answer, row


def test_tune_reports_each_exclusion_and_its_row_reproduces_the_model(prepared, tmp_path, monkeypatch):
    """The search tries b1_conv2 (a fixed ranking): its row says it runs float only with
    float inputs, and quantize_static with the row's arguments, then the post-step the
    row names, gives the model tune measured, byte for byte."""
    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *a, **k: [{"node": "b1_conv2", "gain_db": 1.0}])
    measured = {}
    real_honoured = tune_trials.honoured

    def keep_copy(model, path, level, excluded, given, optimized=None):
        result = real_honoured(model, path, level, excluded, given, optimized)
        measured[tuple(excluded)] = tmp_path / f"measured-{len(measured)}.onnx"
        shutil.copy(path, measured[tuple(excluded)])
        return result

    monkeypatch.setattr(tune_trials, "honoured", keep_copy)
    answer, row = tune_with_one_trial(prepared, tmp_path, monkeypatch)
    assert row["excluded"] == {"b1_conv2": "float_inputs"} and row["post_step"] == {"float_inputs": ["b1_conv2"]}
    assert all(c["excluded"] is None and c["post_step"] is None for c in answer["candidates"] if c is not row)
    again = tmp_path / "again.onnx"
    prepared_path = tmp_path / "out" / "prepared.onnx"
    with quiet():
        quantize_static(
            str(prepared_path), str(again), calibration_reader(prepared["files"][:2]),
            **keyword_arguments(row["quantize_static"]),
        )  # fmt: skip
    fixed, changed = fallback.float_inputs(onnx.load(again), row["post_step"]["float_inputs"], onnx.load(prepared_path))
    assert changed == row["post_step"]["float_inputs"]
    onnx.save(fixed, again)
    assert again.read_bytes() == measured[("b1_conv2",)].read_bytes()


def kernels_of(path, nodes):
    """onnxruntime's profiler: the op each kernel that ran for ``nodes`` was (default session)."""
    import json

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(path) + ".profile"
    session = ort.InferenceSession(str(path), options)
    session.run(None, {"x": np.ones((1, 3, 8, 8), np.float32)})
    events = json.loads(Path(session.end_profiling()).read_text())
    return {
        event["args"].get("op_name")
        for event in events
        if event.get("cat") == "Node" and any(event["name"].startswith(f"{node}_") for node in nodes)
    }


def test_the_profiler_agrees_the_excluded_convs_run_float_and_nothing_is_left_dangling(prepared, tmp_path):
    model = quantized(prepared, tmp_path / "q.onnx", EXCLUDED)
    assert "QLinearConv" in kernels_of(tmp_path / "q.onnx", EXCLUDED)
    fixed, _, _ = fallback.honoured(model, str(tmp_path / "q.onnx"), "all", EXCLUDED, onnx.load(prepared["prepared"]))
    assert "QLinearConv" not in kernels_of(tmp_path / "q.onnx", EXCLUDED)
    assert "Conv" in kernels_of(tmp_path / "q.onnx", EXCLUDED)
    read = {tensor for node in fixed.graph.node for tensor in node.input}
    assert all(t.name in read for t in fixed.graph.initializer)  # no scale or zero point left unread


def test_a_folded_clip_with_initializer_bounds_is_applied_again_with_them(tmp_path):
    """Clip(x, lo, hi) before an excluded Conv: the quantizer folds the Clip into its Q and
    drops lo and hi; float_inputs copies them back with the Clip, and the model runs (a
    PP-OCR recognizer made tune stop with 'p2o.helper.constant.142 is not a graph input')."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
        numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"], name="clip"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8])], inits,
    )  # fmt: skip
    given = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(given, tmp_path / "f.onnx")
    np.savez(tmp_path / "s.npz", x=rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    from onnxruntime.quantization import QuantType

    with quiet():
        quantize_static(
            str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), calibration_reader([tmp_path / "s.npz"]),
            nodes_to_exclude=["conv2"], activation_type=QuantType.QUInt8,
        )  # fmt: skip
    quantized = onnx.load(tmp_path / "q.onnx")
    fixed, status, applied = fallback.honoured(quantized, str(tmp_path / "q.onnx"), "all", ["conv2"], given)
    assert status == {"conv2": "float_inputs"} and applied == ["conv2"]
    assert any(n.op_type == "Clip" for n in fixed.graph.node)  # the folded Clip, applied again
    budget = graphscan.check(str(tmp_path / "q.onnx"), float_path=str(tmp_path / "f.onnx"), min_sqnr=-100,
                             inputs=[str(tmp_path / "s.npz")])  # fmt: skip
    assert budget["budgets"][0]["value"] is not None  # it runs, and is measured
    names = {t.name for t in fixed.graph.initializer} | {o for n in fixed.graph.node for o in n.output}
    assert all(i in names or i == "" for n in fixed.graph.node if n.op_type == "Clip" for i in n.input[1:])


def test_an_exclusion_that_holds_is_measured_in_the_session_it_was_checked_in(prepared, tmp_path, monkeypatch):
    """b2_down excluded runs float as written: the session its exclusion was checked in (the
    graph it saved) is the one its row is measured in, so its file is opened once for both,
    and classify never opens a session of its own for it."""
    import graphscan_ort.engines.classify as classify_module
    import graphscan_ort.tune.deployed as deployed

    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *a, **k: [{"node": "b2_down", "gain_db": 1.0}])
    opened, classified = [], []
    real_session, real_optimized = deployed.measured_session, classify_module.optimized_model

    def measured_session(candidate, session):
        opened.append(Path(candidate.path).name)
        return real_session(candidate, session)

    def optimized_model(data, path, *rest):
        classified.append(Path(path).name)
        return real_optimized(data, path, *rest)

    monkeypatch.setattr(deployed, "measured_session", measured_session)
    monkeypatch.setattr(classify_module, "optimized_model", optimized_model)
    _, row = tune_with_one_trial(prepared, tmp_path, monkeypatch)
    assert row["excluded"] == {"b2_down": fallback.AS_EXCLUDED} and row["sqnr_db"] is not None
    name = f"candidate-{row['id']}.onnx"
    assert opened.count(name) == 1 and name not in classified
