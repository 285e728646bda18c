"""trace's bounded memory (issue 10): one combined session run in segments, small
tensors measured in numpy, big ones reduced inside the graph, the same answers.

Expectations come from onnxruntime run directly (every intermediate tensor
exposed) and numpy, never from trace itself.
"""

import resource
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.engines.combined as combined
import graphscan_ort.engines.measures as measures
from tests.helpers import GRAPHSCAN, error_line, load_bench_script, run_graphscan

# The ways a row can be measured: fetched into numpy by one session, by sessions
# of 150 nodes, by a session per fetched tensor, or measured by numpy in slices of
# 50 values; reduced in the graph, and reduced in slices of 50 values by sessions
# of 150 nodes.
PATHS = [
    pytest.param({}, id="fetched"),
    pytest.param({"TRACE_SEGMENT_NODES": 150}, id="fetched-segmented"),
    pytest.param({"TRACE_FETCH_BUDGET": 1}, id="fetched-a-tensor-a-session"),
    pytest.param({"TRACE_CHUNK_ELEMENTS": 50}, id="fetched-chunked"),
    pytest.param({"TRACE_FETCH_ELEMENTS": 0}, id="reduced-in-graph"),
    pytest.param(
        {"TRACE_FETCH_ELEMENTS": 0, "TRACE_CHUNK_ELEMENTS": 50, "TRACE_SEGMENT_NODES": 150},
        id="reduced-chunked-segmented",
    ),
]


def set_trace_limits(monkeypatch, settings):
    """Set trace's size limits (``{name: value}``) in every engine module that reads them."""
    for name, value in settings.items():
        modules = [module for module in (combined, measures) if hasattr(module, name)]
        assert modules, name
        for module in modules:
            monkeypatch.setattr(module, name, value)


def all_tensors(path, feeds):
    """Every node output of the model at ``path`` on ``feeds``, run directly in onnxruntime."""
    import onnxruntime as ort

    model = onnx.load(path)
    names = [t for node in model.graph.node for t in node.output if t]
    del model.graph.output[:]
    model.graph.output.extend(onnx.ValueInfoProto(name=t) for t in names)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return {**feeds, **dict(zip(names, session.run(names, feeds), strict=True))}


def seen_and_range(model, node_name):
    """What the next op sees of a node's first output (after its Q->DQ) and that
    Q's ``(lo, hi)``, from the quantized model's own initializers."""
    (node,) = [n for n in model.graph.node if n.name == node_name]
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for q in model.graph.node:
        if q.op_type == "QuantizeLinear" and q.input[0] == node.output[0]:
            (dq,) = [d for d in model.graph.node if d.op_type == "DequantizeLinear" and d.input[0] == q.output[0]]
            scale, zero = float(inits[q.input[1]]), int(inits[q.input[2]])
            info = np.iinfo(inits[q.input[2]].dtype)
            return dq.output[0], ((info.min - zero) * scale, (info.max - zero) * scale)
    return node.output[0], None


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A small residual CNN and its static QDQ twin: 4-D tensors of a few hundred values."""
    folder = tmp_path_factory.mktemp("cnn")
    fp32, quant = folder / "cnn.onnx", folder / "cnn_q.onnx"
    onnx.save(gen_models.build_cnn(2, channels=4, size=8, seed=1), fp32)
    gen_models.quantize_qdq(fp32, quant, seed=0)
    x = np.random.default_rng(5).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.savez(folder / "x.npz", x=x)
    return {"float": fp32, "quant": quant, "x": x, "npz": folder / "x.npz"}


@pytest.mark.parametrize("settings", PATHS)
def test_every_path_gives_what_onnxruntime_and_numpy_give(cnn, settings, monkeypatch):
    set_trace_limits(monkeypatch, settings)
    answer = graphscan.trace(str(cnn["float"]), str(cnn["quant"]), inputs=str(cnn["npz"]))
    floats = all_tensors(cnn["float"], {"x": cnn["x"]})
    quants = all_tensors(cnn["quant"], {"x": cnn["x"]})
    quant_model = onnx.load(cnn["quant"])
    checked = 0
    for row in answer["ops"]:
        seen, clip = seen_and_range(quant_model, row["node"])
        reference = floats[row["reference"]].astype(np.float64)
        difference = reference - quants[seen]
        # Maxima are exact on every path (float64 differences, no rounding in a max).
        assert row["propagated_max_abs"] == float(np.max(np.abs(difference))), row["node"]
        noise, signal = np.linalg.norm(difference), np.linalg.norm(reference)
        if noise > 0:
            assert row["sqnr_db"] == pytest.approx(20 * np.log10(signal / noise), rel=1e-12), row["node"]
        if clip is None:
            assert row["clipped"] is None, row["node"]
        else:
            (produced,) = [n.output[0] for n in quant_model.graph.node if n.name == row["node"]]
            values = quants[produced].astype(np.float64)
            assert row["clipped"] == np.mean((values < clip[0]) | (values > clip[1])), row["node"]
        checked += 1
    assert checked == len(answer["ops"]) > 20
    (y,) = [o.name for o in quant_model.graph.output]
    assert answer["outputs"][y] == float(np.max(np.abs(floats[y].astype(np.float64) - quants[y])))


def outward_rounded_range():
    """An int8 scale and zero point whose range [lo, hi] has float32(lo) < lo and
    float32(hi) > hi: the float32 values just outside, where a float32 count can slip."""
    for zero in range(1, 60):
        for scale in np.linspace(0.01, 0.02, 201, dtype=np.float32):
            lo, hi = (-128 - zero) * float(scale), (127 - zero) * float(scale)
            if float(np.float32(lo)) < lo and float(np.float32(hi)) > hi:
                return scale, zero, lo, hi
    raise AssertionError("no such range")


@pytest.mark.parametrize("settings", PATHS)
def test_clipped_counts_float32_values_just_outside_the_range(tmp_path, settings, monkeypatch):
    # On PP-OCRv4 det, counting in the graph against float32 bounds made from
    # Python floats missed such values: 8 of 292 rows said 0.0 (up to 0.246).
    scale, zero, lo, hi = outward_rounded_range()
    just_out = [np.float32(lo), np.float32(hi)]
    just_in = [np.nextafter(np.float32(lo), np.float32(0)), np.nextafter(np.float32(hi), np.float32(0)), 0]
    values = np.array(just_out + just_in, np.float32)
    neg = helper.make_node("Neg", ["x"], ["t"], name="neg")
    qdq = [
        helper.make_node("QuantizeLinear", ["t", "s", "z"], ["t_q"], name="q"),
        helper.make_node("DequantizeLinear", ["t_q", "s", "z"], ["y"], name="dq"),
    ]
    io = ([helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5])],)
    out = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [1, 5]) for t in ("t", "y")]
    qparams = [numpy_helper.from_array(np.array(scale), "s"), numpy_helper.from_array(np.array(zero, np.int8), "z")]
    opset = [helper.make_opsetid("", 17)]
    onnx.save(helper.make_model(helper.make_graph([neg], "a", *io, out[:1]), opset_imports=opset), tmp_path / "a.onnx")
    onnx.save(
        helper.make_model(helper.make_graph([neg, *qdq], "b", *io, out[1:], qparams), opset_imports=opset),
        tmp_path / "b.onnx",
    )
    np.savez(tmp_path / "x.npz", x=-values[None])
    set_trace_limits(monkeypatch, settings)
    answer = graphscan.trace(str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx"), inputs=str(tmp_path / "x.npz"))
    wide = values.astype(np.float64)
    assert np.count_nonzero((wide < lo) | (wide > hi)) == 2  # the ends really are outside, in float64
    assert [row["clipped"] for row in answer["ops"]] == [2 / 5]


@pytest.mark.parametrize("settings", PATHS)
def test_an_output_that_is_an_initializer_is_measured_on_every_path(tmp_path, settings, monkeypatch):
    # No session writes it: split into sessions, it was never handed to the measuring
    # and came out null, as if it could not be compared.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("y", [1, 8]), ("k", [2]))]
    k = numpy_helper.from_array(np.array([1.5, -2.0], np.float32), "k")
    scale, zero = (
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
    )
    neg = helper.make_node("Neg", ["x"], ["t"], name="neg")
    relu = helper.make_node("Relu", ["t"], ["y"], name="relu")
    qdq = [
        helper.make_node("QuantizeLinear", ["t", "s", "z"], ["t_q"], name="q"),
        helper.make_node("DequantizeLinear", ["t_q", "s", "z"], ["t_dq"], name="dq"),
        helper.make_node("Relu", ["t_dq"], ["y"], name="relu"),
    ]
    opset = [helper.make_opsetid("", 17)]
    onnx.save(
        helper.make_model(helper.make_graph([neg, relu], "a", [x], outputs, [k]), opset_imports=opset),
        tmp_path / "a.onnx",
    )
    onnx.save(
        helper.make_model(helper.make_graph([neg, *qdq], "b", [x], outputs, [k, scale, zero]), opset_imports=opset),
        tmp_path / "b.onnx",
    )
    np.savez(tmp_path / "x.npz", x=np.linspace(-1, 1, 8, dtype=np.float32)[None])
    set_trace_limits(monkeypatch, settings)
    answer = graphscan.trace(str(tmp_path / "a.onnx"), str(tmp_path / "b.onnx"), inputs=str(tmp_path / "x.npz"))
    assert answer["outputs"]["k"] == 0.0
    assert answer["outputs"]["y"] > 0


@pytest.fixture(scope="module")
def float16_pair(tmp_path_factory):
    """x -> Mul -> Q -> DQ -> Neg in float16, and its float twin: onnxruntime runs the
    float16 Neg in float32 between Casts of its own."""
    folder = tmp_path_factory.mktemp("f16")
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT16, [3, 5]) for n in ("x", "y"))
    opset = [helper.make_opsetid("", 19)]

    def model(factor, middle, inits=()):
        nodes = [helper.make_node("Mul", ["x", "c"], ["m"], name="mul"), *middle]
        c = numpy_helper.from_array(np.array(factor, np.float16), "c")
        return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [c, *inits]), opset_imports=opset)

    qparams = [
        numpy_helper.from_array(np.array(0.07, np.float16), "s"),
        numpy_helper.from_array(np.array(3, np.int8), "z"),
    ]
    quantized = [
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["m_q"], name="q"),
        helper.make_node("DequantizeLinear", ["m_q", "s", "z"], ["m_dq"], name="dq"),
        helper.make_node("Neg", ["m_dq"], ["y"], name="neg"),
    ]
    onnx.save(model(3, [helper.make_node("Neg", ["m"], ["y"], name="neg")]), folder / "a.onnx")
    onnx.save(model(2.9, quantized, qparams), folder / "b.onnx")
    np.savez(folder / "x.npz", x=(np.random.default_rng(2).standard_normal((3, 5)) * 4).astype(np.float16))
    return [str(folder / name) for name in ("a.onnx", "b.onnx", "x.npz")]


@pytest.mark.parametrize("settings", PATHS[1:])
def test_float16_rows_measure_the_same_on_every_path(float16_pair, settings, monkeypatch):
    # Measured in the graph, onnxruntime merged its own Cast back to float16 with
    # graphscan's Cast to double, and the Neg row's maximum lost float16 rounding
    # (20.12591552734375 where numpy gives 20.125).
    a, b, x = float16_pair
    fetched = graphscan.trace(a, b, inputs=x)
    set_trace_limits(monkeypatch, settings)
    measured = graphscan.trace(a, b, inputs=x)["ops"]
    assert [r["node"] for r in measured] == ["mul", "neg"]
    for got, want in zip(measured, fetched["ops"], strict=True):
        exact = ("isolated_max_abs", "propagated_max_abs", "clipped")
        assert [got[k] for k in exact] == [want[k] for k in exact], got["node"]
        assert got["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-12), got["node"]


@pytest.mark.parametrize("budget", [1, 2**40], ids=["measured-beside-the-sessions", "measured-after-one-session"])
def test_running_out_of_memory_while_measuring_is_exit_5(cnn, budget, monkeypatch):
    # With many sessions, what each fetches is measured on a second thread: its
    # failure must reach the user as the same one line, not be lost with the thread.
    def no_memory(*args):
        raise MemoryError("measuring")

    monkeypatch.setattr(combined, "TRACE_FETCH_BUDGET", budget)
    monkeypatch.setattr(measures, "error_stats", no_memory)
    with pytest.raises(graphscan.GraphscanError) as raised:
        graphscan.trace(str(cnn["float"]), str(cnn["quant"]), inputs=str(cnn["npz"]))
    assert raised.value.exit_code == graphscan.EXIT_RUNTIME
    assert "out of memory (measuring)" in str(raised.value)


@pytest.mark.parametrize("settings", PATHS[1:])
def test_reduced_isolated_errors_equal_the_fetched_ones(cnn, settings, monkeypatch):
    fetched = graphscan.trace(str(cnn["float"]), str(cnn["quant"]), inputs=str(cnn["npz"]))
    set_trace_limits(monkeypatch, settings)
    reduced = graphscan.trace(str(cnn["float"]), str(cnn["quant"]), inputs=str(cnn["npz"]))
    for a, b in zip(fetched["ops"], reduced["ops"], strict=True):
        assert a["isolated_max_abs"] == b["isolated_max_abs"], a["node"]  # a max is exact either way
        assert a["isolated_lsb"] == b["isolated_lsb"], a["node"]


def peak_rss(args, wrapper):
    """Peak RSS (bytes) of one whole process, through the benchmark's measuring wrapper."""
    done = run_graphscan(["--measure", sys.executable, *map(str, args)], script=wrapper)
    assert done.returncode == 0, done.stderr
    import json

    result = json.loads(done.stdout)
    assert result["exit"] == 0, result
    return result["peak_rss"]


def test_peak_memory_stays_within_three_times_running_both_models(tmp_path):
    # 400 ops of 256 KiB: keeping every tensor, as trace once did, needs about
    # 400 x 4 x 256 KiB = 400 MB over onnxruntime's own ~70 MB.
    bench = load_bench_script("bench_trace_memory")
    float_model, quant_model = bench.chain_models(400, 65536)
    paths = [tmp_path / "chain.onnx", tmp_path / "chain_qdq.onnx"]
    onnx.save(float_model, paths[0])
    onnx.save(quant_model, paths[1])
    wrapper = bench.THIS_FILE
    both = peak_rss([wrapper, "--run-both", *paths, "x=1,65536"], wrapper)
    traced = peak_rss([GRAPHSCAN, "trace", *paths], wrapper)
    assert traced <= 3 * both, f"trace {traced / 2**20:.0f} MB, both models once {both / 2**20:.0f} MB"


def test_the_levels_of_many_big_tensors_keep_trace_within_three_times_running_both_models(tmp_path):
    # 20 ops of 8 MiB, each quantized: fetching the float model's tensors 64 at a time to
    # measure their levels held all 20 at once (160 MiB over both runs' ~100 MB: 3.4x);
    # reduced inside the float model's run, each is gone once its min and max are taken.
    bench = load_bench_script("bench_trace_memory")
    width = 2**21
    float_model, quant_model = bench.chain_models(20, width)
    paths = [tmp_path / "chain.onnx", tmp_path / "chain_qdq.onnx"]
    onnx.save(float_model, paths[0])
    onnx.save(quant_model, paths[1])
    wrapper = bench.THIS_FILE
    both = peak_rss([wrapper, "--run-both", *paths, f"x=1,{width}"], wrapper)
    traced = peak_rss([GRAPHSCAN, "trace", *paths], wrapper)
    assert traced <= 3 * both, f"trace {traced / 2**20:.0f} MB, both models once {both / 2**20:.0f} MB"


def tile_chain(width):
    """x [1, 16] tiled to [1, 16 * width] floats, then Relu: tiny input, big activations."""
    repeats = numpy_helper.from_array(np.array([1, width], np.int64), "repeats")
    nodes = [
        helper.make_node("Tile", ["x", "repeats"], ["big"], name="tile"),
        helper.make_node("Relu", ["big"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "tile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16 * width])],
        [repeats],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def address_space_of_onnxruntime(tmp_path):
    """VmPeak of a process that imports graphscan and runs a tiny model in onnxruntime."""
    path = tmp_path / "tiny.onnx"
    onnx.save(tile_chain(1), path)
    code = (
        "import sys, numpy as np, onnxruntime as ort, graphscan;"
        "ort.InferenceSession(sys.argv[1]).run(None, {'x': np.zeros((1, 16), np.float32)});"
        "print([l for l in open('/proc/self/status') if l.startswith('VmPeak')][0].split()[1])"
    )
    done = run_graphscan([path], python_flags=["-c", code], script=str(path), cwd=GRAPHSCAN.rsplit("/", 1)[0])
    assert done.returncode == 0, done.stderr
    return int(done.stdout) * 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and RLIMIT_AS")
def test_out_of_memory_says_so_and_names_the_combined_model(tmp_path):
    limit = address_space_of_onnxruntime(tmp_path) + 400 * 2**20
    path = tmp_path / "tile.onnx"
    onnx.save(tile_chain(2**24), path)  # 256 M floats: 1 GiB per activation, over the limit
    code = (
        "import resource, runpy, sys;"
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}));"
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    done = run_graphscan(["trace", path, path], python_flags=["-c", code])
    line = error_line(done, graphscan.EXIT_RUNTIME)
    assert "out of memory" in line
    assert f"graphscan's combined model of {path} and {path}" in line
    assert "does not run" not in line
    assert resource.RLIMIT_AS  # the limit the child ran under exists on this platform
