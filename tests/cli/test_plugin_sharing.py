"""What the plugin's tables and configs share (graphscan_pytest.py): one model named by two
tables of a config, and one snapshot folder beside two configs.

Two tables of one model are two sets of items, each named by its table's number. Two
configs in one folder, and the user's own files there, keep their files through either
config's ``--graphscan-snapshot-update``: only what a config wrote (the folder's record,
``graphscan_snapshots/written.json``) is ever named unused or deleted, and a file another
config wrote is that config's to delete.
"""

import json
import os

import onnx
import pytest
from onnx import TensorProto, helper

import graphscan_pytest
from tests.cli.test_plugin import RECORD, UPDATE, snapshot_gates, snapshots_taken, unused_lines, updating_session
from tests.helpers import item_outcomes


def relu(path):
    """A model of one float Relu: one float compute node, one node that onnxruntime runs."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def tables(*models, budget="snapshot = true"):
    """A config of one ``[[model]]`` table per model path, each with ``budget``."""
    return "\n".join(f'[[model]]\npath = "{model}"\n{budget}\n' for model in models)


def test_two_tables_of_one_model_are_two_items_each_named_by_its_tables_number(tmp_path, run_pytest):
    """One model in tables 1 and 2, one budget holding and the other broken: two ids, each
    passing or failing on its own, each deselected or chosen alone; a model in one table
    keeps its plain id."""
    relu(tmp_path / "m.onnx")
    relu(tmp_path / "other.onnx")
    holds, breaks = "max_float = 1", "max_float = 0"  # one float compute node: the Relu
    config = [tables("m.onnx", budget=holds), tables("m.onnx", budget=breaks), tables("other.onnx", budget=holds)]
    (tmp_path / "graphscan.toml").write_text("\n".join(config))
    first, second = "graphscan.toml::m.onnx:1::max_float", "graphscan.toml::m.onnx:2::max_float"
    other = "graphscan.toml::other.onnx::max_float"
    code, output = run_pytest(tmp_path, "--graphscan", "-rA")
    assert item_outcomes(output) == {first: "passed", second: "failed", other: "passed"}, output
    assert code == 1 and "max_float: 1 > 0" in output
    code, output = run_pytest(tmp_path, "--graphscan", "-rA", "--deselect", second)
    assert code == 0 and item_outcomes(output) == {first: "passed", other: "passed"}, output
    code, output = run_pytest(tmp_path, "--graphscan", "-rA", second)
    assert code == 1 and item_outcomes(output) == {second: "failed"}, output


def record(folder):
    return json.loads((folder / "graphscan_snapshots" / RECORD).read_text())


def test_an_update_deletes_only_the_snapshots_its_own_config_wrote(tmp_path, run_pytest):
    """a.toml and b.toml beside each other, each pinning its own model and both a shared one,
    and the user's files in graphscan_snapshots/: updating either config, or running it,
    names and deletes none of the other's snapshots nor the user's files. A snapshot one
    config no longer pins stays while the other still wrote it, and goes with the update of
    the last config that wrote it."""
    for model in ("a.onnx", "b.onnx", "shared.onnx"):
        relu(tmp_path / model)
    snapshots = tmp_path / "graphscan_snapshots"
    snapshots.mkdir()
    user_files = {"labels.json": '{"cat": 0}\n', "old.onnx.json": "{}\n", "notes.txt": "mine\n"}
    for name, text in user_files.items():
        (snapshots / name).write_text(text)

    def run(config, *args):
        code, output = run_pytest(tmp_path, "--graphscan", "--graphscan-config", config, "-rA", *args)
        assert code == 0 and set(item_outcomes(output).values()) == {"passed"}, output
        return unused_lines(output)

    for config, own in (("a.toml", "a.onnx"), ("b.toml", "b.onnx")):
        (tmp_path / config).write_text(tables(own, "shared.onnx"))
        assert run(config, "--graphscan-snapshot-update") == []
    everything = sorted([*user_files, "a.onnx.json", "b.onnx.json", "shared.onnx.json"])
    assert snapshots_taken(tmp_path) == everything
    assert record(tmp_path) == {
        "a.toml": ["a.onnx.json", "shared.onnx.json"],
        "b.toml": ["b.onnx.json", "shared.onnx.json"],
    }
    assert run("a.toml") == run("b.toml") == []
    (tmp_path / "a.toml").write_text(tables("a.onnx"))
    assert run("a.toml") == run("a.toml", "--graphscan-snapshot-update") == []  # b.toml wrote it too: b's
    assert snapshots_taken(tmp_path) == everything and record(tmp_path)["a.toml"] == ["a.onnx.json"]
    (tmp_path / "b.toml").write_text(tables("b.onnx"))
    pinned_by = "pinned by no item of b.toml"
    named = (
        f"graphscan: unused snapshot(s), {pinned_by}: graphscan_snapshots/shared.onnx.json (delete them with {UPDATE})"
    )
    assert run("b.toml") == [named]
    deleted = f"graphscan: deleted unused snapshot(s), {pinned_by}: graphscan_snapshots/shared.onnx.json"
    assert run("b.toml", "--graphscan-snapshot-update") == [deleted]
    assert snapshots_taken(tmp_path) == sorted([*user_files, "a.onnx.json", "b.onnx.json"])
    assert record(tmp_path) == {"a.toml": ["a.onnx.json"], "b.toml": ["b.onnx.json"]}
    assert [(snapshots / name).read_text() for name in user_files] == list(user_files.values())


@pytest.mark.parametrize("name", ["written", "WRITTEN"])
def test_no_model_takes_the_records_name(tmp_path, name):
    """A model file named ``written`` would pin ``written.json``, the record (in any case, on
    a case-blind disk): its snapshot name is hashed as a clash is; other names keep theirs."""
    taken, other = snapshot_gates(tmp_path, [name, "written.onnx"])
    assert taken.casefold() != RECORD.casefold() and taken.startswith(f"{name}~")
    assert other == "written.onnx.json"


def test_a_record_that_cannot_be_written_is_one_line_and_the_snapshots_stay(tmp_path, monkeypatch):
    """A full disk when the update records what it wrote: one summary line naming the record
    and why, no traceback, and the snapshot just written kept."""
    import errno

    _, config = updating_session(tmp_path, {"a": "int8"})
    state = graphscan_pytest.session_state(config)
    state.declared = state.ran = {"graphscan.toml::m.onnx::snapshot"}
    state.pinned = state.written = {"m.onnx.json"}
    (tmp_path / "graphscan_snapshots").mkdir()
    (tmp_path / "graphscan_snapshots" / "m.onnx.json").write_text("{}")

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(graphscan_pytest, "write_atomically", full)
    assert graphscan_pytest.unused_report(config, state) == [
        f"graphscan: cannot write the snapshot record graphscan_snapshots/{RECORD} ({os.strerror(errno.ENOSPC)})"
    ]
    assert snapshots_taken(tmp_path) == ["m.onnx.json"]
