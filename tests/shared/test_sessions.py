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


def test_a_one_thread_session_runs_samples_side_by_side_with_the_outputs_of_one_at_a_time(tmp_path, monkeypatch):
    """model_outputs in a one-thread session (a deployed one: tune's accuracy, check's) runs
    two samples at a time in the one session: two runs were in flight together, and every
    output, in the samples' order, is bit for bit what one run after another gives; a sample
    that does not run fails the call as it would alone (exit 5, the model named)."""
    import threading

    import numpy as np

    import gen_models

    monkeypatch.setattr(sessions, "SAMPLE_WORKERS", 2)
    model = gen_models.build_cnn(2, channels=8, size=32, seed=0)
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 3, 32, 32)).astype(np.float32)} for k in range(6)]
    options = sessions.session_options("all", threads=1)
    alone = list(
        sessions.each_sample_outputs(model, samples, "m.onnx", None, sessions.session_options("all", threads=1))
    )
    made, in_flight, most = sessions.open_session, [0], [0]
    lock = threading.Lock()

    class Watched:
        def __init__(self, session):
            self.session = session

        def run(self, names, feeds):
            with lock:
                in_flight[0] += 1
                most[0] = max(most[0], in_flight[0])
            try:
                threading.Event().wait(0.05)  # long enough for the other worker to start its run
                return self.session.run(names, feeds)
            finally:
                with lock:
                    in_flight[0] -= 1

    monkeypatch.setattr(sessions, "open_session", lambda *args: Watched(made(*args)))
    together = sessions.model_outputs(model, samples, "m.onnx", None, options)
    assert most[0] == 2
    assert len(together) == len(alone) == 6
    for got, want in zip(together, alone, strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.tobytes() == b.tobytes() and a.shape == b.shape
    wrong = [*samples[:3], {"x": np.zeros((1, 5, 32, 32), np.float32)}, *samples[3:]]
    with pytest.raises(graphscan.GraphscanError) as raised:
        sessions.model_outputs(model, wrong, "m.onnx", None, options)
    assert raised.value.exit_code == graphscan.EXIT_RUNTIME and "m.onnx: model does not run" in str(raised.value)


def test_sessions_on_the_shared_arena_take_impacts_options_where_it_cannot_be_registered(monkeypatch):
    """The shared arena is registered once per process; where onnxruntime refuses it, the
    sessions are impact's own (no arena, nothing shared) and there is nothing to shrink."""
    monkeypatch.setattr(sessions, "SHARED_ARENA", [])
    tried = []

    def refused(*args):
        tried.append(args)
        raise RuntimeError("no")

    monkeypatch.setattr(sessions.ort, "create_and_register_allocator", refused)
    for _ in range(2):
        options = sessions.shared_arena_options(1)
        assert not options.enable_cpu_mem_arena
        assert options.get_session_config_entry("session.disable_prepacking") == "1"
        with pytest.raises(RuntimeError, match="does not have configuration"):
            options.get_session_config_entry("session.use_env_allocators")
    assert len(tried) == 1 and sessions.SHARED_ARENA == [False]
    monkeypatch.setattr(sessions, "open_session", lambda *args: pytest.fail("a session was opened"))
    sessions.shrink_shared_arena()


def test_the_shared_arena_is_registered_once_and_shrunk_by_a_run_that_asks_it(monkeypatch):
    """Every session on the shared arena reads the process's allocator (with pre-packing
    off, as impact's); shrinking runs a one-node session on it with onnxruntime's shrinkage
    asked for the CPU."""
    sessions.shared_arena_options()  # registered by now, here or by an earlier test
    if sessions.SHARED_ARENA != [True]:
        pytest.skip("this onnxruntime refuses a shared allocator")
    monkeypatch.setattr(
        sessions.ort, "create_and_register_allocator", lambda *args: pytest.fail("registered a second time")
    )
    options = sessions.shared_arena_options(1)
    assert options.enable_cpu_mem_arena and options.intra_op_num_threads == 1
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    assert options.get_session_config_entry("session.disable_prepacking") == "1"
    shrunk = []
    real = sessions.ort.InferenceSession.run

    def run(self, names, feeds, run_options=None):
        shrunk.append(run_options.get_run_config_entry("memory.enable_memory_arena_shrinkage"))
        return real(self, names, feeds, run_options)

    monkeypatch.setattr(sessions.ort.InferenceSession, "run", run)
    sessions.shrink_shared_arena()
    assert shrunk == ["cpu:0"]
