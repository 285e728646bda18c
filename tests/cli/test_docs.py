"""The docs are true: every command they show runs as written, and the contract names everything.

docs/SPEC.md must name every command and exit code: both are read from graphscan.py itself
(COMMANDS and every EXIT_* constant), so a command or code added later without its
paragraph fails here.

Every command shown in README.md and docs/*.md runs. The convention, the same on every page
(docs/TESTING.md states it for writers):

- in a code block, a line starting with ``$ `` is a graphscan command, run by this test;
  the lines under it, up to the next ``$ `` line or the end of the block, are its output;
- ``$ echo $?`` shows the exit code of the command above it (without it, the code is 0);
- a command is ``graphscan ARGS``, ``python graphscan.py ARGS`` or ``.venv/bin/python
  graphscan.py ARGS``, optionally ending in ``> FILE``; all run the repository's graphscan.py
  with this Python (whether or not the graphscan_ort package is beside it);
- lines without ``$ `` (pip, venv, pytest, benchmarks, Graphviz) are not run.

Commands run in one scratch folder per worker holding a copy of ``ops/`` and stand-ins for
the tour's files: ``det.onnx`` / ``det.int8.onnx`` (a small CNN with PP-OCR det's input
``x`` [N, 3, H, W], quantized by onnxruntime's quantize_static), ``page0.npz`` /
``page1.npz`` and the folders ``calibration/`` and ``held/``. A command on the committed
``ops/`` models must print exactly what the doc shows (``...`` in the shown output stands for
any text); a command on a stand-in must exit
with the code shown and print one JSON object (DOT text for ``dot``, a table for
``--format table``).
"""

import re
import shlex
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import graphscan
from tests.helpers import ROOT, describe, json_answer, run_graphscan

SPEC = (ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12_000  # bytes: a README that starts users, not a second spec

EXIT_CODES = sorted(
    (name, value) for name, value in vars(graphscan).items() if name.startswith("EXIT_") and isinstance(value, int)
)
STAND_INS = ["det.onnx", "det.int8.onnx", "page0.npz", "page1.npz"]
PYTHONS = {"python", "python3", ".venv/bin/python"}
FENCE = re.compile(r"^\s*(```|~~~)")
SIDE = 32  # the stand-ins' pages are 1x3xSIDExSIDE


def section_headings():
    """Command names that open a ``### `name ...` `` heading."""
    return {m.group(1) for m in re.finditer(r"^### `([a-z]+)[ `]", SPEC, re.MULTILINE)}


def exit_table(text):
    """``{code: meaning}`` from the rows of an exit-code table."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.+) \|$", text, re.MULTILINE)}


@pytest.mark.parametrize("command", list(graphscan._COMMANDS))
def test_every_command_has_a_section(command):
    assert command in section_headings()


@pytest.mark.parametrize(("name", "value"), EXIT_CODES, ids=[name for name, _ in EXIT_CODES])
def test_every_exit_code_constant_is_in_the_one_table(name, value):
    assert value in graphscan.EXIT_CODES, f"{name} = {value} is not in graphscan.EXIT_CODES"


@pytest.mark.parametrize("page", ["docs/SPEC.md", "README.md"])
def test_the_docs_list_exactly_the_codes_of_the_one_table(page):
    """--help's epilog is built from graphscan.EXIT_CODES; the docs' tables must list those codes."""
    assert sorted(exit_table((ROOT / page).read_text(encoding="utf-8"))) == sorted(graphscan.EXIT_CODES)


def test_help_names_every_command_the_readme_names_for_a_code():
    """--help's epilog and the README's table agree on whose code it is: a command named in
    backticks in a README row (`tune` beside 8) is named in that code's --help meaning."""
    rows = exit_table(README)
    assert "tune" in rows[graphscan.EXIT_BUDGET]  # the README names the commands the test reads
    for code, meaning in rows.items():
        for command in re.findall(r"`([a-z]+)`", meaning):
            assert command in graphscan.EXIT_CODES[code], f"exit {code}: --help does not name {command}"


def test_the_level_runtime_defaults_to_is_said_where_users_read_it():
    """runtime classifies at one level by default and tune and check's SQNR measure at
    another: runtime's --help, the README's tour and min_int8's definition say both."""
    runtime = graphscan._in_process_keywords(graphscan._load_command("runtime"), {})["session"].level
    tune = graphscan._in_process_keywords(graphscan._load_command("tune"), {"calibrate": ["c.npz"]})["session"].level
    assert runtime != tune  # else there is nothing to say
    helped = " ".join(run_graphscan(["runtime", "--help"]).stdout.decode().split())
    assert f"default: {runtime}" in helped and "tune" in helped and f"at {tune}" in helped, helped
    definition = SPEC.split("- `min_int8`: ", 1)[1].split("\n- ", 1)[0]
    assert f"`{runtime}`" in definition and f"`{tune}`" in definition, definition
    tour = README.split("## A 60-second tour", 1)[1].split("\n## ", 1)[0]
    assert f"`--level {runtime}`" in tour and f"`{tune}`" in tour


def test_the_exit_code_constants_were_found():
    # A renamed prefix would make the test above vacuous.
    assert {value for _, value in EXIT_CODES} >= {0, 1, 2, 3, 4, 5, 6, 7, 8, 130}


def test_readme_points_at_the_spec():
    assert "docs/SPEC.md" in README


def test_readme_is_short():
    assert len(README.encode("utf-8")) <= README_LIMIT


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def heading_anchors(text):
    """The anchors GitHub gives a page's headings: lower case, punctuation but ``-`` and ``_``
    dropped, each space a ``-``; a repeated anchor gets ``-1``, ``-2``, ... (code blocks skipped)."""
    anchors, seen, fenced = set(), Counter(), False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.+)", line)):
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{anchor}-{seen[anchor]}" if seen[anchor] else anchor)
            seen[anchor] += 1
    return anchors


def test_heading_anchors_follow_githubs_rule():
    # SPEC links its own "### CPU targets (`--cpu`)" as #cpu-targets---cpu.
    page = "### CPU targets (`--cpu`)\n## The README's tour\n```\n# not a heading\n```\n## Notes\n### Notes"
    assert heading_anchors(page) == {"cpu-targets---cpu", "the-readmes-tour", "notes", "notes-1"}


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_every_anchor_a_page_links_to_is_a_heading_there(page):
    """A section renamed or merged away breaks the links into it: ``PAGE.md#anchor`` and
    ``#anchor`` must name a heading of that page."""
    text = page.read_text(encoding="utf-8")
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        if "://" in target:
            continue
        linked = (page.parent / target) if target else page
        assert anchor in heading_anchors(linked.read_text(encoding="utf-8")), f"{page.name} links to {target}#{anchor}"


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_no_page_names_an_issue(page):
    """The docs say what is; which issue brought it belongs in the history (git log)."""
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        assert not re.search(r"\bissue \d+", line, re.I), f"{page.name}:{number}: {line.strip()}"


# Commands shown in the docs -------------------------------------------------------------


def code_lines(text):
    """``(line number, line, indent)`` of every line inside a fenced or indented code block."""
    fenced, found = False, []
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        indent = len(line) - len(line.lstrip(" "))
        if fenced:
            found.append((number, line, indent))
        elif line.strip() == "" or indent >= 4:
            found.append((number, line, indent if line.strip() else None))
        else:
            found.append((number, None, None))  # prose ends a block
    return found


def shown_commands(page):
    """Every ``$ `` line of a page with the output shown under it and the exit code shown after it."""
    lines = code_lines(page.read_text(encoding="utf-8"))
    commands = []
    for k, (number, line, indent) in enumerate(lines):
        if line is None or not line.lstrip().startswith("$ "):
            continue
        output = []
        for _, later, _ in lines[k + 1 :]:
            if later is None or later.lstrip().startswith("$ "):
                break
            output.append(later[indent:] if later.strip() else "")
        text = "\n".join(output).strip("\n")
        command = line.lstrip()[2:].strip()
        if command == "echo $?":
            assert commands, f"{page.name}:{number}: `echo $?` with no command above it"
            commands[-1]["code"] = int(text)
            continue
        commands.append({"where": f"{page.name}:{number}", "command": command, "output": text, "code": 0})
    return commands


ALL_SHOWN = [shown for page in PAGES for shown in shown_commands(page)]


def argv_of(shown):
    """graphscan's arguments and the file its stdout is redirected to (or None)."""
    words = shlex.split(shown["command"])
    target = None
    if len(words) >= 2 and words[-2] == ">":
        words, target = words[:-2], words[-1]
    if words[:1] == ["graphscan"]:
        args = words[1:]
    elif len(words) >= 2 and words[0] in PYTHONS and Path(words[1]).name == "graphscan.py":
        args = words[2:]
    else:
        pytest.fail(f"{shown['where']}: `$ {shown['command']}` is not a graphscan command; show it without `$ `")
    assert not any(set(word) & set("|&;<>`") for word in args), f"{shown['where']}: shell syntax in {args}"
    return args, target


def stand_in_cnn(folder):
    """Write det.onnx / det.int8.onnx: Conv-Relu-Conv-Relu-Conv-Sigmoid on ``x`` [N, 3, H, W].

    det.int8.onnx is calibrated on inputs twenty times narrower than the pages, so that its
    output SQNR is low: a doc's ``check`` exits 8 on it as on the real model (which breaks
    ``--min-int8 0.5``, its 10.6 dB passing ``--min-sqnr 10``).
    calibration/ holds inputs as wide as the pages, and 64 channels make int8 kernels clearly
    faster than float (about 2.4x at 32x32), so that tune reaches the tour's target, as on
    the real model: its candidates' IoU is about 0.99.
    """
    from onnx import TensorProto, helper, numpy_helper, save
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    rng = np.random.default_rng(0)
    channels = [3, 64, 64, 1]
    nodes, weights, tensor = [], [], "x"
    for k in range(3):
        scale = (2 / (9 * channels[k])) ** 0.5  # He: activations keep their spread through the layers
        weight = rng.normal(0, scale, (channels[k + 1], channels[k], 3, 3)).astype(np.float32)
        weights += [
            numpy_helper.from_array(weight, f"w{k}"),
            numpy_helper.from_array(np.zeros(weight.shape[0], np.float32), f"b{k}"),
        ]
        nodes.append(
            helper.make_node("Conv", [tensor, f"w{k}", f"b{k}"], [f"c{k}"], name=f"conv{k}", pads=[1, 1, 1, 1])
        )
        activation = "Relu" if k < 2 else "Sigmoid"
        tensor = f"a{k}" if k < 2 else "y"
        nodes.append(helper.make_node(activation, [f"c{k}"], [tensor], name=f"{activation.lower()}{k}"))
    graph = helper.make_graph(
        nodes,
        "stand_in_det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1, "H", "W"])],
        weights,
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(folder / "det.onnx"))

    class Narrow(CalibrationDataReader):
        def __init__(self):
            self.samples = iter([{"x": rng.normal(0, 0.05, (1, 3, SIDE, SIDE)).astype(np.float32)} for _ in range(2)])

        def get_next(self):
            return next(self.samples, None)

    quantize_static(str(folder / "det.onnx"), str(folder / "det.int8.onnx"), Narrow(), quant_format=QuantFormat.QDQ)
    for k in range(2):
        np.savez(folder / f"page{k}.npz", x=rng.normal(0, 1, (1, 3, SIDE, SIDE)).astype(np.float32))
    (folder / "calibration").mkdir()  # tune's folder of calibration pages, as wide as the pages
    for k in range(2):
        np.savez(folder / "calibration" / f"cal{k}.npz", x=rng.normal(0, 1, (1, 3, SIDE, SIDE)).astype(np.float32))
    (folder / "held").mkdir()  # tune's held-out pages: enough for its verdict to show the tour's target
    for k in range(8):
        np.savez(folder / "held" / f"held{k}.npz", x=rng.normal(0, 1, (1, 3, SIDE, SIDE)).astype(np.float32))


@pytest.fixture(scope="session")
def docs_folder(tmp_path_factory):
    """Where the docs' commands run: a copy of ops/ (outputs land beside it) and the tour's stand-ins."""
    folder = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "ops", folder / "ops")
    stand_in_cnn(folder)
    return folder


def matches(shown, actual):
    """The shown output equals the actual one, ``...`` standing for any text."""
    pattern = ".*?".join(re.escape(part) for part in shown.split("..."))
    return re.fullmatch(pattern, actual.strip("\n"), re.DOTALL) is not None


def test_the_docs_show_commands():
    # A changed convention would make the test below vacuous.
    assert len(ALL_SHOWN) >= 10
    assert {"README.md", "SPEC.md"} <= {shown["where"].split(":")[0] for shown in ALL_SHOWN}


@pytest.mark.parametrize("shown", ALL_SHOWN, ids=[f"{s['where']} {s['command']}" for s in ALL_SHOWN])
def test_every_shown_command_runs(shown, docs_folder):
    args, target = argv_of(shown)
    proc = run_graphscan(args, cwd=docs_folder)
    assert proc.returncode == shown["code"], f"{shown['where']}: {describe(proc)}"
    if target is not None:  # as the shell would: stdout into the file
        (docs_folder / target).write_bytes(proc.stdout)
    text = proc.stdout.decode("utf-8")
    if args[:1] == ["dot"]:
        assert text.startswith("digraph"), f"{shown['where']}: {describe(proc)}"
    elif "table" in args and args[args.index("table") - 1] == "--format":
        assert text.strip() and not text.startswith("{"), f"{shown['where']}: {describe(proc)}"
    else:
        proc.returncode = 0  # exit 8 comes with the JSON answer too
        json_answer(proc)
    if not set(STAND_INS) & set(args) and shown["output"]:
        assert matches(shown["output"], text), f"{shown['where']}: shown\n{shown['output']}\nactual\n{text}"
