"""PaperDebugger's replayer: open a recording, replay steps, find where NaNs came from.

The Python API a notebook user calls; it reads recordings through ``recorder.store`` and never
imports the TUI.

    rec = replayer.open("run.zarr")
    rec.steps.filter(name="smooth_relu", phase="backward")
    rec.step("Eq. 2@iter=17#3").tensor("output")
"""

from .recording import Recording, Step, StepTable, open
from .replay import ReplayResult, replay

__all__ = ["Recording", "ReplayResult", "Step", "StepTable", "open", "replay"]
