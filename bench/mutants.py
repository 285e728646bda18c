"""The mutation campaign: does the suite notice when graphscan is wrong?

    python bench/mutants.py [--area AREA ...] [--id ID ...] [--whole-suite] [--json FILE]

Reads the curated single-edit mutants of bench/mutants.toml. The repository is
copied once into a temporary folder (tracked and untracked files, no caches);
for each mutant its one edit is applied to the one file of that copy
that holds its snippet (graphscan.py, the plugin's graphscan_pytest*.py or a
module of graphscan_ort/), the tests of its area run (``pytest -x -q -n 2``; ``--whole-suite`` runs every test), and
the file is restored. A mutant is

  killed      the tests fail (or time out);
  survived    the tests pass: a hole in the suite, or an equivalent mutant not yet marked;
  equivalent  marked with its reason in the list; listed, not run;
  stale       its original snippet is in none of those files (update the list);
  ambiguous   its snippet occurs more than once among them (make it longer).

The per-area kill ratio is killed / (killed + survived). Exit 0 when nothing
survived and nothing is stale or ambiguous, 1 otherwise. Not a test: slow (one
pytest run per mutant), run by hand, never under CI.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MUTANTS = Path(__file__).resolve().parent / "mutants.toml"
# The files a mutant may edit: its snippet must occur exactly once among all of them.
TARGETS = ["graphscan.py", "graphscan_pytest*.py", "graphscan_ort/**/*.py"]
TIMEOUT = 600  # seconds per mutant; a hang (e.g. reading a FIFO) counts as killed

# The test files that speak for each area. Chosen for speed (one pytest run per mutant on a
# shared machine): in-process files first, test_cli for what only a process shows (usage, a FIFO).
AREA_TESTS = {
    "counting": [
        "tests/counting/test_rulings.py",
        "tests/counting/test_properties.py",
        "tests/counting/test_invariants.py",
        "tests/counting/test_snapshots.py",
        "tests/loading/test_unknown_dtypes.py",
    ],
    "loading": [
        "tests/loading/test_refusals.py",
        "tests/cli/test_package.py",
        "tests/cli/test_process_boundary.py",
        "tests/cli/test_cli.py",
        "tests/loading/test_big_models.py",
        "tests/loading/test_non_utf8.py",
        "tests/loading/test_unknown_dtypes.py",
        "tests/counting/test_properties.py",
        "tests/fuse/test_fusion.py",
        "tests/fuse/test_tolerance_names_weights.py",
        "tests/loading/test_malformed_graphs.py",
        "tests/cli/test_keyword_rules.py",
    ],
    "fuse": [
        "tests/fuse/test_fusion.py",
        "tests/fuse/test_tolerance_names_weights.py",
        "tests/fuse/test_write_verify_inputs.py",
        "tests/counting/test_gen_models.py",
    ],
    "trace": [
        "tests/trace/test_answer.py",
        "tests/trace/test_rows.py",
        "tests/trace/test_awkward_pairs.py",
        "tests/trace/test_memory.py",
        "tests/trace/test_control_flow.py",
        "tests/loading/test_big_models.py",
        "tests/trace/test_levels.py",
    ],
    "runtime": ["tests/runtime/test_runtime.py", "tests/check/test_check.py"],
    "check": [
        "tests/check/test_check.py",
        "tests/targets/test_check_on_targets.py",
        "tests/check/test_numbers_only.py",
        "tests/check/test_levels_budget.py",
        "tests/trace/test_levels.py",
        "tests/check/test_metric.py",
    ],
    # Issue 33: parts, the worst-part SQNR, levels, tune's seeds and verdict.
    "parts": [
        "tests/shared/test_parts.py",
        "tests/check/test_parts_budget.py",
        "tests/trace/test_levels.py",
        "tests/tune/test_seeds.py",
        "tests/tune/test_guards.py",
    ],
    "impact": [
        "tests/impact/test_impact.py",
        "tests/loading/test_malformed_graphs.py",
        "tests/check/test_numbers_only.py",
        "tests/views/test_tables.py",
        "tests/check/test_check.py",
    ],
    "tune": [
        "tests/tune/test_candidate_rows.py",
        "tests/tune/test_choice.py",
        "tests/tune/test_laws.py",
        "tests/tune/test_guards.py",
        "tests/tune/test_blocks.py",
        "tests/tune/test_fallback.py",
        "tests/tune/test_refine.py",
        "tests/tune/test_tune.py",
        "tests/tune/test_agreement.py",
        "tests/tune/test_rewrites.py",
        "tests/tune/test_prepare.py",
        "tests/tune/test_deployed.py",
        "tests/tune/test_candidates.py",
        "tests/check/test_metric.py",
        "tests/check/test_metric_layouts.py",
        "tests/tune/test_users_code.py",
        "tests/tune/test_dynamic.py",
        "tests/tune/test_contrib.py",
        "tests/tune/test_seeds.py",
        "tests/tune/test_tune_cpu.py",
        "tests/tune/test_race.py",
    ],
    "shared": [
        "tests/shared/test_inputs.py",
        "tests/shared/test_tables.py",
        "tests/shared/test_files.py",
        "tests/shared/test_graph.py",
        "tests/shared/test_sessions.py",
        "tests/cli/test_inputs.py",
        "tests/fuse/test_write_verify_inputs.py",
        "tests/trace/test_awkward_pairs.py",
        "tests/views/test_tables.py",
        "tests/shared/test_metrics.py",
        "tests/cli/test_keyword_rules.py",
        "tests/check/test_numbers_only.py",
    ],
    "plugin": [
        "tests/cli/test_plugin_fixture.py",
        "tests/cli/test_plugin_sharing.py",
        "tests/cli/test_plugin.py",
        "tests/report/test_gate_pages.py",
    ],
    # The report's page (graphscan_ort/report/, commands/report.py), read back by a parser of its own.
    "report": ["tests/report/test_page.py", "tests/report/test_without_plotting.py", "tests/report/test_gate_pages.py"],
    "recovery": [
        "tests/tune/test_equalize.py",
        "tests/tune/test_bias.py",
        "tests/tune/test_recovery.py",
        "tests/tune/test_overrides.py",
    ],
    "calibration": ["tests/tune/test_calibration.py", "tests/tune/test_candidates.py", "tests/tune/test_requantize.py"],
    # The CPU targets without qemu: fake folders and tools, this interpreter standing in.
    "targets": [
        "tests/targets/test_install.py",
        "tests/targets/test_targets.py",
        "tests/targets/test_worker.py",
        "tests/targets/test_interrupts.py",
        "tests/tune/test_tune_cpu.py",
    ],
}
IGNORED = shutil.ignore_patterns(
    ".git", ".venv*", "__pycache__", ".pytest_cache", ".hypothesis", "*.pyc", ".benchmarks"
)


def load_mutants(path: Path = MUTANTS) -> list[dict]:
    with open(path, "rb") as f:
        mutants = tomllib.load(f)["mutant"]
    seen = set()
    for mutant in mutants:
        missing = {"id", "area", "what", "original", "replacement"} - set(mutant)
        if missing:
            raise SystemExit(f"mutants.toml: {mutant.get('id', '?')} lacks {sorted(missing)}")
        if mutant["id"] in seen:
            raise SystemExit(f"mutants.toml: id {mutant['id']} used twice")
        seen.add(mutant["id"])
    return mutants


def target_files(root: Path) -> list[Path]:
    """Every file of TARGETS under ``root``, in a fixed order."""
    return sorted({path for pattern in TARGETS for path in root.glob(pattern)})


def locate(mutant: dict, sources: dict[Path, str]) -> tuple[str | None, Path | None]:
    """``(problem, file)``: the one file holding the mutant's snippet, or why it
    cannot be applied ('stale': in none, 'ambiguous': more than once in all)."""
    holders = [(path, source.count(mutant["original"])) for path, source in sources.items()]
    count = sum(n for _, n in holders)
    if count == 0:
        return "stale", None
    if count > 1:
        return "ambiguous", None
    return None, next(path for path, n in holders if n)


def run_tests(copy: Path, files: list[str], timeout: int) -> tuple[bool, str]:
    """``(passed, last line)`` of pytest on ``files`` (all tests when empty) in ``copy``; the
    line names the first test that failed, so a kill by a flaky test can be told from a real one."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "2", "-p", "no:cacheprovider", *files]
    try:
        done = subprocess.run(command, cwd=copy, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timeout after {timeout} s"
    lines = done.stdout.strip().splitlines() or ["(no output)"]
    # pytest's own summary, not a FAILED line inside a failing test's captured output
    summary = next((k for k in range(len(lines) - 1, -1, -1) if "short test summary info" in lines[k]), len(lines))
    failed = next((line.split(" - ")[0] for line in lines[summary:] if line.startswith(("FAILED ", "ERROR "))), None)
    return done.returncode == 0, lines[-1] if failed is None else f"{lines[-1]}: {failed}"


def run_campaign(mutants: list[dict], whole_suite: bool, timeout: int, log=print) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="graphscan_mutants_") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(REPO_ROOT, copy, ignore=IGNORED)
        sources = {path: path.read_text(encoding="utf-8") for path in target_files(copy)}
        passed, line = run_tests(
            copy, [] if whole_suite else sorted({f for v in AREA_TESTS.values() for f in v}), timeout
        )
        if not passed:
            raise SystemExit(f"the suite fails on the unmutated copy: {line}")
        for mutant in mutants:
            result = {key: mutant[key] for key in ("id", "area", "what")}
            status, target = locate(mutant, sources)
            if target is not None:
                result["file"] = str(target.relative_to(copy))
            if status is None and "equivalent" in mutant:
                status = "equivalent"
                result["reason"] = mutant["equivalent"]
            if status is None:
                pristine = sources[target]
                target.write_text(pristine.replace(mutant["original"], mutant["replacement"]), encoding="utf-8")
                start = time.perf_counter()
                try:
                    files = [] if whole_suite else AREA_TESTS.get(mutant["area"], [])
                    passed, line = run_tests(copy, files, timeout)
                finally:
                    target.write_text(pristine, encoding="utf-8")
                status = "survived" if passed else "killed"
                result.update(seconds=round(time.perf_counter() - start, 1), pytest=line)
            result["status"] = status
            log(f"{mutant['id']:5s} {mutant['area']:9s} {status:10s} {mutant['what']}")
            results.append(result)
    return results


def summary(results: list[dict]) -> dict:
    """Per area: killed, survived, equivalent, stale, ambiguous, and the kill ratio."""
    areas = {}
    for result in results:
        counts = areas.setdefault(
            result["area"], {"killed": 0, "survived": 0, "equivalent": 0, "stale": 0, "ambiguous": 0}
        )
        counts[result["status"]] += 1
    for counts in areas.values():
        run = counts["killed"] + counts["survived"]
        counts["ratio"] = counts["killed"] / run if run else None
    return areas


def format_table(areas: dict, results: list[dict]) -> str:
    lines = [f"{'area':10s}{'killed':>8s}{'run':>6s}{'ratio':>8s}{'equiv.':>8s}{'stale':>7s}"]
    for area, c in areas.items():
        run = c["killed"] + c["survived"]
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.0%}"
        lines.append(f"{area:10s}{c['killed']:>8d}{run:>6d}{ratio:>8s}{c['equivalent']:>8d}{c['stale']:>7d}")
    for result in results:
        if result["status"] in ("survived", "stale", "ambiguous"):
            lines.append(f"  {result['status']}: {result['id']} ({result['area']}) {result['what']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--area", action="append", help="only mutants of this area (repeatable)")
    parser.add_argument("--id", action="append", help="only this mutant (repeatable)")
    parser.add_argument("--whole-suite", action="store_true", help="run every test for each mutant")
    parser.add_argument("--timeout", type=int, default=TIMEOUT, help="seconds per mutant")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write every result as JSON")
    args = parser.parse_args(argv)

    mutants = load_mutants()
    if args.area:
        mutants = [m for m in mutants if m["area"] in args.area]
    if args.id:
        mutants = [m for m in mutants if m["id"] in args.id]
    results = run_campaign(mutants, args.whole_suite, args.timeout)
    areas = summary(results)
    print(format_table(areas, results))
    if args.json:
        args.json.write_text(json.dumps({"areas": areas, "mutants": results}, indent=2) + "\n")
    bad = {"survived", "stale", "ambiguous"}
    return 1 if any(r["status"] in bad for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
