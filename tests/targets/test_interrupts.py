"""tune --cpu interrupted, as a CI runner cancels a job (SIGINT, then SIGTERM 0.3 s later) or
a person presses Ctrl-C twice: graphscan ends at once, and leaves nothing behind: no
temporary folder beside --out or in TMPDIR, no interpreter of the target still running,
nor anything that interpreter started.

The target is x86-avx2 with this interpreter standing in for the emulated one (the worker's
protocol is the same on every target), so no qemu is needed; graphscan runs as its console
script does (``console_main``: its own signal handlers), in a process of its own.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, small_cnn

# graphscan's console script, with x86-avx2 run by STAND_IN in this interpreter (argv[1]:
# STAND_IN's folder of marks; argv[2]: the audit-hook plan, "" for none; then graphscan's argv).
LAUNCH = """
import os, signal, sys
sys.path.insert(0, {root!r})
marks, plan, stand_in = sys.argv[1], sys.argv[2], {stand_in!r}
from graphscan_ort.shared import targets
targets.missing = lambda target: None
targets.command = lambda target, argv: ([sys.executable, "-c", stand_in, marks], dict(os.environ, PYTHONPATH={root!r}))
if plan:  # "SIGINT@open:.graphscan-tune-,SIGTERM@shutil.rmtree": each signal at the first
    # audit event of its name after the one before, whose first argument holds the text after ":"
    steps = [step.partition("@")[::2] for step in plan.split(",")]
    def hook(event, args):
        if steps and event == steps[0][1].partition(":")[0] and steps[0][1].partition(":")[2] in str(args[0]):
            os.kill(os.getpid(), getattr(signal, steps.pop(0)[0]))
    sys.addaudithook(hook)
import graphscan
sys.argv = ["graphscan", *sys.argv[3:]]
graphscan.console_main()
"""

# The target's interpreter: it starts a child of its own (what a process group kill must
# reach), then serves; a candidate's call makes a temporary folder, as runtime's classes
# do, and with HANG in the marks' folder never ends.
STAND_IN = """
import os, subprocess, sys, tempfile, time
marks = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
import graphscan_ort.tune.deployed as deployed
measured = deployed.candidate_on_target
def candidate_on_target(*args, **kwargs):
    tempfile.mkdtemp(prefix="graphscan-runtime-")
    with open(os.path.join(marks, "busy"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    if os.path.exists(os.path.join(marks, "HANG")):
        time.sleep(120)
    return measured(*args, **kwargs)
deployed.candidate_on_target = candidate_on_target
from graphscan_ort.shared import targets
targets.serve()
"""


@pytest.fixture
def tune_cpu(tmp_path):
    """A tune --cpu x86-avx2 run in a process of its own, its TMPDIR a folder of the test's:
    the model and samples, the folders to check, and a function that starts it."""
    fp32, files = small_cnn(tmp_path, 1, 3, seed=5)
    folders = {"tmp": tmp_path / "tmp", "marks": tmp_path / "marks", "parent": tmp_path / "runs"}
    for folder in folders.values():
        folder.mkdir()
    out = folders["parent"] / "out"
    argv = ["tune", fp32, "--calibrate", files[0], "--calibrate", files[1], "--inputs", files[2], "--out", out]
    argv += ["--runs", "1", "--max-trials", "0", "--cpu", "x86-avx2"]
    launch = LAUNCH.format(root=str(ROOT), stand_in=STAND_IN)

    def start(plan=""):
        line = [sys.executable, "-c", launch, str(folders["marks"]), plan, *map(str, argv)]
        env = dict(os.environ, TMPDIR=str(folders["tmp"]))
        return subprocess.Popen(line, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    return {**folders, "out": out, "start": start}


def alive(pid):
    """Whether process ``pid`` runs (a zombie no longer does: nothing may reap it in a container)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def left_behind(run):
    """What the run left: anything beside --out but --out, anything in TMPDIR but the session
    file onnxruntime writes there when it is imported (.ses, its own, kept on purpose)."""
    beside = sorted(p.name for p in run["parent"].iterdir() if p.name != "out")
    return beside + sorted(p.name for p in run["tmp"].iterdir() if p.name != ".ses")


def wait_for(path, process, seconds=60):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.05)


def test_sigint_then_sigterm_during_an_emulated_call_leaves_nothing_behind(tune_cpu):
    """Signalled as a CI runner cancels while the target computes a candidate (its call would
    take two minutes): graphscan ends in seconds, and the target's interpreter and the child
    it started are gone with every temporary folder, the target's own too. The exit code is
    the first signal's (130), or 143 if the SIGTERM came before graphscan was done."""
    (tune_cpu["marks"] / "HANG").touch()
    process = tune_cpu["start"]()
    busy = tune_cpu["marks"] / "busy"
    wait_for(busy, process)
    pids = [int(pid) for pid in busy.read_text().split()]
    process.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    time.sleep(0.3)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert time.monotonic() - signalled < 8, "the call's end was waited for"
    ended = {(130, b"graphscan: interrupted\n"), (143, b"graphscan: terminated\n")}
    assert stdout == b"" and (process.returncode, stderr) in ended, (process.returncode, stderr)
    assert left_behind(tune_cpu) == [] and not tune_cpu["out"].exists()
    time.sleep(0.2)  # the kernel's delivery of SIGKILL to each process of the group
    assert [pid for pid in pids if alive(pid)] == []


@pytest.mark.parametrize(
    ("plan", "code", "line"),
    [
        pytest.param(
            "SIGINT@open:.graphscan-tune-,SIGTERM@shutil.rmtree", 143, b"graphscan: terminated\n", id="then-sigterm"
        ),
        pytest.param(
            "SIGINT@open:.graphscan-tune-,SIGINT@shutil.rmtree", 130, b"graphscan: interrupted\n", id="ctrl-c-twice"
        ),
    ],
)
def test_a_second_signal_while_the_first_is_cleaned_up_removes_everything_still(tune_cpu, plan, code, line):
    """Interrupted as tune writes its first file in its temporary folder beside --out, and again in the
    very removal of that folder: the second signal is remembered (the exit code says
    terminated once a SIGTERM came) and cuts nothing short."""
    process = tune_cpu["start"](plan)
    stdout, stderr = process.communicate(timeout=120)
    assert (process.returncode, stdout, stderr) == (code, b"", line)
    assert left_behind(tune_cpu) == [] and not tune_cpu["out"].exists()
