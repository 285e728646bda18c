"""The brute-force reference of SPEC.md's counting rules, shared by the tests.

It shares no code with graphscan.py: plain loops over ``graph.node``, a BFS for
islands, sets of node indices for the boundary. It is slow on purpose and easy
to check by eye against SPEC.md's "Shared definitions". The property tests
check graphscan against it on random graphs; other tests use it as the
independent expectation for real models (the committed ops/, the lab cases).
"""

from collections import Counter, deque

from onnx import TensorProto

Q, DQ = "QuantizeLinear", "DequantizeLinear"


def reference(model):
    """Every SPEC.md answer of ``model``, computed the slow, obvious way."""
    graph = model.graph
    nodes = list(graph.node)
    names = [n.name if n.name != "" else f"{n.op_type}_{i}" for i, n in enumerate(nodes)]
    op_types = [n.op_type for n in nodes]
    is_q = [op == Q for op in op_types]
    is_dq = [op == DQ for op in op_types]
    initializer_names = {init.name for init in graph.initializer}

    producer = {}  # tensor -> node index
    consumers = {}  # tensor -> set of node indices
    for i, n in enumerate(nodes):
        for t in n.output:
            if t != "":
                assert t not in producer, "the generator never produces a tensor twice"
                producer[t] = i
        for t in n.input:
            if t != "":
                consumers.setdefault(t, set()).add(i)

    compute = [i for i in range(len(nodes)) if not is_q[i] and not is_dq[i]]
    wrapped = set()
    for i in compute:
        inputs_ok = True
        for t in nodes[i].input:
            if t != "" and not (t in producer and is_dq[producer[t]]):
                inputs_ok = False
        outputs_ok = True
        for t in nodes[i].output:
            if t == "":
                continue
            users = consumers.get(t, set())
            if len(users) == 0 or not all(is_q[c] for c in users):
                outputs_ok = False
        if inputs_ok and outputs_ok:
            wrapped.add(i)
    floats = [i for i in compute if i not in wrapped]

    # Undirected edges between float nodes through a tensor one produces and the other reads.
    neighbours = {i: set() for i in floats}
    for t, p in producer.items():
        if p in neighbours:
            for c in consumers.get(t, set()):
                if c in neighbours:
                    neighbours[p].add(c)
                    neighbours[c].add(p)
    components, seen = [], set()
    for start in floats:
        if start in seen:
            continue
        seen.add(start)
        queue, members = deque([start]), []
        while queue:
            i = queue.popleft()
            members.append(i)
            for j in neighbours[i]:
                if j not in seen:
                    seen.add(j)
                    queue.append(j)
        components.append(members)

    islands, per_island = [], []
    for members in components:
        island_names = sorted(names[i] for i in members)
        islands.append(
            {
                "nodes": island_names,
                "size": len(members),
                "op_types": sorted(op_types[i] for i in members),
            }
        )
        in_dq, out_q = set(), set()
        for i in members:
            for t in nodes[i].input:
                if t != "" and t in producer and is_dq[producer[t]]:
                    in_dq.add(producer[t])
            for t in nodes[i].output:
                if t != "":
                    for c in consumers.get(t, set()):
                        if is_q[c]:
                            out_q.add(c)
        per_island.append({"nodes": island_names, "in_dequantize": len(in_dq), "out_quantize": len(out_q)})
    order = sorted(range(len(islands)), key=lambda k: islands[k]["nodes"][0])
    islands = [islands[k] for k in order]
    per_island = [per_island[k] for k in order]

    round_trips = 0
    for i in range(len(nodes)):
        if is_q[i]:
            users = set()
            for t in nodes[i].output:
                if t != "":
                    users |= consumers.get(t, set())
            if len(users) > 0 and all(is_dq[c] for c in users):
                round_trips += 1
    weight_dequantize = 0
    for i in range(len(nodes)):
        if is_dq[i] and len(nodes[i].input) > 0 and nodes[i].input[0] in initializer_names:
            weight_dequantize += 1

    return {
        "nodes": {
            "nodes": len(nodes),
            "op_types": dict(Counter(op_types)),
            "initializers": dict(Counter(TensorProto.DataType.Name(init.data_type) for init in graph.initializer)),
        },
        "qdq": {
            "quantize": sum(is_q),
            "dequantize": sum(is_dq),
            "round_trips": round_trips,
            "weight_dequantize": weight_dequantize,
        },
        "islands": {
            "compute": len(compute),
            "wrapped": len(wrapped),
            "float": len(floats),
            "island_count": len(islands),
            "islands": islands,
        },
        "boundary": {
            "island_count": len(islands),
            "crossings": sum(e["in_dequantize"] + e["out_quantize"] for e in per_island),
            "per_island": per_island,
        },
    }


def reference_diff(a, b):
    """diff's numbers from two reference answers (b minus a)."""
    ops_a, ops_b = a["nodes"]["op_types"], b["nodes"]["op_types"]
    op_delta = {}
    for op in set(ops_a) | set(ops_b):
        if ops_b.get(op, 0) != ops_a.get(op, 0):
            op_delta[op] = ops_b.get(op, 0) - ops_a.get(op, 0)
    return {
        "op_delta": op_delta,
        "quantize_delta": b["qdq"]["quantize"] - a["qdq"]["quantize"],
        "dequantize_delta": b["qdq"]["dequantize"] - a["qdq"]["dequantize"],
        "round_trip_delta": b["qdq"]["round_trips"] - a["qdq"]["round_trips"],
        "island_delta": b["islands"]["island_count"] - a["islands"]["island_count"],
        "float_delta": b["islands"]["float"] - a["islands"]["float"],
    }


def reference_of(path):
    """``reference`` of the model file at ``path``, read without external data."""
    import onnx

    return reference(onnx.load(str(path), load_external_data=False))
