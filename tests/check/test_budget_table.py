"""check's budget table (graphscan.BUDGETS) against docs/SPEC.md, and every surface derived
from it: check's options, the budget file, the plugin's config keys and "needs" rules.

The expectations are the SPEC's words, read from its check section: each budget's name, the
order of the answer's rows, which way it holds, its range and what it needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import graphscan
import graphscan_pytest

ROOT = Path(__file__).resolve().parents[2]


def spec_budgets() -> dict[str, dict[str, object]]:
    """Per budget, as check's section of docs/SPEC.md states it: ``direction``, ``whole``
    (a whole number >= 0), ``fraction`` (in [0, 1]), ``needs_float``, ``needs_metric``."""
    text = (ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8")
    section = text[text.index("### `check <quant.onnx>") :]
    section = section[: section.index("\n### ")]
    found: dict[str, dict[str, object]] = {}
    for bullet in re.split(r"\n- ", section)[1:]:
        words = " ".join(bullet.split())
        head = re.match(r"((?:`(?:max|min)_[a-z0-9]+`(?:, )?)+):", words)
        if head is None:
            continue
        for name in re.findall(r"`([a-z0-9_]+)`", head[1]):
            found[name] = {
                "direction": "max" if "holds when value <= limit" in words else "min",
                "whole": "a whole number >= 0" in words,
                "fraction": "a fraction in [0, 1]" in words,
                "needs_float": bool(re.search(r"[Nn]eeds `--float`", words)),
                "needs_metric": bool(re.search(r"[Nn]eeds `--float` and `--metric`", words)),
            }
    return found


SPEC = spec_budgets()


def test_the_table_holds_the_budgets_of_the_spec_in_the_answers_order():
    """The SPEC lists the rows "in this order whatever order they were given in"."""
    text = " ".join((ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8").split())
    order = re.search(r"in this order whatever order they were given in: ((?:`[a-z0-9_]+`(?:, )?)+)", text)
    assert order is not None
    assert list(graphscan.BUDGETS) == re.findall(r"`([a-z0-9_]+)`", order[1]) == list(SPEC)


@pytest.mark.parametrize("name", list(SPEC))
def test_each_budget_holds_its_direction_range_and_needs_as_the_spec_says(name):
    rule, said = graphscan.BUDGETS[name], SPEC[name]
    assert rule.direction == said["direction"]
    assert rule.structural == said["whole"]  # the counts are the whole numbers, read from the graph
    assert (rule.value is int) == said["whole"]
    assert (rule.between == (0, 1)) == said["fraction"]
    assert rule.needs_float == said["needs_float"]
    assert rule.needs_metric == said["needs_metric"]


@pytest.mark.parametrize("name", list(SPEC))
def test_a_limit_on_the_wrong_side_of_its_range_is_refused_in_the_spec_s_words(name):
    """A whole number >= 0 refuses -1 and 0.5; a fraction refuses 1.5; the others take any
    finite number. The holding side comes back as the number given."""
    said = SPEC[name]
    refused = [-1, 0.5] if said["whole"] else [1.5, -0.5] if said["fraction"] else []
    for value in refused:
        with pytest.raises(graphscan.GraphscanError) as raised:
            graphscan.budget_limit(name, value, "--where")
        assert raised.value.exit_code == graphscan.EXIT_USAGE
        assert str(raised.value).startswith(f"usage: --where: budget {name} ")
    taken = 3 if said["whole"] else 0.25 if said["fraction"] else -12.5
    assert graphscan.budget_limit(name, taken, "--where") == taken


@pytest.mark.parametrize("name", list(SPEC))
def test_check_has_one_option_per_budget_and_the_config_one_key(name):
    flag = "--" + name.replace("_", "-")
    assert flag in dict(graphscan.CHECK.flat_options())
    keys = graphscan_pytest.config_keys()
    types, _ = keys[name]
    assert (float in types) == (not SPEC[name]["whole"])


def test_the_config_lists_its_keys_as_before():
    """The order the plugin's "unknown key" error names its keys in (the metric's keys right
    before min_metric, as the config was written before the table)."""
    assert list(graphscan_pytest.config_keys()) == [
        "path",
        "float",
        "inputs",
        "shape",
        "seed",
        "level",
        "max_float",
        "max_islands",
        "max_crossings",
        "min_int8",
        "min_sqnr",
        "min_levels",
        "metric",
        "threshold",
        "blank",
        "layout",
        "min_metric",
        "snapshot",
        "cpu",
    ]


@pytest.mark.parametrize("name", [name for name, said in SPEC.items() if said["needs_float"]])
def test_a_budget_that_needs_float_is_refused_without_it_by_check_and_by_the_config(name, tmp_path):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"")  # never read: the rule is checked first
    keywords = {name: 0, "metric": "sqnr"} if SPEC[name]["needs_metric"] else {name: 0}
    with pytest.raises(graphscan.GraphscanError, match=r"needs --float F\.onnx"):
        graphscan.check(str(model), **keywords)
    config = tmp_path / "graphscan.toml"
    config.write_text(f'[[model]]\npath = "model.onnx"\n{name} = 0\n')
    with pytest.raises(graphscan_pytest.ConfigError, match=f"{name} needs float = the float model"):
        graphscan_pytest.read_config(config)


@pytest.mark.parametrize("name", [name for name, said in SPEC.items() if said["needs_metric"]])
def test_a_budget_measured_by_a_metric_is_refused_without_one(name, tmp_path):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"")
    flag = "--" + name.replace("_", "-")
    with pytest.raises(graphscan.GraphscanError, match=f"{flag} needs --metric NAME"):
        graphscan.check(str(model), float_path=str(model), **{name: 0})
    config = tmp_path / "graphscan.toml"
    config.write_text(f'[[model]]\npath = "model.onnx"\nfloat = "model.onnx"\n{name} = 0\n')
    with pytest.raises(graphscan_pytest.ConfigError, match=f"{name} needs metric = "):
        graphscan_pytest.read_config(config)
