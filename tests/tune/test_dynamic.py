"""Dynamic candidates (issue 33 item 6): on a transformer-like encoder tune also tries
onnxruntime's one-line ``quantize_dynamic`` (MatMulInteger), measured like any other row;
every figure checked against the test's own quantize_dynamic run and numpy."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

import graphscan
import graphscan_ort.tune.stages as tune_stages
import graphscan_ort.tune.trials as tune_trials
from graphscan_ort.tune.candidates import keyword_arguments, quiet
from graphscan_ort.tune.table import tune_table

WIDTH, SEQUENCE, LAYERS = 64, 16, 3


def encoder(activation="Gelu", width=WIDTH, layers=LAYERS):
    """x [1, SEQUENCE, width] -> (MatMul, Add, activation) x layers, every node named, opset 20
    (its Gelu): the shape of a transformer's feed-forward blocks."""
    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for k in range(layers):
        weight = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        weights += [numpy_helper.from_array(weight, f"w{k}"), numpy_helper.from_array(0.1 * weight[0], f"b{k}")]
        nodes += [
            helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"], name=f"matmul{k}"),
            helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"], name=f"add{k}"),
            helper.make_node(activation, [f"a{k}"], [f"h{k}"], name=f"act{k}"),
        ]
        x = f"h{k}"
    shape = [1, SEQUENCE, width]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def samples(folder, count, seed):
    rng = np.random.default_rng(seed)
    files = []
    for k in range(count):
        files.append(str(folder / f"s{seed}-{k}.npz"))
        np.savez(files[-1], x=rng.standard_normal((1, SEQUENCE, WIDTH)).astype(np.float32))
    return files


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """tune on the encoder with its defaults (two calibration samples, two held out)."""
    folder = tmp_path_factory.mktemp("dynamic")
    onnx.save(encoder(), folder / "encoder.onnx")
    calibration, held = samples(folder, 2, 1), samples(folder, 2, 2)
    answer = graphscan.tune(
        str(folder / "encoder.onnx"), calibrate=calibration, inputs=held, out=str(folder / "o"), runs=2, min_speedup=0
    )
    return {"answer": answer, "float": str(folder / "encoder.onnx"), "held": held, "folder": folder}


def outputs(path, files):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return [session.run(None, dict(np.load(f)))[0].astype(np.float64) for f in files]


def numpy_sqnr(reference, quantized):
    """10·log10(Σ f² / Σ (f - q)²) over every sample: one output, one part."""
    signal = sum(float(np.sum(f**2)) for f in reference)
    noise = sum(float(np.sum((f - q) ** 2)) for f, q in zip(reference, quantized, strict=True))
    return 10 * np.log10(signal / noise)


def test_every_row_holds_one_quantizers_arguments_and_the_dynamic_ones_are_onnxruntimes_defaults(tuned):
    rows = tuned["answer"]["candidates"]
    assert all((r["quantize_static"] is None) != (r["quantize_dynamic"] is None) for r in rows)
    dynamic = sorted((r for r in rows if r["quantize_dynamic"] is not None), key=lambda r: r["id"])
    assert [r["quantize_dynamic"] for r in dynamic] == [{"weight_type": "QInt8"}, {"weight_type": "QUInt8"}]
    assert all(r["error"] is None and not r["rewrites"] and r["trial"] is None for r in dynamic)
    assert all(r["quantize_static"] is not None for r in rows if r["trial"] is not None)  # searches start static


@pytest.mark.parametrize("weight_type", [pytest.param("QInt8", id="int8-weights"), pytest.param("QUInt8", id="uint8")])
def test_a_dynamic_rows_figures_are_the_tests_own_quantize_dynamic_measured_in_numpy(tuned, tmp_path, weight_type):
    """The test quantizes the float model itself, as a user would in one line, and measures it."""
    row = next(
        r for r in tuned["answer"]["candidates"] if (r["quantize_dynamic"] or {}).get("weight_type") == weight_type
    )
    own = tmp_path / "own.onnx"
    with quiet():
        quantize_dynamic(tuned["float"], str(own), weight_type=QuantType[weight_type])
    sqnr = numpy_sqnr(outputs(tuned["float"], tuned["held"]), outputs(str(own), tuned["held"]))
    assert row["sqnr_db"] == pytest.approx(sqnr, abs=1e-6) and row["pooled_sqnr_db"] == pytest.approx(sqnr, abs=1e-6)
    assert row["bytes"] == own.stat().st_size < (tuned["folder"] / "encoder.onnx").stat().st_size
    assert row["float_weights"] == 0 and row["int8_kernels"] >= LAYERS  # every MatMul integer


def test_a_written_dynamic_model_is_reproduced_by_its_arguments_on_prepared_onnx(tmp_path, monkeypatch):
    """With quantize_static's candidates taken away, the model written is a dynamic row's:
    quantize_dynamic with its arguments on prepared.onnx gives it byte for byte, and its
    SQNR is numpy's on the float model's and its own outputs."""
    monkeypatch.setattr(tune_stages, "candidate_settings", list)
    onnx.save(encoder("Relu"), tmp_path / "encoder.onnx")
    files = samples(tmp_path, 2, 3)
    answer = graphscan.tune(
        str(tmp_path / "encoder.onnx"), calibrate=files, out=str(tmp_path / "o"), runs=1, min_speedup=0
    )
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    assert chosen["quantize_dynamic"] is not None and answer["written"] == ["model.onnx", "prepared.onnx"]
    with quiet():
        quantize_dynamic(
            str(tmp_path / "o" / "prepared.onnx"),
            str(tmp_path / "again.onnx"),
            **keyword_arguments(chosen["quantize_dynamic"]),
        )
    assert (tmp_path / "again.onnx").read_bytes() == (tmp_path / "o" / "model.onnx").read_bytes()
    written = outputs(str(tmp_path / "o" / "model.onnx"), files)
    assert chosen["sqnr_db"] == pytest.approx(numpy_sqnr(outputs(str(tmp_path / "encoder.onnx"), files), written))


def refuse_dynamic_models(monkeypatch):
    """onnxruntime refusing every model that holds MatMulInteger, as a runtime without the kernel would."""
    measured = tune_trials.measure_candidate

    def measure(reference, candidate, *args, **kwargs):
        if any(node.op_type == "MatMulInteger" for node in candidate.model.graph.node):
            message = f"{candidate.path}: model does not run (NOT_IMPLEMENTED: MatMulInteger)"
            raise graphscan.GraphscanError(message, graphscan.EXIT_RUNTIME)
        return measured(reference, candidate, *args, **kwargs)

    monkeypatch.setattr(tune_trials, "measure_candidate", measure)


def refuse_quantizing(monkeypatch):
    def refuse(*args):
        raise ValueError("no dynamic kernel for this operator")

    monkeypatch.setattr(tune_trials, "quantize_dynamic_candidate", refuse)


@pytest.mark.parametrize(
    ("refuse", "said"),
    [
        pytest.param(refuse_dynamic_models, "onnxruntime: ", id="onnxruntime-refuses-the-model"),
        pytest.param(refuse_quantizing, "quantize_dynamic: no dynamic kernel", id="the-quantizer-refuses"),
    ],
)
def test_a_refused_dynamic_model_is_a_row_with_its_error_never_the_end_of_the_run(tmp_path, monkeypatch, refuse, said):
    refuse(monkeypatch)
    onnx.save(encoder(layers=2), tmp_path / "encoder.onnx")
    files = samples(tmp_path, 2, 4)
    answer = graphscan.tune(
        str(tmp_path / "encoder.onnx"), calibrate=files, out=str(tmp_path / "o"), runs=1, min_speedup=0, target=-100.0
    )
    dynamic = [r for r in answer["candidates"] if r["quantize_dynamic"] is not None]
    assert len(dynamic) == 2 and all(r["error"].startswith(said) for r in dynamic)
    assert all(r["sqnr_db"] is None and r["fails"] is None and not r["pareto"] for r in dynamic)
    assert all(".graphscan-tune-" not in r["error"] for r in dynamic)  # the user's terms, never tune's files
    assert answer["chosen"] is not None and answer["reached"]  # the static rows carry on
    assert answer["candidates"][-1]["error"] is not None  # refused rows are listed last


def test_no_dynamic_rows_where_no_matmul_has_a_constant_weight(tmp_path):
    """x @ y of two inputs: nothing for quantize_dynamic's defaults to store as integers."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "y"], ["z"], name="matmul"), helper.make_node("Relu", ["z"], ["r"])],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [8, 8]) for n in ("x", "y")],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, [8, 8])],
    )
    assert tune_stages.dynamic_settings(helper.make_model(graph)) == []
    assert len(tune_stages.dynamic_settings(encoder(layers=1))) == 2


def test_the_table_shows_a_dynamic_row_uncalibrated_within_80_columns(tuned):
    """act ``dyn`` (activations quantized at run time), no calibration method."""
    text = tune_table(tuned["answer"], None)
    assert max(map(len, text.splitlines())) <= 80
    shown = [line.split() for line in text.split("candidates, Pareto-best first")[1].split("\n\n")[0].splitlines()[2:]]
    dynamic = {r["id"] for r in tuned["answer"]["candidates"] if r["quantize_dynamic"] is not None}
    assert {int(cells[0]) for cells in shown if cells[1:4] == ["dyn", "no", "-"]} == dynamic


def test_a_target_none_reaches_searches_from_static_rows_and_writes_the_most_accurate(tmp_path):
    """The refinements and exclusions change calibration and nodes_to_exclude: they start from a
    quantize_static row even where a dynamic row is the most accurate, and the run ends (exit 8)."""
    onnx.save(encoder(layers=2), tmp_path / "encoder.onnx")
    files = samples(tmp_path, 3, 5)
    answer = graphscan.tune(
        str(tmp_path / "encoder.onnx"), calibrate=files[:2], inputs=files[2:], out=str(tmp_path / "o"),
        runs=1, min_speedup=0, target=500.0, max_trials=1,
    )  # fmt: skip
    rows = answer["candidates"]
    first = max(r["id"] for r in rows if r["quantize_dynamic"] is not None)
    later = [r for r in rows if r["id"] > first]
    assert later and all(r["quantize_static"] is not None and r["error"] is None for r in later)
    assert not answer["reached"]
    passing = [r for r in rows if r["error"] is None and not r["fails"]]
    assert answer["chosen"] == max(passing, key=lambda r: (r["sqnr_db"], r["speedup"]))["id"]
