"""Model inputs: the one layer behind --inputs, --shape and --seed of every command that runs a model.

An input file or shape that cannot feed a model is exit 7 before any model runs,
and a sample with nothing in it verifies nothing.
"""

import io
import zipfile

import numpy as np
import pytest

from tests.helpers import ROOT, error_line, run_graphscan

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
