"""tune's candidates (issue 18): each is the exact quantize_static call that made it.

Calibrating once through onnxruntime's calibration cache must give the same model,
byte for byte, as a plain quantize_static call with a fresh reader of the same data.
"""

import contextlib
import hashlib

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader, quantize_static

import gen_models
import graphscan_ort.tune.candidates as candidates


class Pages(CalibrationDataReader):
    """Four seeded inputs; a new reader for every call (a consumed one yields nothing)."""

    def __init__(self, shape):
        rng = np.random.default_rng(3)
        self.samples = iter([{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(4)])

    def get_next(self):
        return next(self.samples, None)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A small residual CNN: Conv, Relu, Add, Resize, Concat (the kind tune is for)."""
    folder = tmp_path_factory.mktemp("cnn")
    path = folder / "cnn.onnx"
    onnx.save(gen_models.build_cnn(2, channels=4, size=8, seed=0), path)
    return str(path)


def test_the_search_covers_every_axis_the_issue_names():
    settings = candidates.candidate_settings()
    assert len(settings) == 8 and len({tuple(sorted(s.items())) for s in settings}) == 8
    assert {s["activation_type"] for s in settings} == {"QUInt8", "QInt8"}
    assert {s["per_channel"] for s in settings} == {False, True}
    assert {s["calibrate_method"] for s in settings} == {"MinMax", "Percentile"}
    assert all(s["weight_type"] == "QInt8" and s["quant_format"] == "QDQ" for s in settings)


def test_every_candidate_is_reproduced_by_its_own_arguments(cnn, tmp_path):
    """Two calibrations, in two passes over the samples, serve eight candidates, and each equals
    a plain call without a cache: calibration.py's ranges, one sample at a time, are
    onnxruntime's own over all samples."""
    shape = (1, 3, 8, 8)
    calibrations = []

    class Counted(Pages):
        def __init__(self, shape):
            super().__init__(shape)
            calibrations.append(self)

    for k, settings in enumerate(candidates.candidate_settings()):
        cached = tmp_path / f"cached{k}.onnx"
        with gen_models.quiet_quantizer():
            candidates.quantize_candidate(cnn, str(cached), settings, lambda: Counted(shape), str(tmp_path))
            plain = tmp_path / f"plain{k}.onnx"
            quantize_static(cnn, str(plain), Pages(shape), **candidates.keyword_arguments(settings))
        assert cached.read_bytes() == plain.read_bytes(), settings
    assert len(list(tmp_path.glob("calibration-*.json"))) == 2  # once per calibration method
    # MinMax reads the samples once (every tensor's extremes), Percentile once more (its counts over bins set by them)
    assert len(calibrations) == 1 + 1


def test_files_that_differ_only_after_the_first_mib_have_different_digests(tmp_path):
    """Two quantized models the same for their first MiB (a big model's weights) are not
    twins: the digest is of every byte, hashlib's own SHA-256 of the whole file."""
    head = np.random.default_rng(0).bytes(3 << 19)  # 1.5 MiB
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    a.write_bytes(head + b"a")
    b.write_bytes(head + b"b")
    assert candidates.file_digest(str(a)) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert candidates.file_digest(str(a)) != candidates.file_digest(str(b))


def test_readers_renamed_quickly_rename_what_onnxruntime_renames_and_the_quantizer_writes_the_same_bytes(tmp_path):
    """Every tensor of a residual CNN renamed in turn (and a name no node reads), once by
    onnxruntime's own ONNXModel.replace_input_of_all_nodes and once inside
    readers_renamed_quickly: the graphs are the same after every rename. quantize_static
    inside it writes the model it writes outside, byte for byte, and onnxruntime's method is
    its own again after."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    model = gen_models.build_cnn(2, channels=4, size=8, seed=0)
    theirs, ours = ONNXModel(onnx.ModelProto()), ONNXModel(onnx.ModelProto())
    theirs.model.CopyFrom(model)
    ours.model.CopyFrom(model)
    names = sorted({name for node in model.graph.node for name in node.input if name}) + ["read_by_none"]
    for k, name in enumerate(names):
        theirs.replace_input_of_all_nodes(name, f"renamed_{k}")
        with candidates.readers_renamed_quickly():
            ours.replace_input_of_all_nodes(name, f"renamed_{k}")
        assert ours.model.SerializeToString() == theirs.model.SerializeToString(), name
    assert theirs.model.SerializeToString() != model.SerializeToString()  # the renames did rename

    onnx.save(model, tmp_path / "cnn.onnx")
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 3, 8, 8)).astype(np.float32)} for k in range(3)]
    original = ONNXModel.replace_input_of_all_nodes
    for path, quick in ((tmp_path / "plain.onnx", False), (tmp_path / "quick.onnx", True)):
        with gen_models.quiet_quantizer(), candidates.readers_renamed_quickly() if quick else contextlib.nullcontext():
            quantize_static(str(tmp_path / "cnn.onnx"), str(path), candidates.SampleReader(list(samples)))
    assert (tmp_path / "quick.onnx").read_bytes() == (tmp_path / "plain.onnx").read_bytes()
    assert ONNXModel.replace_input_of_all_nodes is original


def test_readers_renamed_by_their_index_are_the_ones_onnxruntime_renames_after_every_edit():
    """ReadersIndex (one readers_renamed_quickly for the whole run, as in one quantize_static
    call) against onnxruntime's own replace_input_of_all_nodes on a twin graph, after each way
    the quantizer's graph changes: nodes appended that read a renamed or a new name, a node
    reading one name twice, a reader given a name by replace_node_input itself (a dedicated
    pair's), a removal in the middle and at the end, a removal then an append, the field
    cleared and refilled. The graphs are the same after every edit, and replace_node_input is
    onnxruntime's own again after."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    own_descriptor = ONNXModel.__dict__["replace_node_input"]
    own_replace = ONNXModel.replace_node_input
    theirs, ours = ONNXModel(onnx.ModelProto()), ONNXModel(onnx.ModelProto())
    count = iter(range(1000))

    def append(*inputs):
        k = next(count)
        node = onnx.helper.make_node("Add", list(inputs), [f"y{k}"], name=f"n{k}")
        for model in (theirs, ours):
            model.model.graph.node.extend([node])

    def rename(old):
        new = f"r{next(count)}"
        for node in theirs.model.graph.node:  # onnxruntime's own method, its own replace_node_input
            own_replace(node, old, new)  # (inside the context the class's is the one that marks names)
        ours.replace_input_of_all_nodes(old, new)

    def given(position, old, new):  # a dedicated pair's rename of one reader
        own_replace(theirs.model.graph.node[position], old, new)
        ours.replace_node_input(ours.model.graph.node[position], old, new)

    def remove(position):
        for model in (theirs, ours):
            del model.model.graph.node[position]

    def clear():
        for model in (theirs, ours):
            del model.model.graph.node[:]

    edits = [
        *[lambda inputs=inputs: append(*inputs) for inputs in (("a", "b"), ("a", "a"), ("b", "c"), ("y0", "a"))],
        lambda: rename("a"),
        lambda: append("r4", "d"),  # a new node reads the renamed name
        lambda: rename("r4"),
        lambda: given(2, "c", "given"),
        lambda: rename("given"),
        lambda: rename("absent"),
        lambda: remove(1),
        lambda: rename("b"),
        lambda: remove(len(ours.model.graph.node) - 1),
        lambda: append("y0", "e"),  # as many nodes as indexed, the last one new
        lambda: rename("y0"),
        clear,
        lambda: append("f", "g"),
        lambda: rename("f"),
    ]
    with candidates.readers_renamed_quickly():
        for k, edit in enumerate(edits):
            edit()
            assert ours.model.SerializeToString() == theirs.model.SerializeToString(), k
    assert ONNXModel.__dict__["replace_node_input"] is own_descriptor


def test_the_quantizer_with_dedicated_pairs_and_its_readers_indexed_writes_the_same_bytes(tmp_path):
    """quantize_static with a Q/DQ pair for each reader (DedicatedQDQPair, which renames
    readers one by one) writes the same bytes inside readers_renamed_quickly as outside, for
    each grid setting: the residual CNN's tensors read by two nodes."""
    onnx.save(gen_models.build_cnn(2, channels=4, size=8, seed=2), tmp_path / "cnn.onnx")
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 3, 8, 8)).astype(np.float32)} for k in range(3)]
    for settings in candidates.candidate_settings():
        arguments = candidates.keyword_arguments(settings) | {"extra_options": {"DedicatedQDQPair": True}}
        written = []
        for quick in (False, True):
            path = tmp_path / f"{quick}.onnx"
            with (
                gen_models.quiet_quantizer(),
                candidates.readers_renamed_quickly() if quick else contextlib.nullcontext(),
            ):
                quantize_static(
                    str(tmp_path / "cnn.onnx"), str(path), candidates.SampleReader(list(samples)), **arguments
                )
            written.append(path.read_bytes())
        assert written[0] == written[1], settings


def test_an_initializer_found_by_its_index_is_the_one_onnxruntime_finds_after_every_edit():
    """FirstByName against onnxruntime's own find_by_name on one model's initializers, after
    each way the field changes: appends (a name twice among them), a removal in the middle, a
    removal at the end, a removal then an append of the last name again or of a new name, a
    field cleared and refilled. Every name, and one no item has, is found alike each time. (An item renamed in
    place is not followed: onnxruntime's quantizer names a tensor before it adds it.)"""
    from onnxruntime.quantization.quant_utils import find_by_name

    graph = onnx.GraphProto()
    field = graph.initializer

    def tensor(name, value):
        return onnx.numpy_helper.from_array(np.array([value], np.float32), name)

    def append(name, value=0.0):
        field.extend([tensor(name, value)])

    index = candidates.FirstByName(field)

    def same():
        names = {item.name for item in field} | {"absent"}
        for name in sorted(names):
            found, theirs = index.find(name), find_by_name(name, field)
            assert (found is None) == (theirs is None), name
            if theirs is not None:
                assert found.SerializeToString() == theirs.SerializeToString(), name

    same()
    for k in range(6):
        append(f"w{k}", k)
        same()
    append("w2", 99.0)  # a second w2: the first is still the one found
    same()
    field.remove(field[1])
    same()
    del field[len(field) - 1]
    same()
    last = field[len(field) - 1].name
    field.remove(field[0])
    append(last, 7.0)
    same()
    field.remove(field[1])
    append("new", 8.0)  # as many items as indexed, the last one new
    same()
    del field[:]
    same()
    for k in range(3):
        append(f"v{k}", k)
    same()


def test_the_quantizer_with_its_lookups_indexed_writes_the_same_bytes_and_gets_its_own_back(tmp_path):
    """quantize_static inside initializers_found_quickly writes what it writes outside, for
    each activation type and granularity, and every module's find_by_name is onnxruntime's
    own again after."""
    import sys

    from onnxruntime.quantization.onnx_model import ONNXModel

    onnx.save(gen_models.build_cnn(2, channels=4, size=8, seed=1), tmp_path / "cnn.onnx")
    samples = [{"x": np.random.default_rng(k).standard_normal((1, 3, 8, 8)).astype(np.float32)} for k in range(3)]
    own = {name: module.find_by_name for name, module in sys.modules.items() if hasattr(module, "find_by_name")}
    own_get = ONNXModel.get_initializer
    for settings in candidates.candidate_settings():
        arguments = candidates.keyword_arguments(settings)
        written = []
        for quick in (False, True):
            path = tmp_path / f"{quick}.onnx"
            with (
                gen_models.quiet_quantizer(),
                candidates.initializers_found_quickly() if quick else contextlib.nullcontext(),
            ):
                if quick:
                    assert ONNXModel.get_initializer is not own_get
                    module = sys.modules["onnxruntime.quantization.qdq_quantizer"]
                    assert module.find_by_name is not own["onnxruntime.quantization.qdq_quantizer"]
                quantize_static(
                    str(tmp_path / "cnn.onnx"), str(path), candidates.SampleReader(list(samples)), **arguments
                )
            written.append(path.read_bytes())
        assert written[0] == written[1], settings
    assert {name: module.find_by_name for name, module in sys.modules.items() if hasattr(module, "find_by_name")} == own
    assert ONNXModel.get_initializer is own_get
