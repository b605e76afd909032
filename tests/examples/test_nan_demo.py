"""The demo the README runs first: a real NaN crash, recorded, and its origin shown."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from recorder.store.reader import RunReader

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nan_smooth_relu.py"


def test_demo_records_the_crash_and_names_its_origin(tmp_path):
    """The example trains until the loss is NaN, names the step and the operation that produced it
    (exp overflowing in SmoothReLU), finds two fixes on the recorded step, and writes a bundle."""
    out = tmp_path / "nan.zarr"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(out)], check=False, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "iteration 12: loss is nan - the training died (FloatingPointError)" in proc.stdout
    assert "first non-finite step: #146 smooth_relu (forward), iteration 12, module blocks.0.attn" in proc.stdout
    assert "paper: Eq. 2" in proc.stdout
    assert "origin: Eq. 2 · smooth_relu · blocks.0.attn · forward · iteration 12" in proc.stdout  # pdbg bisect --ops
    assert "operation: aten::exp" in proc.stdout
    assert "  aten::exp's input 0: float32[8, 2, 16, 16] min " in proc.stdout  # (the operation's, not the step's)
    assert "then: step 147 Block at blocks.1 (forward, iteration 12)" in proc.stdout
    assert "operation: aten::exp at " in proc.stdout and "torch.exp(x + beta)" in proc.stdout
    assert "swap in a stable SmoothReLU: 2 -> 0  (finite)" in proc.stdout
    assert "clamp its input to [-50, 50]: 2 -> 0  (finite)" in proc.stdout
    assert "verified: bitwise match" in proc.stdout
    # not a terminal: the command, which runs as printed from a shell without the environment activated
    # (pdbg, or the one beside this Python: make demo's .venv/bin/pdbg)
    command = re.search(rf"open it in the TUI: (\S+) {re.escape(str(out))} --at 146\n", proc.stdout)
    assert command is not None, proc.stdout
    info = subprocess.run([*shlex.split(command[1]), "info", str(out)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert info.returncode == 0 and "crashed" in info.stdout, info.stdout + info.stderr
    reader = RunReader(out)
    assert reader.status == "crashed"  # the training died
    assert int(reader.rank(0).column("steps/status")[146]) == 2  # nonfinite
    assert (tmp_path / "nan.pdbg").is_file() and (tmp_path / "repro.py").is_file()
