"""tune's preparation (issue 18): onnxruntime's quant_pre_process, the opset, the rewrites,
each verified against the original model and dropped with its reason when it fails."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphscan_ort.shared.graph as graph_edit
import graphscan_ort.shared.metrics as metrics
import graphscan_ort.shared.sessions as sessions
import graphscan_ort.tune.prepare as prepare
import graphscan_ort.tune.rewrites as rewrites
from graphscan import load_with_weights
from tests.tune.test_rewrites import DIV, HARD_SIGMOID, SAMPLES, conv_block_model


def prepared_as_tune(source, folder, samples):
    """tune's first step on the model at ``source``, handed it as tune reads it:
    ``(the model with its rewrites, every step)``."""
    _, rewritten, steps = prepare.prepare(str(source), str(folder), samples, load_with_weights(str(source)))
    return rewritten, steps


def test_every_step_is_verified_and_the_result_reproduces_the_original(tmp_path):
    """An opset-11 CNN with a Div by a constant and a HardSigmoid: pre-processed, raised
    to opset 13 and both rewritten, each step within fuse's tolerance of the original."""
    middle = [
        helper.make_node("Div", ["c0", "four"], ["h"], name="div"),
        helper.make_node("HardSigmoid", ["h"], ["d"], name="hs", alpha=0.25, beta=0.4),
    ]
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(middle, opset=11), source)
    prepared, steps = prepared_as_tune(source, tmp_path, SAMPLES)
    assert [s["step"] for s in steps] == ["quant_pre_process", "opset", "div_by_constant", "hard_sigmoid"]
    assert all(s["ok"] for s in steps), steps
    assert graph_edit.default_opset(prepared) == 13
    assert {"Div", "HardSigmoid"}.isdisjoint(n.op_type for n in prepared.graph.node)
    error, problem = metrics.verified(onnx.load(source), prepared, SAMPLES)
    assert problem is None and error < 1e-5


def test_a_step_that_changes_the_outputs_is_dropped_with_its_reason(tmp_path, monkeypatch):
    def wrong(model):
        out, count = rewrites.div_by_constant(model)
        for init in out.graph.initializer:
            if init.name.endswith("_reciprocal"):
                init.CopyFrom(onnx.numpy_helper.from_array(np.array(0.3, np.float32), init.name))
        return out, count

    monkeypatch.setitem(rewrites.REWRITES, "div_by_constant", wrong)
    monkeypatch.setattr(prepare, "REWRITES", rewrites.REWRITES)
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(DIV), source)
    prepared, steps = prepared_as_tune(source, tmp_path, SAMPLES)
    (div,) = [s for s in steps if s["step"] == "div_by_constant"]
    assert div["ok"] is False and "output SQNR" in div["detail"] and "80 dB" in div["detail"]
    assert "Div" in [n.op_type for n in prepared.graph.node]  # the last good model goes on


def test_hard_sigmoid_alone_is_rewritten_after_the_opset(tmp_path):
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(HARD_SIGMOID, opset=10), source)
    prepared, steps = prepared_as_tune(source, tmp_path, SAMPLES)
    assert [s["step"] for s in steps if s["ok"]] == ["quant_pre_process", "opset", "hard_sigmoid"]
    assert "HardSigmoid" not in [n.op_type for n in prepared.graph.node]


def scaled_model(factor):
    """y = x * factor: an original (factor 1) and its 'prepared' twins."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("k", TensorProto.FLOAT, [], [factor])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize(
    ("factor", "kept"),
    [
        # 2e-5 relative, more than fuse's 1e-5 allows: what PP-OCR det's BatchNorm folding
        # costs (1.5e-5). Its SQNR, 20*log10(1/2e-5) = 94 dB, is above 80: float reassociation.
        pytest.param(1 + 2e-5, True, id="reassociation-kept"),
        # 1e-3 relative, 60 dB: still below int8's noise, yet a real change of the model.
        pytest.param(1 + 1e-3, False, id="a-real-change-dropped"),
    ],
)
def test_the_prepare_tolerance_keeps_reassociation_and_drops_a_real_change(factor, kept):
    samples = [{"x": np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)}]
    error, problem = metrics.verified(scaled_model(1.0), scaled_model(factor), samples)
    assert (problem is None) is kept, problem
    assert error == pytest.approx(3.0 * (factor - 1), rel=1e-2)  # the largest value times the change


def test_a_step_with_nothing_finite_to_compare_is_not_verified():
    """All-NaN samples compare nothing: no step is verified on them (a Div by the denormal
    1e-40 rewritten as a Mul by inf passed this way)."""
    samples = [{"x": np.full((1, 4), np.nan, np.float32)}]
    _, problem = metrics.verified(scaled_model(1.0), scaled_model(2.0), samples)
    assert problem is not None and "nothing to compare" in problem


def constant_weight_model():
    """A Conv whose weight and bias are Constant nodes, as PP-OCR's models keep them."""
    weight = np.random.default_rng(0).standard_normal((2, 1, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(weight, "w")),
        helper.make_node("Constant", [], ["b"], value=onnx.numpy_helper.from_array(np.ones(2, np.float32), "b")),
        helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "constant_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_constant_weights_become_initializers_bit_exact_even_without_quant_pre_process(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "pre_processed", lambda source, target: (None, "quant_pre_process failed (test)"))
    source = tmp_path / "float.onnx"
    onnx.save(constant_weight_model(), source)
    samples = [{"x": np.random.default_rng(1).standard_normal((1, 1, 4, 4)).astype(np.float32)}]
    prepared, steps = prepared_as_tune(source, tmp_path, samples)
    (constants,) = [s for s in steps if s["step"] == "constants"]
    assert constants["ok"] and constants["max_abs_error"] == 0.0 and constants["detail"].startswith("2 Constant")
    assert "Constant" not in [n.op_type for n in prepared.graph.node]
    assert sorted(init.name for init in prepared.graph.initializer) == ["b", "w"]


def test_a_dropped_quant_pre_process_says_what_it_costs():
    folded = onnx.ModelProto()
    folded.CopyFrom(constant_weight_model())
    del folded.graph.node[:2]  # as if both Constants were folded away
    assert prepare.folding_lost(constant_weight_model(), folded) == "the 2 nodes it folds (2 Constant)"


def test_unnamed_nodes_are_named_so_that_an_exclusion_excludes_them(tmp_path):
    """Without names, nodes_to_exclude got graphscan's derived names, which name nothing in
    prepared.onnx: every exclusion rebuilt the same model."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    unnamed = onnx.ModelProto()
    unnamed.CopyFrom(constant_weight_model())
    for node in unnamed.graph.node:
        node.name = ""
    source = tmp_path / "float.onnx"
    onnx.save(unnamed, source)
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 1, 4, 4)).astype(np.float32)} for k in range(2)]
    prepared, steps = prepared_as_tune(source, tmp_path, samples)
    names = [node.name for node in prepared.graph.node]
    assert all(names) and len(set(names)) == len(names)
    assert [s["ok"] for s in steps if s["step"] == "names"] == [True]
    onnx.save(prepared, tmp_path / "prepared.onnx")
    conv = next(node.name for node in prepared.graph.node if node.op_type == "Conv")

    def quantized(exclude):
        target = tmp_path / f"q{len(exclude)}.onnx"
        reader = iter(samples)
        calibration = type("R", (), {"get_next": lambda self: next(reader, None)})()
        quantize_static(
            tmp_path / "prepared.onnx", target, calibration, quant_format=QuantFormat.QDQ, nodes_to_exclude=exclude
        )
        return [n.op_type for n in onnx.load(target).graph.node]

    assert quantized([]).count("QuantizeLinear") > quantized([conv]).count("QuantizeLinear")  # it is excluded


def test_a_bit_exact_step_is_checked_against_the_step_before_not_the_original(tmp_path, monkeypatch):
    """quant_pre_process's folding reassociates sums (here: one weight changed by 1e-7, about
    110 dB); naming the unnamed nodes after it changes nothing more and is kept. Compared
    with the original, as on the PP-OCR recognizer, it was dropped at 'allowed inf dB'."""
    unnamed = onnx.ModelProto()
    unnamed.CopyFrom(conv_block_model(DIV))
    for node in unnamed.graph.node:
        node.name = ""
    source = tmp_path / "float.onnx"
    onnx.save(unnamed, source)

    def reassociated(src, target):
        model = onnx.load(src)
        weight = next(t for t in model.graph.initializer if t.name == "w")
        values = onnx.numpy_helper.to_array(weight) * np.float32(1 + 1e-7)
        weight.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), "w"))
        onnx.save(model, target)
        return target, "quant_pre_process ran"

    monkeypatch.setattr(prepare, "pre_processed", reassociated)
    prepared, steps = prepared_as_tune(source, tmp_path, SAMPLES)
    by_step = {s["step"]: s for s in steps}
    assert by_step["quant_pre_process"]["ok"] and by_step["quant_pre_process"]["max_abs_error"] > 0
    assert by_step["names"]["ok"] and by_step["names"]["max_abs_error"] == 0.0
    assert all(node.name for node in prepared.graph.node)


def with_weight_scaled(model, factor, name="w"):
    """A copy of ``model`` with the initializer ``name`` times ``factor`` (a linear model's
    outputs scale with it: an output SQNR of -20*log10(factor - 1) dB)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    weight = next(t for t in out.graph.initializer if t.name == name)
    values = onnx.numpy_helper.to_array(weight) * np.float32(factor)
    weight.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), name))
    return out


def pre_processed_as(change):
    """A stand-in for quant_pre_process that saves ``change(model)``."""

    def run(source, target):
        onnx.save(change(onnx.load(source)), target)
        return target, "quant_pre_process ran"

    return run


def test_a_quant_pre_process_that_fails_its_verification_is_dropped_and_the_original_goes_on(tmp_path, monkeypatch):
    """A pre-processed model 60 dB from the original (a weight changed by 1e-3): the step
    fails and every later step starts from the original's weights."""
    monkeypatch.setattr(prepare, "pre_processed", pre_processed_as(lambda m: with_weight_scaled(m, 1 + 1e-3)))
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(DIV), source)
    prepared, steps = prepared_as_tune(source, tmp_path, SAMPLES)
    assert [(s["step"], s["ok"]) for s in steps] == [("quant_pre_process", False), ("div_by_constant", True)]
    assert "dropped" in steps[0]["detail"]
    weight = next(t for t in prepared.graph.initializer if t.name == "w")
    original = next(t for t in onnx.load(source).graph.initializer if t.name == "w")
    assert weight.SerializeToString() == original.SerializeToString()


def test_every_step_is_verified_against_the_original_so_small_changes_cannot_add_up(tmp_path, monkeypatch):
    """Two steps each 84 dB from the model before them are 78 dB from the original, below
    the 80 dB rule: the second is dropped."""
    step_change = 1 + 6e-5  # -20*log10(6e-5) = 84.4 dB; twice: 78.4 dB
    monkeypatch.setattr(prepare, "pre_processed", pre_processed_as(lambda m: with_weight_scaled(m, step_change)))
    monkeypatch.setattr(prepare, "REWRITES", {"scaled": lambda m: (with_weight_scaled(m, step_change), 1)})
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(DIV), source)
    _, steps = prepared_as_tune(source, tmp_path, SAMPLES)
    assert [(s["step"], s["ok"]) for s in steps] == [("quant_pre_process", True), ("scaled", False)]
    assert "80 dB" in steps[1]["detail"]


def test_constants_are_moved_bit_exact_against_the_pre_processed_model_not_the_original(tmp_path, monkeypatch):
    """quant_pre_process reassociated a Constant's weight (by one float32 ulp) and kept the
    Constant: moving it to an initializer changes nothing more, and is kept."""

    def reassociated(model):
        out = onnx.ModelProto()
        out.CopyFrom(model)
        value = out.graph.node[0].attribute[0]
        values = onnx.numpy_helper.to_array(value.t) * np.float32(1 + 1e-7)
        value.t.CopyFrom(onnx.numpy_helper.from_array(values.astype(np.float32), "w"))
        return out

    monkeypatch.setattr(prepare, "pre_processed", pre_processed_as(reassociated))
    source = tmp_path / "float.onnx"
    onnx.save(constant_weight_model(), source)
    samples = [{"x": np.random.default_rng(1).standard_normal((1, 1, 4, 4)).astype(np.float32)}]
    _, steps = prepared_as_tune(source, tmp_path, samples)
    by_step = {s["step"]: s for s in steps}
    assert by_step["quant_pre_process"]["ok"] and by_step["quant_pre_process"]["max_abs_error"] > 0
    assert by_step["constants"]["ok"] and by_step["constants"]["max_abs_error"] == 0.0, by_step["constants"]


def test_an_ir_3_models_constants_become_initializers_that_are_also_graph_inputs(tmp_path, monkeypatch):
    """Before IR 4 every initializer must be a graph input (onnx's checker says so)."""
    monkeypatch.setattr(prepare, "pre_processed", lambda source, target: (None, "quant_pre_process failed (test)"))
    old = constant_weight_model()
    old.ir_version = 3
    old.opset_import[0].version = 8
    source = tmp_path / "float.onnx"
    onnx.save(old, source)
    samples = [{"x": np.random.default_rng(1).standard_normal((1, 1, 4, 4)).astype(np.float32)}]
    _, steps = prepare.prepared_base(str(source), str(tmp_path), samples, load_with_weights(str(source)))
    (constants,) = [s for s in steps if s["step"] == "constants"]
    assert constants["ok"] and constants["max_abs_error"] == 0.0, constants
    moved, count = prepare.constants_as_initializers(old)
    assert count == 2 and {"w", "b"} <= {i.name for i in moved.graph.input}
    onnx.checker.check_model(moved, full_check=True)


def test_an_unnamed_node_whose_spec_name_is_taken_gets_a_fresh_one():
    """Node 1 unnamed is Relu_1 by the SPEC; node 0 already has that name."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="Relu_1"), helper.make_node("Relu", ["r"], ["y"])],
        "clash",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    named, count = prepare.named_nodes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    names = [node.name for node in named.graph.node]
    assert count == 1 and names[0] == "Relu_1" and names[1] not in ("", "Relu_1")


@pytest.mark.parametrize(("opset", "converted"), [(12, True), (13, False)])
def test_only_a_model_below_opset_13_is_converted(tmp_path, monkeypatch, opset, converted):
    monkeypatch.setattr(prepare, "pre_processed", lambda source, target: (source, "quant_pre_process (test)"))
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(DIV, opset=opset), source)
    model, steps = prepare.prepared_base(str(source), str(tmp_path), SAMPLES, load_with_weights(str(source)))
    assert ("opset" in [s["step"] for s in steps]) is converted
    assert graph_edit.default_opset(model) == 13


def test_quant_pre_process_is_retried_once_without_symbolic_shapes_and_says_so(tmp_path, monkeypatch):
    """A stub that records its calls and fails while symbolic shape inference is on."""
    import onnxruntime.quantization.shape_inference as shape_inference

    calls = []

    def recording(source, target, **options):
        calls.append(options)
        if not options.get("skip_symbolic_shape"):
            raise RuntimeError("symbolic shape inference gave up")
        onnx.save(onnx.load(source), target)

    monkeypatch.setattr(shape_inference, "quant_pre_process", recording)
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(DIV), source)
    path, detail = prepare.pre_processed(str(source), str(tmp_path / "pre.onnx"))
    assert path == str(tmp_path / "pre.onnx") and calls == [{}, {"skip_symbolic_shape": True}]
    assert detail.startswith("with skip_symbolic_shape=True;")  # what ran first, then why
    assert "it failed (symbolic shape inference gave up)" in detail


def every_step_model():
    """An opset-11 model that every step of prepare changes: an unnamed Constant weight (constants,
    names), a Div by a constant and a HardSigmoid (the rewrites)."""
    weight = np.random.default_rng(3).standard_normal((4, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(weight, "w")),
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Div", ["h", "four"], ["d"], name="div"),
        helper.make_node("HardSigmoid", ["d"], ["y"], name="hs", alpha=0.25, beta=0.4),
    ]
    graph = helper.make_graph(
        nodes,
        "every_step",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [onnx.numpy_helper.from_array(np.array(4.0, np.float32), "four")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


EVERY_STEP = ["quant_pre_process", "constants", "opset", "names", "div_by_constant", "hard_sigmoid"]
EVERY_STEP_SAMPLES = [{"x": np.random.default_rng(k).standard_normal((1, 4)).astype(np.float32)} for k in range(2)]


@pytest.mark.parametrize("failing", EVERY_STEP)
def test_a_step_whose_verification_fails_leaves_no_trace_in_the_prepared_model(tmp_path, monkeypatch, failing):
    """Law, for every step: when it and every step after it fail their verification, the prepared
    model is exactly the model that step was given (the last one verified, or the original).
    quant_pre_process is made a copy, so that every later step has something to change."""

    def copied(source, target):
        onnx.save(onnx.load(source), target)
        return target, "quant_pre_process ran"

    calls, given = [], []
    real = prepare.checked

    def checked(original, candidate, samples, min_sqnr_db=metrics.PREPARE_MIN_SQNR_DB, kept=None):
        calls.append(candidate)
        if len(calls) > EVERY_STEP.index(failing):
            return None, "made to fail"
        given.append(candidate)
        return real(original, candidate, samples, min_sqnr_db, kept)

    monkeypatch.setattr(prepare, "pre_processed", copied)
    monkeypatch.setattr(prepare, "checked", checked)
    source = tmp_path / "float.onnx"
    onnx.save(every_step_model(), source)
    prepared, steps = prepared_as_tune(source, tmp_path, EVERY_STEP_SAMPLES)
    assert [s["step"] for s in steps] == EVERY_STEP
    assert [s["ok"] for s in steps] == [k < EVERY_STEP.index(failing) for k in range(len(EVERY_STEP))]
    before = given[-1] if given else onnx.load(source)
    assert prepared.SerializeToString() == before.SerializeToString()


def test_a_step_whose_model_fails_onnxs_full_checker_is_dropped(tmp_path, monkeypatch):
    """A rewrite that leaves a value_info contradicting shape inference: onnxruntime runs the model
    (it merges shapes leniently) and its outputs are the original's, but onnx's full checker (shape
    inference, strict) refuses it: the step is dropped saying so, the model before it goes on."""

    def contradicting(model):
        out, count = rewrites.div_by_constant(model)
        out.graph.value_info.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, [1, 4, 8, 7]))
        return out, count

    monkeypatch.setattr(prepare, "REWRITES", {"div_by_constant": contradicting})
    source = tmp_path / "float.onnx"
    onnx.save(conv_block_model(DIV), source)
    changed, _ = contradicting(onnx.load(source))
    onnx.checker.check_model(changed)  # the structural check alone passes it
    assert metrics.verified(onnx.load(source), changed, SAMPLES)[1] is None  # and it verifies
    prepared, steps = prepared_as_tune(source, tmp_path, SAMPLES)
    (div,) = [s for s in steps if s["step"] == "div_by_constant"]
    assert div["ok"] is False and "fails the checker" in div["detail"]
    assert "Div" in [n.op_type for n in prepared.graph.node]
    onnx.checker.check_model(prepared, full_check=True)


def counted_runs(monkeypatch):
    """sessions.model_runner recording the model (by identity) of each run."""
    runs, real = [], sessions.model_runner

    def counting(model, subject):
        run = real(model, subject)

        def counted(feeds):
            runs.append(id(model))
            return run(feeds)

        return counted

    monkeypatch.setattr(sessions, "model_runner", counting)
    return runs


def test_the_original_runs_once_a_sample_for_every_step_checked_against_it(tmp_path, monkeypatch):
    """Four steps of every_step_model are checked against the original (quant_pre_process,
    opset and both rewrites): its outputs on each sample are run once and kept for all four."""
    runs = counted_runs(monkeypatch)
    path = tmp_path / "model.onnx"
    onnx.save(every_step_model(), path)
    original = load_with_weights(str(path))
    _, _, steps = prepare.prepare(str(path), str(tmp_path), EVERY_STEP_SAMPLES, original)
    assert [s["step"] for s in steps if s["ok"]] == [
        "quant_pre_process",
        "opset",
        "names",
        "div_by_constant",
        "hard_sigmoid",
    ]
    assert runs.count(id(original)) == len(EVERY_STEP_SAMPLES)


def test_kept_runs_keep_what_fits_their_budget_and_run_the_rest_again(monkeypatch):
    """A budget of one sample's outputs (4 float32: 16 bytes): sample 0 is run once however
    often it is asked for, sample 1 every time, and each answer is the model's own."""
    runs = counted_runs(monkeypatch)
    model = every_step_model()
    kept = sessions.KeptRuns(model, "the model", budget=16)
    first = [kept(k, feeds) for _ in range(3) for k, feeds in enumerate(EVERY_STEP_SAMPLES)]
    assert len(runs) == 1 + 3
    plain = sessions.model_runner(model, "the model")
    for k, outputs in enumerate(first):
        np.testing.assert_array_equal(outputs[0], plain(EVERY_STEP_SAMPLES[k % 2])[0])


def test_kept_runs_of_another_model_never_stand_in_for_the_original():
    """A check whose original is not the model the kept runs are of (a bit-exact step checked
    against the step before) compares against its own original, not the kept one's outputs:
    y = x against itself verifies, though the kept runs are of y = 2 x."""
    samples = [{"x": np.ones((1, 4), np.float32)}]
    kept = sessions.KeptRuns(scaled_model(2.0), "the model before the rewrite")
    with_kept = metrics.verify(scaled_model(1.0), scaled_model(1.0), samples, min_sqnr_db=80.0, kept=kept)
    assert with_kept.problem is None
    assert with_kept == metrics.verify(scaled_model(1.0), scaled_model(1.0), samples, min_sqnr_db=80.0)
