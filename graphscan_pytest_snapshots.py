"""The runtime snapshots of graphscan's pytest plugin (graphscan_pytest.py): each file's name,
what it pins, how it is written, why a pinned one no longer holds, which files each config
wrote (the folder's record), and which of those no item pins. Plain functions of paths and
answers, standard library only (the plugin imports this module at start-up): the plugin holds
the session and the items.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

SNAPSHOT_FOLDER = "graphscan_snapshots"
# In SNAPSHOT_FOLDER, {config file name: [the snapshot files it wrote]}; never a snapshot's name.
RECORD = "written.json"

UPDATE = "pytest --graphscan --graphscan-snapshot-update"  # works with or without syrupy


# ---------------------------------------------------------------------------
# Names: one file per model and CPU target.


PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


def snapshot_names(models: list[tuple[str, str]], folder: Path) -> list[str]:
    """Each model's snapshot file name (without ``.json``), given ``(name, path)`` per table,
    never one for two models: its name where that is PLAIN_NAME, no other model's name equals
    it regardless of case and it is not the record's (committed snapshots keep their names),
    else that name squeezed, ``~`` and a hash of the model's path from ``folder``. One path
    (``..`` resolved, links not followed), one name."""
    where = [Path(os.path.relpath(path, folder)).as_posix() for _, path in models]
    paths_of: dict[str, set[str]] = {}
    for (name, _), relative in zip(models, where, strict=True):
        paths_of.setdefault(name.casefold(), set()).add(relative)
    names = []
    for (name, _), relative in zip(models, where, strict=True):
        alone = len(paths_of[name.casefold()]) == 1 and f"{name}.json".casefold() != RECORD.casefold()
        if PLAIN_NAME.fullmatch(name) and alone:
            names.append(name)
        else:
            digest = hashlib.sha256(relative.encode("utf-8", "surrogatepass")).hexdigest()[:16]
            names.append(f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)[:100]}~{digest}")
    return names


# The names snapshot_file gives: NAME (plain, or squeezed ~ hash) and @TARGET; nothing else is touched.
SNAPSHOT_FILE = re.compile(r"(?:[A-Za-z0-9._-]{1,200}|[A-Za-z0-9._-]{0,100}~[0-9a-f]{16})(?:@[a-z0-9-]+)?\.json")


# ---------------------------------------------------------------------------
# What a snapshot pins, written whole.


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


def write_atomically(path: Path, text: str) -> None:
    """``text`` as the file ``path``, through a temporary file of this writer's own renamed
    into place: another writer (an xdist worker) or a reader sees a whole file, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would keep the file from its readers
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


# ---------------------------------------------------------------------------
# Whether a pinned snapshot still holds.


def snapshot_damage(pinned: Any) -> str | None:
    """What is wrong with ``pinned``, read from a snapshot file, as a snapshot; None when nothing is."""
    if not isinstance(pinned, dict):
        return f"{json_kind(pinned)}, not an object"
    if set(pinned) != {"onnxruntime", "provider", "level", "nodes"}:
        return f"keys {sorted(pinned)}, not onnxruntime, provider, level and nodes"
    if not isinstance(pinned["nodes"], dict):
        return f"nodes is {json_kind(pinned['nodes'])}, not an object"
    for node, entry in pinned["nodes"].items():
        if not isinstance(entry, dict) or set(entry) != {"class", "reason"}:
            return f"node {node!r} is {json.dumps(entry)[:80]}, not {{class, reason}}"
        if not all(value is None or isinstance(value, str) for value in entry.values()):
            return f"node {node!r} has a class or reason that is neither a string nor null"
    return None


def json_kind(value: Any) -> str:
    """``an array``, ``null``...: what a value read by json is, in JSON's words."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    kinds = {list: "an array", str: "a string", int: "a number", float: "a number"}
    return next((kind for t, kind in kinds.items() if isinstance(value, t)), "an object")


def snapshot_verdict(pinned: Any, now: dict[str, Any], name: str) -> str | None:
    """Why the snapshot ``pinned`` (file ``name``) no longer holds for ``now``; None when it holds."""
    damage = snapshot_damage(pinned)
    if damage is not None:
        return f"snapshot: {name} is damaged ({damage}); retake it with {UPDATE}, review, commit"
    for key in ("onnxruntime", "provider", "level"):
        if pinned[key] != now[key]:
            return (
                f"snapshot: taken with {key} {pinned[key]}, this session has {now[key]}: "
                "classes are only comparable on one onnxruntime version and provider; "
                f"review with {UPDATE}"
            )
    changes = snapshot_changes(pinned["nodes"], now["nodes"])
    if not changes:
        return None
    shown = "\n".join(changes[:50]) + (f"\n  ... and {len(changes) - 50} more" if len(changes) > 50 else "")
    return f"snapshot: {len(changes)} node(s) changed what they run ({name}; accept with {UPDATE})\n" + shown


def snapshot_changes(pinned: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per node whose class or reason changed, appeared or disappeared."""

    def shown(entry: dict[str, Any] | None) -> str:
        if entry is None:
            return "(absent)"
        kind = "null" if entry["class"] is None else entry["class"]  # runtime's class of an unmapped node
        return kind + (f" ({entry['reason']})" if entry.get("reason") else "")

    lines = []
    for node in sorted(set(pinned) | set(now)):
        before, after = pinned.get(node), now.get(node)
        if before != after:
            lines.append(f"  {node}: {shown(before)} -> {shown(after)}")
    return lines


# ---------------------------------------------------------------------------
# The record of what each config wrote, and which of those files no item pins. Only a
# config's own snapshots are ever named unused or deleted: another config of the folder
# keeps its own, and a file the plugin did not write is the user's.


def read_record(folder: Path) -> dict[str, list[str]]:
    """The folder's record; empty when it is missing or damaged (then no file is known to
    be a config's, and none is named or deleted)."""
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {
        config: [name for name in names if isinstance(name, str)]
        for config, names in record.items()
        if isinstance(names, list)
    }


def record_text(record: dict[str, list[str]]) -> str:
    """The record file's text: configs and their files sorted, a config without files left out."""
    kept = {config: sorted(set(names)) for config, names in record.items() if names}
    return json.dumps(kept, indent=2, sort_keys=True) + "\n"


def unused_snapshots(folder: Path, written: set[str], kept: set[str]) -> list[Path]:
    """The files of ``folder`` among ``written`` (what a config wrote, named as snapshots are)
    that are none of the ``kept`` files (those it pins, and those another config wrote) nor
    the record. A case-blind disk shows a kept file under a name that differs in case: it is
    the same file, kept."""

    def identity(name: str) -> tuple[int, int] | None:
        try:
            found = os.stat(folder / name)
        except OSError:
            return None
        return (found.st_dev, found.st_ino) if stat.S_ISREG(found.st_mode) else None

    held = {identity(name) for name in kept | {RECORD}}
    candidates = sorted(name for name in written if SNAPSHOT_FILE.fullmatch(name) and name not in kept)
    return [folder / name for name in candidates if identity(name) not in held | {None}]
