"""PaperDebugger's recorder: mark the paper's steps, record them while training runs.

    @recorder.paper_step("Eq. 2", description="SmoothReLU")
    def smooth_relu(x, beta=1.0, gamma=1.0): ...

    with recorder.record("run.zarr", model=model, optimizer=opt) as run:
        train()

Importing this package is cheap: zarr and the writer load when a recording starts.

Lightning and Hugging Face: ``Trainer(callbacks=[PaperDebuggerCallback("run.zarr")])`` with the
callback from ``recorder.lightning`` or ``recorder.huggingface`` (each imports its framework, this
package neither).
"""

from __future__ import annotations

from typing import Any

from .annotate import StepDef, annotate, paper_step, watch
from .capture import RecorderWarning
from .errors import (
    ChecksumError,
    FormatError,
    NotARecordingError,
    PdbgError,
    RecordingError,
    SchemaVersionError,
    StepNotFoundError,
)
from .monitors import BreakpointStop, NonFiniteError, StepContext, breakpoint, register_check, unregister_check

__all__ = [
    "BreakpointStop",
    "NonFiniteError",
    "StepContext",
    "breakpoint",
    "register_check",
    "unregister_check",
    "ChecksumError",
    "FormatError",
    "NotARecordingError",
    "PdbgError",
    "RecorderWarning",
    "RecordingError",
    "SchemaVersionError",
    "StepDef",
    "StepNotFoundError",
    "annotate",
    "close",
    "flush",
    "open_run",
    "paper_step",
    "record",
    "watch",
]


def record(path: Any, model: Any = None, optimizer: Any = None, mode: str = "full", every: int = 1,
           compressor: Any = None, **options: Any) -> Any:
    """Record the paper steps run inside a ``with`` block (see ``recorder.run.record``)."""
    from .run import record as _record

    return _record(path, model=model, optimizer=optimizer, mode=mode, every=every, compressor=compressor,
                   **options)


def flush(timeout: float | None = 60.0) -> bool:
    """Commit everything the active recording has captured so far, and wait for it (the writer
    commits every ``flush_interval`` on its own; a script that may die hard next, in native code
    it does not trust, can make sure its last steps are on disk). Returns False when no recording
    is active, the writer failed, or ``timeout`` seconds passed. Reaches the recording that
    ``pdbg record`` runs around an unmodified script too."""
    from . import capture

    session = capture.ACTIVE
    return session is not None and bool(session.pipeline.flush(timeout))


def close() -> bool:
    """Close the active recording, for a Run out of reach (a notebook's ``recorder.record(...)`` run as a
    statement, its result not kept), which would refuse every later recording of the process (AlreadyRecording).
    It is closed as the end of the process would close it: ``crashed`` with the stop it raised
    (``on_anomaly="stop"``) or, in a notebook, with the exception of the last cell that recorded steps of it;
    ``complete`` otherwise. Returns False when no recording is active."""
    from .run import close_active

    return close_active()


def open_run(path: Any) -> Any:
    """Open a recording's store for reading (low level; most users want ``replayer.open``)."""
    from .store.reader import RunReader

    return RunReader(path)
