"""A flight-mode run killed while its ring was being written out: the tensors of the write-out's iterations whose
bytes were not committed are said to be lost with the process, not to have "not fit in the ring (record with a
larger max_ring_bytes)", advice that would change nothing; `pdbg info` says the last write-out may be cut short."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import replayer
from tests.cli import ROOT, env, pdbg_here


@pytest.fixture(scope="module")
def cut(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ring") / "cut.zarr"
    proc = subprocess.run([sys.executable, "-m", "tests.recorder.ring_cut_child", str(path)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    return path


def test_a_tensor_whose_write_out_the_death_cut_short_says_so(cut: Path) -> None:
    """Iteration 4 was being written out when the process died: its tensors without bytes say that."""
    rec = replayer.open(cut)
    assert rec.status == "crashed" and 4 in rec.rank.ring_iterations()
    steps = [s for s in rec.steps if s.iteration == 4]
    lost = [r for s in steps for r in s.records if not r.has_payload]
    kept = [r for s in steps for r in s.records if r.has_payload]
    assert lost and kept, "the kill did not land inside the write-out"
    why = rec.rank.why_statistics_only(lost[0])
    assert "when the process died" in why and "max_ring_bytes" not in why, why


def test_pdbg_info_says_the_last_write_out_may_be_cut_short(cut: Path, tmp_path: Path) -> None:
    """`pdbg info` names the kept iterations and that the death may have cut the last write-out short."""
    out = pdbg_here("info", str(cut), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    kept = next(line for line in out.stdout.splitlines() if line.startswith("tensors kept:"))
    assert "cut short" in kept, kept
