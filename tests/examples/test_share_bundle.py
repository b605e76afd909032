"""The bundle example: a NaN step exported as failure.pdbg, replayed bitwise in a fresh process
elsewhere, with the environment differences reported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import replayer
from tests.cli import ROOT, env

EXAMPLE = ROOT / "examples" / "share_bundle.py"


def test_the_bundle_replays_in_a_fresh_process_and_reports_the_environment(tmp_path):
    out = tmp_path / "share"
    run_env = env()
    run_env.pop("OMP_NUM_THREADS", None)  # the example's "other machine" then runs with OMP_NUM_THREADS=1
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(out)], check=False, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path, env=run_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout
    assert "iteration 4: loss is nan - training stopped" in lines
    assert "NaN origin: step 13: Eq. 1 · normalise · forward · iteration 4 · call 0 produced output" in lines
    assert "2 steps of the recording's 14; main step 12: Classifier), verified when made: True" in lines
    # pdbg info, in the fresh process
    assert "$ pdbg info failure.pdbg" in lines
    assert "(step 12 there)" in lines
    # (the bundle keeps its inner step's output: verified bit for bit, the inner step too)
    assert "verified when made: bitwise match" in lines
    assert "statistics only" not in lines
    assert "environment variable OMP_NUM_THREADS: recorded None, here '1'" in lines
    assert f"code of Classifier (__main__:Classifier): unchanged ({EXAMPLE})" in lines
    assert f"code of normalise (__main__:normalise): unchanged ({EXAMPLE})" in lines
    # pdbg replay and repro.py, in the fresh process
    assert "inner steps: 1 of 1 match" in lines
    assert "MATCH: bit for bit" in lines
    assert "step 0 (Classifier, forward): bitwise match\n  output: bitwise equal" in lines
    assert lines.count("(exit code 0)") == 3

    bundle = out / "failure.pdbg"
    rec = replayer.open(bundle)
    assert len(rec) == 2 and rec.bundle_info["verified"]["match"] is True
    assert not rec.bundle_info["verified"].get("by_statistics")
    main = rec.main_step
    assert (main.name, main.phase, main.iteration) == ("Classifier", "forward", 4)
    assert main.tensors("output")[0].stats["nan"] == 16  # the 4 zeroed rows of the batch, 4 classes each
    assert bundle.stat().st_size < 1 << 20

    # what the example leaves is enough on its own: the two files, anywhere, replay bitwise
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(bundle, elsewhere)
    shutil.copy(out / "repro.py", elsewhere)
    repro_env = env()
    repro_env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE.parent), repro_env["PYTHONPATH"]])
    res = subprocess.run([sys.executable, "repro.py"], cwd=elsewhere, capture_output=True, text=True, timeout=120,
                         check=False, env=repro_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "step 0 (Classifier, forward): bitwise match\n  output: bitwise equal" in res.stdout
