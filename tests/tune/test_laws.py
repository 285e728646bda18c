"""The laws tune's pieces must keep, stated so that a plausible bug breaks one: ties,
defaults read from the ONNX spec, argument order (stubs that record what they get),
every sample verified, and the front and the choice against a brute-force definition."""

import itertools
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import graphscan
import graphscan_ort.shared.metrics as metrics
import graphscan_ort.shared.sessions as sessions
import graphscan_ort.tune.choice as tune_choice
import graphscan_ort.tune.deployed as deployed
import graphscan_ort.tune.rewrites as rewrites
import graphscan_ort.tune.stages as tune_stages
from graphscan import Session
from graphscan_ort.shared.options import Named, Timing


def one_node_model(op, shape, graph_name="g", **attributes):
    """x -> op -> y, float, ``shape`` for both."""
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], **attributes)],
        graph_name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def brute_force_front(rows):
    """Pareto-optimal by definition: no other measured row at least as fast and as accurate
    and better in one."""
    measured = [r for r in rows if r["error"] is None]

    def key(r):
        return (tune_choice.speed(r), tune_choice.accuracy(r))

    return {
        r["id"]
        for r in measured
        if not any(
            o is not r and key(o)[0] >= key(r)[0] and key(o)[1] >= key(r)[1] and key(o) != key(r) for o in measured
        )
    }


def brute_force_choice(rows, target):
    """The policy's choice by its definition, for rows whose bounds are given: met where the
    bound reaches the target; of those the fastest (no runs: ties at equal speedups alone),
    then the most accurate; else the most accurate passing row, then the fastest."""
    passing = [r for r in rows if r["error"] is None and not r.get("fails")]
    meeting = [
        r for r in passing if target is not None and r["metric_bound"] is not None and r["metric_bound"] >= target
    ]
    pool, reached = (meeting, True) if meeting else (passing, False)
    if not pool:
        return None, False
    if reached:
        best = max(tune_choice.speed(r) for r in pool)
        fastest = [r for r in pool if tune_choice.speed(r) == best]
        return max(fastest, key=tune_choice.accuracy), True
    best = max(tune_choice.accuracy(r) for r in pool)
    accurate = [r for r in pool if tune_choice.accuracy(r) == best]
    return max(accurate, key=tune_choice.speed), False


@pytest.mark.parametrize("seed", range(40))
def test_the_front_and_the_choice_match_their_definitions_with_ties(seed):
    """Random rows on a coarse grid, so that speeds, accuracies and bounds tie often."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(int(rng.integers(1, 9))):
        refused = rng.random() < 0.15
        value = None if refused or rng.random() < 0.1 else float(rng.choice([1.0, 2.0, 3.0, math.inf]))
        rows.append(
            {
                "id": k,
                "speedup": None if refused else float(rng.choice([0.5, 1.0, 1.5, 2.0])),
                "metric_value": value,
                "metric_bound": None if value is None or rng.random() < 0.2 else value - float(rng.choice([0.0, 1.0])),
                "fails": None if refused else [[], [], ["slower"], ["larger"]][int(rng.integers(4))],
                "error": "refused" if refused else None,
            }
        )
    tune_choice.pareto(rows)
    assert {r["id"] for r in rows if r["pareto"]} == brute_force_front(rows)
    for target in (None, 0.5, 1.0, 2.5, 100.0):
        chosen, reached = tune_choice.Policy(target).chosen(rows)
        expected, expected_reached = brute_force_choice(rows, target)
        assert reached == expected_reached
        if expected is None:
            assert chosen is None
        else:  # ties: any of the rows equal on both keys is right
            ranks = [(tune_choice.speed(row), tune_choice.accuracy(row)) for row in (chosen, expected)]
            assert ranks[0] == ranks[1]


def test_the_speedup_is_floats_time_over_the_candidates_never_the_reverse(monkeypatch):
    """A stub for the interleaved timing that records its sessions' order: float first."""
    seen = []

    def timed(sessions, feeds, runs):
        seen.append([s.get_modelmeta().graph_name for s in sessions])
        return [[4.0, 4.0, 4.0], [1.0, 2.0, 1.0]]  # float 4 s, candidate 1 s (median)

    monkeypatch.setattr(deployed, "interleaved_runs", timed)
    float_model = one_node_model("Relu", [2], "float_graph")
    candidate = onnx.ModelProto()
    candidate.CopyFrom(float_model)
    candidate.graph.name = "candidate_graph"
    (figures,) = deployed.latency_figures(
        Named(float_model, "f.onnx"),
        [Named(candidate, "c.onnx")],
        [{"x": np.ones(2, np.float32)}],
        Session("all", 1),
        Timing(3),
    )
    assert seen == [["float_graph", "candidate_graph"]]
    assert figures["speedup"] == pytest.approx(4.0) and figures["ms"] == pytest.approx(1000.0)  # the median ratio
    assert figures["float_ms"] == pytest.approx(4000.0)
    assert figures["speedup_spread"] == [pytest.approx(3.0), pytest.approx(4.0)]  # ratios 4, 2, 4


def test_impact_ranks_the_quantized_candidate_against_the_model_the_quantizer_was_given(monkeypatch, tmp_path):
    """exclusions() hands impact (float, quantized) in that order: a recording stub."""
    import gen_models

    onnx.save(gen_models.build_mlp(3, 64, 0, ("N",)), tmp_path / "mlp.onnx")
    np.savez(tmp_path / "s.npz", x=np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    calls = []

    def recording(given, candidate, samples):
        calls.append((given.model, candidate.model, given.path, candidate.path))
        return []

    monkeypatch.setattr(tune_stages, "ranked_ops", recording)
    graphscan.tune(
        str(tmp_path / "mlp.onnx"),
        calibrate=[str(tmp_path / "s.npz")],
        out=str(tmp_path / "o"),
        target=1000.0,
        runs=1,
        min_speedup=0,
    )
    ((given, candidate, given_path, candidate_path),) = calls
    assert not any(n.op_type == "QuantizeLinear" for n in given.graph.node)  # the prepared float model
    assert any(n.op_type == "QuantizeLinear" for n in candidate.graph.node)
    assert "prepared" in given_path and "candidate" in candidate_path


def test_hard_sigmoid_defaults_come_from_the_onnx_spec():
    """alpha 0.2 and beta 0.5 when absent (the ONNX spec), checked against onnx's reference."""
    model = one_node_model("HardSigmoid", [7], name="hs")
    rewritten, count = rewrites.hard_sigmoid(model)
    x = np.array([-4, -2.5, -1, 0, 1, 2.5, 4], np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert count == 1
    np.testing.assert_allclose(ReferenceEvaluator(rewritten).run(None, {"x": x})[0], expected, rtol=0, atol=1e-6)


def test_a_step_is_verified_on_every_sample_not_the_first():
    """Relu(x) against x: equal on the first sample (all positive), not on the second; the
    step fails, and the worst error is the second sample's."""

    def model(op):
        return one_node_model(op, [3])

    samples = [{"x": np.array([1.0, 2.0, 3.0], np.float32)}, {"x": np.array([1.0, -2.0, -0.5], np.float32)}]
    error, problem = metrics.verified(model("Identity"), model("Relu"), samples)
    assert problem is not None
    assert error == pytest.approx(2.0)
    assert metrics.verified(model("Identity"), model("Relu"), samples[:1]) == (0.0, None)


def test_a_step_is_verified_with_one_session_per_model_whatever_the_samples(monkeypatch):
    """Each model of a check is built once and run on every sample (a session a sample and a
    model was a second of prepare at page size), and the answer is the one per-sample
    sessions gave: the second sample's error."""

    def model(op):
        return one_node_model(op, [3])

    samples = [{"x": np.array([1.0, 2.0, 3.0], np.float32)}, {"x": np.array([1.0, -2.0, -0.5], np.float32)}] * 3
    built = []
    real = sessions.open_session
    monkeypatch.setattr(sessions, "open_session", lambda model, *args: built.append(model) or real(model, *args))
    error, problem = metrics.verified(model("Identity"), model("Relu"), samples)
    assert problem is not None and error == pytest.approx(2.0)
    assert [m.graph.node[0].op_type for m in built] == ["Identity", "Relu"]


def test_output_pairs_pair_by_name_and_refuse_nothing_extra():
    """Extra outputs of the quantized model are left out, never an error; a [1,4] output is
    never compared with a [4,1] one by broadcasting."""
    f = one_node_model("Identity", [1, 4])
    q = one_node_model("Identity", [1, 4])
    q.graph.node.append(helper.make_node("Identity", ["x"], ["extra"]))
    q.graph.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1, 4]))
    assert metrics.output_pairs(Named(f, "f.onnx"), Named(q, "q.onnx")) == [("y", "y")]
    noise = metrics.OutputNoise([[np.zeros((1, 4), np.float32)]])
    with pytest.raises(Exception, match=r"\[4, 1\]"):
        noise.measure([[np.zeros((4, 1), np.float32)]])


def test_no_two_blocks_of_one_search_repeat_and_all_sizes_are_powers_of_two():
    import gen_models
    from graphscan_ort.tune.blocks import search_blocks

    model = gen_models.build_mlp(6, 8, 0, ("N",))
    names = [n.name for n in model.graph.node]
    ranked = [{"node": n, "gain_db": 0.5} for n in names]
    tails = [b for b in search_blocks(model, ranked, 0.01) if b.kind == "tail"]
    assert [len(b.nodes) for b in tails] == [2**k for k in range(1, len(tails) + 1)]
    assert all(b.nodes == tuple(names[-len(b.nodes) :]) for b in tails)
    assert len(list(itertools.combinations(tails, 2))) == len(tails) * (len(tails) - 1) // 2


def test_the_warning_without_a_choice_counts_the_measured_rows_by_the_guard_they_break():
    """Two rows measured (one slower, one slower and larger) and one the quantizer refused:
    the warning counts 2 not faster and 1 larger, of the 2 measured."""
    rows = [
        {"id": 0, "error": None, "fails": ["slower"]},
        {"id": 1, "error": None, "fails": ["slower", "larger"]},
        {"id": 2, "error": "quantize_static: refused", "fails": None},
    ]
    said = "no candidate passes the guards (2 not faster than float, 1 larger than float of 2): only prepared.onnx"
    assert tune_choice.choice_warnings(rows, None, False, 10.0) == [f"{said} is written"]


def test_the_search_starts_from_the_most_accurate_row_that_can_still_be_written():
    rows = [
        {"id": 0, "speedup": 0.6, "metric_value": 0.84, "fails": ["slower"], "float_weights": 0, "error": None},
        {"id": 1, "speedup": 1.5, "metric_value": 0.83, "fails": [], "float_weights": 0, "error": None},
        {"id": 2, "speedup": 1.9, "metric_value": 0.70, "fails": [], "float_weights": 0, "error": None},
    ]
    assert tune_choice.Policy(None).start(rows)["id"] == 1  # exclusions only slow a model: 0 can never pass
    slow = [{**r, "fails": ["slower"]} for r in rows]
    assert tune_choice.Policy(None).start(slow)["id"] == 0  # none passes: the most accurate with integer weights
    corrected = {**rows[1], "id": 3, "metric_value": 0.9, "recovery": {"step": "bias_correction", "from": 1}}
    # A bias-corrected row's correction fits its own weights; every later model is quantized again without it.
    assert tune_choice.Policy(None).start([*rows, corrected])["id"] == 1
