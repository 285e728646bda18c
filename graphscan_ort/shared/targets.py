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
(or ``$GRAPHSCAN_TARGETS``); it prints the targets' state as JSON, and does nothing
the second time::

    $ python -m graphscan_ort.shared.targets install
    $ python -m graphscan_ort.shared.targets status

Then ``run(target, "graphscan_ort.commands.runtime:function", args)`` calls a function
of graphscan inside the target's interpreter (arguments and its JSON answer go through
files) and returns ``{"cpu": {name, onnxruntime, machine}, "result": ...}``; a ``Worker``
keeps one interpreter for many such calls (an emulated one takes seconds to start).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TypedDict

from graphscan import EXIT_INTERNAL, EXIT_RUNTIME, EXIT_USAGE, GraphscanError, one_line, report, shown

__all__ = [
    "INSTALL_COMMAND",
    "NATIVE",
    "TARGETS",
    "Facts",
    "Worker",
    "installed",
    "missing",
    "require",
    "root",
    "run",
    "status",
]

NATIVE = "native"
X86_AVX2 = "x86-avx2"
ARM64 = "arm64"
TARGETS = (NATIVE, X86_AVX2, ARM64)  # the contract's names; more may follow

INSTALL_COMMAND = "python -m graphscan_ort.shared.targets install"

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
    stamp = arm64_stamp()
    if stamp is None:
        return f"the arm64 Python is not installed in {shown(root())}"
    if stamp.get("pins") != pins():
        return f"the arm64 wheels in {shown(root())} are {stamp.get('pins')}, not this environment's {pins()}"
    if not shutil.which("unshare"):
        return "unshare (util-linux) is not installed: onnxruntime needs an ARM /proc/cpuinfo"
    return None


def installed(target: str) -> bool:
    """Whether ``target`` can run here."""
    return missing(target) is None


def require(target: str) -> None:
    """Exit 2 naming the install command when ``target`` cannot run here."""
    problem = missing(target)
    if problem:
        raise GraphscanError(f"usage: CPU target {target}: {problem} (install it: {INSTALL_COMMAND})", EXIT_USAGE)


def status() -> dict[str, Any]:
    """Each target's state: ``{"root", "targets": {name: {"installed", "missing"}}}``."""
    return {
        "root": str(root()),
        "targets": {name: {"installed": installed(name), "missing": missing(name)} for name in TARGETS},
    }


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
    with tempfile.TemporaryDirectory(prefix="graphscan-target-") as folder:
        request, answer = os.path.join(folder, "request.json"), os.path.join(folder, "answer.json")
        with open(request, "w", encoding="utf-8") as f:
            json.dump({"function": function, "args": args, "kwargs": kwargs}, f)
        line, env = command(target, ["-m", __name__, "call", request, answer])
        done = subprocess.run(line, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
        try:
            with open(answer, encoding="utf-8") as f:
                reply = json.load(f)
        except (OSError, ValueError):
            why = stopped(done.returncode, done.stderr)
            raise GraphscanError(f"CPU target {target}: {why}", EXIT_RUNTIME) from None
    return answered(target, reply)


def answered(target: str, reply: dict) -> dict:
    """A target's reply to one call: its error raised here with its exit code, else the reply."""
    if "error" in reply:
        raise GraphscanError(reply["error"], reply["exit_code"])
    reply["cpu"]["name"] = target
    return reply


def stopped(returncode: int, stderr: str) -> str:
    """How a target's interpreter ended without an answer: its signal or exit code, its last words."""
    if returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    else:
        how = f"stopped (exit {returncode})"
    last = [line.strip() for line in stderr.splitlines() if line.strip()]
    return f"its interpreter was {how} without an answer" + (f": {last[-1]}" if last else "")


class Worker:
    """One interpreter of ``target`` kept for many ``run`` calls, started at the first: under
    emulation, starting Python and importing onnxruntime costs seconds for each call (see
    docs/PERFORMANCE.md), the calls themselves often less. Requests go as ``run``'s do,
    through files; a line on the interpreter's stdin asks, a line on its stdout answers.
    ``close`` (or leaving the ``with`` block) ends it."""

    def __init__(self, target: str) -> None:
        require(target)
        self.target = target
        self.process: subprocess.Popen[str] | None = None
        self.folder: str | None = None
        self.calls = 0

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, function: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None) -> dict:
        """``run(target, function, args, kwargs)`` in this worker's interpreter."""
        if self.target == NATIVE:
            return run(self.target, function, args, kwargs)
        process, folder = self.started()
        self.calls += 1
        request = os.path.join(folder, f"request-{self.calls}.json")
        answer = os.path.join(folder, f"answer-{self.calls}.json")
        with open(request, "w", encoding="utf-8") as f:
            json.dump({"function": function, "args": list(args or []), "kwargs": dict(kwargs or {})}, f)
        assert process.stdin is not None and process.stdout is not None
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
            if done:  # an answer line without an answer file: not a worker to trust again
                process.kill()
            self.process = None
            returncode = ended(process)
            with open(os.path.join(folder, "stderr"), encoding="utf-8", errors="replace") as f:
                last = f.read()
            raise GraphscanError(f"CPU target {self.target}: {stopped(returncode, last)}", EXIT_RUNTIME)
        for file in (request, answer):
            os.remove(file)
        return answered(self.target, reply)

    def started(self) -> tuple[subprocess.Popen[str], str]:
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="graphscan-target-")
        if self.process is None:
            line, env = command(self.target, ["-m", __name__, "serve"])
            with open(os.path.join(self.folder, "stderr"), "w", encoding="utf-8") as stderr:
                self.process = subprocess.Popen(
                    line, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
                )
        return self.process, self.folder

    def close(self) -> None:
        """End the interpreter (its stdin closed, then killed if it lingers) and remove its files."""
        process, self.process = self.process, None
        if process is not None:
            ended(process)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


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
    built beside it and renamed into place, so a half install is never taken for one."""
    stamp = arm64_stamp()
    if stamp is not None and stamp.get("pins") == pins():
        return
    for tool in ("apt-get", "apt-cache", "dpkg"):
        if not shutil.which(tool):
            raise GraphscanError(
                f"targets: the arm64 Python comes from Debian's packages; {tool} is not here", EXIT_USAGE
            )
    base = root()
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
    """Install what the targets need (idempotent) and return their state."""
    if not host_is_x86_64():
        raise GraphscanError(
            f"targets: the targets are emulated from an x86-64 host; this one is {platform.machine()}", EXIT_USAGE
        )
    install_qemu()
    install_arm64()
    return status()


def ended(process: subprocess.Popen[str]) -> int:
    """A worker's interpreter ended: its stdin closed (it stops at the end of its input),
    killed if it lingers, its pipes closed; its exit code."""
    try:
        assert process.stdin is not None
        process.stdin.close()
    except OSError:  # a broken pipe: it has ended already
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()
    return process.returncode


def serve() -> None:
    """Inside a target, for a ``Worker``: each line on stdin, ``[REQUEST, ANSWER]``, is one
    ``call``; an empty line on stdout says its answer is written. Whatever else writes to
    stdout (onnxruntime, a user's metric) goes to stderr: stdout is the worker's alone."""
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request, answer = json.loads(line)
        call(request, answer)
        channel.write("\n")
        channel.flush()


def main(argv: list[str] | None = None) -> int:
    """``install``, ``status`` (JSON on stdout), ``call REQUEST ANSWER`` or ``serve`` (inside a target)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["call"] and len(argv) == 3:
            call(argv[1], argv[2])
            return 0
        if argv == ["serve"]:
            serve()
            return 0
        if argv not in (["install"], ["status"]):
            raise GraphscanError(f"usage: {INSTALL_COMMAND} | python -m {__name__} status", EXIT_USAGE)
        answer = install() if argv == ["install"] else status()
    except GraphscanError as exc:
        report(str(exc))
        return exc.exit_code
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
