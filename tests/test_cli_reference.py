"""The README's command-line reference matches what `pdbg --help` and each subcommand's help offer."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tui.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def reference_rows() -> dict[str, str]:
    """README's command table: subcommand -> the row's command text."""
    text = README.read_text()
    table = text[text.index("## Command line"):text.index("## Documentation")]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `pdbg RUN`, `pdbg (tui)[^|]*` \|", line) or re.match(r"\| `pdbg ([a-z]+)", line)
        if m:
            rows[m.group(1)] = line.replace("\\|", "/").split("|")[1]
    return rows


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_subcommand_and_option_is_in_the_readme() -> None:
    rows = reference_rows()
    commands = subcommands()
    assert set(rows) == set(commands), (sorted(rows), sorted(commands))
    for name, sub in commands.items():
        options = {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
        missing = sorted(o for o in options if o not in rows[name])
        assert not missing, f"pdbg {name}: {missing} are not in the README's command reference"
        documented = set(re.findall(r"--[a-z][a-z-]*", rows[name]))
        assert documented <= options, f"pdbg {name}: the README names {sorted(documented - options)}, which pdbg " \
                                      "does not take"


def test_the_readme_writes_an_optional_positional_argument_in_brackets() -> None:
    """The row of `pdbg replay` wrote `RUN STEP`, STEP required, where a bundle's main step is replayed without
    one (`pdbg replay failure.pdbg`): each positional argument is written as the help's usage writes it."""
    rows = reference_rows()
    for name, sub in subcommands().items():
        if name == "record":  # `-- script.py|-m MODULE [args]`: the script and its arguments, written as a command line
            continue
        for action in sub._actions:
            if action.option_strings or action.nargs in (argparse.REMAINDER, "*"):
                continue
            metavar = action.metavar or action.dest.upper()
            optional = action.nargs == "?"
            written = re.search(rf"(\[)?\b{re.escape(metavar)}\b(\])?", rows[name].split("`")[1])
            assert written, f"pdbg {name}: the README's command reference does not name {metavar}"
            need = "optional" if optional else "required"
            assert bool(written.group(1) and written.group(2)) == optional, \
                f"pdbg {name}: {metavar} is {need}, the README writes {written.group(0)}"
