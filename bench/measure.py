"""Seconds and peak memory of one whole process, measured from a fresh wrapper.

    python bench/measure.py STDOUT STDERR COMMAND...

runs COMMAND with its output in the files STDOUT and STDERR, and prints one JSON
object: ``{"seconds", "peak_rss", "exit"}`` (peak_rss in bytes). The wrapper is a
small process of its own because Linux carries a parent's high-water mark into a
child it spawns directly: a test or a benchmark holding onnxruntime would
otherwise report its own peak. Only the standard library, so the wrapper is small.

The one peak-memory wrapper of the project: bench/bench_trace.py and
tests/loading/test_big_models.py both call ``measured``.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

THIS_FILE = Path(__file__).resolve()
# ru_maxrss is KiB on Linux and bytes on macOS.
RSS_UNIT = 1 if sys.platform == "darwin" else 1024


def measured(command: list[str], stdout_path: Path, stderr_path: Path) -> dict:
    """Run ``command`` through the wrapper: ``{"seconds", "peak_rss", "exit"}``; its
    stdout and stderr are left in the two files. Raises RuntimeError if the wrapper fails."""
    wrapper = [sys.executable, str(THIS_FILE), str(stdout_path), str(stderr_path)]
    done = subprocess.run(wrapper + [str(c) for c in command], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring wrapper failed: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)


def main(argv: list[str]) -> int:
    stdout_path, stderr_path, *command = argv
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
        start = time.perf_counter()
        done = subprocess.run(command, stdout=out, stderr=err)
        seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * RSS_UNIT
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "exit": done.returncode}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
