"""Calibration refinements (Entropy, other percentiles, a moving average) tried on the best
candidate when the target is not met, each reproducible; models the quantizer makes
identical are measured once and said to be the same."""

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import quantize_static

import gen_models
import graphscan
import graphscan_ort.tune.stages as tune_stages
import graphscan_ort.tune.trials as tune_trials
from graphscan_ort.tune.candidates import REFINEMENTS, calibration_key, keyword_arguments, quiet, refinements
from tests.helpers import calibration_reader, mlp_with_samples, point_estimates, without_dynamic_candidates


@pytest.fixture(scope="module")
def unreachable(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refine")
    files = mlp_with_samples(folder, layers=3, width=64, count=3, rows=16, seed=8)
    with pytest.MonkeyPatch.context() as monkeypatch:  # the refinements of quantize_static's rows
        without_dynamic_candidates(monkeypatch)
        monkeypatch.setattr(tune_stages, "recover", lambda *args: [])  # the rows of the refinements alone
        monkeypatch.setattr(tune_stages, "polished", lambda trials, chosen, reached, *rest: (chosen, reached))
        answer = graphscan.tune(
            str(folder / "mlp.onnx"),
            calibrate=files[:2],
            inputs=files[2:],
            out=str(folder / "out"),
            target=500.0,
            runs=1,
            min_speedup=0,
            max_trials=0,
        )
    return {"answer": answer, "files": files, "out": folder / "out", "float": str(folder / "mlp.onnx")}


def test_each_refinement_is_tried_on_the_best_candidate(unreachable):
    rows = unreachable["answer"]["candidates"]
    refined = [  # after the 8 candidates of the first stage, calibrated another way
        c for c in rows
        if c["id"] >= 8 and (c["quantize_static"]["calibrate_method"], c["quantize_static"].get("extra_options", {}))
        in REFINEMENTS
    ]  # fmt: skip
    assert len(refined) == len(REFINEMENTS)
    base = {k: v for k, v in refined[0]["quantize_static"].items() if k not in ("calibrate_method", "extra_options")}
    assert [(c["quantize_static"]["calibrate_method"], c["quantize_static"].get("extra_options", {})) for c in
            sorted(refined, key=lambda c: c["id"])] == REFINEMENTS  # fmt: skip
    assert all({k: c["quantize_static"][k] for k in base} == base for c in refined)  # one base for all


def test_a_refined_row_is_reproduced_by_its_arguments(unreachable, tmp_path):
    answer = unreachable["answer"]
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    with quiet():
        quantize_static(
            str(unreachable["out"] / "prepared.onnx"), str(tmp_path / "again.onnx"),
            calibration_reader(unreachable["files"][:2]), **keyword_arguments(chosen["quantize_static"]),
        )  # fmt: skip
    assert (tmp_path / "again.onnx").read_bytes() == (unreachable["out"] / "model.onnx").read_bytes()


def test_identical_models_are_measured_once_and_said_to_be_the_same(unreachable):
    rows = {c["id"]: c for c in unreachable["answer"]["candidates"]}
    for row in rows.values():
        if row["same_as"] is not None:
            twin = rows[row["same_as"]]
            assert twin["same_as"] is None and twin["id"] < row["id"]
            assert (row["sqnr_db"], row["bytes"], row["int8_kernels"]) == (
                twin["sqnr_db"],
                twin["bytes"],
                twin["int8_kernels"],
            )


def test_twins_are_found_by_content(tmp_path, monkeypatch):
    """The same settings twice give one model: the second row names the first, unmeasured."""
    onnx.save(gen_models.build_mlp(3, 64, 0, ("N",)), tmp_path / "mlp.onnx")
    np.savez(tmp_path / "s.npz", x=np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    plain = [{"quant_format": "QDQ", "activation_type": "QUInt8", "weight_type": "QInt8", "per_channel": False,
              "calibrate_method": "MinMax"}]  # fmt: skip
    monkeypatch.setattr(tune_stages, "candidate_settings", lambda: plain * 2)
    without_dynamic_candidates(monkeypatch)
    point_estimates(monkeypatch)  # one sample: met on its figure alone, no search after the grid
    calls = []
    measured = tune_trials.measure_candidate
    monkeypatch.setattr(tune_trials, "measure_candidate", lambda *a, **k: calls.append(1) or measured(*a, **k))
    answer = graphscan.tune(
        str(tmp_path / "mlp.onnx"), calibrate=[str(tmp_path / "s.npz")], out=str(tmp_path / "o"),
        runs=1, min_speedup=0, target=-100.0,
    )  # fmt: skip
    made = [c for c in answer["candidates"] if c["recovery"] is None]  # the chosen one's bias correction apart
    assert sorted(c["same_as"] for c in made if c["same_as"] is not None) == [0]
    timed = [c for c in answer["candidates"] if c["recovery"] and c["recovery"]["speed_from"] is None]
    assert len(made) == 2 and len(calls) == 1 + len([c for c in timed if c["same_as"] is None])


def test_the_calibration_cache_is_one_per_way_of_calibrating():
    assert calibration_key({"calibrate_method": "Percentile"}) == "Percentile"
    keys = {calibration_key(s) for s in refinements({"calibrate_method": "MinMax", "per_channel": True})}
    assert len(keys) == len(REFINEMENTS)


def test_calibration_samples_of_several_shapes_are_said_to_stop_histogram_methods(tmp_path):
    """onnxruntime's Percentile and Entropy calibrators stack every sample: with batches of 4
    and 7 they fail in numpy; the rows and a warning say why in the user's terms."""
    onnx.save(gen_models.build_mlp(3, 64, 0, ("N",)), tmp_path / "mlp.onnx")
    files = []
    for k, batch in enumerate([4, 7]):
        files.append(str(tmp_path / f"s{k}.npz"))
        np.savez(files[-1], x=np.random.default_rng(k).standard_normal((batch, 64)).astype(np.float32))
    answer = graphscan.tune(
        str(tmp_path / "mlp.onnx"), calibrate=files, out=str(tmp_path / "o"), runs=1, min_speedup=0, target=-100.0
    )
    refused = [c for c in answer["candidates"] if c["error"]]
    assert refused and all(c["quantize_static"]["calibrate_method"] != "MinMax" for c in refused)
    assert all(tune_trials.HISTOGRAM_SHAPES in c["error"] for c in refused)
    assert any(w.startswith(tune_trials.HISTOGRAM_SHAPES) for w in answer["warnings"])
    assert any(c["error"] is None for c in answer["candidates"])  # MinMax takes them


def test_the_refinements_keep_the_nodes_their_row_kept_float(tmp_path):
    """A row with --exclude conv1 (and its seed entry) refined: every refinement keeps conv1
    float and lists the same seed, calibrated each way of REFINEMENTS."""
    from types import SimpleNamespace

    added = []

    class Recording:
        def __init__(self):
            self.files = {5: (str(tmp_path / "candidate-5.onnx"), str(tmp_path / "prepared.onnx"), str(tmp_path / "c"))}

        def add(self, settings, rewrites, prepared_path, cache, kept=None, **more):
            added.append((settings, rewrites, kept))

    kept = [{"node": "conv1", "why": "--exclude"}]
    settings = {"calibrate_method": "MinMax", "per_channel": True, "nodes_to_exclude": ["conv1"]}
    base = {"id": 5, "quantize_static": settings, "rewrites": True, "kept_float": kept}
    run = SimpleNamespace(trials=Recording(), start=lambda: base, progress=SimpleNamespace(show=lambda *args: None))
    tune_stages.refine(run)
    assert [(s["calibrate_method"], s.get("extra_options", {})) for s, _, _ in added] == REFINEMENTS
    assert all(s["nodes_to_exclude"] == ["conv1"] and s["per_channel"] for s, _, _ in added)
    assert all(rewrites is True and k == kept for _, rewrites, k in added)


def test_a_row_that_runs_a_timed_rows_plan_carries_its_timing_and_names_it(unreachable, tmp_path):
    """A refinement changes the ranges alone, so its model most often runs the plan of a row
    timed already: it is not timed again, ``speed_from`` names that row (timed itself, and
    earlier), and its four latency figures are that row's to the last bit. Both rows' models,
    made again from their arguments, optimize in onnxruntime to graphs of the same operators,
    names and tensors, each initializer read of the same type and shape."""
    import onnxruntime

    answer = unreachable["answer"]
    rows = {c["id"]: c for c in answer["candidates"]}
    carried = [c for c in rows.values() if c["speed_from"] is not None and c["error"] is None]
    assert carried  # the refinements of the best row: its graph, other ranges

    def optimized_graph(row):
        path, optimized = tmp_path / f"row-{row['id']}.onnx", tmp_path / f"row-{row['id']}-optimized.onnx"
        with quiet():
            quantize_static(
                str(unreachable["out"] / "prepared.onnx"), str(path),
                calibration_reader(unreachable["files"][:2]), **keyword_arguments(row["quantize_static"]),
            )  # fmt: skip
        options = onnxruntime.SessionOptions()
        options.optimized_model_filepath = str(optimized)
        onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(optimized).graph
        constants = {t.name: (t.data_type, list(t.dims)) for t in graph.initializer}  # shared by value: names vary
        return [(n.op_type, n.name, [constants.get(i, i) for i in n.input], list(n.output)) for n in graph.node]

    for row in carried:
        source = rows[row["speed_from"]]
        assert source["id"] < row["id"] and (source["speed_from"], source["same_as"]) == (None, None)
        for key in ("ms", "float_ms", "speedup", "speedup_spread"):
            assert row[key] == source[key], key
        assert row["quantize_static"] != source["quantize_static"]
        if row["post_step"] is None and source["post_step"] is None:
            assert optimized_graph(row) == optimized_graph(source)
