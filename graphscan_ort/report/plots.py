"""The report's charts, drawn by matplotlib into SVG text the page holds inline.

matplotlib is the optional extra ``report`` (``pip install 'graphscan[report]'``): it is
imported only when a chart is drawn, and ``require_plotting`` says in one line how to
install it. Each chart is a ``Figure`` of its own (no pyplot, no global state), saved as
SVG with its text as text (``svg.fonttype`` none: small, selectable) and no date, so the
same answer draws the same bytes. A plotted row of tune's front is the SVG group
``row-<id>``, the chosen row's mark ``chosen``: what a reader's browser (and the tests)
find in the page.
"""

from __future__ import annotations

import dataclasses
import html
import io
import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from graphscan import EXIT_USAGE, GraphscanError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL = "pip install 'graphscan[report]' (in a clone: pip install '.[report]')"

# What runs, in the island map's colours (graphscan.py's dot): int8 dark green, int8_data
# light green, float orange, absorbed grey.
CLASS_COLOURS = {"int8": "#1b9e77", "int8_data": "#a6dba0", "float": "#f4a582", "absorbed": "#d9d9d9"}
PASSING, REFUSED, CHOSEN, TARGET = "#2166ac", "#999999", "#d7191c", "#b2182b"


def require_plotting(needed_by: str) -> None:
    """Exit 2 in one line naming the install command when matplotlib cannot be imported."""
    try:
        import_quietly()
    except ImportError:
        raise GraphscanError(
            f"usage: {needed_by} draws its charts with matplotlib, not installed: {INSTALL}", EXIT_USAGE
        ) from None


def import_quietly() -> None:
    """matplotlib imported with its start-up warnings (the font cache built on a fresh machine,
    a temporary config folder) kept off stderr, which holds graphscan's one line alone."""
    logger = logging.getLogger("matplotlib")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import matplotlib.font_manager  # noqa: F401  (its import builds the font cache)
    finally:
        logger.setLevel(level)


def new_figure(width: float, height: float) -> Figure:
    import_quietly()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def svg_of(figure: Figure, salt: str) -> str:
    """The figure as an ``<svg>`` element; ``salt``, unique on the page, keeps each chart's
    clip-path and marker ids its own."""
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def with_titles(svg: str, titles: Mapping[str, str]) -> str:
    """``svg`` with a ``<title>`` (the browser's hover text) in each group of ``titles``' ids."""
    for gid, title in titles.items():
        opening = f'<g id="{gid}">'
        svg = svg.replace(opening, f"{opening}<title>{html.escape(title)}</title>", 1)
    return svg


@dataclasses.dataclass(frozen=True)
class FrontPoint:
    """One row of tune's front: its speedup with its quartiles, its metric with its lower
    bound (None: not measured), and how it is drawn."""

    id: int
    speedup: float | None
    spread: Sequence[float] | None
    value: float
    bound: float | None
    refused: bool  # breaks a guard: drawn apart, grey
    chosen: bool
    pareto: bool
    title: str  # the hover text: its settings


@dataclasses.dataclass(frozen=True)
class Lines:
    """The front's reference lines: the target (None: undefined) and the slower guard."""

    target: float | None
    target_label: str
    min_speedup: float | None
    metric_label: str


def front_chart(points: Sequence[FrontPoint], lines: Lines) -> str:
    """Speed against the metric, one mark per row (``row-<id>``); rows whose speedup is not
    measured in a strip of their own beside it; the chosen row ringed (``chosen``)."""
    from matplotlib.lines import Line2D

    unranked = [p for p in points if p.speedup is None]
    figure = new_figure(9.0, 5.6)
    if unranked:
        grid = figure.add_gridspec(1, 2, width_ratios=[10, 1.3])
        ax = figure.add_subplot(grid[0, 0])
        strip = figure.add_subplot(grid[0, 1], sharey=ax)
        draw_unranked(strip, unranked)
    else:
        ax = figure.add_subplot()
    for p in points:
        if p.speedup is not None:
            draw_row(ax, p, p.speedup)
    front = sorted((p.speedup, p.value) for p in points if p.pareto and p.speedup is not None)
    if len(front) > 1:
        ax.plot([x for x, _ in front], [y for _, y in front], color=PASSING, linewidth=0.8, alpha=0.5)
    if lines.target is not None:
        ax.axhline(lines.target, color=TARGET, linestyle="--", linewidth=1)
    if lines.min_speedup is not None:
        ax.axvline(lines.min_speedup, color="#555555", linestyle=":", linewidth=1)
    ax.set_xlabel("speedup over float (median of the run-by-run ratios; bar: their quartiles)")
    ax.set_ylabel(f"{lines.metric_label} (bar: down to its lower bound)")
    ax.grid(True, linewidth=0.3, alpha=0.5)
    legend = [
        Line2D([], [], marker="o", color=PASSING, linestyle="none", label="passes the guards"),
        Line2D([], [], marker="X", color=REFUSED, linestyle="none", label="refused (a guard, a broken part)"),
        Line2D(
            [], [], marker="*", color=CHOSEN, markerfacecolor="none", markersize=14, linestyle="none", label="chosen"
        ),
    ]
    if lines.target is not None:
        legend.append(Line2D([], [], color=TARGET, linestyle="--", label=lines.target_label))
    if lines.min_speedup is not None:
        legend.append(Line2D([], [], color="#555555", linestyle=":", label=f"min speedup {lines.min_speedup:g}"))
    ax.legend(
        handles=legend, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=len(legend), frameon=False
    )
    titles = {f"row-{p.id}": p.title for p in points}
    return with_titles(svg_of(figure, "front"), titles)


def draw_row(ax: Axes, p: FrontPoint, x: float, speed_bar: bool = True) -> None:
    """One row's mark at ``x``: its group ``row-<id>``; its error bars, the metric's from its
    bound up to its value (``metric-bar-<id>``: one-sided) and the speedup's quartiles
    (``speed-bar-<id>``); its id beside it; a ring around it when chosen."""
    colour = REFUSED if p.refused else PASSING
    bars: list[tuple[str, list[list[float]] | None, list[list[float]] | None]] = []  # (gid, xerr, yerr)
    if p.bound is not None:
        bars.append((f"metric-bar-{p.id}", None, [[p.value - p.bound], [0.0]]))
    if speed_bar and p.spread is not None:
        bars.append((f"speed-bar-{p.id}", [[x - p.spread[0]], [p.spread[1] - x]], None))
    for gid, xerr, yerr in bars:
        drawn = ax.errorbar([x], [p.value], xerr=xerr, yerr=yerr, fmt="none", ecolor=colour, elinewidth=0.7, alpha=0.6)
        drawn.lines[2][0].set_gid(gid)
    marker = "X" if p.refused else "o"
    ax.plot([x], [p.value], marker=marker, color=colour, markersize=6, linestyle="none", gid=f"row-{p.id}")
    ax.annotate(str(p.id), (x, p.value), xytext=(4, 3), textcoords="offset points", fontsize=7, color="#333333")
    if p.chosen:
        ax.plot(
            [x], [p.value], marker="*", markersize=18, markerfacecolor="none", markeredgecolor=CHOSEN,
            markeredgewidth=1.5, linestyle="none", gid="chosen",
        )  # fmt: skip


def draw_unranked(strip: Axes, points: Sequence[FrontPoint]) -> None:
    """Rows whose speedup is not measured (a disturbed timing), side by side at their metric."""
    for k, p in enumerate(points):
        draw_row(strip, p, float(k), speed_bar=False)
    strip.set_xlim(-0.8, len(points) - 0.2)
    strip.set_xticks([])
    strip.set_xlabel("speedup\nnot measured", fontsize=8)
    strip.tick_params(labelleft=False)
    strip.grid(True, axis="y", linewidth=0.3, alpha=0.5)


def grouped_bars(groups: Sequence[str], series: Mapping[str, Sequence[float | None]], ylabel: str, salt: str) -> str:
    """Bars side by side per group, one colour per series; a missing value is no bar, its
    place labelled ``n/a``."""
    figure = new_figure(6.0, 2.8)
    ax = figure.add_subplot()
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        drawn = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None and math.isfinite(v)]
        bars = ax.bar([x for x, _ in drawn], [v for _, v in drawn], width=width * 0.95, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
        for x, v in zip(xs, values, strict=True):
            if v is None or not math.isfinite(v):
                ax.annotate("n/a", (x, 0), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.axhline(0, color="#555555", linewidth=0.6)
    ax.margins(y=0.12)  # room for the bars' labels
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(series), frameon=False)
    ax.grid(True, axis="y", linewidth=0.3, alpha=0.5)
    return svg_of(figure, salt)


def classes_chart(by_target: Mapping[str, Mapping[str, Mapping[str, int]]], salt: str) -> str:
    """Per operator type, the nodes of each runtime class as one stacked bar, one panel per
    CPU target (``{target: by_op_type}``), the types with the most nodes on top."""
    totals: dict[str, int] = {}
    for by_op_type in by_target.values():
        for op, counts in by_op_type.items():
            totals[op] = max(totals.get(op, 0), sum(counts.values()))
    ops = sorted(totals, key=lambda op: (-totals[op], op))[::-1]
    figure = new_figure(3.0 + 3.0 * len(by_target), 0.8 + 0.26 * len(ops))
    axes = figure.subplots(1, len(by_target), sharey=True, squeeze=False)[0]
    for ax, (target, by_op_type) in zip(axes, by_target.items(), strict=True):
        left = [0] * len(ops)
        for name, colour in CLASS_COLOURS.items():
            nodes = [by_op_type.get(op, {}).get(name, 0) for op in ops]
            ax.barh(ops, nodes, left=left, color=colour, label=name, edgecolor="white", linewidth=0.4)
            left = [a + b for a, b in zip(left, nodes, strict=True)]
        ax.set_title(target, fontsize=9)
        ax.set_xlabel("nodes", fontsize=8)
        ax.tick_params(labelsize=8)
    axes[-1].legend(fontsize=8, loc="lower right")
    return svg_of(figure, salt)


def ranked_chart(labels: Sequence[str], values: Sequence[float], xlabel: str, salt: str) -> str:
    """One horizontal bar per label, the first on top."""
    figure = new_figure(8.0, 0.8 + 0.26 * len(labels))
    ax = figure.add_subplot()
    ax.barh(list(range(len(labels)))[::-1], values, color=PASSING)
    ax.set_yticks(list(range(len(labels)))[::-1], [short(label) for label in labels], fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.grid(True, axis="x", linewidth=0.3, alpha=0.5)
    return svg_of(figure, salt)


def kernel_picture(by_target: Mapping[str, Mapping[str, int]], salt: str) -> str:
    """A model's runtime classes at a glance (the plugin's index): one stacked bar per CPU
    target of its int8, int8_data, float and absorbed nodes."""
    figure = new_figure(4.2, 0.45 + 0.3 * len(by_target))
    ax = figure.add_subplot()
    names = list(by_target)[::-1]
    left = [0] * len(names)
    for name, colour in CLASS_COLOURS.items():
        counts = [by_target[target].get(name, 0) for target in names]
        ax.barh(names, counts, left=left, color=colour, label=name, height=0.7)
        left = [a + b for a, b in zip(left, counts, strict=True)]
    ax.tick_params(labelsize=7)
    ax.set_xlabel("nodes", fontsize=7)
    ax.legend(fontsize=6, ncol=len(CLASS_COLOURS), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return svg_of(figure, salt)


def short(label: str, width: int = 40) -> str:
    """A long node name cut in the middle, so the chart keeps its room for the bars."""
    return label if len(label) <= width else label[: width // 2 - 1] + "…" + label[-(width // 2) :]


def finite(value: Any) -> float | None:
    """A JSON number as a float (None for null)."""
    return None if value is None else float(value)
