"""tune's measurements (issue 18): each figure equals an independent measurement of
the written model, as it will be deployed."""

from pathlib import Path

import numpy as np
import onnx
import pytest

import gen_models
import graphscan
import graphscan_ort.tune.deployed as deployed
from graphscan_ort.shared.options import Named, Timing


@pytest.fixture(scope="module")
def cnn_pair(tmp_path_factory):
    """A small residual CNN and its onnxruntime QDQ model, with two samples."""
    folder = tmp_path_factory.mktemp("cnn")
    fp32, quant = folder / "cnn.onnx", folder / "cnn_qdq.onnx"
    onnx.save(gen_models.build_cnn(2, channels=4, size=8, seed=0), fp32)
    with gen_models.quiet_quantizer():
        gen_models.quantize_qdq(fp32, quant, seed=0)
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 3, 8, 8)).astype(np.float32)} for k in range(2)]
    paths = []
    for k, sample in enumerate(samples):
        np.savez(folder / f"s{k}.npz", **sample)
        paths.append(str(folder / f"s{k}.npz"))
    return str(fp32), str(quant), samples, paths


def test_every_figure_equals_an_independent_measurement(cnn_pair):
    fp32, quant, samples, paths = cnn_pair
    reference, candidate = Named(onnx.load(fp32), fp32), Named(onnx.load(quant), quant)
    measured = deployed.measure_candidate(reference, candidate, samples, timing=Timing(3))
    # The SQNR: check's min_sqnr, as deployed (default session), on the same samples.
    budget = graphscan.check(quant, float_path=fp32, min_sqnr=-100, inputs=paths)["budgets"][0]
    assert measured["sqnr_db"] == pytest.approx(budget["value"], abs=1e-6)
    # The kernels: the runtime command at onnxruntime's default level.
    classes = graphscan.runtime(quant, level="all")["classes"]
    assert measured["int8_kernels"] == classes["int8"]
    running = classes["int8"] + classes["int8_data"] + classes["float"]
    assert measured["int8_fraction"] == (classes["int8"] + classes["int8_data"]) / running
    assert measured["bytes"] == len(Path(quant).read_bytes())
    # The speedup is the median of the run-by-run ratios, not float_ms / ms (a ratio of medians,
    # which differs whenever the median runs of the two models fall in different rounds).
    ratios = measured["speedup_runs"]
    assert measured["ms"] > 0 and len(ratios) == 3
    assert measured["speedup"] == pytest.approx(sorted(ratios)[1])
    assert all(isinstance(count, int) and count > 0 for count in measured["wrapped_but_float"].values())
