"""Step kinds for replay coverage tests (importable, so replay finds them by reference)."""

from __future__ import annotations

import torch
import torch.nn as nn

import recorder


@recorder.paper_step("Eq. 5", description="returns a tuple with a non-tensor and takes keyword tensors")
def split_scale(x: torch.Tensor, *, scale: torch.Tensor, k: int = 2) -> tuple[torch.Tensor, int, torch.Tensor]:
    return x[:, :k] * scale, k, x.t() @ x


@recorder.paper_step("Eq. 7", description="spectral product, returning lazy conjugate and negation views")
def spectral(z: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    product = z * w
    return product.conj(), product.conj().imag


@recorder.paper_step("Eq. 6", description="refuses negative input")
def checked(x: torch.Tensor) -> torch.Tensor:
    if (x < 0).any():
        raise ValueError("negative input")
    return x.sqrt()


@recorder.paper_step("Eq. 8", description="adds noise drawn from the generator it is given")
def noised(x: torch.Tensor, generator: torch.Generator, sigma: float = 0.1) -> torch.Tensor:
    return x + sigma * torch.randn(x.shape, generator=generator)


class Keyworded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("offset", torch.arange(4.0))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x) + self.offset
        return y if mask is None else y * mask


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kw = Keyworded()
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.kw(x, mask=torch.ones(4)))
