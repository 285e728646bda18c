"""The pytest plugin's pages (``pytest --graphscan --graphscan-report DIR``): one page per
model of graphscan.toml (its items with their outcomes, check's budgets, what runs on each
CPU target, its island map) and ``index.html``: every model's items, pass or fail, and its
kernel picture. The plugin hands over plain data (no pytest object reaches this module);
the controller of an xdist run writes them once, from what every worker measured."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from graphscan import EXIT_NO_FILE, GraphscanError, shown
from graphscan_ort.report.html import Html, Section, bullets, code, document, join, paragraph, table, tag
from graphscan_ort.report.islands import ModelFile
from graphscan_ort.report.page import Source, build_page
from graphscan_ort.report.plots import kernel_picture
from graphscan_ort.report.views import target_of
from graphscan_ort.shared.files import write_atomically

INDEX = "index.html"
OUTCOMES = ("passed", "failed", "skipped", "not run")  # "not run": deselected, or the run stopped before it


@dataclasses.dataclass(frozen=True)
class ItemOutcome:
    """One item of the config: its id, its name (``min_int8[arm64]``), its outcome and why."""

    id: str
    name: str
    outcome: str
    why: str = ""


@dataclasses.dataclass(frozen=True)
class ModelGates:
    """A model of the config and what its tables' items found: check's and runtime's answers
    as ``(command, answer)``, and what could not be measured for the page."""

    name: str
    path: str
    page: str  # its page's file name in the folder
    items: Sequence[ItemOutcome]
    answers: Sequence[tuple[str, Mapping[str, Any]]]
    notes: Sequence[str] = ()

    @property
    def failed(self) -> bool:
        return any(item.outcome == "failed" for item in self.items)


def write_gate_report(folder: str, config: str, tables: Sequence[ModelGates]) -> str:
    """Each model's page (its tables together: a path two tables name is one page) and the
    index into ``folder`` (made when missing), each file whole; the index's path."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise GraphscanError(f"{shown(folder)}: cannot write ({exc.strerror or exc})", EXIT_NO_FILE)
    models = merged(tables)
    for model in models:
        write_atomically(model_page(model).encode("utf-8"), os.path.join(folder, model.page))
    index = os.path.join(folder, INDEX)
    write_atomically(index_page(config, models).encode("utf-8"), index)
    return index


def merged(tables: Sequence[ModelGates]) -> list[ModelGates]:
    """One entry per page, in the config's order: the tables of one model path together, its
    runtime answers once per CPU target (each table measured the same model)."""
    pages: dict[str, ModelGates] = {}
    for entry in tables:
        kept = pages.get(entry.page)
        if kept is None:
            pages[entry.page] = entry
            continue
        targets = {target_of(answer) for command, answer in kept.answers if command == "runtime"}
        new = [(c, a) for c, a in entry.answers if c != "runtime" or target_of(a) not in targets]
        pages[entry.page] = dataclasses.replace(
            kept, items=[*kept.items, *entry.items], answers=[*kept.answers, *new], notes=[*kept.notes, *entry.notes]
        )
    return list(pages.values())


def why_not_passed(report: Any) -> str:
    """Why a pytest item did not pass, from its report: a gate's sentence, a skip's reason, an
    error's message (empty when it passed)."""
    longrepr = report.longrepr
    if report.passed or longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    return str(longrepr if crash is None else crash.message)


def items_table(items: Sequence[ItemOutcome]) -> Html:
    rows = [[item.name, tag("span", item.outcome, class_="outcome"), item.why] for item in items]
    return table(["item", "outcome", "why"], rows, [item.outcome.replace(" ", "-") for item in items])


def model_page(model: ModelGates) -> str:
    """The model's items, then the sections of its answers and its island map."""
    gate = Section("gate", "the gate's items", join([items_table(model.items), bullets(model.notes)]))
    sources = [Source(command, answer, label="measured by the gate") for command, answer in model.answers]
    maps = [ModelFile(model.name, model.path)]
    return build_page(sources, f"graphscan gate: {model.name}", lead=[gate], maps=maps).html


def classes_by_target(model: ModelGates) -> dict[str, Mapping[str, int]]:
    """runtime's class counts of the model, by CPU target."""
    return {target_of(answer): answer["classes"] for command, answer in model.answers if command == "runtime"}


def index_page(config: str, models: Sequence[ModelGates]) -> str:
    """Every model of the config: its items and their outcomes, its kernel picture, its page."""
    counts = Counter(item.outcome for model in models for item in model.items)
    summary = ", ".join(f"{counts[outcome]} {outcome}" for outcome in OUTCOMES if counts[outcome])
    rows, classes = [], []
    for k, model in enumerate(models):
        by_target = classes_by_target(model)
        picture = Html(kernel_picture(by_target, f"kernels-{k}")) if by_target else "not measured"
        outcomes = join(
            tag("div", join([item.name, ": ", tag("span", item.outcome, class_=item.outcome.replace(" ", "-"))]))
            for item in model.items
        )
        rows.append([tag("a", model.name, href=model.page), outcomes, picture])
        classes.append("failed" if model.failed else None)
    intro = join(
        [
            paragraph("config ", code(config), f": {len(models)} model{'s' if len(models) != 1 else ''}, {summary}"),
            paragraph("Each model's page holds its budgets, what runs on each CPU and its island map.", class_="note"),
        ]
    )
    section = Section("models", "models", table(["model", "items", "what runs (nodes per class)"], rows, classes))
    return document(f"graphscan gate: {os.path.basename(config)}", intro, [section])
