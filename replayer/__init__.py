"""PaperDebugger's replayer: open a recording, replay steps, find where NaNs came from.

The Python API a notebook user calls; it reads recordings through ``recorder.store`` and never
imports the TUI.

    rec = replayer.open("run.zarr")
    rec.steps.filter(name="smooth_relu", phase="backward")
    res = replayer.replay(rec, "Eq. 2@iter=17#3")        # .match, .outputs, .diffs
    origin = replayer.first_nonfinite(rec, ops=True)     # .step, .cause, .op, .spread
    replayer.first_divergence(rec_a, rec_b)              # the root cause of two runs parting
    replayer.find(rec, "Eq. 2", "output.absmax > 1e3", start=origin.step, backward=True)
    replayer.bundle(rec, origin.step, "failure.pdbg", verify=True)   # replays elsewhere
"""

from recorder.errors import PdbgError, ReplayError, StepNotFoundError

from .bisect import Divergence, Origin, find, first_divergence, first_nonfinite
from .bundles import BundleInfo, bundle
from .intervene import InterventionError
from .recording import ChecksumReport, DamagedPayload, Recording, Step, StepTable, open
from .replay import ReplayResult, replay

__all__ = ["BundleInfo", "ChecksumReport", "DamagedPayload", "Divergence", "InterventionError", "Origin", "PdbgError",
           "Recording", "ReplayError", "ReplayResult", "Step", "StepNotFoundError", "StepTable", "bundle", "find",
           "first_divergence", "first_nonfinite", "open", "replay"]
