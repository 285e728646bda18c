"""onnxruntime sessions' surroundings (graphscan_ort/shared/sessions.py): the temporary
folder is removed whatever happens in it, and onnxruntime failing to write there is the
file system's exit 3, never a model blamed with exit 5."""

import os

import pytest

import graphscan
from graphscan_ort.shared import sessions


def failing_inside(message):
    """``(folder, error)``: a file written into a temporary folder, then a failure of
    onnxruntime (exit 5) whose text is ``message(folder)``."""
    used = []

    def work():
        with sessions.temporary_folder("graphscan-test-") as folder:
            used.append(folder)
            open(os.path.join(folder, "profile.json"), "w").close()
            raise graphscan.GraphscanError(message(folder), graphscan.EXIT_RUNTIME)

    with pytest.raises(graphscan.GraphscanError) as raised:
        work()
    return used[0], raised.value


def test_the_temporary_folder_is_removed_after_success_and_after_a_failure():
    with sessions.temporary_folder("graphscan-test-") as folder:
        open(os.path.join(folder, "profile.json"), "w").close()
    assert not os.path.exists(folder)
    failed, _ = failing_inside(lambda folder: "m.onnx: model does not run in onnxruntime (bad)")
    assert not os.path.exists(failed)


def test_onnxruntime_failing_to_write_into_the_temporary_folder_is_exit_3():
    _, error = failing_inside(lambda folder: f"m.onnx: model does not run in onnxruntime ({folder}/p.json: failed)")
    assert error.exit_code == graphscan.EXIT_NO_FILE
    assert "cannot write into the temporary folder" in str(error) and "TMPDIR" in str(error)
    # A failure that does not name the folder is the model's, and stays exit 5.
    _, error = failing_inside(lambda folder: "m.onnx: model does not run in onnxruntime (bad)")
    assert error.exit_code == graphscan.EXIT_RUNTIME
