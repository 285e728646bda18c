"""targets.Worker: one interpreter kept for many calls (tune --cpu's candidates), here with
this very interpreter standing in for an emulated one (the protocol is the same; the
targets' own runs are the ``targets`` tests)."""

import os
import signal
import sys
import time

import pytest

import graphscan
from graphscan_ort.shared import targets


@pytest.fixture
def worker(monkeypatch):
    """A Worker for x86-avx2 whose interpreter is this Python, without qemu."""

    def command(target, argv):
        env = {**os.environ, "PYTHONPATH": str(targets.repository())}
        return [sys.executable, *argv], env

    monkeypatch.setattr(targets, "require", lambda target: None)
    monkeypatch.setattr(targets, "command", command)
    with targets.Worker(targets.X86_AVX2) as started:
        yield started


def test_one_interpreter_answers_every_call_and_what_it_prints_is_not_its_answer(worker):
    first = worker.run("graphscan_ort.shared.targets:native_facts")
    process = worker.process
    assert first["cpu"]["name"] == "x86-avx2" and first["result"]["name"] == "native"
    assert worker.run("builtins:print", ["noise on stdout"])["result"] is None
    assert worker.run("math:hypot", [3, 4])["result"] == 5.0
    assert worker.process is process and process.poll() is None  # the same interpreter throughout
    folder = worker.folder
    assert sorted(os.listdir(folder)) == ["stderr", "tmp"]  # each call's files removed; tmp: the target's TMPDIR
    worker.close()  # ends the interpreter, removes its files
    assert process.poll() is not None and not os.path.exists(folder)


def test_an_error_there_is_raised_here_with_its_exit_code_and_the_worker_goes_on(worker):
    with pytest.raises(graphscan.GraphscanError) as caught:
        worker.run("graphscan_ort.shared.targets:require", ["sparc"])
    assert caught.value.exit_code == graphscan.EXIT_USAGE and "sparc" in str(caught.value)
    assert worker.run("math:hypot", [3, 4])["result"] == 5.0


def test_an_interpreter_that_ends_is_one_line_and_the_next_call_starts_another(worker):
    with pytest.raises(graphscan.GraphscanError) as caught:
        worker.run("os:_exit", [3])
    assert caught.value.exit_code == graphscan.EXIT_RUNTIME
    assert str(caught.value) == "CPU target x86-avx2: its interpreter was stopped (exit 3) without an answer"
    assert worker.run("math:hypot", [3, 4])["result"] == 5.0


def test_a_native_worker_calls_in_this_process():
    with targets.Worker(targets.NATIVE) as native:
        assert native.run("math:hypot", [3, 4])["result"] == 5.0 and native.process is None


def test_a_worker_closed_before_it_is_ready_is_killed_at_once_not_waited_for(monkeypatch):
    """Closed while its interpreter starts (a Ctrl-C during an emulated start, seconds long):
    one that would never stop at the end of its input is not given its 10 s, nor are its files kept."""
    monkeypatch.setattr(targets, "require", lambda target: None)
    monkeypatch.setattr(targets, "command", lambda target, argv: ([sys.executable, "-c", LINGERS], dict(os.environ)))
    worker = targets.Worker(targets.X86_AVX2)
    worker.start()
    process, folder = worker.process, worker.folder
    started = time.monotonic()
    worker.close()
    assert time.monotonic() - started < 3 and process.returncode == -signal.SIGKILL
    assert not os.path.exists(folder)


# An interpreter that never says it is ready and outlives the end of its input.
LINGERS = "import time; time.sleep(60)"


# An interpreter that says it is ready and then neither reads its input nor ends.
READY_THEN_DEAF = "import time; print('ready', flush=True); time.sleep(60)"
# An interpreter that answers every request line with its empty line and writes no answer file.
ANSWERS_WITHOUT_FILES = "import sys; print('ready', flush=True)\nfor line in sys.stdin: print(flush=True)"


def stand_in_worker(monkeypatch, script):
    """A Worker for x86-avx2 whose interpreter runs ``script`` (this Python, no qemu)."""
    monkeypatch.setattr(targets, "require", lambda target: None)
    monkeypatch.setattr(targets, "command", lambda target, argv: ([sys.executable, "-c", script], dict(os.environ)))
    return targets.Worker(targets.X86_AVX2)


def test_an_idle_worker_closed_after_a_signal_is_killed_at_once(monkeypatch):
    """Ready and idle, but a Ctrl-C came: close does not give it LINGER seconds to stop at the
    end of its input (graphscan is unwinding), it kills it at once and removes its files."""
    worker = stand_in_worker(monkeypatch, READY_THEN_DEAF)
    assert worker.start_problem() is None and worker.idle
    process, folder = worker.process, worker.folder
    monkeypatch.setattr(targets, "LINGER", 5)
    monkeypatch.setattr(targets, "INTERRUPTED", [signal.SIGINT])
    started = time.monotonic()
    worker.close()
    assert time.monotonic() - started < 3 and process.returncode == -signal.SIGKILL
    assert not os.path.exists(folder)


def test_an_answer_line_without_an_answer_file_is_exit_5_naming_the_target(monkeypatch):
    """The interpreter says it answered and wrote nothing: no worker to trust again (it is
    ended), one line naming the target, exit 5."""
    worker = stand_in_worker(monkeypatch, ANSWERS_WITHOUT_FILES)
    try:
        with pytest.raises(graphscan.GraphscanError) as caught:
            worker.run("math:hypot", [3, 4])
        assert caught.value.exit_code == graphscan.EXIT_RUNTIME
        assert str(caught.value).startswith("CPU target x86-avx2: its interpreter was ")
        assert worker.process is None
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("code", "stderr", "said"),
    [
        pytest.param(0, "", "its interpreter was stopped (exit 0) at the end", id="exit-0"),
        pytest.param(
            3,
            "first words\n  last words  \n\n",
            "its interpreter was stopped (exit 3) at the end: last words",
            id="last-words",
        ),
        pytest.param(-signal.SIGKILL, "", "its interpreter was killed by SIGKILL at the end", id="signal"),
        pytest.param(-200, "", "its interpreter was killed by signal 200 at the end", id="unknown-signal"),
    ],
)
def test_how_an_interpreter_ended_is_its_exit_code_or_signal_and_its_last_words(code, stderr, said):
    assert targets.stopped(code, stderr, "at the end") == said


def test_a_target_that_runs_another_onnxruntime_is_not_installed(worker, monkeypatch):
    """The trivial call asks the target's interpreter for its onnxruntime: here this very one,
    against pins that say another version: that target does not run this environment's release."""
    import onnxruntime

    assert targets.trivial_call(worker) is None  # the same release: installed
    real = targets.pins()
    monkeypatch.setattr(targets, "pins", lambda: {**real, "onnxruntime": "0.0.1"})
    assert targets.trivial_call(worker) == f"it runs onnxruntime {onnxruntime.__version__}, not 0.0.1"


def test_a_target_out_of_memory_is_exit_5_naming_the_function(worker):
    """A MemoryError in the target's interpreter (a petabyte asked for): the model did not run
    there, exit 5 in one line, and the worker goes on."""
    with pytest.raises(graphscan.GraphscanError) as caught:
        worker.run("builtins:bytearray", [10**15])
    assert caught.value.exit_code == graphscan.EXIT_RUNTIME and str(caught.value) == "builtins:bytearray: out of memory"
    assert worker.run("math:hypot", [3, 4])["result"] == 5.0
