"""Small recordings for the TUI tests: a NaN, an exception, broken watches, a second run."""

from __future__ import annotations

from pathlib import Path

import torch

import recorder
from tests.replayer import nanmodels


@recorder.paper_step("Eq. 9", description="a step that gives up on negative input")
def picky(x: torch.Tensor) -> torch.Tensor:
    if (x < 0).all():
        raise ValueError("all negative")
    return x.abs()


@recorder.paper_step("Eq. 7", algorithm="Algorithm 1", step=5, description="gated scores")
def gated(x: torch.Tensor) -> torch.Tensor:
    y = torch.sigmoid(x) * 2
    recorder.watch(y, "gate", expected_range=(0.0, 1.0), reference="Eq. 7")
    return y


def nan_run(path: Path, scales: tuple[float, ...] = (1.0, 1000.0)) -> Path:
    """Two Scaled blocks; in the second iteration exp overflows in the first block's SmoothReLU."""
    torch.manual_seed(0)
    nanmodels.record_scales(path, nanmodels.Stack(4), scales)
    return path


def mixed_run(path: Path) -> Path:
    """An exception, a broken watch and ordinary steps."""
    with recorder.record(path) as run:
        for i in range(3):
            gated(torch.randn(4))
            try:
                picky(-torch.ones(2) if i == 1 else torch.ones(2))
            except ValueError:
                pass
            run.next_iteration()
    return path
