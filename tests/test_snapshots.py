"""Pinned answers of all five commands on the canonical lab models.

The snapshots under __snapshots__/ are what a reviewer reads: a change in
graphscan's counting or in onnxruntime's quantizer shows up as a JSON diff.
Update serially and read the diff: pytest --snapshot-update -p no:xdist
"""

import pytest
from syrupy.extensions.json import JSONSnapshotExtension

import graphscan
from conftest import CANONICAL, VARIANTS

SINGLE_MODEL_COMMANDS = ["nodes", "qdq", "islands", "boundary"]


@pytest.fixture
def snapshot_json(snapshot):
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.fixture(scope="module")
def canonical(build_case):
    """The lab's default models (gen_models.py defaults), built once."""
    return build_case(CANONICAL)


def with_file_names(answer, paths):
    """Replace tmp paths echoed in ``model``/``a``/``b`` by the file names."""
    names = {str(path): path.name for path in paths.values()}
    return {
        key: names.get(value, value) if key in ("model", "a", "b") else value
        for key, value in answer.items()
    }


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("command", SINGLE_MODEL_COMMANDS)
def test_command_snapshot(canonical, snapshot_json, command, variant):
    answer = getattr(graphscan, command)(str(canonical[variant]))
    assert with_file_names(answer, canonical) == snapshot_json


@pytest.mark.parametrize("b", ["matmul_only", "excluded", "dynamic"])
def test_diff_snapshot(canonical, snapshot_json, b):
    answer = graphscan.diff(str(canonical["full"]), str(canonical[b]))
    assert with_file_names(answer, canonical) == snapshot_json
