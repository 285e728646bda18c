"""graphscan report: saved answers drawn as one page, read back by an HTML parser of its own
(tests/report/pages.py). Each expectation comes from the answers' own JSON, counted or
sorted here, never from the report's code."""

import copy
import json
import os
import shutil
from collections import Counter

import numpy as np
import onnx
import pytest

import graphscan
from tests.helpers import main_error_line, run_main
from tests.report.conftest import needs_plotting, save
from tests.report.pages import Page

pytestmark = needs_plotting
CLASSES = ["int8", "int8_data", "float", "absorbed"]


def drawn(capsys, tmp_path, *answers, name="page.html"):
    """``graphscan report ANSWERS --out tmp_path/name``: its JSON answer and the page read back."""
    out = tmp_path / name
    code, stdout, stderr = run_main(capsys, ["report", *answers, "--out", out])
    assert code == 0 and stderr == "", stderr
    return json.loads(stdout), Page(out.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def every_kind(saved, tmp_path_factory):
    """One page of every saved answer, read back: ``(answer, page, html text)``."""
    folder = tmp_path_factory.mktemp("every_kind")
    out = folder / "page.html"
    paths = saved["paths"]
    answer = graphscan.report(
        *(str(paths[k]) for k in ("tune", "runtime", "runtime_arm64", "check", "trace", "impact")), out=str(out)
    )
    text = out.read_text(encoding="utf-8")
    return answer, Page(text), text


def test_the_page_has_a_section_per_answer_and_one_island_map_per_model(every_kind):
    answer, page, text = every_kind
    assert page.sections == ["tune", "accuracy", "kernels", "runs", "check", "trace", "impact", "islands"]
    assert answer["sections"] == page.sections and answer["bytes"] == len(text.encode("utf-8"))
    assert [a["command"] for a in answer["answers"]] == ["tune", "runtime", "runtime", "check", "trace", "impact"]


def test_the_page_fetches_nothing_and_runs_no_script(every_kind):
    """Offline on any machine: no script, no link but to its own sections, and a policy that
    forbids the browser every request."""
    _, page, text = every_kind
    assert page.scripts == 0
    outside = [link for link in page.links if not link.startswith("#")]
    assert outside == []
    policies = [m["content"] for m in page.meta if m.get("http-equiv") == "Content-Security-Policy"]
    assert policies and "default-src 'none'" in policies[0]
    assert "url(http" not in text and len(text.encode()) < 2_000_000


def test_the_front_holds_one_mark_per_row_and_rings_the_chosen_one(saved, every_kind):
    tune = saved["answers"]["tune"]
    _, page, _ = every_kind
    marks = page.front_marks()
    assert sorted(marks) == sorted(row["id"] for row in tune["candidates"] if row["metric_value"] is not None)
    (ring,) = page.marks["chosen"]
    assert ring[:2] == marks[tune["chosen"]][:2]  # the ring sits on the chosen row's mark


def test_each_mark_sits_where_its_speedup_and_metric_put_it(saved, every_kind):
    """x is one linear function of the speedup, y (downwards in SVG) one of the metric, for
    every row with a speedup: the chart draws the answer's figures, not their ranks."""
    rows = {row["id"]: row for row in saved["answers"]["tune"]["candidates"]}
    marks = timed_marks(rows, every_kind[1])
    placed = [(rows[i]["speedup"], rows[i]["metric_value"], x, y) for i, (x, y, _) in marks.items()]
    speedup, metric, x, y = (np.array(column, dtype=float) for column in zip(*placed, strict=True))
    for figure, position in ((speedup, x), (metric, y)):
        slope, intercept = np.polyfit(figure, position, 1)
        assert np.abs(slope * figure + intercept - position).max() < 0.05, (figure, position)
    assert np.polyfit(metric, y, 1)[0] < 0 < np.polyfit(speedup, x, 1)[0]


def timed_marks(rows, page):
    """The front's marks of the rows with a speedup (a disturbed timing, on a busy machine, puts
    a row in the strip beside the axes: test_refused_rows_... draws one there on purpose)."""
    return {i: mark for i, mark in page.front_marks().items() if rows[i]["speedup"] is not None}


def linear_maps(rows, marks):
    """The chart's two maps, fitted on the marks: speedup to x, metric to y."""
    placed = [(rows[i]["speedup"], rows[i]["metric_value"], x, y) for i, (x, y, _) in marks.items()]
    speedup, metric, x, y = (np.array(column, dtype=float) for column in zip(*placed, strict=True))
    return np.poly1d(np.polyfit(speedup, x, 1)), np.poly1d(np.polyfit(metric, y, 1))


def test_each_rows_bars_span_its_lower_bound_and_its_speedups_quartiles(saved, every_kind):
    """The metric's bar runs from its one-sided lower bound up to the value, no further; the
    speedup's from its 25th to its 75th percentile, through the mark."""
    rows = {row["id"]: row for row in saved["answers"]["tune"]["candidates"]}
    page = every_kind[1]
    marks = timed_marks(rows, page)
    to_x, to_y = linear_maps(rows, marks)
    for i, (x, y, _) in marks.items():
        row = rows[i]
        (x1, y1, x2, y2), *_ = page.paths[f"metric-bar-{i}"]
        assert x1 == pytest.approx(x) and x2 == pytest.approx(x)
        assert sorted([y1, y2]) == pytest.approx(sorted([to_y(row["metric_bound"]), y]), abs=0.05)
        (x1, y1, x2, y2), *_ = page.paths[f"speed-bar-{i}"]
        assert y1 == pytest.approx(y) and y2 == pytest.approx(y)
        assert sorted([x1, x2]) == pytest.approx(sorted(to_x(q) for q in row["speedup_spread"]), abs=0.05)


def test_every_row_is_in_the_table_in_the_answers_order_with_its_settings(saved, every_kind):
    tune = saved["answers"]["tune"]
    header, *rows = every_kind[1].by_id["rows"]
    assert [int(row[0]) for row in rows] == [c["id"] for c in tune["candidates"]]
    settings = dict(
        zip([c["id"] for c in tune["candidates"]], [row[header.index("settings")] for row in rows], strict=True)
    )
    for candidate in tune["candidates"]:
        static = candidate["quantize_static"]
        if static is None:
            assert settings[candidate["id"]].startswith("quantize_dynamic")
        else:
            assert static["activation_type"] in settings[candidate["id"]]
            assert static["calibrate_method"] in settings[candidate["id"]]
    chosen = [row for row in rows if row[1].startswith("chosen")]
    assert [int(row[0]) for row in chosen] == [tune["chosen"]]


def test_refused_rows_are_drawn_apart_and_listed_with_why(saved, capsys, tmp_path):
    """Rows refused by hand (guards broken, a quantizer's error, an output part broken) and one
    whose timing was disturbed (speedup null): the refused grey, the error not drawn and named,
    the disturbed one drawn in the strip of its own."""
    tune = copy.deepcopy(saved["answers"]["tune"])
    others = [c for c in tune["candidates"] if c["id"] != tune["chosen"]]
    slow, broken, disturbed, breaking = others[0], others[1], others[2], others[3]
    slow["fails"] = ["slower", "larger"]
    breaking["broken_parts"] = [{"output": "y", "part": 0, "node": "head", "why": "SQNR 1.9 dB (floor 6 dB)"}]
    broken.update(dict.fromkeys(("metric_value", "metric_bound", "speedup", "speedup_spread", "fails")))
    broken["error"] = "quantize_static: no scale for tensor t"
    disturbed.update(speedup=None, speedup_spread=None)
    answer, page = drawn(capsys, tmp_path, save(tmp_path, "tune", tune))
    marks = page.front_marks()
    assert broken["id"] not in marks and sorted(marks) == sorted(c["id"] for c in tune["candidates"] if c is not broken)
    assert "#999999" in marks[slow["id"]][2] and "#999999" in marks[breaking["id"]][2]  # grey: refused
    timed = {c["id"] for c in tune["candidates"] if c["speedup"] is not None}
    main_x = [x for i, (x, _, _) in marks.items() if i in timed]
    assert marks[disturbed["id"]][0] > max(main_x)  # in the strip beside the axes
    refused = {int(row[0]): row[1] for row in page.in_section["tune"][0][1:]}
    assert "slower" in refused[slow["id"]] and "larger" in refused[slow["id"]]
    assert "no scale for tensor t" in refused[broken["id"]]
    assert refused[breaking["id"]] == "breaks y part 0 (from head): SQNR 1.9 dB (floor 6 dB)"
    assert answer["notes"] == [f"row {broken['id']}: the quantizer or onnxruntime refused it: {broken['error']}"]


def test_accuracy_by_part_sets_the_chosen_row_against_onnxruntimes_defaults(saved, every_kind):
    tune = saved["answers"]["tune"]
    default = min(
        (c for c in tune["candidates"] if c["quantize_static"] and not c["rewrites"] and not c["recovery"]
         and c["quantize_static"]["activation_type"] == "QInt8" and not c["quantize_static"]["per_channel"]
         and c["quantize_static"]["calibrate_method"] == "MinMax"),
        key=lambda c: c["id"],
    )  # fmt: skip
    chosen = next(c for c in tune["candidates"] if c["id"] == tune["chosen"])
    _, *rows = every_kind[1].in_section["accuracy"][0]
    assert [row[0] for row in rows] == [f"chosen (row {chosen['id']})", f"onnxruntime's defaults (row {default['id']})"]
    for row, candidate in zip(rows, (chosen, default), strict=True):
        part = candidate["worst_part"]
        assert float(row[1]) == pytest.approx(candidate["sqnr_db"], rel=1e-3)
        assert row[2] == f"{part['output']} part {part['part']} (from {part['node']})"


def test_what_runs_counts_each_op_type_per_target_from_the_node_rows(saved, every_kind):
    """A column per CPU target (native, and the arm64 answer given beside it): each cell the
    nodes of that type and class, counted here from the answer's node rows."""
    header, *rows = every_kind[1].in_section["runs"][0]
    targets = {"native": saved["answers"]["runtime"], "arm64": saved["answers"]["runtime_arm64"]}
    assert header == ["op type"] + [f"{t}: {c}" for t in targets for c in CLASSES]
    counted = {t: Counter((n["op_type"], n["class"]) for n in a["nodes"]) for t, a in targets.items()}
    for row in rows[:-1]:
        assert [int(v) for v in row[1:]] == [counted[t][(row[0], c)] for t in targets for c in CLASSES], row[0]
    assert rows[-1][0] == "all"
    assert [int(v) for v in rows[-1][1:]] == [
        sum(counted[t][(op, c)] for op in {o for o, _ in counted[t]}) for t in targets for c in CLASSES
    ]
    assert "nodes whose class on arm64 differs from native" in every_kind[1].text_of["runs"]


def test_check_trace_and_impact_show_their_rows_as_the_answers_rank_them(saved, every_kind):
    answers, page = saved["answers"], every_kind[1]
    budgets = page.in_section["check"][0][1:]
    assert [(b[0], b[3]) for b in budgets] == [
        (b["name"], "holds" if b["ok"] else "broken") for b in answers["check"]["budgets"]
    ]
    lowest = sorted((r for r in answers["trace"]["ops"] if r["sqnr_db"] is not None), key=lambda r: r["sqnr_db"])
    assert [row[0] for row in page.in_section["trace"][0][1:]] == [r["node"] for r in lowest[:20]]
    gained = [r["node"] for r in answers["impact"]["ops"] if r["gain_db"] is not None][:20]
    assert [row[0] for row in page.in_section["impact"][0][1:]] == gained


def compute_node_names(path):
    return [n.name for n in onnx.load(path).graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear")]


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not on the PATH (apt-get install graphviz)")
def test_the_island_map_is_drawn_by_graphviz_naming_every_compute_node(saved, every_kind):
    text = every_kind[2]
    section = text[text.index('<section id="islands">') :]
    assert "<svg" in section and "<pre>digraph" not in section.split("<details>")[0]
    for name in compute_node_names(saved["out"] / "model.onnx"):
        assert f'xlink:title="{name}"' in section, name


def test_without_graphviz_the_island_map_is_its_dot_text_and_a_hint(saved, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot here
    answer, page = drawn(capsys, tmp_path, saved["paths"]["runtime"])
    text = page.text_of["islands"]
    assert "digraph graphscan" in text and "apt-get install graphviz" in text
    assert answer["notes"] and "DOT text" in answer["notes"][0]


def test_a_model_found_nowhere_leaves_its_map_out_saying_so(saved, capsys, tmp_path):
    runtime = dict(saved["answers"]["runtime"], model="gone/model.onnx")
    answer, page = drawn(capsys, tmp_path, save(tmp_path, "runtime", runtime))
    assert answer["notes"] == [
        "the island map of gone/model.onnx is left out: no such file from here or beside the answer"
    ]
    assert "runs" in page.sections and "<svg" not in page.text_of["islands"]


def test_a_model_named_relative_to_its_saved_answer_is_found_beside_it(saved, capsys, tmp_path, monkeypatch):
    beside = tmp_path / "answers"
    beside.mkdir()
    shutil.copy(saved["out"] / "model.onnx", beside / "m.onnx")
    path = save(beside, "runtime", dict(saved["answers"]["runtime"], model="m.onnx"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    answer, page = drawn(capsys, tmp_path, os.path.relpath(path, elsewhere))
    assert "left out" not in " ".join(answer["notes"]) and "digraph graphscan" in page.text_of["islands"]


def test_tune_report_writes_the_page_of_its_own_answer_into_out(saved):
    tune, out = saved["answers"]["tune"], saved["out"]
    assert tune["written"] == ["model.onnx", "prepared.onnx", "report.html"]
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "prepared.onnx", "report.html"]
    page = Page((out / "report.html").read_text(encoding="utf-8"))
    assert page.sections == ["tune", "accuracy", "kernels", "islands"]
    assert sorted(page.front_marks()) == sorted(c["id"] for c in tune["candidates"] if c["metric_value"] is not None)
    assert f"the island map: {out / 'model.onnx'}" in (out / "report.html").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("content", "code", "said"),
    [
        pytest.param(None, 3, "no such file", id="missing"),
        pytest.param("{not json", 2, "not a JSON answer", id="not-json"),
        pytest.param('{"a": 1}', 2, "not the JSON answer of a graphscan command", id="foreign"),
        pytest.param('{"model": "m.onnx", "ok": NaN}', 2, "NaN is not strict JSON", id="nan"),
        pytest.param("[1, 2]", 2, "not the JSON answer of a graphscan command", id="a-list"),
    ],
)
def test_a_bad_or_foreign_answer_is_one_line_and_nothing_is_written(capsys, tmp_path, content, code, said):
    answer = tmp_path / "answer.json"
    if content is not None:
        answer.write_text(content, encoding="utf-8")
    line = main_error_line(capsys, ["report", answer, "--out", tmp_path / "page.html"], code)
    assert said in line and not (tmp_path / "page.html").exists()


def test_a_wrong_value_under_the_right_keys_names_the_value(saved, capsys, tmp_path):
    runtime = dict(saved["answers"]["runtime"], compute="many")
    line = main_error_line(capsys, ["report", save(tmp_path, "runtime", runtime), "--out", tmp_path / "p.html"], 2)
    assert "not a runtime answer (answer.compute" in line


def test_out_must_be_given_and_be_a_file(saved, capsys, tmp_path):
    assert "report needs --out" in main_error_line(capsys, ["report", saved["paths"]["check"]], 2)
    line = main_error_line(capsys, ["report", saved["paths"]["check"], "--out", tmp_path], 3)
    assert "not a regular file" in line


def test_an_answer_of_another_command_is_its_table_beside_its_models_island_map(capsys, tmp_path, small_lab):
    """islands' answer has no view of its own: its section holds what ``table`` prints for it."""
    islands = graphscan.islands(small_lab["matmul_only"])
    answer, page = drawn(capsys, tmp_path, save(tmp_path, "islands", islands))
    assert page.sections == ["answer", "islands"] and answer["answers"][0]["command"] == "islands"
    shown = page.text_of["answer"]
    assert f"island_count {islands['island_count']}" in " ".join(shown.split())
    assert all(island["nodes"][0] in shown for island in islands["islands"])
    assert small_lab["matmul_only"] in page.text_of["islands"]


def test_the_rows_the_chart_cannot_hold_each_say_why():
    """A row whose metric is undefined says that, the rows raced out on speed say so in one
    line with their speedups and those raced on their first samples in another (not that
    their metric is undefined); measured rows are plotted, not listed. An answer from before
    the race (no ``raced`` key) still reads."""
    from graphscan_ort.report.tune_view import unplotted

    def row(ident, **keys):
        return {"id": ident, "metric_value": None, "error": None, "raced": None, "speedup": 0.5, **keys}

    answer = {
        "candidates": [
            row(0, metric_value=12.0),
            row(4, raced="not measured for accuracy: ...", speedup=0.71),
            row(1, raced="not measured for accuracy: ..."),
            row(2),
            {key: value for key, value in row(3).items() if key != "raced"},
            row(6, raced="not run on its last 8 evaluation samples: ..."),
        ]
    }
    said = unplotted(answer)
    assert said[:2] == [f"row {k}: its metric is undefined (or, for sqnr, infinite)" for k in (2, 3)]
    assert said[2:] == [
        "rows 1, 4: raced out on speed (0.5-0.71x): not measured for accuracy",
        (
            "row 6: raced out on their first evaluation samples (less accurate there than a row as fast): not "
            "measured on the rest"
        ),
    ]
    answer["candidates"] = answer["candidates"][2:3]
    assert unplotted(answer) == ["row 1: raced out on speed (0.5x): not measured for accuracy"]
