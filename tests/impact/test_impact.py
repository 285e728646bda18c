"""graphscan.py impact: the output SQNR each op or tensor would give back if it stayed float.

Expected values come from tests/impact_reference.py, a brute force written from
issue 9's definitions (one plain onnx edit and one onnxruntime session per
variant), never from graphscan itself. The models: the lab MLP (one weight scale
made 3x too large), a small residual CNN, and a two-output model whose widest
branch is scaled by 1e-3 before it reaches the output.
"""

import math
import threading
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gen_models
import graphscan
import graphscan_ort.engines.attribution as attribution
import graphscan_ort.engines.segments as segment_engine
import graphscan_ort.shared.graph as graph_edit
import graphscan_ort.shared.metrics as metrics
import graphscan_ort.shared.sessions as sessions
from graphscan_ort.shared.options import Named
from tests import impact_reference as reference
from tests import parts_models
from tests.helpers import error_line, json_answer, run_graphscan, run_onnx, with_weight_scale_times
from tests.lab import TRACE_LAB

FAULTY = "fc2_matmul"
TOLERANCE_DB = 0.05  # issue 9: graphscan equals the brute force within 0.05 dB on every row
ANSWER_KEYS = [
    "a",
    "b",
    "inputs",
    "defaulted",
    "samples",
    "output_sqnr_db",
    "pooled_sqnr_db",
    "worst_part",
    "deployed_output_sqnr_db",
    "weights",
    "warnings",
    "ops",
    "tensors",
]
OP_KEYS = ["node", "op_type", "sqnr_db", "gain_db"]
TENSOR_KEYS = [
    "tensor",
    "producer",
    "consumers",
    "sqnr_db",
    "gain_db",
    "rounding_sqnr_db",
    "rounding_gain_db",
    "clipped",
]


def write_samples(folder, shapes, count, seed, scale=1.0):
    """``count`` .npz files of seeded normal data times ``scale``, ``{input: shape}`` each."""
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(count):
        path = folder / f"sample{k}.npz"
        arrays = {name: (rng.standard_normal(shape) * scale).astype(np.float32) for name, shape in shapes.items()}
        np.savez(path, **arrays)
        paths.append(path)
    return paths


def load_samples(paths):
    return [dict(np.load(p)) for p in paths]


def quantized(folder, model, name):
    """``(float path, quantized path)``: ``model`` saved and quantized the lab's way."""
    fp32, quant = folder / f"{name}_fp32.onnx", folder / f"{name}_qdq.onnx"
    onnx.save(model, fp32)
    gen_models.quantize_qdq(fp32, quant, seed=0)
    return fp32, quant


def branches_model():
    """y = x@W_wide * 1e-3 + x@W_narrow, z = (x@W_narrow)@W_head.

    The wide branch's values are ~100x larger than anything else, so trace's
    absolute isolated error is by far the largest there; a later Mul by 1e-3
    makes its effect on the output negligible.
    """
    rng = np.random.default_rng(3)
    dim = 16
    inits = [
        numpy_helper.from_array((rng.standard_normal((dim, dim)) * 100).astype(np.float32), "w_wide"),
        numpy_helper.from_array((rng.standard_normal((dim, dim)) / 4).astype(np.float32), "w_narrow"),
        numpy_helper.from_array((rng.standard_normal((dim, dim)) / 4).astype(np.float32), "w_head"),
        numpy_helper.from_array(np.array(1e-3, np.float32), "tiny"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w_wide"], ["wide"], name="wide_matmul"),
        helper.make_node("Mul", ["wide", "tiny"], ["wide_scaled"], name="wide_scale"),
        helper.make_node("MatMul", ["x", "w_narrow"], ["narrow"], name="narrow_matmul"),
        helper.make_node("Add", ["wide_scaled", "narrow"], ["y"], name="join"),
        helper.make_node("MatMul", ["narrow", "w_head"], ["z"], name="head_matmul"),
    ]
    shape = ["N", dim]
    graph = helper.make_graph(
        nodes,
        "branches",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, shape),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", gen_models.OPSET)])


@pytest.fixture(scope="module")
def faulty(trace_lab, tmp_path_factory):
    """full.onnx with fc2_matmul's weight scale multiplied by 3 (values 3x too large)."""
    return with_weight_scale_times(trace_lab["full"], FAULTY, 3, tmp_path_factory.mktemp("faulty") / "faulty.onnx")


@pytest.fixture(scope="module")
def mlp_samples(tmp_path_factory):
    """Three samples of 8 rows: several --inputs files make one measurement.

    Half the calibration data's spread, so values stay inside the calibrated
    ranges: full.onnx is then good (~30 dB) and one broken scale stands out.
    """
    return write_samples(tmp_path_factory.mktemp("mlp_samples"), {"x": (8, TRACE_LAB.dim)}, 3, seed=5, scale=0.5)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A small residual CNN (Conv, BatchNorm, Relu, Add, Resize, Concat, Gemm), quantized."""
    folder = tmp_path_factory.mktemp("cnn")
    fp32, quant = quantized(folder, gen_models.build_cnn(blocks=2, channels=4, size=8), "cnn")
    return fp32, quant, write_samples(folder, {"x": (1, 3, 8, 8)}, 2, seed=7)


@pytest.fixture(scope="module")
def branches(tmp_path_factory):
    """The two-output model with a wide branch scaled by 1e-3, quantized."""
    folder = tmp_path_factory.mktemp("branches")
    fp32, quant = quantized(folder, branches_model(), "branches")
    return fp32, quant, write_samples(folder, {"x": (8, 16)}, 2, seed=9)


def close(actual, expected):
    if expected is None or actual is None:
        return actual is expected
    return abs(actual - expected) <= TOLERANCE_DB


BRUTE_FORCES = {}  # one reference per (models, samples): several tests check the same one


def brute_force(a, b, sample_paths):
    """reference.py's impact of ``b`` against ``a``, computed once per files and samples."""
    key = (str(a), str(b), tuple(map(str, sample_paths)))
    if key not in BRUTE_FORCES:
        BRUTE_FORCES[key] = reference.reference_impact(onnx.load(a), onnx.load(b), load_samples(sample_paths))
    return BRUTE_FORCES[key]


def assert_equals_brute_force(a, b, sample_paths):
    answer = graphscan.impact(str(a), str(b), inputs=[str(p) for p in sample_paths])
    brute = brute_force(a, b, sample_paths)
    baseline = brute["baseline"]
    assert close(answer["output_sqnr_db"], baseline), (answer["output_sqnr_db"], baseline)
    assert sorted(r["node"] for r in answer["ops"]) == sorted(brute["ops"])
    for row in answer["ops"]:
        assert close(row["sqnr_db"], brute["ops"][row["node"]]), (row, brute["ops"][row["node"]])
        assert close(row["gain_db"], brute["ops"][row["node"]] - baseline), row
    assert sorted(r["tensor"] for r in answer["tensors"]) == sorted(brute["tensors"])
    for row in answer["tensors"]:
        kept, rounded, clipped = brute["tensors"][row["tensor"]]
        assert close(row["sqnr_db"], kept), (row, kept)
        assert close(row["rounding_sqnr_db"], rounded), (row, rounded)
        assert math.isclose(row["clipped"], clipped, abs_tol=1e-12), (row, clipped)
    return answer, brute


# Which version of a switched segment runs is the runner's choice by timing;
# each choice is forced here, and the answers must be the same.
VERSION_POLICIES = {
    "group-versions": lambda self, j, wanted: wanted,
    "full-versions": lambda self, j, wanted: (
        segment_engine.PLAIN if wanted == segment_engine.PLAIN else segment_engine.FULL
    ),
}


@pytest.mark.parametrize("policy", sorted(VERSION_POLICIES))
@pytest.mark.parametrize("model", ["lab-mlp", "faulty-mlp", "cnn", "two-outputs"])
def test_every_row_equals_the_brute_force(model, policy, trace_lab, faulty, mlp_samples, cnn, branches, monkeypatch):
    a, b, samples = {
        "lab-mlp": (trace_lab["fp32"], trace_lab["full"], mlp_samples),
        "faulty-mlp": (trace_lab["fp32"], faulty, mlp_samples),
        "cnn": cnn,
        "two-outputs": branches,
    }[model]
    runs = []
    real = attribution.ImpactRun.__init__

    def spy(self, *args):
        real(self, *args)
        runs.append(self)

    monkeypatch.setattr(attribution.ImpactRun, "__init__", spy)
    monkeypatch.setattr(segment_engine.SegmentRunner, "version", VERSION_POLICIES[policy])
    answer, _ = assert_equals_brute_force(a, b, samples)
    # The rows were measured through the chain of segment sessions, in the
    # versions the policy picks, not through the one-segment fallback.
    (run,) = runs
    assert len(run.runner.plan.chunks) > 1
    assert run.runner.plan.selections  # the weights' Wheres are bindings
    built = [(j, version) for kind, j, version in run.runner.seconds if kind == "build"]
    assert not run.runner.sessions  # closed once impact answered
    versions = {version for _, version in built}
    assert any(isinstance(j, tuple) for j, _ in built)  # a plain tail as one session
    if policy == "group-versions":
        assert segment_engine.FULL not in versions and any(isinstance(v, int) for v in versions), versions
    else:
        assert versions == {segment_engine.PLAIN, segment_engine.FULL}, versions
    assert answer["samples"] == len(samples)
    gains = [r["gain_db"] for r in answer["ops"]]
    assert gains == sorted(gains, reverse=True)


def test_group_versions_only_when_the_machinery_costs_more_than_a_build(trace_lab, mlp_samples):
    """The timing rule: a group's version is built once the full version's
    extra run time, over all samples and twice, exceeds its build time."""
    float_model, quant_model = onnx.load(trace_lab["fp32"]), onnx.load(trace_lab["full"])
    samples = load_samples(mlp_samples)
    noise = metrics.OutputNoise(sessions.model_outputs(float_model, samples, "a"))
    runner = attribution.ImpactRun(float_model, quant_model, samples, ["y"], noise, "b").runner
    assert runner.version(0, segment_engine.PLAIN) == segment_engine.PLAIN
    assert runner.version(0, 3) == segment_engine.FULL  # the full version has not run yet
    runner.seconds.update(
        {
            ("run", 0, segment_engine.PLAIN): 0.001,
            ("build", 0, segment_engine.FULL): 0.05,
        }
    )
    runner.seconds["run", 0, segment_engine.FULL] = 0.001 + 0.05 / (2 * len(samples)) * 0.9
    assert runner.version(0, 3) == segment_engine.FULL
    runner.seconds["run", 0, segment_engine.FULL] = 0.001 + 0.05 / (2 * len(samples)) * 1.1
    assert runner.version(0, 3) == 3


def test_scaled_weight_makes_its_matmul_the_top_op(trace_lab, faulty, mlp_samples):
    answer = graphscan.impact(str(trace_lab["fp32"]), str(faulty), inputs=[str(p) for p in mlp_samples])
    top, second = answer["ops"][:2]
    assert top["node"] == FAULTY
    assert top["gain_db"] > 10.0, top  # tens of dB: the 3x scale ruins the output
    assert top["gain_db"] - second["gain_db"] > 10.0, (top, second)


def test_absorbed_relu_is_restored(trace_lab, mlp_samples):
    """fc1_out is a Relu's output in fp32 but the Add's in full.onnx: the
    quantizer folded the Relu into the Q. float(t) must put it back; dropping it
    (what a plain 'read t instead' would do) passes negatives on and is far worse."""
    a, b = onnx.load(trace_lab["fp32"]), onnx.load(trace_lab["full"])
    assert reference.absorbed(a, b, "fc1_out").op_type == "Relu"
    answer = graphscan.impact(str(trace_lab["fp32"]), str(trace_lab["full"]), inputs=[str(p) for p in mlp_samples])
    (row,) = [r for r in answer["tensors"] if r["tensor"] == "fc1_out"]
    assert row["gain_db"] > -0.5, row
    samples = load_samples(mlp_samples)
    without_relu = onnx.ModelProto()
    without_relu.CopyFrom(b)
    for node in without_relu.graph.node:
        node.input[:] = ["fc1_out" if t == "fc1_out_DequantizeLinear_Output" else t for t in node.input]
    dropped = reference.sqnr(reference.float_outputs(a, b, samples), reference.run(without_relu, samples))
    assert dropped < row["sqnr_db"] - 3.0, (dropped, row)


def test_trace_worst_op_has_no_output_impact(branches):
    """The two rankings differ on purpose: trace's worst isolated error is the
    wide branch, whose effect on the output the 1e-3 Mul removes."""
    a, b, samples = branches
    traced = graphscan.trace(str(a), str(b), inputs=str(samples[0]))
    assert traced["worst_isolated"]["node"] == "wide_matmul"
    answer = graphscan.impact(str(a), str(b), inputs=[str(p) for p in samples])
    rows = {r["node"]: r for r in answer["ops"]}
    assert abs(rows["wide_matmul"]["gain_db"]) < 0.5, rows["wide_matmul"]
    assert answer["ops"][0]["node"] != "wide_matmul"
    assert answer["ops"][0]["gain_db"] > rows["wide_matmul"]["gain_db"] + 1.0


def test_exclusion_equals_an_independent_run(trace_lab, faulty, mlp_samples):
    a, b = onnx.load(trace_lab["fp32"]), onnx.load(faulty)
    samples = load_samples(mlp_samples)
    expected_float = reference.float_outputs(a, b, samples)
    paths = [str(p) for p in mlp_samples]
    base = graphscan.impact(str(trace_lab["fp32"]), str(faulty), inputs=paths)
    target = base["output_sqnr_db"] + 10.0
    answer = graphscan.impact(str(trace_lab["fp32"]), str(faulty), inputs=paths, target_sqnr=target)
    exclude = answer["exclude"]
    assert exclude["reached"] is True and exclude["nodes"][0] == FAULTY, exclude
    assert exclude["sqnr_db"] >= target
    independent = reference.sqnr(
        expected_float, reference.run(reference.unquantize_ops(a, b, exclude["nodes"]), samples)
    )
    assert close(exclude["sqnr_db"], independent), (exclude, independent)

    impossible = graphscan.impact(str(trace_lab["fp32"]), str(faulty), inputs=paths, target_sqnr=300.0)["exclude"]
    positive = [r["node"] for r in base["ops"] if r["gain_db"] > 0]
    assert impossible["reached"] is False
    assert impossible["nodes"] == positive  # every op with a gain was tried, in rank order
    independent = reference.sqnr(expected_float, reference.run(reference.unquantize_ops(a, b, positive), samples))
    assert close(impossible["sqnr_db"], independent), (impossible, independent)

    limited = graphscan.impact(str(trace_lab["fp32"]), str(faulty), inputs=paths, target_sqnr=300.0, max_exclude=1)
    assert limited["exclude"]["nodes"] == [FAULTY] and limited["exclude"]["reached"] is False


def test_top_limits_the_lists_not_the_measurement(trace_lab, faulty, mlp_samples):
    paths = [str(p) for p in mlp_samples]
    full = graphscan.impact(str(trace_lab["fp32"]), str(faulty), inputs=paths)
    top = graphscan.impact(str(trace_lab["fp32"]), str(faulty), inputs=paths, top=2, target_sqnr=300.0)
    assert top["ops"] == full["ops"][:2] and top["tensors"] == full["tensors"][:2]
    assert len(full["ops"]) > 2
    # The exclusion still walks every op with a gain, not just the two listed.
    assert len(top["exclude"]["nodes"]) == len([r for r in full["ops"] if r["gain_db"] > 0])


@pytest.mark.parametrize("model", ["faulty-mlp", "cnn"])
def test_the_ops_ranking_alone_equals_impacts_and_runs_no_tensor_variant(
    model, trace_lab, faulty, mlp_samples, cnn, monkeypatch
):
    """tune's ranking (ranked_ops) is impact's ``ops`` row for row, made without the
    tensors' runs, their value statistics or the deployed figure: one run per operator
    variant and the baseline, nothing more."""
    a, b, paths = {"faulty-mlp": (trace_lab["fp32"], faulty, mlp_samples), "cnn": cnn}[model]
    samples = load_samples(paths)
    expected = graphscan.impact(str(a), str(b), inputs=[str(p) for p in paths])["ops"]
    runs, stats_read, impact_runs = [], [], []
    real_run, real_stats, real_init = (
        segment_engine.SegmentRunner.run,
        attribution.tensor_stats,
        attribution.ImpactRun.__init__,
    )
    monkeypatch.setattr(segment_engine.SegmentRunner, "run", lambda self, s=None: runs.append(s) or real_run(self, s))
    monkeypatch.setattr(
        attribution.ImpactRun, "__init__", lambda self, *args: impact_runs.append(self) or real_init(self, *args)
    )
    monkeypatch.setattr(attribution, "tensor_stats", lambda *args: stats_read.append(args) or real_stats(*args))
    monkeypatch.setattr(attribution, "paired_outputs", lambda *args: pytest.fail("the deployed figure was measured"))
    ranked = attribution.ranked_ops(Named(onnx.load(a), str(a)), Named(onnx.load(b), str(b)), samples)
    assert ranked == expected
    assert not stats_read
    (run,) = impact_runs
    distinct = {attribution.variant_key(v) for v in run.op_variants} - {attribution.variant_key({})}
    assert len(distinct) > 1
    assert sorted(map(attribution.variant_key, runs)) == sorted([attribution.variant_key({}), *distinct])


def test_value_statistics_fetched_a_few_tensors_a_run_are_those_of_one_run(cnn, monkeypatch):
    """impact's value statistics (clipped, finite, least and greatest) fetch the tensors
    TENSORS_PER_RUN a run, one sample at a time: with 3 a run, no run fetches more than 3 and
    every statistic equals the one all tensors fetched in a single run give, each value
    counted once as numpy counts them."""
    _, quant, paths = cnn
    samples, model = load_samples(paths), onnx.load(quant)
    ranges = {t: (-1.0, 1.0, 8) for node in model.graph.node for t in node.output if node.op_type != "Constant"}
    ranges["x"] = (-2.0, 2.0, 8)  # a graph input: counted from the samples themselves
    monkeypatch.setattr(attribution, "TENSORS_PER_RUN", 10**6)
    whole = attribution.tensor_stats(model, samples, ranges, quant)
    # Counted once each, as numpy counts the values of one session answering every tensor.
    every = onnx.ModelProto()
    every.CopyFrom(model)
    every.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in ranges if t != "x")
    path = quant.parent / "every_tensor.onnx"
    onnx.save(every, path)
    values = [dict(zip([o.name for o in every.graph.output], run_onnx(path, s), strict=True)) for s in samples]
    fetched = []
    real_run = sessions.ort.InferenceSession.run

    def counted(self, names, feeds, *rest):
        fetched.append(len(names))
        return real_run(self, names, feeds, *rest)

    monkeypatch.setattr(attribution, "TENSORS_PER_RUN", 3)
    monkeypatch.setattr(sessions.ort.InferenceSession, "run", counted)
    grouped = attribution.tensor_stats(model, samples, ranges, quant)
    computed = len(ranges) - 1
    assert max(fetched) == 3 and len(fetched) == math.ceil(computed / 3) * len(samples)
    key = ("total", "outside", "finite", "dtype", "low", "high")
    assert {t: [getattr(s, k) for k in key] for t, s in grouped.items()} == {
        t: [getattr(s, k) for k in key] for t, s in whole.items()
    }
    for t, (lo, hi, _) in ranges.items():
        arrays = [s[t] for s in samples] if t == "x" else [v[t] for v in values]
        assert grouped[t].total == sum(a.size for a in arrays), t
        assert grouped[t].outside == sum(int(np.count_nonzero((a < lo) | (a > hi))) for a in arrays), t


def test_by_subprocess_strict_json(trace_lab, faulty, mlp_samples, tmp_path):
    args = ["impact", trace_lab["fp32"], faulty]
    for path in mlp_samples:
        args += ["--inputs", path]
    answer = json_answer(run_graphscan(args + ["--top", "3", "--target-sqnr", "40"], cwd=tmp_path))
    assert list(answer) == ANSWER_KEYS + ["exclude"]
    assert answer["a"] == str(trace_lab["fp32"]) and answer["samples"] == 3
    assert answer["inputs"] == {"x": [8, TRACE_LAB.dim]} and answer["defaulted"] == []
    assert all(list(r) == OP_KEYS for r in answer["ops"]) and len(answer["ops"]) == 3
    assert all(list(r) == TENSOR_KEYS for r in answer["tensors"])
    assert list(answer["exclude"]) == ["target_sqnr_db", "nodes", "sqnr_db", "reached"]


def test_default_shape_is_reported(trace_lab, tmp_path):
    seeded = json_answer(run_graphscan(["impact", trace_lab["fp32"], trace_lab["full"], "--seed", "3"], cwd=tmp_path))
    assert seeded["inputs"] == {"x": [1, TRACE_LAB.dim]} and seeded["defaulted"] == ["x"]
    assert "exclude" not in seeded
    shaped = graphscan.impact(str(trace_lab["fp32"]), str(trace_lab["full"]), shape=["x=5,16"])
    assert shaped["inputs"] == {"x": [5, TRACE_LAB.dim]} and shaped["defaulted"] == []


@pytest.mark.parametrize(
    ("options", "code"),
    [
        pytest.param(["--top", "-1"], 2, id="negative-top"),
        pytest.param(["--target-sqnr", "nan"], 2, id="nan-target"),
        pytest.param(["--target-sqnr", "inf"], 2, id="infinite-target"),
        pytest.param(["--max-exclude", "2"], 2, id="max-exclude-without-target"),
        pytest.param(["--target-sqnr", "10", "--max-exclude", "-3"], 2, id="negative-max-exclude"),
        pytest.param(["--shape", "x=a,b"], 7, id="unreadable-shape"),
        pytest.param(["--shape", "x=2,3"], 7, id="shape-against-declared"),
        pytest.param(["--inputs", "MISSING_INPUT_NPZ"], 7, id="npz-lacks-input"),
        pytest.param(["--inputs", "NOT_AN_NPZ"], 7, id="not-an-npz"),
    ],
)
def test_errors(trace_lab, tmp_path, options, code):
    missing = tmp_path / "other.npz"
    np.savez(missing, y=np.zeros((1, TRACE_LAB.dim), np.float32))
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    options = [{"MISSING_INPUT_NPZ": missing, "NOT_AN_NPZ": garbage}.get(o, o) for o in options]
    line = error_line(run_graphscan(["impact", trace_lab["fp32"], trace_lab["full"], *options], cwd=tmp_path), code)
    assert "Traceback" not in line


def test_broken_derived_model_is_named_as_graphscans(trace_lab, monkeypatch):
    """A derived model that fails is blamed on graphscan, not on the user's model (exit 5)."""
    real = attribution.switched_model

    def broken(plan, quant_model, float_model, prefix):
        model, *rest = real(plan, quant_model, float_model, prefix)
        model.graph.node[0].op_type = "NoSuchOperator"
        return (model, *rest)

    monkeypatch.setattr(attribution, "switched_model", broken)
    with pytest.raises(graphscan.GraphscanError) as caught:
        graphscan.impact(str(trace_lab["fp32"]), str(trace_lab["full"]))
    assert caught.value.exit_code == graphscan.EXIT_RUNTIME
    assert f"graphscan's derived model of {trace_lab['full']}" in str(caught.value)


def test_if_branches_reading_a_dequantized_tensor(tmp_path):
    """The If branches read r's DQ output from outside: keeping r float must reach
    them too. Reference: that DQ replaced by Relu's output, one session."""
    from tests.trace.test_control_flow import control_flow_model

    a, b = tmp_path / "float.onnx", tmp_path / "quant.onnx"
    onnx.save(control_flow_model(False), a)
    onnx.save(control_flow_model(True), b)
    sample = {"x": np.linspace(-1, 1, 4, dtype=np.float32)[None], "cond": np.array(True)}
    np.savez(tmp_path / "s.npz", **sample)
    answer = graphscan.impact(str(a), str(b), inputs=[str(tmp_path / "s.npz")])
    assert [r["node"] for r in answer["ops"]] == ["relu"]
    rows = {r["tensor"]: r for r in answer["tensors"]}
    assert sorted(rows) == ["r", "x"]
    quant = onnx.load(b)
    for node in quant.graph.node:
        if node.name == "r_dequantize":
            node.CopyFrom(helper.make_node("Identity", ["r"], ["r_dq"], name="r_dequantize"))
    expected = reference.sqnr(reference.run(onnx.load(a), [sample]), reference.run(quant, [sample]))
    assert close(rows["r"]["sqnr_db"], expected), (rows["r"], expected)


def test_derived_model_is_deterministic_and_prefixed(cnn):
    """Derived names come from the graph, never from the time: two builds are
    byte-identical, and every added node, input and initializer is graphscan's."""
    a, b, _ = cnn
    float_model, quant_model = onnx.load(a), onnx.load(b)

    sample = {"x": np.zeros((1, 3, 8, 8), np.float32)}

    def build():
        plan = attribution.ImpactPlan(float_model, quant_model)
        model, _, _, _ = attribution.switched_model(plan, quant_model, float_model)
        machinery = {n.name for n in model.graph.node if n.name.startswith("graphscan.")}
        segments = segment_engine.SegmentPlan(model, ["x"], set(), machinery, segment_engine.IMPACT_SEGMENTS, sample)
        assert len(segments.chunks) > 1
        types = {t: "tensor(float)" for node in model.graph.node for t in [*node.input, *node.output]}
        types.update({i.name: "tensor(float)" for i in model.graph.input})
        versions = [
            segments.segment_model(j, switched, types)[0].SerializeToString()
            for j in [None, *range(len(segments.chunks))]
            for switched in (segment_engine.PLAIN, segment_engine.FULL, 0)
        ]
        return model, versions

    (first, first_segments), (second, second_segments) = build(), build()
    assert first.SerializeToString() == second.SerializeToString()
    assert first_segments == second_segments
    original = {n.name for n in quant_model.graph.node}
    assert all(n.name in original or n.name.startswith("graphscan.") for n in first.graph.node)
    added_inputs = {i.name for i in first.graph.input} - {i.name for i in quant_model.graph.input}
    assert added_inputs and all(name.startswith("graphscan.") for name in added_inputs)
    added_inits = {i.name for i in first.graph.initializer} - {i.name for i in quant_model.graph.initializer}
    assert all(name.startswith("graphscan.") for name in added_inits)


def test_a_model_against_itself_is_exact(trace_lab, mlp_samples):
    """No quantization, no noise: the output SQNR is infinite (JSON's null), whatever segment a
    node runs in, and no operator or tensor has a gain to list."""
    answer = graphscan.impact(str(trace_lab["fp32"]), str(trace_lab["fp32"]), inputs=[str(p) for p in mlp_samples])
    assert answer["output_sqnr_db"] == answer["deployed_output_sqnr_db"] == math.inf
    assert answer["ops"] == [] and answer["tensors"] == []


def absorbed_pair():
    """A float model with a LeakyRelu and a Clip(0, 6), and a hand-written QDQ twin
    whose MatMuls write the activations' names, as a quantizer that folded them
    into the following Q would (onnxruntime's folds only Relu and Clip)."""
    rng = np.random.default_rng(4)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(0.0, np.float32), "low"),
        numpy_helper.from_array(np.array(6.0, np.float32), "high"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 8]) for n in ["leaky", "clipped"]]
    float_nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
        helper.make_node("LeakyRelu", ["m1"], ["leaky"], name="leaky_relu", alpha=0.2),
        helper.make_node("MatMul", ["x", "w2"], ["m2"], name="mm2"),
        helper.make_node("Clip", ["m2", "low", "high"], ["clipped"], name="clip"),
    ]
    qparams = [
        numpy_helper.from_array(np.array(0.05, np.float32), "sx"),
        numpy_helper.from_array(np.array(0.04, np.float32), "sa"),
        numpy_helper.from_array(np.array(-100, np.int8), "za"),
        numpy_helper.from_array(np.array(0.03, np.float32), "sc"),
        numpy_helper.from_array(np.array(-128, np.int8), "zc"),
        numpy_helper.from_array(np.array(0, np.int8), "z0"),
    ]

    def qdq(tensor, scale, zero, out):
        return [
            helper.make_node("QuantizeLinear", [tensor, scale, zero], [f"{tensor}_q"], name=f"{tensor}_quantize"),
            helper.make_node("DequantizeLinear", [f"{tensor}_q", scale, zero], [out], name=f"{tensor}_dequantize"),
        ]

    quant_nodes = (
        qdq("x", "sx", "z0", "x_dq")
        + [
            helper.make_node("MatMul", ["x_dq", "w1"], ["leaky_QuantizeLinear_Input"], name="mm1"),
            helper.make_node("MatMul", ["x_dq", "w2"], ["m2_folded"], name="mm2"),
            helper.make_node("Identity", ["m2_folded"], ["clipped_pre"], name="rename"),
        ]
        + qdq("leaky_QuantizeLinear_Input", "sa", "za", "leaky")
        + [
            helper.make_node("Relu", ["clipped_pre"], ["clipped_QuantizeLinear_Input"], name="not_a_clip"),
        ]
        + qdq("clipped_QuantizeLinear_Input", "sc", "zc", "clipped")
    )
    opset = [helper.make_opsetid("", gen_models.OPSET)]
    float_model = helper.make_model(helper.make_graph(float_nodes, "f", [x], outputs, inits), opset_imports=opset)
    quant_model = helper.make_model(
        helper.make_graph(quant_nodes, "q", [x], outputs, inits + qparams), opset_imports=opset
    )
    return float_model, quant_model


def test_absorbed_leaky_relu_and_clip_equal_the_brute_force(tmp_path):
    """float(t) re-applies a LeakyRelu (its own node) and a Clip (its bounds); the
    names end in _QuantizeLinear_Input, so the float producer is found without it."""
    float_model, quant_model = absorbed_pair()
    a, b = tmp_path / "float.onnx", tmp_path / "quant.onnx"
    onnx.save(float_model, a)
    onnx.save(quant_model, b)
    assert reference.absorbed(float_model, quant_model, "leaky_QuantizeLinear_Input").op_type == "LeakyRelu"
    assert reference.absorbed(float_model, quant_model, "clipped_QuantizeLinear_Input").op_type == "Clip"
    samples = write_samples(tmp_path, {"x": (4, 8)}, 2, seed=12)
    answer, _brute = assert_equals_brute_force(a, b, samples)
    rows = {r["tensor"]: r for r in answer["tensors"]}
    # Re-applied, the activations make their output float up to x's own rounding: the worst
    # output's SQNR rises by one of them and falls by neither.
    gains = [
        rows[t]["sqnr_db"] - answer["output_sqnr_db"]
        for t in ("leaky_QuantizeLinear_Input", "clipped_QuantizeLinear_Input")
    ]
    assert max(gains) > 0 and min(gains) >= 0


def grid_chain_model():
    """x -> Q -> DQ -> Relu -> Q -> DQ -> Neg -> Q -> DQ -> Mul(0.3) -> Q -> DQ -> y, and its float twin.

    int8, scale 0.5, zero point 0. Fed with x on the 0.5 grid, every Q -> DQ
    before the Mul is exact, so keeping any operator float changes nothing:
    all three rows gain exactly 0 dB. Only the last Q (0.3 x off the grid)
    makes noise, and an operator's own output Q -> DQ stays when it is
    un-quantized. Equal gains must keep graph order.
    """
    inits = [
        numpy_helper.from_array(np.array(0.5, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "zp"),
        numpy_helper.from_array(np.array(0.3, np.float32), "k"),
    ]
    chain = [("Relu", "relu", "a"), ("Neg", "neg", "b"), ("Mul", "mul", "c")]
    quant_nodes, float_nodes, tensor = [], [], "x"
    for k, (op, name, out) in enumerate(chain):
        quant_nodes += [
            helper.make_node("QuantizeLinear", [tensor, "s", "zp"], [f"{tensor}_q"], name=f"q{k}"),
            helper.make_node("DequantizeLinear", [f"{tensor}_q", "s", "zp"], [f"{tensor}_dq"], name=f"dq{k}"),
        ]
        operands = [f"{tensor}_dq", "k"] if op == "Mul" else [f"{tensor}_dq"]
        quant_nodes.append(helper.make_node(op, operands, [out], name=name))
        float_nodes.append(helper.make_node(op, [tensor, "k"] if op == "Mul" else [tensor], [out], name=name))
        tensor = out
    quant_nodes += [
        helper.make_node("QuantizeLinear", ["c", "s", "zp"], ["c_q"], name="q3"),
        helper.make_node("DequantizeLinear", ["c_q", "s", "zp"], ["y"], name="dq3"),
    ]
    float_nodes.append(helper.make_node("Identity", ["c"], ["y"], name="out"))
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 8])  # noqa: E731

    def model(nodes, initializers):
        graph = helper.make_graph(nodes, "chain", [value("x")], [value("y")], initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    return model(float_nodes, inits[2:]), model(quant_nodes, inits)


def test_equal_gains_keep_graph_order(tmp_path):
    float_model, quant_model = grid_chain_model()
    onnx.save(float_model, tmp_path / "f.onnx")
    onnx.save(quant_model, tmp_path / "q.onnx")
    np.savez(tmp_path / "x.npz", x=np.array([[-2.0, -1.5, -0.5, 0.0, 0.5, 1.0, 2.5, 3.0]], np.float32))
    answer = graphscan.impact(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), inputs=[str(tmp_path / "x.npz")])
    assert answer["output_sqnr_db"] is not None  # the last Q makes noise
    assert [(r["node"], r["gain_db"]) for r in answer["ops"]] == [("relu", 0.0), ("neg", 0.0), ("mul", 0.0)]


def test_outputs_named_differently_are_paired_by_position(tmp_path):
    """Float outputs z = Relu(x), a = Neg(x); the quantized model names them q
    and p. Paired by position (z-q, a-p), the SQNR is the one numpy gives."""
    inits = [
        numpy_helper.from_array(np.array(0.25, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "zp"),
    ]
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 8])  # noqa: E731
    float_graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["z"], name="relu"), helper.make_node("Neg", ["x"], ["a"], name="neg")],
        "f",
        [value("x")],
        [value("z"), value("a")],
    )
    quant_graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["x_q"], name="xq"),
            helper.make_node("DequantizeLinear", ["x_q", "s", "zp"], ["x_dq"], name="xdq"),
            helper.make_node("Relu", ["x_dq"], ["q"], name="relu"),
            helper.make_node("Neg", ["x_dq"], ["p"], name="neg"),
        ],
        "q",
        [value("x")],
        [value("q"), value("p")],
        inits,
    )
    for graph, name in [(float_graph, "f.onnx"), (quant_graph, "q.onnx")]:
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / name)
    x = np.array([[-1.1, -0.6, -0.1, 0.2, 0.35, 0.9, 1.3, 2.05]], np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    answer = graphscan.impact(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), inputs=[str(tmp_path / "x.npz")])
    dq = np.clip(np.round(x / 0.25), -128, 127) * 0.25
    f_outputs = [np.maximum(x, 0).astype(np.float64), -x.astype(np.float64)]
    q_outputs = [np.maximum(dq, 0).astype(np.float64), -dq.astype(np.float64)]
    pairs = zip(f_outputs, q_outputs, strict=True)
    each = [20 * math.log10(np.linalg.norm(f) / np.linalg.norm(f - q)) for f, q in pairs]
    assert answer["output_sqnr_db"] == pytest.approx(min(each), abs=1e-6)  # the worst output, each one part
    f, q = np.concatenate(f_outputs, axis=None), np.concatenate(q_outputs, axis=None)
    pooled = 20 * math.log10(np.linalg.norm(f) / np.linalg.norm(f - q))
    assert answer["pooled_sqnr_db"] == pytest.approx(pooled, abs=1e-6)


F32 = np.float32
INF = np.float32(np.inf)


@pytest.mark.parametrize(
    ("values", "kept", "rounded", "same"),
    [
        pytest.param([-0.5, 0.5], (-INF, INF), (-1, 1), True, id="inside-the-range"),
        pytest.param([-0.5, 1.0], (-INF, INF), (-1, 1), False, id="on-the-upper-end"),
        pytest.param([-1.0, 0.5], (-INF, INF), (-1, 1), False, id="on-the-lower-end"),
        pytest.param([-0.5, 3.0], (-INF, INF), (-1, 1), False, id="outside"),
        pytest.param([-1.0, 0.0, 1.5], (0, INF), (0, 2), True, id="relu-same-lower-bound"),
        pytest.param([-1.0, 0.5], (0, INF), (-0.25, 2), False, id="relu-other-lower-bound"),
        pytest.param([0.5, 1.5], (0, INF), (-0.25, 2), True, id="relu-bounds-never-reached"),
        pytest.param([0.5, np.nan], (-INF, INF), (-1, 1), False, id="nan"),
        pytest.param([0.5, np.inf], (-INF, INF), (-1, 1), False, id="infinite"),
        pytest.param([], (-INF, INF), (-1, 1), True, id="empty"),
    ],
)
def test_rounding_reuses_the_kept_run_only_when_the_clips_agree(values, kept, rounded, same):
    """Clip(t, kept) and Clip(t, rounded) are one run only when they are equal
    bit for bit: t finite, each side's bounds equal or never reached."""
    bounds = [tuple(np.array(b, F32) for b in pair) for pair in (kept, rounded)]
    for dtype, expected in ((F32, same), (np.float64, False)):  # float64: not the bounds' type
        stats = attribution.ValueStats((-1.0, 1.0, TensorProto.FLOAT))
        half = len(values) // 2  # two samples: the extremes are over both
        stats.add(np.array(values[:half], dtype))
        stats.add(np.array(values[half:], dtype))
        assert attribution.same_clip(stats, *bounds) is expected


def test_a_tensor_inside_its_range_is_measured_once(tmp_path, monkeypatch):
    """x never leaves its Q's range: its rounding-only row is its float row,
    taken from the same run, and both equal the brute force."""
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w")
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
            "inside",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
            [weight],
        ),
        opset_imports=[helper.make_opsetid("", gen_models.OPSET)],
    )
    a, b = quantized(tmp_path, model, "inside")
    sample = tmp_path / "s.npz"
    np.savez(sample, x=np.linspace(-0.5, 0.5, 8, dtype=np.float32)[None])  # calibration: normal, far wider
    runs, impact_runs = [], []
    real_run, real_init = (
        segment_engine.SegmentRunner.run,
        attribution.ImpactRun.__init__,
    )
    monkeypatch.setattr(segment_engine.SegmentRunner, "run", lambda self, s=None: runs.append(s) or real_run(self, s))
    monkeypatch.setattr(
        attribution.ImpactRun,
        "__init__",
        lambda self, *args: impact_runs.append(self) or real_init(self, *args),
    )
    answer, _ = assert_equals_brute_force(a, b, [sample])
    (row,) = [r for r in answer["tensors"] if r["tensor"] == "x"]
    assert row["clipped"] == 0.0 and row["rounding_sqnr_db"] == row["sqnr_db"]
    ran = [attribution.variant_key(s or {}) for s in runs]
    assert len(ran) == len(set(ran)), "a variant ran twice"
    (run,) = impact_runs
    (m,) = [m for m, (t, *_) in enumerate(run.plan.tensor_rows) if t == "x"]
    kept, rounded = run.tensor_variants[m]
    assert attribution.variant_key(kept) in ran and attribution.variant_key(rounded) not in ran


def test_a_sequence_between_segments_falls_back_to_one_segment(tmp_path, monkeypatch):
    """A segment's inputs are declared as tensors: a sequence that crosses a cut
    (every node its own segment here) sends the runner to one whole-model
    segment, with the same rows as the brute force."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), w) for w in ("w1", "w2")]
    inits.append(numpy_helper.from_array(np.array(0, np.int64), "first"))
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("MatMul", ["x", "w1"], ["h"], name="matmul1"),
                helper.make_node("SequenceConstruct", ["h", "h"], ["pair"], name="pack"),
                helper.make_node("SequenceAt", ["pair", "first"], ["g"], name="unpack"),
                helper.make_node("MatMul", ["g", "w2"], ["y"], name="matmul2"),
            ],
            "sequence",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
            inits,
        ),
        opset_imports=[helper.make_opsetid("", gen_models.OPSET)],
    )
    a, b = quantized(tmp_path, model, "sequence")
    monkeypatch.setattr(segment_engine, "IMPACT_SEGMENTS", 1000)
    plans = []
    real = segment_engine.SegmentRunner.__init__
    monkeypatch.setattr(
        segment_engine.SegmentRunner,
        "__init__",
        lambda self, plan, *a: plans.append(plan) or real(self, plan, *a),
    )
    answer, _ = assert_equals_brute_force(a, b, write_samples(tmp_path, {"x": (2, 8)}, 2, seed=1))
    assert len(plans[0].chunks) > 1 and len(plans[-1].chunks) == 1
    assert {r["node"] for r in answer["ops"]} == {"matmul1", "pack", "matmul2"}


def test_segments_are_cut_by_work_not_by_node_count():
    """Work is output elements times the length of each sum; a cut falls where
    the work done so far passes each share, so a node heavier than a share ends
    a segment and the nodes after it start the next (unknown work: the median)."""
    nodes = list("abcdefgh")
    assert segment_engine.equal_work_chunks(nodes, [1, 1, 1, 100, 1, 1, None, 1], 4) == [
        list("abcd"),
        list("efgh"),
    ]
    assert segment_engine.equal_work_chunks(nodes, [100, 1, 1, 1, 1, 1, 1, 1], 4) == [
        ["a"],
        list("bcdefgh"),
    ]
    assert segment_engine.equal_work_chunks(nodes, [1] * 8, 4) == [
        list("ab"),
        list("cd"),
        list("ef"),
        list("gh"),
    ]
    conv = helper.make_node("Conv", ["x", "w"], ["y"])
    shapes = {"x": [1, 3, 8, 8], "w": [16, 3, 3, 3], "y": [1, 16, 8, 8]}
    assert segment_engine.node_work(conv, shapes) == 16 * 8 * 8 * 3 * 3 * 3
    assert segment_engine.node_work(conv, {**shapes, "y": None}) is None


def test_shapes_behind_a_computed_reshape_are_known():
    """Shape -> Reshape needs onnx's data propagation, and a declared symbolic
    dim is refined by the sample's shape."""
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Relu", ["x"], ["r"]),
                helper.make_node("Shape", ["r"], ["s"]),
                helper.make_node("Reshape", ["r", "s"], ["y"]),
            ],
            "reshape",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
            value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4])],
        ),
        opset_imports=[helper.make_opsetid("", gen_models.OPSET)],
    )
    shapes = segment_engine.known_shapes(model, list(model.graph.node), {"x": np.zeros((3, 4), np.float32)})
    assert shapes["r"] == [3, 4] and shapes["y"] == [3, 4]


def test_a_scalar_input_stays_a_scalar(tmp_path):
    """A 0-d array in an .npz feeds a scalar input as it is: ``inputs`` says [],
    not [1] (np.ascontiguousarray makes every array at least 1-d)."""
    model = helper.make_model(
        helper.make_graph(
            [helper.make_node("Mul", ["x", "s"], ["y"], name="scale")],
            "scalar",
            [
                helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
            ],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        ),
        opset_imports=[helper.make_opsetid("", gen_models.OPSET)],
    )
    path = tmp_path / "scalar.onnx"
    onnx.save(model, path)
    np.savez(tmp_path / "s.npz", x=np.ones((2, 4), np.float32), s=np.array(0.5, np.float32))
    answer = graphscan.impact(str(path), str(path), inputs=[str(tmp_path / "s.npz")])
    assert answer["inputs"] == {"x": [2, 4], "s": []}
    assert answer["output_sqnr_db"] == math.inf  # the model against itself


def with_names_prefixed(path, prefix, out_path):
    """The model at ``path`` with every node and every tensor but the graph's
    inputs and outputs (and their Q/DQ tensors) renamed ``<prefix><name>``: the
    same model under names graphscan itself would derive."""
    model = onnx.load(path)
    graph = model.graph
    kept = {info.name for info in graph.input} | {info.name for info in graph.output}

    def rename(name):  # onnxruntime's names for a graph output's Q/DQ (y_QuantizeLinear_Input) stay too
        return name if not name or graph_edit.QDQ_SUFFIX.sub("", name) in kept else prefix + name

    for node in graph.node:
        node.name = prefix + node.name
        node.input[:] = [rename(t) for t in node.input]
        node.output[:] = [rename(t) for t in node.output]
    for info in graph.value_info:
        info.name = rename(info.name)
    for init in graph.initializer:
        init.name = rename(init.name)
    onnx.save(model, out_path)
    return str(out_path)


@pytest.mark.parametrize("prefix", ["graphscan.", "graphscan.float/"])  # every derived name starts so
def test_names_graphscan_would_derive_change_nothing(trace_lab, faulty, mlp_samples, tmp_path, prefix):
    """A model whose nodes are named ``graphscan.fc2`` gave impact -0.8 dB
    instead of 33.2, silently: no name graphscan derives may be one a model uses."""
    a = with_names_prefixed(trace_lab["fp32"], prefix, tmp_path / "a.onnx")
    b = with_names_prefixed(faulty, prefix, tmp_path / "b.onnx")
    plain, renamed = (
        graphscan.impact(trace_lab["fp32"], faulty, inputs=mlp_samples),
        graphscan.impact(a, b, inputs=mlp_samples),
    )
    assert renamed["output_sqnr_db"] == plain["output_sqnr_db"]
    assert [(r["node"], r["sqnr_db"]) for r in renamed["ops"]] == [
        (prefix + r["node"], r["sqnr_db"]) for r in plain["ops"]
    ]
    assert [r["sqnr_db"] for r in renamed["tensors"]] == [r["sqnr_db"] for r in plain["tensors"]]
    plain, renamed = graphscan.trace(trace_lab["fp32"], faulty), graphscan.trace(a, b)
    numbers = ["isolated_max_abs", "propagated_max_abs", "sqnr_db", "clipped"]
    assert [[r.get(k) for k in numbers] for r in renamed["ops"]] == [[r.get(k) for k in numbers] for r in plain["ops"]]
    assert list(renamed["outputs"].values()) == list(plain["outputs"].values())


@pytest.mark.parametrize("min_gain", [None, 0.0, 0.5])
def test_exclusion_adds_no_operator_below_the_minimum_gain(trace_lab, faulty, mlp_samples, min_gain):
    """On a broken model the list held 83 operators gaining 1e-9 dB each: an
    operator is added only when it gains at least --min-gain (default 0.01 dB)."""
    answer = graphscan.impact(trace_lab["fp32"], faulty, inputs=mlp_samples, target_sqnr=1000, min_gain=min_gain)
    gains = {row["node"]: row["gain_db"] for row in answer["ops"]}
    least = 0.01 if min_gain is None else min_gain
    assert answer["exclude"]["nodes"], "the fault's operator gains far more than any minimum here"
    assert all(
        gains[node] is not None and gains[node] > 0 and gains[node] >= least for node in answer["exclude"]["nodes"]
    )
    eligible = [node for node, gained in gains.items() if gained is not None and gained > 0 and gained >= least]
    assert answer["exclude"]["nodes"] == eligible  # rank order, every one tried: the target is out of reach


def test_min_gain_needs_a_target(trace_lab):
    line = error_line(run_graphscan(["impact", trace_lab["fp32"], trace_lab["full"], "--min-gain", "0.1"]), 2)
    assert "--min-gain" in line


def test_weights_without_a_float_twin_are_counted_and_warned_about(trace_lab, tmp_path):
    """The float model before quant_pre_process (weights renamed by BatchNorm folding)
    matched 0 of 109 weight DQs by name, and impact said nothing."""
    model = onnx.load(trace_lab["fp32"])
    renamed = {init.name: f"renamed_{init.name}" for init in model.graph.initializer}
    for init in model.graph.initializer:
        init.name = renamed[init.name]
    for node in model.graph.node:
        node.input[:] = [renamed.get(t, t) for t in node.input]
    float_path = tmp_path / "renamed.onnx"
    onnx.save(model, float_path)
    plain = graphscan.impact(trace_lab["fp32"], trace_lab["full"], top=0)
    assert plain["weights"]["matched"] == plain["weights"]["total"] > 0 and plain["warnings"] == []
    answer = graphscan.impact(str(float_path), trace_lab["full"], top=0)
    assert answer["weights"] == {"matched": 0, "total": plain["weights"]["total"]}
    (warning,) = answer["warnings"]
    assert f"0 of {plain['weights']['total']}" not in warning and str(float_path) in warning
    assert f"{plain['weights']['total']} of {plain['weights']['total']} quantized weights" in warning
    table = graphscan.render_table("impact", answer)
    assert "weights matched 0 of" in table and "warning:" in table
    assert all(len(line) <= 80 for line in table.splitlines())


def sparse_or_dense_pair(folder, sparse):
    """x -> MatMul(w) -> y and its QDQ twin, ``w`` stored as a sparse initializer or dense."""
    w = np.array([[0.0, 1.5, 0.0], [0.0, 0.0, -2.0], [0.5, 0.0, 0.0]], dtype=np.float32)
    rows, cols = np.nonzero(w)
    stored = {}
    if sparse:
        values = numpy_helper.from_array(w[rows, cols], "w")
        indices = numpy_helper.from_array((rows * 3 + cols).astype(np.int64), "w_i")
        stored["sparse_initializer"] = [helper.make_sparse_tensor(values, indices, [3, 3])]
    else:
        stored["initializer"] = [numpy_helper.from_array(w, "w")]
    scales = [
        helper.make_tensor("s", TensorProto.FLOAT, [], [0.02]),
        helper.make_tensor("z", TensorProto.INT8, [], [0]),
    ]
    io = (
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("MatMul", ["xd", "w"], ["m"]),
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["mq"]),
        helper.make_node("DequantizeLinear", ["mq", "s", "z"], ["y"]),
    ]
    paths = []
    for name, graph_nodes, extra in [("f", [helper.make_node("MatMul", ["x", "w"], ["y"])], []), ("q", nodes, scales)]:
        graph = helper.make_graph(graph_nodes, name, *io, initializer=stored.get("initializer", []) + extra)
        graph.sparse_initializer.extend(stored.get("sparse_initializer", []))
        path = folder / f"{name}_{'sparse' if sparse else 'dense'}.onnx"
        path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]).SerializeToString())
        paths.append(str(path))
    return paths


def test_a_sparse_initializer_is_measured_as_the_dense_tensor_it_stands_for(tmp_path):
    """impact cuts the derived model into segments, each listing the initializers it reads:
    a sparse one was not among them (exit 1, 'Unsegmentable')."""
    answers = [
        json_answer(run_graphscan(["impact", *sparse_or_dense_pair(tmp_path, sparse)])) for sparse in (True, False)
    ]
    for answer in answers:
        del answer["a"], answer["b"]
    assert answers[0] == answers[1] and answers[0]["output_sqnr_db"] is not None


@pytest.mark.parametrize(
    "repeat", [pytest.param(False, id="k-moves-the-border"), pytest.param(True, id="k-sizes-both-parts")]
)
@pytest.mark.parametrize("order", [pytest.param((2, 6), id="k-2-then-6"), pytest.param((6, 2), id="k-6-then-2")])
def test_each_sample_is_labelled_by_the_input_values_that_decide_its_parts(tmp_path, repeat, order):
    """y = Concat(x[:k] * 100, x[k:] * 2) (or x[:k] twice), its Q->DQ twin: the baseline and the
    deployed figure equal numpy's worst part on the partitions known by hand, in either order."""
    a, b = tmp_path / "float.onnx", tmp_path / "quant.onnx"
    parts_models.sliced_model(a, False, repeat)
    parts_models.sliced_model(b, True, repeat)
    paths = [parts_models.sample(tmp_path, k) for k in order]
    answer = graphscan.impact(str(a), str(b), inputs=[str(p) for p in paths])
    samples = load_samples(paths)
    floats = [run_onnx(a, s)[0] for s in samples]
    quants = [run_onnx(b, s)[0] for s in samples]
    labels = [parts_models.partition(k, repeat) for k in order]
    expected, part = parts_models.worst_part_db(floats, quants, labels)
    assert answer["output_sqnr_db"] == pytest.approx(expected, abs=1e-9)
    assert answer["deployed_output_sqnr_db"] == pytest.approx(expected, abs=1e-9)
    assert answer["worst_part"] == {"output": "y", "part": part, "node": ["big_part", "small_part"][part]}


def test_a_leaky_relu_the_quantized_model_still_runs_is_never_applied_again(tmp_path):
    """MatMul -> LeakyRelu -> MatMul quantized the lab's way keeps its LeakyRelu (Q->DQ around
    it): nothing was absorbed, so float(t) of its output is t itself, as the brute force says
    (a LeakyRelu re-applied to its own output scales the negatives by alpha once more)."""
    rng = np.random.default_rng(21)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), w) for w in ("w1", "w2")]
    model = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
                helper.make_node("LeakyRelu", ["m1"], ["leaky"], name="leaky_relu", alpha=0.3),
                helper.make_node("MatMul", ["leaky", "w2"], ["y"], name="mm2"),
            ],
            "leaky",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
            inits,
        ),
        opset_imports=[helper.make_opsetid("", gen_models.OPSET)],
    )
    a, b = quantized(tmp_path, model, "leaky")
    assert "LeakyRelu" in {n.op_type for n in onnx.load(b).graph.node}
    assert reference.absorbed(model, onnx.load(b), "leaky") is None
    answer, _ = assert_equals_brute_force(a, b, write_samples(tmp_path, {"x": (4, 8)}, 2, seed=5))
    assert "leaky" in {row["tensor"] for row in answer["tensors"]}


def test_a_min_gain_of_0_adds_every_operator_that_gains_anything(tmp_path):
    """y = Neg(DQ(Q(x))) + DQ(Q(z)): x at a step of 0.5 misses 0.2 on y's first value, z at a
    step of 1e-4 misses 3e-5 on the second. Keeping the Add's input z float gains
    10 log10(1 + (3e-5)^2 / 0.2^2), about 1e-7 dB: under the default 0.01 dB, over 0. With a
    target out of reach, --min-gain 0 adds it after the Neg; the default leaves it out."""
    qparams = [
        numpy_helper.from_array(np.array(0.5, np.float32), "sx"),
        numpy_helper.from_array(np.array(1e-4, np.float32), "sz"),
        numpy_helper.from_array(np.array(0, np.int8), "zp"),
    ]
    float_nodes = [
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
        helper.make_node("Add", ["n", "z"], ["y"], name="add"),
    ]
    quant_nodes = [
        helper.make_node("QuantizeLinear", ["x", "sx", "zp"], ["xq"], name="x_q"),
        helper.make_node("DequantizeLinear", ["xq", "sx", "zp"], ["xd"], name="x_dq"),
        helper.make_node("QuantizeLinear", ["z", "sz", "zp"], ["zq"], name="z_q"),
        helper.make_node("DequantizeLinear", ["zq", "sz", "zp"], ["zd"], name="z_dq"),
        helper.make_node("Neg", ["xd"], ["n"], name="neg"),
        helper.make_node("Add", ["n", "zd"], ["y"], name="add"),
    ]
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 2]) for name in ("x", "z")]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])]
    a, b = tmp_path / "f.onnx", tmp_path / "q.onnx"
    for path, nodes, inits in ((a, float_nodes, []), (b, quant_nodes, qparams)):
        graph = helper.make_graph(nodes, path.stem, io, out, inits)
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    sample = tmp_path / "s.npz"
    np.savez(sample, x=np.array([[0.2, 0.0]], np.float32), z=np.array([[0.0, 3e-5]], np.float32))
    answer = graphscan.impact(str(a), str(b), inputs=[str(sample)], target_sqnr=1000, min_gain=0.0)
    gains = {row["node"]: row["gain_db"] for row in answer["ops"]}
    expected = 10 * math.log10(1 + float(np.float32(3e-5)) ** 2 / float(np.float32(0.2)) ** 2)
    assert gains["add"] == pytest.approx(expected, rel=1e-3) and 0 < gains["add"] < attribution.MIN_GAIN_DB
    assert answer["exclude"]["nodes"] == ["neg", "add"] and answer["exclude"]["reached"]
    default = graphscan.impact(str(a), str(b), inputs=[str(sample)], target_sqnr=1000)
    assert default["exclude"]["nodes"] == ["neg"] and not default["exclude"]["reached"]


def test_rows_rank_an_exact_variant_first_then_by_gain_and_rows_without_a_gain_last():
    """Gains 1, none, 3, 0 and an exact variant (its SQNR null, the baseline not exact): the
    exact one first, then 3, 1, 0, and the row without a gain last; equal gains in graph
    order. When the baseline is exact too, an exact variant ranks by its gain (none: last)."""
    rows = [{"gain_db": g} for g in (1.0, None, 3.0, 0.0, None, 1.0)]
    exact = [False, False, False, False, True, False]
    assert attribution.ranked(rows, exact, False) == [4, 2, 0, 5, 3, 1]
    assert attribution.ranked(rows, exact, True) == [2, 0, 5, 3, 1, 4]


def test_one_samples_variants_run_two_at_a_time_each_on_one_thread_as_the_float_reference(cnn, monkeypatch):
    """On one sample there are no samples to run side by side: RUNS_AT_ONCE variants run at
    once, and every row still equals the brute force. Every segment session runs on one
    thread whatever the cores (4 here), and so does the float model the rows are measured
    against: a convolution's last bits can depend on the threads that share it."""
    fp32, quant, paths = cnn
    monkeypatch.setattr(segment_engine, "usable_cores", lambda: 4)
    runners, in_flight, most, lock = [], [0], [0], threading.Lock()
    real_init, real_run = segment_engine.SegmentRunner.__init__, segment_engine.SegmentRunner.run

    def counted(self, settings=None):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(0.005)  # time for the other worker to start its run
        try:
            return real_run(self, settings)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(
        segment_engine.SegmentRunner, "__init__", lambda self, *a: runners.append(self) or real_init(self, *a)
    )
    monkeypatch.setattr(segment_engine.SegmentRunner, "run", counted)
    references, real_outputs = [], attribution.model_outputs
    monkeypatch.setattr(attribution, "model_outputs", lambda *args: references.append(args[4]) or real_outputs(*args))
    assert_equals_brute_force(fp32, quant, paths[:1])
    assert most[0] == segment_engine.RUNS_AT_ONCE == 2
    (runner,) = runners
    assert runner.threads == 1
    (reference,) = references
    assert reference.intra_op_num_threads == 1


@pytest.mark.parametrize("answer", ["impact", "ranked_ops"])
def test_segment_sessions_run_on_the_shared_arena_given_back_once_answered(answer, cnn, monkeypatch):
    """Every segment session takes the shared arena's options; once impact (or tune's
    ranking) has its rows, the runner drops its sessions and values and shrinks the arena
    once, and the rows are those of the brute force."""
    fp32, quant, paths = cnn
    opened, shrunk, runners = [], [], []
    real_open, real_init = segment_engine.open_session, segment_engine.SegmentRunner.__init__
    real_options, made = segment_engine.shared_arena_options, []
    monkeypatch.setattr(segment_engine, "open_session", lambda *args: opened.append(args[2]) or real_open(*args))
    monkeypatch.setattr(segment_engine, "shrink_shared_arena", lambda: shrunk.append(len(runners[0].sessions)))
    monkeypatch.setattr(
        segment_engine.SegmentRunner, "__init__", lambda self, *a: runners.append(self) or real_init(self, *a)
    )
    monkeypatch.setattr(
        segment_engine, "shared_arena_options", lambda threads: made.append(real_options(threads)) or made[-1]
    )
    if answer == "impact":
        assert_equals_brute_force(fp32, quant, paths)
    else:
        samples = load_samples(paths)
        rows = attribution.ranked_ops(Named(onnx.load(fp32), str(fp32)), Named(onnx.load(quant), str(quant)), samples)
        assert rows == graphscan.impact(str(fp32), str(quant), inputs=[str(p) for p in paths])["ops"]
    assert opened and all(any(options is shared for shared in made) for options in opened)
    assert shrunk[0] == 0 and not runners[0].baseline  # after the sessions were dropped
    assert len(shrunk) == (2 if answer == "ranked_ops" else 1)  # ranked_ops, then impact's own


def test_a_variant_failing_beside_another_is_exit_5_with_the_runner_closed(cnn, monkeypatch):
    """A run that fails in one of the two workers ends impact with onnxruntime's one line
    (exit 5), the runs not yet started are not run, and the runner is closed: its threads
    ended, its sessions dropped."""
    fp32, quant, paths = cnn
    monkeypatch.setattr(segment_engine, "usable_cores", lambda: 2)
    runners, runs, real_init, real_run = [], [], segment_engine.SegmentRunner.__init__, segment_engine.SegmentRunner.run

    def failing(self, settings=None):
        runs.append(settings)
        if len(runs) == 4 and failure:
            raise graphscan.GraphscanError("m.onnx: model does not run in onnxruntime (broken)", graphscan.EXIT_RUNTIME)
        return real_run(self, settings)

    monkeypatch.setattr(
        segment_engine.SegmentRunner, "__init__", lambda self, *a: runners.append(self) or real_init(self, *a)
    )
    monkeypatch.setattr(segment_engine.SegmentRunner, "run", failing)
    failure = False
    graphscan.impact(str(fp32), str(quant), inputs=[str(paths[0])])
    every, failure = len(runs), True
    runs.clear()
    runners.clear()
    with pytest.raises(graphscan.GraphscanError, match="does not run") as caught:
        graphscan.impact(str(fp32), str(quant), inputs=[str(paths[0])])
    assert caught.value.exit_code == graphscan.EXIT_RUNTIME
    (runner,) = runners
    assert not runner.sessions and not runner.baseline
    assert len(runs) < every  # the variants not started when the failure surfaced were cancelled
    with pytest.raises(RuntimeError):
        runner.pool.submit(print)  # shut down


def test_sessions_closed_beyond_the_cap_are_built_again_with_the_same_rows(cnn, monkeypatch):
    """With room for 3 segment sessions, the least recently used are closed and built again
    when a variant needs them: every row still equals the brute force, and no more than 3
    sessions are ever held."""
    monkeypatch.setattr(segment_engine, "MAX_SESSIONS", 3)
    held, built = [], []
    real = segment_engine.SegmentRunner.session

    def counted(self, j, version, values):
        found = real(self, j, version, values)
        held.append(len(self.sessions))
        return found

    real_open = segment_engine.open_session
    monkeypatch.setattr(segment_engine.SegmentRunner, "session", counted)
    monkeypatch.setattr(segment_engine, "open_session", lambda *args: built.append(1) or real_open(*args))
    assert_equals_brute_force(*cnn)
    assert max(held) == 3
    assert len(built) > 3
