"""pytest --graphscan --graphscan-report DIR: a page per model and an index listing every item
of graphscan.toml with its outcome, each outcome as pytest itself reports it (``-rA``)."""

import importlib
import importlib.util
import shutil

import pytest

import graphscan
from tests.helpers import item_outcomes
from tests.lab import DEFAULT_LAB
from tests.report.conftest import PLOTTING, needs_plotting
from tests.report.pages import Page

pytestmark = needs_plotting
# One chart drawn here, before pytester's runs: each run in this process forgets the modules it
# imported (matplotlib imports some at its first chart), and a matplotlib imported twice over
# meets its own classes as strangers.
if PLOTTING:
    importlib.import_module("graphscan_ort.report.gate")
    importlib.import_module("graphscan_ort.report.plots").kernel_picture({"native": {"int8": 1}}, "warm-up")

# The pytester folder's conftest: each write of the pages, with the process that wrote them.
WRITES_LOGGED = """
import os
import graphscan_ort.report.gate as gate

written = gate.write_gate_report


def logged(*args, **kwargs):
    with open(os.environ["GRAPHSCAN_PAGES_LOG"], "a") as log:
        log.write(f"{os.getpid()}\\n")
    return written(*args, **kwargs)


gate.write_gate_report = logged
"""


@pytest.fixture(scope="module")
def gated(tmp_path_factory, build_case):
    """The lab's QDQ model, gated so that every budget holds, and its MatMul-only variant with
    one broken budget; a third table names the first model again."""
    folder = tmp_path_factory.mktemp("gated")
    (folder / "models").mkdir()
    lab = build_case(DEFAULT_LAB)
    for variant in ("full", "matmul_only"):
        shutil.copy(lab[variant], folder / "models" / f"{variant}.onnx")
    islands = graphscan.islands(str(folder / "models" / "matmul_only.onnx"))["island_count"]
    (folder / "graphscan.toml").write_text(
        f"""
[[model]]
path = "models/full.onnx"
min_int8 = 0
max_islands = 1000

[[model]]
path = "models/matmul_only.onnx"
max_islands = {islands - 1}
max_float = 1000

[[model]]
path = "models/full.onnx"
max_crossings = 1000
""",
        encoding="utf-8",
    )
    return folder


def index_outcomes(folder):
    """``{(model, item): outcome}`` as the index lists them, read back from its table."""
    page = Page((folder / "index.html").read_text(encoding="utf-8"))
    found = {}
    for model, items, _ in page.by_id.get("models", page.tables[0])[1:]:
        for line in filter(None, items.split("\n")):
            name, outcome = line.rsplit(": ", 1)
            found[(model, name)] = outcome
    return found


def pytest_outcomes(output):
    """``{(model, item): outcome}`` from pytest's own ``-rA`` summary."""
    found = {}
    for item, outcome in item_outcomes(output).items():
        _, model, name = item.split("::")
        found[(model.split(":")[0], name)] = outcome
    return found


def test_the_index_lists_every_item_with_the_outcome_pytest_reports(gated, run_pytest):
    code, output = run_pytest(gated, "--graphscan", "--graphscan-report", "pages", "-rA")
    assert code == 1
    expected = pytest_outcomes(output)
    assert len(expected) == 5 and list(expected.values()).count("failed") == 1
    assert index_outcomes(gated / "pages") == expected
    assert "graphscan: the report, a page per model: pages/index.html" in output
    # one page per model, named as its snapshot is (a name with a folder is hashed): full.onnx's two tables on one
    links = [
        link for link in Page((gated / "pages" / "index.html").read_text(encoding="utf-8")).links if "#" not in link
    ]
    assert sorted(p.name for p in (gated / "pages").iterdir()) == sorted(["index.html", *links])
    assert len(links) == 2 and "matmul_only.onnx.html" in links
    page = Page((gated / "pages" / "matmul_only.onnx.html").read_text(encoding="utf-8"))
    assert page.sections == ["gate", "check", "runs", "islands"]
    failed = [row for row in page.in_section["gate"][0][1:] if row[1] == "failed"]
    assert [row[0] for row in failed] == ["max_islands"] and failed[0][2].startswith("max_islands: ")


def test_items_left_out_are_listed_as_not_run(gated, run_pytest):
    _, output = run_pytest(gated, "--graphscan", "--graphscan-report", "pages", "-rA", "-k", "max_islands")
    ran = pytest_outcomes(output)
    listed = index_outcomes(gated / "pages")
    assert len(listed) == 5 and {key: listed[key] for key in ran} == ran
    assert {listed[key] for key in set(listed) - set(ran)} == {"not run"}


def test_under_two_workers_the_pages_are_written_once_and_whole(gated, run_pytest, monkeypatch, tmp_path):
    """The workers send their outcomes and answers; the controller alone writes, once."""
    gate = importlib.import_module("graphscan_ort.report.gate")
    monkeypatch.setattr(gate, "write_gate_report", gate.write_gate_report)  # the conftest wraps it in this process
    (gated / "conftest.py").write_text(WRITES_LOGGED, encoding="utf-8")
    log = tmp_path / "writes.log"
    monkeypatch.setenv("GRAPHSCAN_PAGES_LOG", str(log))
    try:
        code, output = run_pytest(gated, "--graphscan", "--graphscan-report", "pages2", "-rA", "-n", "2")
    finally:
        (gated / "conftest.py").unlink()
    assert code == 1 and len(log.read_text().split()) == 1, output
    assert index_outcomes(gated / "pages2") == pytest_outcomes(output)
    (full,) = (gated / "pages2").glob("models_full.onnx~*.html")
    page = Page(full.read_text(encoding="utf-8"))
    assert page.sections == ["gate", "check", "runs", "check-2", "islands"]  # both tables' answers, from the workers


@pytest.mark.skipif(importlib.util.find_spec("pytest_html") is None, reason="pytest-html is not installed")
def test_with_pytest_html_each_item_links_its_models_page(gated, run_pytest):
    code, _ = run_pytest(gated, "--graphscan", "--graphscan-report", "pages", "--html", "run.html")
    text = (gated / "run.html").read_text(encoding="utf-8")
    links = [
        link for link in Page((gated / "pages" / "index.html").read_text(encoding="utf-8")).links if "#" not in link
    ]
    for page in links:
        assert (gated / "pages" / page).resolve().as_uri() in text
    assert code == 1 and "graphscan report" in text
