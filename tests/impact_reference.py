"""A brute-force reference for ``graphscan.py impact``: one plain onnx edit and
one onnxruntime session per variant, written from issue 9's definitions alone.

Nothing here imports graphscan: the edits are spelled out again, node by node,
so a mistake in graphscan's switched model cannot hide in its reference.
bench/bench_impact.py times this against graphscan as the brute force.
"""

import copy
import math
import re

import numpy as np
import onnx
from onnx import helper, numpy_helper

ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")
ORT_SUFFIX = re.compile(r"_(?:QuantizeLinear_Input|QuantizeLinear_Output|DequantizeLinear_Output)(?:_\d+)?$")
DQ_SUFFIX = re.compile(r"_DequantizeLinear_Output(?:_\d+)?$")
QRANGE = {
    onnx.TensorProto.INT8: (-128, 127),
    onnx.TensorProto.UINT8: (0, 255),
    onnx.TensorProto.INT16: (-32768, 32767),
    onnx.TensorProto.UINT16: (0, 65535),
}


_MEMO = {}


def memo(function):
    """Cache a per-model table on the model object's identity (the originals
    stay alive for the whole run; edited copies are never passed here)."""

    def cached(model):
        key = (function.__name__, id(model))
        if key not in _MEMO:
            _MEMO[key] = (model, function(model))
        return _MEMO[key][1]

    return cached


def node_names(model):
    return [n.name or f"{n.op_type}_{i}" for i, n in enumerate(model.graph.node)]


def producers(model):
    return {t: n for n in model.graph.node for t in n.output}


original_producers = memo(producers)  # only for the models as loaded, never their edited copies


@memo
def constants(model):
    """Initializers and Constant-node values, as numpy arrays (models as loaded only)."""
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    values[n.output[0]] = numpy_helper.to_array(a.t)
    return values


def qdq_pairs(model):
    """``[(q, dq, t)]``: every DequantizeLinear fed by a QuantizeLinear of t."""
    made_by = producers(model)
    pairs = []
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear":
            q = made_by.get(n.input[0])
            if q is not None and q.op_type == "QuantizeLinear":
                pairs.append((q, n, q.input[0]))
    return pairs


def is_activation_tensor(model, t):
    """Not a weight: neither an initializer nor a Constant node's output."""
    made_by = producers(model)
    initializers = {i.name for i in model.graph.initializer}
    return t not in initializers and not (t in made_by and made_by[t].op_type == "Constant")


def absorbed(float_model, quant_model, t):
    """The float model's Relu/Clip/LeakyRelu producing t (by name, or the name
    without ORT's suffix), when the quantized model's producer of t differs."""
    float_made, quant_made = original_producers(float_model), original_producers(quant_model)
    node = float_made.get(t) or float_made.get(ORT_SUFFIX.sub("", t))
    if node is None or t not in quant_made or node.op_type not in ACTIVATIONS:
        return None
    return None if quant_made[t].op_type == node.op_type else node


def activation_nodes(float_model, node, t, out, tag):
    """``node`` re-applied to t: new nodes writing ``out`` and the initializers they need."""
    values = constants(float_model)
    inputs, inits = [t], []
    for k, name in enumerate(node.input[1:], start=1):
        if name:
            const = f"ref.{tag}.{k}"
            inits.append(numpy_helper.from_array(values[name], const))
            name = const
        inputs.append(name)
    new = helper.make_node(node.op_type, inputs, [out], name=out)
    new.attribute.extend(node.attribute)
    return [new], inits


def quant_bounds(model, q):  # model: the original quantized model
    values = constants(model)
    scale = float(values[q.input[1]].reshape(-1)[0])
    if len(q.input) > 2 and q.input[2]:
        zero = values[q.input[2]]
        qmin, qmax = QRANGE[helper.np_dtype_to_tensor_dtype(zero.dtype)]
        zp = float(zero.reshape(-1)[0])
    else:
        (qmin, qmax), zp = QRANGE[onnx.TensorProto.UINT8], 0.0
    return (qmin - zp) * scale, (qmax - zp) * scale


def insert_before(model, anchor, nodes):
    graph = model.graph
    position = list(graph.node).index(anchor)
    for k, n in enumerate(nodes):
        graph.node.insert(position + k, n)


def unquantize_ops(float_model, quant_model, names):
    """A copy of the quantized model with each op of ``names`` un-quantized."""
    model = copy.deepcopy(quant_model)
    float_inits = {i.name: i for i in float_model.graph.initializer}
    quant_inits = {i.name: i for i in model.graph.initializer}
    made_by = producers(model)
    pair_by_output = {dq.output[0]: (q, t) for q, dq, t in qdq_pairs(model)}
    wanted = set(names)
    for node, name in zip(list(model.graph.node), node_names(model), strict=True):
        if name not in wanted:
            continue
        for pos, tensor in enumerate(node.input):
            if tensor in pair_by_output:
                t = pair_by_output[tensor][1]
                act = absorbed(float_model, quant_model, t)
                if act is None:
                    node.input[pos] = t
                else:
                    out = f"ref.float.{name}.{pos}"
                    new, inits = activation_nodes(float_model, act, t, out, out)
                    model.graph.initializer.extend(inits)
                    insert_before(model, node, new)
                    node.input[pos] = out
            elif tensor in made_by and made_by[tensor].op_type == "DequantizeLinear":
                source = made_by[tensor].input[0]
                twin = float_inits.get(DQ_SUFFIX.sub("", tensor))
                if source in quant_inits and twin is not None and list(twin.dims) == list(quant_inits[source].dims):
                    weight = copy.deepcopy(twin)
                    weight.name = f"ref.weight.{name}.{pos}"
                    model.graph.initializer.append(weight)
                    node.input[pos] = weight.name
    return model


def replace_dequantize(float_model, quant_model, t, rounding):
    """Every DQ fed by Q(t) replaced by float(t) (or by Clip(t, lo, hi) of that Q)."""
    model = copy.deepcopy(quant_model)
    for q, dq, source in qdq_pairs(model):
        if source != t:
            continue
        out = dq.output[0]
        if rounding:
            lo, hi = quant_bounds(quant_model, q)
            dtype = constants(quant_model)[q.input[1]].dtype
            lo_name, hi_name = f"ref.lo.{out}", f"ref.hi.{out}"
            model.graph.initializer.extend(
                [
                    numpy_helper.from_array(np.array(lo, dtype), lo_name),
                    numpy_helper.from_array(np.array(hi, dtype), hi_name),
                ]
            )
            new = [helper.make_node("Clip", [t, lo_name, hi_name], [out], name=f"ref.clip.{out}")]
        else:
            act = absorbed(float_model, quant_model, t)
            if act is None:
                new = [helper.make_node("Identity", [t], [out], name=f"ref.identity.{out}")]
            else:
                new, inits = activation_nodes(float_model, act, t, out, f"ref.act.{out}")
                model.graph.initializer.extend(inits)
        insert_before(model, dq, new)
        model.graph.node.remove(dq)
    return model


def run(model, samples, outputs=None):
    """Every sample through one fresh session (graph optimizations off)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # threads idle between runs: faster
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [session.run(outputs, feeds) for feeds in samples]


def norm(x):
    """||x||, summed by numpy rather than BLAS: BLAS threads left spinning after
    the call would slow the brute force's next session and make the benchmark
    flatter graphscan."""
    return math.sqrt(float(np.sum(np.square(x))))


def pooled_sqnr(float_outputs, quant_outputs):
    """20*log10(||f|| / ||f - q||) over all samples and outputs; None when f == q."""
    f = np.concatenate([np.asarray(o, np.float64).ravel() for s in float_outputs for o in s])
    q = np.concatenate([np.asarray(o, np.float64).ravel() for s in quant_outputs for o in s])
    noise = norm(f - q)
    if noise == 0 or norm(f) == 0:
        return None
    return 20 * math.log10(norm(f) / noise)


def sqnr(float_outputs, quant_outputs):
    """The worst output's SQNR (the models here join nothing with a Concat before an
    output, so each output is one part): each output's pooled over the samples, the
    lowest of those with noise; None when every output equals float's."""
    figures = [
        pooled_sqnr([[s[k]] for s in float_outputs], [[s[k]] for s in quant_outputs])
        for k in range(len(float_outputs[0]))
    ]
    measured = [db for db in figures if db is not None]
    return min(measured) if measured else None


def float_outputs(float_model, quant_model, samples):
    """The float model's outputs, ordered like the quantized model's outputs."""
    names = [o.name for o in quant_model.graph.output]
    return run(float_model, samples, names)


def reference_impact(float_model, quant_model, samples):
    """``{"baseline", "ops": {node: sqnr}, "tensors": {t: (sqnr, rounding sqnr, clipped)}}``."""
    reference = float_outputs(float_model, quant_model, samples)
    answer = {"baseline": sqnr(reference, run(quant_model, samples)), "ops": {}, "tensors": {}}
    dequantized = {n.output[0] for n in quant_model.graph.node if n.op_type == "DequantizeLinear"}
    for node, name in zip(quant_model.graph.node, node_names(quant_model), strict=True):
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or dequantized.isdisjoint(node.input):
            continue  # nothing it reads could change
        edited = unquantize_ops(float_model, quant_model, [name])
        if edited != quant_model:  # an op row: at least one input was changed
            answer["ops"][name] = sqnr(reference, run(edited, samples))
    for q, _, t in qdq_pairs(quant_model):
        if not is_activation_tensor(quant_model, t) or t in answer["tensors"]:
            continue
        kept = sqnr(reference, run(replace_dequantize(float_model, quant_model, t, False), samples))
        rounded = sqnr(reference, run(replace_dequantize(float_model, quant_model, t, True), samples))
        answer["tensors"][t] = (kept, rounded, clipped(quant_model, samples, t, q))
    return answer


def clipped(quant_model, samples, t, q):
    """Fraction of t's values (in the quantized model) outside that Q's range."""
    lo, hi = quant_bounds(quant_model, q)
    if t in samples[0]:
        values = [s[t] for s in samples]
    else:
        exposed = copy.deepcopy(quant_model)
        exposed.graph.output.append(onnx.ValueInfoProto(name=t))
        values = [r[0] for r in run(exposed, samples, [t])]
    flat = np.concatenate([np.asarray(v, np.float64).ravel() for v in values])
    return float(np.mean((flat < lo) | (flat > hi)))
