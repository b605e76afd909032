"""The ``pdbg`` command's entry point.

Importing the command line takes about a second (torch); Ctrl-C in that second, or before a
command runs, is one line and exit 130, as it is while a command runs.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from .cli import main as run

        return run()
    except KeyboardInterrupt:
        print("pdbg: interrupted", file=sys.stderr)
        return 130
