"""The flight recorder example: a long run dies late; the last `keep` iterations are there, bit for bit."""

from __future__ import annotations

import subprocess
import sys

import torch

import replayer
from tests.cli import ROOT, env

EXAMPLE = ROOT / "examples" / "flight_recorder.py"


def test_a_late_crash_leaves_statistics_for_all_and_payloads_for_the_last_iterations(tmp_path):
    """100 iterations, a corrupted batch at 90, keep=3: the run stops at the NaN, every iteration
    0-90 has statistics, only 88-90 have payloads, and the origin and a step before it replay bitwise."""
    out = tmp_path / "flight.zarr"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(out), "--iterations", "100"], check=False,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout
    assert ("iteration 90: training died: NonFiniteError: Eq. 1 (normalise) forward, iteration 90, call 0: "
            "output has 64 NaN") in lines
    assert "iteration 91" not in lines  # nothing trained after the crash
    assert "statistics: 91 iterations (0-90)" in lines
    assert "payloads:   iterations [88, 89, 90]" in lines
    assert "ring written on nonfinite: iterations [88, 89, 90]" in lines
    assert "Eq. 1 · normalise · forward · iteration 90 · call 0 produced output (64 NaN of 512) from finite inputs" \
        in lines
    assert "(normalise forward, iteration 90; the step that made the NaN): bitwise match (output)" in lines
    assert "(Classifier backward, iteration 89; the iteration before): bitwise match" in lines
    assert "MISMATCH" not in lines

    rec = replayer.open(out)
    assert rec.status == "crashed"
    final = rec.reader.attrs["final"]
    assert final["exception"]["message"] == "Eq. 1 (normalise) forward, iteration 90, call 0: output has 64 NaN"
    assert [(d["reason"], d["iterations"]) for d in final["flight"]["dumps"]] == [("nonfinite", [88, 89, 90])]
    iterations = set()
    for step in rec.steps:
        iterations.add(step.iteration)
        records = step.records
        assert records, step
        if step.iteration < 88:  # statistics only
            assert not any(r.has_payload for r in records), step
        else:  # every tensor's bytes
            assert all(r.has_payload for r in records), step
        for r in step.tensors("output"):
            assert r.stats["std"] > 0, (step, r)  # real statistics, NaN rows or not
    assert iterations == set(range(91))

    (origin,) = rec.steps.filter(name="normalise", iteration=90)
    assert origin.status == "nonfinite"
    x = origin.tensor("args.0")  # the corrupted batch itself: every eighth row zero, the others not
    zero_rows = (x == 0).all(dim=1)
    assert zero_rows.tolist() == [i % 8 == 0 for i in range(32)]
    assert torch.isnan(origin.tensor("output")[zero_rows]).all()
    assert torch.isfinite(origin.tensor("output")[~zero_rows]).all()
