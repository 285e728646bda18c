"""Test helpers shared by every test module: one copy of each idea.

graphscan.py is exercised as its users run it (a separate process, from any
working directory), and every answer is parsed as strict JSON.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPHSCAN = str(ROOT / "graphscan.py")


def run_graphscan(args, cwd=None, script=GRAPHSCAN, env=None, python_flags=(), timeout=300):
    """Run graphscan.py as a separate process; stdout and stderr stay bytes."""
    return subprocess.run(
        [sys.executable, *python_flags, script, *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=timeout,
    )


def describe(proc):
    return f"exit {proc.returncode}\nstdout: {proc.stdout!r}\nstderr: {proc.stderr!r}"


def reject_constant(token):
    raise ValueError(f"not strict JSON: {token}")


def strict_loads(text):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as strict parsers do."""
    return json.loads(text, parse_constant=reject_constant)


def json_answer(proc):
    """Assert a success: exit 0, empty stderr, one strict JSON object then one newline."""
    assert proc.returncode == 0, describe(proc)
    assert proc.stderr == b"", describe(proc)
    text = proc.stdout.decode("utf-8")
    answer, end = json.JSONDecoder(parse_constant=reject_constant).raw_decode(text)
    assert text[end:] == "\n", f"stdout after the JSON object: {text[end:]!r}"
    assert isinstance(answer, dict), describe(proc)
    return answer


def error_line(proc, code):
    """Assert a failure with ``code``: nothing on stdout, one line on stderr; returns it."""
    assert proc.returncode == code, describe(proc)
    assert proc.stdout == b"", describe(proc)
    lines = proc.stderr.decode("utf-8", "replace").splitlines()
    assert len(lines) == 1, describe(proc)
    assert lines[0].startswith("graphscan: "), describe(proc)
    return lines[0]


def load_bench_script(name):
    """A script of bench/ loaded as a module (bench/ is a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
