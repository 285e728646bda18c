"""The speed contract: every counting command costs at most twice loading the model.

Deselected by default (see pytest.ini); run by hand, serially, so timings do not compete
with other workers:  pytest -m bench -p no:xdist
"""

import pytest

from tests.helpers import load_bench_script


@pytest.mark.bench
def test_every_command_within_twice_load_time(tmp_path):
    bench = load_bench_script("bench_commands")
    report = bench.run_benchmark(bench.DEFAULT_NODES, bench.DEFAULT_RUNS, tmp_path)

    assert report["nodes"] >= bench.DEFAULT_NODES
    over = {row["command"]: round(row["ratio"], 2) for row in report["results"] if row["ratio"] > bench.BOUND}
    assert not over, f"over {bench.BOUND}x the load floor:\n{bench.format_table(report)}"
