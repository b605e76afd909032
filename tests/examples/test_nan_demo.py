"""The demo the README runs first: a real NaN crash, recorded, and its origin shown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from recorder.store.reader import RunReader

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nan_smooth_relu.py"


def test_demo_records_the_crash_and_names_its_origin(tmp_path):
    """The example trains until the loss is NaN and names the innermost step that produced it."""
    out = tmp_path / "nan.zarr"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(out)], check=False, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "loss is nan - training stopped" in proc.stdout
    assert "first non-finite step: #64 SmoothAttention (forward), iteration 5, module blocks.1.attn" in proc.stdout
    assert "paper: Eq. 3" in proc.stdout
    assert "inside it: #65 smooth_relu output min 0 " in proc.stdout
    assert "operation: aten::div at " in proc.stdout and "weights / weights.sum(-1, keepdim=True)" in proc.stdout
    reader = RunReader(out)
    assert reader.status == "complete"
    assert int(reader.rank(0).column("steps/status")[64]) == 2  # nonfinite
