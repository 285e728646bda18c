"""tune's pipeline is one ordered list (stages.STAGES): its stages as the code runs them, as
``tune --help`` lists them and as DESIGN.md's tune section lists them are the same."""

import re

import graphscan
import graphscan_ort.tune.stages as stages
from tests.helpers import ROOT


def numbered(text):
    """The ``N. name: ...`` lines of ``text``, in order, stripped."""
    return [line.strip() for line in text.splitlines() if re.match(r"\s*\d+\. \w+: ", line)]


def test_the_code_the_help_and_design_list_the_same_stages_in_the_same_order():
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    pipeline = design.split("- **The pipeline** (`stages.py`)", 1)[1].split("\n- **", 1)[0]
    helped = tune_help()
    code = [f"{k}. {stage.name}:" for k, stage in enumerate(stages.STAGES, 1)]
    for listed in (numbered(pipeline), numbered(helped)):
        assert [line.split(" ", 2)[0] + " " + line.split(" ", 2)[1] for line in listed] == code
    assert numbered(pipeline) == numbered(helped) == numbered(stages.stages_text())


def tune_help():
    parser = graphscan._build_parser("tune")
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices["tune"].format_help()


def test_a_stage_that_searches_runs_only_while_no_row_meets_the_target():
    always = [stage.name for stage in stages.STAGES if stage.always]
    assert always == ["grid", "polish", "retime"]  # the grid first, the choice finished last
    assert stages.STAGES[0].name == "grid" and stages.STAGES[-1].name == "retime"
