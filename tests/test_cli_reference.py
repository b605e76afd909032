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
