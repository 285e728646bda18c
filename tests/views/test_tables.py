"""--format table: text for people, rendered from the unchanged JSON answer.

The snapshots in __snapshots__/test_tables.ambr are what a reviewer reads (update
serially: pytest tests/views/test_tables.py --snapshot-update -p no:xdist). Facts a table
must show (graph order, sizes first, --top, 80 columns) are checked by hand-derived
expectations on hand-built graphs, and the runtime/impact/check renderers on small
hand-written answers in the shapes their issues describe.
"""

import json
import os
import re
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import graphscan
import graphscan_ort.engines.trace as trace_engine
from tests.helpers import chain_model, error_line, run_graphscan

COUNTING = ["nodes", "qdq", "islands", "boundary"]


@pytest.fixture
def in_models(default_lab, monkeypatch):
    monkeypatch.chdir(Path(default_lab["full"]).parent)


def printed(capsys, argv):
    """stdout of ``main(argv)``, asserting success and a quiet stderr."""
    assert graphscan.main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def columns(line):
    """Terminal columns of a line, counted independently of graphscan: wide East Asian characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 0 if unicodedata.combining(c) else 1 for c in line)


def assert_fits(text, width=80):
    wide = [line for line in text.splitlines() if columns(line) > width]
    assert not wide, wide


# --------------------------------------------------------------------------
# middle_cut: both ends kept


@pytest.mark.parametrize(
    ("text", "width", "expected"),
    [
        pytest.param("abcdefghij", 10, "abcdefghij", id="fits-exactly"),
        pytest.param("abc", 8, "abc", id="short"),
        # 7 = 2 head + "..." + 2 tail; an odd remainder goes to the head (20 = 9 + 3 + 8).
        pytest.param("abcdefghij", 7, "ab...ij", id="even-split"),
        pytest.param("abcdefghij", 8, "abc...ij", id="odd-split"),
        pytest.param("layer1/block2/conv/Conv_output_0", 20, "layer1/bl...output_0", id="path-like"),
        pytest.param("abcdefghij", 4, "a...", id="one-char-head"),
        pytest.param("abcdefghij", 3, "abc", id="no-room-for-the-marker"),
    ],
)
def test_middle_cut(text, width, expected):
    assert graphscan._middle_cut(text, width) == expected


# --------------------------------------------------------------------------
# A cut column: the end of each name kept, different names kept apart, words whole

# Names as exporters write them: a shared layer path, what differs at the end (YOLO, PP-OCR).
EXPORTER_NAMES = st.lists(
    st.builds(
        lambda parts, op: "/" + "/".join(parts) + "/" + op,
        st.lists(
            st.sampled_from(["model.22", "cv3.0", "cv3.1", "cv2.0", "m.0", "conv", "dfl"]), min_size=1, max_size=6
        ),
        st.sampled_from(["Conv", "Sigmoid", "Mul", "GlobalAveragePool"]),
    ),
    min_size=1,
    max_size=30,
)


@pytest.mark.parametrize(
    ("text", "width", "expected"),
    [
        pytest.param("abcdefghij", 10, "abcdefghij", id="fits-exactly"),
        pytest.param("abcdefghij", 7, "...ghij", id="ascii"),
        pytest.param("abc表格", 5, "...格", id="wide-characters-take-two-columns"),
        pytest.param("abc表格", 4, "...", id="no-room-for-a-wide-character"),
        pytest.param("abcdefghij", 3, "hij", id="no-room-for-the-marker"),
    ],
)
def test_end_cut(text, width, expected):
    assert graphscan._end_cut(text, width) == expected


@given(names=EXPORTER_NAMES, width=st.integers(min_value=20, max_value=80))
def test_a_cut_column_keeps_each_names_end_and_tells_different_names_apart(names, width):
    rows = [[name, k, "Percentile"] for k, name in enumerate(names)]
    lines = graphscan._format_table(["node", "id", "method"], rows, width=width).splitlines()[1:]
    shown = {}
    for name, line in zip(names, lines, strict=True):
        cut, _, method = line.split()
        assert method == "Percentile"  # a word is never cut
        assert cut == name or (cut.startswith("...") and len(cut) > 3 and name.endswith(cut[3:])), (name, cut)
        shown.setdefault(name, cut)
    assert len(set(shown.values())) == len(shown), shown  # two different names never look the same


# --------------------------------------------------------------------------
# The JSON is the contract: byte for byte unchanged


@pytest.mark.parametrize("command", COUNTING + ["diff"])
def test_default_and_json_format_print_the_unchanged_answer(in_models, capsys, command):
    paths = ["full.onnx", "matmul_only.onnx"] if command == "diff" else ["matmul_only.onnx"]
    expected = json.dumps(getattr(graphscan, command)(*paths)) + "\n"
    assert printed(capsys, [command, *paths]) == expected
    assert printed(capsys, [command, *paths, "--format", "json"]) == expected


# --------------------------------------------------------------------------
# Snapshots of the lab's models


@pytest.mark.parametrize("variant", ["fp32", "full", "matmul_only", "excluded"])
@pytest.mark.parametrize("command", COUNTING)
def test_table_snapshot(in_models, capsys, snapshot, command, variant):
    assert printed(capsys, [command, f"{variant}.onnx", "--format", "table"]) == snapshot


def test_diff_table_snapshot(in_models, capsys, snapshot):
    assert printed(capsys, ["diff", "full.onnx", "matmul_only.onnx", "--format", "table"]) == snapshot


def test_fuse_table_snapshot(default_lab, capsys, snapshot, tmp_path, monkeypatch):
    shutil.copy(default_lab["fp32"], tmp_path)  # fuse writes beside its input, never into shared folders
    monkeypatch.chdir(tmp_path)
    assert printed(capsys, ["fuse", "fp32.onnx", "gemm.onnx", "--format", "table"]) == snapshot


def test_trace_table_lists_every_row_in_graph_order_as_a_process(default_lab):
    answer_rows = ["fc1_matmul", "fc1_add", "fc2_matmul", "fc2_add", "fc3_matmul", "fc3_add"]
    proc = run_graphscan(["trace", "fp32.onnx", "full.onnx", "--format", "table"], cwd=Path(default_lab["full"]).parent)
    assert proc.returncode == 0 and proc.stderr == b""
    lines = proc.stdout.decode().splitlines()
    start = lines.index("ops in graph order") + 2  # title, column titles
    assert [line.split()[0] for line in lines[start : start + 6]] == answer_rows
    assert_fits(proc.stdout.decode())


# --------------------------------------------------------------------------
# Graph order, sizes first, --top, 80 columns


def island_listing(text, number):
    """Names listed under ``island <number> in graph order:``."""
    lines = text.splitlines()
    start = lines.index(f"island {number} in graph order:") + 1
    names = []
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        names += line.strip().rstrip(",").split(", ")
    return names


def test_island_members_are_listed_in_graph_order(tmp_path, capsys):
    # One float chain r.1 -> r.2 -> ... -> r.12: one island. The JSON sorts its
    # members as strings (r.1, r.10, r.11, r.12, r.2, ...); the table follows the graph.
    names = [f"r.{k}" for k in range(1, 13)]
    path = chain_model(tmp_path / "m.onnx", names)
    assert graphscan.islands(path)["islands"][0]["nodes"][:3] == ["r.1", "r.10", "r.11"]
    text = printed(capsys, ["islands", path, "--format", "table"])
    assert island_listing(text, 1) == names


def test_islands_largest_first_and_top_cuts_with_a_note(tmp_path, capsys):
    # Islands in graph order: {a1} (1 node), {b1, b2, b3} (3), {c1, c2} (2). The JSON
    # sorts them by first name: a1 -> #1, b1 -> #2, c1 -> #3. Largest first: #2, #3, #1.
    path = chain_model(tmp_path / "m.onnx", ["a1", "qdq", "b1", "b2", "b3", "qdq", "c1", "c2"])
    text = printed(capsys, ["islands", path, "--format", "table", "--top", "2"])
    rows = text.split("\n\n")[1].splitlines()
    assert [row.split()[:2] for row in rows[2:4]] == [["2", "3"], ["3", "2"]]
    assert rows[4] == "(1 more not shown; --top 2)"
    assert "island 1 in graph order:" not in text
    assert island_listing(text, 2) == ["b1", "b2", "b3"]

    boundary = printed(capsys, ["boundary", path, "--format", "table"])
    # #2 (b1..b3): one DQ in, one Q out; #3 (c1, c2): one DQ in, reaches only y; #1: a1 feeds one Q.
    rows = boundary.split("\n\n")[1].splitlines()[2:]
    assert [row.split() for row in rows] == [
        ["2", "3", "1", "1", "b1", "b3"],
        ["3", "2", "1", "0", "c1", "c2"],
        ["1", "1", "0", "1", "a1", "a1"],
    ]


def test_long_names_keep_their_end_in_80_columns(tmp_path, capsys):
    first = "encoder/" + "block" * 40 + "/first_relu"
    last = "decoder/" + "layer" * 40 + "/last_relu"
    path = chain_model(tmp_path / ("long" * 30 + ".onnx"), [first, last])
    for command in COUNTING:
        text = printed(capsys, [command, path, "--format", "table"])
        assert_fits(text)
    text = printed(capsys, ["islands", path, "--format", "table"])
    listed = island_listing(text, 1)
    assert len(listed) == 2
    for cut, name in zip(listed, [first, last], strict=False):
        head, tail = cut.split("...")
        assert head == "" and name.endswith(tail) and len(tail) > 20


def test_a_name_with_a_newline_stays_on_one_row(tmp_path, capsys):
    path = chain_model(tmp_path / "m.onnx", ["first\nhalf", "second"])
    text = printed(capsys, ["islands", path, "--format", "table"])
    assert island_listing(text, 1) == ["first\\nhalf", "second"]
    assert "1     2  Relu 2    first\\nhalf  second" in text.splitlines()


@pytest.mark.parametrize("command", COUNTING)
def test_names_that_drive_a_terminal_are_shown_escaped(tmp_path, capsys, command):
    """ESC could clear the screen, CR overwrite a row, BEL ring: a name is text, never a command."""
    hostile = ["clear\x1b[2Jscreen", "over\rwrite", "bell\x07", "rtl\u202eoverride", "nul\x00byte"]
    path = chain_model(tmp_path / "m.onnx", hostile)
    argv = [command, path, path] if command == "diff" else [command, path]
    text = printed(capsys, [*argv, "--format", "table"])
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", text), text
    if command == "islands":
        assert "clear\\x1b[2Jscreen" in text and "over\\x0dwrite" in text


def test_wide_characters_take_two_columns(tmp_path, capsys):
    """CJK names counted as one column each made lines of 100+ columns."""
    names = ["第一層/畳み込み/" + "活性化関数" * 8, "第二層/" + "正規化" * 10]
    path = chain_model(tmp_path / "m.onnx", names)
    for command in COUNTING:
        assert_fits(
            printed(capsys, [command, path, path] if command == "diff" else [command, path, "--format", "table"])
        )
    assert_fits(graphscan.render_table("islands", graphscan.islands(path), None))


def test_long_input_names_and_the_method_line_fit(tmp_path):
    answer = {**TRACE_ANSWER, "inputs": {"input_" + "x" * 150: [1, 3, 224, 224]}, "defaulted": ["input_" + "x" * 150]}
    assert_fits(graphscan.render_table("trace", answer))
    timed = {**RUNTIME_ANSWER["time"], "method": "onnxruntime profiler, one thread " * 20}  # as long as the real one
    assert_fits(graphscan.render_table("runtime", {**RUNTIME_ANSWER, "time": timed}))


def test_a_terminal_that_cannot_show_a_name_gets_it_escaped(tmp_path):
    path = chain_model(tmp_path / "m.onnx", ["Ωmega", "b"])
    proc = run_graphscan(["islands", path, "--format", "table"], env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert proc.returncode == 0 and proc.stderr == b""
    assert b"\\u03a9mega, b" in proc.stdout


@pytest.mark.parametrize("width", [20, 37, 80])
def test_wrapped_name_lists_fit_their_width(width):
    names = [f"layer{k}/{'x' * (k % 13)}" for k in range(60)]
    text = graphscan.format_names(names, width)
    assert_fits(text, width)
    # Each name is cut to fit a line of its own: width - 2 (indent) - 1 (its comma).
    assert [n.strip() for n in text.replace("\n", "").split(",")] == [
        graphscan._end_cut(name, width - 3) for name in names
    ]


# --------------------------------------------------------------------------
# --format and --top on the command line


@pytest.mark.parametrize(
    ("args", "named"),
    [
        pytest.param(["--format", "table", "--top", "-1"], "--top", id="negative-top"),
        pytest.param(["--format", "table", "--top", "two"], "--top", id="non-integer-top"),
        pytest.param(["--top", "3"], "--format table", id="top-without-table"),
        pytest.param(["--format", "yaml"], "--format", id="unknown-format"),
    ],
)
def test_bad_format_or_top_is_a_usage_error(default_lab, args, named):
    line = error_line(run_graphscan(["islands", default_lab["full"], *args]), 2)
    assert named in line


def test_top_zero_shows_no_rows(in_models, capsys):
    text = printed(capsys, ["nodes", "full.onnx", "--format", "table", "--top", "0"])
    assert "(none)" in text and "more not shown; --top 0" in text


@pytest.mark.parametrize("command", list(graphscan._COMMANDS))
def test_every_json_command_offers_format_and_top(command, capsys):
    assert graphscan.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    if graphscan._load_command(command).text:
        assert "--format" not in out
    else:
        assert "--format" in out and "--top" in out


# --------------------------------------------------------------------------
# Renderers from hand-written answers (trace; runtime and impact as issues 8 and 9 describe them)

LONG = "backbone/stage3/" + "residual_block" * 5 + "/conv2/Conv"

TRACE_ANSWER = {
    "a": "float.onnx",
    "b": "quant.onnx",
    "inputs": {"x": [1, 3, 1, 1]},
    "defaulted": ["x"],
    "ops": [
        {
            "node": "conv1",
            "op_type": "Conv",
            "wrapped": True,
            "reference": "c1",
            "isolated_max_abs": 0.01,
            "propagated_max_abs": 0.01,
            "isolated_lsb": 0.5,
            "sqnr_db": 40.0,
            "clipped": 0.0,
        },
        {
            "node": LONG,
            "op_type": "Conv",
            "wrapped": True,
            "reference": "c2",
            "isolated_max_abs": 0.5,
            "propagated_max_abs": 0.6,
            "isolated_lsb": 3.25,
            "sqnr_db": 12.5,
            "clipped": 0.125,
        },
        {
            "node": "add",
            "op_type": "Add",
            "wrapped": False,
            "reference": "a",
            "isolated_max_abs": 0.02,
            "propagated_max_abs": 0.9,
            "isolated_lsb": None,
            "sqnr_db": None,
        },
        {
            "node": "MatMulInteger_4",
            "op_type": "MatMulInteger",
            "wrapped": False,
            "reference": None,
            "isolated_max_abs": None,
            "propagated_max_abs": None,
            "isolated_lsb": None,
            "sqnr_db": None,
        },
    ],
    "outputs": {"y": 0.9},
    "worst_isolated": {"node": LONG, "max_abs": 0.5},
    "first_over": {"node": LONG, "max_abs": 0.5},
    "unmatched": [{"node": "relu", "op_type": "Relu", "reason": trace_engine.REASON_ABSORBED}],
}

# The shape of a real `runtime --time` answer (tests/runtime/test_runtime.py pins the values).
RUNTIME_ANSWER = {
    "model": "det_qdq.onnx",
    "environment": {
        "onnxruntime": "1.32.0",
        "provider": "CPUExecutionProvider",
        "level": "extended",
        "machine": "x86_64",
        "int8_allowed": False,
    },
    "compute": 4,
    "wrapped": 3,
    "classes": {"int8": 1, "int8_data": 1, "float": 1, "absorbed": 1},
    "wrapped_but_float": 1,
    "float_but_int8": 0,
    "by_op_type": {"Add": {"float": 1}, "Conv": {"int8": 1}, "MaxPool": {"int8_data": 1}, "Relu": {"absorbed": 1}},
    "nodes": [
        {
            "node": "conv",
            "op_type": "Conv",
            "wrapped": True,
            "class": "int8",
            "kernel": "QLinearConv",
            "runs_in": "conv",
            "reason": None,
        },
        {
            "node": "relu",
            "op_type": "Relu",
            "wrapped": False,
            "class": "absorbed",
            "kernel": "QLinearConv",
            "runs_in": "conv",
            "reason": None,
        },
        {
            "node": LONG,
            "op_type": "Add",
            "wrapped": True,
            "class": "float",
            "kernel": "Add",
            "runs_in": LONG,
            "reason": {"code": "mixed_types", "detail": "inputs uint8, int8; outputs uint8"},
        },
        {
            "node": "pool",
            "op_type": "MaxPool",
            "wrapped": True,
            "class": "int8_data",
            "kernel": "MaxPool",
            "runs_in": "pool",
            "reason": None,
        },
    ],
    "unmapped": [],
    "time": {
        "method": "onnxruntime profiler, one thread, per-event floor subtracted",
        "inputs": {"x": [1, 3, 320, 320]},
        "defaulted": [],
        "runs": 20,
        "profiler_floor_us": 2.0,
        "shares": {"int8": 0.25, "int8_data": 0.05, "float": 0.5, "quantize": 0.1, "dequantize": 0.1},
        "nodes": {"conv": 120.5, LONG: 300.25, "pool": 8.0},
        "wall_ms": {"model": 40.5, "without_round_trips": 28.0},
        "round_trip_cost": 0.31,
    },
}

IMPACT_ANSWER = {
    "a": "float.onnx",
    "b": "quant.onnx",
    "inputs": {"x": [1, 16]},
    "samples": 2,
    "output_sqnr_db": 2.7,
    "ops": [
        {"node": "fc2_matmul", "op_type": "MatMul", "sqnr_db": 30.5, "gain_db": 27.8},
        {"node": LONG, "op_type": "Conv", "sqnr_db": 3.0, "gain_db": 0.3},
        {"node": "fc1_add", "op_type": "Add", "sqnr_db": 2.7, "gain_db": 0.0},
    ],
    "tensors": [
        {
            "tensor": "fc2_mm",
            "producer": "fc2_matmul",
            "consumers": ["fc2_add"],
            "sqnr_db": 25.0,
            "gain_db": 22.3,
            "rounding_sqnr_db": 4.0,
            "rounding_gain_db": 1.3,
            "clipped": 0.25,
        },
    ],
    "exclude": {"target_sqnr_db": 20.0, "nodes": ["fc2_matmul"], "sqnr_db": 30.5, "reached": True},
}

# Issue 11 item 3 (check) has no renderer of its own: the generic one shows it.
CHECK_ANSWER = {
    "model": "quant.onnx",
    "float": None,
    "budgets": [
        {"name": "max_float", "value": 31, "limit": 10, "ok": False},
        {"name": "max_islands", "value": 12, "limit": 20, "ok": True},
    ],
    "ok": False,
}

HAND_ANSWERS = [
    pytest.param("trace", TRACE_ANSWER, None, id="trace-all-rows"),
    pytest.param("trace", TRACE_ANSWER, 2, id="trace-top-2"),
    pytest.param("runtime", RUNTIME_ANSWER, None, id="runtime"),
    pytest.param("runtime", RUNTIME_ANSWER, 2, id="runtime-top-2"),
    pytest.param("impact", IMPACT_ANSWER, None, id="impact"),
    pytest.param("impact", IMPACT_ANSWER, 1, id="impact-top-1"),
    pytest.param("check", CHECK_ANSWER, None, id="check-generic"),
]


@pytest.mark.parametrize(("command", "answer", "top"), HAND_ANSWERS)
def test_hand_answer_table_snapshot(snapshot, command, answer, top):
    text = graphscan.render_table(command, answer, top)
    assert_fits(text)
    assert text == snapshot


def first_column(text, title):
    """First words of the rows of the table under ``title``."""
    block = next(b for b in text.split("\n\n") if b.startswith(title + "\n"))
    return [line.split()[0] for line in block.splitlines()[2:] if not line.startswith("(")]


def test_trace_top_ranks_by_isolated_then_by_propagated_error():
    text = graphscan.render_table("trace", TRACE_ANSWER, 2)
    cut = graphscan._end_cut(LONG, len(first_column(text, "ops by isolated error")[0]))
    # isolated: LONG 0.5 > add 0.02 > conv1 0.01; propagated: add 0.9 > LONG 0.6.
    assert first_column(text, "ops by isolated error") == [cut, "add"]
    assert first_column(text, "ops by propagated error") == ["add", cut]


def test_runtime_top_ranks_nodes_by_kernel_time_when_timed():
    text = graphscan.render_table("runtime", RUNTIME_ANSWER, 2)
    rows = first_column(text, "nodes by kernel time")
    assert rows[1] == "conv" and rows[0].endswith("/conv2/Conv")  # 300.25 us, then 120.5 us
    untimed = {key: value for key, value in RUNTIME_ANSWER.items() if key != "time"}
    text = graphscan.render_table("runtime", untimed, 2)
    assert first_column(text, "nodes in graph order") == ["conv", "relu"]


def test_generic_table_shows_every_budget():
    text = graphscan.render_table("check", CHECK_ANSWER)
    rows = [line.split() for line in text.splitlines() if line.startswith("max_")]
    assert rows == [["max_float", "31", "10", "no"], ["max_islands", "12", "20", "yes"]]
    assert text.splitlines()[0].split() == ["model", "quant.onnx", "float", "-", "ok", "no"]


def test_runtime_time_block_lists_every_share():
    rows = first_column(graphscan.render_table("runtime", RUNTIME_ANSWER), "time")
    assert rows == [
        "runs",
        "profiler_floor_us",
        "round_trip_cost",
        "wall_ms",
        "wall_ms",
        "share",
        "share",
        "share",
        "share",
        "share",
    ]


def test_red_flags_lead_where_absolute_errors_hide_them():
    """A Sigmoid 10^8 LSB off with a near-zero SQNR, and a Conv whose values are all
    clipped, had the smallest absolute errors, so a table by error hid them."""
    row = dict.fromkeys(["reference", "wrapped", "propagated_max_abs"], None)
    ops = [
        {**row, "node": "big_matmul", "op_type": "MatMul", "isolated_max_abs": 2.0, "isolated_lsb": 4.0,
         "sqnr_db": 30.0, "clipped": 0.0},
        {**row, "node": "tiny_sigmoid", "op_type": "Sigmoid", "isolated_max_abs": 1e-6, "isolated_lsb": 1e8,
         "sqnr_db": 0.00003, "clipped": 0.0},
        {**row, "node": "saturated_conv", "op_type": "Conv", "isolated_max_abs": 1e-3, "isolated_lsb": 2.0,
         "sqnr_db": 20.0, "clipped": 1.0},
    ]  # fmt: skip
    answer = {**TRACE_ANSWER, "ops": ops, "unmatched": []}
    for top in (None, 1):
        text = graphscan.render_table("trace", answer, top)
        assert first_column(text, "ops by SQNR, worst first")[0] == "tiny_sigmoid"
        assert first_column(text, "ops by isolated error in LSB, largest first")[0] == "tiny_sigmoid"
        assert first_column(text, "ops by clipped share, largest first") == ["saturated_conv"]
        assert text.index("ops by SQNR") < text.index("ops by isolated error" if top else "ops in graph order")
    tensor = IMPACT_ANSWER["tensors"][0]
    never = {**tensor, "tensor": "never_clipped", "gain_db": 30.0, "clipped": 0.0}  # the largest gain, inside its range
    impact = {**IMPACT_ANSWER, "tensors": [never, {**tensor, "tensor": "all_clipped", "clipped": 1.0}]}
    assert first_column(graphscan.render_table("impact", impact), "tensors by clipped share, largest first") == [
        "all_clipped"
    ]


# --------------------------------------------------------------------------
# graphscan table ANSWER.json: a saved answer shown as its command's table


SAVED = [
    pytest.param(["nodes", "{full}"], id="nodes"),
    pytest.param(["qdq", "{full}"], id="qdq"),
    pytest.param(["islands", "{matmul_only}"], id="islands"),
    pytest.param(["boundary", "{matmul_only}"], id="boundary"),
    pytest.param(["diff", "{fp32}", "{full}"], id="diff"),
    pytest.param(["check", "{full}", "--max-islands", "0"], id="check-broken"),
    pytest.param(["runtime", "{full}"], id="runtime"),
    pytest.param(["trace", "{fp32}", "{full}"], id="trace"),
    pytest.param(["impact", "{fp32}", "{full}", "--target-sqnr", "60"], id="impact"),
]


@pytest.mark.parametrize("argv", SAVED)
@pytest.mark.parametrize("top", [None, "2"])
def test_a_saved_answer_is_shown_as_its_commands_table(argv, top, default_lab, tmp_path, capsys):
    argv = [str(a).format(**{k: str(v) for k, v in default_lab.items()}) for a in argv]
    limit = ["--top", top] if top else []
    own_top = graphscan._load_command(argv[0]).own_top  # impact's --top limits its JSON too
    graphscan.main([*argv, *(limit if own_top else [])])
    saved = tmp_path / "answer.json"
    saved.write_text(capsys.readouterr().out)
    graphscan.main([*argv, "--format", "table", *limit])
    expected = capsys.readouterr().out
    assert graphscan.main(["table", str(saved), *limit]) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize(
    ("content", "code", "said"),
    [
        pytest.param(None, 3, "no such file", id="missing"),
        pytest.param("{not json", 2, "not a JSON answer", id="not-json"),
        pytest.param("[1, 2]", 2, "not the JSON answer of a graphscan command", id="a-list"),
        pytest.param(
            '{"model": "m", "a": "a", "b": "b", "max_abs_error": NaN}', 2, "(NaN is not strict JSON)", id="nan"
        ),
        pytest.param('{"model": "m.onnx"}', 2, "not the JSON answer of a graphscan command", id="unknown-keys"),
        pytest.param(
            '{"model": "m", "quantize": "six", "dequantize": 1, "round_trips": 1, "weight_dequantize": 1}',
            2,
            'not a qdq answer (answer.quantize is "six", not int)',
            id="a-string-count",
        ),
        pytest.param(
            '{"model": "m", "compute": 1, "wrapped": 0, "float": 1, "island_count": 1,'
            ' "islands": [{"nodes": ["r"], "size": "1", "op_types": ["Relu"]}]}',
            2,
            'not a islands answer (answer.islands[0].size is "1", not int)',
            id="a-nested-string-count",
        ),
        pytest.param(
            '{"model": "m", "island_count": {}, "crossings": 0, "per_island": []}',
            2,
            "not a boundary answer (answer.island_count is {}, not int)",
            id="an-object-for-a-count",
        ),
        pytest.param(
            '{"model": "m", "quantize": true, "dequantize": 1, "round_trips": 1, "weight_dequantize": 1}',
            2,
            "not a qdq answer (answer.quantize is true, not int)",
            id="a-boolean-count",  # Python's True is an int: JSON's true is not a count
        ),
        pytest.param(
            '{"model": "gone.onnx", "compute": 1, "wrapped": 1, "float": 0, "island_count": 1, "islands": 3}',
            2,
            "not a islands answer",
            id="keys-right-values-not",
        ),
    ],
)
def test_a_file_that_is_not_an_answer_is_one_line(content, code, said, tmp_path, capsys):
    path = tmp_path / "answer.json"
    if content is not None:
        path.write_text(content)
    assert graphscan.main(["table", str(path)]) == code
    out, err = capsys.readouterr()
    if code:
        assert out == "" and err.count("\n") == 1 and said in err, err


@pytest.mark.parametrize("command", ["islands", "boundary"])
@pytest.mark.parametrize("model", [2, 10**30])
def test_a_saved_answer_whose_model_is_not_a_path_is_refused_in_one_line(tmp_path, command, model):
    """islands' and boundary's tables read the model for its graph order; open() takes an
    int as a file descriptor (2 closed graphscan's own stderr; 10**30 overflowed: exit 1).
    The answer's types refuse it first; graph_positions refuses it too, for a caller of
    render_table."""
    path = chain_model(tmp_path / "m.onnx", ["Q", "DQ"])
    answer = json.loads(run_graphscan([command, path]).stdout)
    saved = tmp_path / "answer.json"
    saved.write_text(json.dumps({**answer, "model": model}))
    line = error_line(run_graphscan(["table", str(saved)]), 2)
    assert f"not a {command} answer (answer.model is {model}, not str)" in line
