"""ops_report.md: the lab's report in Korean, written from measured answers.

SPEC.md asks for exactly four sections, in order; every number comes from the
answers and JSON files gen_models.py measured, never typed by hand. The layer
chain is drawn by reopening the model through graphscan's own index.
"""

import onnx

import graphscan

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
        pairs = zip(a["islands"]["islands"], a["boundary"]["per_island"], strict=True)
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
        f'- `op_types_to_quantize=["MatMul"]` (full → matmul_only): {diff_text(scope["diff_matmul_only"])}. '
        f"MatMul 이 아닌 연산자는 통째로 섬이 되어, 층 {layers} 개에 섬 "
        f"{models['matmul_only']['island_count']} 개, 경계 {models['matmul_only']['crossings']} 개가 생겼다.",
        f'- `nodes_to_exclude=["{excluded}"]` (full → excluded): {diff_text(scope["diff_excluded"])}. '
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
