"""The speed contract: every counting command costs at most twice loading the model.

Deselected by default (see pytest.ini); run by hand, serially, so timings do not compete
with other workers:  pytest -m bench -p no:xdist
"""

import importlib.util
from pathlib import Path

import pytest

BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "bench_commands.py"


def _load_bench():
    # bench/ is a folder of scripts, not a package: load the file itself.
    spec = importlib.util.spec_from_file_location("bench_commands", BENCH_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.bench
def test_every_command_within_twice_load_time(tmp_path):
    bench = _load_bench()
    report = bench.run_benchmark(bench.DEFAULT_NODES, bench.DEFAULT_RUNS, tmp_path)

    assert report["nodes"] >= bench.DEFAULT_NODES
    over = {row["command"]: round(row["ratio"], 2) for row in report["results"] if row["ratio"] > bench.BOUND}
    assert not over, f"over {bench.BOUND}x the load floor:\n{bench.format_table(report)}"
