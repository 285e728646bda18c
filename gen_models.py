#!/usr/bin/env python3
"""Build the lab's models and write every artifact into ``ops/``.

The one model builder of the project: conftest.py builds its test models with
these same functions.
"""

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphscan

OPSET = 17
DEFAULT_LAYERS = 3
DEFAULT_DIM = 16
DEFAULT_SEED = 0
CALIBRATION_BATCHES = 8
CALIBRATION_BATCH_SIZE = 4


def layer_names(layer):
    """Node names of layer ``layer`` (1-based): MatMul, Add, Relu."""
    return f"fc{layer}_matmul", f"fc{layer}_add", f"fc{layer}_relu"


def build_mlp(layers, dim, seed, input_shape=("N",)):
    """fp32 MatMul -> Add -> Relu stack with every node named.

    The graph input is ``x`` of shape ``input_shape + (dim,)`` (the leading
    symbolic batch keeps the model usable at any batch size), output ``y``.
    """
    rng = np.random.default_rng(seed)
    nodes, initializers = [], []
    previous = "x"
    for layer in range(1, layers + 1):
        matmul, add, relu = layer_names(layer)
        weight, bias = f"fc{layer}_weight", f"fc{layer}_bias"
        scale = 1.0 / np.sqrt(dim)  # keeps activations O(1) through the stack
        initializers.append(
            numpy_helper.from_array(
                (rng.standard_normal((dim, dim)) * scale).astype(np.float32), weight
            )
        )
        initializers.append(
            numpy_helper.from_array(
                (rng.standard_normal(dim) * 0.1).astype(np.float32), bias
            )
        )
        output = "y" if layer == layers else f"fc{layer}_out"
        nodes += [
            helper.make_node("MatMul", [previous, weight], [f"fc{layer}_mm"], name=matmul),
            helper.make_node("Add", [f"fc{layer}_mm", bias], [f"fc{layer}_sum"], name=add),
            helper.make_node("Relu", [f"fc{layer}_sum"], [output], name=relu),
        ]
        previous = output
    shape = list(input_shape) + [dim]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model, full_check=True)
    return model


class CnnBuilder:
    """Appends named nodes and seeded initializers for build_cnn."""

    def __init__(self, seed, fold_batchnorm):
        self.rng = np.random.default_rng(seed)
        self.fold_batchnorm = fold_batchnorm
        self.nodes, self.initializers = [], []

    def weight(self, name, shape, scale=1.0):
        array = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def node(self, op_type, inputs, name, **attributes):
        self.nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attributes))
        return name

    def conv(self, x, name, c_in, c_out, kernel=3, stride=1):
        """Conv, then BatchNormalization (or its folded form: nothing more)."""
        fan_in = c_in * kernel * kernel
        w = self.weight(f"{name}_w", (c_out, c_in, kernel, kernel), np.sqrt(2.0 / fan_in))
        b = self.weight(f"{name}_b", (c_out,), 0.1)
        pad = kernel // 2
        y = self.node("Conv", [x, w, b], name, pads=[pad] * 4, strides=[stride, stride])
        if self.fold_batchnorm:
            return y
        # Not "<name>_bn_scale": the quantizer names its own scales "<tensor>_scale".
        gamma = self.constant(f"{name}_gamma", 1.0 + 0.1 * self.rng.standard_normal(c_out))
        beta = self.weight(f"{name}_beta", (c_out,), 0.1)
        mean = self.weight(f"{name}_mean", (c_out,), 0.1)
        var = self.constant(f"{name}_var", 1.0 + 0.1 * np.abs(self.rng.standard_normal(c_out)))
        return self.node("BatchNormalization", [y, gamma, beta, mean, var], f"{name}_bn")

    def constant(self, name, values):
        array = np.asarray(values, dtype=np.float32)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name


def build_cnn(blocks, channels=8, size=16, seed=0, fold_batchnorm=False):
    """A small residual CNN: Conv (+BatchNorm), Relu, residual Add, Resize, Concat.

    Every two residual blocks a stride-2 Conv goes down, a Resize comes back
    up and a Concat joins the skip path; a Gemm head gives 10 logits. About
    10 compute nodes per block, so ``blocks=25`` is over 250.
    """
    net = CnnBuilder(seed, fold_batchnorm)
    c = channels
    x = net.node("Relu", [net.conv("x", "stem", 3, c)], "stem_relu")
    for block in range(1, blocks + 1):
        p = f"b{block}"
        h = net.node("Relu", [net.conv(x, f"{p}_conv1", c, c)], f"{p}_relu1")
        h = net.conv(h, f"{p}_conv2", c, c)
        x = net.node("Relu", [net.node("Add", [h, x], f"{p}_add")], f"{p}_relu2")
        if block % 2 == 0:
            down = net.node("Relu", [net.conv(x, f"{p}_down", c, c, stride=2)], f"{p}_down_relu")
            scales = net.constant(f"{p}_resize_scales", [1, 1, 2, 2])
            up = net.node("Resize", [down, "", scales], f"{p}_up", mode="nearest")
            joined = net.node("Concat", [up, x], f"{p}_concat", axis=1)
            x = net.node("Relu", [net.conv(joined, f"{p}_merge", 2 * c, c, kernel=1)], f"{p}_merge_relu")
    pooled = net.node("GlobalAveragePool", [x], "pool")
    flat = net.node("Flatten", [pooled], "flatten", axis=1)
    head_w = net.weight("head_w", (c, 10), 1.0 / np.sqrt(c))
    head_b = net.weight("head_b", (10,), 0.1)
    net.nodes.append(helper.make_node("Gemm", [flat, head_w, head_b], ["y"], name="head"))
    graph = helper.make_graph(
        net.nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        net.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model, full_check=True)
    return model


def concrete_shape(model, batch=CALIBRATION_BATCH_SIZE):
    """The graph input's shape with every symbolic dimension set to ``batch``."""
    dims = model.graph.input[0].type.tensor_type.shape.dim
    return tuple(d.dim_value if d.HasField("dim_value") else batch for d in dims)


def calibration_reader(shape, seed):
    """A new, seeded CalibrationDataReader (a consumed reader yields nothing)."""
    from onnxruntime.quantization import CalibrationDataReader

    class SeededReader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(seed)
            self._batches = iter(
                [
                    {"x": rng.standard_normal(shape).astype(np.float32)}
                    for _ in range(CALIBRATION_BATCHES)
                ]
            )

        def get_next(self):
            return next(self._batches, None)

    return SeededReader()


def quantize_qdq(source, target, seed, **scope):
    """Static QDQ quantization with a new seeded reader; ``scope`` narrows it.

    The one place static settings live, so gemm_full.onnx is quantized exactly
    like full.onnx.
    """
    from onnxruntime.quantization import QuantFormat, quantize_static

    shape = concrete_shape(onnx.load(str(source)))
    quantize_static(
        str(source), str(target), calibration_reader(shape, seed),
        quant_format=QuantFormat.QDQ, **scope,
    )


def quantize_variants(fp32_path, out_dir, exclude, seed):
    """Write full, matmul_only, excluded and dynamic next to ``fp32_path``.

    Returns ``{variant: path}``. Each static call gets its own fresh reader.
    """
    from onnxruntime.quantization import quantize_dynamic

    scopes = {
        "full": {},
        "matmul_only": {"op_types_to_quantize": ["MatMul"]},
        "excluded": {"nodes_to_exclude": [exclude]},
    }
    paths = {}
    for variant, scope in scopes.items():
        paths[variant] = out_dir / f"{variant}.onnx"
        quantize_qdq(fp32_path, paths[variant], seed, **scope)
    paths["dynamic"] = out_dir / "dynamic.onnx"
    quantize_dynamic(str(fp32_path), str(paths["dynamic"]))
    return paths


# --------------------------------------------------------------------------
# The lab's numbers, all measured by graphscan's own functions

SCOPE_KEYS = ["quantize", "dequantize", "round_trips", "island_count", "float", "crossings"]
FUSE_KEYS = ["op_types", "quantize", "dequantize", "round_trips"]


def measure(path):
    """Every graphscan answer about one model, keyed by command."""
    path = str(path)
    return {
        command: getattr(graphscan, command)(path)
        for command in ("nodes", "qdq", "islands", "boundary")
    }


def scope_entry(answers):
    merged = {**answers["qdq"], **answers["islands"], **answers["boundary"]}
    return {key: merged[key] for key in SCOPE_KEYS}


def fuse_entry(answers):
    merged = {**answers["nodes"], **answers["qdq"]}
    return {key: merged[key] for key in FUSE_KEYS}


def scope_report(paths, answers, exclude):
    """scope.json: three static variants and both diffs against full.onnx."""
    return {
        "excluded_node": exclude,
        "models": {v: scope_entry(answers[v]) for v in ("full", "matmul_only", "excluded")},
        "diff_matmul_only": diff_by_name(paths["full"], paths["matmul_only"]),
        "diff_excluded": diff_by_name(paths["full"], paths["excluded"]),
    }


def diff_by_name(a, b):
    """graphscan's diff with the paths written as file names inside ops/."""
    return {**graphscan.diff(str(a), str(b)), "a": a.name, "b": b.name}


def fuse_report(answers, max_abs_error):
    """fuse.json: full.onnx before, gemm_full.onnx after, removed = before - after."""
    before, after = fuse_entry(answers["full"]), fuse_entry(answers["gemm_full"])
    return {
        "before": before,
        "after": after,
        "removed_quantize": before["quantize"] - after["quantize"],
        "removed_round_trips": before["round_trips"] - after["round_trips"],
        "max_abs_error": max_abs_error,
    }


# --------------------------------------------------------------------------
# ops_report.md, written from the answers above (no number typed by hand)

REPORT_SECTIONS = [
    "## 무엇이 int8 로 갔나",
    "## float 로 남은 섬",
    "## 범위를 좁히면 무엇이 달라지나",
    "## 모델을 고쳐 얻은 것",
]
STATIC_VARIANTS = ["full", "matmul_only", "excluded"]


def census_text(op_types):
    return ", ".join(f"{op} {count}" for op, count in op_types.items())


def trace_back(index, tensor, graph_inputs):
    """The compute node (or graph input) a tensor comes from, skipping Q/DQ.

    Returns ``(name or None, crossed)``; ``crossed`` tells a Q/DQ was passed.
    """
    source, chain = graphscan.data_source(index, index.graph, tensor)
    producer = index.producer_of(source)
    if producer is None:
        return (source if source in graph_inputs else None), bool(chain)
    return index.names[producer], bool(chain)


def layer_chain_mermaid(path):
    """A mermaid flowchart of the compute nodes, int8-wrapped and float apart."""
    model = graphscan.load_model(str(path))
    index = graphscan.GraphIndex(model.graph)
    graph_inputs = {i.name for i in model.graph.input}
    ids = {}

    def node_id(name):
        return ids.setdefault(name, f"n{len(ids)}")

    lines = ["```mermaid", "flowchart LR"]
    for name in graph_inputs:
        lines.append(f'  {node_id(name)}(["{name}"])')
    wrapped, floating = [], []
    for i in range(len(index)):
        if not index.is_compute(i):
            continue
        kind = "int8" if index.wrapped[i] else "float"
        (wrapped if index.wrapped[i] else floating).append(node_id(index.names[i]))
        lines.append(f'  {node_id(index.names[i])}["{index.names[i]}<br/>{index.op_types[i]} · {kind}"]')
    for i in range(len(index)):
        if not index.is_compute(i):
            continue
        for tensor in index.inputs[i]:
            source, crossed = trace_back(index, tensor, graph_inputs)
            if source is not None:
                arrow = ' -- "Q→DQ" --> ' if crossed else " --> "
                lines.append(f"  {node_id(source)}{arrow}{node_id(index.names[i])}")
    for output in model.graph.output:
        source, crossed = trace_back(index, output.name, graph_inputs)
        output_id = node_id(f"output:{output.name}")  # a name may be both input and output
        lines.append(f'  {output_id}(["{output.name}"])')
        if source is not None:
            arrow = ' -- "Q→DQ" --> ' if crossed else " --> "
            lines.append(f"  {node_id(source)}{arrow}{output_id}")
    lines.append("  classDef int8 fill:#d8f0dc,stroke:#2e7d32")
    lines.append("  classDef float fill:#fde2e1,stroke:#c62828")
    if wrapped:
        lines.append(f"  class {','.join(wrapped)} int8")
    if floating:
        lines.append(f"  class {','.join(floating)} float")
    lines.append("```")
    return "\n".join(lines)


def section_int8(answers):
    fp32, full, dynamic = answers["fp32"], answers["full"], answers["dynamic"]
    lines = [
        REPORT_SECTIONS[0],
        "",
        "QDQ 형식은 연산자 이름을 그대로 두고 텐서마다 QuantizeLinear / DequantizeLinear 를 끼울 뿐이다. "
        "그래서 MatMul 이 보인다고 양자화가 안 된 것도, 파일이 작아졌다고 int8 로 도는 것도 아니다. "
        "판정 규칙: 모든 입력이 DequantizeLinear 에서 오고 모든 출력이 QuantizeLinear 로만 가는 연산자만 "
        "int8 로 감싼 것으로 센다.",
        "",
        "| 모델 | 노드 | 연산자 census | Q | DQ | Q/DQ 왕복 | 가중치 DQ | int8 로 감싼 연산자 | float 연산자 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in ["fp32"] + STATIC_VARIANTS:
        a = answers[variant]
        lines.append(
            f"| {variant}.onnx | {a['nodes']['nodes']} | {census_text(a['nodes']['op_types'])} "
            f"| {a['qdq']['quantize']} | {a['qdq']['dequantize']} | {a['qdq']['round_trips']} "
            f"| {a['qdq']['weight_dequantize']} | {a['islands']['wrapped']} | {a['islands']['float']} |"
        )
    lines += [
        "",
        f"full.onnx 에서는 연산 노드 {full['islands']['compute']} 개 중 "
        f"{full['islands']['wrapped']} 개가 int8 로 감싸였고 {full['islands']['float']} 개가 float 로 남았다. "
        f"DequantizeLinear {full['qdq']['dequantize']} 개 중 {full['qdq']['weight_dequantize']} 개는 "
        f"가중치용(짝이 되는 Q 가 없다)이라, 활성값의 Q/DQ 왕복은 "
        f"{full['qdq']['dequantize']} − {full['qdq']['weight_dequantize']} = {full['qdq']['round_trips']} 번이다.",
    ]
    absorbed = sorted(set(fp32["nodes"]["op_types"]) - set(full["nodes"]["op_types"]))
    if absorbed:
        lines.append(
            f"fp32.onnx 에 있던 {', '.join(absorbed)} 는 full.onnx 에 없다: quantizer 가 앞 연산자에 흡수했다."
        )
    lines += [
        "",
        f"dynamic.onnx (quantize_dynamic) 는 형식이 다르다: 노드 {dynamic['nodes']['nodes']} 개, "
        f"census {census_text(dynamic['nodes']['op_types'])}. QuantizeLinear / DequantizeLinear 가 없으므로 "
        "섬과 경계의 잣대는 대지 않고 nodes 만 정직한 척도로 쓴다.",
        "",
    ]
    return lines


def island_line(entry, per_island):
    nodes = ", ".join(entry["nodes"])
    return (
        f"- 크기 {entry['size']}: {nodes} ({', '.join(entry['op_types'])}) — "
        f"들어오는 DQ {per_island['in_dequantize']}, 나가는 Q {per_island['out_quantize']}"
    )


def why_not_smaller(answers):
    """The answer to "why did it not shrink as much as expected?", from the counts."""
    full, narrow = answers["full"], answers["matmul_only"]
    return (
        "왜 기대만큼 줄지 않았나: 양자화했다는 것은 int8 로 돈다는 뜻이 아니다. "
        f"matmul_only.onnx 에서는 연산 노드 {narrow['islands']['compute']} 개 중 "
        f"{narrow['islands']['wrapped']} 개만 int8 로 감싸였고, float 연산자 {narrow['islands']['float']} 개가 "
        f"섬 {narrow['islands']['island_count']} 개로 뭉쳐 경계 {narrow['boundary']['crossings']} 개를 만든다. "
        f"모두 감싼 full.onnx 도 Q/DQ 왕복이 {full['qdq']['round_trips']} 번 남아 있어, "
        "그만큼 값을 int8 로 보냈다가 다시 float 로 되돌린다."
    )


def section_islands(answers, paths):
    lines = [
        REPORT_SECTIONS[1],
        "",
        "섬은 개수보다 경계가 문제다. 섬마다 들어오는 DQ 와 나가는 Q 가 붙고, 경계 하나마다 값을 다시 채우는 작업과 "
        "반올림이 한 번씩 늘어난다 (같은 DQ 는 한 번만 센다).",
        "",
        "| 모델 | float 연산자 | 섬 | 섬 크기 | 경계 (crossings) |",
        "|---|---|---|---|---|",
    ]
    for variant in STATIC_VARIANTS:
        a = answers[variant]
        sizes = ", ".join(str(i["size"]) for i in a["islands"]["islands"]) or "-"
        lines.append(
            f"| {variant}.onnx | {a['islands']['float']} | {a['islands']['island_count']} "
            f"| {sizes} | {a['boundary']['crossings']} |"
        )
    lines += ["", why_not_smaller(answers)]
    for variant in STATIC_VARIANTS:
        a = answers[variant]
        lines += ["", f"{variant}.onnx 의 섬 {a['islands']['island_count']} 개:"]
        pairs = zip(a["islands"]["islands"], a["boundary"]["per_island"])
        lines += [island_line(entry, per) for entry, per in pairs] or ["- 없음"]
    lines += [
        "",
        "matmul_only.onnx 의 층 사슬 (초록: int8 로 감싼 연산자, 빨강: float 연산자, "
        "`Q→DQ` 화살표: 값이 int8 로 한 번 갔다 온 경계):",
        "",
        layer_chain_mermaid(paths["matmul_only"]),
        "",
    ]
    return lines


def diff_text(answer):
    ops = ", ".join(f"{op} {delta:+d}" for op, delta in answer["op_delta"].items()) or "없음"
    return (
        f"연산자 {ops}; Q {answer['quantize_delta']:+d}, DQ {answer['dequantize_delta']:+d}, "
        f"왕복 {answer['round_trip_delta']:+d}, 섬 {answer['island_delta']:+d}, "
        f"float 연산자 {answer['float_delta']:+d}"
    )


def direct_initializers(path, node):
    """``[(name, dtype)]`` of the initializers ``node`` reads directly (not via a DQ)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    dtypes = {init.name: graphscan.dtype_name(init.data_type) for init in graph.initializer}
    (target,) = [n for n in graph.node if n.name == node]
    return [(name, dtypes[name]) for name in target.input if name in dtypes]


def section_scope(scope, paths, layers):
    models = scope["models"]
    excluded = scope["excluded_node"]
    kept = direct_initializers(paths["excluded"], excluded)
    kept_text = ", ".join(f"{name} ({dtype})" for name, dtype in kept) or "없음"
    lines = [
        REPORT_SECTIONS[2],
        "",
        "옵션을 줬다고 그대로 됐다고 믿지 않고 다시 센다 (scope.json).",
        "",
        "| 모델 | Q | DQ | 왕복 | 섬 | float 연산자 | 경계 |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, entry in models.items():
        lines.append(
            f"| {variant}.onnx | {entry['quantize']} | {entry['dequantize']} | {entry['round_trips']} "
            f"| {entry['island_count']} | {entry['float']} | {entry['crossings']} |"
        )
    lines += [
        "",
        f"- `op_types_to_quantize=[\"MatMul\"]` (full → matmul_only): {diff_text(scope['diff_matmul_only'])}. "
        f"MatMul 이 아닌 연산자는 통째로 섬이 되어, 층 {layers} 개에 섬 "
        f"{models['matmul_only']['island_count']} 개, 경계 {models['matmul_only']['crossings']} 개가 생겼다.",
        f"- `nodes_to_exclude=[\"{excluded}\"]` (full → excluded): {diff_text(scope['diff_excluded'])}. "
        f"{excluded} 는 float 로 남고, DequantizeLinear 없이 직접 읽는 초기값은 {kept_text} 이다.",
        "- 두 방법은 그래프에 남기는 흔적이 다르다: 종류로 좁히면 그 종류가 아닌 연산자가 층마다 섬이 되고, "
        "이름으로 빼면 그 노드 주변만 섬이 되며 그 가중치가 float 초기값으로 남는다.",
        "",
    ]
    return lines


def section_fuse(fuse, answers):
    before, after = fuse["before"], fuse["after"]
    return [
        REPORT_SECTIONS[3],
        "",
        "MatMul 의 출력이 그 Add 하나에만 쓰이고 Add 의 다른 입력이 초기값일 때만 MatMul+Add 를 Gemm 하나로 "
        "묶었다 (gemm.onnx), 그리고 full.onnx 와 같은 설정으로 양자화했다 (gemm_full.onnx, fuse.json).",
        "",
        "| 모델 | 연산자 census | Q | DQ | 왕복 | 섬 |",
        "|---|---|---|---|---|---|",
        f"| full.onnx | {census_text(before['op_types'])} | {before['quantize']} | {before['dequantize']} "
        f"| {before['round_trips']} | {answers['full']['islands']['island_count']} |",
        f"| gemm_full.onnx | {census_text(after['op_types'])} | {after['quantize']} | {after['dequantize']} "
        f"| {after['round_trips']} | {answers['gemm_full']['islands']['island_count']} |",
        "",
        f"Gemm 으로 고치자 QuantizeLinear 가 {fuse['removed_quantize']} 개, Q/DQ 왕복이 "
        f"{fuse['removed_round_trips']} 번 줄었다. fp32.onnx 와 gemm.onnx 를 같은 입력으로 돌린 최대 절대 오차는 "
        f"{fuse['max_abs_error']!r} 이다.",
        "",
        "시간은 재지 않았다. 이 보고서의 모든 숫자는 그래프를 센 값이다. 시간은 실행 공급자와 하드웨어에 따라 "
        "달라지지만, 어떤 연산자가 int8 로 감싸였고 float 섬이 몇 개이며 경계를 몇 번 넘는지는 그래프의 성질이라 "
        "먼저 세어야 시간을 재도 그 숫자를 해석할 수 있다.",
        "",
    ]


def ops_report(paths, answers, scope, fuse, layers):
    """The Korean report: exactly the four sections of SPEC.md, in order."""
    lines = (
        section_int8(answers)
        + section_islands(answers, paths)
        + section_scope(scope, paths, layers)
        + section_fuse(fuse, answers)
    )
    return "\n".join(lines).rstrip("\n") + "\n"


# --------------------------------------------------------------------------
# The main job

MODELS = ["fp32", "full", "matmul_only", "excluded", "dynamic", "gemm", "gemm_full"]
ARTIFACTS = [f"{m}.onnx" for m in MODELS] + ["scope.json", "fuse.json", "ops_report.md"]


class LabError(Exception):
    """A user error of gen_models.py, reported in one line."""


def write_json(path, data):
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_lab(folder, layers, dim, seed, exclude):
    """Build every artifact of ARTIFACTS into ``folder``; returns the answers."""
    paths = {m: folder / f"{m}.onnx" for m in MODELS}
    onnx.save(build_mlp(layers, dim, seed), paths["fp32"])
    quantize_variants(paths["fp32"], folder, exclude, seed)
    fused = graphscan.fuse(str(paths["fp32"]), str(paths["gemm"]))
    quantize_qdq(paths["gemm"], paths["gemm_full"], seed)  # the settings of full.onnx
    answers = {m: measure(paths[m]) for m in MODELS}
    scope = scope_report(paths, answers, exclude)
    fuse = fuse_report(answers, fused["max_abs_error"])
    write_json(folder / "scope.json", scope)
    write_json(folder / "fuse.json", fuse)
    report = ops_report(paths, answers, scope, fuse, layers)
    (folder / "ops_report.md").write_text(report, encoding="utf-8")
    return {"answers": answers, "scope": scope, "fuse": fuse}


def default_exclude(layers):
    """A middle MatMul: excluding it leaves quantized layers on both sides."""
    return layer_names((layers + 1) // 2)[0]


def parse_args(argv):
    parser = graphscan.OneLineParser(
        description="Build the lab's models and write every artifact into the output folder."
    )
    parser.add_argument("--out", default="ops", help="output folder (default: ops)")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="MatMul-Add-Relu layers, >= 3")
    parser.add_argument("--dim", type=int, default=DEFAULT_DIM, help="feature width")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="weights and calibration seed")
    parser.add_argument("--exclude", help="node left out of excluded.onnx (default: a middle MatMul)")
    return parser.parse_args(argv)


def check_args(args):
    if args.layers < 3:
        raise LabError(f"--layers must be at least 3, got {args.layers}")
    if args.dim < 1:
        raise LabError(f"--dim must be at least 1, got {args.dim}")
    names = [name for layer in range(1, args.layers + 1) for name in layer_names(layer)]
    exclude = args.exclude or default_exclude(args.layers)
    if exclude not in names:
        raise LabError(f"--exclude {exclude!r} is not a node of the model (nodes: {', '.join(names)})")
    return exclude


def staging_folder(out):
    """A temporary folder inside ``out``, so moving files into place is a rename."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".building-", dir=out))
    except OSError as exc:
        raise LabError(f"{graphscan.shown(out)}: cannot write there ({exc.strerror or exc})")


def summary_lines(out, result):
    scope, fuse = result["scope"], result["fuse"]
    lines = [f"gen_models: wrote {len(ARTIFACTS)} files into {graphscan.shown(out)}/: {', '.join(ARTIFACTS)}"]
    for variant, entry in scope["models"].items():
        lines.append(
            f"  {variant}: {entry['round_trips']} round trips, {entry['island_count']} islands, "
            f"{entry['float']} float ops, {entry['crossings']} crossings"
        )
    lines.append(
        f"  fuse: {fuse['removed_quantize']} Q and {fuse['removed_round_trips']} round trips removed, "
        f"max_abs_error {fuse['max_abs_error']!r}"
    )
    return lines


def main(argv=None):
    """Build everything in a staging folder; move it into place only if all succeeded."""
    logging.getLogger().setLevel(logging.ERROR)  # the quantizer's advice is not our output
    try:
        args = parse_args(argv)
        exclude = check_args(args)
        out = Path(args.out)
        staging = staging_folder(out)
        try:
            result = build_lab(staging, args.layers, args.dim, args.seed, exclude)
            for name in ARTIFACTS:
                os.replace(staging / name, out / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except (LabError, graphscan.GraphscanError) as exc:
        print(f"gen_models: error: {graphscan.single_line(str(exc))}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # argparse after printing --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:  # the staging folder is already removed
        print("gen_models: interrupted", file=sys.stderr)
        return graphscan.EXIT_INTERRUPTED
    except Exception as exc:  # still one line; ops/ is untouched either way
        print(f"gen_models: error: {type(exc).__name__}: {graphscan.one_line(exc)}", file=sys.stderr)
        return 1
    print("\n".join(summary_lines(out, result)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
