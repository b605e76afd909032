"""An ordinary training script with no PaperDebugger in it: plain PyTorch, to be recorded unedited.

Run it:     python examples/zero_edit/train.py 5 [--lr 0.01] [--seed 0]
Record it:  pdbg record -o run.zarr --modules 'blocks.*' -- examples/zero_edit/train.py 5

A small residual MLP (an input layer, three blocks, a head) learns to classify points by the
quadrant they fall in, on mini-batches drawn from a fixed generator; it prints the loss of every
iteration. See README.md next to it for what recording it gives.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURES, WIDTH, DEPTH, CLASSES, BATCH = 2, 32, 3, 4, 64


class Block(nn.Module):
    """Pre-norm residual MLP block."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Net(nn.Module):
    def __init__(self, d: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Points in the plane, labelled by quadrant (0..3)."""
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, (x[:, 0] > 0).long() * 2 + (x[:, 1] > 0).long()


def train(iterations: int, lr: float, seed: int) -> list[float]:
    """The training loop; prints and returns the loss of every iteration."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for i in range(iterations):
        x, y = batch(g)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"iteration {i}: loss {loss.item():.6f}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description="train a small residual MLP")
    parser.add_argument("iterations", type=int, help="how many optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    losses = train(args.iterations, args.lr, args.seed)
    if losses:
        print(f"final loss {losses[-1]:.6f}")


if __name__ == "__main__":
    main()
