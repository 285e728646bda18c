"""Build the README tour's models: PP-OCRv4 text detection, float and int8 QDQ.

    pip download rapidocr-onnxruntime==1.4.4 --no-deps -d wheels
    .venv/bin/python docs/tour_model.py wheels/rapidocr_onnxruntime-1.4.4-py3-none-any.whl

Writes into the current folder:

- det.onnx: the wheel's ch_PP-OCRv4_det_infer.onnx after onnxruntime's quant_pre_process
  (skip_symbolic_shape=True: the symbolic pass needs sympy, which graphscan does not install);
- det.int8.onnx: quantize_static(det.onnx, quant_format=QDQ) with onnxruntime 1.32's other
  defaults (int8 activations and weights, per tensor, MinMax), calibrated on 8 text-like
  pages 1x3x320x320 (seed 1);
- page0.npz, page1.npz: two more pages (seed 0, bench/bench_impact.py's samples) for
  trace, impact, check and tune;
- calibration/cal0.npz ... cal7.npz: the eight calibration pages, for tune.
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_impact import text_page, write_samples  # one page generator for the tour and the bench

MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
SIZE = 320


class Pages(CalibrationDataReader):
    """Eight seeded text-like pages; a new reader for every quantize_static call."""

    def __init__(self, count=8, seed=1):
        rng = np.random.default_rng(seed)
        self.pages = iter([{"x": text_page(rng, SIZE)} for _ in range(count)])

    def get_next(self):
        return next(self.pages, None)


def main(wheel):
    with tempfile.TemporaryDirectory() as scratch:
        original = Path(scratch) / "det_infer.onnx"
        original.write_bytes(zipfile.ZipFile(wheel).read(MEMBER))
        quant_pre_process(str(original), "det.onnx", skip_symbolic_shape=True)
    quantize_static("det.onnx", "det.int8.onnx", Pages(), quant_format=QuantFormat.QDQ)
    write_samples(Path("."), 2, SIZE)
    calibration = Path("calibration")  # the same eight pages, as files, for tune
    calibration.mkdir(exist_ok=True)
    for k, page in enumerate(Pages().pages):
        np.savez(calibration / f"cal{k}.npz", **page)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
