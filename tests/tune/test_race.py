"""Racing rows on their first evaluation samples: a grid row's accuracy is measured on the
first 8 samples, then at each doubling, and stops once it is shown below a row at least as
fast that passes every guard (Trials.raced_on_samples). Stopping never changes what the
samples it ran give, and a run that races writes the model a run without the race writes."""

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime
import pytest

import graphscan
import graphscan_ort.tune.deployed as deployed
import graphscan_ort.tune.trials as tune_trials
from graphscan_ort.shared.metrics import Checkpoints, output_pairs, paired_outputs
from graphscan_ort.shared.options import Named, Timing
from graphscan_ort.shared.sessions import session_options
from graphscan_ort.tune.choice import TimedRuns
from tests.helpers import small_cnn_and_qdq


@pytest.fixture(scope="module")
def cnn_pair(tmp_path_factory):
    """A small residual CNN, its onnxruntime QDQ model and 20 samples."""
    fp32, quant = small_cnn_and_qdq(tmp_path_factory.mktemp("race"))
    rng = np.random.default_rng(3)
    samples = [{"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)} for _ in range(20)]
    return Named(onnx.load(fp32), str(fp32)), Named(onnx.load(quant), str(quant)), samples


@pytest.mark.parametrize(
    ("samples", "checkpoints"),
    [(0, ()), (8, ()), (9, (8,)), (16, (8,)), (17, (8, 16)), (40, (8, 16, 32))],
)
def test_a_row_may_stop_after_its_first_8_samples_then_at_each_doubling_short_of_all(samples, checkpoints):
    assert deployed.race_checkpoints(samples) == checkpoints


def runs_of_each_session(monkeypatch):
    """onnxruntime.InferenceSession recording, per session built, the feeds of each run."""
    made, runs = onnxruntime.InferenceSession, []

    class Recorded(made):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            runs.append(self.fed)

        @property
        def fed(self):
            self.__dict__.setdefault("_fed", [])
            return self.__dict__["_fed"]

        def run(self, names, feeds, *rest):
            self.fed.append(feeds)
            return super().run(names, feeds, *rest)

    monkeypatch.setattr(onnxruntime, "InferenceSession", Recorded)
    return runs


def test_outputs_run_in_stretches_are_the_outputs_run_at_once_and_stop_where_asked(cnn_pair, monkeypatch):
    """At checkpoints 8 and 16 of 20 samples, the candidate runs in one session, the stop is
    asked with the first 8 then 16 outputs, and they are those of one run over every sample;
    a stop at 8 leaves the first 8 alone."""
    reference, candidate, samples = cnn_pair
    pairs, options = output_pairs(reference, candidate), session_options("all", 1)
    whole = paired_outputs(reference, candidate, samples, pairs, options)
    asked = []
    kept = {}
    runs = runs_of_each_session(monkeypatch)
    ran = paired_outputs(reference, candidate, samples, pairs, options, kept, None, Checkpoints((8, 16), asked.append))
    assert [len(outputs.candidate) for outputs in asked] == [8, 16]
    assert len(ran.candidate) == 20 and len(runs) == 2  # the float model's session, then one of the candidate
    for mine, theirs in zip(ran.candidate, whole.candidate, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True))
    stopped = paired_outputs(reference, candidate, samples, pairs, options, kept, None, Checkpoints((8, 16), bool))
    assert len(stopped.candidate) == 8 and len(runs[-1]) == 8


def test_a_row_raced_on_its_first_samples_keeps_their_values_and_runs_no_other(cnn_pair, monkeypatch):
    """A race that stops at the first checkpoint: the candidate's session runs the first 8
    samples alone (beside its timing runs on the first; the float model's runs all 20), the
    metric on each is the one a whole measurement gives them, the accuracy figures are null
    and ``raced`` says why."""
    reference, candidate, samples = cnn_pair
    whole = deployed.accuracy_figures(reference, candidate, samples)
    asked = []

    def stop_at_once(speed, values):
        asked.append((speed["speedup"], list(values)))
        return "behind"

    runs = runs_of_each_session(monkeypatch)
    race = deployed.Race(lambda speed: None, stop_at_once)
    figures = deployed.measure_candidate(reference, candidate, samples, timing=Timing(2), race=race)
    assert figures["raced"] == "behind" and figures["metric_by_sample"] == whole["metric_by_sample"][:8]
    assert asked == [(figures["speedup"], whole["metric_by_sample"][:8])]
    assert figures["sqnr_db"] is figures["metric_value"] is figures["worst_part"] is None
    assert figures["int8_kernels"] == whole["int8_kernels"] > 0
    ran = sorted(len({id(feeds) for feeds in fed}) for fed in runs if any(feeds is samples[7] for feeds in fed))
    assert ran == [8, 20]


def test_a_row_the_race_keeps_is_measured_as_without_the_race(cnn_pair):
    """A race that never stops is asked at 8 and 16 of 20 samples, each time with the metric
    on the first ones, and the row's figures are those of a measurement without a race."""
    reference, candidate, samples = cnn_pair
    plain = deployed.measure_candidate(reference, candidate, samples, timing=Timing(2))
    asked = []
    race = deployed.Race(lambda speed: None, lambda speed, values: asked.append(list(values)))
    raced = deployed.measure_candidate(reference, candidate, samples, timing=Timing(2), race=race)
    assert [len(values) for values in asked] == [8, 16]
    assert all(values == plain["metric_by_sample"][: len(values)] for values in asked)
    accuracy = ("sqnr_db", "pooled_sqnr_db", "worst_part", "metric_value", "metric_spread", "metric_by_sample")
    assert {key: raced[key] for key in accuracy} == {key: plain[key] for key in accuracy}
    assert raced.get("raced") is None


class ScriptedRows:
    """Trials holding scripted rows for the race on samples: each row's speedup, its metric on
    each of 16 evaluation samples, the guards it breaks and its broken parts."""

    def __init__(self, tmp_path, float_ms=1.0):
        measure = SimpleNamespace(evaluation=[{}] * 16, float_bytes=10**9, min_speedup=1.0, models={})
        self.trials = tune_trials.Trials(str(tmp_path), None, measure)
        self.float_ms = float_ms

    def add(self, speedup, values, fails=(), broken=None, step=None, runs=None):
        trials, k = self.trials, len(self.trials.rows)
        figures = {"ms": 1.0, "float_ms": self.float_ms, "speedup": speedup, "speedup_spread": [speedup] * 2}
        figures |= {"bytes": 1, "float_weights": 0, "fails": list(fails), "broken_parts": broken}
        row = tune_trials.candidate_row(k, "quantize_static", {}, False, [], None, figures=figures)
        record = tune_trials.Record(row, tune_trials.Origin(), files=(f"candidate-{k}.onnx", "p.onnx", "c"))
        record.by_sample = list(values)
        record.runs = None if runs is None else TimedRuns(k, tuple(runs))
        trials.book(record, row)
        row["recovery"] = None if step is None else {"step": step}
        return row

    def race(self, speedup, values, float_ms=1.0, runs=None):
        timed = {"speedup": speedup, "float_ms": float_ms, "speedup_runs": runs}
        return self.trials.raced_on_samples(timed, list(values))


AHEAD = [30.0 + 0.1 * (k % 3) for k in range(16)]  # a row's SQNR on each sample
BEHIND = [value - 6.0 + 0.1 * (k % 2) for k, value in enumerate(AHEAD[:8])]  # 6 dB below it on the first 8


MINE = [2.0, 2.3, 1.8, 2.1, 1.9]  # a row's speedup run by run


@pytest.mark.parametrize(
    ("speedup", "runs"),
    [(2.0, None), (1.9, [1.7, 2.2, 1.9, 2.0, 1.8])],
    ids=["as-fast", "speed-tied"],
)
def test_a_row_shown_below_a_passing_row_as_fast_is_raced_naming_it(tmp_path, speedup, runs):
    """Behind a row whose speedup is at least its own, or below it but tied by their runs
    (the policy's speed tie): raced, the rival and the samples named."""
    rows = ScriptedRows(tmp_path)
    rows.add(speedup, AHEAD, runs=runs)
    said = rows.race(2.0, BEHIND, runs=MINE)
    assert said is not None and "candidate 0's" in said and "last 8 evaluation samples" in said
    assert "on its first 8" in said


@pytest.mark.parametrize(
    ("rival", "mine"),
    [
        ({"speedup": 1.9}, {}),  # the rival is slower, no runs to tie them: this row may win on speed
        ({"speedup": 1.5, "runs": [1.5, 1.52, 1.49, 1.51, 1.5]}, {}),  # shown slower by its runs
        ({"fails": ["larger"]}, {}),  # the rival breaks a guard: it is never written
        ({"broken": [{"output": "y"}]}, {}),  # the rival breaks an output part
        ({"step": "bias_correction"}, {}),  # a bias correction is never a start
        ({}, {"values": AHEAD[:8]}),  # equal sample by sample: not behind
        ({}, {"values": [v + (8.0 if k % 2 else -8.0) for k, v in enumerate(AHEAD[:8])]}),  # too noisy to show
        ({}, {"float_ms": 3.0}),  # the float model's times spread 3 times: a busy machine
    ],
    ids=[
        "rival-slower",
        "rival-shown-slower",
        "rival-fails",
        "rival-broken",
        "rival-corrected",
        "equal",
        "noisy",
        "busy",
    ],
)
def test_no_row_is_raced_on_its_samples_but_behind_a_written_candidate_at_least_as_fast(tmp_path, rival, mine):
    rows = ScriptedRows(tmp_path)
    given = {"speedup": 2.0, "values": AHEAD, **rival}
    rows.add(given.pop("speedup"), given.pop("values"), **given)
    assert rows.race(2.0, mine.get("values", BEHIND), mine.get("float_ms", 1.0), MINE) is None


def outlier_conv(folder, count):
    """A Conv of 32 channels whose weights hold one outlier (100 among standard-normal values,
    where an input channel is 100 times smaller): per tensor, its weights' step is 0.8 and
    the output loses 13 dB against per channel. ``count`` seeded samples ``s0.npz``, ...:
    the model's path and the sample files."""
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((32, 16, 3, 3)).astype(np.float32)
    weights[0, 0, 1, 1] = 100.0
    conv = onnx.helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])
    graph = onnx.helper.make_graph(
        [conv],
        "outlier",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 16, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 32, 8, 8])],
        [onnx.numpy_helper.from_array(weights, "w")],
    )
    path = folder / "outlier.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), path)
    files = []
    for k in range(count):
        x = rng.standard_normal((1, 16, 8, 8)).astype(np.float32)
        x[:, 0] *= 0.01
        files.append(str(folder / f"s{k}.npz"))
        np.savez(files[-1], x=x)
    return str(path), files


def test_a_run_that_races_writes_the_model_of_a_run_that_does_not(tmp_path, monkeypatch):
    """The outlier Conv measured on 12 held-out samples, each row at one speed (2x, a stub):
    a row per tensor after a row per channel is raced on its first 8 samples (onnxruntime's
    defaults' own never is); the written model is byte for byte the one written with the race
    off, every raced row names a rival that passes, the rows raced on their samples count
    among the rows compared, and the table names them."""
    model, files = outlier_conv(tmp_path, 14)

    def two_times(reference, candidates, *rest):
        runs = [2.0, 2.05, 1.95, 2.0, 2.02]
        return [
            {"ms": 0.5, "float_ms": 1.0, "speedup": 2.0, "speedup_spread": [1.95, 2.05], "speedup_runs": runs}
            for _ in candidates
        ]

    monkeypatch.setattr(deployed, "latency_figures", two_times)
    options = {"calibrate": files[:2], "inputs": files[2:], "runs": 2, "min_speedup": 1.0}
    raced = graphscan.tune(model, out=str(tmp_path / "raced"), **options)
    monkeypatch.setattr(tune_trials.Trials, "raced_on_samples", lambda self, timed, values: None)
    plain = graphscan.tune(model, out=str(tmp_path / "plain"), **options)
    on_samples = [c for c in raced["candidates"] if c["raced"]]
    assert on_samples and all(c["metric_value"] is None and not c["quantize_static"]["per_channel"] for c in on_samples)
    rows = {c["id"]: c for c in raced["candidates"]}
    for row in on_samples:
        rival = rows[int(row["raced"].split("candidate ")[1].split("'")[0])]
        assert rival["error"] is None and not rival["fails"] and rival["raced"] is None and rival["id"] < row["id"]
        assert rival["sqnr_db"] > rows[row["id"] - 1]["sqnr_db"] + 10  # the row per tensor measured before it
    assert (tmp_path / "raced" / "model.onnx").read_bytes() == (tmp_path / "plain" / "model.onnx").read_bytes()
    measured = sum(c["error"] is None and c["raced"] is None for c in raced["candidates"])
    assert raced["evaluation"]["rows_compared"] == measured + len(on_samples)
    assert plain["evaluation"]["rows_compared"] == len(plain["candidates"])
    said = " ".join(graphscan.render_table("tune", raced).split())
    assert f"{', '.join(str(c['id']) for c in on_samples)}: raced out on their first evaluation samples" in said


class Timed:
    """A session stand-in that counts its runs (interleaved_runs times whatever it runs)."""

    def __init__(self):
        self.runs = 0

    def run(self, names, feeds):
        self.runs += 1


@pytest.mark.parametrize(("raced", "rounds"), [(True, deployed.RACE_FIRST_RUNS), (False, 5)])
def test_a_row_raced_on_its_first_timing_rounds_runs_no_other(cnn_pair, raced, rounds):
    """Timed on 5 rounds with a stop: after one warm-up run each, the float model and the row
    run RACE_FIRST_RUNS rounds and the stop is asked with their figures; where it races the
    row, those are its figures, else the rounds go on to 5 with no second warm-up and the
    figures are all 5 rounds'."""
    reference, candidate, samples = cnn_pair
    sessions, asked = [Timed(), Timed()], []

    def stop(figures):
        asked.append(len(figures["speedup_runs"]))
        return "raced" if raced else None

    (figures,) = deployed.latency_figures(
        reference, [candidate], samples[:1], deployed.DEPLOYED, Timing(5), sessions, stop
    )
    assert asked == [deployed.RACE_FIRST_RUNS]
    assert [s.runs for s in sessions] == [1 + rounds, 1 + rounds]
    assert len(figures["speedup_runs"]) == rounds
