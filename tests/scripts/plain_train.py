"""An ordinary training script: no PaperDebugger import, no decorators, a plain loop with an optimizer.

    python plain_train.py ITERATIONS [--fail-at K] [--exit CODE] [--save PATH]

Prints the loss of every iteration. ``--fail-at K`` raises inside the second block's forward at
iteration K; ``--exit CODE`` ends with sys.exit(CODE); ``--save PATH`` writes the final parameters.
"""

import argparse

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)
        self.fail_at: int | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at + 1:
            raise FloatingPointError(f"block gave up at call {self.calls}")
        return x + self.drop(torch.tanh(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("iterations", type=int)
    parser.add_argument("--fail-at", type=int)
    parser.add_argument("--exit", type=int)
    parser.add_argument("--save")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net()
    model.blocks[1].fail_at = args.fail_at
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(32, 4)
    target = data.sum(dim=1, keepdim=True)
    for i in range(args.iterations):
        loss = nn.functional.mse_loss(model(data), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"iteration {i} loss {loss.item():.8f}")
    if args.save:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.save)
    if args.exit is not None:
        raise SystemExit(args.exit)


if __name__ == "__main__":
    main()
