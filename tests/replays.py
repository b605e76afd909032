"""Checks that replays of recorded calls give their recorded results, shared by the tests of what a step
draws from (generators in arguments, defaults, module-level places)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

import replayer


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def assert_each_call_replays_alone(path: Path, names: Iterable[str], iterations: Iterable[int] = (2, 0, 1)) -> None:
    """Replay each call of each named step alone, out of recording order (the iterations as given, the steps
    backwards): each matches, its output bit for bit. A replay that drew from a generator as loading left
    it, not as the call found it, matches only in recording order, if at all."""
    names = list(names)
    with replayer.open(path) as rec:
        for it in iterations:
            for name in reversed(names):
                step = rec.step(f"{name}@iter={it}")
                res = replayer.replay(rec, step.index)
                assert res.match, (name, it, res.warnings)
                assert torch.equal(bits(res.values["output"]), bits(step.tensor("output"))), (name, it)
