"""Child process of test_crash_safety: records a small model forever, until it is killed.

    python crash_child.py STORE SEED            record in an endless loop (the test SIGKILLs it)
    python crash_child.py --early DIR N1 N2...  for each N: fork, start a recording in DIR/kill-N and
                                                SIGKILL itself at its N-th file write (store setup)

Every tensor it records is known to the test without running this process: the input of iteration
``i`` is ``input_for(i, width)``, the probe steps scale slices of it by known factors, and the
parameters of iteration 0 are those of ``build(seed)``. The test imports this file for these
definitions, so keep its import free of side effects.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from typing import Any

import torch

import recorder

ROWS = 8


def config(seed: int) -> dict[str, int]:
    """Workload of one child, derived from its seed: layer width and probe steps per iteration."""
    rng = random.Random(seed)
    return {"width": rng.choice([16, 128, 256]), "probes": rng.choice([0, 3, 12])}


def input_for(iteration: int, width: int) -> torch.Tensor:
    """The model input of an iteration: never zero anywhere, different for every iteration."""
    pattern = torch.arange(ROWS * width, dtype=torch.float32).reshape(ROWS, width) / (ROWS * width)
    return torch.full((ROWS, width), float(iteration + 1)) + pattern


def probe_factor(call: int) -> float:
    return float(call + 2)


@recorder.paper_step("Eq. 1", description="affine map")
class Affine(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@recorder.paper_step("Eq. 2", description="softplus")
def smooth(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    return torch.nn.functional.softplus(x, beta=beta)


@recorder.paper_step("Algorithm 1", algorithm=1, step=3, description="probe a slice")
def probe(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = Affine(width)
        self.b = Affine(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(smooth(self.a(x)))


def build(seed: int) -> tuple[Net, torch.optim.Optimizer]:
    """The model and optimizer of a child, initialised from its seed."""
    torch.manual_seed(seed)
    model = Net(config(seed)["width"])
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def train_iteration(model: Net, opt: torch.optim.Optimizer, iteration: int, probes: int) -> None:
    x = input_for(iteration, model.a.lin.in_features)
    for call in range(probes):
        probe(x[:, call:call + 4], probe_factor(call))  # a non-contiguous slice, forward only
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def record_forever(path: str, seed: int) -> None:
    model, opt = build(seed)
    probes = config(seed)["probes"]
    with recorder.record(path, model=model, optimizer=opt, mode="full", flush_interval=0.05):
        iteration = 0
        while True:
            train_iteration(model, opt, iteration, probes)
            iteration += 1


def _kill_at_write(n: int) -> None:
    """Make this process SIGKILL itself at its n-th file write (zarr's or the recorder's), before
    the write (even n) or after it (odd n); counted across both write paths."""
    import zarr.storage._local as zlocal

    from recorder.store import backend

    count = [0]

    def tick(when: int) -> None:
        if count[0] * 2 + when == n:
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tick(0)
            out = fn(*args, **kwargs)
            tick(1)
            count[0] += 1
            return out
        return wrapper

    zlocal._put = counted(zlocal._put)
    backend.put = counted(backend.put)


def early(root: str, points: list[int]) -> None:
    """Fork one recording per kill point; each child dies by SIGKILL while the store is being set up
    (or, past the setup's writes, while recording). Prints "N SIGNAL" for each."""
    import torch._dynamo  # noqa: F401  (torch.optim imports it on first use: a second, paid once)
    import zarr.storage._local  # noqa: F401  (imported once here, not in every fork)

    import recorder.run  # noqa: F401
    for n in points:
        pid = os.fork()
        if pid == 0:  # the child never returns: it is killed, or exits 3 if no kill point was hit
            try:
                _kill_at_write(n)
                record_forever(os.path.join(root, f"kill-{n}"), 0)
            finally:
                os._exit(3)
        deadline = time.monotonic() + 30.0
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:  # the kill point was never reached: report it as a hang
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = None
                break
            time.sleep(0.002)
        if status is None:
            print(n, "hang", flush=True)
        else:
            print(n, os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--early":
        early(sys.argv[2], [int(a) for a in sys.argv[3:]])
    else:
        record_forever(sys.argv[1], int(sys.argv[2]))
