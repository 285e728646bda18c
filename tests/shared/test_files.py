"""Writing outputs (graphscan_ort/shared/files.py): an output is the old file or all of the
new one, with the mode it had; a failed write leaves nothing of its own; tune's --out is
refused before any work unless it is absent or an empty folder."""

import errno
import os
import stat

import pytest

import graphscan
from graphscan_ort.shared import files


def leftovers(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith(files.TEMPORARY_PREFIX))


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
def test_a_file_written_over_keeps_its_own_mode(tmp_path, mode):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    target.chmod(mode)
    files.write_atomically(b"new", str(target))
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == mode
    assert leftovers(tmp_path) == []


def test_a_write_that_fails_keeps_the_old_file_and_leaves_no_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(graphscan.GraphscanError) as raised:
        files.write_atomically(b"new", str(target))
    assert raised.value.exit_code == graphscan.EXIT_NO_FILE and "No space left" in str(raised.value)
    assert target.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_out_must_be_absent_or_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.onnx").write_bytes(b"someone's model")
    (tmp_path / "file").write_bytes(b"")
    assert files.check_out(str(tmp_path / "absent")) == str(tmp_path)
    assert files.check_out(str(tmp_path / "empty")) == str(tmp_path)
    for occupied in ("full", "file"):
        with pytest.raises(graphscan.GraphscanError) as raised:
            files.check_out(str(tmp_path / occupied))
        assert raised.value.exit_code == graphscan.EXIT_NO_FILE and "left untouched" in str(raised.value)
    assert (tmp_path / "full" / "model.onnx").read_bytes() == b"someone's model"
