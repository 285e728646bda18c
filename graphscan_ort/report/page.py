"""One self-contained page from a set of answers: each answer's sections in the order given
(runtime's answers of one model together, a column per CPU target), then the island map of
each model they name. The page's text is HTML with its charts inline as SVG: it opens
offline, on any machine, and fetches nothing."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from graphscan import render_table
from graphscan_ort.report.html import Html, Section, bullets, code, document, join, paragraph, pre
from graphscan_ort.report.islands import ModelFile, island_map, locate, named_model
from graphscan_ort.report.tune_view import tune_sections, unplotted
from graphscan_ort.report.views import budgets, gains, target_of, what_runs, worst_operators


@dataclasses.dataclass(frozen=True)
class Source:
    """One answer on the page: the command it is from, the answer, the file it was read from
    (None: handed over in memory), and its model's file when not where the answer names it
    (tune's ``--report``, written before ``--out`` is in place)."""

    command: str
    answer: Mapping[str, Any]
    path: str | None = None
    model: ModelFile | None = None
    label: str = "this run"  # what the page calls an answer in memory

    def model_file(self) -> ModelFile | None:
        if self.model is not None:
            return self.model
        named = named_model(self.command, self.answer)
        beside = os.path.dirname(self.path) if self.path else None
        return None if named is None else locate(named, beside)


@dataclasses.dataclass(frozen=True)
class Page:
    """The page's text, its sections' ids in order, and what it left out or could not draw."""

    html: str
    sections: list[str]
    notes: list[str]


class Ids:
    """Section ids unique on a page: ``tune``, then ``tune-2``, ..."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def suffix(self, kind: str) -> str:
        self.seen[kind] = self.seen.get(kind, 0) + 1
        return "" if self.seen[kind] == 1 else f"-{self.seen[kind]}"


def build_page(
    sources: Sequence[Source],
    title: str | None = None,
    lead: Sequence[Section] = (),
    maps: Sequence[ModelFile] | None = None,
) -> Page:
    """The page of ``sources`` after the ``lead`` sections; ``title`` defaults to the models
    they name; ``maps``: the models whose island maps it draws (default: the answers')."""
    ids, sections, notes = Ids(), list(lead), []
    grouped = runtime_groups(sources)
    for k, source in enumerate(sources):
        if source.command == "runtime":
            group = grouped.get(k)
            if group is not None:
                suffix = ids.suffix("runs")
                answers = [s.answer for s in group]
                named = f"what runs: {', '.join(map(target_of, answers))}"
                sections.append(Section(f"runs{suffix}", named, what_runs(answers, f"runs{suffix}")))
            continue
        made, said = answer_sections(source, ids)
        sections += made
        notes += said
    drawn, said = island_sections(model_files(sources) if maps is None else maps, ids)
    notes += said
    sections += drawn
    models = sorted({str(named_model(s.command, s.answer)) for s in sources if named_model(s.command, s.answer)})
    heading = title or "graphscan report" + (f": {', '.join(models)}" if models else "")
    intro = join(
        [
            paragraph("Drawn from these answers (the JSON is the contract):") if sources else "",
            bullets(join([code(s.path) if s.path else s.label, f" ({s.command})"]) for s in sources),
            bullets(notes) if notes else "",
        ]
    )
    return Page(document(heading, intro, sections), [s.id for s in sections], notes)


def runtime_groups(sources: Sequence[Source]) -> dict[int, list[Source]]:
    """runtime's answers by model, at the position of the first of each: several answers of
    one model (its CPU targets) are one section, a column per target."""
    first: dict[str, int] = {}
    groups: dict[int, list[Source]] = {}
    for k, source in enumerate(sources):
        if source.command == "runtime":
            at = first.setdefault(str(source.answer["model"]), k)
            groups.setdefault(at, []).append(source)
    return groups


def answer_sections(source: Source, ids: Ids) -> tuple[list[Section], list[str]]:
    """The sections of one answer that is not runtime's, and its notes."""
    answer, command = source.answer, source.command
    if command == "tune":
        return tune_sections(answer, ids.suffix("tune")), unplotted(answer)
    views: dict[str, tuple[str, Callable[[Mapping[str, Any], str], Html]]] = {
        "check": ("check: the budgets", lambda a, salt: budgets(a)),
        "trace": ("trace: the worst operators", worst_operators),
        "impact": ("impact: the gain of keeping each operator float", gains),
    }
    if command in views:
        title, view = views[command]
        suffix = ids.suffix(command)
        return [Section(f"{command}{suffix}", title, view(answer, f"{command}{suffix}"))], []
    suffix = ids.suffix("answer")
    body = join(
        [paragraph("the answer as ", code("graphscan table"), " shows it:"), pre(render_table(command, dict(answer)))]
    )
    return [Section(f"answer{suffix}", f"{command}", body)], []


def model_files(sources: Sequence[Source]) -> list[ModelFile]:
    """The models the answers name, each once (by the file it is read from)."""
    found: dict[str, ModelFile] = {}
    for source in sources:
        model = source.model_file()
        if model is not None:
            found.setdefault(os.path.realpath(model.path) if model.path else model.named, model)
    return list(found.values())


def island_sections(models: Sequence[ModelFile], ids: Ids) -> tuple[list[Section], list[str]]:
    """One island map per model, and what could not be drawn."""
    sections, notes = [], []
    for model in models:
        body, note = island_map(model)
        sections.append(Section(f"islands{ids.suffix('islands')}", f"the island map: {model.named}", body))
        notes += [note] if note else []
    return sections, notes


def tune_page(answer: Mapping[str, Any], folder: str) -> str:
    """tune ``--report``'s page of ``answer``, its model read from ``folder`` (tune's work
    folder: renamed to ``--out`` once the page is written)."""
    named = named_model("tune", answer)
    model = None if named is None else ModelFile(named, os.path.join(folder, os.path.basename(named)))
    return build_page([Source("tune", answer, model=model)]).html
