"""Model inputs (graphscan_ort/shared/inputs.py): what every command that runs a model
feeds it. The laws a plausible bug breaks: --shape read as SPEC writes it, a shape or an
array of another rank refused (never truncated by a zip), one seeded stream for all
inputs, an .npy array read with its own order and byte order, a symbolic dimension that
agrees with any size, every sample's shape reported, a folder read in sorted order."""

import os

import numpy as np
import pytest
from onnx import TensorProto, helper

import graphscan
from graphscan_ort.shared import inputs
from graphscan_ort.shared.options import Named


def spec(name, dims, elem_type=TensorProto.FLOAT):
    return inputs.InputSpec(helper.make_tensor_value_info(name, elem_type, dims))


def model_with_inputs(dims_by_name):
    """Each input through an Identity to an output of its own: a model that declares ``dims_by_name``."""
    names = list(dims_by_name)
    graph = helper.make_graph(
        [helper.make_node("Identity", [n], [f"{n}_out"]) for n in names],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n, dims in dims_by_name.items()],
        [helper.make_tensor_value_info(f"{n}_out", TensorProto.FLOAT, dims) for n, dims in dims_by_name.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def exit_code_of(call):
    with pytest.raises(graphscan.GraphscanError) as raised:
        call()
    return raised.value.exit_code


def test_a_negative_shape_dimension_is_exit_7_and_zero_is_a_size():
    assert exit_code_of(lambda: inputs.parse_shapes(["x=2,-1"])) == graphscan.EXIT_INPUTS
    assert inputs.parse_shapes(["x=0,4"]) == {"x": [0, 4]}


def test_shape_splits_at_the_last_equals_sign_so_a_name_may_hold_one():
    """Dimensions never hold '=', names may (an exporter's 'input=0')."""
    assert inputs.parse_shapes(["input=0=1,3", "y=2"]) == {"input=0": [1, 3], "y": [2]}


def test_a_shape_of_another_rank_is_refused_even_when_its_first_dimensions_fit():
    declared = spec("x", ["N", 4])
    assert inputs.resolve_shape(declared, {"x": [3, 4]}, 1) == ([3, 4], False)
    for wanted in ([3, 4, 5], [3]):
        assert exit_code_of(lambda w=wanted: inputs.resolve_shape(declared, {"x": w}, 1)) == graphscan.EXIT_INPUTS


def test_inputs_of_one_shape_get_different_data_from_one_seeded_stream():
    """One generator for all inputs in declaration order: two inputs of one shape never get
    the same values (Sub(a, b) would be all zeros and measure nothing)."""
    specs = inputs.input_specs(model_with_inputs({"a": [2, 3], "b": [2, 3]}))
    feeds, defaulted = inputs.seeded_feeds(specs, {}, 5, 1)
    rng = np.random.default_rng(5)
    expected_a = rng.standard_normal(6).astype(np.float32).reshape(2, 3)
    expected_b = rng.standard_normal(6).astype(np.float32).reshape(2, 3)
    np.testing.assert_array_equal(feeds["a"], expected_a)
    np.testing.assert_array_equal(feeds["b"], expected_b)
    assert defaulted == [] and not np.array_equal(feeds["a"], feeds["b"])


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param(np.asfortranarray, id="fortran-order"),
        pytest.param(lambda x: x.astype(">f4"), id="big-endian"),
    ],
)
def test_an_npy_array_is_read_with_its_own_order_and_byte_order(tmp_path, stored):
    values = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    np.savez(tmp_path / "s.npz", x=stored(values))
    (read,) = inputs.read_npz_inputs(str(tmp_path / "s.npz"), [spec("x", ["N", 3])]).values()
    np.testing.assert_array_equal(read, values)
    assert read.dtype == np.dtype(np.float32) and read.flags["C_CONTIGUOUS"]


@pytest.mark.parametrize("shape", [(1, 4, 2), (4,)], ids=["one-more-dimension", "one-fewer"])
def test_an_array_of_another_rank_is_refused_before_it_is_read(tmp_path, shape):
    np.savez(tmp_path / "s.npz", x=np.zeros(shape, np.float32))

    def read():
        return inputs.read_npz_inputs(str(tmp_path / "s.npz"), [spec("x", ["N", 4])])

    assert exit_code_of(read) == graphscan.EXIT_INPUTS


def test_a_symbolic_dimension_agrees_with_any_size_and_fixed_ones_must_be_equal():
    """A float model exported with a dynamic batch and its quantized copy fixed at batch 1
    take the same samples; batch 1 and batch 2, or another rank, do not."""
    dynamic, one, two = (model_with_inputs({"x": [batch, 4]}) for batch in ("N", 1, 2))
    inputs.check_same_inputs(Named(dynamic, "f.onnx"), Named(one, "q.onnx"))
    inputs.check_same_inputs(Named(one, "f.onnx"), Named(dynamic, "q.onnx"))
    for a, b in ((one, two), (dynamic, model_with_inputs({"x": ["N", 4, 1]}))):
        code = exit_code_of(lambda a=a, b=b: inputs.check_same_inputs(Named(a, "f.onnx"), Named(b, "q.onnx")))
        assert code == graphscan.EXIT_INPUTS


def test_samples_of_different_shapes_list_every_samples_shape():
    same = [{"x": np.zeros((1, 4))}, {"x": np.zeros((1, 4))}]
    differ = [{"x": np.zeros((1, 4))}, {"x": np.zeros((1, 4))}, {"x": np.zeros((3, 4))}]
    assert inputs.inputs_answer(same) == {"x": [1, 4]}
    assert inputs.inputs_answer(differ) == {"x": [[1, 4], [1, 4], [3, 4]]}


def test_a_folder_of_samples_is_read_in_sorted_order_whatever_the_file_system_lists(tmp_path, monkeypatch):
    folder = tmp_path / "samples"
    folder.mkdir()
    for name in ("b.npz", "a.npz", "c.npz", "notes.txt"):
        (folder / name).write_bytes(b"")
    listed = os.listdir

    def unsorted(path):
        names = listed(path)
        return sorted(names, reverse=True) if os.path.samefile(path, folder) else names

    monkeypatch.setattr(os, "listdir", unsorted)
    expected = [str(folder / name) for name in ("a.npz", "b.npz", "c.npz")]
    assert inputs.sample_files([str(folder), "z.npz"]) == [*expected, "z.npz"]


@pytest.mark.parametrize("size", [2**63, 10**23, 2**31])
def test_a_generated_input_above_the_bound_is_exit_7_before_anything_is_allocated(size):
    """numpy cannot allocate some shapes at all (a dimension of 2**63: ValueError, once exit 1);
    the others would take the machine's memory. The bound is the one --inputs files have."""
    with pytest.raises(graphscan.GraphscanError) as raised:
        inputs.seeded_feeds([spec("x", ["N", 4])], {"x": [size, 4]}, 0, 1)
    assert raised.value.exit_code == graphscan.EXIT_INPUTS
    assert f"{inputs.MAX_INPUT_BYTES:,}" in str(raised.value)
    feeds, _ = inputs.seeded_feeds([spec("x", ["N", 4])], {"x": [inputs.MAX_INPUT_BYTES // 16 // 1024, 4]}, 0, 1)
    assert feeds["x"].nbytes <= inputs.MAX_INPUT_BYTES


def npz_member(path, shape_text, payload):
    """An .npz holding one member x.npy whose header declares ``shape_text`` of float32 and whose
    data is ``payload``, written by hand (numpy writes only honest headers); the member's bytes."""
    import zipfile

    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    member = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin1") + payload
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", member)
    return member


def test_a_member_declaring_more_bytes_than_it_holds_is_refused_before_its_data_is_read(tmp_path):
    """(1000, 16) float32 declares 64,000 bytes; the member holds its header and 64 bytes."""
    member = npz_member(tmp_path / "s.npz", "(1000, 16)", bytes(64))
    with pytest.raises(graphscan.GraphscanError) as raised:
        inputs.read_npz_inputs(str(tmp_path / "s.npz"), [spec("x", ["N", 16])])
    assert raised.value.exit_code == graphscan.EXIT_INPUTS
    assert f"declares 64000 bytes but the member holds {len(member)}" in str(raised.value)


@pytest.mark.parametrize(
    ("bound", "refused"),
    [pytest.param(127, True, id="one-byte-below"), pytest.param(128, False, id="at-the-bound")],
)
def test_a_member_is_refused_above_the_bound_even_when_it_holds_every_byte(tmp_path, monkeypatch, bound, refused):
    """The bound on a member's declared bytes (8 GiB, made 127 or 128 here) holds for an honest
    member too: a (2, 16) float32 array is 128 bytes, refused above the bound, read at it."""
    values = np.arange(32, dtype="<f4")
    npz_member(tmp_path / "s.npz", "(2, 16)", values.tobytes())
    monkeypatch.setattr(inputs, "MAX_INPUT_BYTES", bound)
    read = lambda: inputs.read_npz_inputs(str(tmp_path / "s.npz"), [spec("x", ["N", 16])])  # noqa: E731
    if refused:
        assert exit_code_of(read) == graphscan.EXIT_INPUTS
    else:
        np.testing.assert_array_equal(read()["x"], values.reshape(2, 16))
