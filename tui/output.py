"""What ``pdbg`` writes, and where: stdout and stderr that never make a traceback of their own (a
reader that left, a closed descriptor, an encoding that lacks a character), and ``--json`` output
on stdout alone, whatever the replayed code prints meanwhile."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

_json_stream: TextIO | None = None  # where --json goes while sys.stdout is stderr (json_only)


class Output(io.TextIOBase):
    """A text stream over stdout or stderr: ``escapes`` (a str.translate table) applied to what it is
    given; a reader that left (`| head -1`: BrokenPipeError) ends the output and not the command, so
    its exit code is still its answer; a character the stream's encoding lacks is written escaped."""

    def __init__(self, stream: TextIO, escapes: dict[int, str] | None = None) -> None:
        self.stream = stream
        self.escapes = escapes
        self.gone = False

    def write(self, text: str) -> int:
        if self.gone:
            return len(text)
        out = text.translate(self.escapes) if self.escapes else text
        try:
            try:
                self.stream.write(out)
            except UnicodeEncodeError:
                encoding = getattr(self.stream, "encoding", None) or "ascii"
                self.stream.write(out.encode(encoding, "backslashreplace").decode(encoding))
        except BrokenPipeError:
            self._reader_left()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._reader_left()

    def _reader_left(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError, ValueError):  # what the stream still buffers goes nowhere at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.stream, "errors", None)

    def __getattr__(self, name: str) -> Any:  # the rest as the stream has it (buffer, reconfigure, line_buffering)
        return getattr(self.stream, name)


@contextlib.contextmanager
def streams(escapes: dict[int, str] | None, wrap: bool = True) -> Iterator[None]:
    """stdout and stderr as ``Output`` for the duration (``wrap``), and a closed one (``>&-``) as
    /dev/null; ``escapes``: control characters to escape (in what a recording holds: names, messages)."""
    saved = sys.stdout, sys.stderr
    opened = []
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:  # started with the descriptor closed
            opened.append(open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 - closed below
            setattr(sys, name, opened[-1])
    if wrap:
        sys.stdout, sys.stderr = Output(sys.stdout, escapes), Output(sys.stderr, escapes)  # type: ignore[assignment]
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stdout, sys.stderr = saved
        for stream in opened:
            stream.close()


@contextlib.contextmanager
def json_only(on: bool) -> Iterator[None]:
    """With ``on`` (a ``--json`` command): what anything else prints to stdout meanwhile (the replayed
    script's own prints) goes to stderr, so that stdout holds the one JSON object ``emit_json`` writes."""
    global _json_stream
    if not on:
        yield
        return
    saved = _json_stream, sys.stdout
    _json_stream, sys.stdout = sys.stdout, sys.stderr
    try:
        yield
    finally:
        _json_stream, sys.stdout = saved


def emit_json(text: str, **kwargs: Any) -> None:
    """Print a ``--json`` command's JSON text to stdout (see ``json_only``)."""
    print(text, file=_json_stream or sys.stdout, **kwargs)
