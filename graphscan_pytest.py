"""graphscan for pytest: gate a repository of quantized models with no test code.

Installed with graphscan (a ``pytest11`` entry point), inert unless asked: without
``--graphscan`` it adds no items, runs nothing, and imports nothing beyond the
standard library (graphscan, onnx and onnxruntime are imported when a gate or the
``graphscan`` fixture first needs them).

    pytest --graphscan [--graphscan-config FILE] [-n auto]

reads ``graphscan.toml`` in the rootdir (or FILE): one ``[[model]]`` table per
quantized model, its budgets as keys. Each budget is one test item,
``graphscan.toml::det.int8.onnx::min_int8``; a broken one fails with one sentence.
Each table is measured once per test session (per xdist worker), however many
budgets it has; a path in two tables is two sets of items, ``det.int8.onnx:2::min_int8``.
``snapshot = true`` pins what onnxruntime runs, node by node, in a JSON file beside
the config (``graphscan_snapshots/<model>.json``, written by syrupy's JSON extension when
syrupy is installed, by json otherwise, the same text): a changed class is a failure that
lists the nodes that changed, and ``--graphscan-snapshot-update`` (or syrupy's
``--snapshot-update`` when syrupy is installed) rewrites it.
``cpu = ["native", "arm64"]`` measures the budgets that run the model, and the
snapshot, on each CPU target too: ``det.int8.onnx::min_int8[arm64]`` by
``graphscan check --cpu arm64``, pinned in ``<model>@arm64.json``. The update records
which snapshots each config wrote (``graphscan_snapshots/written.json``); when every item
ran, a snapshot the config wrote and no item pins is named at the end of the run (the
update deletes it), and no other file ever is.

The ``graphscan`` fixture (graphscan_pytest_fixture.py) has one typed method per command,
run in-process for hand-written tests, each answer kept for the test session under what
its call reads and asks.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from graphscan_pytest_fixture import Graphscan, user_metric_file
from graphscan_pytest_snapshots import (
    RECORD,
    SNAPSHOT_FILE,
    SNAPSHOT_FOLDER,
    UPDATE,
    read_record,
    record_text,
    runtime_snapshot,
    snapshot_names,
    snapshot_text,
    snapshot_verdict,
    unused_snapshots,
    write_atomically,
)

CONFIG_NAME = "graphscan.toml"

Key = tuple[tuple[type, ...], str]  # the types a config key may have, and what it is
# The keys of a [[model]] table beside its budgets (config_keys); paths are relative to the config's folder.
OPTION_KEYS: dict[str, Key] = {
    "path": ((str,), "the quantized model"),
    "float": ((str,), "the float model, for min_sqnr and min_metric"),
    "inputs": ((str, list), "samples: .npz files or folders of them"),
    "shape": ((list,), "shapes of generated inputs, NAME=D0,D1,..."),
    "seed": ((int,), "seed of generated inputs"),
    "level": ((str,), "onnxruntime optimization level of min_sqnr and min_metric"),
}
METRIC_KEYS: dict[str, Key] = {
    "metric": ((str,), "a built-in metric or FILE.py:FUNCTION"),
    "threshold": ((int, float), "iou's threshold"),
    "blank": ((int,), "ctc's blank class"),
    "layout": ((str,), "ctc's output axes, NTC or TNC"),
}
GATE_KEYS: dict[str, Key] = {
    "snapshot": ((bool,), "pin the runtime class of every node"),
    "cpu": ((list,), "the CPU targets that run the model: native, x86-avx2, arm64"),
}
PATH_KEYS = ("path", "float")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphscan", "gate quantized ONNX models (graphscan)")
    group.addoption("--graphscan", action="store_true", help="gate the models of graphscan.toml")
    group.addoption("--graphscan-config", metavar="FILE", help="the gates' file (default: graphscan.toml in rootdir)")
    group.addoption(
        "--graphscan-snapshot-update",
        action="store_true",
        help="rewrite the runtime snapshots (syrupy's --snapshot-update does too)",
    )
    group.addoption("--graphscan-report", metavar="DIR", help="write a page per model and index.html into DIR")


def config_path(config: pytest.Config) -> Path:
    given = config.getoption("graphscan_config")
    return Path(given).resolve() if given else Path(config.rootpath, CONFIG_NAME).resolve()


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("graphscan_report") and not config.getoption("graphscan"):
        raise pytest.UsageError("--graphscan-report: only with --graphscan")
    if not config.getoption("graphscan"):
        return
    if config.getoption("graphscan_report") and importlib.util.find_spec("matplotlib") is None:
        raise pytest.UsageError(
            "--graphscan-report draws with matplotlib, not installed: pip install 'graphscan[report]'"
        )
    path = config_path(config)
    if not path.is_file():
        raise pytest.UsageError(f"--graphscan: no {path} (give --graphscan-config FILE)")
    # Collected like a test file wherever pytest is pointed: the gates always run.
    if not any(covers(Path(arg.split("::")[0]).resolve(), path) for arg in config.args):
        config.args.append(str(path))


def covers(arg: Path, path: Path) -> bool:
    return arg == path or (arg.is_dir() and arg in path.parents)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    config = parent.config
    if config.getoption("graphscan") and file_path.resolve() == config_path(config):
        return GateFile.from_parent(parent, path=file_path)
    return None


def pytest_sessionfinish(session: pytest.Session) -> None:
    if session.config.getoption("graphscan"):
        finish_session(session.config)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_testnodedown(node: Any, error: object) -> None:
    if node.config.getoption("graphscan"):
        gather(node.config, getattr(node, "workeroutput", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    for line in session_state(config).report:  # the unused snapshots (finish_session)
        terminalreporter.write_line(line)


# ---------------------------------------------------------------------------
# The config: checked before anything runs; every error names file, line and key.


class ConfigError(Exception):
    """A bad graphscan.toml: one collection error naming the file, line and key."""


@dataclasses.dataclass(frozen=True)
class Gate:
    """One ``[[model]]`` of the config, its paths resolved."""

    index: int
    name: str  # the model's name: its file name, or its path when two models share a name
    settings: dict[str, Any]
    snapshot_name: str = ""  # its snapshot's file name without .json (snapshot_names)
    node_name: str = ""  # its part of the item ids: the name, ``NAME:N`` (the table's number) where a path repeats

    @property
    def budgets(self) -> list[str]:
        """Its budgets, in check's order."""
        return [key for key in budget_rules() if key in self.settings]

    @property
    def targets(self) -> list[str]:
        """The CPU targets its budgets that run the model are measured on (``cpu``; native by default)."""
        return list(self.settings.get("cpu", [native()]))


def on_target(name: str, target: str) -> str:
    """An item's name on ``target``: ``min_int8`` natively, ``min_int8[arm64]`` on arm64."""
    return name if target == native() else f"{name}[{target}]"


def key_line(text: str, index: int, key: str | None) -> int:
    """The line of ``key`` in the ``index``-th ``[[model]]`` table (its header without a key)."""
    lines = text.splitlines()
    headers = [k for k, line in enumerate(lines) if re.match(r"\s*\[\[\s*model\s*\]\]", line)]
    if index >= len(headers):
        # model = [...] written as an array: its line
        return next((k + 1 for k, line in enumerate(lines) if re.match(r"\s*model\s*=", line)), 1)
    start = headers[index]
    end = next((k for k in range(start + 1, len(lines)) if re.match(r"\s*\[", lines[k])), len(lines))
    if key is not None:
        for k in range(start + 1, end):
            if re.match(rf"\s*{re.escape(key)}\s*=", lines[k]):
                return k + 1
    return start + 1


def read_config(path: Path) -> list[Gate]:
    """The gates of ``path``; ConfigError for an unknown key, a wrong type or a missing file."""
    import tomllib

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 (byte {exc.start}: {exc.reason}); TOML is UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not TOML ({exc})") from None
    unknown_top = sorted(set(data) - {"model"})
    if unknown_top:
        raise ConfigError(f"{path}: unknown table or key {unknown_top[0]!r} (only [[model]] tables)")
    models = data.get("model", [])
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{path}: no [[model]] table")
    gates = [checked_gate(path, text, k, entry) for k, entry in enumerate(models)]
    names = [Path(g.settings["path"]).name for g in gates]
    gates = [
        dataclasses.replace(g, name=n if names.count(n) == 1 else os.path.relpath(g.settings["path"], path.parent))
        for g, n in zip(gates, names, strict=True)
    ]
    models = [(g.name, g.settings["path"]) for g in gates]
    paths = [model_path for _, model_path in models]
    return [
        dataclasses.replace(g, snapshot_name=n, node_name=table_node_name(g, paths.count(g.settings["path"]) > 1))
        for g, n in zip(gates, snapshot_names(models, path.parent), strict=True)
    ]


def table_node_name(gate: Gate, path_repeats: bool) -> str:
    """The table's part of its item ids: the model's name, and the table's number where
    another table names the same path (two tables, two ids; one model, one snapshot)."""
    return f"{gate.name}:{gate.index + 1}" if path_repeats else gate.name


def native() -> str:
    """The CPU target of a model without ``cpu = [...]`` (the core's name): its items and
    snapshot keep their plain names."""
    name: str = graphscan_core().NATIVE
    return name


def budget_rules() -> dict[str, Any]:
    """check's table of budgets (``graphscan.BUDGETS``, name: BudgetRule): the one home of
    the budgets' keys, types, ranges and "needs" rules."""
    rules: dict[str, Any] = graphscan_core().BUDGETS
    return rules


def counted(name: str) -> bool:
    """Whether budget ``name`` is counted from the graph (the same on every CPU), not run."""
    return bool(budget_rules()[name].structural)


def sampled(name: str) -> bool:
    """Whether budget ``name`` runs the model on samples, against the float model."""
    return bool(budget_rules()[name].needs_float)


def config_keys() -> dict[str, Key]:
    """Every key of a ``[[model]]`` table, in the order its errors list them: the options,
    each budget of check's table (the metric's keys right before the budget it measures),
    then snapshot and cpu."""
    keys = dict(OPTION_KEYS)
    for rule in budget_rules().values():
        if rule.needs_metric:
            keys.update(METRIC_KEYS)
        keys[rule.name] = ((int,) if rule.value is int else (int, float), rule.key_help)
    return {**keys, **GATE_KEYS}


def checked_gate(path: Path, text: str, index: int, entry: Any) -> Gate:
    def fail(key: str | None, why: str) -> ConfigError:
        return ConfigError(f"{path}:{key_line(text, index, key)}: [[model]] {index + 1}: {why}")

    if not isinstance(entry, dict):
        raise fail(None, f"must be a table of keys (path = ..., budgets), not {entry!r}")
    known = config_keys()
    for key, value in entry.items():
        if key not in known:
            raise fail(key, f"unknown key {key!r} (known: {', '.join(known)})")
        types, what = known[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise fail(key, f"{key} must be {' or '.join(t.__name__ for t in types)} ({what}), not {value!r}")
    if "path" not in entry:
        raise fail(None, "needs path = the quantized model")
    if "cpu" in entry:
        why = cpu_mistake(entry)
        if why is not None:
            raise fail("cpu", why)
    settings = dict(entry)
    for key in PATH_KEYS:
        if key in settings:
            # Named as given: ".." resolved, a link kept (its name is the model's name).
            settings[key] = os.path.normpath(path.parent / settings[key])
            if not os.path.isfile(settings[key]):
                raise fail(key, f"{key}: no such file {entry[key]!r}")
    if "inputs" in settings:
        given = settings["inputs"] if isinstance(settings["inputs"], list) else [settings["inputs"]]
        resolved = []
        for item in given:
            if not isinstance(item, str):
                raise fail("inputs", f"inputs must be paths, not {item!r}")
            full = os.path.normpath(path.parent / item)
            if not os.path.exists(full):
                raise fail("inputs", f"inputs: no such file or folder {item!r}")
            resolved.append(full)
        settings["inputs"] = resolved
    core = graphscan_core()
    rules = budget_rules()
    for key in rules:
        if key in settings:
            try:
                core.budget_limit(key, settings[key], key)
            except core.GraphscanError as exc:
                raise fail(key, str(exc).removeprefix("usage: ")) from None
    if not any(key in settings for key in [*rules, "snapshot"]):
        raise fail(None, f"no budget (one of {', '.join(rules)}) and no snapshot")
    # check's own rule of what a budget needs, the config's keys for check's keywords
    keywords = {"float_path" if key == "float" else key for key in settings}
    unmet = core.unmet_need([key for key in rules if key in settings], keywords)
    if unmet is not None:
        key, need = unmet
        raise fail(key, f"{key} needs {core.NEEDS[need][1]}")
    try:
        command_line_rules(settings)
        metric_file = user_metric_file(settings.get("metric"))
        if metric_file is not None:  # code the gate imports and runs: found beside the config
            full = os.path.normpath(path.parent / metric_file[0])
            if not os.path.isfile(full):
                raise core.GraphscanError(f"--metric: no such file {metric_file[0]!r}", core.EXIT_USAGE)
            settings["metric"] = f"{full}:{metric_file[1]}"
    except core.GraphscanError as exc:
        # check's own words, its flags written as the config's keys (--min-sqnr: min_sqnr)
        why = re.sub(r"--([a-z0-9-]+)", lambda m: m[1].replace("-", "_"), str(exc).removeprefix("usage: "))
        named = next((key for key in re.findall(r"[a-z0-9_]+", why) if key in entry), None)
        raise fail(named, why) from None
    return Gate(index, Path(settings["path"]).name, settings)


def cpu_mistake(entry: dict[str, Any]) -> str | None:
    """What is wrong with a table's ``cpu = [...]`` (None: nothing): each name one of the
    targets, once; another target than native only where a budget or snapshot runs the model
    (check's rule for --cpu: the counts are the same on every CPU)."""
    targets = graphscan_core().CPU_TARGETS
    chosen = entry["cpu"]
    if not chosen:
        return "cpu: an empty list runs nothing (leave cpu out for native alone)"
    for name in chosen:
        if not isinstance(name, str) or name not in targets:
            return f"cpu: {name!r} is not one of {', '.join(targets)}"
        if chosen.count(name) > 1:
            return f"cpu: {name!r} is given twice"
    running = [key for key in budget_rules() if not counted(key)]
    if chosen != [native()] and not (entry.get("snapshot") or any(key in entry for key in running)):
        return f"cpu: only with {', '.join(running)} or snapshot (the counts are the same on every CPU)"
    return None


def command_line_rules(settings: dict[str, Any]) -> None:
    """GraphscanError where ``graphscan check`` would refuse the same options: each rule is
    the command line's own function, so a config and check never disagree. A user metric is
    not loaded here (its file runs when the gate runs)."""
    core = graphscan_core()
    sample = {f"--{key}": settings.get(key) for key in OPTION_KEYS if key != "path"}
    rules = budget_rules().values()
    needing = [rule.name for rule in rules if rule.needs_float]
    core.only_with(core.either_of(needing), any(key in settings for key in needing), sample)
    metric_keys = {f"--{key}": settings.get(key) for key in METRIC_KEYS}
    measured_by_metric = [rule.name for rule in rules if rule.needs_metric]
    core.only_with(core.either_of(measured_by_metric), any(key in settings for key in measured_by_metric), metric_keys)
    declared = dict(core.CHECK.flat_options())  # check's own argparse types
    for key in ("seed", "blank", "threshold"):
        parse = declared[f"--{key}"]["type"]
        if key in settings:
            try:
                parse(str(settings[key]))
            except argparse.ArgumentTypeError as exc:
                raise core.GraphscanError(f"--{key}: {exc}", core.EXIT_USAGE) from None
    for key in ("level", "layout"):
        choices = declared[f"--{key}"]["choices"]
        if key in settings and settings[key] not in choices:
            raise core.GraphscanError(f"--{key}: {settings[key]!r} is not one of {', '.join(choices)}", core.EXIT_USAGE)
    if "shape" in settings:
        bad = [item for item in settings["shape"] if not isinstance(item, str)]
        if bad:
            raise core.GraphscanError(f"--shape: {bad[0]!r} is not a string NAME=D0,D1,...", core.EXIT_USAGE)
        from graphscan_ort.shared.inputs import parse_shapes

        parse_shapes(settings["shape"])
    if "metric" in settings:
        from graphscan_ort.shared.agreement import metric

        user = user_metric_file(settings["metric"]) is not None
        # A built-in or a malformed name is checked whole; a user's takes neither threshold, blank nor layout.
        parameters = [settings.get(key) for key in ("threshold", "blank", "layout")]
        metric("sqnr" if user else settings["metric"], *parameters)


# ---------------------------------------------------------------------------
# Collection: the config file, one collector per model, one item per budget.


class GateFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        try:
            gates = read_config(self.path)
        except ConfigError as exc:
            raise self.CollectError(str(exc)) from None
        # The whole config's items and snapshots, whichever of them are selected: the
        # unused-snapshot report needs to know every one (pytest_sessionfinish).
        state = session_state(self.config)
        for gate in gates:
            for name, budget, target in gate_items(gate):
                state.declared.add(f"{self.nodeid}::{gate.node_name}::{name}")
                if budget is None:
                    state.pinned.add(snapshot_file(self.config, gate, target).name)
        for gate in gates:
            yield ModelGates.from_parent(self, name=gate.node_name, gate=gate)


def gate_items(gate: Gate) -> Iterator[tuple[str, str | None, str]]:
    """``(name, budget, target)`` of each item of ``gate`` in order, its snapshot's with budget None."""
    for budget in gate.budgets:
        # A count reads the graph alone: one item whatever the CPUs; the others one per target.
        for target in [native()] if counted(budget) else gate.targets:
            yield on_target(budget, target), budget, target
    if gate.settings.get("snapshot"):
        for target in gate.targets:
            yield on_target("snapshot", target), None, target


class ModelGates(pytest.Collector):
    def __init__(self, *, gate: Gate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate

    def collect(self) -> Iterator[pytest.Item]:
        for name, budget, target in gate_items(self.gate):
            if budget is None:
                yield SnapshotItem.from_parent(self, name=name, gate=self.gate, target=target)
            else:
                yield BudgetItem.from_parent(self, name=name, gate=self.gate, budget=budget, target=target)


class GateFailed(Exception):
    """A gate broken: its sentence is the whole report."""


class GateItem(pytest.Item):
    def __init__(self, *, gate: Gate, target: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate
        self.target = target  # the CPU target it is measured on

    def setup(self) -> None:
        session_state(self.config).ran.add(self.nodeid)  # the unused-snapshot report counts it

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, GateFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)  # a bug of the plugin: its traceback

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.gate.node_name}::{self.name}"


class BudgetItem(GateItem):
    def __init__(self, *, budget: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.budget = budget

    def runtest(self) -> None:
        answer = measured(self.config, self.gate, self.budget, self.target)
        (row,) = [b for b in answer["budgets"] if b["name"] == self.budget]
        if not row["ok"]:
            raise GateFailed(budget_sentence(row, self.config, self.gate, self.target))


class SnapshotItem(GateItem):
    def runtest(self) -> None:
        compare_snapshot(self.config, self.gate, self.target)


# ---------------------------------------------------------------------------
# Measuring: each model once per session, by graphscan's own check and runtime.


@dataclasses.dataclass
class SessionState:
    """What the plugin keeps for one pytest session (``config.stash[STATE]``): the answers
    measured, and what the unused-snapshot report needs, gathered from every xdist worker."""

    answers: dict[Any, Any] = dataclasses.field(default_factory=dict)  # the gates' and the fixture's
    declared: set[str] = dataclasses.field(default_factory=set)  # the config's item ids, once it is read
    pinned: set[str] = dataclasses.field(default_factory=set)  # the snapshot files its items pin
    ran: set[str] = dataclasses.field(default_factory=set)  # the ids of the items that ran
    written: set[str] = dataclasses.field(default_factory=set)  # the snapshot files this session wrote
    outcomes: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # --graphscan-report: [outcome, why]
    report: list[str] = dataclasses.field(default_factory=list)  # the terminal summary's lines


STATE = pytest.StashKey[SessionState]()


def session_state(config: pytest.Config) -> SessionState:
    return config.stash.setdefault(STATE, SessionState())


def graphscan_core() -> Any:
    """The graphscan module (imported on first use: the plugin's start-up costs nothing)."""
    import graphscan

    return graphscan


def in_process(run: Callable[[], Any]) -> Any:
    """``run()``, a GraphscanError (bad input: a model that does not load, samples that do
    not fit) turned into a gate failure with graphscan's one line."""
    core = graphscan_core()
    try:
        return run()
    except core.GraphscanError as exc:
        raise GateFailed(f"graphscan: {exc} (exit {exc.exit_code})") from None


def measured(config: pytest.Config, gate: Gate, budget: str, target: str) -> dict[str, Any]:
    """graphscan check's answer for ``budget`` on ``target`` and the other budgets of
    ``gate`` measured alike, once per session: those that run samples apart, so a sample
    that fails them never fails a count (max_islands needs no inputs). The counts are
    measured natively only (check refuses --cpu for them alone)."""
    cache = session_state(config).answers
    on_samples = sampled(budget)
    key = ("check", gate.index, on_samples, target)
    if key not in cache:
        core = graphscan_core()
        s = gate.settings
        alike = [name for name in gate.budgets if sampled(name) == on_samples]
        options = {name: s[name] for name in alike if target == native() or not counted(name)}
        if target != native():
            options["cpu"] = target
        if on_samples:
            for name in [key for key in [*OPTION_KEYS, *METRIC_KEYS] if key != "path"]:
                if name in s:
                    options["float_path" if name == "float" else name] = s[name]
        cache[key] = in_process(lambda: core.check(s["path"], **options))
    answer: dict[str, Any] = cache[key]
    return answer


def runtime_answer(config: pytest.Config, gate: Gate, target: str) -> dict[str, Any]:
    cache = session_state(config).answers
    key = ("runtime", gate.index, target)
    if key not in cache:
        core = graphscan_core()
        cpu = {} if target == native() else {"cpu": target}
        cache[key] = in_process(lambda: core.runtime(gate.settings["path"], **cpu))
    answer: dict[str, Any] = cache[key]
    return answer


def budget_sentence(row: dict[str, Any], config: pytest.Config, gate: Gate, target: str) -> str:
    """``min_int8: 0.1849 < 0.8 (54 of 292 nodes run int8 or int8_data kernels)``
    (``min_int8[arm64]: ...`` on a target, its nodes those the target runs): the words
    after the value are the budget's own (``BudgetRule.words``)."""
    name, value, limit = row["name"], row["value"], row["limit"]
    rule = budget_rules()[name]
    sign = ">" if rule.direction == "max" else "<"
    shown = "undefined" if value is None else f"{value:.4g}"
    words = rule.words(row, GateExplaining(config, gate, target))
    return f"{on_target(name, target)}: {shown} {sign} {limit:g} ({words})" + (
        " (undefined never holds)" if value is None else ""
    )


@dataclasses.dataclass
class GateExplaining:
    """What a budget's words may ask of a gate (the core's ``Explaining``): the float model's
    name, the nodes that run int8 on the gate's target, a metric named as the config names it."""

    config: pytest.Config
    gate: Gate
    target: str

    @property
    def float_name(self) -> str:
        return Path(self.gate.settings["float"]).name

    def int8_nodes(self) -> tuple[int, int]:
        classes = runtime_answer(self.config, self.gate, self.target)["classes"]
        integer = classes["int8"] + classes["int8_data"]
        return integer, integer + classes["float"]

    def metric_words(self, described: dict[str, Any]) -> list[str]:
        if user_metric_file(described.get("name")) is not None:  # the file as the config's folder sees it
            described = {**described, "name": os.path.relpath(described["name"], config_path(self.config).parent)}
        words: list[str] = graphscan_core().metric_words(described)
        return words


# ---------------------------------------------------------------------------
# Snapshots of what runs, node by node.


def snapshot_file(config: pytest.Config, gate: Gate, target: str) -> Path:
    """``NAME.json``, or ``NAME@TARGET.json`` for a CPU target (``@`` is never in a NAME)."""
    name = gate.snapshot_name if target == native() else f"{gate.snapshot_name}@{target}"
    return config_path(config).parent / SNAPSHOT_FOLDER / f"{name}.json"


def updating(config: pytest.Config) -> bool:
    return bool(config.getoption("graphscan_snapshot_update") or config.getoption("update_snapshots", False))


def compare_snapshot(config: pytest.Config, gate: Gate, target: str) -> None:
    now = runtime_snapshot(runtime_answer(config, gate, target))
    path = snapshot_file(config, gate, target)
    if not updating(config) and not path.is_file():
        raise GateFailed(f"snapshot: no {path}: take it with {UPDATE}, review, commit")
    if updating(config):
        try:
            write_atomically(path, snapshot_text(now))
        except OSError as exc:  # a full disk, a read-only checkout: not a bug of the plugin
            raise GateFailed(f"snapshot: cannot write {path} ({exc.strerror or exc})") from None
        session_state(config).written.add(path.name)  # the config's own: the record says so
        return
    try:
        pinned = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise GateFailed(f"snapshot: {path} is not JSON ({exc}); retake it with {UPDATE}, review, commit") from None
    verdict = snapshot_verdict(pinned, now, path.name)
    if verdict is not None:
        raise GateFailed(verdict)


# ---------------------------------------------------------------------------
# Unused snapshots: when the whole config ran, the files it wrote (the folder's record) that
# no item of it pins are named (syrupy's report); --graphscan-snapshot-update deletes them
# and records what the config wrote. Each xdist worker sends what it collected, ran and
# wrote to the controller, which reports and records.

GATHERED = "graphscan_snapshots"  # the key of a worker's workeroutput


def unused_report(config: pytest.Config, state: SessionState) -> list[str]:
    """The summary's lines on the config's unused snapshots (none unless every item of it ran),
    each deleted first when updating; an update then records what the config wrote."""
    path = config_path(config)
    folder = path.parent / SNAPSHOT_FOLDER
    record = read_record(folder)
    wrote = set(record.get(path.name, [])) | state.written
    others = {name for other, names in record.items() if other != path.name for name in names}
    # Part of the config (-k, a node id, -x): its other items' snapshots are unknown.
    whole = bool(state.declared) and state.declared <= state.ran
    unused = unused_snapshots(folder, wrote, state.pinned | others) if whole else []
    lines, left = unused_lines(config, unused)
    if updating(config):
        claimed = (wrote & state.pinned) | {file.name for file in left} if whole else wrote
        lines += record_claims(config, record, claimed)
    return lines


def shown(config: pytest.Config, file: Path) -> str:
    """A file as the summary names it: its path from the rootdir."""
    return os.path.relpath(file, config.rootpath)


def unused_lines(config: pytest.Config, unused: list[Path]) -> tuple[list[str], list[Path]]:
    """The summary's lines naming the ``unused`` snapshots, or, updating, deleting them; and
    the files still there."""
    if not unused:
        return [], []
    pinned_by = f"pinned by no item of {shown(config, config_path(config))}"
    if not updating(config):
        named = ", ".join(shown(config, file) for file in unused)
        return [f"graphscan: unused snapshot(s), {pinned_by}: {named} (delete them with {UPDATE})"], unused
    deleted, left, lines = [], [], []
    for file in unused:
        try:
            file.unlink()
        except OSError as exc:
            lines.append(f"graphscan: cannot delete the unused snapshot {shown(config, file)} ({exc.strerror or exc})")
            left.append(file)
        else:
            deleted.append(shown(config, file))
    if deleted:
        lines.insert(0, f"graphscan: deleted unused snapshot(s), {pinned_by}: {', '.join(deleted)}")
    return lines, left


def record_claims(config: pytest.Config, record: dict[str, list[str]], claimed: set[str]) -> list[str]:
    """The record rewritten with ``claimed`` (those still there and named as snapshots) as
    what the config wrote, when that changed; a summary line when it cannot be written."""
    path = config_path(config)
    folder = path.parent / SNAPSHOT_FOLDER
    mine = {name for name in claimed if SNAPSHOT_FILE.fullmatch(name) and (folder / name).is_file()} - {RECORD}
    if mine == set(record.get(path.name, [])):
        return []
    try:
        write_atomically(folder / RECORD, record_text({**record, path.name: sorted(mine)}))
    except OSError as exc:
        return [f"graphscan: cannot write the snapshot record {shown(config, folder / RECORD)} ({exc.strerror or exc})"]
    return []


def finish_session(config: pytest.Config) -> None:
    """An xdist worker sends what it collected, ran and wrote to the controller (and, with
    --graphscan-report, its items' outcomes and the answers it measured); the controller, or a
    session without workers, writes the report (and, updating, deletes and records) and the pages."""
    state = session_state(config)
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[GATHERED] = {key: sorted(getattr(state, key)) for key in ("declared", "pinned", "ran", "written")}
        if config.getoption("graphscan_report"):
            answers = [[list(key), answer] for key, answer in gate_answers(state)]
            workeroutput[REPORTED] = json.dumps({"outcomes": state.outcomes, "answers": answers})
    else:
        state.report = unused_report(config, state)
        if config.getoption("graphscan_report"):
            state.report += write_pages(config, state)


def gather(config: pytest.Config, workeroutput: dict[str, Any]) -> None:
    """What a worker sent at its end (a worker that crashed sent nothing: its items did not all run)."""
    state = session_state(config)
    for key, names in workeroutput.get(GATHERED, {}).items():
        getattr(state, key).update(names)
    reported = json.loads(workeroutput.get(REPORTED, "{}"))  # JSON: an answer's infinite SQNR travels too
    state.outcomes.update(reported.get("outcomes", {}))
    for key, answer in reported.get("answers", []):
        state.answers.setdefault(tuple(key), answer)


# ---------------------------------------------------------------------------
# --graphscan-report: a page per model and an index (graphscan_ort/report/gate.py), from each
# item's outcome and the answers the gates measured, written once by the controller.

REPORTED = "graphscan_report"  # the key of a worker's workeroutput


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    folder = item.config.getoption("graphscan_report")
    if folder and isinstance(item, GateItem) and (report.when == "call" or not report.passed):
        from graphscan_ort.report.gate import why_not_passed

        session_state(item.config).outcomes[item.nodeid] = [report.outcome, why_not_passed(report)]
        if importlib.util.find_spec("pytest_html") is not None:  # the model's page as the item's extra
            from pytest_html import extras

            page = Path(folder, f"{item.gate.snapshot_name}.html").resolve().as_uri()
            vars(report)["extras"] = [*vars(report).get("extras", []), extras.url(page, name="graphscan report")]
    return report


def gate_answers(state: SessionState) -> list[tuple[Any, Any]]:
    """The gates' answers (check's and runtime's, keyed by the table's index), not the fixture's."""
    return [(key, answer) for key, answer in state.answers.items() if isinstance(key[1], int)]


def write_pages(config: pytest.Config, state: SessionState) -> list[str]:
    """Each model's page and the index: every item of the config with its outcome (``not run``
    when left out); runtime measured here for a model no item measured it for."""
    from graphscan_ort.report.gate import ItemOutcome, ModelGates, write_gate_report

    if not state.declared:  # the config did not collect: its error says why
        return []
    prefix = next(iter(state.declared)).split("::")[0]
    tables = []
    for gate in read_config(config_path(config)):
        ids = [(f"{prefix}::{gate.node_name}::{name}", name) for name, _, _ in gate_items(gate)]
        items = [ItemOutcome(i, name, *state.outcomes.get(i, ["not run", ""])) for i, name in ids]
        answers = [("check", answer) for key, answer in gate_answers(state) if key[:2] == ("check", gate.index)]
        notes = []
        for target in gate.targets:
            try:
                answers.append(("runtime", runtime_answer(config, gate, target)))
            except GateFailed as exc:
                notes.append(f"runtime{'' if target == native() else ' on ' + target}: {exc}")
        tables.append(ModelGates(gate.name, gate.settings["path"], f"{gate.snapshot_name}.html", items, answers, notes))
    folder = config.getoption("graphscan_report")
    try:
        index = write_gate_report(folder, str(config_path(config)), tables)
    except graphscan_core().GraphscanError as exc:
        return [f"graphscan: the report: {exc}"]
    return [f"graphscan: the report, a page per model: {shown(config, Path(index))}"]


# ---------------------------------------------------------------------------
# The fixture: graphscan's commands in-process (graphscan_pytest_fixture.py).


@pytest.fixture(scope="session")
def graphscan(request: pytest.FixtureRequest) -> Graphscan:
    """graphscan's commands in this process, answers kept per session by what each call reads."""
    return Graphscan(session_state(request.config).answers)
