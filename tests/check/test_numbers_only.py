"""One rule in every command that measures accuracy (check's min_sqnr and min_metric, impact,
tune): an output that is not a tensor of numbers (a STRING tensor, a sequence) is refused with
exit 2 and one line naming it, whether its type is declared or only its value shows it, before
any answer or file is written; tensors of integers are numbers and are measured."""

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests import odd_outputs
from tests.helpers import main_error_line, run_main, run_onnx, strict_loads

USER_METRIC = "def agree(reference, candidate):\n    return 1.0\n"


def commands(float_path, quant_path, sample, folder):
    """Every way to ask for an accuracy figure, by its id."""
    measured = ["--float", float_path, "--inputs", sample]
    return {
        "check-min-sqnr": ["check", quant_path, "--min-sqnr", "20", *measured],
        "check-min-metric-cosine": ["check", quant_path, "--min-metric", "0.5", "--metric", "cosine", *measured],
        "check-min-metric-users": [
            "check", quant_path, "--min-metric", "0.5", "--metric", f"{folder / 'agree.py'}:agree", *measured
        ],
        "impact": ["impact", float_path, quant_path, "--inputs", sample],
        "tune": ["tune", float_path, "--calibrate", sample, "--out", folder / "out"],
        "tune-users-metric": [
            "tune", float_path, "--calibrate", sample, "--out", folder / "out",
            "--metric", f"{folder / 'agree.py'}:agree", "--target", "0.5",
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    "command",
    ["check-min-sqnr", "check-min-metric-cosine", "check-min-metric-users", "impact", "tune", "tune-users-metric"],
)
@pytest.mark.parametrize("kind", ["string", "sequence"])
@pytest.mark.parametrize("declared", [pytest.param(True, id="declared"), pytest.param(False, id="undeclared")])
def test_an_output_that_is_not_numbers_is_refused_in_one_line_by_every_command(
    capsys, tmp_path, command, kind, declared
):
    float_path, quant_path = tmp_path / "float.onnx", tmp_path / "quant.onnx"
    odd_outputs.odd_model(float_path, kind, False, declared)
    odd_outputs.odd_model(quant_path, kind, True, declared)
    (tmp_path / "agree.py").write_text(USER_METRIC)
    argv = commands(float_path, quant_path, odd_outputs.sample(tmp_path), tmp_path)[command]
    assert main_error_line(capsys, argv, 2) == odd_outputs.refusal(float_path, kind)
    assert not (tmp_path / "out").exists()


def test_an_integer_output_is_numbers_and_measured(capsys, tmp_path):
    """y = Relu(x) (its twin a Q->DQ) beside n = Cast(x > 0) as int64, equal in both models:
    n is measured, exact, so the worst part is y's, by numpy on onnxruntime's outputs."""
    paths = []
    for quantized in (False, True):
        nodes = [
            helper.make_node("Relu", ["x"], ["r" if quantized else "y"], name="relu"),
            helper.make_node("Greater", ["x", "zero"], ["positive"]),
            helper.make_node("Cast", ["positive"], ["n"], to=TensorProto.INT64),
        ]
        inits = [numpy_helper.from_array(np.array(0, np.float32), "zero")]
        if quantized:
            nodes += [
                helper.make_node("QuantizeLinear", ["r", "scale", "zp"], ["rq"]),
                helper.make_node("DequantizeLinear", ["rq", "scale", "zp"], ["y"]),
            ]
            inits += [numpy_helper.from_array(np.array(0.07, np.float32), "scale")]
            inits += [numpy_helper.from_array(np.array(0, np.uint8), "zp")]
        outputs = [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("n", TensorProto.INT64, [4]),
        ]
        graph = helper.make_graph(
            nodes, "ints", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])], outputs, inits
        )
        paths.append(tmp_path / f"{'quant' if quantized else 'float'}.onnx")
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), paths[-1])
    sample = odd_outputs.sample(tmp_path)
    code, out, err = run_main(capsys, ["check", paths[1], "--float", paths[0], "--min-sqnr", "0", "--inputs", sample])
    assert code == 0, err
    feeds = dict(np.load(sample))
    (f, n_float), (q, n_quant) = run_onnx(paths[0], feeds), run_onnx(paths[1], feeds)
    assert np.array_equal(n_float, n_quant) and n_float.dtype == np.int64
    f, q = f.astype(np.float64), q.astype(np.float64)
    (row,) = strict_loads(out)["budgets"]
    assert row["value"] == pytest.approx(10 * math.log10(np.sum(f**2) / np.sum((f - q) ** 2)), abs=1e-9)
    assert row["worst_part"] == {"output": "y", "part": 0, "node": "relu"}
