"""Build the README tour's models: PP-OCRv4 text detection, float and int8 QDQ.

    pip download rapidocr-onnxruntime==1.4.4 --no-deps -d wheels
    python docs/tour_model.py wheels/rapidocr_onnxruntime-1.4.4-py3-none-any.whl [--out tour]

Needs only onnx, onnxruntime and numpy (a clone's bench/ is not needed: it runs after
``pip install .`` too). Writes into its own folder, ``tour/`` (git ignores it):

- det.onnx: the wheel's ch_PP-OCRv4_det_infer.onnx after onnxruntime's quant_pre_process
  (skip_symbolic_shape=True: the symbolic pass needs sympy, which graphscan does not install);
- det.int8.onnx: quantize_static(det.onnx, quant_format=QDQ) with onnxruntime 1.32's other
  defaults (int8 activations and weights, per tensor, MinMax), calibrated on 8 text-like
  pages 1x3x320x320 (seed 1);
- page0.npz, page1.npz: two more pages (seed 0) for trace, impact, check and tune;
- calibration/cal0.npz ... cal7.npz: the eight calibration pages, for tune.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
SIZE = 320
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # PP-OCR's normalization


def text_page(rng: np.random.Generator, size: int) -> np.ndarray:
    """A white page with lines of dark character-sized blocks, as a normalized 1x3xHxW array."""
    page = np.ones((size, size, 3), np.float32)
    line = size // 16
    for top in range(line, size - 2 * line, 3 * line):
        x = int(rng.integers(0, size // 8))
        end = int(rng.integers(size // 2, size))
        while x < end:
            width = int(rng.integers(line // 2, line + 1))
            page[top : top + line, x : x + width] = rng.uniform(0.0, 0.3)
            x += width + int(rng.integers(1, line // 2 + 2))
    page += rng.normal(0, 0.02, page.shape).astype(np.float32)
    normalized = (page - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    return normalized.transpose(2, 0, 1)[None].astype(np.float32)


def write_samples(folder: Path, count: int, size: int) -> list[Path]:
    """``page0.npz`` ... in ``folder``: text-like pages, seed 0 (the tour's and the bench's)."""
    rng = np.random.default_rng(0)
    paths = []
    for k in range(count):
        path = folder / f"page{k}.npz"
        np.savez(path, x=text_page(rng, size))
        paths.append(path)
    return paths


class Pages(CalibrationDataReader):
    """Eight seeded text-like pages; a new reader for every quantize_static call."""

    def __init__(self, count: int = 8, seed: int = 1) -> None:
        rng = np.random.default_rng(seed)
        self.pages = iter([{"x": text_page(rng, SIZE)} for _ in range(count)])

    def get_next(self) -> dict | None:
        return next(self.pages, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", help="the rapidocr-onnxruntime 1.4.4 wheel")
    parser.add_argument("--out", default="tour", type=Path, help="the folder written (default: tour)")
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        original = Path(scratch) / "det_infer.onnx"
        original.write_bytes(zipfile.ZipFile(args.wheel).read(MEMBER))
        quant_pre_process(str(original), str(out / "det.onnx"), skip_symbolic_shape=True)
    quantize_static(str(out / "det.onnx"), str(out / "det.int8.onnx"), Pages(), quant_format=QuantFormat.QDQ)
    write_samples(out, 2, SIZE)
    calibration = out / "calibration"  # the same eight pages, as files, for tune
    calibration.mkdir(exist_ok=True)
    for k, page in enumerate(Pages().pages):
        np.savez(calibration / f"cal{k}.npz", **page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
