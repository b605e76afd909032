"""examples/multiscale_fusion.py: a broken paper expectation (Eq. 7's weights in (0, 1)) shown as alerts."""

from __future__ import annotations

import re
from pathlib import Path

import replayer
from tests.cli import ROOT, python

EXAMPLE = ROOT / "examples" / "multiscale_fusion.py"
ITERATIONS = 3


def test_example_reports_the_broken_range_and_only_it(tmp_path: Path) -> None:
    """The example exits 0 and prints one alert per ChannelAttention call; the recording holds the
    same alerts, naming the watched tensor and the range check, while shape and norm held."""
    out = tmp_path / "mf.zarr"
    proc = python(str(EXAMPLE), "--out", str(out), "--iterations", str(ITERATIONS), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"{ITERATIONS} of {8 * ITERATIONS} steps raised alerts:" in proc.stdout
    printed = re.findall(r"watch 'channel_weights' range \(Eq\. 7\): expected values in \[0, 1\], "
                         r"got \[(-?[\d.e+-]+), (-?[\d.e+-]+)\]", proc.stdout)
    assert len(printed) == ITERATIONS and all(float(lo) < 0 for lo, _ in printed)
    assert "channel_weights: shape held, range BROKEN; attended_c1: shape held, norm held" in proc.stdout
    assert f"pdbg {out}   then press `a` for the alerts pane" in proc.stdout

    rec = replayer.open(out)
    assert rec.status == "complete"
    alerts = rec.steps.filter(status="alert")
    assert [(s.name, s.phase, s.iteration, s.module_path) for s in alerts] == [
        ("ChannelAttention", "forward", it, "c1_attention") for it in range(ITERATIONS)]
    assert {s.status for s in rec.steps} == {"ok", "alert"}
    for step, (lo, hi) in zip(alerts, printed):
        assert step.paper == {"label": "Algorithm 1", "algorithm": None, "step": 5, "equation": "Eq. 7",
                              "description": "Apply channel attention to shallow feature C1"}
        (alert,) = step.extra["alerts"]  # shape (both watches) and norm (attended_c1) were not broken
        assert alert["watch"] == "channel_weights" and alert["check"] == "range"
        assert alert["expected"] == [0.0, 1.0] and alert["reference"] == "Eq. 7" and alert["nonfinite"] == 0
        assert alert["actual"][0] < 0 and f"{alert['actual'][0]:.4g}" == lo and f"{alert['actual'][1]:.4g}" == hi
        weights = step.tensor("channel_weights", role="watch")
        assert weights.shape == (8, 32, 1, 1) and weights.min().item() == alert["actual"][0]
        assert [w["name"] for w in step.extra["watches"]] == ["channel_weights", "attended_c1"]
