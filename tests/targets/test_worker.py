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
