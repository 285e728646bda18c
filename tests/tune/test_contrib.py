"""Contrib operators (issue 33 item 6): a BERT-shaped encoder whose Gelu is onnxruntime's
``com.microsoft`` one. onnx's shape inference does not know it, so every tensor after it has no
type and the quantizer refuses them; tune types them with onnxruntime's symbolic shape inference
(steps ``types`` and ``dynamic_types``). Every figure is checked against the test's own
onnxruntime run, with the workaround onnxruntime's error message names."""

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

import graphscan
import graphscan_ort.tune.prepare as prepare
import graphscan_ort.tune.stages as stages
from graphscan_ort.tune.candidates import candidate_settings, keyword_arguments, quiet
from tests.tune.test_dynamic import numpy_sqnr, outputs

LAYERS, HIDDEN, HEADS, FFN, SEQUENCE = 2, 32, 2, 64, 8
# Per layer, the MatMuls whose weight is an initializer: q, k, v, the attention output, the two
# of the feed-forward block (the two attention MatMuls multiply activations).
WEIGHT_MATMULS = 6 * LAYERS


def encoder(gelu_domain="com.microsoft"):
    """x [1, SEQUENCE, HIDDEN] -> LAYERS post-norm BERT layers (multi-head self-attention, then a
    Gelu feed-forward block, each with a residual Add and a LayerNormalization), opset 20, every
    node named after its output. ``gelu_domain`` "" is opset 20's own Gelu."""
    rng = np.random.default_rng(0)
    weights, nodes = [], []

    def weight(name, shape, scale=None):
        values = rng.standard_normal(shape) * (1 / np.sqrt(shape[0]) if scale is None else scale)
        weights.append(numpy_helper.from_array(values.astype(np.float32), name))
        return name

    def constant(name, values):
        weights.append(numpy_helper.from_array(np.asarray(values), name))
        return name

    def node(op, inputs, output, domain="", **attributes):
        nodes.append(helper.make_node(op, inputs, [output], name=output + "_node", domain=domain, **attributes))
        return output

    constant("split_heads", np.array([1, SEQUENCE, HEADS, HIDDEN // HEADS], np.int64))
    constant("merge_heads", np.array([1, SEQUENCE, HIDDEN], np.int64))
    constant("scale", np.array(1 / np.sqrt(HIDDEN // HEADS), np.float32))
    x = "x"
    for layer in range(LAYERS):
        p = f"l{layer}_"
        heads = {}
        for k in "qkv":
            h = node("MatMul", [x, weight(p + k + "_w", (HIDDEN, HIDDEN))], p + k + "_mm")
            h = node("Add", [h, weight(p + k + "_b", (HIDDEN,), 0.02)], p + k + "_add")
            h = node("Reshape", [h, "split_heads"], p + k + "_split")
            heads[k] = node("Transpose", [h], p + k + "_heads", perm=[0, 2, 3, 1] if k == "k" else [0, 2, 1, 3])
        h = node("MatMul", [heads["q"], heads["k"]], p + "scores")
        h = node("Mul", [h, "scale"], p + "scaled")
        h = node("Softmax", [h], p + "probs", axis=-1)
        h = node("MatMul", [h, heads["v"]], p + "context")
        h = node("Transpose", [h], p + "context_t", perm=[0, 2, 1, 3])
        h = node("Reshape", [h, "merge_heads"], p + "merged")
        h = node("MatMul", [h, weight(p + "o_w", (HIDDEN, HIDDEN))], p + "o_mm")
        h = node("Add", [h, weight(p + "o_b", (HIDDEN,), 0.02)], p + "o_add")
        h = node("Add", [h, x], p + "residual1")
        norm = [constant(p + "ln1_g", np.ones(HIDDEN, np.float32)), constant(p + "ln1_b", np.zeros(HIDDEN, np.float32))]
        x1 = node("LayerNormalization", [h, *norm], p + "ln1", axis=-1, epsilon=1e-12)
        h = node("MatMul", [x1, weight(p + "f1_w", (HIDDEN, FFN))], p + "f1_mm")
        h = node("Add", [h, weight(p + "f1_b", (FFN,), 0.02)], p + "f1_add")
        h = node("Gelu", [h], p + "gelu", domain=gelu_domain)
        h = node("MatMul", [h, weight(p + "f2_w", (FFN, HIDDEN))], p + "f2_mm")
        h = node("Add", [h, weight(p + "f2_b", (HIDDEN,), 0.02)], p + "f2_add")
        h = node("Add", [h, x1], p + "residual2")
        norm = [constant(p + "ln2_g", np.ones(HIDDEN, np.float32)), constant(p + "ln2_b", np.zeros(HIDDEN, np.float32))]
        x = node("LayerNormalization", [h, *norm], p + "ln2", axis=-1, epsilon=1e-12)
    shape = [1, SEQUENCE, HIDDEN]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
        weights,
    )
    opsets = [helper.make_opsetid("", 20)] + ([helper.make_opsetid(gelu_domain, 1)] if gelu_domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def after_the_first_gelu(model):
    """Every tensor a node makes from the first contrib Gelu on, in node order, but the graph's
    output (declared, so typed): in this encoder each depends on that Gelu."""
    names = [output for node in model.graph.node for output in node.output]
    first = names.index("l0_gelu")
    return [name for name in names[first:] if name not in {o.name for o in model.graph.output}]


def samples(folder, count, seed):
    rng = np.random.default_rng(seed)
    files = []
    for k in range(count):
        files.append(str(folder / f"s{seed}-{k}.npz"))
        np.savez(files[-1], x=rng.standard_normal((1, SEQUENCE, HIDDEN)).astype(np.float32))
    return files


def loaded(files):
    return [dict(np.load(f)) for f in files]


def onnxruntimes_static_defaults():
    """quantize_static's candidates cut to onnxruntime's defaults (per tensor, MinMax): the
    tests of typing need one static row, not eight (each costs a calibration and timing)."""
    return [settings for settings in candidate_settings() if not settings["per_channel"]][:1]


def tuned_encoder(folder, **options):
    onnx.save(encoder(), folder / "encoder.onnx")
    calibration, held = samples(folder, 2, 1), samples(folder, 2, 2)
    answer = graphscan.tune(
        str(folder / "encoder.onnx"), calibrate=calibration, inputs=held, out=str(folder / "o"), **options
    )
    return {"answer": answer, "float": str(folder / "encoder.onnx"), "held": held}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """tune on the contrib encoder (two calibration samples, two held out), its static
    candidates cut to onnxruntime's defaults."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stages, "candidate_settings", onnxruntimes_static_defaults)
        return tuned_encoder(tmp_path_factory.mktemp("contrib"), runs=2, min_speedup=0)


def test_onnx_leaves_every_tensor_after_the_contrib_gelu_untyped_and_the_symbolic_inference_types_them(tmp_path):
    model = encoder()
    assert prepare.untyped(model) == after_the_first_gelu(model)
    assert prepare.untyped(encoder(gelu_domain="")) == []  # opset 20's Gelu: onnx knows it
    typed, count = prepare.typed(model, str(tmp_path))
    assert prepare.untyped(typed) == [] and count == len(after_the_first_gelu(model))
    assert [v.name for v in typed.graph.value_info] == after_the_first_gelu(model)  # only what onnx lacks
    kinds = {v.name: v.type.tensor_type.elem_type for v in typed.graph.value_info}
    assert {kinds[name] for name in after_the_first_gelu(model)} == {TensorProto.FLOAT}  # every tensor here
    assert typed.graph.node == model.graph.node and typed.graph.initializer == model.graph.initializer


def test_an_output_declared_without_an_element_type_is_untyped_until_typed(tmp_path):
    """A graph output declared with its element type UNDEFINED (0) says nothing of what it holds."""
    model = encoder()
    output = model.graph.output[0].name
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info(output, TensorProto.UNDEFINED, None))
    assert prepare.untyped(model) == after_the_first_gelu(model) + [output]
    typed, count = prepare.typed(model, str(tmp_path))
    assert count == len(after_the_first_gelu(model)) + 1 and prepare.untyped(typed) == []


def test_a_model_onnx_types_whole_is_given_back_itself(tmp_path):
    model = encoder(gelu_domain="")
    assert prepare.typed(model, str(tmp_path)) == (model, 0)
    assert prepare.types_step(model, [], str(tmp_path), "types") == (model, [])


def test_the_dynamic_model_is_typed_only_where_quantize_dynamic_has_a_matmul_to_quantize(tmp_path):
    """A contrib Gelu between two Relus and no MatMul: no dynamic candidate, so no step for it."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Gelu", ["r"], ["g"], name="gelu", domain="com.microsoft"),
        helper.make_node("Relu", ["g"], ["y"], name="relu_after"),
    ]
    graph = helper.make_graph(
        nodes,
        "no_matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    assert prepare.untyped(model) == ["g"]
    feeds = [{"x": np.linspace(-2, 2, 4, dtype=np.float32).reshape(1, 4)}]
    assert prepare.dynamic_base(model, feeds, str(tmp_path))[1] == []
    _, (step,) = prepare.dynamic_base(encoder(), loaded(samples(tmp_path, 1, 5)), str(tmp_path))
    assert step["step"] == "dynamic_types" and step["ok"]


@pytest.mark.parametrize("weight_type", [pytest.param("QInt8", id="int8-weights"), pytest.param("QUInt8", id="uint8")])
def test_the_dynamic_rows_are_measured_as_onnxruntimes_own_workaround_quantizes(tuned, tmp_path, weight_type):
    """quantize_dynamic on the float model fails as tune's dynamic rows did ("Unable to find data
    type"); with the DefaultTensorType its message names, it quantizes every weight MatMul. tune's
    row is that model's SQNR in numpy, with as many MatMulInteger."""
    row = next(
        r for r in tuned["answer"]["candidates"] if (r["quantize_dynamic"] or {}).get("weight_type") == weight_type
    )
    own = tmp_path / "own.onnx"
    with quiet(), pytest.raises(RuntimeError, match="Unable to find data type"):
        quantize_dynamic(tuned["float"], str(own), weight_type=QuantType[weight_type])
    with quiet():
        options = {"DefaultTensorType": TensorProto.FLOAT}
        quantize_dynamic(tuned["float"], str(own), weight_type=QuantType[weight_type], extra_options=options)
    ops = collections.Counter(node.op_type for node in onnx.load(own).graph.node)
    assert ops["MatMulInteger"] == WEIGHT_MATMULS
    sqnr = numpy_sqnr(outputs(tuned["float"], tuned["held"]), outputs(str(own), tuned["held"]))
    assert row["error"] is None and row["sqnr_db"] == pytest.approx(sqnr, abs=1e-6)
    assert row["float_weights"] == 0


def test_the_typing_of_the_dynamic_model_is_a_verified_step_and_every_candidate_runs(tuned):
    answer = tuned["answer"]
    (step,) = [s for s in answer["prepare"] if s["step"] == "dynamic_types"]
    count = len(after_the_first_gelu(encoder()))
    assert step["ok"] and step["max_abs_error"] == 0.0 and step["detail"].startswith(f"{count} tensors typed")
    assert all(row["error"] is None for row in answer["candidates"])


def test_the_written_dynamic_model_is_reproduced_from_prepared_onnx_by_its_arguments(tmp_path, monkeypatch):
    """prepared.onnx is the typed model: quantize_dynamic with the row's arguments alone gives
    model.onnx byte for byte (without the types it fails, as above)."""
    monkeypatch.setattr(stages, "candidate_settings", list)
    result = tuned_encoder(tmp_path, runs=1, min_speedup=0)
    answer, out = result["answer"], tmp_path / "o"
    chosen = next(c for c in answer["candidates"] if c["id"] == answer["chosen"])
    assert chosen["quantize_dynamic"] is not None
    with quiet():
        quantize_dynamic(
            str(out / "prepared.onnx"), str(tmp_path / "again.onnx"), **keyword_arguments(chosen["quantize_dynamic"])
        )
    assert (tmp_path / "again.onnx").read_bytes() == (out / "model.onnx").read_bytes()


def without_symbolic_pre_processing(monkeypatch):
    """quant_pre_process whose symbolic shape inference fails (as it does without sympy, or on a
    symbolic dimension it cannot merge): tune retries it without, which leaves the types out."""
    import onnxruntime.quantization.shape_inference as shape_inference

    real = shape_inference.quant_pre_process

    def failing(source, target, **options):
        if not options.get("skip_symbolic_shape"):
            raise RuntimeError("symbolic shape inference gave up")
        return real(source, target, **options)

    monkeypatch.setattr(shape_inference, "quant_pre_process", failing)


def test_without_quant_pre_processs_types_the_static_candidates_still_run(tmp_path, monkeypatch):
    """The issue's exit 5 ("Only an existing tensor can be modified"): the calibrator found no
    type after the first layer. The step ``types`` gives them, and every candidate runs."""
    without_symbolic_pre_processing(monkeypatch)
    monkeypatch.setattr(stages, "candidate_settings", onnxruntimes_static_defaults)
    answer = tuned_encoder(tmp_path, runs=1, min_speedup=0)["answer"]
    steps = {s["step"]: s for s in answer["prepare"]}
    assert steps["quant_pre_process"]["detail"].startswith("with skip_symbolic_shape=True")
    assert steps["types"]["ok"] and steps["types"]["max_abs_error"] == 0.0
    static = [row for row in answer["candidates"] if row["quantize_static"] is not None]
    assert static and all(row["error"] is None and row["sqnr_db"] is not None for row in static)


def test_a_failing_symbolic_inference_is_a_failed_step_and_its_rows_say_why(tmp_path, monkeypatch):
    """The inference gives up: the step says so and how many tensors stay untyped, the model goes on
    without types, and each dynamic row the quantizer then refuses is a row with its error; the
    static rows, typed by quant_pre_process, are measured."""

    def gives_up(model, folder):
        raise RuntimeError("Incomplete symbolic shape inference")

    monkeypatch.setattr(prepare, "symbolic_shapes", gives_up)
    monkeypatch.setattr(stages, "candidate_settings", onnxruntimes_static_defaults)
    answer = tuned_encoder(tmp_path, runs=1, min_speedup=0)["answer"]
    (step,) = [s for s in answer["prepare"] if s["step"] == "dynamic_types"]
    count = len(after_the_first_gelu(encoder()))
    assert not step["ok"] and step["max_abs_error"] is None
    assert step["detail"] == (
        "onnxruntime's symbolic shape inference failed (Incomplete symbolic shape inference); "
        f"{count} tensors stay untyped"
    )
    rows = answer["candidates"]
    dynamic = [row for row in rows if row["quantize_dynamic"] is not None]
    assert len(dynamic) == 2 and all("Unable to find data type" in row["error"] for row in dynamic)
    assert all(row["error"] is None for row in rows if row["quantize_static"] is not None)


@pytest.mark.parametrize(
    ("found", "ok", "detail"),
    [
        pytest.param(0, False, "onnxruntime's symbolic shape inference typed none of the 3 untyped tensors", id="none"),
        pytest.param(2, True, "2 tensors typed by onnxruntime's symbolic shape inference", id="all-but-the-gelus"),
        pytest.param(3, True, "3 tensors typed by onnxruntime's symbolic shape inference", id="all"),
    ],
)
def test_the_step_counts_the_tensors_it_typed_and_those_left(tmp_path, monkeypatch, found, ok, detail):
    """An inference that finds the types of the last ``found`` of three untyped tensors (the
    contrib Gelu's output, then the MatMul and Add after it, which onnx types from it): the step
    counts them and the Gelu's when it stays untyped; one that finds none is a failed step."""
    model = encoder()
    first = after_the_first_gelu(model)[:3]
    with_types = prepare.typed(model, str(tmp_path))[0]
    types = [v for v in with_types.graph.value_info if v.name in first[len(first) - found :]]

    def partial(model, folder):
        out = onnx.ModelProto()
        out.CopyFrom(model)
        out.graph.value_info.extend(types)
        return out

    # The model with the types of all but the first three, so that exactly those three are missing.
    given = onnx.ModelProto()
    given.CopyFrom(model)
    given.graph.value_info.extend(v for v in with_types.graph.value_info if v.name not in first)
    assert prepare.untyped(given) == first
    monkeypatch.setattr(prepare, "symbolic_shapes", partial)
    samples = [{"x": np.zeros((1, SEQUENCE, HIDDEN), np.float32)}]
    prepared, (step,) = prepare.types_step(given, samples, str(tmp_path), "types")
    left = first[: len(first) - found] if ok else first
    assert step["ok"] is ok and step["detail"].startswith(detail) and prepare.untyped(prepared) == left
    assert step["detail"].endswith(f"; {len(left)} still untyped") == (ok and bool(left))


def test_when_nothing_can_type_the_tensors_the_end_of_the_run_names_the_step_that_failed(tmp_path, monkeypatch, capsys):
    """quant_pre_process's symbolic pass and tune's own typing both fail: the quantizer refuses every
    candidate, and the one line (exit 5) says why the tensors had no type."""
    import graphscan

    without_symbolic_pre_processing(monkeypatch)
    monkeypatch.setattr(stages, "candidate_settings", onnxruntimes_static_defaults)

    def gives_up(model, folder):
        raise RuntimeError("Incomplete symbolic shape inference")

    monkeypatch.setattr(prepare, "symbolic_shapes", gives_up)
    onnx.save(encoder(), tmp_path / "encoder.onnx")
    argv = [
        "tune",
        str(tmp_path / "encoder.onnx"),
        "--calibrate",
        samples(tmp_path, 1, 1)[0],
        "--out",
        str(tmp_path / "o"),
    ]
    assert graphscan.main([*argv, "--runs", "1", "--min-speedup", "0"]) == graphscan.EXIT_RUNTIME
    (line,) = capsys.readouterr().err.splitlines()
    assert "refused every candidate" in line
    assert "; types: onnxruntime's symbolic shape inference failed (Incomplete symbolic shape inference)" in line
    assert "; dynamic_types: onnxruntime's symbolic shape inference failed" in line


def test_a_typing_that_fails_verification_leaves_no_trace(tmp_path, monkeypatch):
    """Law of every prepare step: dropped, the model goes on exactly as it was given."""
    monkeypatch.setattr(prepare, "checked", lambda *args, **kwargs: (None, "made to fail"))
    model = encoder()
    kept, steps = prepare.types_step(model, [], str(tmp_path), "types")
    assert kept is model and steps == [{"step": "types", "ok": False, "detail": "made to fail", "max_abs_error": None}]


def test_the_symbolic_inference_leaves_nothing_in_the_users_folder(tmp_path, monkeypatch):
    """Where onnxruntime's symbolic shape inference gives up (an operator nobody knows), it saves
    its partial model as sym_shape_infer_temp.onnx in the current folder: quant_pre_process's and
    tune's own typing run it in tune's work folder, never the user's."""
    unknown = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Mystery", ["r"], ["m"], name="mystery", domain="example.custom"),
        helper.make_node("Relu", ["m"], ["y"], name="relu_after"),
    ]
    graph = helper.make_graph(
        unknown,
        "unknown",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)]
    )
    users, work = tmp_path / "user", tmp_path / "work"
    users.mkdir()
    work.mkdir()
    onnx.save(model, work / "float.onnx")
    monkeypatch.chdir(users)
    prepare.pre_processed(str(work / "float.onnx"), str(work / "pre.onnx"))
    assert list(users.iterdir()) == []
    with pytest.raises(Exception, match="Incomplete symbolic shape inference"):
        prepare.typed(model, str(work))
    assert list(users.iterdir()) == []
