"""A two-rank training script (gloo, CPU) whose ranks are coupled inside a paper step.

Launched once per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
``global_mean`` all-reduces inside the step, so a NaN born on one rank reaches the other through
the collective. Environment knobs:
  NAN_RANK, NAN_AT   on that rank, at that iteration, ``sharpen`` divides by zero (the origin)
  BLOW_RANK, BLOW_AT on that rank, at that iteration, ``global_mean`` makes its sum 0/0 before
                     all-reducing it (the origin, whose NaN every rank's all_reduce returns)
  POISON_RANK, POISON_AT on that rank, at that iteration, code outside every step puts a NaN into
                     ``global_mean``'s input (which it then sends to the other rank)
  RAISE_RANK, RAISE_AT that rank raises RuntimeError at the start of that iteration
  KILL_RANK, KILL_AT that rank SIGKILLs itself at the start of that iteration (after a commit)
  COUPLED            iterations from 0 that communicate (later ones use the local mean)
  BACKWARD_SYNC      1: ``global_mean``'s backward all-reduces its gradient too (as SyncBatchNorm's does)
  DDP                1: train the model wrapped in DistributedDataParallel (which all-reduces the
                     gradients in its own hooks, outside every step)
  RECORD_TO          record in code with recorder.record (else: run as is, e.g. under pdbg record)
"""

from __future__ import annotations

import contextlib
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

import recorder

ITERATIONS = int(os.environ.get("ITERATIONS", "6"))
COUPLED = int(os.environ.get("COUPLED", str(ITERATIONS)))
NAN_RANK, NAN_AT = int(os.environ.get("NAN_RANK", "-1")), int(os.environ.get("NAN_AT", "-1"))
KILL_RANK, KILL_AT = int(os.environ.get("KILL_RANK", "-1")), int(os.environ.get("KILL_AT", "-1"))
RAISE_RANK, RAISE_AT = int(os.environ.get("RAISE_RANK", "-1")), int(os.environ.get("RAISE_AT", "-1"))
BLOW_RANK, BLOW_AT = int(os.environ.get("BLOW_RANK", "-1")), int(os.environ.get("BLOW_AT", "-1"))
POISON_RANK, POISON_AT = int(os.environ.get("POISON_RANK", "-1")), int(os.environ.get("POISON_AT", "-1"))
BACKWARD_SYNC = os.environ.get("BACKWARD_SYNC") == "1"


class SummedGrad(torch.autograd.Function):
    """The identity, whose backward sums the gradient over the ranks."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        dist.all_reduce(g)
        return g


@recorder.paper_step("Eq. 2", description="sharpen(h, t) = h / t")
def sharpen(h: torch.Tensor, t: float) -> torch.Tensor:
    return h / t


@recorder.paper_step("Eq. 3", description="mean over the global batch (all ranks)")
def global_mean(h: torch.Tensor, coupled: bool, scale: float = 1.0, backward_sync: bool = False) -> torch.Tensor:
    total = h.sum(0, keepdim=True) * scale / scale
    if backward_sync:
        total = SummedGrad.apply(total)
    count = torch.tensor([float(h.shape[0])])
    if coupled:
        dist.all_reduce(total)
        work = dist.all_reduce(count, async_op=True)
        work.wait()
    return total / count


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, t: float, coupled: bool, scale: float = 1.0,
                poison: bool = False) -> torch.Tensor:
        h = sharpen(torch.tanh(self.fc1(x)), t)
        if poison:  # outside every step
            h = h.clone()
            h[0, 0] = float("nan")
        return self.fc2(h - global_mean(h, coupled, scale, BACKWARD_SYNC))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    for p in model.parameters():
        dist.broadcast(p.data, 0)  # outside every step: not recorded
    if os.environ.get("DDP") == "1":
        model = nn.parallel.DistributedDataParallel(model)  # type: ignore[assignment]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(100 + rank)
    target = os.environ.get("RECORD_TO")
    run = recorder.record(target, model=model, optimizer=opt) if target else None
    with run if run is not None else contextlib.nullcontext():
        for it in range(ITERATIONS):
            if rank == KILL_RANK and it == KILL_AT:
                assert run is not None
                run.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == RAISE_RANK and it == RAISE_AT:
                raise RuntimeError(f"rank {rank} gave up at iteration {it}")
            x = torch.randn(16, 8, generator=data)
            t = 0.0 if (rank == NAN_RANK and it == NAN_AT) else 1.0
            scale = 0.0 if (rank == BLOW_RANK and it == BLOW_AT) else 1.0
            loss = model(x, t, it < COUPLED, scale, rank == POISON_RANK and it == POISON_AT).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"rank {rank} iteration {it} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
