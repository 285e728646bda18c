"""Test helpers shared by every test module: one copy of each idea.

graphscan.py is exercised as its users run it (a separate process, from any
working directory), and every answer is parsed as strict JSON.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPHSCAN = str(ROOT / "graphscan.py")


def run_graphscan(args, cwd=None, script=GRAPHSCAN, env=None, python_flags=(), timeout=300):
    """Run graphscan.py as a separate process; stdout and stderr stay bytes."""
    return subprocess.run(
        [sys.executable, *python_flags, script, *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=timeout,
    )


def describe(proc):
    return f"exit {proc.returncode}\nstdout: {proc.stdout!r}\nstderr: {proc.stderr!r}"


def reject_constant(token):
    raise ValueError(f"not strict JSON: {token}")


def strict_loads(text):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as strict parsers do."""
    return json.loads(text, parse_constant=reject_constant)


def json_answer(proc):
    """Assert a success: exit 0, empty stderr, one strict JSON object then one newline."""
    assert proc.returncode == 0, describe(proc)
    assert proc.stderr == b"", describe(proc)
    text = proc.stdout.decode("utf-8")
    answer, end = json.JSONDecoder(parse_constant=reject_constant).raw_decode(text)
    assert text[end:] == "\n", f"stdout after the JSON object: {text[end:]!r}"
    assert isinstance(answer, dict), describe(proc)
    return answer


def error_line(proc, code):
    """Assert a failure with ``code``: nothing on stdout, one line on stderr; returns it."""
    assert proc.returncode == code, describe(proc)
    assert proc.stdout == b"", describe(proc)
    lines = proc.stderr.decode("utf-8", "replace").splitlines()
    assert len(lines) == 1, describe(proc)
    assert lines[0].startswith("graphscan: "), describe(proc)
    return lines[0]


def chain_model(path, steps, op_type="Relu"):
    """Write a runnable one-chain model ``x -> steps -> y`` to ``path`` and return it as a str.

    Each step is a node name (an ``op_type`` node of that name) or ``"qdq"``, a
    QuantizeLinear -> DequantizeLinear pair (int8, scale 0.1) named ``q<k>``/``dq<k>``.
    A chain's float nodes between two pairs form one island, so sizes and graph
    order are fixed by the list.
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    nodes, tensor = [], "x"
    for k, step in enumerate(steps):
        out = "y" if k == len(steps) - 1 else f"t{k}"
        if step == "qdq":
            nodes.append(helper.make_node("QuantizeLinear", [tensor, "s", "zp"], [f"{out}_q"], name=f"q{k}"))
            nodes.append(helper.make_node("DequantizeLinear", [f"{out}_q", "s", "zp"], [out], name=f"dq{k}"))
        else:
            nodes.append(helper.make_node(op_type, [tensor], [out], name=step))
        tensor = out
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.float32(0.1), "s"), numpy_helper.from_array(np.int8(0), "zp")],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    return str(path)
