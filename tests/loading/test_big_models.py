"""Big models and external data: structural commands answer without the weights.

The multi-GiB cases are marked ``slow`` (deselected by default; run them with
``pytest -m slow -p no:xdist -s`` to see the peak-memory table).
"""

import sys

import pytest
from onnx import TensorProto

import gen_models
import graphscan
from tests.helpers import (
    GRAPHSCAN,
    SINGLE_MODEL_COMMANDS,
    load_bench_script,
    main_runs_in_one_process,
    strict_loads,
    varint,
    with_external_weights,
)

MiB = 1 << 20
GiB = 1 << 30


def field(number, length):
    """Key and length of a length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(length)


def write_big_model(path, tensor_bytes, tensors):
    """The lab MLP plus ``tensors`` FLOAT initializers of ``tensor_bytes`` each,
    embedded, written in chunks so the test never holds the weights."""
    model = gen_models.build_mlp(3, 8, seed=0)
    graph_head = model.graph.SerializeToString()
    payloads = []
    for k in range(tensors):
        header = TensorProto(name=f"big_{k}", data_type=TensorProto.FLOAT, dims=[tensor_bytes // 4])
        header = header.SerializeToString()
        payloads.append((header + field(9, tensor_bytes), tensor_bytes))  # 9 = raw_data
    graph_length = len(graph_head) + sum(len(field(5, len(h) + n)) + len(h) + n for h, n in payloads)
    model.ClearField("graph")
    chunk = bytes(64 * MiB)
    with open(path, "wb") as f:
        f.write(model.SerializeToString() + field(7, graph_length) + graph_head)
        for header, n in payloads:
            f.write(field(5, len(header) + n) + header)
            for start in range(0, n, len(chunk)):
                f.write(chunk[: min(len(chunk), n - start)])
    return path


def peak_rss(argv, folder):
    """Exit code, stdout and peak RSS (bytes) of ``argv``, through bench/measure.py."""
    out, err = folder / "measured.stdout", folder / "measured.stderr"
    result = load_bench_script("measure").measured(argv, out, err)
    return result["exit"], out.read_text(), result["peak_rss"]


@pytest.mark.parametrize("command", SINGLE_MODEL_COMMANDS)
def test_missing_external_data_file_is_never_needed(tmp_path, command):
    path = with_external_weights(tmp_path / "m.onnx", "weights.bin", 256)
    answer = getattr(graphscan, command)(str(path))
    reference = getattr(graphscan, command)(str(with_external_weights(tmp_path / "n.onnx", "w", 1)))
    assert {**answer, "model": ""} == {**reference, "model": ""}


def opened_files(runs):
    """Per argv of ``runs``: its exit code and every path graphscan opens during it, seen by
    a Python audit hook (which cannot be removed, so all in one separate process)."""
    seen = main_runs_in_one_process(
        runs,
        prelude=(
            "opened = []\n"
            "sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == 'open' else None)"
        ),
        before_each="opened.clear()",
        after_each="list(opened)",
    )
    return [(code, opened) for code, _, _, opened in seen]


def test_location_outside_the_folder_is_never_opened(tmp_path):
    (tmp_path / "weights.bin").write_bytes(bytes(256))
    evil = with_external_weights(tmp_path / "evil.onnx", "../../etc/shadow", 1024)
    local = with_external_weights(tmp_path / "local.onnx", "weights.bin", 256)
    runs = [[command, str(path)] for command in SINGLE_MODEL_COMMANDS for path in (evil, local)]
    for argv, (code, opened) in zip(runs, opened_files(runs), strict=True):
        assert code == 0, argv
        assert argv[1] in opened, argv  # the hook sees graphscan's own open
        assert not [p for p in opened if "shadow" in p or "weights.bin" in p], (argv, opened)


def test_trace_refuses_a_location_outside_the_folder(tmp_path, capsys):
    path = with_external_weights(tmp_path / "m.onnx", "../../etc/shadow", 1024)
    assert graphscan.main(["trace", str(path), str(path)]) == graphscan.EXIT_NOT_ONNX
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1
    assert "points outside the directory" in err and str(path) in err


def test_fuse_reports_missing_external_data(tmp_path, capsys):
    path = with_external_weights(tmp_path / "m.onnx", "weights.bin", 256)
    assert graphscan.main(["fuse", str(path), str(tmp_path / "out.onnx")]) == graphscan.EXIT_NOT_ONNX
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "external data" in err
    assert not (tmp_path / "out.onnx").exists()


def test_skimmed_and_full_parse_agree(tmp_path, monkeypatch, build_case):
    """The big-file path (weights skipped) gives the same answers as the full parse."""
    from tests.lab import CASES

    variants = build_case(CASES[1])
    for variant, path in variants.items():
        full = [getattr(graphscan, c)(str(path)) for c in SINGLE_MODEL_COMMANDS]
        monkeypatch.setattr(graphscan, "_SKIM_THRESHOLD", 0)
        skimmed = [getattr(graphscan, c)(str(path)) for c in SINGLE_MODEL_COMMANDS]
        monkeypatch.undo()
        assert skimmed == full, variant


def test_skim_refuses_a_truncated_big_file(tmp_path, monkeypatch, capsys):
    path = write_big_model(tmp_path / "big.onnx", 4 * MiB, 2)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    monkeypatch.setattr(graphscan, "_SKIM_THRESHOLD", 0)
    assert graphscan.main(["nodes", str(path)]) == graphscan.EXIT_NOT_ONNX
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and str(path) in err


def test_small_big_model_counts_its_initializers(tmp_path):
    path = write_big_model(tmp_path / "big.onnx", 70 * MiB, 1)  # over the skim threshold
    answer = graphscan.nodes(str(path))
    assert answer["initializers"] == {"FLOAT": 7}
    assert answer["op_types"] == {"Add": 3, "MatMul": 3, "Relu": 3}
    code, stdout, peak = peak_rss([sys.executable, GRAPHSCAN, "nodes", str(path)], tmp_path)
    assert code == 0 and strict_loads(stdout)["nodes"] == 9
    assert peak < 70 * MiB  # the 70 MiB of weights were never all in memory


@pytest.mark.slow
def test_two_gib_embedded_model(tmp_path):
    path = write_big_model(tmp_path / "big.onnx", 480 * MiB, 4)  # 1.88 GiB, under protobuf's 2 GiB
    size = path.stat().st_size
    rows = []
    for command in SINGLE_MODEL_COMMANDS:
        code, stdout, peak = peak_rss([sys.executable, GRAPHSCAN, command, str(path)], tmp_path)
        assert code == 0, stdout
        strict_loads(stdout)
        rows.append((command, peak))
    _, _, floor = peak_rss([sys.executable, "-c", f"import onnx; onnx.load({str(path)!r})"], tmp_path)
    print(f"\nembedded model {size / GiB:.2f} GiB; onnx.load peak {floor / MiB:.0f} MiB")
    for command, peak in rows:
        print(f"  {command:9s} peak RSS {peak / MiB:7.1f} MiB = {peak / size:.3f} x file size")
        assert peak < 0.1 * size


@pytest.mark.slow
def test_several_gib_external_model(tmp_path):
    weights = tmp_path / "weights.bin"
    with open(weights, "wb") as f:
        f.truncate(6 * GiB)  # sparse: structural commands must never read it
    path = with_external_weights(tmp_path / "m.onnx", "weights.bin", 6 * GiB)
    for command in SINGLE_MODEL_COMMANDS:
        code, stdout, peak = peak_rss([sys.executable, GRAPHSCAN, command, str(path)], tmp_path)
        assert code == 0
        strict_loads(stdout)
        print(f"\n  external 6 GiB: {command:9s} peak RSS {peak / MiB:7.1f} MiB")
        assert peak < 200 * MiB
