"""Without matplotlib (the extra ``report``): ``report``, ``tune --report`` and the plugin's
``--graphscan-report`` each say in one line how to install it, before any work. These tests
hold wherever they run: matplotlib is made unimportable when it is installed."""

import importlib.util
import json
import sys

import numpy as np
import pytest

import graphscan
from tests.helpers import main_error_line

INSTALL = "pip install 'graphscan[report]'"


@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` fails, and find_spec finds none, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))


def test_report_and_tune_report_say_how_to_install_it_and_write_nothing(no_matplotlib, small_lab, capsys, tmp_path):
    answer = tmp_path / "islands.json"
    answer.write_text(json.dumps(graphscan.islands(small_lab["full"])), encoding="utf-8")
    line = main_error_line(capsys, ["report", answer, "--out", tmp_path / "p.html"], 2)
    assert line.startswith("graphscan: usage: report draws its charts with matplotlib") and INSTALL in line
    sample = tmp_path / "s.npz"
    np.savez(sample, x=np.ones((1, 8), np.float32))
    argv = ["tune", small_lab["fp32"], "--calibrate", sample, "--out", tmp_path / "o", "--report"]
    line = main_error_line(capsys, argv, 2)
    assert line.startswith("graphscan: usage: tune --report draws its charts with matplotlib") and INSTALL in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["islands.json", "s.npz"]


def test_the_plugins_report_needs_graphscan_and_matplotlib(no_matplotlib, small_lab, run_pytest, tmp_path):
    (tmp_path / "graphscan.toml").write_text(f'[[model]]\npath = "{small_lab["full"]}"\nmax_islands = 9\n')
    code, output = run_pytest(tmp_path, "--graphscan-report", "pages")
    assert code == 4 and "--graphscan-report: only with --graphscan" in output
    code, output = run_pytest(tmp_path, "--graphscan", "--graphscan-report", "pages")
    assert code == 4 and INSTALL in output
    assert not (tmp_path / "pages").exists()
