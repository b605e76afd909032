"""pdbg - PaperDebugger's command line.

Exit codes: 0 success, 1 a finding (mismatch, NaN found, divergence), 2 bad usage or bad input.
Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from recorder.errors import PdbgError

from . import cmd_bisect, cmd_bundle, cmd_record, cmd_replay, cmd_serve


def _version() -> str:
    try:
        return version("paperdebugger")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdbg", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"pdbg {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cmd_record.add_parser(sub)
    cmd_replay.add_parsers(sub)
    cmd_bisect.add_parsers(sub)
    cmd_bundle.add_parsers(sub)
    cmd_serve.add_parser(sub)
    p = sub.add_parser("tui", help="open the TUI on a recording (also: pdbg RUN)",
                       description="Travel through a recording from the keyboard: ? lists every key.")
    p.add_argument("run", metavar="RUN", help="the recording or bundle")
    p.add_argument("--at", metavar="STEP", help="put the cursor on this step (an index or a selector)")
    cmd_replay.rank_option(p)
    p.set_defaults(handler=_tui)
    return parser


COMMANDS = ("record", "info", "replay", "verify", "bisect", "find", "bundle", "serve", "tui")


def _tui(args: argparse.Namespace) -> int:
    from .app import run_app

    return run_app(args.run, args.at, args.rank)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        argv = ["tui", *argv]  # pdbg RUN: the TUI
    args = parser.parse_args(argv)
    try:
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.print_usage(sys.stderr)
            print("pdbg: error: give a command (see pdbg --help)", file=sys.stderr)
            return 2
        return int(handler(args))
    except PdbgError as exc:
        print(f"pdbg: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `pdbg ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
