"""A signal the program ignores when ``pdbg record`` starts stays ignored: ``nohup pdbg record ...`` (SIGHUP
ignored) and a background job of a shell script (SIGINT ignored) train on through a closed terminal or a
Ctrl-C meant for the foreground job, as ``python script.py`` does. In flight mode the script runs in a child
process, which only inherits an ignored disposition if pdbg's parent leaves it ignored."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

import replayer
from tests.cli import env

HANGUP_AND_INTERRUPT = """import os, signal, torch
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
print("hangup ignored:", signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, flush=True)
for i in range(4):
    model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    if i == 1:
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C at the terminal, meant for another job
print("trained on", flush=True)
"""


def _ignoring() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("mode", ["flight", "full"])
def test_signals_ignored_at_start_stay_ignored_in_the_script(tmp_path, mode):
    """Flight mode's child got SIGINT and SIGHUP back at their defaults: the Ctrl-C raised KeyboardInterrupt
    and ended the run (exit 130), and the hangup pdbg forwarded killed a ``nohup`` job."""
    (tmp_path / "train.py").write_text(HANGUP_AND_INTERRUPT)
    rec = subprocess.run([sys.executable, "-m", "tui.cli", "record", "-o", "run.zarr", "--mode", mode,
                          "--modules", "*", "--", "train.py"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, check=False, env=env(), preexec_fn=_ignoring)
    assert rec.returncode == 0, rec.stderr
    assert rec.stdout.splitlines() == ["hangup ignored: True", "trained on"], rec.stdout + rec.stderr
    assert replayer.open(tmp_path / "run.zarr").status == "complete"


def test_pdbg_leaves_an_ignored_signal_ignored_while_it_waits(tmp_path):
    """SIGHUP to ``nohup pdbg record --mode flight`` (its terminal closed) was forwarded to the script, which
    died of it; ignored when pdbg started, it is neither forwarded nor handled."""
    from recorder import supervise

    signals = (signal.SIGINT, signal.SIGHUP)
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        with supervise._forwarding() as started:
            during = {sig: signal.getsignal(sig) for sig in signals}
            started(None)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert during == {sig: signal.SIG_IGN for sig in signals}
