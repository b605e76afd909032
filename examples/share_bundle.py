"""Sharing a failure: export the step where a NaN appeared as one small file, and replay it elsewhere.

A small classifier trains under ``recorder.record`` until a corrupted batch (some feature rows all
zeros) reaches the paper's Eq. 1, which normalises each row by its L2 norm: 0/0 is NaN, the loss is
NaN and training stops. From the recording, ``replayer.bundle(..., verify=True, script=True)`` writes
``failure.pdbg`` (the model's forward call in that iteration, with the Eq. 1 call inside it: their
inputs, parameters, RNG states, settings and source) and ``repro.py`` next to it: what you would
attach to a bug report.

Then, as a colleague on another machine would, it copies those two files into an empty temporary
directory and, in fresh processes started there, runs ``pdbg info failure.pdbg`` (what the bundle
holds, how it was verified, and every difference between the environment it was recorded in and
this one), ``pdbg replay failure.pdbg`` and ``python repro.py``. The "other machine" runs with a
different ``OMP_NUM_THREADS``, so the environment report has something to say; the replay still
matches, because it applies the recorded intra-op thread count: the model's call bit for bit, and the
Eq. 1 call inside it too (a bundle keeps the results of the steps inside its step).

Run it:   python examples/share_bundle.py [--out runs/share_bundle]

The code the steps ran (this file's ``normalise`` and ``Classifier``) is found again in the fresh
process through this script's recorded path, loaded without its ``if __name__ == "__main__":``
block, so nothing trains there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import recorder
import replayer

ROOT = Path(__file__).resolve().parents[1]
FEATURES, HIDDEN, CLASSES, BATCH = 16, 32, 4, 32
BAD_AT = 4  # the iteration whose batch is corrupted


@recorder.paper_step("Eq. 1", description="unit-normalise each feature vector: x / ||x||_2")
def normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


@recorder.paper_step("Algorithm 1", algorithm="Algorithm 1", step=2,
                     description="classify the normalised features with a two-layer MLP")
class Classifier(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(normalise(x))))


def batch(it: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of features and labels; iteration BAD_AT's has every eighth row zeroed (a bad shard)."""
    g = torch.Generator().manual_seed(it)
    x = torch.randn(BATCH, FEATURES, generator=g)
    y = x[:, :CLASSES].argmax(dim=1)
    if it == BAD_AT:
        x[::8] = 0.0
    return x, y


def train(run_path: Path, iterations: int = 10) -> None:
    """Train in full mode until the loss is non-finite (a NaN guard, as a training script has)."""
    torch.manual_seed(0)
    model = Classifier(FEATURES, HIDDEN, CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(run_path, model=model, optimizer=opt, mode="full"):
        for it in range(iterations):
            x, y = batch(it)
            loss = F.cross_entropy(model(x), y)
            if not torch.isfinite(loss):
                print(f"iteration {it}: loss is {loss.item()} - training stopped")
                return
            loss.backward()
            opt.step()
            opt.zero_grad()
            print(f"iteration {it}: loss {loss.item():.3f}")


def export(run_path: Path, out: Path) -> replayer.BundleInfo:
    """Bundle the forward call in which the NaN was born (its origin, Eq. 1, is inside it)."""
    rec = replayer.open(run_path)
    origin = replayer.first_nonfinite(rec)
    if origin.step is None:
        raise SystemExit(f"nothing to share: {origin.cause}")
    print(f"\nNaN origin: {origin.cause}")
    main_step = rec.step(origin.step.parent) if origin.step.parent is not None else origin.step
    info = replayer.bundle(rec, main_step, out / "failure.pdbg", verify=True, script=True)
    print(f"bundle: {info.path} ({info.bytes} bytes, {info.steps} steps of the recording's {len(rec)}; "
          f"main step {main_step.index}: {main_step.name}), verified when made: {info.verified}")
    print(f"repro script: {info.script}")
    return info


def elsewhere_env(example_dir: Path) -> dict[str, str]:
    """The environment of "another machine": this repository and the example's directory importable,
    and a different OMP_NUM_THREADS from the recording's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(example_dir), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "2" if env.get("OMP_NUM_THREADS") == "1" else "1"
    return env


def run_elsewhere(info: replayer.BundleInfo) -> bool:
    """Copy the bundle and repro.py into an empty directory and replay there in fresh processes;
    True when every command exits 0 (pdbg replay and repro.py: a bitwise match)."""
    assert info.script is not None
    env = elsewhere_env(Path(__file__).resolve().parent)
    ok = True
    with tempfile.TemporaryDirectory(prefix="pdbg-elsewhere-") as where:
        shutil.copy(info.path, Path(where) / "failure.pdbg")
        shutil.copy(info.script, Path(where) / "repro.py")
        print(f"\nin a fresh process, in an empty directory, with OMP_NUM_THREADS={env['OMP_NUM_THREADS']}:")
        for shown, argv in (("pdbg info failure.pdbg", ["-m", "tui.cli", "info", "failure.pdbg"]),
                            ("pdbg replay failure.pdbg", ["-m", "tui.cli", "replay", "failure.pdbg"]),
                            ("python repro.py", ["repro.py"])):
            proc = subprocess.run([sys.executable, *argv], cwd=where, env=env, capture_output=True, text=True,
                                  timeout=120, check=False)
            print(f"\n$ {shown}")
            print(proc.stdout.rstrip())
            if proc.stderr.strip():
                print(proc.stderr.rstrip())
            print(f"(exit code {proc.returncode})")
            ok = ok and proc.returncode == 0
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/share_bundle"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    run_path = args.out / "run.zarr"
    train(run_path)
    info = export(run_path, args.out)
    return 0 if run_elsewhere(info) and info.verified else 1


if __name__ == "__main__":
    sys.exit(main())
