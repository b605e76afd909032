"""Mixed precision with loss scaling (torch.amp.GradScaler): an overflow of the scaled gradients makes
the scaler skip optimizer.step(). The skipped step still ends its iteration; the overflow is recorded
(non-finite backward steps, listed iterations) but is no anomaly to stop at while the scale is above
1; gradients that stay non-finite once the scale is down to 1 stop the run in scaler.step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.amp.grad_scaler import GradScaler

import recorder
from recorder.store.reader import RunReader

ITERATIONS = 8
ORIGINAL = {"scale": GradScaler.scale, "step": GradScaler.step}


@recorder.paper_step("Eq. 3", description="a fp16 layer")
class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@recorder.paper_step("Eq. 4", description="root of the magnitude (its gradient at 0 is not finite)")
def root(x: torch.Tensor) -> torch.Tensor:
    return x.abs().sqrt()


def train(path, init_scale: float, nan_from: int | None = None, killed: bool = False,
          nan_loss_from: int | None = None, fused: bool = False) -> tuple[list[float], recorder.Run]:
    """Autocast to float16 with a GradScaler, recorded with on_anomaly="stop"; returns the scale
    each iteration ran at, and the scale after the last. ``killed``: the process commits what it
    recorded, then is SIGKILLed before the recording closes (call it in a child process).
    ``nan_loss_from``: from that iteration on the loss is NaN (a log(0) in it), outside every step.
    ``fused``: a fused optimizer, whose own step skips the update where the scaler found Inf."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Layer(), Layer())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, fused=fused or None)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scales = []
    with recorder.record(path, model=model, optimizer=opt, mode="full", on_anomaly="stop") as run:
        for i in range(ITERATIONS):
            with torch.autocast("cpu", dtype=torch.float16):
                h = model(torch.randn(4, 16, generator=torch.Generator().manual_seed(i)))
                if nan_from is not None and i >= nan_from:
                    h = root(h * 0)
                loss = h.float().sum()
                if nan_loss_from is not None and i >= nan_loss_from:
                    loss = loss * float("nan")
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if killed:
            run.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    scales.append(scaler.get_scale())
    return scales, run


def test_overflows_the_scaler_skips_end_their_iteration_and_do_not_stop(run_path):
    scales, run = train(run_path, init_scale=2.0 ** 16)  # GradScaler's default
    skipped = [i for i in range(ITERATIONS) if scales[i + 1] < scales[i]]  # the scaler backed off
    assert skipped and len(skipped) < ITERATIONS  # some steps overflowed, then training went on
    assert run.status == "complete"
    rank = RunReader(run_path).rank(0)
    iterations = rank.column("steps/iteration").tolist()
    assert iterations == [i for i in range(ITERATIONS) for _ in range(4)]  # 2 forward, 2 backward each
    phases, statuses = rank.column("steps/phase").tolist(), rank.column("steps/status").tolist()
    nonfinite = sorted({i for i, phase, status in zip(iterations, phases, statuses) if status == 2})
    assert nonfinite == skipped and set(phases[k] for k, s in enumerate(statuses) if s == 2) == {1}
    assert rank.final["grad_scaler_skipped"] == {"count": len(skipped), "iterations": skipped,
                                                 "scales": [scales[i] for i in skipped]}
    assert GradScaler.scale is ORIGINAL["scale"] and GradScaler.step is ORIGINAL["step"]


def test_a_fused_optimizer_skipping_its_own_update_is_a_skip(run_path, tmp_path):
    """GradScaler calls a fused optimizer's step (``AdamW(fused=True)``, nanoGPT's setup) even on an
    overflow, and the optimizer skips its update itself: its step hooks run as for a step taken. The
    recording took every overflow for a step taken: on_anomaly="stop" stopped training at the first
    one, and bisect named it as the origin. The skips are now those a plain optimizer's run lists."""
    import replayer

    plain, _ = train(tmp_path / "plain.zarr", init_scale=2.0 ** 16)
    scales, run = train(run_path, init_scale=2.0 ** 16, fused=True)
    assert run.status == "complete" and scales == plain
    skipped = RunReader(run_path).rank(0).final["grad_scaler_skipped"]
    assert skipped == RunReader(tmp_path / "plain.zarr").rank(0).final["grad_scaler_skipped"]
    assert skipped["count"] > 0, skipped
    assert replayer.first_nonfinite(replayer.open(run_path)).clean


def test_gradients_non_finite_at_scale_one_stop_in_scaler_step(run_path):
    with pytest.raises(recorder.NonFiniteError,
                       match=r"Eq\. 4 \(root\) backward, iteration \d+, call 0: .* NaN .*GradScaler skipped "
                             r"the optimizer step at loss scale 1\)"):
        train(run_path, init_scale=8.0, nan_from=2)
    rank = RunReader(run_path).rank(0)
    assert rank.final["status"] == "crashed"
    # iterations 2, 3 and 4 skipped at scales 8, 4 and 2 (no stop); iteration 5, at scale 1, stopped
    assert rank.final["grad_scaler_skipped"]["iterations"] == [2, 3, 4, 5]
    assert GradScaler.scale is ORIGINAL["scale"] and GradScaler.step is ORIGINAL["step"]


def test_bisect_passes_over_the_overflows_the_scaler_handled(run_path, tmp_path):
    """A healthy run's overflows (skipped at a loss scale above 1, their gradients holding Inf) are no NaN
    origin, and pdbg info says what the scaler skipped. A NaN from the gradient of sqrt at 0 is no
    overflow, though the scaler skips it too: no Inf beside it (bisect passed over it, and named it only
    once the scale was down to 1, or said "clean" where it never got there)."""
    import replayer
    from tests.cli import pdbg_here as pdbg

    scales, _ = train(run_path, init_scale=2.0 ** 16)
    rec = replayer.open(run_path)
    origin = replayer.first_nonfinite(rec)
    assert origin.step is None and origin.cause.startswith(
        "no non-finite values recorded outside the backward passes of the"), origin.cause
    looked = replayer.first_nonfinite(rec, scaler_skips=True)
    assert looked.step is not None and looked.step.phase == "backward"
    info = pdbg("info", str(run_path), cwd=tmp_path)
    assert "GradScaler skipped " in info.stdout and "NaN origin: none found" in info.stdout, info.stdout
    bisect = pdbg("bisect", str(run_path), cwd=tmp_path)
    assert bisect.returncode == 0 and "--scaler-skips" in bisect.stdout
    assert pdbg("bisect", str(run_path), "--scaler-skips", cwd=tmp_path).returncode == 1

    stopped = tmp_path / "stopped.zarr"
    with pytest.raises(recorder.NonFiniteError):
        train(stopped, init_scale=8.0, nan_from=2)
    origin = replayer.first_nonfinite(replayer.open(stopped))
    assert origin.step is not None and (origin.step.name, origin.step.phase, origin.step.iteration) == (
        "root", "backward", 2), origin.cause
    assert origin.cause.endswith("from finite inputs (GradScaler skipped the optimizer step of iteration 2, but no "
                                 "gradient recorded in it held Inf: NaN without Inf is no overflow of the scaled "
                                 "loss)"), origin.cause


def test_a_run_killed_before_it_closed_still_says_what_the_scaler_skipped(run_path, tmp_path):
    """What GradScaler skipped is committed as the run goes (the manifest's info), not only when the
    recording closes: a healthy mixed-precision run killed by the OOM killer or a preemption is not
    reported as a NaN at its first overflow (bisect named it, and pdbg info did too)."""
    import replayer
    from tests.cli import pdbg_here as pdbg

    child = subprocess.run([sys.executable, "-c", "import sys; from tests.recorder.test_grad_scaler import train; "
                            "train(sys.argv[1], init_scale=2.0 ** 16, killed=True)", str(run_path)],
                           cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == -signal.SIGKILL, child.stderr
    scales, _ = train(tmp_path / "closed.zarr", init_scale=2.0 ** 16)  # the same run, closed
    closed = RunReader(tmp_path / "closed.zarr").rank(0).final["grad_scaler_skipped"]
    rec = replayer.open(run_path)
    assert rec.status == "crashed" and rec.rank.final == {}
    assert rec.scaler_skips == closed and closed["count"] > 0
    origin = replayer.first_nonfinite(rec)
    assert origin.step is None and "GradScaler skipped" in origin.cause, origin.cause
    info = pdbg("info", str(run_path), cwd=tmp_path)
    assert "NaN origin: none found" in info.stdout and "GradScaler skipped " in info.stdout, info.stdout
    assert pdbg("bisect", str(run_path), cwd=tmp_path).returncode == 0


def test_past_the_first_skips_those_bisect_passes_over_are_still_listed(run_path, monkeypatch):
    """Only SKIPS_LISTED skips are listed whatever their scale; every skip at a scale above 1 is
    (a long run's overflows past the first thousand were not, and bisect named them as origins). The
    NaN of sqrt at 0 here is no overflow (no Inf): it is the origin at its first skip."""
    import replayer

    monkeypatch.setattr("recorder.items.SKIPS_LISTED", 1)
    with pytest.raises(recorder.NonFiniteError):
        train(run_path, init_scale=8.0, nan_from=2)  # skipped at scales 8, 4, 2, then 1 (stopped)
    skipped = RunReader(run_path).rank(0).final["grad_scaler_skipped"]
    assert skipped == {"count": 4, "iterations": [2, 3, 4], "scales": [8.0, 4.0, 2.0]}
    origin = replayer.first_nonfinite(replayer.open(run_path))
    assert origin.step is not None and (origin.step.phase, origin.step.iteration) == ("backward", 2)


def test_a_nan_loss_the_scaler_skips_is_no_overflow(run_path, tmp_path):
    """A loss already NaN makes the scaler skip every step from then on, halving its scale: bisect passed
    over them as "overflows of the scaled loss, as mixed precision expects" and exited 0 (clean). NaN
    with no Inf beside it is no overflow: it came in through the grad output, and bisect says so (exit
    1); the overflows before it, whose gradients held Inf, are still passed over."""
    import replayer
    from tests.cli import pdbg_here as pdbg

    train(run_path, init_scale=2.0 ** 16, nan_loss_from=5)
    rec = replayer.open(run_path)
    skipped = rec.scaler_skips["iterations"]
    assert [i for i in skipped if i < 5] and [i for i in skipped if i >= 5] == [5, 6, 7], skipped
    origin = replayer.first_nonfinite(rec)
    entered = origin.entered
    assert origin.step is None and entered is not None, origin.cause
    assert (entered.name, entered.phase, entered.iteration) == ("Layer", "backward", 5), origin.cause
    assert origin.cause.startswith(f"grad output of step {entered.index}: ") and origin.cause.endswith(
        "(GradScaler skipped the optimizer step of iteration 5, but no gradient recorded in it held Inf: NaN "
        "without Inf is no overflow of the scaled loss)"), origin.cause
    res = pdbg("bisect", str(run_path), cwd=tmp_path)
    assert res.returncode == 1 and "no overflow" in res.stdout, res.stdout

    overflows = tmp_path / "overflows.zarr"  # the same run without the NaN: its overflows alone
    train(overflows, init_scale=2.0 ** 16)
    origin = replayer.first_nonfinite(replayer.open(overflows))
    assert skipped[:3] == [0, 1, 2] and origin.clean and origin.cause.startswith(
        "no non-finite values recorded outside the backward passes of the 3 iterations whose optimizer step "
        "GradScaler skipped (0, 1, 2) and whose gradients held Inf, as an overflow of the scaled loss does"), \
        origin.cause
    assert ("; it skipped 3 iterations in a row (0 to 2, loss scale 65536 down to 16384): an overflow stops once the "
            "scale is low enough") in origin.cause, origin.cause
