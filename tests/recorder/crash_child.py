"""Child process of test_crash_safety: records a small model forever, until it is killed.

    python crash_child.py STORE SEED            record in an endless loop (the test SIGKILLs it)
    python crash_child.py --early DIR           fork recordings that SIGKILL themselves at chosen file
                                                writes while their store is set up (see early())

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
import threading
import time
from typing import Any

import torch

import recorder

ROWS = 8


def config(seed: int) -> dict[str, int]:
    """Workload of one child, derived from its seed: layer width and probe steps per iteration."""
    rng = random.Random(seed)
    return {"width": rng.choice([16, 128, 256]), "probes": rng.choice([0, 3, 12]),
            "chunk_div": rng.choice([1, 512])}


def train_with_a_nan(step: Any, out: str, iterations: int, nan_at: int, *, after: Any = None,
                     **options: Any) -> None:
    """``Linear(4, 4)`` then the paper ``step``, SGD, seed 0, recorded into ``out`` with ``options``: iteration
    ``nan_at`` gets a NaN in its input (the children that die at a chosen point of a recording's life use it);
    ``after(i)``, if given, is called at the end of each iteration ``i``, the recording still open."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with recorder.record(out, model=model, optimizer=opt, **options):
        for i in range(iterations):
            x = torch.randn(2, 4)
            if i == nan_at:
                x[0, 0] = float("nan")
            step(model(x)).sum().backward()
            opt.step()
            opt.zero_grad()
            if after is not None:
                after(i)


def shrink_chunks(div: int) -> None:
    """Divide the rows per chunk of every array by ``div``, so that a short run seals many chunks
    and grows every array several times (the layout's chunks are sized for long runs)."""
    if div == 1:
        return
    import dataclasses

    from recorder.store import layout

    columns = layout.columns
    layout.columns = lambda: [dataclasses.replace(c, chunk_rows=max(1, c.chunk_rows // div))
                              for c in columns()]


def input_for(iteration: int, width: int) -> torch.Tensor:
    """The model input of an iteration: in [1, 3), never zero, different for 1000 iterations in a row
    (bounded, so that training never diverges however long a child runs)."""
    pattern = torch.arange(ROWS * width, dtype=torch.float32).reshape(ROWS, width) / (ROWS * width)
    return torch.full((ROWS, width), 1.0 + (iteration % 1000) / 1000) + pattern


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


def start_recording(path: str, seed: int) -> tuple[Any, Net, torch.optim.Optimizer]:
    """Build child ``seed``'s model and start its recording (commits every 50 ms)."""
    model, opt = build(seed)
    shrink_chunks(config(seed)["chunk_div"])
    run = recorder.record(path, model=model, optimizer=opt, mode="full", flush_interval=0.05)
    return run, model, opt


def record_forever(path: str, seed: int) -> None:
    run, model, opt = start_recording(path, seed)
    with run:
        iteration = 0
        while True:
            train_iteration(model, opt, iteration, config(seed)["probes"])
            iteration += 1


def _count_writes(kill_at: int | None) -> list[int]:
    """Count write events in this process: the start and the end of every file write, zarr's and the
    recorder's, in the order they happen (zarr writes from several threads at once, so under a lock).
    With ``kill_at``, the process SIGKILLs itself at that event. Returns the live counter."""
    import zarr.storage._local as zlocal

    from recorder.store import backend

    lock = threading.Lock()
    events = [0]

    def event() -> None:
        with lock:
            if events[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            events[0] += 1

    def counted(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            event()
            out = fn(*args, **kwargs)
            event()
            return out
        return wrapper

    zlocal._put = counted(zlocal._put)
    backend.put = counted(backend.put)
    return events


def _fork(child: Any) -> int:
    """Run ``child()`` in a forked process; returns its pid. The child never returns."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(3)
    return pid


def _wait(pid: int, timeout: float) -> str:
    """Wait for a forked child: "SIGKILL", "exit N", or "hang" (killed here after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return signal.Signals(os.WTERMSIG(status)).name
            return f"exit {os.WEXITSTATUS(status)}"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang"
        time.sleep(0.002)


def setup_events(root: str) -> int:
    """Write events from the start of a recording up to its first commit (the first manifest)."""
    read, write = os.pipe()

    def child() -> None:
        os.close(read)
        events = _count_writes(None)
        run, _, _ = start_recording(os.path.join(root, "count"), 0)
        run.pipeline.ready.wait(30)  # the writer thread lays out the store; no step yet, so no commit follows
        os.write(write, str(events[0]).encode())
        os._exit(0)

    pid = _fork(child)
    os.close(write)
    with os.fdopen(read) as fh:
        text = fh.read()
    outcome = _wait(pid, 60.0)
    if outcome != "exit 0" or not text:
        raise RuntimeError(f"counting the setup's writes failed: {outcome}")
    return int(text)


def early(root: str) -> None:
    """Kill recordings at write events of their setup: the first 12, every 9th, the last 10 and the
    first 4 after the first commit (each in its own forked process, store ``root/kill-N``).
    Prints "setup S" (the setup's write events), then "N OUTCOME" per kill point."""
    import torch._dynamo  # noqa: F401  (torch.optim imports it on first use: a second, paid once)
    import zarr.storage._local  # noqa: F401  (imported once here, not in every fork)

    import recorder.run  # noqa: F401

    total = setup_events(root)
    print("setup", total, flush=True)
    points = sorted(set(range(12)) | set(range(0, total, 9)) | set(range(total - 10, total + 4)))
    for n in points:
        def child(n: int = n) -> None:
            _count_writes(n)
            record_forever(os.path.join(root, f"kill-{n}"), 0)

        print(n, _wait(_fork(child), 30.0), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--early":
        early(sys.argv[2])
    else:
        record_forever(sys.argv[1], int(sys.argv[2]))
