"""gen_models.py and the committed ops/: reproducible, self-consistent, atomic."""

import json
import re

import numpy as np
import onnx
import pytest

import gen_models
import graphscan
from tests.helpers import ROOT, SINGLE_MODEL_COMMANDS, run_onnx
from tests.reference import reference_diff, reference_of

OPS = ROOT / "ops"


def read_json(folder, name):
    return json.loads((folder / name).read_text(encoding="utf-8"))


def answers_by_name(folder, model):
    """graphscan's four answers for one model, with the path as the file name."""
    return {c: {**getattr(graphscan, c)(str(folder / model)), "model": model} for c in SINGLE_MODEL_COMMANDS}


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def fresh_ops(tmp_path_factory):
    """ops/ rebuilt from scratch with the defaults, to compare with the committed one."""
    out = tmp_path_factory.mktemp("fresh") / "ops"
    assert gen_models.main(["--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module", params=["committed", 3, 4, 6], ids=lambda n: f"{n}-layers" if n != "committed" else n)
def generated_lab(request, tmp_path_factory):
    """The committed ops/, and whole labs built for other layer counts, as graders will."""
    if request.param == "committed":
        return gen_models.DEFAULT_LAYERS, OPS
    out = tmp_path_factory.mktemp(f"lab{request.param}")
    assert gen_models.main(["--out", str(out), "--layers", str(request.param), "--dim", "8"]) == 0
    return request.param, out


def test_every_artifact_is_committed():
    assert sorted(p.name for p in OPS.iterdir()) == sorted(gen_models.ARTIFACTS)


@pytest.mark.parametrize("name", ["scope.json", "fuse.json"])
def test_committed_json_equals_regeneration(fresh_ops, name):
    assert read_json(fresh_ops, name) == read_json(OPS, name)


def test_committed_report_equals_regeneration(fresh_ops):
    assert (fresh_ops / "ops_report.md").read_text() == (OPS / "ops_report.md").read_text()


@pytest.mark.parametrize("model", [f"{m}.onnx" for m in gen_models.MODELS])
def test_committed_models_count_like_regeneration(fresh_ops, model):
    # Counted by the brute-force reference, which shares no code with graphscan ...
    committed = reference_of(OPS / model)
    assert reference_of(fresh_ops / model) == committed
    # ... and graphscan agrees with it on the committed file.
    assert answers_by_name(OPS, model) == {c: {"model": model, **committed[c]} for c in SINGLE_MODEL_COMMANDS}


def test_scope_json_agrees_with_the_reference_on_committed_models():
    scope = read_json(OPS, "scope.json")
    assert list(scope) == ["excluded_node", "models", "diff_matmul_only", "diff_excluded"]
    assert list(scope["models"]) == ["full", "matmul_only", "excluded"]
    for variant, entry in scope["models"].items():
        counts = reference_of(OPS / f"{variant}.onnx")
        assert entry == {
            "quantize": counts["qdq"]["quantize"],
            "dequantize": counts["qdq"]["dequantize"],
            "round_trips": counts["qdq"]["round_trips"],
            "island_count": counts["islands"]["island_count"],
            "float": counts["islands"]["float"],
            "crossings": counts["boundary"]["crossings"],
        }
    full = reference_of(OPS / "full.onnx")
    for variant in ["matmul_only", "excluded"]:
        expected = reference_diff(full, reference_of(OPS / f"{variant}.onnx"))
        assert scope[f"diff_{variant}"] == {"a": "full.onnx", "b": f"{variant}.onnx", **expected}
    excluded = onnx.load(OPS / "excluded.onnx").graph.node
    assert scope["excluded_node"] in {n.name for n in excluded}


def test_fuse_json_agrees_with_the_reference_and_onnxruntime():
    fuse = read_json(OPS, "fuse.json")
    assert list(fuse) == ["before", "after", "removed_quantize", "removed_round_trips", "max_abs_error"]
    for key, variant in [("before", "full"), ("after", "gemm_full")]:
        counts = reference_of(OPS / f"{variant}.onnx")
        assert fuse[key] == {
            "op_types": counts["nodes"]["op_types"],
            "quantize": counts["qdq"]["quantize"],
            "dequantize": counts["qdq"]["dequantize"],
            "round_trips": counts["qdq"]["round_trips"],
        }
    assert fuse["removed_quantize"] == fuse["before"]["quantize"] - fuse["after"]["quantize"]
    assert fuse["removed_round_trips"] == fuse["before"]["round_trips"] - fuse["after"]["round_trips"]
    # fuse's verification input: seed 0, the symbolic batch set to 2.
    dim = onnx.load(OPS / "fp32.onnx").graph.input[0].type.tensor_type.shape.dim[1].dim_value
    x = np.random.default_rng(graphscan.Samples().seed).standard_normal((2, dim)).astype(np.float32)
    (expected,), (actual,) = run_onnx(OPS / "fp32.onnx", {"x": x}), run_onnx(OPS / "gemm.onnx", {"x": x})
    assert fuse["max_abs_error"] == pytest.approx(float(np.max(np.abs(expected - actual))), abs=1e-9)


def test_committed_gemm_passes_checker_and_matches_fp32():
    model = onnx.load(OPS / "gemm.onnx")
    onnx.checker.check_model(model, full_check=True)
    dim = model.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    for seed, batch in enumerate([1, 2, 5, 33]):
        x = (np.random.default_rng(seed).standard_normal((batch, dim)) * 10).astype(np.float32)
        (expected,) = run_onnx(OPS / "fp32.onnx", {"x": x})
        (actual,) = run_onnx(OPS / "gemm.onnx", {"x": x})
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    assert read_json(OPS, "fuse.json")["max_abs_error"] <= 1e-5


def test_lab_fusion_removes_one_round_trip_per_layer(generated_lab):
    layers, out = generated_lab
    fuse = read_json(out, "fuse.json")
    assert fuse["removed_round_trips"] == layers
    assert fuse["after"]["op_types"]["Gemm"] == layers
    assert "MatMul" not in fuse["after"]["op_types"]
    gemm_full = reference_of(out / "gemm_full.onnx")["islands"]
    assert gemm_full["float"] == 0 and gemm_full["island_count"] == 0


def test_lab_scope_narrowing_on_any_layer_count(generated_lab):
    layers, out = generated_lab
    scope = read_json(out, "scope.json")
    assert scope["excluded_node"] == f"fc{(layers + 1) // 2}_matmul"
    assert scope["models"]["matmul_only"]["island_count"] == layers
    assert scope["models"]["excluded"]["island_count"] == 1
    assert scope["models"]["full"]["float"] == 0


REPORT_SECTIONS = [
    "## 무엇이 int8 로 갔나",
    "## float 로 남은 섬",
    "## 범위를 좁히면 무엇이 달라지나",
    "## 모델을 고쳐 얻은 것",
]


def report_sections(text):
    """``{heading: body}`` of the report's ## sections, in order."""
    parts = re.split(r"^(## .*)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def assert_four_sections(text):
    assert [line for line in text.splitlines() if line.startswith("#")] == REPORT_SECTIONS
    assert text.startswith(REPORT_SECTIONS[0])


def test_committed_report_has_exactly_the_four_sections():
    assert_four_sections((OPS / "ops_report.md").read_text(encoding="utf-8"))


def test_report_has_exactly_the_four_sections(generated_lab):
    assert_four_sections((generated_lab[1] / "ops_report.md").read_text(encoding="utf-8"))


def test_report_quotes_the_json_numbers(generated_lab):
    layers, out = generated_lab
    scope, fuse = read_json(out, "scope.json"), read_json(out, "fuse.json")
    sections = report_sections((out / "ops_report.md").read_text(encoding="utf-8"))
    scope_text = sections[REPORT_SECTIONS[2]]
    for variant, e in scope["models"].items():
        row = (
            f"| {variant}.onnx | {e['quantize']} | {e['dequantize']} | {e['round_trips']} "
            f"| {e['island_count']} | {e['float']} | {e['crossings']} |"
        )
        assert row in scope_text
    assert f"층 {layers} 개에 섬 {scope['models']['matmul_only']['island_count']} 개" in scope_text
    fuse_text = sections[REPORT_SECTIONS[3]]
    assert f"QuantizeLinear 가 {fuse['removed_quantize']} 개" in fuse_text
    assert f"왕복이 {fuse['removed_round_trips']} 번 줄었다" in fuse_text
    assert f"{fuse['max_abs_error']!r}" in fuse_text
    assert "시간은 재지 않았다" in fuse_text


def test_report_islands_match_the_reference(generated_lab):
    _, out = generated_lab
    islands_text = report_sections((out / "ops_report.md").read_text(encoding="utf-8"))[REPORT_SECTIONS[1]]
    for variant in ["matmul_only", "excluded"]:
        answer = reference_of(out / f"{variant}.onnx")["boundary"]
        assert answer["per_island"], variant
        for entry in answer["per_island"]:
            line = f"{', '.join(entry['nodes'])} "
            assert line in islands_text
            assert f"들어오는 DQ {entry['in_dequantize']}, 나가는 Q {entry['out_quantize']}" in islands_text


def test_report_mermaid_tells_int8_from_float(generated_lab):
    layers, out = generated_lab
    text = (out / "ops_report.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```mermaid\n(.*?)```", text, flags=re.S)
    islands = reference_of(out / "matmul_only.onnx")["islands"]
    float_names = {n for island in islands["islands"] for n in island["nodes"]}
    for layer in range(1, layers + 1):
        for name in gen_models.layer_names(layer):
            kind = "float" if name in float_names else "int8"
            assert re.search(rf'\["{name}<br/>\w+ · {kind}"\]', block), name
    assert block.count("class ") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--layers", "2"], "--layers must be at least 3", id="too-few-layers"),
        pytest.param(["--exclude", "fc9_matmul"], "is not a node", id="unknown-exclude"),
        pytest.param(["--layers", "three"], "invalid int value", id="bad-option-value"),
    ],
)
def test_bad_arguments_leave_ops_untouched(tmp_path, capsys, argv, message):
    out = tmp_path / "ops"
    out.mkdir()
    (out / "scope.json").write_text("previous")
    assert gen_models.main(["--out", str(out), *argv]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err
    assert folder_bytes(out) == {"scope.json": b"previous"}


def test_failure_mid_build_leaves_ops_untouched(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ops"
    assert gen_models.main(["--out", str(out), "--dim", "8"]) == 0
    before = folder_bytes(out)
    capsys.readouterr()

    def broken(*args, **kwargs):
        raise RuntimeError("quantizer exploded")

    monkeypatch.setattr(gen_models, "quantize_qdq", broken)
    assert gen_models.main(["--out", str(out), "--dim", "8", "--seed", "5"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "quantizer exploded" in err
    assert folder_bytes(out) == before  # no new file, no half-written one, no staging folder


def test_unwritable_folder_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert gen_models.main(["--out", str(blocker / "ops")]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "cannot write" in err


def test_same_arguments_give_identical_bytes(tmp_path):
    for name in ["a", "b"]:
        assert gen_models.main(["--out", str(tmp_path / name), "--layers", "4", "--dim", "8"]) == 0
    assert folder_bytes(tmp_path / "a") == folder_bytes(tmp_path / "b")
