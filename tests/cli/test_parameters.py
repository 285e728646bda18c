"""Options travel as typed groups (Samples, MetricChoice, Budgets, Session, Timing, CpuTarget, and
tune's own) and a model with its path (Named), not as long flat keyword lists: each command
receives its groups built, and its in-process keywords are derived from them. The functions of
the product allowed more than MAX_PARAMETERS parameters are listed here, each with its reason;
any other fails, and so does a listed one that no longer needs its place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_PARAMETERS = 8

# "file:function" (a method as Class.method): why it takes more than MAX_PARAMETERS.
ALLOWED = {
    "graphscan_ort/engines/combined.py:run_segment": "trace's segment runner: a failure is blamed on the float "
    "model, the quantized one or graphscan's own single-op model of a row, so it carries both paths, the rows "
    "and the combined model's names beside the session's inputs",
    "graphscan_ort/tune/trials.py:candidate_row": "a candidate row built once from its outcome: each keyword "
    "is one key of shared/answers.Candidate that only some outcomes know (a twin, a refusal, a measurement)",
    "graphscan_ort/tune/deployed.py:measure_candidate": "one candidate measured as deployed, the function tests "
    "stand in for: trials.Measure holds its inputs as one group (the float model, the samples, the session and "
    "timing, the float outputs kept, the metric, the latency samples) and adds the timings already taken by plan, "
    "the race that may spare a slow row its accuracy and the float model's timing session kept for the run",
}


def product_files() -> list[Path]:
    plugin = sorted(ROOT.glob("graphscan_pytest*.py"))
    return [ROOT / "graphscan.py", *plugin, *sorted((ROOT / "graphscan_ort").rglob("*.py"))]


def parameter_counts(files: list[Path], root: Path) -> dict[str, int]:
    """``{"file:function": parameters}`` of every function and method in ``files`` (self
    and cls not counted; ``*args`` and ``**keywords`` count one each)."""
    counts = {}

    def visit(node: ast.AST, file: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, file, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                positional = [a.arg for a in [*args.posonlyargs, *args.args]]
                count = len(positional) + len(args.kwonlyargs) + bool(args.vararg) + bool(args.kwarg)
                if prefix and positional[:1] in (["self"], ["cls"]):
                    count -= 1
                counts[f"{file}:{prefix}{child.name}"] = count
                visit(child, file, f"{prefix}{child.name}.")

    for path in files:
        visit(ast.parse(path.read_text(encoding="utf-8")), path.relative_to(root).as_posix(), "")
    return counts


COUNTS = parameter_counts(product_files(), ROOT)


def test_the_parameter_reader_counts_what_a_signature_declares(tmp_path):
    """The reader on a hand-counted source: positional-only, plain, ``*args``, keyword-only and
    ``**kw`` each count; a method's ``self`` does not; a nested function is its own."""
    source = tmp_path / "m.py"
    source.write_text(
        "def f(a, b, /, c, *args, d, **kw):\n    def inner(x, y): pass\n"
        "class C:\n    def m(self, x): pass\n    @classmethod\n    def k(cls): pass\n"
    )
    assert parameter_counts([source], tmp_path) == {"m.py:f": 6, "m.py:f.inner": 2, "m.py:C.m": 1, "m.py:C.k": 0}


@pytest.mark.parametrize("function", sorted(name for name, count in COUNTS.items() if count > MAX_PARAMETERS))
def test_a_function_with_more_than_eight_parameters_is_listed_with_its_reason(function):
    assert function in ALLOWED, (
        f"{function} takes {COUNTS[function]} parameters: pass an option group (Samples, MetricChoice, "
        "Session, Timing) or a Named model, or list it in ALLOWED with its reason"
    )


@pytest.mark.parametrize("function", sorted(ALLOWED))
def test_every_listed_function_still_needs_its_place(function):
    assert COUNTS.get(function, 0) > MAX_PARAMETERS, f"{function} is listed but takes {COUNTS.get(function)}"
