"""The report's pages in a real browser: headless Chromium (Debian's), the network off.

Marker ``browser``, deselected by default: ``python -m tests.report.browser install`` (root,
apt-get), then ``pytest -m browser -p no:xdist``; ``.ci/run`` runs both. Each page renders
with no console line (an error, or a request the page's policy refused), holds its sections
and, on tune's front, one mark per row and the chosen one ringed. The screenshots are kept for
review in the folder the run prints (``-s``), or in ``$GRAPHSCAN_SCREENSHOTS``.
"""

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import graphscan
from graphscan_ort.report.html import Html, Section, document
from tests.helpers import ROOT
from tests.report import browser
from tests.report.pages import Page

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(browser.executable() is None, reason="no chromium: python -m tests.report.browser install"),
]


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory):
    """Where the screenshots are kept for review, said once."""
    folder = Path(os.environ.get("GRAPHSCAN_SCREENSHOTS") or tmp_path_factory.mktemp("report-screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nthe report's screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def pages(saved, tmp_path_factory):
    """``{name: (page, its sections, the tune answer drawn on it or None)}``: tune --report's
    own page, one page of every answer kind, and the plugin's index and its model's page."""
    folder = tmp_path_factory.mktemp("pages")
    answers, paths = saved["answers"], saved["paths"]
    every = folder / "every.html"
    kinds = ("tune", "runtime", "runtime_arm64", "check", "trace", "impact")
    graphscan.report(*(str(paths[kind]) for kind in kinds), out=str(every))
    index = gate_run(saved, folder / "gate")
    (model_page,) = set(index.parent.glob("*.html")) - {index}
    tune = ["tune", "accuracy", "kernels"]
    return {
        "tune-report": (saved["out"] / "report.html", [*tune, "islands"], answers["tune"]),
        "every-kind": (every, [*tune, "runs", "check", "trace", "impact", "islands"], answers["tune"]),
        "gate-index": (index, ["models"], None),
        # check's answers: the counted budgets and the sampled ones, measured apart
        "gate-model": (model_page, ["gate", "check", "check-2", "runs", "islands"], None),
    }


def gate_run(saved, folder):
    """``pytest --graphscan --graphscan-report pages -n 2`` in a new process, as a user's CI runs
    it, on a repository of the tuned model (one budget holds, one is broken): the index's path."""
    (folder / "models").mkdir(parents=True)
    shutil.copy(saved["out"] / "model.onnx", folder / "models" / "cnn.int8.onnx")
    shutil.copy(saved["float"], folder / "models" / "cnn.onnx")
    (folder / "graphscan.toml").write_text(
        '[[model]]\npath = "models/cnn.int8.onnx"\nfloat = "models/cnn.onnx"\nmax_islands = 1000\nmin_sqnr = 200\n'
    )
    argv = ["-m", "pytest", "-p", "graphscan_pytest", "-p", "no:cacheprovider", "--graphscan", "-n", "2"]
    done = subprocess.run(
        [sys.executable, *argv, "--graphscan-report", "pages"],
        cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "graphscan: the report, a page per model: pages/index.html" in done.stdout, done
    return folder / "pages" / "index.html"


def png_size(path):
    """``(width, height)`` from a PNG's header."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("name", ["tune-report", "every-kind", "gate-index", "gate-model"])
def test_each_page_renders_offline_with_its_sections_and_no_console_line(pages, screenshots, name):
    path, sections, tune = pages[name]
    dom, console = browser.dump(path)
    assert console == []
    page = Page(dom)
    assert page.sections == sections
    if tune is not None:
        plotted = sorted(row["id"] for row in tune["candidates"] if row["metric_value"] is not None)
        assert sorted(page.front_marks()) == plotted
        assert len(page.marks["chosen"]) == 1
    shot = screenshots / f"{name}.png"
    assert browser.screenshot(path, shot, 1200, 1600) == []
    assert png_size(shot) == (1200, 1600)


def test_the_browser_check_sees_a_page_that_reaches_for_the_network(tmp_path):
    """The control: the page's own document with an image from a host: the browser refuses it
    and logs it, so a page that reached out would fail the test above."""
    outside = Html('<img src="http://example.com/x.png" alt="x">')
    path = tmp_path / "reaching.html"
    path.write_text(document("reaching", Html(""), [Section("s", "s", outside)]), encoding="utf-8")
    _, console = browser.dump(path)
    assert len(console) == 1 and "Content Security Policy" in console[0]
