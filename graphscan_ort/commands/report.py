"""report: saved answers as one self-contained HTML page (graphscan_ort/report/).

    graphscan report tune.json runtime.json --out report.html

Each answer is read as ``table`` reads it (the command it is from, by its keys and types);
the page is written atomically. matplotlib draws the charts: without it (the ``report``
extra), exit 2 naming the install command, before anything is read.
"""

from __future__ import annotations

from graphscan import EXIT_USAGE, Command, GraphscanError, one_line, read_answer, shown
from graphscan_ort.report.page import Source, build_page
from graphscan_ort.report.plots import require_plotting
from graphscan_ort.shared.answers import ReportAnswer
from graphscan_ort.shared.files import check_output_path, write_atomically


def report(*answers: str, out: str | None) -> ReportAnswer:
    """The page of the saved ``answers`` written to ``out``."""
    if out is None:
        raise GraphscanError("usage: report needs --out FILE.html", EXIT_USAGE)
    require_plotting("report")
    check_output_path(out)  # a folder or device there is refused before any work
    sources = []
    for path in answers:
        command, answer = read_answer(path)
        sources.append(Source(command.name, answer, path))
    try:
        page = build_page(sources)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:  # keys right, values not
        raise GraphscanError(
            f"usage: {', '.join(map(shown, answers))}: not answers report can draw ({one_line(exc)})", EXIT_USAGE
        )
    data = page.html.encode("utf-8")
    write_atomically(data, out)
    return {
        "answers": [{"path": s.path or "", "command": s.command} for s in sources],
        "output": out,
        "bytes": len(data),
        "sections": page.sections,
        "notes": page.notes,
    }


COMMAND = Command(
    "report",
    report,
    ("answer",),
    options=(("--out", {"metavar": "FILE.html", "help": "the page to write (one file: it opens offline)"}),),
    answer=ReportAnswer,
    path_help="a saved JSON answer of any command (tune, runtime, check, trace, impact, ...); several make one page",
    many=True,
)
