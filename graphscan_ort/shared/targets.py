"""CPU targets: the same onnxruntime release dispatched for another CPU, from one x86-64 host.

What onnxruntime runs and computes depends on the CPU: its aarch64 build fuses other
integer kernels, and x86 without VNNI rounds U8S8 convolutions otherwise. A target is
a real build run under emulation (Debian's ``qemu-user``): its kernels are real, its
timings mean nothing.

- ``native``: this process, as every command runs today;
- ``x86-avx2``: this very interpreter under ``qemu-x86_64 -cpu Haswell`` (AVX2, no VNNI);
- ``arm64``: Debian's arm64 Python with the aarch64 wheels of this environment's onnx,
  onnxruntime, numpy and ml_dtypes, under ``qemu-aarch64 -cpu neoverse-n1``, in a private
  mount namespace whose ``/proc/cpuinfo`` describes that CPU (onnxruntime reads it).

Install once, as root (apt-get), into ``${XDG_CACHE_HOME:-~/.cache}/graphscan/targets``
(or ``$GRAPHSCAN_TARGETS``); it prints the targets' state as JSON, and repairs only what
does not run the second time::

    $ python -m graphscan_ort.shared.targets install
    $ python -m graphscan_ort.shared.targets status

Then ``run(target, "graphscan_ort.commands.runtime:function", args)`` calls a function
of graphscan inside the target's interpreter (arguments and its JSON answer go through
files) and returns ``{"cpu": {name, onnxruntime, machine}, "result": ...}``; a ``Worker``
keeps one interpreter for many such calls (an emulated one takes seconds to start).

Installed means the target runs a trivial call. Every command checks only what costs
no start (``missing``: the tools, the arm64 folder's files and its packages' versions) and
blames a target that then fails to start on its install (exit 2 naming the install
command); ``status`` and ``install`` start each target once to know (``probed``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict, TypeVar

from graphscan import (
    CPU_TARGETS,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NO_FILE,
    EXIT_RUNTIME,
    EXIT_USAGE,
    INSTALL_TARGETS,
    INTERRUPTED,
    NATIVE,
    GraphscanError,
    one_line,
    shown,
    stderr_line,
)

ReturnT = TypeVar("ReturnT")

__all__ = [
    "INSTALL_COMMAND",
    "NATIVE",
    "TARGETS",
    "Facts",
    "Runner",
    "Worker",
    "installed",
    "missing",
    "probed",
    "require",
    "root",
    "run",
    "status",
]

TARGETS = CPU_TARGETS  # the contract's names (the core's, with NATIVE); more may follow
_, X86_AVX2, ARM64 = TARGETS

# What users type after ``python -m`` (run so, this module's __name__ is "__main__").
MODULE = "graphscan_ort.shared.targets"
INSTALL_COMMAND = INSTALL_TARGETS
assert f"python -m {MODULE} install" == INSTALL_COMMAND, "the core names this module's install command"

# What the aarch64 wheels are pinned to: this environment's own versions, so a target
# runs the release native runs (their dependencies follow the same environment).
PINNED = ("onnx", "onnxruntime", "numpy", "ml_dtypes")

# Debian's arm64 packages the interpreter needs (their dependencies come along).
ARM64_PACKAGES = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6")
ARM64_PYTHON = "usr/bin/python3.11"
ARM64_PYTHON_VERSION = "3.11"

# Haswell is AVX2 without VNNI; the minus flags are what TCG cannot emulate and would
# otherwise warn about on every start.
X86_AVX2_CPU = "Haswell,-pcid,-x2apic,-tsc-deadline,-hle,-invpcid,-rtm"
ARM64_CPU = "neoverse-n1"
# /proc/cpuinfo of a Neoverse N1 (Graviton2, Ampere Altra): ARMv8.2 with the dot product.
ARM64_CPUINFO = (
    "processor\t: {i}\nBogoMIPS\t: 50.00\n"
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop "
    "asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\n"
    "CPU revision\t: 1\n\n"
)
STAMP = "installed.json"
# What a worker's interpreter writes first on its stdout, once onnxruntime is imported:
# an interpreter that ends before it is a target that does not start (a damaged install).
READY = "ready"
# Seconds an idle worker's interpreter is given to stop at the end of its input.
LINGER = 10


class Facts(TypedDict):
    """What a target ran on: its name, its onnxruntime's version and its machine."""

    name: str
    onnxruntime: str
    machine: str


# -- where things are


def root() -> Path:
    """The targets' folder: ``$GRAPHSCAN_TARGETS``, else ``${XDG_CACHE_HOME:-~/.cache}/graphscan/targets``."""
    if os.environ.get("GRAPHSCAN_TARGETS"):
        return Path(os.environ["GRAPHSCAN_TARGETS"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "graphscan" / "targets"


def repository() -> Path:
    """The folder that holds ``graphscan.py`` and ``graphscan_ort/``: the target's PYTHONPATH."""
    return Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    """This environment's versions of the pinned packages."""
    return {name: importlib.metadata.version(name) for name in PINNED}


def host_is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def qemu(arch: str) -> str | None:
    return shutil.which(f"qemu-{arch}")


def arm64_stamp() -> dict[str, Any] | None:
    try:
        return json.loads((root() / ARM64 / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def missing(target: str) -> str | None:
    """Why ``target`` cannot run here (None: it can), naming what to do."""
    if target not in TARGETS:
        return f"unknown CPU target {target!r} (known: {', '.join(TARGETS)})"
    if target == NATIVE:
        return None
    if not host_is_x86_64():
        return f"the {target} target is emulated from an x86-64 host; this one is {platform.machine()}"
    if target == X86_AVX2:
        return None if qemu("x86_64") else "qemu-x86_64 is not installed"
    if not qemu("aarch64"):
        return "qemu-aarch64 is not installed"
    problem = arm64_damage()
    if problem:
        return problem
    if not shutil.which("unshare"):
        return "unshare (util-linux) is not installed: onnxruntime needs an ARM /proc/cpuinfo"
    return None


def arm64_damage() -> str | None:
    """What the arm64 folder lacks, from its files alone (None: nothing): the stamp a whole
    install writes last, the interpreter and the ARM cpuinfo it runs with, and the pinned
    packages at this environment's versions (what is installed, not what the stamp says)."""
    if arm64_stamp() is None:
        return f"the arm64 Python is not installed in {shown(root())}"
    folder = root() / ARM64
    absent = [name for name in (f"sysroot/{ARM64_PYTHON}", "cpuinfo") if not (folder / name).is_file()]
    if absent:
        return f"the arm64 install in {shown(root())} is damaged: no {' and no '.join(absent)}"
    wanted = pins()
    found = site_versions(folder / "site")
    there = {name: found.get(canonical(name)) for name in wanted}
    if there != wanted:
        return f"the arm64 wheels in {shown(root())} are {there}, not this environment's {wanted}"
    return None


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (ml_dtypes and ml-dtypes are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def site_versions(site: Path) -> dict[str, str]:
    """The version of each distribution installed in ``site``, by canonical name."""
    found = importlib.metadata.distributions(path=[str(site)])
    return {canonical(dist.metadata["Name"] or ""): dist.version for dist in found}


def installed(target: str) -> bool:
    """Whether ``target`` runs a trivial call here (an emulated one is started: seconds)."""
    problem = missing(target)
    return problem is None and (target == NATIVE or probed([target])[target] is None)


def require(target: str) -> None:
    """Exit 2 naming the install command when ``target`` cannot run here (its files tell)."""
    problem = missing(target)
    if problem:
        raise not_installed(target, problem)


def not_installed(target: str, problem: str) -> GraphscanError:
    """Exit 2: ``target`` is not installed whole, and the install command repairs it."""
    return GraphscanError(f"usage: CPU target {target}: {problem} (install it: {INSTALL_COMMAND})", EXIT_USAGE)


def status() -> dict[str, Any]:
    """Each target's state: ``{"root", "targets": {name: {"installed", "missing"}}}``;
    installed means it runs a trivial call (each emulated target started once, side by side)."""
    problems = {name: missing(name) for name in TARGETS}
    problems.update(probed([name for name, problem in problems.items() if problem is None and name != NATIVE]))
    return {
        "root": str(root()),
        "targets": {name: {"installed": problem is None, "missing": problem} for name, problem in problems.items()},
    }


def probed(names: list[str]) -> dict[str, str | None]:
    """Why each emulated target of ``names`` does not run a trivial call (None: it does),
    all started at once: a start under emulation costs seconds."""
    workers = [Worker(name) for name in names]
    try:
        for worker in workers:
            worker.start()
        return {worker.target: trivial_call(worker) for worker in workers}
    finally:
        for worker in workers:
            worker.close()


def trivial_call(worker: Worker) -> str | None:
    """Why ``worker``'s target does not answer a call for its facts with this environment's
    onnxruntime (None: it does)."""
    problem = worker.start_problem()
    if problem is not None:
        return problem
    try:
        facts = worker.run(f"{MODULE}:native_facts")["result"]
    except GraphscanError as exc:
        return one_line(exc)
    wanted = pins()["onnxruntime"]
    return None if facts["onnxruntime"] == wanted else f"it runs onnxruntime {facts['onnxruntime']}, not {wanted}"


# -- running a function inside a target


def native_facts() -> Facts:
    import onnxruntime as ort

    return {"name": NATIVE, "onnxruntime": ort.__version__, "machine": platform.machine()}


def command(target: str, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run ``python argv...`` inside ``target``."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    path = [str(repository())]
    if target == X86_AVX2:
        line = [str(qemu("x86_64")), "-cpu", X86_AVX2_CPU, sys.executable, *argv]
    else:
        folder = root() / ARM64
        sysroot = folder / "sysroot"
        path.insert(0, str(folder / "site"))
        python = [str(qemu("aarch64")), "-cpu", ARM64_CPU, "-L", str(sysroot), str(sysroot / ARM64_PYTHON), *argv]
        cpuinfo = folder / "cpuinfo"
        # A private mount namespace: only this process and its children see the ARM file.
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        script = 'mount --bind "$0" /proc/cpuinfo && exec "$@"'
        line = [str(shutil.which("unshare")), *user, "--mount", "sh", "-c", script, str(cpuinfo), *python]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return line, env


def run(target: str, function: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None) -> dict:
    """Call ``function`` (``"module:name"``, a function of graphscan whose answer is JSON)
    inside ``target``: ``{"cpu": Facts, "result": its answer}``. A ``GraphscanError``
    raised there is raised here with its exit code; a missing target is exit 2."""
    args, kwargs = list(args or []), dict(kwargs or {})
    require(target)
    if target == NATIVE:
        return {"cpu": native_facts(), "result": resolve(function)(*args, **kwargs)}
    with Worker(target) as worker:
        return worker.run(function, args, kwargs)


def answered(target: str, reply: dict) -> dict:
    """A target's reply to one call: its error raised here with its exit code, else the reply."""
    if "error" in reply:
        raise GraphscanError(reply["error"], reply["exit_code"])
    reply["cpu"]["name"] = target
    return reply


def stopped(returncode: int, stderr: str, when: str = "without an answer") -> str:
    """How a target's interpreter ended ``when``: its signal or exit code, its last words."""
    if returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"stopped (exit {returncode})"
    last = [line.strip() for line in stderr.splitlines() if line.strip()]
    return f"its interpreter was {how} {when}" + (f": {last[-1]}" if last else "")


class Worker:
    """One interpreter of ``target`` kept for many ``run`` calls, started at the first (or by
    ``start``): under emulation, starting Python and importing onnxruntime costs seconds for
    each call (see docs/PERFORMANCE.md), the calls themselves often less. Requests go as
    ``run``'s do, through files; a line on the interpreter's stdin asks, a line on its
    stdout answers. ``close`` (or leaving the ``with`` block) ends it.

    The interpreter runs in a process group of its own, with its temporary folder inside
    this worker's: a Ctrl-C reaches graphscan alone, and ``close`` ends the whole group and
    removes everything it wrote, even when it is killed in the middle of a call."""

    def __init__(self, target: str) -> None:
        require(target)
        self.target = target
        self.process: subprocess.Popen[str] | None = None
        self.folder: str | None = None
        self.calls = 0
        self.idle = False  # ready and waiting for a request: it may be asked to stop

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, function: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None) -> dict:
        """``run(target, function, args, kwargs)`` in this worker's interpreter."""
        if self.target == NATIVE:
            return run(self.target, function, args, kwargs)
        problem = self.start_problem()
        if problem is not None:
            raise not_installed(self.target, problem)
        process, folder = self.process, self.folder
        assert process is not None and process.stdin is not None and process.stdout is not None and folder
        self.calls += 1
        request = os.path.join(folder, f"request-{self.calls}.json")
        answer = os.path.join(folder, f"answer-{self.calls}.json")
        with open(request, "w", encoding="utf-8") as f:
            json.dump({"function": function, "args": list(args or []), "kwargs": dict(kwargs or {})}, f)
        self.idle = False
        try:
            process.stdin.write(json.dumps([request, answer]) + "\n")
            process.stdin.flush()
            done = process.stdout.readline()
        except OSError:  # a broken pipe: the interpreter has ended
            done = ""
        try:
            with open(answer, encoding="utf-8") as f:
                reply = json.load(f)
        except (OSError, ValueError):
            reply = None
        if not done or reply is None:
            # an answer line without an answer file: not a worker to trust again
            how = self.ended_how(at_once=bool(done), when="without an answer")
            raise GraphscanError(f"CPU target {self.target}: {how}", EXIT_RUNTIME)
        self.idle = True
        for file in (request, answer):
            os.remove(file)
        return answered(self.target, reply)

    def start(self) -> None:
        """Start the interpreter unless it runs, without waiting for it to be ready."""
        if self.target == NATIVE or self.process is not None:
            return
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="graphscan-target-")
            os.mkdir(os.path.join(self.folder, "tmp"))
        line, env = command(self.target, ["-m", MODULE, "serve"])
        env["TMPDIR"] = os.path.join(self.folder, "tmp")  # removed with this worker's folder, whatever happens
        self.idle = False
        with open(os.path.join(self.folder, "stderr"), "w", encoding="utf-8") as stderr:
            self.process = subprocess.Popen(
                line,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )

    def start_problem(self) -> str | None:
        """Why the interpreter does not start (None: it is ready, started now if need be):
        one that ends before it says it is ready is a target whose install is damaged."""
        self.start()
        if self.target == NATIVE or self.idle:
            return None
        assert self.process is not None and self.process.stdout is not None
        try:
            said = self.process.stdout.readline()
        except OSError:
            said = ""
        if said.strip() != READY:
            return f"it does not start: {self.ended_how(at_once=True, when='before it was ready')}"
        self.idle = True
        return None

    def ended_how(self, at_once: bool, when: str) -> str:
        """The interpreter ended (``ended``), and how, with its last words, for a message."""
        process, self.process, self.idle = self.process, None, False
        assert process is not None and self.folder is not None
        returncode = ended(process, at_once)
        with open(os.path.join(self.folder, "stderr"), encoding="utf-8", errors="replace") as f:
            return stopped(returncode, f.read(), when)

    def close(self) -> None:
        """End the interpreter and remove its files: an idle one is asked to stop; one that is
        starting or in a call (an interrupt, an error here), or any after a signal, is killed
        at once (``ended``)."""
        process, self.process = self.process, None
        try:
            if process is not None:
                ended(process, at_once=not self.idle or bool(INTERRUPTED))
        finally:
            self.idle = False
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = None


class Runner:
    """Calls functions of graphscan on one CPU target (``CpuTarget.runner``): natively in
    this process; else in the target's interpreter, one started for each call, or one kept
    for every call (``kept``: a ``Worker``; ``close`` ends it). ``facts``: the CPU that
    answered the last call."""

    def __init__(self, target: str, kept: bool = False) -> None:
        require(target)
        self.target = target
        self.worker = Worker(target) if kept and target != NATIVE else None
        self.facts: Facts | None = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, function: Callable[..., ReturnT], *args: Any) -> ReturnT:
        """``function(*args)`` on the target: a module-level function of graphscan whose
        arguments and answer are JSON (the import stays where readers and the layer test see it)."""
        name = f"{function.__module__}:{function.__qualname__}"
        assert "." not in function.__qualname__ and resolve(name) is function, f"{name}: not a module-level function"
        reply = self.worker.run(name, list(args)) if self.worker is not None else run(self.target, name, list(args))
        self.facts = reply["cpu"]
        return reply["result"]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def resolve(function: str) -> Any:
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)


def call(request: str, answer: str) -> None:
    """Inside a target: run the request's function, write its answer (or its error)."""
    with open(request, encoding="utf-8") as f:
        asked = json.load(f)
    try:
        reply: dict[str, Any] = {
            "cpu": native_facts(),
            "result": resolve(asked["function"])(*asked["args"], **asked["kwargs"]),
        }
    except GraphscanError as exc:
        reply = {"error": str(exc), "exit_code": exc.exit_code}
    except MemoryError:
        reply = {"error": f"{asked['function']}: out of memory", "exit_code": EXIT_RUNTIME}
    except Exception as exc:  # a bug: one line there as here, never a traceback
        reply = {"error": f"internal error: {type(exc).__name__}: {one_line(exc)}", "exit_code": EXIT_INTERNAL}
    with open(answer, "w", encoding="utf-8") as f:
        json.dump(reply, f)


# -- installing


def step(what: str, line: list[str], **kwargs: Any) -> None:
    """Run one install step; its failure is one line naming the step and its last words."""
    if sys.stderr is not None and sys.stderr.isatty():  # progress for people; stderr stays one line in CI
        print(f"targets: {what}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(line, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False, **kwargs)
    except OSError as exc:
        raise GraphscanError(f"targets: {what}: {one_line(exc)}", EXIT_USAGE) from None
    if done.returncode:
        last = [text for text in (done.stderr + done.stdout).splitlines() if text.strip()]
        raise GraphscanError(
            f"targets: {what} failed (exit {done.returncode}){': ' + last[-1].strip() if last else ''}", EXIT_USAGE
        )


def install_qemu() -> None:
    """Debian's qemu-user (qemu-x86_64 and qemu-aarch64), unless both are here."""
    if qemu("x86_64") and qemu("aarch64"):
        return
    if not shutil.which("apt-get"):
        raise GraphscanError(
            "targets: need qemu-x86_64 and qemu-aarch64 (Debian's qemu-user); apt-get is not here to install them",
            EXIT_USAGE,
        )
    if os.geteuid() != 0:
        raise GraphscanError(
            "targets: installing Debian's qemu-user needs root (apt-get); run this as root", EXIT_USAGE
        )
    step("apt-get update", ["apt-get", "update", "-q"])
    step("apt-get install qemu-user", ["apt-get", "install", "-y", "-q", "qemu-user"])


def install_arm64() -> None:
    """Debian's arm64 Python and the aarch64 wheels of the pins, into ``root()/arm64``,
    built beside it and renamed into place (over what was there), so a half install is
    never taken for one."""
    for tool in ("apt-get", "apt-cache", "dpkg"):
        if not shutil.which(tool):
            raise GraphscanError(
                f"targets: the arm64 Python comes from Debian's packages; {tool} is not here", EXIT_USAGE
            )
    base = root()
    try:
        base.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".arm64-", dir=base))
        try:
            build_arm64(work)
            final = base / ARM64
            if final.exists():
                shutil.rmtree(final)
            (work / "arm64").rename(final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    except OSError as exc:
        why = exc.strerror or one_line(exc)
        raise GraphscanError(f"targets: cannot write the targets' folder {shown(base)} ({why})", EXIT_NO_FILE) from None


def build_arm64(work: Path) -> None:
    apt = work / "apt"
    for folder in (apt / "lists" / "partial", apt / "cache" / "archives" / "partial", work / "debs"):
        folder.mkdir(parents=True)
    # apt's own state in private folders: the host's architectures and package lists stay as they are.
    options = [
        f"-oDir::State::Lists={apt / 'lists'}",
        f"-oDir::Cache={apt / 'cache'}",
        "-oDir::State::status=/dev/null",
        "-oAPT::Architecture=arm64",
        "-oAPT::Architectures::=arm64",
        "-oAPT::Sandbox::User=root",
    ]
    step("apt-get update (arm64 package lists)", ["apt-get", *options, "update", "-q"])
    depends = subprocess.run(
        ["apt-cache", *options, "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts"]
        + ["--no-breaks", "--no-replaces", "--no-enhances", *ARM64_PACKAGES],
        capture_output=True,
        text=True,
        check=False,
    )
    packages = sorted({name for name in depends.stdout.splitlines() if name and name[0] not in " <"})
    if depends.returncode or not packages:
        raise GraphscanError(f"targets: Debian's arm64 {ARM64_PACKAGES[0]} was not found", EXIT_USAGE)
    step(
        f"apt-get download ({len(packages)} arm64 packages)",
        ["apt-get", *options, "download", *(f"{name}:arm64" for name in packages)],
        cwd=work / "debs",
    )
    sysroot = work / "arm64" / "sysroot"
    sysroot.mkdir(parents=True)
    for deb in sorted((work / "debs").glob("*.deb")):
        step(f"dpkg -x {deb.name}", ["dpkg", "-x", str(deb), str(sysroot)])
    constraints = work / "constraints.txt"
    constraints.write_text(
        "".join(f"{d.metadata['Name']}=={d.version}\n" for d in importlib.metadata.distributions()),
        encoding="utf-8",
    )
    # pip's --platform takes no "or older": every manylinux glibc up to bookworm's 2.36.
    platforms = [f"--platform=manylinux_2_{minor}_aarch64" for minor in range(17, 37)]
    step(
        "pip install the aarch64 wheels " + " ".join(f"{name}=={version}" for name, version in pins().items()),
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"]
        + [str(work / "arm64" / "site"), *platforms, "--platform=manylinux2014_aarch64"]
        + ["--python-version", ARM64_PYTHON_VERSION, "--only-binary=:all:", "-c", str(constraints)]
        + [f"{name}=={version}" for name, version in pins().items()],
    )
    cpus = os.cpu_count() or 1
    (work / "arm64" / "cpuinfo").write_text("".join(ARM64_CPUINFO.format(i=i) for i in range(cpus)), encoding="utf-8")
    (work / "arm64" / STAMP).write_text(
        json.dumps({"pins": pins(), "packages": packages}, indent=1) + "\n", encoding="utf-8"
    )


def install() -> dict[str, Any]:
    """Install what the targets need, repairing what does not run a trivial call, and return
    their state; exit 2 when one still does not run afterwards."""
    if not host_is_x86_64():
        raise GraphscanError(
            f"targets: the targets are emulated from an x86-64 host; this one is {platform.machine()}", EXIT_USAGE
        )
    install_qemu()
    state = status()
    # arm64's folder is rebuilt when its files or a trivial call say it is not whole (without
    # unshare nothing runs: then its files alone judge it).
    if not state["targets"][ARM64]["installed"] and (arm64_damage() is not None or shutil.which("unshare")):
        install_arm64()
        state = status()
    for name, target in state["targets"].items():
        if not target["installed"]:
            raise GraphscanError(
                f"targets: {name} still does not run after the install: {target['missing']}", EXIT_USAGE
            )
    return state


def ended(process: subprocess.Popen[str], at_once: bool = False) -> int:
    """A worker's interpreter ended, its exit code: unless ``at_once``, its stdin closed (an
    idle one stops at the end of its input) and ``LINGER`` seconds given; then, if it still
    runs, its process group killed (what it started goes with it); its pipes closed."""
    try:
        if not at_once:
            with contextlib.suppress(OSError):  # a broken pipe: it has ended already
                assert process.stdin is not None
                process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=LINGER)
    finally:  # also when a signal cuts the wait short
        if process.poll() is None:
            with contextlib.suppress(OSError):  # gone between the two calls
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for pipe in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
    return process.returncode


def serve() -> None:
    """Inside a target, for a ``Worker``: each line on stdin, ``[REQUEST, ANSWER]``, is one
    ``call``; an empty line on stdout says its answer is written. Whatever else writes to
    stdout (onnxruntime, a user's metric) goes to stderr: stdout is the worker's alone."""
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    native_facts()  # onnxruntime imported before the worker is told ready: a broken install never is
    channel.write(READY + "\n")
    channel.flush()
    for line in sys.stdin:
        request, answer = json.loads(line)
        call(request, answer)
        channel.write("\n")
        channel.flush()


def main(argv: list[str] | None = None) -> int:
    """``install``, ``status`` (JSON on stdout) or ``serve`` (inside a target); an error is
    one line on stderr and its exit code, never a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv == ["serve"]:
            serve()
            return 0
        if argv not in (["install"], ["status"]):
            raise GraphscanError(f"usage: {INSTALL_COMMAND} | python -m {MODULE} status", EXIT_USAGE)
        answer = install() if argv == ["install"] else status()
    except GraphscanError as exc:
        stderr_line(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        stderr_line("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: still one line
        stderr_line(f"internal error: {type(exc).__name__}: {one_line(exc)}")
        return EXIT_INTERNAL
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
