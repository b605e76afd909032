"""What hashing the code of a module step's submodule classes (schema 1.17: the skeleton's
``submodule_code``) adds to a recording of a 48-block model (579 modules, 10 classes, 3 of them the
training code's own: this file's ``Attention``, ``MLP`` and ``Gate``).

A class's source is read and hashed once per recording process, when the first skeleton holding it is
built (a module's first recorded call); every skeleton built after looks the hashes up. A call whose
module's skeleton has not changed builds none: its cost per call is unchanged. Measured: the first
hashing of the three classes; the lookups of one skeleton; ``skeleton.build`` of one Block and of the
whole model, with and without the hashes (alternating, in one process); and the training thread's CPU
time of the first and later iterations of ``record(modules="blocks.*")``, with and without (each
recording in a new session, the hashes forgotten before each, alternating). CPU time of the training
thread, not wall time: a shared machine's load does not count.

Usage:
  python bench/submodule_code.py            # ~1 min on 2 cores
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import recorder  # noqa: E402
from recorder import skeleton  # noqa: E402

annotate = sys.modules["recorder.annotate"]  # (recorder.annotate is the function)


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = MLP(d)
        self.gate = Gate()
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.gate(x) * self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, n: int = 48) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n))
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


HASHING = annotate.submodule_code


def hashing(on: bool) -> None:
    annotate.submodule_code = HASHING if on else (lambda classes: {})


def median_us(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t)
    return statistics.median(times) / 1e3


def record(model: nn.Module, iterations: int) -> list[float]:
    annotate._CLASS_CODE.clear()
    x = torch.randn(2, 16, 64)
    times = []
    with tempfile.TemporaryDirectory() as where, \
            recorder.record(f"{where}/run.zarr", model=model, modules="blocks.*", mode="stats") as run:
        for _ in range(iterations):
            t = time.thread_time()
            model(x).sum().backward()
            run.next_iteration()
            times.append(time.thread_time() - t)
    return times


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    classes = dict.fromkeys(skeleton.own_class(m) for m in model.modules())
    print(f"model: {len(model.blocks)} blocks, {sum(1 for _ in model.modules())} modules, {len(classes)} classes")
    annotate._CLASS_CODE.clear()
    t = time.thread_time_ns()
    for cls in (Attention, MLP, Gate):
        annotate.class_code(cls)
    print(f"reading and hashing the 3 classes' sources (once per process): {(time.thread_time_ns() - t) / 1e6:.2f} ms")
    lookup = median_us(lambda: HASHING(classes), 2000)
    print(f"looking the hashes up for one skeleton ({len(classes)} classes): {lookup:.1f} µs")
    for label, module in (("one Block (12 modules)", model.blocks[0]), ("the whole model (579 modules)", model)):
        on: list[float] = []
        off: list[float] = []
        for _ in range(60):
            for flag, out in ((True, on), (False, off)):
                hashing(flag)
                out.append(median_us(lambda: skeleton.build(module), 1))  # noqa: B023
        hashing(True)
        print(f"skeleton.build of {label}: {statistics.median(on):.0f} µs with the hashes, "
              f"{statistics.median(off):.0f} µs without (medians of 60, alternating)")
    firsts: dict[bool, list[float]] = {True: [], False: []}
    laters: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(4):
        for flag in (False, True):
            hashing(flag)
            times = record(model, 20)
            firsts[flag].append(times[0])
            laters[flag].append(statistics.median(times[1:]))
    hashing(True)
    for flag in (False, True):
        print(f"record(modules='blocks.*'), {'with' if flag else 'without'} the hashes: training thread CPU, first "
              f"iteration {1e3 * statistics.median(firsts[flag]):.1f} ms, later ones "
              f"{1e3 * statistics.median(laters[flag]):.1f} ms (medians of 4 sessions)")


if __name__ == "__main__":
    main()
