"""The tune command (issue 18, first version): every figure checked against an independent
measurement of the written model, the choice against the definition, the exit codes."""

import errno
import io
import itertools
import math
import os
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import quantize_dynamic, quantize_static

import gen_models
import graphscan
import graphscan_ort.shared.files
import graphscan_ort.shared.inputs
import graphscan_ort.tune.candidates as candidates
import graphscan_ort.tune.choice as tune_choice
import graphscan_ort.tune.command as tune
import graphscan_ort.tune.stages as tune_stages
import graphscan_ort.tune.trials as tune_trials
from graphscan_ort.shared.options import Named, Timing
from graphscan_ort.tune.bias import bias_corrected
from graphscan_ort.tune.choice import Policy
from tests.helpers import (
    INTERRUPT_AT,
    TERMINATE_AT,
    error_line,
    json_answer,
    main_error_line,
    run_graphscan,
    searched,
    small_cnn_held_out,
    without_structural_seeds,
)
from tests.lab import Case


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """tune on a small residual CNN: two calibration samples, one held-out sample. Its
    16 channels make every int8 model smaller than float; at 8x8 pixels int8 is rarely
    faster, so ``--min-speedup 0`` lets the speed guard pass whatever the machine's noise
    (the guards are tested on their own)."""
    folder = tmp_path_factory.mktemp("tune")
    fp32, calibration, held = small_cnn_held_out(folder)
    out = folder / "tuned"
    argv = ["tune", fp32, *[a for c in calibration for a in ("--calibrate", c)], "--inputs", held, "--out", out]
    answer = json_answer(run_graphscan([*argv, "--runs", "3", "--min-speedup", "0"]))
    return {"answer": answer, "float": str(fp32), "calibration": calibration, "held": str(held / "h0.npz"), "out": out}


def test_the_answer_has_the_issues_keys_and_writes_two_files(tuned):
    answer = tuned["answer"]
    assert list(answer) == [
        "model", "environment", "calibration", "evaluation", "float", "prepare", "candidates",
        "metric", "target", "target_sqnr_db", "latency", "chosen", "reached", "written", "warnings", "output",
    ]  # fmt: skip
    assert answer["written"] == ["model.onnx", "prepared.onnx"]
    # Nothing to warn of (on a busy machine a row whose timing stays disturbed, or the float
    # model's own time spreading over the run, is said: those rules' own tests are in test_guards.py).
    assert [w for w in answer["warnings"] if "far off" not in w and "was busy" not in w] == []
    assert answer["metric"] == {"name": "sqnr"} and answer["target"]["source"] == "defaults"
    assert sorted(p.name for p in tuned["out"].iterdir()) == ["model.onnx", "prepared.onnx"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(tuned["out"].stat().st_mode) == 0o777 & ~umask  # as mkdir makes it, not 0700
    assert answer["evaluation"]["held_out"] is True and answer["calibration"]["samples"] == 2
    # 8 ways to quantize (no Div or HardSigmoid here: no rewritten variant), and the chosen row's bias correction
    assert len(answer["candidates"]) == 9
    assert [c["recovery"]["step"] for c in answer["candidates"] if c["recovery"]] == ["bias_correction"]
    assert list(tuned["out"].parent.glob(".graphscan-tune-*")) == []


def test_the_choice_is_on_the_front_and_meets_the_default_target(tuned):
    answer = tuned["answer"]
    rows = {c["id"]: c for c in answer["candidates"]}
    chosen = rows[answer["chosen"]]
    default = next(
        c for c in rows.values()
        if c["quantize_static"]["activation_type"] == "QInt8" and not c["quantize_static"]["per_channel"]
        and c["quantize_static"]["calibrate_method"] == "MinMax" and not c["rewrites"]
    )  # fmt: skip
    assert answer["target_sqnr_db"] == default["sqnr_db"]
    # Shown at least as accurate as onnxruntime's defaults on the 8 held-out samples (paired), or
    # the defaults' own row; passing every guard.
    assert answer["reached"] and not chosen["fails"]
    assert answer["evaluation"]["method"] == ("defaults_row" if chosen is default else "paired_student_t")
    assert answer["evaluation"]["confidence"] == 0.95
    assert answer["evaluation"]["rows_compared"] == sum(c["error"] is None for c in rows.values())


def test_the_written_model_is_reproduced_and_measured_independently(tuned, tmp_path):
    """Its quantize_static arguments, re-run on prepared.onnx with the same calibration data
    (then its bias correction, when the corrected row was chosen), give the same model; its
    SQNR is check's on the held-out sample; its kernels runtime's."""
    answer = tuned["answer"]
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])

    class Reader(candidates.CalibrationDataReader):
        def __init__(self):
            self.left = iter([dict(np.load(p)) for p in tuned["calibration"]])

        def get_next(self):
            return next(self.left, None)

    again = tmp_path / "again.onnx"
    with candidates.quiet():
        quantize_static(
            str(tuned["out"] / "prepared.onnx"),
            str(again),
            Reader(),
            **candidates.keyword_arguments(chosen["quantize_static"]),
        )
    if chosen["recovery"] is not None:  # the chosen row's biases corrected on the calibration samples
        prepared = str(tuned["out"] / "prepared.onnx")
        calibration = [dict(np.load(p)) for p in tuned["calibration"]]
        corrected, _ = bias_corrected(onnx.load(again), onnx.load(prepared), calibration, prepared)
        onnx.save(corrected, again)
    model = tuned["out"] / "model.onnx"
    assert again.read_bytes() == Path(model).read_bytes()
    held = str(Path(tuned["held"]).parent)  # every held-out sample, as tune measured the row
    budget = graphscan.check(str(model), float_path=tuned["float"], min_sqnr=-100, inputs=[held])
    assert chosen["sqnr_db"] == pytest.approx(budget["budgets"][0]["value"], abs=1e-6)
    assert chosen["int8_kernels"] == graphscan.runtime(str(model), level="all")["classes"]["int8"]


def test_refusals(tuned, tmp_path, capsys):
    fp32, cal = tuned["float"], str(tuned["calibration"][0])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    line = main_error_line(capsys, ["tune", fp32, "--calibrate", cal, "--out", str(tmp_path / "full")], 3)
    assert "not an empty folder" in line and (tmp_path / "full" / "x").read_text() == "keep"
    np.savez(tmp_path / "wrong.npz", y=np.zeros((1, 3, 8, 8), np.float32))
    line = main_error_line(
        capsys, ["tune", fp32, "--calibrate", str(tmp_path / "wrong.npz"), "--out", str(tmp_path / "o")], 7
    )
    assert not (tmp_path / "o").exists()
    assert "--calibrate" in main_error_line(capsys, ["tune", fp32, "--out", str(tmp_path / "o")], 2)


def test_the_pareto_front_and_the_choice_follow_their_definitions():
    rows = [  # speedup: interleaved against float, in one measurement each (ms are not comparable)
        {"id": 0, "ms": 5.0, "speedup": 2.0, "sqnr_db": 10.0, "error": None},
        {"id": 1, "ms": 3.0, "speedup": 3.3, "sqnr_db": 8.0, "error": None},
        {"id": 2, "ms": 4.0, "speedup": 2.5, "sqnr_db": 7.0, "error": None},  # slower and worse than 1
        {"id": 3, "ms": None, "speedup": None, "sqnr_db": None, "error": "quantize_static: refused"},
    ]
    tune_choice.pareto(rows)
    assert [r["pareto"] for r in rows] == [True, True, False, False]
    for row in rows:  # bounds as the rows' values: figures that show themselves exactly
        row["metric_bound"] = row["sqnr_db"]
    assert Policy(8.0).chosen(rows)[0]["id"] == 1 and Policy(9.0).chosen(rows)[0]["id"] == 0
    # Fast by speedup, not by ms: timed minutes apart, a slower ms can be the faster model.
    later = [{**rows[0], "ms": 1.0, "speedup": 0.9}, rows[1]]
    assert Policy(5.0).chosen(later)[0]["id"] == 1
    chosen, reached = Policy(50.0).chosen(rows)
    assert chosen["id"] == 0 and reached is False  # unreachable: the most accurate


def test_an_exact_candidate_ranks_first_and_undefined_or_zero_db_ones_keep_their_place():
    """A candidate whose outputs equal float's is infinitely accurate (null in the JSON): it
    reaches any target and is on the front. An undefined SQNR is the least accurate, and an
    SQNR of exactly 0 dB is a number like any other (not the worst)."""
    rows = [
        {"id": 0, "ms": 5.0, "speedup": 1.2, "sqnr_db": 39.0, "error": None},
        {"id": 1, "ms": 6.0, "speedup": 1.0, "sqnr_db": math.inf, "error": None},  # exact
        {"id": 2, "ms": 1.0, "speedup": 6.0, "sqnr_db": None, "error": None},  # undefined
        {"id": 3, "ms": 2.0, "speedup": 3.0, "sqnr_db": 0.0, "error": None},
    ]
    tune_choice.pareto(rows)
    assert [r["pareto"] for r in rows] == [True, True, True, True]
    for row in rows:  # bounds as the rows' values (an exact row's: inf)
        row["metric_bound"] = row["sqnr_db"]
    chosen, reached = Policy(200.0).chosen(rows)
    assert chosen["id"] == 1 and reached is True
    assert Policy(-10.0).chosen(rows)[0]["id"] == 3  # the fastest that meets it: 0 dB >= -10 dB
    assert Policy(50.0).chosen([rows[2], rows[3]])[0]["id"] == 3  # unreachable: 0 dB beats undefined


def test_a_candidate_equal_to_float_is_measured_as_infinitely_accurate(tuned):
    """measure_candidate on the float model itself: no noise, so inf, never None (which ranked
    an exact exclusion row as the least accurate of all)."""
    model = onnx.load(tuned["float"])
    samples = [dict(np.load(tuned["held"]))]
    named = Named(model, tuned["float"])
    measured = tune_trials.measure_candidate(named, named, samples, timing=Timing(1))
    assert measured["sqnr_db"] == math.inf


def test_out_of_range_runs_threads_and_level_are_refused_before_any_work(tuned, tmp_path, capsys):
    base = ["tune", tuned["float"], "--calibrate", str(tuned["calibration"][0]), "--out", str(tmp_path / "o")]
    for extra in (["--threads", "2147483648"], ["--threads", "0"], ["--runs", "100001"], ["--level", "disabled"]):
        line = main_error_line(capsys, [*base, *extra], 2)
        assert extra[0] in line
    assert not (tmp_path / "o").exists() and list(tmp_path.glob(".graphscan-tune-*")) == []
    with pytest.raises(graphscan.GraphscanError) as raised:  # in-process too
        graphscan.tune(tuned["float"], calibrate=[str(tuned["calibration"][0])], out=str(tmp_path / "o"), threads=10**6)
    assert raised.value.exit_code == graphscan.EXIT_USAGE


def test_every_candidate_refused_is_exit_5(tuned, tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise ValueError("no such quantization")

    monkeypatch.setattr(tune_trials, "quantize_candidate", refuse)
    argv = ["tune", tuned["float"], "--calibrate", str(tuned["calibration"][0]), "--out", str(tmp_path / "o")]
    line = main_error_line(capsys, argv, 5)
    assert "quantize_static" in line and not (tmp_path / "o").exists()
    assert list(tmp_path.glob(".graphscan-tune-*")) == []


def test_tune_prepares_the_float_model_by_prepare_given_it_as_tune_reads_it(tuned, tmp_path, monkeypatch, capsys):
    """One path: tune's first step is prepare(), handed the model as load_with_weights reads
    it, so tests/tune/test_prepare.py, which calls prepare() so too, tests what tune runs."""
    handed = []

    def stop_after_seeing(float_path, folder, samples, original):
        handed.append((float_path, original.SerializeToString()))
        raise graphscan.GraphscanError("usage: stopped at prepare", graphscan.EXIT_USAGE)

    monkeypatch.setattr(tune_stages, "prepare", stop_after_seeing)
    argv = ["tune", tuned["float"], "--calibrate", str(tuned["calibration"][0]), "--out", str(tmp_path / "o")]
    assert main_error_line(capsys, argv, graphscan.EXIT_USAGE) == "graphscan: usage: stopped at prepare"
    assert handed == [(tuned["float"], graphscan.load_with_weights(tuned["float"]).SerializeToString())]


def test_table_fits_80_columns(tuned):
    text = graphscan.render_table("tune", tuned["answer"])
    assert "candidates, Pareto-best first" in text and all(len(line) <= 80 for line in text.splitlines())


def test_each_speedup_is_the_median_of_its_rows_ratios_and_float_ms_the_runs_median(tuned):
    """One statistic: each row's speedup is the median of its run-by-run ratios, so it lies
    within their quartiles (``speedup_spread``); each row carries its own float time, right
    after its ms, in the table too, and the answer's float.ms is their median."""
    answer = tuned["answer"]
    rows = [c for c in answer["candidates"] if c["error"] is None]
    for row in rows:
        keys = list(row)
        assert keys.index("float_ms") == keys.index("ms") + 1
        if row["speedup"] is None:  # its float time stayed far off the run's: said, never ranked
            assert any(w.startswith(f"candidate {row['id']}'s float time lay far off") for w in answer["warnings"])
            continue
        low, high = row["speedup_spread"]
        assert low <= row["speedup"] <= high
    times = sorted(row["float_ms"] for row in rows)
    assert answer["float"]["ms"] == times[len(times) // 2]  # the upper median of an even count
    section = graphscan.render_table("tune", answer).split("\ntimes (ms)")[1].split("\n\n")[0]
    lines = section.splitlines()[2:]
    cells = {int(line.split()[0]): line.split()[1:4] for line in lines if line.strip()}
    shown = {k: [None if v == "-" else float(v) for v in values] for k, values in cells.items()}  # "-": null
    assert sorted(shown) == sorted(c["id"] for c in answer["candidates"])
    for row in rows:
        expected = [row["ms"], row["float_ms"], row["speedup"]]
        assert [v is None for v in shown[row["id"]]] == [v is None for v in expected]
        known = [(v, e) for v, e in zip(shown[row["id"]], expected, strict=True) if e is not None]
        assert [v for v, _ in known] == pytest.approx([e for _, e in known], rel=5e-3)  # three significant digits


# sympy's real message when quant_pre_process runs without it (PP-OCRv4 det, the README's tour).
SYMPY = (
    "sympy is required for symbolic shape inference in quantization preprocessing. "
    "Install with: 'pip install sympy' or pass skip_symbolic_shape=True to quant_pre_process()."
)


def test_a_step_that_ran_after_a_failure_says_what_ran_and_the_whole_reason(tuned, tmp_path, monkeypatch):
    """quant_pre_process fails, then runs without symbolic shapes: its row never puts ``yes``
    beside ``failed``, and the reason is shown whole below the table, never cut."""
    import onnxruntime.quantization.shape_inference as shape_inference

    from graphscan_ort.tune import prepare

    def without_sympy(source, target, **options):
        if not options.get("skip_symbolic_shape"):
            raise ImportError(SYMPY)
        onnx.save(onnx.load(source), target)

    monkeypatch.setattr(shape_inference, "quant_pre_process", without_sympy)
    _, detail = prepare.pre_processed(tuned["float"], str(tmp_path / "pre.onnx"))
    step = {"step": "quant_pre_process", "ok": True, "detail": detail, "max_abs_error": 0.0}
    text = graphscan.render_table("tune", {**tuned["answer"], "prepare": [step]})
    row = next(line for line in text.splitlines() if line.startswith("quant_pre_process "))
    assert row.split()[1] == "yes" and "fail" not in row, row
    assert SYMPY in " ".join(text.split()), text  # whole, once the notes' line breaks are undone
    assert all(len(line) <= 80 for line in text.splitlines())


@pytest.mark.parametrize(
    "metric",
    [pytest.param("scripts/evaluation/detector_f1.py:f1", id="user-metric"), pytest.param("iou", id="built-in")],
)
def test_the_metric_is_named_whole(tuned, metric):
    """A user's metric is a path (``FILE.py:FUNCTION``): the table names it whole in its
    header and never shows a cut of it (``scr...:f1``) as a column title."""
    text = graphscan.render_table("tune", {**tuned["answer"], "metric": {"name": metric}})
    assert f"metric {metric}" in text
    titles = next(line.split() for line in text.splitlines() if line.split()[:2] == ["id", "act"])
    assert not any("..." in title for title in titles), titles
    assert all(len(line) <= 80 for line in text.splitlines())


def test_each_exclusion_trial_says_what_it_kept_float(tuned):
    """Trials that exclude different nodes from one candidate: each row counts its excluded
    nodes, and the table names every one with how it runs, under the row's id."""
    base = tuned["answer"]["candidates"][0]
    kept = [["conv_0"], ["relu_1"], ["conv_0", "relu_1"]]
    trials = [
        {
            **base,
            "id": 100 + k,
            "quantize_static": {**base["quantize_static"], "nodes_to_exclude": nodes},
            "trial": {"block": "node", "added": nodes[-1:]},
            "excluded": dict.fromkeys(nodes, "float"),
            "pareto": False,
        }
        for k, nodes in enumerate(kept)
    ]
    text = graphscan.render_table("tune", {**tuned["answer"], "candidates": [base, *trials]})
    titles = next(line.split() for line in text.splitlines() if line.split()[:2] == ["id", "act"])
    candidates = text.split("\ntimes (ms)")[0]  # the times section lists the same ids
    rows = {
        line.split()[0]: line.split()
        for line in candidates.splitlines()
        if line.split()[:1] in (["100"], ["101"], ["102"])
    }
    assert [rows[str(100 + k)][titles.index("excl")] for k in range(3)] == [str(len(nodes)) for nodes in kept]
    notes = " ".join(text.split("in full:", 1)[1].split())
    for k, nodes in enumerate(kept):
        said = notes.split(f"candidate {100 + k} keeps float: ", 1)[1].split("candidate ", 1)[0]
        assert all(f"{node} (float)" in said for node in nodes), said


def test_as_a_process_a_bad_file_is_one_line(tmp_path):
    line = error_line(
        run_graphscan(["tune", tmp_path / "none.onnx", "--calibrate", "c.npz", "--out", tmp_path / "o"]), 3
    )
    assert "none.onnx" in line


@pytest.mark.parametrize(("max_exclude", "max_trials"), [(None, None), (1, None), (None, 2)])
def test_exclusions_are_realized_by_the_quantizer_and_measured(tuned, tmp_path, monkeypatch, max_exclude, max_trials):
    """An unreachable target: blocks of operators are excluded, one trial at a time, each
    model re-quantized and measured as deployed; an addition stays only when it helps, and
    the most accurate model is chosen (reached false). impact's own ranking is tested with
    impact; here it is fixed, so the search is what is tested."""
    without_structural_seeds(monkeypatch)  # the search alone; seeds are tested in test_seeds.py
    convs = [n.name for n in onnx.load(tuned["float"]).graph.node if n.op_type == "Conv"]
    ranking = [{"node": name, "gain_db": 1.0} for name in convs] + [{"node": "noise", "gain_db": 1e-9}]
    monkeypatch.setattr(tune_stages, "ranked_ops", lambda *args, **kwargs: ranking)
    answer = graphscan.tune(
        tuned["float"],
        calibrate=[str(c) for c in tuned["calibration"]],
        inputs=[tuned["held"]],
        out=str(tmp_path / "out"),
        target_sqnr=500.0,
        max_exclude=max_exclude,
        max_trials=max_trials,
        runs=2,
        min_speedup=0,
    )
    tried = sorted((c for c in answer["candidates"] if c["trial"] is not None), key=lambda c: c["id"])
    budget = 8 if max_trials is None else max_trials
    assert len(tried) <= budget and (max_exclude is not None or len(tried) == budget)  # every trial allowed
    assert answer["reached"] is False
    best = max(c["sqnr_db"] for c in answer["candidates"] if not c["fails"])
    assert next(c for c in answer["candidates"] if c["id"] == answer["chosen"])["sqnr_db"] == best
    plain = [c for c in answer["candidates"] if c["error"] is None and c["trial"] is None]
    start = max((c for c in plain if not c["float_weights"]), key=lambda c: c["sqnr_db"])
    kept, kept_sqnr = [], start["sqnr_db"]  # the search starts from the most accurate candidate
    blocks = set()
    for row in tried:
        excluded = searched(row)  # the seeds kept float in every row apart
        assert excluded == [*kept, *row["trial"]["added"]]  # what helped so far, plus one block
        assert "noise" not in excluded and set(excluded) <= set(convs)  # never the 1e-9 dB "gain"
        assert max_exclude is None or len(excluded) <= max_exclude
        assert tuple(excluded) not in blocks
        blocks.add(tuple(excluded))
        # kept when more accurate, really float, and breaking no guard the start passed (a
        # timing nulled on a busy machine fails ``slower`` even at --min-speedup 0)
        breaks = set(row["fails"] or []) - set(start["fails"] or [])
        if row["sqnr_db"] > kept_sqnr and "int8" not in row["excluded"].values() and not breaks:
            kept, kept_sqnr = excluded, row["sqnr_db"]
    if max_exclude == 1 and kept:  # no room left after the first node that helped
        assert searched(tried[-1]) == kept
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.onnx", "prepared.onnx"]


@pytest.mark.parametrize(
    ("signal_at", "code", "line"),
    [
        pytest.param(INTERRUPT_AT, 130, b"graphscan: interrupted\n", id="ctrl-c"),
        pytest.param(TERMINATE_AT, 143, b"graphscan: terminated\n", id="sigterm"),
    ],
)
@pytest.mark.parametrize("event", ["os.mkdir", "open", "os.rename"])
def test_ctrl_c_and_sigterm_leave_nothing_half_written(tuned, tmp_path, event, signal_at, code, line):
    """Interrupted (Ctrl-C) or terminated (SIGTERM: a CI timeout) when its temporary folder is
    made, while the quantizer runs, or while the folder is renamed into place: one line and
    its exit code; --out is absent or complete, and no temporary folder is left."""
    out = tmp_path / "out"
    argv = ["tune", tuned["float"], "--calibrate", tuned["calibration"][0], "--out", out, "--runs", "1"]
    argument = "*candidate-0.onnx" if event == "open" else "*"  # "open": while the first candidate is made
    proc = run_graphscan(argv, python_flags=("-c", signal_at, event, argument))
    assert proc.returncode == code and proc.stderr == line and proc.stdout == b"", proc
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == ["model.onnx", "prepared.onnx"]
    assert list(tmp_path.glob(".graphscan-tune-*")) == []


def test_the_lab_mlp_is_tuned_and_reproduced(tmp_path, build_case):
    """The lab's MLP (MatMul, Add, Relu; a symbolic batch), 64 wide so that int8 is smaller
    than float: the chosen model, static or dynamic, is its own arguments' model, and the
    answer's SQNR check's."""
    lab = build_case(Case(3, ("N",), "fc2_matmul", dim=64))
    samples = []
    for k in range(3):
        samples.append(tmp_path / f"s{k}.npz")
        np.savez(samples[-1], x=np.random.default_rng(k).standard_normal((4, 64)).astype(np.float32))
    answer = graphscan.tune(
        lab["fp32"],
        calibrate=[str(s) for s in samples[:2]],
        inputs=[str(samples[2])],
        out=str(tmp_path / "o"),
        runs=2,
        min_speedup=0,
    )
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])

    class Reader(candidates.CalibrationDataReader):
        def __init__(self):
            self.left = iter([dict(np.load(p)) for p in samples[:2]])

        def get_next(self):
            return next(self.left, None)

    prepared, again = str(tmp_path / "o" / "prepared.onnx"), str(tmp_path / "again.onnx")
    with candidates.quiet():  # its MatMuls make dynamic rows too: whichever quantizer made the choice
        if chosen["quantize_dynamic"] is not None:
            quantize_dynamic(prepared, again, **candidates.keyword_arguments(chosen["quantize_dynamic"]))
        else:
            quantize_static(prepared, again, Reader(), **candidates.keyword_arguments(chosen["quantize_static"]))
    if chosen["recovery"] is not None:  # the chosen row's biases corrected on the calibration samples
        calibration = [dict(np.load(p)) for p in samples[:2]]
        corrected, _ = bias_corrected(onnx.load(again), onnx.load(prepared), calibration, prepared)
        onnx.save(corrected, again)
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "o" / "model.onnx").read_bytes()
    budget = graphscan.check(
        str(tmp_path / "o" / "model.onnx"), float_path=lab["fp32"], min_sqnr=-100, inputs=[str(samples[2])]
    )
    assert chosen["sqnr_db"] == pytest.approx(budget["budgets"][0]["value"], abs=1e-6)


def test_a_folder_of_samples_is_every_npz_in_it(tuned, tmp_path, capsys):
    folder = tmp_path / "calibration"
    folder.mkdir()
    for k, source in enumerate(tuned["calibration"]):
        (folder / f"cal{k}.npz").write_bytes(Path(source).read_bytes())
    assert tune.sample_files([str(folder)]) == [str(folder / "cal0.npz"), str(folder / "cal1.npz")]
    (tmp_path / "empty").mkdir()
    line = main_error_line(
        capsys, ["tune", tuned["float"], "--calibrate", str(tmp_path / "empty"), "--out", str(tmp_path / "o")], 7
    )
    assert "without .npz" in line


def test_a_model_onnxruntime_refuses_is_one_line_without_the_quantizers_traceback(tmp_path):
    """Two nodes with one name: quant_pre_process logged a 30-line traceback on stderr (Python's
    logging) before graphscan's own line."""
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Relu", ["x"], ["a"], name="same"),
            onnx.helper.make_node("Neg", ["a"], ["y"], name="same"),
        ],
        "two_names",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "s.npz", x=np.ones((1, 4), np.float32))
    argv = ["tune", tmp_path / "m.onnx", "--calibrate", tmp_path / "s.npz", "--out", tmp_path / "o", "--runs", "1"]
    proc = run_graphscan(argv)
    assert proc.stdout == b"" and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(b"graphscan: ") and not (tmp_path / "o").exists()
    # The line names the user's model, never a temporary copy of it (ort.quant.*, .graphscan-tune-*).
    assert b"ort.quant." not in proc.stderr and b".graphscan-tune-" not in proc.stderr, proc.stderr
    assert str(tmp_path / "m.onnx").encode() in proc.stderr


def refuse_to_list(forbidden):
    """os.listdir that cannot read ``forbidden``, as for a user without the permission (the
    suite runs as root, where chmod 000 reads all the same)."""
    real = os.listdir

    def listdir(path="."):
        if os.path.abspath(path) == os.path.abspath(forbidden):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path)

    return listdir


@pytest.mark.parametrize("what", ["calibrate", "out"])
def test_an_unreadable_folder_is_exit_3(tuned, tmp_path, monkeypatch, capsys, what):
    """It was exit 1, an internal error (PermissionError)."""
    folder = tmp_path / what
    folder.mkdir()
    np.savez(folder / "s.npz", **dict(np.load(tuned["held"])))
    calibrate = folder if what == "calibrate" else tuned["calibration"][0]
    out = folder if what == "out" else tmp_path / "o"
    module = graphscan_ort.shared.inputs if what == "calibrate" else graphscan_ort.shared.files
    monkeypatch.setattr(module.os, "listdir", refuse_to_list(folder))
    line = main_error_line(capsys, ["tune", tuned["float"], "--calibrate", str(calibrate), "--out", str(out)], 3)
    assert str(folder) in line and "cannot read" in line
    assert list(tmp_path.glob(".graphscan-tune-*")) == []


ENOSPC = OSError(errno.ENOSPC, "No space left on device")
# What quantize_static says when the model it wrote was cut short and it reads it back.
CUT = ValueError("Error parsing message: Wire format was corrupt")


@pytest.mark.parametrize(
    ("full", "said"),
    [
        pytest.param("out", ENOSPC, id="out-enospc"),
        pytest.param("out", CUT, id="out-cut"),
        pytest.param("tmpdir", ENOSPC, id="tmpdir-enospc"),
        pytest.param("tmpdir", CUT, id="tmpdir-cut"),
        # The quantizer's temporary folder is gone by the time the failure is seen: room again.
        pytest.param("tmpdir-emptied", ENOSPC, id="tmpdir-emptied-enospc"),
    ],
)
def test_a_full_disk_is_exit_3_never_blamed_on_the_quantizer(tuned, tmp_path, monkeypatch, capsys, full, said):
    """Every candidate refused (exit 5, "quantize_static refused every candidate") was what a
    full disk said, and a full $TMPDIR was blamed on --out. Law: when the quantizer fails and
    a file system it writes on has no room, or it failed to write where --out has room, the
    disk is named, --out's or the temporary folder's (TMPDIR), exit 3, and nothing is left.
    The disk is made full by its free space (statvfs), the quantizer's failure injected."""
    (tmp_path / "a").mkdir()
    (tmp_path / "t").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "t"))
    no_room = {"out": tmp_path / "a", "tmpdir": tmp_path / "t"}.get(full)

    def free_bytes(folder):
        return 0 if no_room is not None and Path(folder).resolve().is_relative_to(no_room) else 10**15

    def quantizer(*args, **kwargs):
        raise said

    monkeypatch.setattr(graphscan_ort.shared.files, "free_bytes", free_bytes, raising=False)
    monkeypatch.setattr(tune_trials, "quantize_candidate", quantizer)
    out = tmp_path / "a" / "o"
    argv = ["tune", tuned["float"], "--calibrate", str(tuned["calibration"][0]), "--out", str(out), "--runs", "1"]
    line = main_error_line(capsys, argv, 3)
    assert "quantize_static" not in line
    if full == "out":
        assert f"--out {out}: cannot write" in line and "No space left" in line
    else:
        assert f"temporary folder {tmp_path / 't'}" in line and "TMPDIR" in line and str(out) not in line
    assert not out.exists() and list(tmp_path.rglob(".graphscan-tune-*")) == []


def test_held_out_compares_contents_not_paths(tuned, tmp_path):
    """The same arrays given to --calibrate and --inputs (another file) are not held out."""
    copy = tmp_path / "copy.npz"
    np.savez(copy, **dict(np.load(tuned["calibration"][0])))
    answer = graphscan.tune(
        tuned["float"], calibrate=[str(tuned["calibration"][0])], inputs=[str(copy)], out=str(tmp_path / "o"), runs=1
    )
    assert answer["evaluation"]["held_out"] is False
    assert tuned["answer"]["evaluation"]["held_out"] is True  # a sample of its own is


@pytest.mark.parametrize("kind", ["quantized-float-model", "dot", "empty", "symlink-to-an-empty-folder"])
def test_what_would_fail_is_refused_before_any_work(tuned, tmp_path, monkeypatch, capsys, kind):
    float_path, out, code = tuned["float"], str(tmp_path / "o"), 3
    if kind == "quantized-float-model":
        float_path, code = str(tuned["out"] / "model.onnx"), 2
    elif kind == "dot":
        (tmp_path / "sub").mkdir()
        monkeypatch.chdir(tmp_path / "sub")
        out = "."
    elif kind == "empty":
        out = ""
    else:
        (tmp_path / "empty").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "empty")
        out = str(tmp_path / "link")
    started = []
    monkeypatch.setattr(tune, "tune_in", lambda *args: started.append(True))
    argv = ["tune", float_path, "--calibrate", str(tuned["calibration"][0]), "--out", out]
    line = main_error_line(capsys, argv, code)
    assert line and started == []
    assert list(tmp_path.rglob(".graphscan-tune-*")) == []


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_a_progress_line_on_a_terminal_only(tuned, tmp_path, monkeypatch, terminal):
    stream = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    graphscan.tune(tuned["float"], calibrate=[str(tuned["calibration"][0])], out=str(tmp_path / "o"), runs=1)
    text = stream.getvalue()
    if not terminal:
        assert text == ""  # in a pipe or in CI, stderr stays as the contract says
        return
    shown = [line for line in text.split("\r") if line]
    assert shown[0].startswith("graphscan: tune: preparing the float model, 0:")
    assert any(line.startswith("graphscan: tune: quantizing and measuring candidate 8/8, ") for line in shown)
    assert text.endswith("\r\x1b[K")  # erased at the end: what follows starts clean


@pytest.mark.parametrize("values", ["nan", "inf"])
def test_samples_that_measure_nothing_are_exit_7(tuned, tmp_path, capsys, values):
    """NaN or infinity everywhere in the float model's outputs: no candidate can be measured
    (a prepare step verified on such samples kept a rewrite that was really wrong)."""
    sample = tmp_path / "bad.npz"
    np.savez(sample, x=np.full((1, 3, 8, 8), float(values), np.float32))
    argv = ["tune", tuned["float"], "--calibrate", str(sample), "--out", str(tmp_path / "o")]
    line = main_error_line(capsys, argv, 7)
    assert "nothing to measure" in line and str(sample) in line and not (tmp_path / "o").exists()


def test_float_outputs_with_a_finite_value_are_measurable_beside_nans():
    """check_measurable refuses outputs NaN or infinite everywhere, not ones where some value is
    finite (the metrics measure those values): [NaN, 1.0] passes, named by the model's output."""
    model = one_node_model_proto("Relu", "")
    mixed = [[np.array([[np.nan, 1.0, np.inf, 0.5]], np.float32)]]
    assert tune.check_measurable(model, mixed, "m.onnx", ["s.npz"])[0]["y"][0, 1] == 1.0
    with pytest.raises(graphscan.GraphscanError, match="NaN or infinite everywhere"):
        tune.check_measurable(model, [[np.full((1, 4), np.nan, np.float32)]], "m.onnx", ["s.npz"])


def one_node_model_proto(op_type, domain):
    """A model whose one node is ``op_type``, x [1, 4] to y [1, 4]."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    node = onnx.helper.make_node(op_type, ["x"], ["y"], name="n", domain=domain)
    opsets = [onnx.helper.make_opsetid("", 13), onnx.helper.make_opsetid("com.microsoft", 1)]
    return onnx.helper.make_model(onnx.helper.make_graph([node], "g", [x], [y]), opset_imports=opsets)


def one_node_model(folder, op_type, domain):
    """A model whose one node is ``op_type`` (never run: tune refuses it before any work)."""
    path = folder / f"{op_type}.onnx"
    onnx.save(one_node_model_proto(op_type, domain), path)
    return path


@pytest.mark.parametrize(
    ("op_type", "domain"),
    [
        pytest.param("QuantizeLinear", "", id="q"),
        pytest.param("DequantizeLinear", "", id="dq"),
        pytest.param("QLinearConv", "", id="qlinear"),
        pytest.param("ConvInteger", "", id="integer"),
        pytest.param("DynamicQuantizeLinear", "", id="dynamic-quantize"),
        pytest.param("DynamicQuantizeLSTM", "com.microsoft", id="dynamic-lstm"),
        pytest.param("MatMulNBits", "com.microsoft", id="nbits"),
        pytest.param("QGemm", "com.microsoft", id="qgemm"),
    ],
)
def test_a_model_holding_an_integer_operator_is_refused_as_already_quantized(tmp_path, capsys, op_type, domain):
    """Q/DQ, onnxruntime's integer kernels (QLinear*, *Integer, DynamicQuantize*, MatMulNBits)
    say a model is quantized already: exit 2 naming the operator, before any work."""
    path = one_node_model(tmp_path, op_type, domain)
    np.savez(tmp_path / "s.npz", x=np.ones((1, 4), np.float32))
    argv = ["tune", str(path), "--calibrate", str(tmp_path / "s.npz"), "--out", str(tmp_path / "o")]
    line = main_error_line(capsys, argv, graphscan.EXIT_USAGE)
    assert line == f"graphscan: usage: {path} is already quantized (it holds {op_type}): give tune the float model"
    assert not (tmp_path / "o").exists()


def test_a_model_quantized_inside_an_ifs_branch_is_refused_as_already_quantized(tmp_path, capsys):
    """The top graph holds an If alone; its else-branch holds a Loop whose body holds a
    QLinearMatMul: the refusal looks into bodies at any depth."""
    h = onnx.helper

    def body(nodes, name, inputs=()):
        outputs = [h.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)]
        return h.make_graph(nodes, name, list(inputs), outputs)

    loop_body = h.make_graph(
        [h.make_node("QLinearMatMul", ["x"], ["deep"]), h.make_node("Identity", ["cond_in"], ["cond_out"])],
        "loop_body",
        [
            h.make_tensor_value_info(n, t, [])
            for n, t in (("i", onnx.TensorProto.INT64), ("cond_in", onnx.TensorProto.BOOL))
        ],
        [
            h.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
            h.make_tensor_value_info("deep", onnx.TensorProto.FLOAT, None),
        ],
    )
    then_branch = body([h.make_node("Relu", ["x"], ["plain"])], "plain")
    else_branch = body([h.make_node("Loop", ["", ""], ["looped"], body=loop_body)], "looped")
    node = h.make_node("If", ["c"], ["y"], name="choose", then_branch=then_branch, else_branch=else_branch)
    inputs = [
        h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4]),
        h.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
    ]
    graph = h.make_graph([node], "g", inputs, [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 13)]), tmp_path / "nested.onnx")
    np.savez(tmp_path / "s.npz", x=np.ones((1, 4), np.float32), c=np.array(True))
    argv = ["tune", str(tmp_path / "nested.onnx"), "--calibrate", str(tmp_path / "s.npz"), "--out", str(tmp_path / "o")]
    line = main_error_line(capsys, argv, graphscan.EXIT_USAGE)
    assert "is already quantized (it holds QLinearMatMul)" in line and not (tmp_path / "o").exists()


def test_evaluation_samples_are_held_out_only_when_none_is_a_calibration_sample():
    """One of two --inputs samples equal to a --calibrate one (by content): not held out."""
    first, second = ({"x": np.full((1, 4), v, np.float32)} for v in (1.0, 2.0))
    assert tune.held_out([first], [second]) is True
    assert tune.held_out([first], [second, {"x": first["x"].copy()}]) is False
    assert tune.held_out([first], [{"x": first["x"].copy()}, second]) is False


def test_a_dynamically_quantized_cnn_is_refused_not_blamed_on_the_quantizer(tmp_path, capsys):
    """onnxruntime's quantize_dynamic of a CNN (ConvInteger, DynamicQuantizeLinear: an OCR
    wheel's default model) given as the float model: exit 2 in one line, where the quantizer
    failed on its scales (exit 5, KeyError '..._scale')."""
    onnx.save(gen_models.build_cnn(1, channels=8, size=8, seed=0), tmp_path / "cnn.onnx")
    with candidates.quiet():
        quantize_dynamic(str(tmp_path / "cnn.onnx"), str(tmp_path / "dynamic.onnx"), op_types_to_quantize=["Conv"])
    held = {n.op_type for n in onnx.load(tmp_path / "dynamic.onnx").graph.node}
    assert {"ConvInteger", "DynamicQuantizeLinear"} <= held  # what the refusal must name
    np.savez(tmp_path / "s.npz", x=np.ones((1, 3, 8, 8), np.float32))
    dynamic, sample = str(tmp_path / "dynamic.onnx"), str(tmp_path / "s.npz")
    argv = ["tune", dynamic, "--calibrate", sample, "--out", str(tmp_path / "o")]
    line = main_error_line(capsys, argv, graphscan.EXIT_USAGE)
    assert "is already quantized (it holds ConvInteger, DynamicQuantizeLinear" in line and "float model" in line
    assert not (tmp_path / "o").exists()


def test_the_table_shows_each_failed_prepare_step_in_full_and_no_passed_one(tuned):
    """A failed step's reason is cut in its column; it is the one written out below."""
    reason = "quant_pre_process failed (symbolic shape inference gave up on node Resize_12 of the decoder); dropped"
    prepare = [
        {"step": "quant_pre_process", "ok": False, "detail": reason, "max_abs_error": None},
        {"step": "opset", "ok": True, "detail": "opset 11 -> 13 (per-channel weights need it)", "max_abs_error": 0.0},
    ]
    text = graphscan.render_table("tune", {**tuned["answer"], "prepare": prepare, "warnings": []})
    notes = " ".join(line.strip() for line in text.split("in full:\n", 1)[1].splitlines())
    assert f"quant_pre_process: {reason}" in notes and "opset: opset 11" not in notes


def test_the_progress_line_counts_minutes_and_seconds(monkeypatch):
    import types

    import graphscan_ort.tune.progress as progress

    clock = types.SimpleNamespace(monotonic=lambda: 100.0)
    monkeypatch.setattr(progress, "time", clock)
    line = progress.Progress(Terminal())
    for now, shown in ((159.0, "0:59"), (225.0, "2:05"), (3700.0, "60:00")):
        clock.monotonic = lambda now=now: now
        line.show("measuring candidate", 3, 8)
        assert line.stream.getvalue().endswith(f"\rgraphscan: tune: measuring candidate 3/8, {shown}\x1b[K")


def test_a_terminal_closed_under_the_progress_line_only_turns_it_off():
    import graphscan_ort.tune.progress as progress

    line = progress.Progress(Terminal())
    line.stream.close()  # writing now raises ValueError
    line.show("measuring candidate", 1, 8)
    line.close()
    assert line.enabled is False


def symbolic_matmul(folder):
    """x [N, K] @ W [4, 3]: every x of shape [n, k] fits the declared inputs, and only k = 4 runs."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", "K"])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])
    w = onnx.numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 12, "w")
    graph = onnx.helper.make_graph([onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g", [x], [y], [w])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)]), folder / "mm.onnx")
    return str(folder / "mm.onnx")


@pytest.mark.parametrize("flag", ["--calibrate", "--inputs", "--latency-inputs"])
def test_a_sample_that_fits_the_declared_shape_but_does_not_run_is_exit_7_naming_it(tmp_path, capsys, flag):
    """A sample of [1, 5] fits x [N, K] but not the weights: --latency-inputs was exit 1 (onnxruntime's
    MatMul dimension mismatch while timing), --calibrate exit 5 ("quantize_static refused every
    candidate"), --inputs exit 5 blaming the model. They are the user's samples: exit 7 naming the
    option and the file, before any work, nothing left."""
    model = symbolic_matmul(tmp_path)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "good.npz", x=rng.standard_normal((2, 4)).astype(np.float32))
    np.savez(tmp_path / "other.npz", x=rng.standard_normal((3, 4)).astype(np.float32))
    np.savez(tmp_path / "wide.npz", x=rng.standard_normal((1, 5)).astype(np.float32))
    given = {"--calibrate": ["good.npz"], "--inputs": ["other.npz"], "--latency-inputs": ["good.npz"]}
    given[flag] = [given[flag][0], "wide.npz"]  # the bad sample after a good one: each is tried
    argv = ["tune", model, "--out", str(tmp_path / "o"), "--runs", "1"]
    argv += [a for option, names in given.items() for name in names for a in (option, str(tmp_path / name))]
    line = main_error_line(capsys, argv, 7)
    assert f"{flag} {tmp_path / 'wide.npz'}:" in line and "does not run" in line, line
    assert "good.npz" not in line and "other.npz" not in line
    assert not (tmp_path / "o").exists() and list(tmp_path.glob(".graphscan-tune-*")) == []


def assert_listed_in_order(listed):
    """SPEC's order of tune's candidates, checked pair by pair: Pareto-best first, then the other
    measured rows, then the refused ones; within each, speedup from fastest, then id."""
    group = [(not c["pareto"], c["error"] is not None) for c in listed]
    assert group == sorted(group), [(c["id"], c["pareto"], c["error"]) for c in listed]
    for first, second in itertools.pairwise(listed):
        if (first["pareto"], first["error"] is None) == (second["pareto"], second["error"] is None):
            faster = (first["speedup"] or 0.0) > (second["speedup"] or 0.0)
            tie = (first["speedup"] or 0.0) == (second["speedup"] or 0.0) and first["id"] < second["id"]
            assert faster or tie, (first["id"], first["speedup"], second["id"], second["speedup"])


def test_candidates_are_listed_pareto_first_then_by_speedup_and_refused_last(tuned):
    """Law on every listing: the answer's own (real timings) and random rows with ties and refusals."""
    listed = tuned["answer"]["candidates"]
    assert sorted(c["id"] for c in listed) == list(range(len(listed)))
    assert_listed_in_order(listed)
    assert any(c["pareto"] for c in listed) and not all(c["pareto"] for c in listed)
    rng = np.random.default_rng(5)
    for _ in range(50):
        rows = []
        for ident in rng.permutation(12):
            refused = rng.random() < 0.25
            # A measured row's speedup may be undefined too (null: no time measured), ranked as 0.
            speedup = None if refused else [None, 0.5, 1.0, 1.5, 2.0][rng.integers(5)]
            rows.append({"id": int(ident), "speedup": speedup, "pareto": not refused and rng.random() < 0.4,
                         "error": "refused" if refused else None})  # fmt: skip
        listed = tune_choice.listing_order(rows)
        assert sorted(r["id"] for r in listed) == list(range(12))
        assert_listed_in_order(listed)


def test_every_step_that_failed_is_shown_whole_below_the_table(tuned):
    """A failed prepare step's reason is in the notes whatever its length: a column cuts it."""
    step = {"step": "opset", "ok": False, "detail": "the opset converter refused (short)", "max_abs_error": None}
    passed = {"step": "names", "ok": True, "detail": "3 nodes named", "max_abs_error": 0.0}
    text = graphscan.render_table("tune", {**tuned["answer"], "prepare": [step, passed]})
    notes = text.split("in full:\n", 1)[1]
    assert "opset: the opset converter refused (short)" in notes
    assert "names: 3 nodes named" not in notes  # what passed, short, is whole in its column
