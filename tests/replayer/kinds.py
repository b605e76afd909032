"""Step kinds for replay coverage tests (importable, so replay finds them by reference)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from typing import Any

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


def logged(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A user's decorator, with functools.wraps: paper_step sees a plain function, not the generator or
    coroutine function it calls."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    return wrapper


@recorder.paper_step("Algorithm 3", description="iterative refinement, yielding every state")
@logged
def refine(x: torch.Tensor, w: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    for _ in range(steps):
        x = x - 0.1 * torch.tanh(x @ w)
        yield x


@recorder.paper_step("Eq. 11", description="per-chunk features, lazily")
def chunks(x: torch.Tensor) -> Iterator[torch.Tensor]:
    return (c.tanh() for c in x.chunk(2, -1))


@recorder.paper_step("Eq. 12", description="fetch-and-transform, awaited")
@logged
async def transform(x: torch.Tensor) -> torch.Tensor:
    await asyncio.sleep(0)
    return torch.tanh(x) * 2


@recorder.paper_step("Algorithm 4", description="a sampler module yielding each refinement")
class Refiner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @logged
    def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        for _ in range(2):
            x = x - 0.1 * torch.tanh(self.fc(x))
            yield x


def twice_nowraps(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A user's decorator without functools.wraps: its wrapper is named twice_nowraps.<locals>.wrapper."""
    def wrapper(h: torch.Tensor) -> torch.Tensor:
        return fn(h * 2)
    return wrapper


@twice_nowraps
@recorder.paper_step("Eq. 4", description="unit-normalise (decorator without wraps, outside)")
def unit_outside(h: torch.Tensor) -> torch.Tensor:
    return h / h.norm(dim=-1, keepdim=True)


@recorder.paper_step("Eq. 4", description="unit-normalise (decorator without wraps, inside)")
@twice_nowraps
def unit_inside(h: torch.Tensor) -> torch.Tensor:
    return h / h.norm(dim=-1, keepdim=True)


unit_lambda = recorder.paper_step("Eq. 4", name="unit_lambda")(lambda h: h / h.norm(dim=-1, keepdim=True))


@recorder.paper_step("Algorithm 4", description="encode a parse tree bottom-up, the module calling itself")
class TreeEncoder(nn.Module):
    """A Tree-LSTM-like encoder: a leaf is an embedding, a pair the mix of its two subtrees' codes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.mix = nn.Linear(8, 4)

    def forward(self, tree: Any) -> torch.Tensor:
        if isinstance(tree, int):
            return self.emb.weight[tree]
        return torch.tanh(self.mix(torch.cat([self(tree[0]), self(tree[1])])))
