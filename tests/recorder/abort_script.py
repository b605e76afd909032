"""Script of test_hard_crash, run under `pdbg record --mode flight`: a small deterministic model.

    abort_script.py ITERATIONS [--die-at K [--how abort|kill] [--no-flush]] [--flush-at J] [--nan-at N] [--forever]
                    [--maps]

Trains ``build()`` with SGD on ``input_for(i)``, one optimizer step per iteration. ``--die-at K``:
after the backward pass of iteration K, commit what the recording holds (``recorder.flush()``: steps
of the last second are otherwise committed by the next periodic commit, which a hard crash never
sees), then die hard before the optimizer steps: ``os.abort()`` (SIGABRT, as native code does) or
SIGKILL (as the OOM killer does); ``--no-flush``: without that commit. ``--flush-at J``: commit after
the backward pass of iteration J. ``--nan-at N``: a NaN in the input of iteration N, whose gradients
are dropped before the optimizer steps (the flight ring is written out there). ``--forever``: train until killed,
printing "iteration I" after each. ``--maps``: print the mapping of the flight ring's shared memory
("ring: ...", from /proc/self/maps).

The test imports this file for ``build``, ``input_for`` and ``LR`` (recomputing what was recorded),
so importing it must have no side effects.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.nn as nn

LR = 0.05


def build() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def input_for(iteration: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 12).reshape(3, 4) * (1 + iteration / 50) + iteration / 100


def ring_mapping() -> str:
    with open("/proc/self/maps") as maps:
        found = [line.split(None, 5)[-1].strip() for line in maps if "pdbg-" in line]
    return found[0] if found else "none"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("iterations", type=int)
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--how", choices=("abort", "kill"), default="abort")
    parser.add_argument("--no-flush", action="store_true")
    parser.add_argument("--flush-at", type=int)
    parser.add_argument("--nan-at", type=int)
    parser.add_argument("--forever", action="store_true")
    parser.add_argument("--maps", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.maps:
        print(f"ring: {ring_mapping()}", flush=True)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    i = 0
    while args.forever or i < args.iterations:
        x = input_for(i)
        if i == args.nan_at:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        loss.backward()
        if i == args.flush_at or (i == args.die_at and not args.no_flush):
            import recorder

            assert recorder.flush(), "the recording did not commit"
        if i == args.die_at:
            if args.how == "abort":
                os.abort()
            os.kill(os.getpid(), signal.SIGKILL)
        if i == args.nan_at:
            opt.zero_grad()  # its update skipped: the step below changes nothing, and still ends the iteration
        opt.step()
        opt.zero_grad()
        if args.forever:
            print(f"iteration {i}", flush=True)
        i += 1


if __name__ == "__main__":
    main(sys.argv[1:])
