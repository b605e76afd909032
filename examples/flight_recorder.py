"""The flight recorder: a long run that dies late, and the last iterations are there to debug.

A small classifier trains for 200 iterations under ``recorder.record(..., mode="flight", keep=3)``:
the statistics of every step go to disk as usual, while the bytes of the tensors of the last three
iterations wait in memory. Late in the run (at 90% of it: iteration 180 of 200) a corrupted batch
arrives, with some feature rows all zeros. The paper's Eq. 1 normalises each row by its L2 norm, 0/0
is NaN, and with ``on_anomaly="stop"`` the recorder raises ``NonFiniteError`` out of that step, which
ends the training. Before raising, it writes out the ring: the bytes of iterations 178, 179 and 180.

Run it:   python examples/flight_recorder.py [--out runs/flight_recorder.zarr] [--iterations 200]

Then it reads the recording back and shows that every iteration has statistics but only the last
three have payloads, names the step that produced the NaN (``replayer.first_nonfinite``), and
replays that step, and the backward pass of the iteration before it, bit for bit from the recording.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import recorder
import replayer

FEATURES, HIDDEN, CLASSES, BATCH = 16, 32, 4, 32
KEEP = 3  # iterations whose payloads the flight ring holds


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


def batch(it: int, corrupted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of features and labels; a corrupted one has every eighth row zeroed (a bad shard)."""
    g = torch.Generator().manual_seed(it)
    x = torch.randn(BATCH, FEATURES, generator=g)
    y = x[:, :CLASSES].argmax(dim=1)
    if corrupted:
        x[::8] = 0.0
    return x, y


def train(out: Path, iterations: int, bad_at: int) -> int | None:
    """Train under the flight recorder; returns the iteration the run died in, if it died."""
    torch.manual_seed(0)
    model = Classifier(FEATURES, HIDDEN, CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    it = 0
    try:
        with recorder.record(out, model=model, optimizer=opt, mode="flight", keep=KEEP, on_anomaly="stop"):
            for it in range(iterations):
                x, y = batch(it, corrupted=it == bad_at)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                if it % 40 == 0:
                    print(f"iteration {it}: loss {loss.item():.3f}")
    except recorder.NonFiniteError as exc:  # the recording is closed (as crashed) by the time we get here
        print(f"iteration {it}: training died: {type(exc).__name__}: {exc}")
        return it
    return None


def payload_iterations(rec: replayer.Recording) -> tuple[list[int], list[int]]:
    """(iterations with recorded steps, iterations whose steps kept the bytes of their tensors)."""
    recorded: set[int] = set()
    with_bytes: set[int] = set()
    for step in rec.steps:
        recorded.add(step.iteration)
        if any(r.has_payload for r in step.records):
            with_bytes.add(step.iteration)
    return sorted(recorded), sorted(with_bytes)


def show(out: Path) -> None:
    """What the flight recorder left: statistics everywhere, payloads at the end, the NaN's origin."""
    rec = replayer.open(out)
    recorded, with_bytes = payload_iterations(rec)
    print(f"\nrecording: {out} ({rec.status}), {len(rec.steps)} steps")
    print(f"statistics: {len(recorded)} iterations ({recorded[0]}-{recorded[-1]})")
    print(f"payloads:   iterations {with_bytes}")
    flight = rec.reader.attrs.get("final", {}).get("flight", {})
    for dump in flight.get("dumps", []):
        print(f"ring written on {dump['reason']}: iterations {dump['iterations']}, {dump['bytes']} bytes")
    early = rec.step(f"Algorithm 1@iter={recorded[len(recorded) // 2]}")
    out_stats = early.tensors("output")[0].stats
    print(f"e.g. step {early.index} (iteration {early.iteration}): output mean {out_stats['mean']:.4f}, "
          f"std {out_stats['std']:.4f}, bytes kept: {early.tensors('output')[0].has_payload}")

    origin = replayer.first_nonfinite(rec)
    print(f"\nNaN origin: {origin.cause}")
    if origin.step is None:
        return
    for step, what in ((origin.step, "the step that made the NaN"),
                       (rec.step(f"Algorithm 1@iter={origin.step.iteration - 1}:backward"), "the iteration before")):
        result = replayer.replay(rec, step)
        verdict = "bitwise match" if result.match else "MISMATCH"
        names = ", ".join(d.name for d in result.outputs)
        print(f"replay of step {step.index} ({step.name} {step.phase}, iteration {step.iteration}; {what}): "
              f"{verdict} ({names})")
        for warning in result.warnings:
            print(f"  note: {warning}")
    print(f"\nthe same from the command line: pdbg bisect {out}; pdbg replay {out} {origin.step.index}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/flight_recorder.zarr"))
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    if args.iterations < 2 * KEEP:
        parser.error(f"--iterations must be at least {2 * KEEP}")
    shutil.rmtree(args.out, ignore_errors=True)
    died_at = train(args.out, args.iterations, bad_at=args.iterations * 9 // 10)
    show(args.out)
    return 0 if died_at is not None else 1


if __name__ == "__main__":
    sys.exit(main())
