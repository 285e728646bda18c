"""The fallback search by blocks: estimates, order, limits, and on a real model a target
that no single excluded node reaches but a set of them does, found by tune."""

import math
import types

import onnx
import pytest
from onnxruntime.quantization import quantize_static

import gen_models
import graphscan
import graphscan_ort.tune.stages as stages
from graphscan_ort.tune import fallback
from graphscan_ort.tune import trials as trials_module
from graphscan_ort.tune.blocks import Block, next_block, noise_share, search_blocks, weight_elements
from graphscan_ort.tune.candidates import keyword_arguments, quiet
from graphscan_ort.tune.choice import Policy
from tests.helpers import (
    calibration_reader,
    mlp_with_samples,
    point_estimates,
    undisturbed_timings,
    without_dynamic_candidates,
)


def test_noise_shares_add_in_power():
    """Six equal noise sources: each exclusion gains 10*log10(6/5) dB alone, and four of them
    remove 4/6 of the noise, 10*log10(3) dB, more than the sum of their gains in dB."""
    single = 10 * math.log10(6 / 5)
    share = noise_share(single)
    assert share == pytest.approx(1 / 6)
    block = Block("tail", ("a", "b", "c", "d"), (share,) * 4, cost=4)
    assert block.gain() == pytest.approx(10 * math.log10(3))
    assert block.gain(frozenset({"a", "b"}), 2 * share) == pytest.approx(10 * math.log10(4 / 2))
    assert noise_share(None) == 0.0 and noise_share(-1.0) == 0.0 and noise_share(math.inf) == 1.0


def test_the_next_block_is_the_cheapest_enough_else_the_best_gain_per_cost():
    cheap = Block("node", ("a",), (0.5,), cost=10)  # 3.0 dB for 10
    big = Block("tail", ("a", "b", "c"), (0.5, 0.3, 0.1), cost=100)  # 10 dB for 100
    other = Block("node", ("c",), (0.1,), cost=1)  # 0.46 dB for 1: the best ratio
    blocks = [cheap, big, other]
    assert next_block(blocks, set(), frozenset(), 0.0, needed=2.0) is cheap  # enough, and cheapest
    assert next_block(blocks, set(), frozenset(), 0.0, needed=8.0) is big  # only it is enough
    assert next_block(blocks, set(), frozenset(), 0.0, needed=50.0) is other  # none is: gain per cost
    assert next_block(blocks, set(), frozenset(), 0.0, needed=None) is other  # no estimate in the unit
    assert next_block(blocks, {("c",)}, frozenset(), 0.0, needed=None) is cheap
    assert next_block(blocks, set(), frozenset({"a"}), 0.5, needed=None, room=1) is other  # big adds 2
    assert next_block([cheap], set(), frozenset({"a"}), 0.5, needed=None) is None  # nothing new


def test_blocks_cover_single_nodes_tails_and_neighbourhoods():
    model = gen_models.build_mlp(4, 8, 0, ("N",))
    names = [n.name for n in model.graph.node]
    ranked = [{"node": name, "gain_db": 1.0 + k} for k, name in enumerate(names)] + [{"node": "gone", "gain_db": 9.0}]
    blocks = search_blocks(model, ranked, min_gain=0.01)
    kinds = {b.kind for b in blocks}
    assert kinds == {"node", "tail", "around"}
    assert [b.nodes for b in blocks if b.kind == "tail"] == [tuple(names[-k:]) for k in (2, 4, 8)]
    assert all("gone" not in b.nodes for b in blocks)  # a name the model does not have
    assert len({b.nodes for b in blocks}) == len(blocks)  # each set of nodes once
    around = next(b for b in blocks if b.kind == "around")
    assert len(around.nodes) > 1 and set(around.nodes) <= set(names)


def mlp_and_samples(folder):
    """``folder``/mlp.onnx, an 8-layer MLP 64 wide, and its 4 samples (2 to calibrate, 2 to evaluate)."""
    return mlp_with_samples(folder, layers=8, width=64, count=4, rows=16, seed=2)


def test_a_target_no_single_exclusion_reaches_is_reached_by_a_set_of_them(tmp_path, monkeypatch):
    """An 8-layer MLP, 64 wide. Measured: every Gemm kept float alone (as deployed, its
    exclusion made real) stays below the target; tune's search reaches it with more (the
    search of quantize_static's rows: a dynamic row would meet this target at once). On two
    samples, the search's mechanics on point figures."""
    without_dynamic_candidates(monkeypatch)
    point_estimates(monkeypatch)
    undisturbed_timings(monkeypatch)
    files = mlp_and_samples(tmp_path)
    target = 34.0
    answer = graphscan.tune(
        str(tmp_path / "mlp.onnx"),
        calibrate=files[:2],
        inputs=files[2:],
        out=str(tmp_path / "out"),
        target=target,
        runs=1,
        min_speedup=0,
        max_trials=4,
    )
    made = [c for c in answer["candidates"] if c["trial"] is None and c["recovery"] is None and not c["fails"]]
    start = max(made, key=lambda c: c["sqnr_db"])  # the search's start: no block, no recovery of a row
    assert start["sqnr_db"] < target  # the search was needed
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    assert answer["reached"] is True and chosen["sqnr_db"] >= target
    found = chosen["quantize_static"]["nodes_to_exclude"]
    assert len(found) >= 2 and all(v != "int8" for v in chosen["excluded"].values())
    prepared = str(tmp_path / "out" / "prepared.onnx")
    given = onnx.load(prepared)
    gemms = [n.name for n in given.graph.node if n.op_type == "Gemm"]
    for name in gemms:  # each alone, as tune would make it: quantized, then its exclusion made real
        single = tmp_path / "single.onnx"
        with quiet():
            settings = {**start["quantize_static"], "nodes_to_exclude": [name]}
            quantize_static(prepared, str(single), calibration_reader(files[:2]), **keyword_arguments(settings))
        fallback.honoured(onnx.load(single), str(single), "all", [name], given)
        budget = graphscan.check(str(single), float_path=str(tmp_path / "mlp.onnx"), inputs=files[2:], min_sqnr=-100)
        assert budget["budgets"][0]["value"] < target, name


def test_a_block_that_makes_a_model_the_guards_refuse_is_never_kept_nor_outdone_in_cost(tmp_path, monkeypatch):
    """The MLP above with a model keeping more than one Gemm float refused as ``larger``: a
    refused block is not kept, whatever its accuracy (every later model would hold its float
    weights too and be refused as well), and no block at least as costly is tried after it, so
    the trials go to models that can be written. Such a model's bytes are said to be over
    float's, so the guards refuse it again when a row is timed again on a busy machine
    (Trials.retake). The refusal counts Gemms, not real bytes: which row the search starts
    from (per-channel or not) rests on int8 rounding, which differs between hosts with and
    without VNNI, and so do its bytes; one Gemm of eight kept float gains about a dB on either."""
    without_dynamic_candidates(monkeypatch)
    files = mlp_and_samples(tmp_path)
    measured = trials_module.Measure.__call__

    def one_float_gemm_at_most(self, candidate, candidate_path, excluded=None, speed=None, *rest):
        row = measured(self, candidate, candidate_path, excluded, speed, *rest)
        gemms = {n.name for n in candidate.graph.node if n.op_type == "Gemm"}
        if len(gemms & set(excluded or [])) > 1:
            row["bytes"] = self.float_bytes + 1
            row["fails"] = trials_module.failed_guards(row, self.float_bytes, self.min_speedup)
        return row

    monkeypatch.setattr(trials_module.Measure, "__call__", one_float_gemm_at_most)
    # Speed is not at stake: on a busy machine Trials.steady would null a disturbed row's
    # speedup, failing it as slower and moving the search's start.
    monkeypatch.setattr(trials_module, "far_off", lambda value, others: False)
    answer = graphscan.tune(
        str(tmp_path / "mlp.onnx"),
        calibrate=files[:2],
        inputs=files[2:],
        out=str(tmp_path / "out"),
        target=60.0,
        runs=1,
        min_speedup=0,
        max_trials=6,
    )
    rows = sorted((c for c in answer["candidates"] if c["trial"] is not None), key=lambda c: c["id"])
    refused = [r for r in rows if "larger" in r["fails"]]
    assert refused and any(not r["fails"] for r in rows)  # the guard bit, and cheaper blocks were tried
    given = onnx.load(tmp_path / "out" / "prepared.onnx")
    cost = weight_elements(given)
    start = trials_start(answer, rows[0])
    kept, current = list(start["quantize_static"].get("nodes_to_exclude") or []), start["sqnr_db"]
    ceiling = math.inf
    for row in rows:
        added = row["trial"]["added"]
        assert row["quantize_static"]["nodes_to_exclude"] == kept + added  # only accepted blocks stay
        assert sum(1 + cost[n] for n in added) < ceiling  # never as costly as a refused block
        if row["fails"]:
            ceiling = min(ceiling, sum(1 + cost[n] for n in added))
        elif row["sqnr_db"] > current and all(row["excluded"][n] != "int8" for n in added):
            kept, current = kept + added, row["sqnr_db"]


class ScriptedTrials:
    """Trials whose models are not made: each trial's row is scripted by the block it adds,
    ``{added nodes: (fails, metric)}``; ``tried`` records each trial's nodes_to_exclude."""

    def __init__(self, outcomes):
        self.outcomes, self.tried, self.rows = outcomes, [], []
        self.files = {0: ("start.onnx", "prepared.onnx", "cache")}
        self.measure = types.SimpleNamespace(models={"start.onnx": None}, evaluation=[{}], release_float=lambda: None)

    def add(self, settings, rewrites, prepared_path, cache, kept, origin):
        nodes = settings["nodes_to_exclude"]
        self.tried.append(nodes)
        fails, value = self.outcomes[tuple(origin.trial["added"])]
        row = {"id": len(self.rows), "error": None, "fails": fails, "metric_value": value, "metric_bound": value}
        self.rows.append({**row, "excluded": dict.fromkeys(nodes, "float"), "speedup": 1.0, "sqnr_db": value})
        return self.rows[-1]


def test_after_a_refused_block_only_cheaper_blocks_are_tried_and_it_is_never_kept(monkeypatch):
    """The search's rule on scripted rows (no rounding, any host). By estimated gain per cost
    (shares 0.4, 0.3, 0.5, 0.1, 0.05: gains 2.22, 1.55, 3.01, 0.46, 0.22 dB) the order is x (cost
    40), v (40), w (100), y (20), z (10). x measures best but breaks a guard the start passes:
    not kept, and v and w, at least as costly, are never tried; y then z are, each on top of
    what was kept (y helped, so z is tried beside it). The start's own fails do not count."""
    blocks = [
        Block("node", ("x",), (0.4,), cost=40),
        Block("node", ("v",), (0.3,), cost=40),
        Block("node", ("w",), (0.5,), cost=100),
        Block("node", ("y",), (0.1,), cost=20),
        Block("node", ("z",), (0.05,), cost=10),
    ]
    monkeypatch.setattr(stages, "ranked_ops", lambda *args: [])
    monkeypatch.setattr(stages, "search_blocks", lambda *args: blocks)
    monkeypatch.setattr(stages, "part_blocks", lambda *args: [])
    trials = ScriptedTrials(
        {("x",): (["slower", "larger"], 50.0), ("y",): (["slower"], 12.0), ("z",): (["slower"], 13.0)}
    )
    start = {
        "id": 0, "quantize_static": {"nodes_to_exclude": ["seed"]}, "rewrites": False, "kept_float": [],
        "worst_part": None, "metric_value": 10.0, "sqnr_db": 10.0, "speedup": 1.0, "fails": ["slower"],
    }  # fmt: skip
    stages.exclusions(trials, Policy(100.0), start, (None, 8), {"none": None}, in_db=False)
    assert trials.tried == [["seed", "x"], ["seed", "y"], ["seed", "y", "z"]]


def trials_start(answer, first_trial):
    """The row the exclusion search started from: the most accurate passing row whose settings
    its first trial extends (the same quantize_static arguments apart from nodes_to_exclude)."""
    settings = {k: v for k, v in first_trial["quantize_static"].items() if k != "nodes_to_exclude"}
    same = [
        c for c in answer["candidates"]
        if c["trial"] is None and c["recovery"] is None and c["quantize_static"] is not None
        and {k: v for k, v in c["quantize_static"].items() if k != "nodes_to_exclude"} == settings
        and not c["fails"]
    ]  # fmt: skip
    return max(same, key=lambda c: c["sqnr_db"])
