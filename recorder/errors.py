"""Errors of the data layers.

Every error that reaches a user is one of these. Its message is one line that names the problem and
says what to do; the command line prints it and exits with code 2, never a traceback. Each class also
inherits the builtin it refines, so ``except FileNotFoundError`` keeps working in user code.
"""

from __future__ import annotations


def brief(exc: BaseException) -> str:
    """``TypeName: first line of its message``: another library's error inside one of these one-line messages."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class PdbgError(Exception):
    """Base class: a problem with the user's input or recording, not a bug in PaperDebugger."""

    exit_code = 2


class NotARecordingError(PdbgError, FileNotFoundError):
    """The path does not exist or holds no PaperDebugger recording."""


class FormatError(PdbgError, ValueError):
    """The recording exists but its contents are damaged or inconsistent."""


class ChecksumError(FormatError):
    """Bytes read from the recording are not the bytes recorded: their checksum does not match.
    ``reason``: what the message says of them, without the recording's name and the advice, for a list
    (``pdbg verify`` lists each step whose tensors are corrupted and goes on)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


class UnknownTagError(FormatError):
    """A document holds a tag this PaperDebugger does not know: damage, or (in a recording of a newer minor
    schema) something the newer version added, which a replay then refuses for that step alone."""

    def __init__(self, message: str, tag: str) -> None:
        super().__init__(message)
        self.tag = tag


class SchemaVersionError(FormatError):
    """The recording was written by a newer, incompatible PaperDebugger."""


class RecordingError(PdbgError, RuntimeError):
    """``recorder.record`` was used in a way that cannot work (for example, nested recordings)."""


class StepNotFoundError(PdbgError, KeyError):
    """A step index or selector does not name a recorded step."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it one plain line
        return str(self.args[0]) if self.args else ""


class StepPositionError(StepNotFoundError, IndexError):
    """A position beyond a step table's steps: an IndexError too, as a sequence's is."""


class AlreadyRecording(RecordingError):
    """``record()`` while a recording is active in the process (one at a time)."""


class ReplayError(PdbgError, RuntimeError):
    """A step cannot be replayed: its code cannot be found, or something it needs was not recorded."""


class NewerSchemaError(ReplayError):
    """A step of a newer minor schema's recording holds what that schema added, which this PaperDebugger
    cannot read (an unknown tag or tensor role): that step is not replayed here; the others are.
    ``reason``: the message without the step, for a list of steps."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class NotOnThisMachine(ReplayError):
    """A step that cannot be replayed on this machine, but can on one like the recording's (a GPU
    step where there is no GPU)."""
