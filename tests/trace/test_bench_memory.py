"""trace's memory contract (issue 10): peak RSS at most 3x running both models once.

Deselected by default (see pytest.ini); run by hand, serially, on a quiet machine:
    pytest -m bench -p no:xdist tests/trace/test_bench_memory.py
Real models are measured with the script itself (python bench/bench_trace_memory.py --det ...),
never used as test fixtures.
"""

import onnx
import pytest

from tests.helpers import load_bench_script


@pytest.mark.bench
def test_a_2500_op_chain_stays_within_three_times_both_models(tmp_path):
    bench = load_bench_script("bench_trace_memory")
    float_model, quant_model = bench.chain_models(2500, 65536)
    paths = [str(tmp_path / "chain.onnx"), str(tmp_path / "chain_qdq.onnx")]
    onnx.save(float_model, paths[0])
    onnx.save(quant_model, paths[1])
    result = bench.measure_pair(*paths, "x=1,65536")
    assert result["ratio"] <= bench.BOUND, result
