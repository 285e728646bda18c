"""The trace speed contract: no slower than onnxruntime's own qdq_loss_debug flow.

Deselected by default (see pytest.ini); run by hand, serially, on a quiet machine, so the
two sides' timings do not compete with other workers:
    pytest -m bench -p no:xdist tests/trace/test_bench_speed.py
"""

import pytest

from tests.helpers import load_bench_script


@pytest.mark.bench
def test_trace_no_slower_than_ort_qdq_loss_debug(tmp_path):
    bench = load_bench_script("bench_trace")
    report = bench.run_benchmark(bench.DEFAULT_BLOCKS, bench.DEFAULT_RUNS, tmp_path)
    table = bench.format_table(report)

    assert report["compute"] >= bench.MIN_COMPUTE, table
    # A fast trace that skipped operators would prove nothing: one row per compute node.
    assert report["sides"]["trace"]["entries"] == report["compute_quant"], table
    assert report["ratio"] <= bench.BOUND, f"trace slower than the ORT flow:\n{table}"
