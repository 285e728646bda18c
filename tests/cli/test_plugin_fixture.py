"""The plugin's ``graphscan`` fixture (graphscan_pytest_fixture.py): a kept answer is given
again only to the same call, and each caller gets an answer of its own.

The same call is the same command, each path as given, the contents of every file the call
reads (a model, its external data, each file of a folder of samples, a metric's FILE.py) and
the value of every option. The expectations come from numpy (the SQNR of ``x @ W`` against
``x @ W0``) and by hand (a metric that returns a constant, a path as given), never from
another call of the fixture.
"""

import copy
import inspect
import math
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphscan
import graphscan_pytest_fixture
from graphscan_pytest_fixture import Graphscan, call_key

W0 = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)  # the float model's weight
X = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)  # one sample


def matmul(weight):
    """``y = x @ weight``, x of shape (N, 4): a model whose output is known to numpy."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(weight.astype(np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def save_with_weight_beside(path, weight):
    """``matmul(weight)`` at ``path``, its weight in ``path.data`` beside it."""
    onnx.save(matmul(weight), path, save_as_external_data=True, location=f"{path.name}.data", size_threshold=0)


def sqnr_db(weight, samples):
    """The output SQNR of ``x @ weight`` against ``x @ W0`` over ``samples``, by numpy in float64."""
    reference = np.concatenate([s.astype(np.float64) @ W0 for s in samples])
    candidate = np.concatenate([s.astype(np.float64) @ weight.astype(np.float64) for s in samples])
    return 10 * math.log10(np.sum(reference**2) / np.sum((reference - candidate) ** 2))


def noisy(scale, seed):
    """W0 with noise of ``scale``: a candidate of a known SQNR."""
    return (W0 + scale * np.random.default_rng(seed).standard_normal(W0.shape)).astype(np.float32)


@pytest.fixture
def lab(tmp_path):
    """``tmp_path`` with the float model ``ref.onnx`` (W0 inline) and the sample ``x.npz``."""
    onnx.save(matmul(W0), tmp_path / "ref.onnx")
    np.savez(tmp_path / "x.npz", x=X)
    return tmp_path


def min_sqnr(fixture, model, lab, inputs=None):
    """The fixture's check of ``model`` against ref.onnx: the min_sqnr budget's value."""
    answer = fixture.check(model, float=lab / "ref.onnx", inputs=inputs or [lab / "x.npz"], min_sqnr=-1000)
    (row,) = answer["budgets"]
    return row["value"]


# ---------------------------------------------------------------------------
# Every file the call reads.


def test_two_paths_to_the_same_bytes_are_two_answers_each_naming_its_path(tmp_path):
    onnx.save(matmul(W0), tmp_path / "q.onnx")
    (tmp_path / "copy.onnx").write_bytes((tmp_path / "q.onnx").read_bytes())
    fixture = Graphscan({})
    assert fixture.qdq(tmp_path / "q.onnx")["model"] == str(tmp_path / "q.onnx")
    assert fixture.qdq(tmp_path / "copy.onnx")["model"] == str(tmp_path / "copy.onnx")


def test_models_whose_onnx_files_are_alike_are_told_apart_by_their_external_data(lab):
    """Two models in two folders, their .onnx files byte for byte the same, their weights
    (``m.onnx.data``) not: each gets its own SQNR. Then one weight file is rewritten in
    place, its .onnx untouched: the model is measured again."""
    first, second = noisy(0.01, 2), noisy(0.1, 3)
    for folder, weight in (("a", first), ("b", second)):
        (lab / folder).mkdir()
        save_with_weight_beside(lab / folder / "m.onnx", weight)
    assert (lab / "a" / "m.onnx").read_bytes() == (lab / "b" / "m.onnx").read_bytes()
    fixture = Graphscan({})
    for folder, weight in (("a", first), ("b", second)):
        assert min_sqnr(fixture, lab / folder / "m.onnx", lab) == pytest.approx(sqnr_db(weight, [X]), abs=1e-3)
    weights = lab / "a" / "m.onnx.data"
    assert weights.read_bytes() == first.tobytes()  # the one tensor, from offset 0
    weights.write_bytes(second.tobytes())
    assert (lab / "a" / "m.onnx").read_bytes() == (lab / "b" / "m.onnx").read_bytes()
    assert min_sqnr(fixture, lab / "a" / "m.onnx", lab) == pytest.approx(sqnr_db(second, [X]), abs=1e-3)


def test_the_float_models_external_data_is_read_by_the_key_too(lab):
    """``float=`` a model whose weight lies beside it: that weight rewritten in place (the
    float .onnx untouched) changes the reference, so min_sqnr is measured again against it."""
    candidate, reference = lab / "q.onnx", lab / "f" / "ref.onnx"
    onnx.save(matmul(noisy(0.1, 2)), candidate)
    reference.parent.mkdir()
    save_with_weight_beside(reference, W0)
    fixture = Graphscan({})

    def measured():
        answer = fixture.check(candidate, float=reference, inputs=[lab / "x.npz"], min_sqnr=-1000)
        return answer["budgets"][0]["value"]

    assert measured() == pytest.approx(sqnr_db(noisy(0.1, 2), [X]), abs=1e-3)
    other = noisy(0.5, 7)  # the new reference
    (lab / "f" / "ref.onnx.data").write_bytes(other.tobytes())
    x, q = X.astype(np.float64), noisy(0.1, 2).astype(np.float64)
    f = x @ other.astype(np.float64)
    assert measured() == pytest.approx(10 * math.log10(np.sum(f**2) / np.sum((f - x @ q) ** 2)), abs=1e-3)


def if_matmul(weight, path=None):
    """``y = If(c, then: x @ weight, else: x @ weight) + bias`` (bias zeros), each branch
    holding its own copy of the weight; with ``path``: saved there, every tensor in a file of
    its own beside it, named as the tensor (``w_then``, ``w_else``, ``bias``)."""

    def branch(name):
        return helper.make_graph(
            [helper.make_node("MatMul", ["x", name], [f"{name}_y"])],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, ["N", 3])],
            [numpy_helper.from_array(weight.astype(np.float32), name)],
        )

    graph = helper.make_graph(
        [
            helper.make_node("If", ["c"], ["chosen"], then_branch=branch("w_then"), else_branch=branch("w_else")),
            helper.make_node("Add", ["chosen", "bias"], ["y"]),
        ],
        "if_matmul",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.zeros(3, np.float32), "bias")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if path is not None:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=0)
    return model


def test_weights_inside_an_ifs_branches_kept_beside_the_model_are_read_by_the_key(tmp_path):
    """The branches' weights lie in files of their own beside m.onnx: rewritten in place (the
    .onnx and the top graph's bias untouched), the model's SQNR against x @ W0 is measured again."""
    onnx.save(if_matmul(W0), tmp_path / "ref.onnx")
    np.savez(tmp_path / "xc.npz", x=X, c=np.array(True))
    first, second = noisy(0.01, 2), noisy(0.1, 3)
    if_matmul(first, tmp_path / "m.onnx")
    assert (tmp_path / "w_then").read_bytes() == (tmp_path / "w_else").read_bytes() == first.tobytes()
    fixture = Graphscan({})
    for weight in (first, second):
        for name in ("w_then", "w_else"):
            (tmp_path / name).write_bytes(weight.tobytes())
        answer = fixture.check(
            tmp_path / "m.onnx", float=tmp_path / "ref.onnx", inputs=[tmp_path / "xc.npz"], min_sqnr=-1000
        )
        assert answer["budgets"][0]["value"] == pytest.approx(sqnr_db(weight, [X]), abs=1e-3)


def test_a_model_rewritten_in_place_with_its_size_and_time_is_measured_again(lab):
    """A rewrite within the clock's step leaves a file's size and mtime as they were: its
    contents are what tells it apart."""
    model = lab / "m.onnx"
    onnx.save(matmul(noisy(0.01, 2)), model)
    fixture = Graphscan({})
    assert min_sqnr(fixture, model, lab) == pytest.approx(sqnr_db(noisy(0.01, 2), [X]), abs=1e-3)
    before = os.stat(model)
    onnx.save(matmul(noisy(0.1, 3)), model)
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (os.stat(model).st_size, os.stat(model).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert min_sqnr(fixture, model, lab) == pytest.approx(sqnr_db(noisy(0.1, 3), [X]), abs=1e-3)


def test_a_folder_of_samples_rewritten_is_read_again(lab):
    """``inputs`` a folder: a sample rewritten in it, then one added, each changes the SQNR."""
    model, samples = lab / "m.onnx", lab / "samples"
    onnx.save(matmul(noisy(0.1, 2)), model)
    samples.mkdir()
    fixture = Graphscan({})
    other = np.random.default_rng(4).standard_normal((2, 4)).astype(np.float32) * [[1, 10, 0.1, 3]]
    for files in ({"a.npz": X}, {"a.npz": other}, {"a.npz": other, "b.npz": X}):
        for name, sample in files.items():
            np.savez(samples / name, x=sample.astype(np.float32))
        expected = sqnr_db(noisy(0.1, 2), [files[name] for name in sorted(files)])
        assert min_sqnr(fixture, model, lab, inputs=[samples]) == pytest.approx(expected, abs=1e-3)


def test_a_metric_file_rewritten_is_run_again(lab):
    """``metric = "score.py:score"``: the function now returns 0.25 where it returned 0.75
    (of another length: Python's bytecode cache tells a rewritten file by size and second)."""
    model, score = lab / "m.onnx", lab / "score.py"
    onnx.save(matmul(W0), model)
    fixture = Graphscan({})
    for value in ("0.75", "0.250"):
        score.write_text(f"def score(reference, candidate):\n    return {value}\n")
        answer = fixture.check(
            model, float=lab / "ref.onnx", inputs=[lab / "x.npz"], metric=f"{score}:score", min_metric=0
        )
        assert answer["budgets"][0]["value"] == float(value)


# ---------------------------------------------------------------------------
# Every option's value.


def option_values(settings):
    """Two different values of an option as its declaration takes them: two of its choices,
    true and false for a flag, else two numbers."""
    if "choices" in settings:
        return settings["choices"][:2]
    if settings.get("action") == "store_true":
        return [True, False]
    return [1, 2]


CALLS = [
    pytest.param(name, option, id=f"{name}-{option[0].lstrip('-')}")
    for name in graphscan._COMMANDS
    for option in graphscan._load_command(name).flat_options()
]


@pytest.mark.parametrize(("name", "option"), CALLS)
def test_changing_any_options_value_changes_the_key(name, option):
    """For each command and each of its options (as keywords of the in-process call): the
    call without it, and with each of two values, are three keys."""
    keyword = graphscan._option_dest(*option)
    paths = tuple(f"{part}.onnx" for part in graphscan._load_command(name).paths)
    keys = [call_key(name, paths, {})] + [call_key(name, paths, {keyword: v}) for v in option_values(option[1])]
    assert len(set(keys)) == 3, keys


def test_values_that_python_finds_equal_are_different_options():
    """``1``, ``True`` and ``1.0`` are equal in Python and one dictionary key: the key keeps
    them apart by type, and holds a NaN equal to itself."""
    values = [1, True, 1.0, "1"]
    assert len({call_key("check", ("m.onnx",), {"min_sqnr": v}) for v in values}) == len(values)
    assert call_key("check", ("m.onnx",), {"min_sqnr": math.nan}) == call_key(
        "check", ("m.onnx",), {"min_sqnr": -math.nan}
    )


def test_another_option_value_of_the_same_call_is_answered_for_itself(tmp_path):
    """The same model asked at two levels and under two limits: each answer is that call's."""
    onnx.save(matmul(W0), tmp_path / "m.onnx")
    fixture = Graphscan({})
    for level in ("basic", "all"):
        assert fixture.runtime(tmp_path / "m.onnx", level=level)["environment"]["level"] == level
    for limit, holds in ((0, False), (1, True)):  # one float compute node: the MatMul
        assert fixture.check(tmp_path / "m.onnx", max_float=limit)["ok"] is holds


# ---------------------------------------------------------------------------
# Each caller's own answer.


def test_what_a_caller_does_to_its_answer_no_other_caller_sees(tmp_path):
    """A test edits its answer, a nested list too: a later call of the same command gets the
    answer as it was given."""
    onnx.save(matmul(W0), tmp_path / "m.onnx")
    fixture = Graphscan({})
    first = fixture.islands(tmp_path / "m.onnx")
    given = copy.deepcopy(first)
    first["island_count"] = 99
    first["islands"].append({"edited": True})
    assert fixture.islands(tmp_path / "m.onnx") == given
    assert given["island_count"] == 1  # the one MatMul, float: one island


# ---------------------------------------------------------------------------
# One typed method per command of the core.


def test_the_fixture_has_one_typed_method_per_command_of_the_core():
    """The core's registry names every command it runs in-process: the fixture has a method
    for each, and no other, taking the command's paths in order and returning its answer's
    type (text for dot and table). A command added to the core fails here until it has one."""
    methods = {
        name for name, value in vars(Graphscan).items() if inspect.isfunction(value) and not name.startswith("_")
    }
    assert methods == set(graphscan._COMMANDS) and methods <= set(graphscan.__all__)
    for name in sorted(methods):
        declared = graphscan._load_command(name)
        signature = inspect.signature(getattr(Graphscan, name))
        positional = [p for p in signature.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD][1:]
        assert [p.annotation for p in positional] == ["StrPath"] * len(declared.paths), name
        returned = "str" if declared.text else declared.answer.__name__
        assert signature.return_annotation == returned, name
    reading_answers = [name for name in methods if graphscan._load_command(name).path_help != "path to an .onnx file"]
    assert sorted(graphscan_pytest_fixture.ANSWER_PATHS) == sorted(reading_answers)  # every other path is a model


def test_a_fixture_call_that_writes_a_file_writes_it_every_time(tmp_path):
    """fuse writes its output: the fixture runs it on every call (a kept answer would leave
    the file a test removed unwritten)."""
    onnx.save(matmul(W0), tmp_path / "m.onnx")
    fixture, output = Graphscan({}), tmp_path / "fused.onnx"
    first = fixture.fuse(tmp_path / "m.onnx", output)
    output.unlink()
    second = fixture.fuse(tmp_path / "m.onnx", output)
    assert output.is_file() and second == first
