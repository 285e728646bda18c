"""The README's tour as a new user meets it: docs/tour_model.py runs without a clone's
bench/ (as after ``pip install .``) and writes into a folder of its own, which git ignores."""

import subprocess
import sys
import zipfile

import onnx

import gen_models
from tests.helpers import ROOT

MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"


def test_the_tour_runs_isolated_and_writes_only_its_own_folder(tmp_path):
    """A stand-in wheel holds a small CNN where the real one holds PP-OCRv4 det (same input:
    x, [N, 3, H, W]). ``python -I`` puts neither the script's folder nor the clone on sys.path."""
    model = gen_models.build_cnn(2, channels=4, size=8, seed=0)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_param = "W"
    model.graph.output[0].type.tensor_type.ClearField("shape")
    wheel = tmp_path / "rapidocr_onnxruntime-1.4.4-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(MEMBER, model.SerializeToString())
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-I", str(ROOT / "docs" / "tour_model.py"), str(wheel)],
        cwd=work,
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert sorted(p.name for p in work.iterdir()) == ["tour"]  # nothing in the folder it was run from
    written = sorted(p.relative_to(work / "tour").as_posix() for p in (work / "tour").rglob("*") if p.is_file())
    calibration = [f"calibration/cal{k}.npz" for k in range(8)]
    assert written == sorted([*calibration, "det.int8.onnx", "det.onnx", "page0.npz", "page1.npz"])
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(work / "tour" / "det.int8.onnx").graph.node)
    assert "/tour/" in (ROOT / ".gitignore").read_text().splitlines()
