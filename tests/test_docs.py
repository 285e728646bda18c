"""docs/SPEC.md is the contract in the repository: it must name every command and exit code.

Commands and exit codes are read from graphscan.py itself (COMMANDS and every EXIT_*
constant), so a command or code added later without its paragraph fails here.
"""

import re

import pytest

import graphscan
from tests.helpers import ROOT

SPEC = (ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")

EXIT_CODES = sorted(
    (name, value) for name, value in vars(graphscan).items() if name.startswith("EXIT_") and isinstance(value, int)
)


def section_headings():
    """Command names that open a ``### `name ...` `` heading."""
    return {m.group(1) for m in re.finditer(r"^### `([a-z]+)[ `]", SPEC, re.MULTILINE)}


def exit_table():
    """``{code: meaning}`` from the rows of the exit-code table."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| (\d+) \| (.+) \|$", SPEC, re.MULTILINE)}


@pytest.mark.parametrize("command", list(graphscan.COMMANDS))
def test_every_command_has_a_section(command):
    assert command in section_headings()


@pytest.mark.parametrize(("name", "value"), EXIT_CODES, ids=[name for name, _ in EXIT_CODES])
def test_every_exit_code_is_in_the_table(name, value):
    assert value in exit_table(), f"{name} = {value} has no row in docs/SPEC.md"


def test_the_exit_code_constants_were_found():
    # A renamed prefix would make the test above vacuous.
    assert {value for _, value in EXIT_CODES} >= {0, 1, 2, 3, 4, 5, 6, 7}


def test_readme_points_at_the_spec():
    assert "docs/SPEC.md" in README
