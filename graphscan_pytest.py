"""graphscan for pytest: gate a repository of quantized models with no test code.

Installed with graphscan (a ``pytest11`` entry point), inert unless asked: without
``--graphscan`` it adds no items, runs nothing, and imports nothing beyond the
standard library (graphscan, onnx and onnxruntime are imported when a gate or the
``graphscan`` fixture first needs them).

    pytest --graphscan [--graphscan-config FILE] [-n auto]

reads ``graphscan.toml`` in the rootdir (or FILE): one ``[[model]]`` table per
quantized model, its budgets as keys. Each budget is one test item,
``graphscan.toml::det.int8.onnx::min_int8``; a broken one fails with one sentence.
Each model is measured once per test session (per xdist worker), however many
budgets it has. ``snapshot = true`` pins what onnxruntime runs, node by node, in a
JSON file beside the config (``graphscan_snapshots/<model>.json``, written by syrupy's
JSON extension when syrupy is installed, by json otherwise, the same text): a changed
class is a failure that lists the nodes that changed, and ``--snapshot-update``
(syrupy's flag when syrupy is installed) or ``--graphscan-snapshot-update`` rewrites it.

The ``graphscan`` fixture runs the commands in-process for hand-written tests,
answers cached per test session by the models' file contents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CONFIG_NAME = "graphscan.toml"
SNAPSHOT_FOLDER = "graphscan_snapshots"

# key: (types it may have, what it is); paths are relative to the config's folder.
KEYS: dict[str, tuple[tuple[type, ...], str]] = {
    "path": ((str,), "the quantized model"),
    "float": ((str,), "the float model, for min_sqnr and min_metric"),
    "inputs": ((str, list), "samples: .npz files or folders of them"),
    "shape": ((list,), "shapes of generated inputs, NAME=D0,D1,..."),
    "seed": ((int,), "seed of generated inputs"),
    "level": ((str,), "onnxruntime optimization level of min_sqnr and min_metric"),
    "max_float": ((int,), "at most N float compute nodes"),
    "max_islands": ((int,), "at most N float islands"),
    "max_crossings": ((int,), "at most N boundary crossings"),
    "min_int8": ((int, float), "at least this fraction of kernels int8"),
    "min_sqnr": ((int, float), "output SQNR against float of at least DB"),
    "min_levels": ((int, float), "every quantized tensor's worst part spans at least N steps of its scale"),
    "metric": ((str,), "a built-in metric or FILE.py:FUNCTION"),
    "threshold": ((int, float), "iou's threshold"),
    "blank": ((int,), "ctc's blank class"),
    "min_metric": ((int, float), "the metric's agreement with float of at least X"),
    "snapshot": ((bool,), "pin the runtime class of every node"),
}
COUNTED = {"max_float": "float compute nodes", "max_islands": "float islands", "max_crossings": "boundary crossings"}
BUDGET_KEYS = ["max_float", "max_islands", "max_crossings", "min_int8", "min_sqnr", "min_levels", "min_metric"]
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


def config_path(config: pytest.Config) -> Path:
    given = config.getoption("graphscan_config")
    return Path(given).resolve() if given else Path(config.rootpath, CONFIG_NAME).resolve()


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("graphscan"):
        return
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


# ---------------------------------------------------------------------------
# The config: checked before anything runs; every error names file, line and key.


class ConfigError(Exception):
    """A bad graphscan.toml: one collection error naming the file, line and key."""


@dataclasses.dataclass(frozen=True)
class Gate:
    """One ``[[model]]`` of the config, its paths resolved."""

    index: int
    name: str  # the model's id part: its file name, or its path when two share a name
    settings: dict[str, Any]

    @property
    def budgets(self) -> list[str]:
        return [key for key in BUDGET_KEYS if key in self.settings]


def key_line(text: str, index: int, key: str | None) -> int:
    """The line of ``key`` in the ``index``-th ``[[model]]`` table (its header without a key)."""
    lines = text.splitlines()
    headers = [k for k, line in enumerate(lines) if re.match(r"\s*\[\[\s*model\s*\]\]", line)]
    if index >= len(headers):
        return 1
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

    text = path.read_text(encoding="utf-8")
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
    return [
        dataclasses.replace(g, name=n if names.count(n) == 1 else os.path.relpath(g.settings["path"], path.parent))
        for g, n in zip(gates, names, strict=True)
    ]


def checked_gate(path: Path, text: str, index: int, entry: dict[str, Any]) -> Gate:
    def fail(key: str | None, why: str) -> ConfigError:
        return ConfigError(f"{path}:{key_line(text, index, key)}: [[model]] {index + 1}: {why}")

    for key, value in entry.items():
        if key not in KEYS:
            raise fail(key, f"unknown key {key!r} (known: {', '.join(KEYS)})")
        types, what = KEYS[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise fail(key, f"{key} must be {' or '.join(t.__name__ for t in types)} ({what}), not {value!r}")
    if "path" not in entry:
        raise fail(None, "needs path = the quantized model")
    settings = dict(entry)
    for key in PATH_KEYS:
        if key in settings:
            settings[key] = str((path.parent / settings[key]).resolve())
            if not os.path.isfile(settings[key]):
                raise fail(key, f"{key}: no such file {entry[key]!r}")
    if "inputs" in settings:
        given = settings["inputs"] if isinstance(settings["inputs"], list) else [settings["inputs"]]
        resolved = []
        for item in given:
            if not isinstance(item, str):
                raise fail("inputs", f"inputs must be paths, not {item!r}")
            full = str((path.parent / item).resolve())
            if not os.path.exists(full):
                raise fail("inputs", f"inputs: no such file or folder {item!r}")
            resolved.append(full)
        settings["inputs"] = resolved
    core = graphscan_core()
    for key in BUDGET_KEYS:
        if key in settings:
            try:
                core.budget_limit(key, settings[key], key)
            except core.GraphscanError as exc:
                raise fail(key, str(exc).removeprefix("usage: ")) from None
    if not any(key in settings for key in [*BUDGET_KEYS, "snapshot"]):
        raise fail(None, f"no budget (one of {', '.join(BUDGET_KEYS)}) and no snapshot")
    for key in ("min_sqnr", "min_levels", "min_metric"):
        if key in settings and "float" not in settings:
            raise fail(key, f"{key} needs float = the float model")
    if "min_metric" in settings and "metric" not in settings:
        raise fail("min_metric", "min_metric needs metric = NAME or FILE.py:FUNCTION")
    return Gate(index, Path(settings["path"]).name, settings)


# ---------------------------------------------------------------------------
# Collection: the config file, one collector per model, one item per budget.


class GateFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item | pytest.Collector]:
        try:
            gates = read_config(self.path)
        except ConfigError as exc:
            raise self.CollectError(str(exc)) from None
        for gate in gates:
            yield ModelGates.from_parent(self, name=gate.name, gate=gate)


class ModelGates(pytest.Collector):
    def __init__(self, *, gate: Gate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate

    def collect(self) -> Iterator[pytest.Item]:
        for budget in self.gate.budgets:
            yield BudgetItem.from_parent(self, name=budget, gate=self.gate, budget=budget)
        if self.gate.settings.get("snapshot"):
            yield SnapshotItem.from_parent(self, name="snapshot", gate=self.gate)


class GateFailed(Exception):
    """A gate broken: its sentence is the whole report."""


class GateItem(pytest.Item):
    def __init__(self, *, gate: Gate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, GateFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)  # a bug of the plugin: its traceback

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"{self.gate.name}::{self.name}"


class BudgetItem(GateItem):
    def __init__(self, *, budget: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.budget = budget

    def runtest(self) -> None:
        answer = measured(self.config, self.gate)
        (row,) = [b for b in answer["budgets"] if b["name"] == self.budget]
        if not row["ok"]:
            raise GateFailed(budget_sentence(row, self.config, self.gate))


class SnapshotItem(GateItem):
    def runtest(self) -> None:
        compare_snapshot(self.config, self.gate)


# ---------------------------------------------------------------------------
# Measuring: each model once per session, by graphscan's own check and runtime.


def session_cache(config: pytest.Config) -> dict[Any, Any]:
    cache = getattr(config, "_graphscan_cache", None)
    if cache is None:
        cache = {}
        config._graphscan_cache = cache  # type: ignore[attr-defined]
    return cache


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


def measured(config: pytest.Config, gate: Gate) -> dict[str, Any]:
    """graphscan check's answer for every budget of ``gate``, measured once per session."""
    cache = session_cache(config)
    key = ("check", gate.index)
    if key not in cache:
        core = graphscan_core()
        s = gate.settings
        options = {name: s[name] for name in gate.budgets}
        for name in ("shape", "seed", "level", "metric", "threshold", "blank"):
            if name in s:
                options[name] = s[name]
        if "inputs" in s:
            options["inputs"] = s["inputs"]
        cache[key] = in_process(lambda: core.check(s["path"], float_path=s.get("float"), **options))
    answer: dict[str, Any] = cache[key]
    return answer


def runtime_answer(config: pytest.Config, gate: Gate) -> dict[str, Any]:
    cache = session_cache(config)
    key = ("runtime", gate.index)
    if key not in cache:
        core = graphscan_core()
        cache[key] = in_process(lambda: core.runtime(gate.settings["path"]))
    answer: dict[str, Any] = cache[key]
    return answer


def budget_sentence(row: dict[str, Any], config: pytest.Config, gate: Gate) -> str:
    """``min_int8: 0.18 < 0.8 (51 of 292 compute nodes run int8 kernels)``."""
    name, value, limit = row["name"], row["value"], row["limit"]
    sign = ">" if name.startswith("max_") else "<"
    shown = "undefined" if value is None else f"{value:.4g}"
    sentence = f"{name}: {shown} {sign} {limit:g}"
    if name == "min_int8":
        classes = runtime_answer(config, gate)["classes"]
        integer = classes["int8"] + classes["int8_data"]
        sentence += f" ({integer} of {integer + classes['float']} nodes that run a kernel run int8 kernels)"
    elif name == "min_metric":
        words = graphscan_core().metric_words(row.get("metric", {}))
        sentence += f" ({', '.join(words)} against {Path(gate.settings['float']).name})"
    elif name == "min_sqnr":
        part = row.get("worst_part") or {}
        where = f", worst part {part['part']} of {part['output']} from {part['node']}" if part else ""
        sentence += f" (dB, against {Path(gate.settings['float']).name}{where})"
    elif name == "min_levels":
        part = row.get("part") or {}
        where = f" at {row['tensor']}, part {part['part']} from {part['node']}" if part else ""
        sentence += f" (steps of the scale{where})"
    else:
        sentence += f" ({COUNTED[name]})"
    return sentence + (" (undefined never holds)" if value is None else "")


# ---------------------------------------------------------------------------
# Snapshots of what runs, node by node.


def snapshot_file(config: pytest.Config, gate: Gate) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", gate.name)
    return config_path(config).parent / SNAPSHOT_FOLDER / f"{safe}.json"


def runtime_snapshot(answer: dict[str, Any]) -> dict[str, Any]:
    """What a snapshot pins: onnxruntime's version and provider, the level, and each node's
    class and reason code (sorted keys: stable across runs and machines)."""
    environment = answer["environment"]
    return {
        "onnxruntime": environment["onnxruntime"],
        "provider": environment["provider"],
        "level": environment["level"],
        "nodes": {
            row["node"]: {"class": row["class"], "reason": row["reason"]["code"] if row["reason"] else None}
            for row in answer["nodes"]
        },
    }


def snapshot_text(snapshot: dict[str, Any]) -> str:
    """The snapshot file's text: syrupy's JSON extension when syrupy is installed (the format
    its users review), else the same JSON (sorted keys, two-space indent) from json itself."""
    try:
        from syrupy.extensions.json import JSONSnapshotExtension
    except ImportError:
        return json.dumps(snapshot, indent=2, sort_keys=True) + "\n"
    return str(JSONSnapshotExtension().serialize(snapshot)).rstrip("\n") + "\n"


def updating(config: pytest.Config) -> bool:
    return bool(config.getoption("graphscan_snapshot_update") or config.getoption("update_snapshots", False))


def compare_snapshot(config: pytest.Config, gate: Gate) -> None:
    now = runtime_snapshot(runtime_answer(config, gate))
    path = snapshot_file(config, gate)
    if not updating(config) and not path.is_file():
        raise GateFailed(f"snapshot: no {path}: take it with pytest --graphscan --snapshot-update, review, commit")
    if updating(config):
        path.parent.mkdir(exist_ok=True)
        temporary = path.with_suffix(".json.tmp")
        temporary.write_text(snapshot_text(now), encoding="utf-8")
        os.replace(temporary, path)
        return
    try:
        pinned = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise GateFailed(f"snapshot: {path} is not JSON ({exc}); rewrite it with --snapshot-update") from None
    verdict = snapshot_verdict(pinned, now, path.name)
    if verdict is not None:
        raise GateFailed(verdict)


def snapshot_verdict(pinned: dict[str, Any], now: dict[str, Any], name: str) -> str | None:
    """Why the snapshot ``pinned`` (file ``name``) no longer holds for ``now``; None when it holds."""
    for key in ("onnxruntime", "provider", "level"):
        if pinned.get(key) != now[key]:
            return (
                f"snapshot: taken with {key} {pinned.get(key)}, this session has {now[key]}: "
                "classes are only comparable on one onnxruntime version and provider; "
                "review with --snapshot-update"
            )
    changes = snapshot_changes(pinned.get("nodes", {}), now["nodes"])
    if not changes:
        return None
    shown = "\n".join(changes[:50]) + (f"\n  ... and {len(changes) - 50} more" if len(changes) > 50 else "")
    return f"snapshot: {len(changes)} node(s) changed what they run ({name}; accept with --snapshot-update)\n" + shown


def snapshot_changes(pinned: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per node whose class or reason changed, appeared or disappeared."""

    def shown(entry: dict[str, Any] | None) -> str:
        if entry is None:
            return "(absent)"
        return entry["class"] + (f" ({entry['reason']})" if entry.get("reason") else "")

    lines = []
    for node in sorted(set(pinned) | set(now)):
        before, after = pinned.get(node), now.get(node)
        if before != after:
            lines.append(f"  {node}: {shown(before)} -> {shown(after)}")
    return lines


# ---------------------------------------------------------------------------
# The fixture: graphscan's commands in-process, cached by file contents.


def file_key(value: Any) -> Any:
    """A hashable key for an argument: a path's file contents, a list's items."""
    if isinstance(value, (list, tuple)):
        return tuple(file_key(v) for v in value)
    if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
        digest = hashlib.sha256()
        with open(value, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return ("file", digest.hexdigest())
    if isinstance(value, float) and math.isnan(value):
        return ("nan",)
    return value


class Graphscan:
    """graphscan's commands as methods (``graphscan.runtime(path)``,
    ``graphscan.check(path, float=..., inputs=..., min_int8=...)``), answers cached for the
    test session by the contents of the files they read. A bad input raises
    ``graphscan.GraphscanError`` with its one line and exit code."""

    COMMANDS = ("nodes", "qdq", "islands", "boundary", "diff", "runtime", "check", "trace", "impact")

    def __init__(self, cache: dict[Any, Any]) -> None:
        self._cache = cache

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in self.COMMANDS:
            raise AttributeError(name)

        def command(*paths: Any, **options: Any) -> Any:
            if name == "check" and "float" in options:
                options["float_path"] = options.pop("float")
            key = (name, file_key(paths), tuple(sorted((k, file_key(v)) for k, v in options.items())))
            if key not in self._cache:
                self._cache[key] = getattr(graphscan_core(), name)(*map(str, paths), **options)
            return self._cache[key]

        command.__name__ = name
        return command


@pytest.fixture(scope="session")
def graphscan(request: pytest.FixtureRequest) -> Graphscan:
    """graphscan's commands in this process, answers cached per session by file content."""
    return Graphscan(session_cache(request.config))
