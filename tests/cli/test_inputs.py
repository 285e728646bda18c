"""Model inputs: the one layer behind --inputs, --shape and --seed of every command that runs a model.

An input file or shape that cannot feed a model is exit 7 before any model runs,
and a sample with nothing in it verifies nothing.
"""

import io
import zipfile

import numpy as np
import pytest

from tests.helpers import ROOT, error_line, main_error_line, run_graphscan, run_main

FP32, FULL = ROOT / "ops" / "fp32.onnx", ROOT / "ops" / "full.onnx"


def npy_with_header(shape_text, payload=b""):
    """A .npy member whose header declares ``shape_text`` (written by hand: numpy refuses bad shapes)."""
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode("latin1") + payload


def test_a_negative_dimension_is_refused_before_the_member_is_read(tmp_path):
    """A negative size made the byte count negative, so the whole member was
    decompressed before it was refused (a 1 MB .npz peaked at 2.1 GB)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x.npy", npy_with_header("(-1, 16)", bytes(64 * 2**20)))  # 64 MiB of zeros, packed small
    path = tmp_path / "negative.npz"
    path.write_bytes(buffer.getvalue())
    assert path.stat().st_size < 2**20
    line = error_line(run_graphscan(["trace", FP32, FULL, "--inputs", path]), 7)
    assert "(-1, 16)" in line or "[-1, 16]" in line


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["check", FULL, "--float", FP32, "--min-sqnr", "-1000", "--shape", "x=0,16"], id="check-shape"),
        pytest.param(["check", FULL, "--float", FP32, "--min-sqnr", "-1000", "--inputs", "{empty}"], id="check-inputs"),
    ],
)
def test_an_empty_sample_never_holds_an_sqnr_budget(argv, tmp_path):
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 16), np.float32))
    argv = [str(a).format(empty=tmp_path / "empty.npz") for a in argv]
    proc = run_graphscan(argv)
    assert proc.returncode == 8, proc.stderr
    assert b'"value": null' in proc.stdout and b'"ok": false' in proc.stdout


def test_an_empty_sample_is_not_measured_by_impact(tmp_path):
    line = error_line(run_graphscan(["impact", FP32, FULL, "--shape", "x=0,16"]), 7)
    assert "empty" in line


def test_an_empty_sample_cannot_verify_a_fusion(tmp_path):
    out = tmp_path / "gemm.onnx"
    line = error_line(run_graphscan(["fuse", FP32, out, "--shape", "x=0,16"]), 6)
    assert "empty" in line and not out.exists()


def fixed_size_model(path):
    """``y = Reshape(x, [3])`` with x declared ``[N]``: it runs only when N is 3."""
    from onnx import TensorProto, helper, numpy_helper, save

    shape = numpy_helper.from_array(np.array([3], np.int64), "three")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "three"], ["y"], name="reshape")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [shape],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["trace", "{m}", "{m}"],
        ["impact", "{m}", "{m}"],
        ["check", "{m}", "--float", "{m}", "--min-sqnr", "1"],
        ["fuse", "{m}", "{out}"],
        ["runtime", "{m}", "--time", "--runs", "1"],
    ],
    ids=["trace", "impact", "check", "fuse", "runtime-time"],
)
def test_a_model_that_needs_other_inputs_is_told_so(tmp_path, argv, capsys):
    """Exit 5 says the inputs were generated and how to give others; with them, it answers."""
    model = fixed_size_model(tmp_path / "m.onnx")
    argv = [arg.format(m=model, out=tmp_path / "out.onnx") for arg in argv]
    line = main_error_line(capsys, argv, 5)
    assert "inputs were generated" in line and "--shape" in line and "--inputs" in line
    code, _, err = run_main(capsys, [*argv, "--shape", "x=3"])
    assert code == 0, err


def test_generated_inputs_have_no_float64_copy_and_the_same_values():
    """Inputs were drawn as float64 and then cast, doubling their memory; they are
    now drawn a chunk at a time, with the very same values."""
    import tracemalloc

    import graphscan_ort.shared.inputs as inputs

    shape, seed = (4, 1_000_003), 11
    expected = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    tracemalloc.start()
    try:
        generated = inputs.seeded_array(np.random.default_rng(seed), shape, np.float32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(generated, expected)
    assert peak < expected.nbytes + 3 * 8 * inputs.GENERATION_CHUNK  # not the 3x of a float64 copy


@pytest.mark.parametrize("command", ["impact", "check", "fuse", "runtime"])
def test_out_of_memory_is_exit_5_in_one_line(command, monkeypatch, capsys, tmp_path):
    """A MemoryError was an internal error (exit 1) everywhere but trace."""
    import graphscan
    import graphscan_ort.shared.inputs

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(graphscan_ort.shared.inputs, "seeded_array", exhausted)
    argv = {
        "impact": ["impact", FP32, FULL],
        "check": ["check", FULL, "--float", FP32, "--min-sqnr", "1"],
        "fuse": ["fuse", FP32, tmp_path / "out.onnx"],
        "runtime": ["runtime", FULL, "--time", "--runs", "1"],
    }[command]
    assert graphscan.main([str(a) for a in argv]) == 5
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "out of memory" in err
