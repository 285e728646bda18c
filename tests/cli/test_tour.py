"""The README's tour as a new user meets it: docs/tour_model.py runs without a clone's
bench/ (as after ``pip install .``), reads the two wheels ``pip download`` wrote, writes into
a folder of its own, which git ignores, and says so."""

import importlib.util
import struct
import subprocess
import sys
import zipfile
import zlib

import numpy as np
import onnx
import pytest

import gen_models
from tests.helpers import ROOT

MEMBER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
IMAGES = [
    "page.png",
    "text.png",
    "camera.png",
    "astronaut.png",
    "coffee.png",
    "chelsea.png",
    "motorcycle_left.png",
    "coins.png",
]
COLOUR_TYPES = {1: 0, 3: 2, 4: 6}  # channels -> PNG colour type (gray, RGB, RGBA)


def tour_model():
    spec = importlib.util.spec_from_file_location("tour_model", ROOT / "docs" / "tour_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paeth(a, b, c):
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def png(image):
    """An 8-bit PNG of an HxWxC uint8 array, written from the PNG specification's filter
    definitions (row k uses filter k mod 5), independently of the decoder under test."""
    height, width, channels = image.shape
    rows = image.reshape(height, width * channels).astype(int)
    raw = b""
    for y in range(height):
        kind, line = y % 5, rows[y]
        up = rows[y - 1] if y else np.zeros_like(line)
        out = []
        for x in range(len(line)):
            a = line[x - channels] if x >= channels else 0
            c = up[x - channels] if x >= channels else 0
            guess = [0, a, up[x], (a + up[x]) // 2, paeth(a, up[x], c)][kind]
            out.append((line[x] - guess) % 256)
        raw += bytes([kind, *out])

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, COLOUR_TYPES[channels], 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("channels", [pytest.param(c, id=f"{c}-channels") for c in COLOUR_TYPES])
def test_the_png_reader_inverts_every_filter(channels):
    image = np.random.default_rng(channels).integers(0, 256, (11, 7, channels), dtype=np.uint8)
    np.testing.assert_array_equal(tour_model().read_png(png(image)), image)


def test_the_tour_runs_isolated_and_writes_only_its_own_folder(tmp_path):
    """Stand-in wheels: a small CNN where the real one holds PP-OCRv4 det (same input: x,
    [N, 3, H, W]), and images known by hand where scikit-image's are: pure red photographs
    (rapidocr's BGR order, ``(v / 255 - 0.5) / 0.5``: B -1, G -1, R +1) and two pages that
    are gray ramps from left to right over ranges of their own, so that a held-out cut that
    shares a column with a calibration cut would share values with it.
    ``python -I`` puts neither the script's folder nor the clone on sys.path."""
    model = gen_models.build_cnn(2, channels=4, size=8, seed=0)
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_param = "W"
    model.graph.output[0].type.tensor_type.ClearField("shape")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "rapidocr_onnxruntime-1.4.4-py3-none-any.whl", "w") as archive:
        archive.writestr(MEMBER, model.SerializeToString())
    red = np.zeros((24, 40, 3), np.uint8)
    red[:, :, 0] = 255
    ramps = {"page.png": (0, 120), "text.png": (135, 255)}  # 24x48: 640 wide at height 320
    with zipfile.ZipFile(wheels / "scikit_image-0.26.0-cp311-cp311-manylinux_2_28_x86_64.whl", "w") as archive:
        for name in IMAGES:
            low, high = ramps.get(name, (0, 0))
            ramp = np.broadcast_to(np.linspace(low, high, 48).round().astype(np.uint8), (24, 48))[:, :, None]
            archive.writestr(f"skimage/data/{name}", png(ramp if name in ramps else red))
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-I", str(ROOT / "docs" / "tour_model.py"), str(wheels)],
        cwd=work,
        capture_output=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    said = proc.stdout.decode().strip().splitlines()
    assert len(said) == 1 and "tour" in said[0], said  # one short line that names what it wrote
    assert sorted(p.name for p in work.iterdir()) == ["tour"]  # nothing in the folder it was run from
    written = sorted(p.relative_to(work / "tour").as_posix() for p in (work / "tour").rglob("*") if p.is_file())
    calibration = [f"calibration/cal{k}.npz" for k in range(8)]
    # held/: every 320-tile of each page's held-out half scaled to heights 320, 480, 640, 800, 960
    # and 1120 (2h wide, a half h wide: h // 320 tiles across and down): 1 + 1 + 4 + 4 + 9 + 9 per page.
    held = [f"held/held{k:02d}.npz" for k in range(2 * (1 + 1 + 4 + 4 + 9 + 9))]
    assert written == sorted([*calibration, *held, "det.int8.onnx", "det.onnx", "page0.npz", "page1.npz"])
    samples = {name: np.load(work / "tour" / name)["x"] for name in ["page0.npz", "page1.npz", *calibration]}
    assert all(x.shape == (1, 3, 320, 320) and x.dtype == np.float32 for x in samples.values())
    photos = [x for x in samples.values() if not np.allclose(x[0, 0], x[0, 2])]  # red: B and R differ
    assert len(photos) == 6
    for x in photos:
        np.testing.assert_allclose(x[0, :, 0, 0], [-1.0, -1.0, 1.0], atol=1e-6)
        np.testing.assert_allclose(x, np.broadcast_to(x[:, :, :1, :1], x.shape), atol=1e-6)
    spans = {name: (x.min(), x.max()) for name, x in samples.items() if np.allclose(x[0, 0], x[0, 2])}
    seen_pages = [name for name in spans if name.startswith("calibration/")]
    assert len(spans) == 4 and len(seen_pages) == 2  # the two pages: a half each for calibration
    for name in ["page0.npz", "page1.npz", *held]:  # no held-out value in a calibration cut's span
        x = np.load(work / "tour" / name)["x"]
        assert x.shape == (1, 3, 320, 320) and np.allclose(x[0, 0], x[0, 2])  # a page's gray, never a photo
        for seen in seen_pages:
            assert x.max() < spans[seen][0] or spans[seen][1] < x.min(), (name, seen, spans)
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(work / "tour" / "det.int8.onnx").graph.node)
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/tour/" in ignored and "/wheels/" in ignored  # what the README's two lines leave in a clone
