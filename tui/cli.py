"""pdbg - PaperDebugger's command line.

Exit codes: 0 success, 1 a finding (mismatch, NaN found, divergence), 2 bad usage or bad input.
Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import shlex
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

from recorder.errors import PdbgError
from replayer.recording import ESCAPES as _ESCAPES  # control characters, escaped in what pdbg prints

from . import cmd_bisect, cmd_bundle, cmd_record, cmd_replay, cmd_serve, output


def _version() -> str:
    try:
        return version("paperdebugger")
    except PackageNotFoundError:
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (the problem, and where the options are listed)
    instead of a usage block and the error, and whose options may come between positional arguments
    (``pdbg replay RUN --no-inner STEP``)."""

    _plain = False  # set while parse_known_intermixed_args runs its two plain passes

    _words: list[str] = []  # the words being parsed, for error()'s hint about values that start with "-"

    def error(self, message: str) -> NoReturn:
        hint = _dash_hint(message, self._words, self._option_string_actions)
        self.exit(2, f"pdbg: error: {message}{hint} (options: {self.prog} --help)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        # argparse fills the positionals it can from the first run of words: an optional one (replay's STEP)
        # is left empty when an option follows RUN, and the STEP after the option is then "unrecognized".
        # Intermixed parsing takes the options first, then the positionals from the words left over.
        if not self._plain:
            self._words = [str(w) for w in (sys.argv[1:] if args is None else args)]
        if self._plain or not self._intermixable(args):
            return super().parse_known_args(args, namespace)
        self._plain = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._plain = False

    def _intermixable(self, args: Any) -> bool:
        """Whether intermixed parsing applies: not to a parser of subcommands, nor to pdbg record (the
        script's own arguments follow it as they are), nor where ``--`` marks what follows as positional
        (the second pass would read a ``-name`` after it as an option)."""
        words = sys.argv[1:] if args is None else list(args)
        nested = any(a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in self._get_positional_actions())
        return not nested and "--" not in words


def _dash_hint(message: str, words: list[str], known: Any) -> str:
    """How to pass a value that argparse took for an option because it starts with "-": ``--against -x.zarr``
    reads as an option without its value, ``pdbg info -x.zarr`` as an unknown option."""
    if message.endswith(": expected one argument"):
        flags = message.split(":")[0].removeprefix("argument ").split("/")
        for flag, value in zip(words, words[1:]):
            if flag in flags and value.startswith("-") and value != "--":
                return f"; a value that starts with '-' is given as {flag}={value}"
        return ""
    for w in words:
        if w.startswith("-") and w.split("=")[0] not in known and ("." in w or "/" in w):
            return f"; {w} reads as an option: a path that starts with '-' is given as ./{w}"
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdbg", description=__doc__.split("\n\n")[0])
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
    cmd_replay.code_options(p)
    cmd_replay.rank_option(p)
    p.set_defaults(handler=_tui)
    return parser


COMMANDS = ("record", "info", "replay", "verify", "bisect", "find", "bundle", "serve", "tui")
_READERS = frozenset({"info", "replay", "verify", "bisect", "find", "bundle"})  # print what a recording holds


def _tui(args: argparse.Namespace) -> int:
    from recorder.store import backend

    from .app import run_app

    if not backend.is_url(args.run) and not os.path.exists(args.run):
        raise PdbgError(_not_there(args.run, as_command=False))
    web = "web_driver" in os.environ.get("TEXTUAL_DRIVER", "")  # pdbg serve: a browser is the terminal
    if not web and not (sys.stdin.isatty() and sys.stdout.isatty()):
        run = shlex.quote(args.run)
        served = f"-- {run}" if args.run.startswith("-") else run  # (a dash path is an option to pdbg serve)
        raise PdbgError("the TUI needs a terminal (stdin and stdout are not one here): use pdbg info, bisect or "
                        f"replay on {args.run}, or pdbg serve {served} to open it in a browser")
    return run_app(args.run, args.at, args.rank, script=args.script, use_bundled_source=args.use_bundled_source)


# Words people try for a command that has another name here (difflib would offer `pdbg list` "bisect").
_GUESSED = {"list": "info", "ls": "info", "steps": "info", "show": "info", "summary": "info", "stats": "info",
            "diff": "bisect --against", "compare": "bisect --against", "nan": "bisect", "origin": "bisect",
            "export": "bundle", "share": "bundle", "open": "tui", "view": "tui", "browse": "serve", "web": "serve",
            "check": "verify", "search": "find", "run": "record", "rerun": "replay"}


def _not_there(word: str, as_command: bool) -> str:
    """The error for ``pdbg WORD ...`` where WORD is neither a command nor a path that exists
    (``as_command``: more words follow it, so it was meant as a command)."""
    close = [_GUESSED[word.lower()]] if word.lower() in _GUESSED else difflib.get_close_matches(word, COMMANDS, n=1)
    meant = f" (did you mean {close[0]!r}?)" if close and os.sep not in word else ""
    commands = ", ".join(COMMANDS)
    if as_command:
        return f"unknown command {word!r}{meant}: the commands are {commands}; pdbg RUN opens the TUI"
    return (f"{word} does not exist{meant}: give the path of a recording (run.zarr) or a bundle (.pdbg), or a "
            f"command ({commands}; pdbg --help)")


# Arguments that are text a recording's names are compared with (selectors, globs, edit keys, conditions),
# never paths, nor the recorded script's own arguments (pdbg record passes those on as they are).
_TEXT_ARGS = ("step", "at", "start", "where", "when", "swap", "edit", "set", "recipe", "save_recipe", "modules")


def _text_arg(value: str) -> str:
    """A command-line argument as the text it was typed as: Python decodes the command line with the
    locale's encoding (under LC_ALL=C without its UTF-8 mode, "é" comes as two lone surrogates, which match
    no name); a recording's names are UTF-8, so the argument's bytes are read as UTF-8 where they are that."""
    try:
        return os.fsencode(value).decode("utf-8")
    except (UnicodeError, ValueError):
        return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"] and len(argv) > 1:  # pdbg -- -odd-name.zarr: the TUI on a path that starts with -
        argv = ["tui", *argv]
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        # pdbg infoo run.zarr; pdbg export --help, which would be the TUI's help, as for a recording named export
        if len(argv) > 1 and (not argv[1].startswith("-") or argv[1] in ("-h", "--help")) \
                and not os.path.exists(argv[0]):
            print(f"pdbg: error: {_not_there(argv[0], as_command=True)}", file=sys.stderr)
            return 2
        argv = ["tui", *argv]  # pdbg RUN: the TUI
    if argv[:1] == ["bundle"]:
        argv = cmd_bundle.legacy_script_flag(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (argparse's own message names the top-level help, not the command's)
        command = f"pdbg {args.command}" if getattr(args, "command", None) else "pdbg"
        message = f"unrecognized arguments: {' '.join(unknown)}"
        hint = _dash_hint(message, unknown, ())
        print(f"pdbg: error: {message}{hint} (options: {command} --help)", file=sys.stderr)
        return 2
    handler = getattr(args, "handler", None)
    if handler is None:
        print("pdbg: error: give a command, or a recording to open (see pdbg --help)", file=sys.stderr)
        return 2
    for name in _TEXT_ARGS:  # (paths stay as given: the file system's bytes)
        value = getattr(args, name, None)
        if isinstance(value, str):
            setattr(args, name, _text_arg(value))
        elif isinstance(value, list):
            setattr(args, name, [_text_arg(v) if isinstance(v, str) else v for v in value])
    from recorder.runner import warnings_as_lines

    # What reads a recording prints through output.streams; pdbg record leaves the script's streams
    # as they are (it may reconfigure them, or write to their buffer), and the TUI has the terminal.
    with output.streams(_ESCAPES, wrap=args.command in _READERS):
        try:
            with output.json_only(bool(getattr(args, "json", False))), warnings_as_lines():
                return int(handler(args))
        except PdbgError as exc:
            print(f"pdbg: error: {str(exc).translate(_ESCAPES)}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:  # Ctrl-C: nothing it was writing is left half-written (bundles, recipes)
            print("pdbg: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # (record, serve: `pdbg ... | head`) the reader left; not an error of ours
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            return 0


if __name__ == "__main__":
    sys.exit(main())
