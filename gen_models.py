#!/usr/bin/env python3
"""Build the lab's models and write every artifact into ``ops/``.

The one model builder of the project: conftest.py builds its test models with
these same functions. The Korean report (ops_report.md) is written by
ops_report.py from the answers measured here.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphscan
from ops_report import ops_report

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
            numpy_helper.from_array((rng.standard_normal((dim, dim)) * scale).astype(np.float32), weight)
        )
        initializers.append(numpy_helper.from_array((rng.standard_normal(dim) * 0.1).astype(np.float32), bias))
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


def input_shapes(model, batch=CALIBRATION_BATCH_SIZE):
    """``{name: shape}`` of every graph input that is not an initializer, with
    each symbolic (or unknown) dimension set to ``batch``."""
    initializers = {init.name for init in model.graph.initializer}
    return {
        info.name: tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else batch
            for d in info.type.tensor_type.shape.dim
        )
        for info in model.graph.input
        if info.name not in initializers
    }


def calibration_reader(shapes, seed, batches=CALIBRATION_BATCHES):
    """A new, seeded CalibrationDataReader of standard normal float32 inputs
    ``{name: shape}`` (a consumed reader yields nothing, so one per call)."""
    from onnxruntime.quantization import CalibrationDataReader

    class SeededReader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(seed)
            self._batches = iter(
                [
                    {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
                    for _ in range(batches)
                ]
            )

        def get_next(self):
            return next(self._batches, None)

    return SeededReader()


def quiet_quantizer():
    """The quantizer silenced for one block (graphscan_ort's one ``quiet``: its
    advice off the root logger, its progress off stdout), imported when first used."""
    from graphscan_ort.shared.sessions import quiet

    return quiet()


def quantize_qdq(source, target, seed, **scope):
    """Static QDQ quantization with a new seeded reader; ``scope`` narrows it.

    The one place static settings live, so gemm_full.onnx is quantized exactly
    like full.onnx.
    """
    from onnxruntime.quantization import QuantFormat, quantize_static

    shapes = input_shapes(onnx.load(str(source)))
    quantize_static(
        str(source),
        str(target),
        calibration_reader(shapes, seed),
        quant_format=QuantFormat.QDQ,
        **scope,
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
    return {command: getattr(graphscan, command)(path) for command in ("nodes", "qdq", "islands", "boundary")}


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
    parser = graphscan._OneLineParser(
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
        raise LabError(f"{graphscan.shown(out)}: cannot write there ({exc.strerror or exc})") from None


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
    try:
        args = parse_args(argv)
        exclude = check_args(args)
        out = Path(args.out)
        staging = staging_folder(out)
        try:
            with quiet_quantizer():
                result = build_lab(staging, args.layers, args.dim, args.seed, exclude)
            for name in ARTIFACTS:
                os.replace(staging / name, out / name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except (LabError, graphscan.GraphscanError) as exc:
        print(f"gen_models: error: {graphscan._single_line(str(exc))}", file=sys.stderr)
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
