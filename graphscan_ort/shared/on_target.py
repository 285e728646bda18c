"""Arrays to and from a CPU target (targets.py): the samples saved to an .npz the target's
interpreter reads, the outputs saved by it to another."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def save_samples(folder: str, samples: list[dict]) -> tuple[str, list[list[str]]]:
    """``samples`` in an .npz in ``folder`` (keys by position: input names need not be file
    names) and each sample's input names."""
    file = os.path.join(folder, "samples.npz")
    np.savez(
        file, **{f"s{i}_{j}": value for i, sample in enumerate(samples) for j, value in enumerate(sample.values())}
    )
    return file, [list(sample) for sample in samples]


def load_samples(file: str, names: list[list[str]]) -> list[dict]:
    with np.load(file) as saved:
        return [{name: saved[f"s{i}_{j}"] for j, name in enumerate(sample)} for i, sample in enumerate(names)]


def keyed_outputs(prefix: str, outputs: list) -> dict[str, Any]:
    """Per sample ``i``, output ``j``: ``{prefix}{i}_{j}``, the keys ``read_outputs`` reads back."""
    return {f"{prefix}{i}_{j}": value for i, row in enumerate(outputs) for j, value in enumerate(row)}


def read_outputs(saved: Any, prefix: str, count: int, outputs: int) -> list[list[np.ndarray]]:
    """``count`` samples' ``outputs`` outputs saved under ``prefix`` (``keyed_outputs``) in the
    opened .npz ``saved``."""
    return [[saved[f"{prefix}{i}_{j}"] for j in range(outputs)] for i in range(count)]
