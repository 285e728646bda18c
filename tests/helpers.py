"""Test helpers shared by every test module: one copy of each idea.

graphscan.py is exercised as its users run it (``python graphscan.py ARGS`` from
any working directory: in this process where that gives the same bytes, else a
separate one), and every answer is parsed as strict JSON.
"""

import contextlib
import dataclasses
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import traceback
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPHSCAN = str(ROOT / "graphscan.py")


DEFAULT_TIMEOUT = 300


def run_graphscan(args, cwd=None, script=GRAPHSCAN, env=None, python_flags=(), timeout=DEFAULT_TIMEOUT):
    """``python graphscan.py ARGS`` as ``subprocess.CompletedProcess``; stdout and stderr stay bytes.

    A plain run (no other environment, interpreter flags, script or timeout) is
    made in this process by :func:`run_in_process`, which gives the same bytes
    and exit code (tests/cli/test_in_process.py holds it to that on every
    command) at a tenth of the cost; anything else is a separate process.
    """
    if env is None and not python_flags and script == GRAPHSCAN and timeout == DEFAULT_TIMEOUT:
        return run_in_process(args, cwd)
    return run_graphscan_process(args, cwd, script, env, python_flags, timeout)


def run_graphscan_process(args, cwd=None, script=GRAPHSCAN, env=None, python_flags=(), timeout=DEFAULT_TIMEOUT):
    """Run graphscan.py as a separate process, as its users do."""
    return subprocess.run(
        [sys.executable, *python_flags, script, *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=timeout,
    )


MAIN_RUNS = """
import contextlib, io, json, sys
{prelude}
sys.path.insert(0, {root!r})
import graphscan
runs = []
for argv in json.loads(sys.argv[1]):
    {before_each}
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = graphscan.main(argv)
    runs.append([code, out.getvalue(), err.getvalue(), {after_each}])
sys.stdout.write(json.dumps(runs))
"""


def main_runs_in_one_process(argvs, cwd=None, env=None, prelude="", before_each="pass", after_each="None"):
    """Each argv of ``argvs`` through ``graphscan.main`` in turn, in one new interpreter:
    for what only a fresh process has (a hash seed, a blocked import, an audit hook that
    cannot be removed) at one start-up for many runs. ``prelude`` runs before graphscan
    is imported, ``before_each`` before every run; per run ``(code, stdout, stderr,
    after_each's value)``."""
    script = MAIN_RUNS.format(prelude=prelude, root=str(ROOT), before_each=before_each, after_each=after_each)
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps([[str(a) for a in argv] for argv in argvs])],
        cwd=cwd, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    return [tuple(run) for run in json.loads(done.stdout)]


@functools.cache
def process_stream_errors():
    """The error handlers a child Python gives stdout and stderr in this environment
    (``surrogateescape`` on stdout under a C.UTF-8 locale, for one)."""
    probe = "import sys; print(sys.stdout.encoding, sys.stdout.errors, sys.stderr.encoding, sys.stderr.errors)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    out_encoding, out_errors, err_encoding, err_errors = done.stdout.split()
    return (out_encoding, out_errors), (err_encoding, err_errors)


def run_in_process(args, cwd=None):
    """``graphscan.main(args)`` in this process, seen as a separate process would see it.

    Descriptors 1 and 2 are pointed at files, so onnxruntime's own C++ output is
    caught as well; ``sys.stdout``/``sys.stderr`` are fresh streams on them with a
    child's encodings; the root logger has no handlers (pytest's would swallow
    what Python's last-resort handler prints); ``cwd`` is the working folder for
    the run. An exception escaping ``main`` is a traceback and exit 1, as in the
    interpreter.
    """
    import graphscan

    argv = [str(a) for a in args]
    (out_encoding, out_errors), (err_encoding, err_errors) = process_stream_errors()
    root = logging.getLogger()
    saved = sys.stdout, sys.stderr, sys.argv, root.handlers[:], os.getcwd()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for stream in saved[:2]:
            stream.flush()
        saved_fds = os.dup(1), os.dup(2)
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = open(1, "w", encoding=out_encoding, errors=out_errors, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", encoding=err_encoding, errors=err_errors, closefd=False, buffering=1)  # noqa: SIM115
            sys.argv = [GRAPHSCAN, *argv]
            root.handlers = []
            if cwd is not None:
                os.chdir(cwd)
            try:
                code = graphscan.main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # the interpreter's answer to an escape
                traceback.print_exc()
                code = 1
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
        finally:
            os.chdir(saved[4])
            sys.stdout, sys.stderr, sys.argv, root.handlers = saved[:4]
            for fd, saved_fd in zip((1, 2), saved_fds, strict=True):
                os.dup2(saved_fd, fd)
                os.close(saved_fd)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([sys.executable, GRAPHSCAN, *argv], code, out.read(), err.read())


def run_onnx(path, feeds, level="disabled"):
    """All outputs of the model at ``path`` on ``feeds``, run directly in onnxruntime:
    with graph optimizations off (Q/DQ kept as written), or ``level`` "all", a
    default session as users run it."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if level == "disabled":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Threads idle between runs instead of spinning: the same outputs, and a test opens many sessions.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def describe(proc):
    return f"exit {proc.returncode}\nstdout: {proc.stdout!r}\nstderr: {proc.stderr!r}"


def reject_constant(token):
    raise ValueError(f"not strict JSON: {token}")


def strict_loads(text):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as strict parsers do."""
    return json.loads(text, parse_constant=reject_constant)


def json_answer(proc, code=0):
    """Assert an answer: exit ``code`` (0: success; 8: check's or tune's unmet), empty stderr,
    one strict JSON object then one newline."""
    assert proc.returncode == code, describe(proc)
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


# --------------------------------------------------------------------------
# SPEC.md "Commands": the counting commands and exactly their keys


SINGLE_MODEL_COMMANDS = ["nodes", "qdq", "islands", "boundary"]
COMMANDS = SINGLE_MODEL_COMMANDS + ["diff"]
SPEC_KEYS = {
    "nodes": ["model", "nodes", "op_types", "initializers"],
    "qdq": ["model", "quantize", "dequantize", "round_trips", "weight_dequantize"],
    "islands": ["model", "compute", "wrapped", "float", "island_count", "islands"],
    "boundary": ["model", "island_count", "crossings", "per_island"],
    "diff": [
        "a",
        "b",
        "op_delta",
        "quantize_delta",
        "dequantize_delta",
        "round_trip_delta",
        "island_delta",
        "float_delta",
    ],
}
ISLAND_KEYS = ["nodes", "size", "op_types"]
PER_ISLAND_KEYS = ["nodes", "in_dequantize", "out_quantize"]
PATH_KEYS = ["model", "a", "b"]
DELTA_KEYS = SPEC_KEYS["diff"][3:]  # every diff key but the paths and op_delta


def assert_counts_are_integers(value, where="answer"):
    """Every number in a structural answer is an int (never a float or a bool)."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"{where}: key {key!r} is not a str"
            if key not in PATH_KEYS:
                assert_counts_are_integers(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            assert_counts_are_integers(item, f"{where}[{i}]")
    elif not isinstance(value, str):
        assert type(value) is int, f"{where} = {value!r} is not an int"


def assert_spec_shape(command, answer):
    """SPEC.md's keys at every level, integer counts, and a strict JSON round trip."""
    assert sorted(answer) == sorted(SPEC_KEYS[command])
    for entry in answer.get("islands", []):
        assert sorted(entry) == sorted(ISLAND_KEYS)
    for entry in answer.get("per_island", []):
        assert sorted(entry) == sorted(PER_ISLAND_KEYS)
    assert_counts_are_integers(answer)
    assert strict_loads(json.dumps(answer)) == answer


def laws_broken(answers):
    """STYLE.md's invariants on the four single-model answers of one model: the
    names of the laws that do not hold (empty when all hold)."""
    nodes, qdq, islands, boundary = (answers[c] for c in SINGLE_MODEL_COMMANDS)
    per_island = boundary["per_island"]
    firsts = [e["nodes"][0] for e in islands["islands"]]
    checks = {
        "nodes == sum(op_types)": nodes["nodes"] == sum(nodes["op_types"].values()),
        "nodes == compute + Q + DQ": nodes["nodes"] == islands["compute"] + qdq["quantize"] + qdq["dequantize"],
        "Q and DQ counted in the census": (qdq["quantize"], qdq["dequantize"])
        == (nodes["op_types"].get("QuantizeLinear", 0), nodes["op_types"].get("DequantizeLinear", 0)),
        "0 <= round_trips <= quantize": 0 <= qdq["round_trips"] <= qdq["quantize"],
        "0 <= weight_dequantize <= dequantize": 0 <= qdq["weight_dequantize"] <= qdq["dequantize"],
        "wrapped + float == compute": islands["wrapped"] + islands["float"] == islands["compute"],
        "sum(sizes) == float": sum(e["size"] for e in islands["islands"]) == islands["float"],
        "island_count == len(islands) == boundary island_count": islands["island_count"]
        == len(islands["islands"])
        == boundary["island_count"],
        "size == len(nodes) == len(op_types) > 0": all(
            e["size"] == len(e["nodes"]) == len(e["op_types"]) > 0 for e in islands["islands"]
        ),
        "islands sorted": firsts == sorted(firsts)
        and all(e["nodes"] == sorted(e["nodes"]) for e in islands["islands"])
        and all(e["op_types"] == sorted(e["op_types"]) for e in islands["islands"]),
        "crossings == sum(per_island)": boundary["crossings"]
        == sum(e["in_dequantize"] + e["out_quantize"] for e in per_island),
        "boundary lists the islands in order": [e["nodes"] for e in per_island]
        == [e["nodes"] for e in islands["islands"]],
    }
    return [law for law, holds in checks.items() if not holds]


def assert_laws(answers):
    broken = laws_broken(answers)
    assert not broken, f"laws broken: {broken}"


def negated(answer):
    """A diff answer with a and b swapped and every delta negated: diff(b, a)."""
    return {
        "a": answer["b"],
        "b": answer["a"],
        "op_delta": {op: -d for op, d in answer["op_delta"].items()},
        **{key: -answer[key] for key in DELTA_KEYS},
    }


# --------------------------------------------------------------------------
# In-process runs


def run_main(capsys, argv):
    """``graphscan.main(argv)`` as ``(code, stdout, stderr)``.

    An exception escaping ``main`` would be a traceback on the command line: it
    comes back as code None with the exception in stderr.
    """
    import graphscan

    capsys.readouterr()
    try:
        code = graphscan.main([str(a) for a in argv])
    except BaseException as exc:  # any escape is the finding
        captured = capsys.readouterr()
        return None, captured.out, captured.err + f"Traceback (escaped main): {type(exc).__name__}: {exc}"
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def main_error_line(capsys, argv, code):
    """``graphscan.main(argv)`` in this process: assert a failure with ``code``,
    nothing on stdout and one ``graphscan: `` line on stderr; returns the line."""
    got, out, err = run_main(capsys, argv)
    assert got == code, (got, out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("graphscan: "), (out, err)
    return err.rstrip("\n")


def process_result(proc):
    """``(exit code, stdout, stderr)`` of a finished run, the streams decoded as text."""
    return proc.returncode, proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")


def command_paths(command, path, original):
    """The paths of one run on ``path``: ``diff`` compares ``original`` with it."""
    return [str(original), str(path)] if command == "diff" else [str(path)]


def contract_violation(command, paths, code, out, err):
    """Why one run of a counting command breaks SPEC.md's contract, or None.

    ``out``/``err`` are text. Exit 0: one strict JSON object of SPEC's shape on one
    stdout line, stderr empty. Exit 3 or 4: stdout empty, one ``graphscan: `` line
    on stderr naming the last path (the damaged one). Nothing else, no traceback.
    """
    shown = f"exit {code}, stdout {out[:300]!r}, stderr {err[:500]!r}"
    if "Traceback" in out or "Traceback" in err:
        return f"traceback: {shown}"
    if code == 0:
        if err or not out.endswith("\n") or out.count("\n") != 1:
            return f"exit 0 but not one stdout line and empty stderr: {shown}"
        try:
            assert_spec_shape(command, strict_loads(out))
        except (ValueError, AssertionError, AttributeError, TypeError) as exc:
            return f"exit 0 with an answer that is not SPEC's ({exc}): {shown}"
        return None
    if code in (3, 4):  # no file / not an ONNX model
        if out:
            return f"error exit with stdout: {shown}"
        if not err.endswith("\n") or err.count("\n") != 1 or not err.startswith("graphscan: "):
            return f"error exit without exactly one 'graphscan: ' stderr line: {shown}"
        if paths[-1] not in err:
            return f"error line does not name {paths[-1]}: {shown}"
        return None
    return f"exit code outside the contract: {shown}"


def load_bench_script(name):
    """A script of bench/ loaded as a module (bench/ is a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def saved_arrays(path):
    """A trace --save .npz read as README says: names.json maps tensor names to keys.

    Returns ``(feeds by tensor name, the float reference)``.
    """
    import numpy as np

    with np.load(path) as arrays:
        names = json.loads(arrays["names.json"])
        feeds = {name: arrays[key] for name, key in names["inputs"].items()}
        return feeds, arrays[names["reference"]]


def with_external_weights(path, location, length):
    """The lab MLP whose first weight claims ``length`` bytes at ``location``."""
    import onnx
    from onnx import TensorProto

    import gen_models

    model = gen_models.build_mlp(3, 8, seed=0)
    weight = model.graph.initializer[0]
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in [("location", location), ("offset", "0"), ("length", str(length))]:
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    onnx.save(model, path)
    return path


def with_weight_scale_times(quant_path, node, factor, out_path):
    """``quant_path`` saved to ``out_path`` with the scale of ``node``'s weight DQ
    multiplied by ``factor``: that op's dequantized weight is ``factor`` x too large."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(quant_path)
    (op,) = [n for n in model.graph.node if n.name == node]
    (dq,) = [n for n in model.graph.node if op.input[1] in n.output]
    (scale,) = [i for i in model.graph.initializer if i.name == dq.input[1]]
    scale.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scale) * factor, scale.name))
    onnx.save(model, out_path)
    return out_path


def mlp_with_weights_beside(folder, name, seed):
    """The lab MLP saved as ``folder/name`` with every weight in ``folder/weights.bin``."""
    import onnx

    import gen_models

    folder.mkdir(exist_ok=True)
    onnx.save(
        gen_models.build_mlp(3, 8, seed=seed),
        folder / name,
        save_as_external_data=True,
        location="weights.bin",
        size_threshold=0,
    )
    return folder / name


def varint(value):
    """A protobuf varint, written here so the tests do not lean on graphscan's encoder."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def fuse_with_transposed_b(monkeypatch):
    """Make graphscan's fusion wrong on purpose (every Gemm gets transB=1), so a test
    can show the verification catches a fusion that gives other numbers."""
    from onnx import helper

    import graphscan_ort.commands.fuse

    honest = graphscan_ort.commands.fuse.fuse_matmul_add

    def transposing(model):
        fused, done, skipped = honest(model)
        for node in fused.graph.node:
            if node.op_type == "Gemm":
                node.attribute.append(helper.make_attribute("transB", 1))
        return fused, done, skipped

    monkeypatch.setattr(graphscan_ort.commands.fuse, "fuse_matmul_add", transposing)


# Run as `python -c INTERRUPT_AT EVENT ARGUMENT script args...`: the script, sent
# SIGINT at the first audit event EVENT whose first argument is ARGUMENT ("*": any).
INTERRUPT_AT = """
import os, runpy, signal, sys
event_wanted, argument = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[3:]
sent = []
def hook(event, args):
    seen = str(args[0]) if args else ""
    matches = argument in ("*", seen) or (argument.startswith("*") and seen.endswith(argument[1:]))
    if not sent and event == event_wanted and args and matches:
        sent.append(True)
        os.kill(os.getpid(), signal.SIGINT)
sys.addaudithook(hook)
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# INTERRUPT_AT with SIGTERM (a CI timeout) instead of Ctrl-C.
TERMINATE_AT = INTERRUPT_AT.replace("signal.SIGINT", "signal.SIGTERM")


def replace_command(monkeypatch, name, run):
    """Make command ``name`` run ``run`` (its paths and options unchanged) for one test."""
    import graphscan

    entry = graphscan._COMMANDS[name]
    command = dataclasses.replace(graphscan._load_command(name), run=run)
    monkeypatch.setitem(graphscan._COMMANDS, name, dataclasses.replace(entry, declared=lambda: command))


def install_into_fresh_venv(folder, index):
    """A new venv under ``folder`` with graphscan installed from a copy of the
    repository; returns its bin folder. ``index``: use the package registry
    (fresh dependencies), else the dependencies already installed here."""
    source = folder / "source"
    source.mkdir()
    for name in [*sorted(path.name for path in ROOT.glob("graphscan*.py")), "pyproject.toml", "README.md"]:
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "graphscan_ort", source / "graphscan_ort", ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = folder / "venv"
    bin_dir = env_dir / "bin"
    if index:
        venv.create(env_dir, with_pip=True)
        # pip runs the build backend from the new venv; its bundled setuptools is too old to build wheels.
        shutil.rmtree(next((env_dir / "lib").glob("python3*/site-packages/setuptools")), ignore_errors=True)
        pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, str(source)], check=True, capture_output=True, timeout=900)
        return bin_dir
    # No pip of its own (ensurepip is most of the time): this venv's pip installs into it,
    # and this venv's packages (onnx, onnxruntime, numpy, setuptools) are visible to it.
    venv.create(env_dir, with_pip=False)
    purelib = next((env_dir / "lib").glob("python3*/site-packages"))
    (purelib / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q"]
    subprocess.run(
        [*pip, "--disable-pip-version-check", "--no-deps", "--no-build-isolation", "--no-index", str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return bin_dir


def calibration_reader(paths):
    """onnxruntime's calibration reader over the ``.npz`` samples at ``paths``: tune's own
    ``SampleReader``, so the tests calibrate as tune does."""
    import numpy as np

    from graphscan_ort.tune.candidates import SampleReader

    return SampleReader([dict(np.load(p)) for p in paths])


def mlp_with_samples(folder, layers, width, count, rows, seed):
    """``folder``/mlp.onnx (gen_models' MLP, ``layers`` deep, ``width`` wide) and ``count``
    seeded samples of ``rows`` rows each beside it, s0.npz, s1.npz, ...: their paths."""
    import numpy as np
    import onnx

    import gen_models

    onnx.save(gen_models.build_mlp(layers, width, 0, ("N",)), Path(folder) / "mlp.onnx")
    rng = np.random.default_rng(seed)
    files = [str(Path(folder) / f"s{k}.npz") for k in range(count)]
    for path in files:
        np.savez(path, x=rng.standard_normal((rows, width)).astype(np.float32))
    return files


def searched(row):
    """A tune row's ``nodes_to_exclude`` without its seeds (``kept_float``): what the
    fallback search added."""
    seeds = {kept["node"] for kept in row["kept_float"]}
    return [node for node in row["quantize_static"].get("nodes_to_exclude") or [] if node not in seeds]


def without_dynamic_candidates(monkeypatch):
    """tune with quantize_static candidates only: for tests of the stages that refine them
    (refinements, exclusions), on MLPs where a dynamic row would already meet the target."""
    import graphscan_ort.tune.stages as tune_stages

    monkeypatch.setattr(tune_stages, "dynamic_settings", lambda model: [])


def without_structural_seeds(monkeypatch):
    """tune with no structural seeds (tune/seeds.py) and no blocks around the worst part
    (blocks.part_blocks): for tests of the search by impact's ranking alone."""
    import graphscan_ort.tune.stages as tune_stages

    monkeypatch.setattr(tune_stages, "structural_seeds", lambda *args, **kwargs: [])
    monkeypatch.setattr(tune_stages, "part_blocks", lambda *args, **kwargs: [])


def small_cnn(folder, blocks, count, seed, names=None):
    """gen_models' residual CNN (``blocks`` blocks, 16 channels: int8 is smaller than float, 8x8
    pixels) saved as ``folder/cnn.onnx``, and ``count`` seeded standard-normal samples
    ``s0.npz``, ``s1.npz``, ... (``names``: their paths under ``folder`` instead, folders
    made), drawn in that order: the model's path and the sample files."""
    import numpy as np
    import onnx

    import gen_models

    fp32 = Path(folder) / "cnn.onnx"
    onnx.save(gen_models.build_cnn(blocks, channels=16, size=8, seed=0), fp32)
    rng = np.random.default_rng(seed)
    files = []
    for name in names or [f"s{k}.npz" for k in range(count)]:
        files.append(str(Path(folder) / name))
        Path(files[-1]).parent.mkdir(parents=True, exist_ok=True)
        np.savez(files[-1], x=rng.standard_normal((1, 3, 8, 8)).astype(np.float32))
    return fp32, files


def small_cnn_and_qdq(folder):
    """gen_models' residual CNN (2 blocks, 4 channels, 8x8 pixels) and its QDQ model the lab's
    way, saved as ``folder/cnn.onnx`` and ``folder/cnn_qdq.onnx``: their paths."""
    import onnx

    import gen_models

    fp32, quant = Path(folder) / "cnn.onnx", Path(folder) / "cnn_qdq.onnx"
    onnx.save(gen_models.build_cnn(2, channels=4, size=8, seed=0), fp32)
    with gen_models.quiet_quantizer():
        gen_models.quantize_qdq(fp32, quant, seed=0)
    return fp32, quant


def small_cnn_held_out(folder):
    """small_cnn with 2 blocks, 2 calibration samples ``cal0.npz``, ``cal1.npz`` and 8
    held-out samples ``held/h0.npz``, ... drawn after them (seed 4): enough held-out samples
    to show a row at least as accurate as the defaults'. The model's path, the calibration
    files and the held-out folder."""
    names = ["cal0.npz", "cal1.npz", *(f"held/h{k}.npz" for k in range(8))]
    fp32, files = small_cnn(folder, 2, len(names), seed=4, names=names)
    return fp32, files[:2], Path(folder) / "held"


def item_outcomes(output):
    """``{item id: outcome}`` from pytest ``-rA``'s summary lines (``PASSED id`` / ``FAILED id - ...``)."""
    found = {}
    for line in output.splitlines():
        for outcome in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(outcome + " "):
                found[line[len(outcome) + 1 :].split(" - ")[0].strip()] = outcome.lower()
    return found


CTC_ALPHABET = "-abcde"  # the classes of ctc_head: 0, the blank, is "-"
CTC_CLASSES, CTC_FRAMES, CTC_HIDDEN = len(CTC_ALPHABET), 16, 64


def ctc_head(path, sequences, time_first, noise=0.0, declared=None, seed=0, spread=1.0):
    """A CTC head on [N, T, 6] frames: y = relu(x W1) W2, which is x when ``noise`` is 0
    (W1 = [I, -I, spread * R], W2 = [I; -I; 0]; the noise is in W2's rows that pass x on;
    a wide ``spread`` coarsens the int8 scale of x W1), with the output transposed to
    [T, N, 6] when ``time_first``; ``declared``: the output's declared dims (default: its
    fixed shape)."""
    import numpy as np
    import onnx

    rng = np.random.default_rng(seed)
    eye = np.eye(CTC_CLASSES)
    w1 = np.concatenate([eye, -eye, spread * rng.standard_normal((CTC_CLASSES, CTC_HIDDEN - 2 * CTC_CLASSES))], axis=1)
    w2 = np.concatenate([eye, -eye, np.zeros((CTC_HIDDEN - 2 * CTC_CLASSES, CTC_CLASSES))])
    w2[: 2 * CTC_CLASSES] += noise * rng.standard_normal((2 * CTC_CLASSES, CTC_CLASSES))  # the rows that pass x on
    nodes = [
        onnx.helper.make_node("MatMul", ["x", "w1"], ["h"]),
        onnx.helper.make_node("Relu", ["h"], ["r"]),
        onnx.helper.make_node("MatMul", ["r", "w2"], ["logits" if time_first else "y"]),
    ]
    if time_first:
        nodes.append(onnx.helper.make_node("Transpose", ["logits"], ["y"], perm=[1, 0, 2]))
    shape = [CTC_FRAMES, sequences, CTC_CLASSES] if time_first else [sequences, CTC_FRAMES, CTC_CLASSES]
    graph = onnx.helper.make_graph(
        nodes,
        "ctc_head",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [sequences, CTC_FRAMES, CTC_CLASSES])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, declared or shape)],
        [onnx.numpy_helper.from_array(w.astype(np.float32), name) for w, name in ((w1, "w1"), (w2, "w2"))],
    )
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)]), path)
    return str(path)


def ctc_frames(folder, sequences, count=4, seed=3, margin=2.0):
    """Frames a recognizer might see, ``sequences`` per sample: mostly the blank, now and
    then a character, ahead of the other classes by about ``margin``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    paths, arrays = [], []
    for k in range(count):
        classes = np.where(
            rng.random((sequences, CTC_FRAMES)) < 0.6, 0, rng.integers(1, CTC_CLASSES, (sequences, CTC_FRAMES))
        )
        x = (np.eye(CTC_CLASSES)[classes] * margin + rng.normal(0, 0.3, (sequences, CTC_FRAMES, CTC_CLASSES))).astype(
            np.float32
        )
        paths.append(str(folder / f"frames{sequences}x{k}.npz"))
        np.savez(paths[-1], x=x)
        arrays.append(x)
    return paths, arrays


def ctc_strings(logits, time_first, alphabet):
    """The greedy CTC decode of every sequence of ``logits`` ([N, T, C], or [T, N, C] when
    ``time_first``), written apart from graphscan's: the argmax of each frame (the first
    maximum), repeats merged, the blank (class 0) dropped, each class its character of
    ``alphabet``."""
    sequences = logits.shape[1] if time_first else logits.shape[0]
    strings = []
    for n in range(sequences):
        frames = logits[:, n, :] if time_first else logits[n, :, :]
        text, previous = "", None
        for frame in frames:
            best = max(range(len(frame)), key=lambda c: (frame[c], -c))
            if best != previous and best != 0:
                text += alphabet[best]
            previous = best
        strings.append(text)
    return strings


def string_agreement(reference, candidate, time_first, alphabet):
    """The share of sequences whose ``ctc_strings`` agree, over paired lists of logits."""
    same = total = 0
    for f, q in zip(reference, candidate, strict=True):
        for a, b in zip(ctc_strings(f, time_first, alphabet), ctc_strings(q, time_first, alphabet), strict=True):
            same += a == b
            total += 1
    return same / total


def undisturbed_timings(monkeypatch):
    """tune taking every row's float time as undisturbed, for tests of accuracy that time
    each row once (--runs 1) on a shared machine: a busy moment would null a row's speedup
    (its float time far off, Trials.steady) and the slower guard would refuse it."""
    monkeypatch.setattr("graphscan_ort.tune.trials.far_off", lambda value, others: False)


def point_estimates(monkeypatch):
    """tune's policy taking every figure as exact: a row's bound is its value, and a row is
    shown at least as accurate as another where its mean paired difference is 0 or above. For
    the search's mechanics on a sample or two, where the statistics (tests/tune/test_choice.py)
    would rightly show nothing."""
    import graphscan_ort.tune.choice as choice

    def shown_above(values, other, confidence):
        differences = choice.paired(values, other)
        return differences is not None and len(differences) > 0 and float(differences.mean()) >= 0

    monkeypatch.setattr(choice.Policy, "bound", lambda self, row, confidence: choice.accuracy_value(row))
    monkeypatch.setattr(choice, "shown_above", shown_above)
