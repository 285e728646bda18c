"""Pinned answers of all five commands on the default lab models.

The snapshots under __snapshots__/ are what a reviewer reads: a change in
graphscan's counting or in onnxruntime's quantizer shows up as a JSON diff.
Update serially and read the diff: pytest --snapshot-update -p no:xdist
"""

from pathlib import Path

import pytest
from syrupy.extensions.json import JSONSnapshotExtension

import graphscan
from tests.helpers import SINGLE_MODEL_COMMANDS
from tests.lab import VARIANTS


@pytest.fixture
def snapshot_json(snapshot):
    return snapshot.use_extension(JSONSnapshotExtension)


def with_file_names(answer, paths):
    """Replace tmp paths echoed in ``model``/``a``/``b`` by the file names."""
    names = {path: Path(path).name for path in paths.values()}
    return {key: names.get(value, value) if key in ("model", "a", "b") else value for key, value in answer.items()}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("command", SINGLE_MODEL_COMMANDS)
def test_command_snapshot(default_lab, snapshot_json, command, variant):
    answer = getattr(graphscan, command)(str(default_lab[variant]))
    assert with_file_names(answer, default_lab) == snapshot_json


@pytest.mark.parametrize("b", ["matmul_only", "excluded", "dynamic"])
def test_diff_snapshot(default_lab, snapshot_json, b):
    answer = graphscan.diff(str(default_lab["full"]), str(default_lab[b]))
    assert with_file_names(answer, default_lab) == snapshot_json
