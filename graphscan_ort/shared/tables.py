"""What the tables of the commands that run models share (the core renders the rest)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def input_fields(
    inputs: Mapping[str, list[int] | list[list[int]]], defaulted: list[str] | None = None
) -> list[tuple[str, str]]:
    """``inputs`` of a trace/impact answer as header pairs: the shapes, then the
    inputs whose symbolic dimensions were set to 1 because nothing said otherwise."""
    pairs = [(f"input {name}", "x".join(map(str, shape))) for name, shape in inputs.items()]
    if defaulted:
        pairs.append(("defaulted to 1", ", ".join(defaulted)))
    return pairs


def largest_first(rows: Iterable[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows with a value for ``key``, largest first (ties keep their order)."""
    return sorted((r for r in rows if r.get(key) is not None), key=lambda r: -r[key])


def smallest_first(rows: Iterable[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows with a value for ``key``, smallest first (ties keep their order)."""
    return sorted((r for r in rows if r.get(key) is not None), key=lambda r: r[key])


# Without --top, a table leads with this many rows of each red-flag ranking.
RED_FLAGS = 5
