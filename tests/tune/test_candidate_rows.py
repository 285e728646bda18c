"""A candidate's row: one typed ``Candidate`` built once from its outcome (trials.candidate_row),
and the front marked anew after every stage that adds rows (choice.Policy.settle)."""

import pytest

from graphscan_ort.shared.answers import Candidate
from graphscan_ort.tune.choice import Policy
from graphscan_ort.tune.trials import candidate_row

# What a measurement gives, hand-written: every figure of SPEC's candidate row but the
# row's identity (id, settings, seeds, trial, post step, exclusions, twin) and its place
# on the front and error.
FIGURES = {
    "sqnr_db": 31.5,
    "pooled_sqnr_db": 33.0,
    "worst_part": {"output": "y", "part": 0, "node": "fc"},
    "metric_value": 31.5,
    "metric_events": None,
    "metric_worst": {"sample": 0, "value": 31.5},
    "metric_spread": [31.0, 32.0],
    "levels": {"value": 40.0, "tensor": "t", "part": 0, "node": "fc"},
    "broken_parts": [],
    "int8_fraction": 1.0,
    "int8_kernels": 2,
    "wrapped_but_float": {},
    "ms": 1.0,
    "float_ms": 2.0,
    "speedup": 2.0,
    "speedup_spread": [1.9, 2.1],
    "bytes": 1000,
    "float_weights": 0,
    "fails": [],
}
SETTINGS = {"activation_type": "QUInt8", "nodes_to_exclude": ["fc"]}
KEPT = [{"node": "fc", "why": "--exclude"}]


@pytest.mark.parametrize(
    ("quantizer", "outcome"),
    [
        pytest.param("quantize_static", {"figures": FIGURES}, id="static-measured"),
        pytest.param("quantize_dynamic", {"figures": FIGURES}, id="dynamic-measured"),
        pytest.param("quantize_static", {"figures": FIGURES, "same_as": 0}, id="static-twin"),
        pytest.param("quantize_static", {"error": "quantize_static: refused"}, id="static-refused"),
        pytest.param(
            "quantize_static",
            {"excluded": {"fc": "float"}, "post_step": {"float_inputs": ["fc"]}, "error": "onnxruntime: no"},
            id="static-refused-after-its-exclusions-were-checked",
        ),
    ],
)
def test_a_row_has_every_key_of_the_answer_in_its_order_whatever_its_outcome(quantizer, outcome):
    """Every outcome gives the same keys in the declared order (tune's JSON rows never change
    shape): the settings under their quantizer's key, the other null, the figures copied, a
    refused row's figures null, and no row on the front before settle marks it."""
    row = candidate_row(3, quantizer, SETTINGS, True, KEPT, {"block": "single", "added": ["fc"]}, **outcome)
    assert list(row) == list(Candidate.__annotations__)
    other = "quantize_dynamic" if quantizer == "quantize_static" else "quantize_static"
    assert (row[quantizer], row[other]) == (SETTINGS, None)
    assert (row["id"], row["rewrites"], row["kept_float"], row["pareto"]) == (3, True, KEPT, False)
    given = outcome.get("figures") or {}
    assert {key: row[key] for key in FIGURES} == {key: given.get(key) for key in FIGURES}
    for key in ("excluded", "post_step", "same_as", "error"):
        assert row[key] == outcome.get(key)


def row(ident, speedup, sqnr):
    """A measured row that passes the guards, with only what the choice reads."""
    return {"id": ident, "speedup": speedup, "metric_value": sqnr, "fails": [], "error": None, "pareto": False}


def test_settle_marks_the_front_anew_when_a_stage_adds_a_row_that_dominates():
    """Row 0 is alone on the front; a later stage adds row 1, faster and more accurate: after
    settle, 0 is off the front (its old mark does not survive) and 1 is chosen; a refused row
    is never on it. Each row's SQNR sample by sample: 19, 21 for row 0 (20 misses 25 dB), 29.9,
    30.1 for row 1 (its bound, 30 less t(1 - 0.05 / 2, 1) = 12.71 times 0.1, stays above 25)."""
    by_sample = {0: [19.0, 21.0], 1: [29.9, 30.1], 2: None}
    policy = Policy(25.0, by_sample=by_sample)
    rows = [row(0, 1.5, 20.0)]
    assert policy.settle(rows) == (rows[0], False) and rows[0]["pareto"] is True
    rows.append(row(1, 2.0, 30.0))
    rows.append({**row(2, None, None), "error": "quantize_static: refused"})
    assert policy.settle(rows) == (rows[1], True)
    assert [r["pareto"] for r in rows] == [False, True, False]
