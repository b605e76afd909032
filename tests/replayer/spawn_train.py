"""A script whose training runs in a child process that multiprocessing's spawn started, as
``torch.multiprocessing.spawn`` starts each rank: there the script is imported again as
``__mp_main__``, so its paper steps and modules are recorded under that module name.
Usage: spawn_train.py OUT."""

from __future__ import annotations

import multiprocessing
import sys

import torch
import torch.nn as nn

import recorder


@recorder.paper_step("Eq. 1", description="scaled tanh")
def act(h: torch.Tensor, s: float) -> torch.Tensor:
    return torch.tanh(h) * s


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act(self.fc(x), 2.0)


def work(out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with recorder.record(out, model=model, optimizer=opt, modules=["0"]):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()


if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=work, args=(sys.argv[1],))
    child.start()
    child.join()
    sys.exit(child.exitcode)
