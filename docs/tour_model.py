"""Build the README tour's models and samples: PP-OCRv4 text detection, float and int8 QDQ,
on real scans and photographs.

    pip download rapidocr-onnxruntime==1.4.4 scikit-image==0.26.0 --no-deps -d wheels
    python docs/tour_model.py wheels [--out tour]

Needs only onnx, onnxruntime and numpy (a clone's bench/ is not needed: it runs after
``pip install .`` too; the PNG files are decoded here, with zlib). Reads two wheels from the
folder: the model from rapidocr-onnxruntime's, the images from scikit-image's sample images
(``skimage/data/``). Writes into its own folder, ``tour/`` (git ignores it):

- det.onnx: the wheel's ch_PP-OCRv4_det_infer.onnx after onnxruntime's quant_pre_process
  (skip_symbolic_shape=True, as before graphscan installed sympy: the tour's figures were made so);
- det.int8.onnx: quantize_static(det.onnx, quant_format=QDQ) with onnxruntime 1.32's other
  defaults (int8 activations and weights, per tensor, MinMax), calibrated on calibration/;
- calibration/cal0.npz ... cal7.npz: 1x3x320x320 cuts of the scanned book page ``page.png``
  and the photographed page ``text.png`` (one half each) and of six photographs;
- page0.npz, page1.npz: the other halves of the two pages, which calibration never sees, for
  trace, impact, check and tune.

Each image is scaled to a height of 320 pixels (bilinear), cut 320 wide, and normalized as
rapidocr 1.4.4 feeds the model: BGR, ``(pixel / 255 - 0.5) / 0.5``.
"""

from __future__ import annotations

import argparse
import struct
import sys
import tempfile
import zipfile
import zlib
from pathlib import Path

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
from onnxruntime.quantization.shape_inference import quant_pre_process

MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
MODEL_WHEEL = "rapidocr_onnxruntime-1.4.4-*.whl"
IMAGES_WHEEL = "scikit_image-*.whl"
IMAGES = "skimage/data/"
SIZE = 320
MEAN, STD = 0.5, 0.5  # rapidocr 1.4.4's config.yaml for det, on pixel / 255
# (sample file, image, where the 320-wide cut starts: 0 left, 1 right, 0.5 centre)
# Each scan is over 640 pixels wide once scaled: its left and right cuts do not overlap.
HELD_OUT = [("page0.npz", "page.png", 0.0), ("page1.npz", "text.png", 1.0)]
# held/: tune's held-out pages, enough for an honest verdict: every 320x320 tile of the same
# halves (page.png's left, text.png's right, which calibration never sees) scaled to these heights.
HELD_HALVES = [("page.png", 0.0), ("text.png", 1.0)]
HELD_HEIGHTS = [320, 480, 640, 800, 960, 1120]
CALIBRATION = [
    ("cal0.npz", "page.png", 1.0),
    ("cal1.npz", "text.png", 0.0),
    ("cal2.npz", "camera.png", 0.5),
    ("cal3.npz", "astronaut.png", 0.5),
    ("cal4.npz", "coffee.png", 0.5),
    ("cal5.npz", "chelsea.png", 0.5),
    ("cal6.npz", "motorcycle_left.png", 0.5),
    ("cal7.npz", "coins.png", 0.5),
]
CHANNELS = {0: 1, 2: 3, 4: 2, 6: 4}  # PNG colour type: gray, RGB, gray+alpha, RGBA


def read_png(data: bytes) -> np.ndarray:
    """An 8-bit, non-interlaced PNG (what scikit-image ships) as an HxWxC uint8 array."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG file")
    chunks, offset = {}, 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        chunks.setdefault(kind, []).append(data[offset + 8 : offset + 8 + length])
        offset += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"][0])
    if depth != 8 or interlace or colour not in CHANNELS:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    step = CHANNELS[colour]
    raw = np.frombuffer(zlib.decompress(b"".join(chunks[b"IDAT"])), np.uint8).reshape(height, 1 + width * step)
    rows = np.zeros((height + 1, width * step), np.int32)  # row -1 is zeros
    for y in range(height):
        kind, line, up = raw[y, 0], raw[y, 1:].astype(np.int32), rows[y]
        if kind == 0:
            rows[y + 1] = line
        elif kind == 2:
            rows[y + 1] = (line + up) & 255
        else:  # 1 (sub), 3 (average), 4 (Paeth) depend on the pixel to the left: one pass
            out = rows[y + 1]
            for x in range(width * step):
                left = out[x - step] if x >= step else 0
                corner = up[x - step] if x >= step else 0
                if kind == 1:
                    guess = left
                elif kind == 3:
                    guess = (left + up[x]) // 2
                else:
                    p = left + up[x] - corner
                    pa, pb, pc = abs(p - left), abs(p - up[x]), abs(p - corner)
                    guess = left if pa <= pb and pa <= pc else (up[x] if pb <= pc else corner)
                out[x] = (line[x] + guess) & 255
    return rows[1:].reshape(height, width, step).astype(np.uint8)


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of an HxWxC float array (pixel centres aligned, as OpenCV's INTER_LINEAR)."""

    def axis(new: int, old: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        where = np.clip((np.arange(new) + 0.5) * old / new - 0.5, 0, old - 1)
        low = np.floor(where).astype(int)
        return low, np.minimum(low + 1, old - 1), (where - low).astype(np.float32)

    y0, y1, wy = axis(height, image.shape[0])
    x0, x1, wx = axis(width, image.shape[1])
    rows = image[y0] * (1 - wy)[:, None, None] + image[y1] * wy[:, None, None]
    return rows[:, x0] * (1 - wx)[None, :, None] + rows[:, x1] * wx[None, :, None]


def sample(image: np.ndarray, where: float, size: int = SIZE) -> np.ndarray:
    """A size x size cut of ``image`` scaled to a height of ``size``, as the model's input x."""
    gray = image.shape[2] < 3
    rgb = np.repeat(image[:, :, :1], 3, axis=2) if gray else image[:, :, :3]
    width = max(size, round(image.shape[1] * size / image.shape[0]))
    scaled = resize(rgb.astype(np.float32), size, width)
    left = round((width - size) * where)
    bgr = scaled[:, left : left + size, ::-1] / 255.0
    return ((bgr - MEAN) / STD).transpose(2, 0, 1)[None].astype(np.float32)


def tiles(image: np.ndarray, half: float, height: int, size: int = SIZE) -> list[np.ndarray]:
    """Every size x size tile of one half of ``image`` (0.0: the left, 1.0: the right) scaled to
    ``height``, as the model's input x, row by row."""
    gray = image.shape[2] < 3
    rgb = np.repeat(image[:, :, :1], 3, axis=2) if gray else image[:, :, :3]
    width = round(image.shape[1] * height / image.shape[0])
    scaled = resize(rgb.astype(np.float32), height, width)
    start, stop = (0, width // 2) if half == 0.0 else (width - width // 2, width)
    found = []
    for top in range(0, height - size + 1, size):
        for left in range(start, stop - size + 1, size):
            bgr = scaled[top : top + size, left : left + size, ::-1] / 255.0
            found.append(((bgr - MEAN) / STD).transpose(2, 0, 1)[None].astype(np.float32))
    return found


def find_wheel(folder: Path, pattern: str) -> Path:
    """The one wheel in ``folder`` matching ``pattern``."""
    found = sorted(folder.glob(pattern))
    if not found:
        raise SystemExit(f"tour_model.py: no {pattern} in {folder} (see the pip download line above)")
    return found[-1]


def text_page(rng: np.random.Generator, size: int) -> np.ndarray:
    """A synthetic white page with lines of dark character-sized blocks, as a normalized
    1x3xHxW array (bench/bench_impact.py's workload; the tour uses real images)."""
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
    normalized = (page - np.array((0.485, 0.456, 0.406), np.float32)) / np.array((0.229, 0.224, 0.225), np.float32)
    return normalized.transpose(2, 0, 1)[None].astype(np.float32)


def write_samples(folder: Path, count: int, size: int) -> list[Path]:
    """``page0.npz`` ... in ``folder``: synthetic pages, seed 0 (bench/bench_impact.py's)."""
    rng = np.random.default_rng(0)
    paths = []
    for k in range(count):
        path = folder / f"page{k}.npz"
        np.savez(path, x=text_page(rng, size))
        paths.append(path)
    return paths


class Samples(CalibrationDataReader):
    """The calibration files, read in order; a new reader for every quantize_static call."""

    def __init__(self, paths: list[Path]) -> None:
        self.samples = iter([dict(np.load(path)) for path in paths])

    def get_next(self) -> dict | None:
        return next(self.samples, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", type=Path, help="the folder pip download wrote the two wheels into")
    parser.add_argument("--out", default="tour", type=Path, help="the folder written (default: tour)")
    args = parser.parse_args(argv)
    out = args.out
    calibration = out / "calibration"
    calibration.mkdir(parents=True, exist_ok=True)
    held = out / "held"
    held.mkdir(exist_ok=True)
    with zipfile.ZipFile(find_wheel(args.wheels, IMAGES_WHEEL)) as images:
        for folder, plan in [(out, HELD_OUT), (calibration, CALIBRATION)]:
            for name, image, where in plan:
                np.savez(folder / name, x=sample(read_png(images.read(IMAGES + image)), where))
        count = 0
        for image, half in HELD_HALVES:
            pixels = read_png(images.read(IMAGES + image))
            for height in HELD_HEIGHTS:
                for tile in tiles(pixels, half, height):
                    np.savez(held / f"held{count:02d}.npz", x=tile)
                    count += 1
    with tempfile.TemporaryDirectory() as scratch:
        original = Path(scratch) / "det_infer.onnx"
        original.write_bytes(zipfile.ZipFile(find_wheel(args.wheels, MODEL_WHEEL)).read(MEMBER))
        quant_pre_process(str(original), str(out / "det.onnx"), skip_symbolic_shape=True)
    cal_paths = [calibration / name for name, _, _ in CALIBRATION]
    quantize_static(str(out / "det.onnx"), str(out / "det.int8.onnx"), Samples(cal_paths), quant_format=QuantFormat.QDQ)
    print(f"tour_model.py: wrote det.onnx, det.int8.onnx, page0.npz, page1.npz, held/ and calibration/ into {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
