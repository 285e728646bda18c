"""dot: the island map as Graphviz DOT text (for people; the JSON commands are the contract).

The DOT is parsed here (one statement per line, as graphscan writes it) and its
structure checked without Graphviz: every compute node drawn exactly once, every
float island a cluster of exactly its nodes, edges only between declared nodes.
When Graphviz is installed, the same pictures are also rendered to SVG.
"""

import html
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import graphscan
import graphscan_ort.engines.classify as classify_engine
from tests.helpers import chain_model, error_line, run_graphscan
from tests.lab import QDQ_VARIANTS, VARIANTS

WRAPPED, FLOAT = graphscan._COLOURS["wrapped"][0], graphscan._COLOURS["float"][0]
ATTRIBUTE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
NODE = re.compile(r"^\s*(\w+) \[(.*)\];$")
EDGE = re.compile(r"^\s*(\w+) -> (\w+)(?: \[(.*)\])?;$")
CLUSTER = re.compile(r"^\s*subgraph (cluster_\w+) \{$")


def unescape(text):
    """A DOT string's text: backslash escapes, then the HTML entities Graphviz decodes."""
    return html.unescape(re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text))


def attributes(text):
    return {key: unescape(value) for key, value in ATTRIBUTE.findall(text or "")}


def parse_dot(text):
    """``(nodes {id: attrs}, clusters {name: {"label", "nodes"}}, edges [(source, target, label)])``."""
    lines = text.splitlines()
    assert lines[0] == "digraph graphscan {" and lines[-1] == "}"
    nodes, clusters, edges, cluster = {}, {}, [], None
    for line in lines[1:-1]:
        if match := CLUSTER.match(line):
            cluster = clusters.setdefault(match.group(1), {"label": None, "nodes": []})
        elif line.strip() == "}":
            cluster = None
        elif match := EDGE.match(line):
            edges.append((match.group(1), match.group(2), attributes(match.group(3)).get("label", "")))
        elif match := NODE.match(line):
            ident, attrs = match.group(1), attributes(match.group(2))
            if ident == "graph" and cluster is not None:
                cluster["label"] = attrs["label"]
            elif ident not in ("graph", "node", "edge"):
                assert ident not in nodes, f"{ident} declared twice"
                nodes[ident] = attrs
                if cluster is not None:
                    cluster["nodes"].append(ident)
        else:
            raise AssertionError(f"unexpected DOT line: {line!r}")
    return nodes, clusters, edges


def drawn_names(nodes):
    """Compute node name -> DOT id: plain nodes (``n<i>``) and the members of boxes."""
    drawn = {}
    for ident, attrs in nodes.items():
        if ident.startswith(("n", "box")):
            for name in attrs["tooltip"].split("\n") if ident.startswith("box") else [attrs["tooltip"]]:
                assert name not in drawn, f"{name} drawn twice"
                drawn[name] = ident
    return drawn


def assert_structure(path, text):
    """The laws every picture obeys, checked against the counting commands' answers."""
    nodes, clusters, edges = parse_dot(text)
    index = graphscan._index_model(path)
    drawn = drawn_names(nodes)
    assert sorted(drawn) == sorted(index.names[i] for i in index.compute_nodes)
    islands = graphscan.islands(path)["islands"]
    per_island = graphscan.boundary(path)["per_island"]
    assert len(clusters) == len(islands)
    for number, (island, crossing) in enumerate(zip(islands, per_island, strict=True), 1):
        cluster = clusters[f"cluster_island_{number}"]
        assert sorted(nodes[ident]["tooltip"] for ident in cluster["nodes"]) == island["nodes"]
        crossings = crossing["in_dequantize"] + crossing["out_quantize"]
        assert cluster["label"].startswith(f"island {number}: {island['size']} nodes, {crossings} crossings")
    for source, target, _ in edges:
        assert source in nodes and target in nodes, (source, target)
    return nodes, clusters, edges


def render_svg(text):
    """Graphviz's SVG of ``text``; it must render without a warning."""
    proc = subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr
    return proc.stdout.decode()


needs_graphviz = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")


def test_matmul_only_picture_derived_by_hand(default_lab):
    # matmul_only: x -Q/DQ-> fc1_matmul (weight by a DQ, hidden) -Q/DQ-> fc1_add -> fc1_relu
    # -Q/DQ-> fc2_matmul ... fc3_relu -> y. The MatMuls are wrapped; each Add+Relu pair is a
    # float island: one DQ in, one Q out (the last reaches only y: no Q out).
    text = graphscan.dot(str(default_lab["matmul_only"]))
    nodes, clusters, edges = parse_dot(text)
    name = {ident: attrs["tooltip"] for ident, attrs in nodes.items() if "tooltip" in attrs}
    name.update({ident: attrs["label"] for ident, attrs in nodes.items() if ident.startswith(("in", "out"))})
    assert sorted((name[s], name[t], label) for s, t, label in edges) == sorted(
        [
            ("x", "fc1_matmul", "Q→DQ"),
            ("fc1_matmul", "fc1_add", "Q→DQ"),
            ("fc1_add", "fc1_relu", ""),
            ("fc1_relu", "fc2_matmul", "Q→DQ"),
            ("fc2_matmul", "fc2_add", "Q→DQ"),
            ("fc2_add", "fc2_relu", ""),
            ("fc2_relu", "fc3_matmul", "Q→DQ"),
            ("fc3_matmul", "fc3_add", "Q→DQ"),
            ("fc3_add", "fc3_relu", ""),
            ("fc3_relu", "y", ""),
        ]
    )
    assert [c["label"] for c in clusters.values()] == [
        "island 1: 2 nodes, 2 crossings (1 DQ in, 1 Q out)",
        "island 2: 2 nodes, 2 crossings (1 DQ in, 1 Q out)",
        "island 3: 2 nodes, 1 crossings (1 DQ in, 0 Q out)",
    ]
    colours = {name[ident]: attrs["fillcolor"] for ident, attrs in nodes.items() if ident.startswith("n")}
    assert {n for n, colour in colours.items() if colour == WRAPPED} == {"fc1_matmul", "fc2_matmul", "fc3_matmul"}
    assert sum(colour == FLOAT for colour in colours.values()) == 6


@pytest.mark.parametrize("collapse", [False, True], ids=["full", "collapse"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_structure_of_every_lab_picture(default_lab, variant, collapse):
    path = str(default_lab[variant])
    assert_structure(path, graphscan.dot(path, collapse=collapse))


def test_collapse_draws_a_wrapped_chain_as_one_box(tmp_path):
    # a, b, c: every input from a DQ, every output only to a Q: wrapped. d feeds e, and e
    # reaches only y: both float, one island. --collapse draws a..c as one box.
    path = chain_model(tmp_path / "m.onnx", ["qdq", "a", "qdq", "b", "qdq", "c", "qdq", "d", "e"])
    nodes, clusters, edges = assert_structure(path, graphscan.dot(path, collapse=True))
    assert nodes["box0"]["tooltip"] == "a\nb\nc"
    assert nodes["box0"]["label"].startswith("3 wrapped nodes: Relu 3\na\n")
    ident = {attrs["tooltip"]: i for i, attrs in nodes.items() if i.startswith("n")}
    assert edges == [
        ("in0", "box0", "Q→DQ"),
        ("box0", ident["d"], "Q→DQ"),
        (ident["d"], ident["e"], ""),
        (ident["e"], "out0", ""),
    ]
    assert next(iter(clusters.values()))["label"] == "island 1: 2 nodes, 1 crossings (1 DQ in, 0 Q out)"


def test_constants_that_only_set_a_q_scale_are_one_box(tmp_path):
    # Constant nodes make the scales of q1, q3 and dq4. No input, and every output read only
    # by Qs: wrapped (vacuously) for q1's and q3's, which no edge touches: one box of two.
    # The one read by a DQ is float (SPEC: all consumers must be Qs), an island of its own.
    path = chain_model(tmp_path / "m.onnx", ["a", "qdq", "b", "qdq", "c"])
    model = onnx.load(path)
    readers = {"q1": "scale_q1", "q3": "scale_q3", "dq3": "scale_dq3"}
    for node in model.graph.node:
        if node.name in readers:
            node.input[1] = readers[node.name]
    for name in ["scale_dq3", "scale_q3", "scale_q1"]:  # each inserted first: scale_q1 leads
        constant = numpy_helper.from_array(np.float32(0.1))
        model.graph.node.insert(0, helper.make_node("Constant", [], [name], name=name, value=constant))
    onnx.save(model, path)
    nodes, clusters, edges = assert_structure(path, graphscan.dot(path))
    assert nodes["box0"]["tooltip"] == "scale_q1\nscale_q3"
    assert nodes["box0"]["label"].startswith("2 wrapped nodes: Constant 2\n")
    assert not [edge for edge in edges if "box0" in edge]
    alone = [c for c in clusters.values() if [nodes[i]["tooltip"] for i in c["nodes"]] == ["scale_dq3"]]
    assert alone and alone[0]["label"].endswith("0 crossings (0 DQ in, 0 Q out)")


HOSTILE_NAMES = ["clear\x1b[2Jscreen", "over\rwrite", "bell\x07", "nul\x00byte", "rtl\u202eoverride", "new\nline"]


def test_names_with_quotes_backslashes_and_unicode_survive_in_ascii_dot(tmp_path):
    names = ['say "hi"', "back\\slash", "a&b", "a&amp;b", "Ω→ü", *HOSTILE_NAMES]
    path = chain_model(tmp_path / "m.onnx", names)
    text = graphscan.dot(path)
    assert text.isascii()  # printable on any terminal; Graphviz decodes the entities
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", text)  # no control character but the newlines between lines
    nodes, _, _ = parse_dot(text)
    tooltips = sorted(attrs["tooltip"] for i, attrs in nodes.items() if i.startswith("n"))
    # A control character is shown as its escape, never sent to the terminal or to Graphviz.
    assert tooltips == sorted(graphscan.visible(name) for name in names)
    assert "clear\\x1b[2Jscreen" in tooltips and "nul\\x00byte" in tooltips


# --------------------------------------------------------------------------
# --runtime: colours from the runtime command (issue 8), here a hand-written answer


def fake_classify(classes):
    """runtime's classification answering ``classes`` (by node name; None for the rest), in graph order as it does."""

    def classify(model, path):
        index = graphscan.GraphIndex(model.graph)
        names = [index.names[i] for i in index.compute_nodes]
        return types.SimpleNamespace(rows=[{"node": name, "class": classes.get(name)} for name in names])

    return classify


def test_runtime_colours_go_by_position_when_names_repeat(tmp_path):
    """Two nodes named ``dup``: runtime answers them as ``dup`` and ``dup~<i>``;
    each is coloured by its own class, found by graph position, not by name."""
    from onnx import TensorProto

    scale = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    zero = numpy_helper.from_array(np.array(0, np.int8), "z")
    lowest = numpy_helper.from_array(np.array(-128, np.int8), "low")  # a Relu before it is folded away
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q0"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq0"),
        helper.make_node("Relu", ["xd"], ["r"], name="dup"),
        helper.make_node("QuantizeLinear", ["r", "s", "low"], ["rq"], name="q1"),
        helper.make_node("DequantizeLinear", ["rq", "s", "low"], ["rd"], name="dq1"),
        helper.make_node("Sigmoid", ["rd"], ["y"], name="dup"),
    ]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", io[:1], io[1:], [scale, zero, lowest])
    path = tmp_path / "dup.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    rows = graphscan.runtime(str(path))["nodes"]
    assert [r["node"] for r in rows] == ["dup", "dup~5"] and rows[0]["class"] != rows[1]["class"]
    drawn, _, _ = parse_dot(graphscan.dot(str(path), runtime_colours=True))
    colours = [drawn[f"n{i}"]["fillcolor"] for i in (2, 5)]
    assert colours == [graphscan._COLOURS[r["class"]][0] for r in rows]


def test_runtime_colours_follow_the_runtime_classes(default_lab, monkeypatch):
    classes = {
        "fc1_matmul": "int8",
        "fc2_matmul": "int8",
        "fc3_matmul": "float",
        "fc1_add": "float",
        "fc1_relu": "absorbed",
        "fc2_add": "int8_data",
        "fc3_relu": "int4",
    }  # int4, missing: unknown
    monkeypatch.setattr(classify_engine, "classify", fake_classify(classes))
    path = str(default_lab["matmul_only"])
    nodes, _, _ = assert_structure(path, graphscan.dot(path, runtime_colours=True))
    colours = {attrs["tooltip"]: attrs["fillcolor"] for i, attrs in nodes.items() if i.startswith("n")}
    expected = {**classes, "fc2_relu": "unknown", "fc3_add": "unknown", "fc3_relu": "unknown"}  # no int4 colour
    assert colours == {node: graphscan._COLOURS[cls][0] for node, cls in expected.items()}
    legend = parse_graph_label(graphscan.dot(path, runtime_colours=True))
    assert "2 int8 (dark green), 1 int8_data (light green), 2 float (orange), 1 absorbed (grey), 3 unknown" in legend


def parse_graph_label(text):
    return attributes(text.splitlines()[1])["label"]


def test_runtime_missing_is_a_clear_usage_error(default_lab, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "graphscan_ort", None)  # as if graphscan.py were alone
    for name in [name for name in sys.modules if name.startswith("graphscan_ort.")]:
        monkeypatch.delitem(sys.modules, name)
    assert graphscan.main(["dot", str(default_lab["full"]), "--runtime"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("graphscan: ") and "runtime" in err


# --------------------------------------------------------------------------
# As a process; Graphviz when present


def test_dot_prints_dot_text_and_errors_like_every_command(default_lab, tmp_path):
    proc = run_graphscan(["dot", default_lab["matmul_only"]])
    assert proc.returncode == 0 and proc.stderr == b""
    assert proc.stdout.decode() == graphscan.dot(str(default_lab["matmul_only"]))
    assert "missing.onnx" in error_line(run_graphscan(["dot", tmp_path / "missing.onnx"]), 3)
    assert "--format" in error_line(run_graphscan(["dot", default_lab["full"], "--format", "table"]), 2)


@needs_graphviz
@pytest.mark.parametrize("variant", QDQ_VARIANTS)
def test_graphviz_renders_every_island_cluster(default_lab, variant):
    path = str(default_lab[variant])
    text = graphscan.dot(path)
    svg = render_svg(text)
    _, clusters, _ = parse_dot(text)
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    for name in clusters:
        assert f"<title>{name}</title>" in svg


@needs_graphviz
def test_graphviz_renders_collapsed_boxes_and_odd_names(tmp_path):
    path = chain_model(tmp_path / "m.onnx", ["qdq", 'say "hi"', "qdq", "b\\c", "qdq", "Ω&d"])
    svg = render_svg(graphscan.dot(path, collapse=True))
    assert "say &quot;hi&quot;" in svg and "b\\c" in svg and "Ω&amp;d" in svg and "Q→DQ" in svg
