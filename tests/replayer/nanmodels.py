"""Small models whose NaNs are born in known places (importable, so replay finds them)."""

from __future__ import annotations

import torch
import torch.nn as nn

import recorder


@recorder.paper_step("Eq. 2", description="SmoothReLU(x) = log(1 + exp(x + beta)) / gamma")
def smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    return torch.log1p(torch.exp(x + beta)) / gamma


@recorder.paper_step("Eq. 3", description="scaled block")
class Scaled(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return smooth_relu(self.fc(x) * scale)


@recorder.paper_step("Eq. 4", description="root of the energy")
def root_energy(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(x * x)


def stable_smooth_relu(x: torch.Tensor, beta: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    """The same function, computed without overflow (softplus switches to x for large x)."""
    return torch.nn.functional.softplus(x + beta) / gamma


class StableScaled(nn.Module):
    """Scaled with the stable function and a different parameter layout (``proj`` instead of ``fc``,
    plus a ``gain`` the original lacks)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return stable_smooth_relu(self.proj(x) * scale) * self.gain


class StableFc(nn.Module):
    """Same parameter names as Scaled (``fc``), stable function."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return stable_smooth_relu(self.fc(x) * scale)


@recorder.paper_step("Model", description="two scaled blocks")
class Stack(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.first, self.second = Scaled(d), Scaled(d)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.second(self.first(x, scale), 1.0)


def record_scales(path: object, model: nn.Module, scales: tuple[float, ...]) -> None:
    """Record ``model(x, scale)`` forward and backward once per scale, one iteration each; the
    inputs come from torch's global generator (seed it before building the model)."""
    with recorder.record(path, model=model) as run:
        for scale in scales:
            model(torch.randn(3, 4), scale).sum().backward()
            run.next_iteration()
