"""What recording costs per paper step, apart from the bytes: the fixed cost of one step call.

A model of many tiny paper steps (``nn.Linear(8, 8)`` and ``tanh``, batch 4) does almost no
arithmetic, so what a recording adds to it is the recorder's own work per step: the RNG and settings
snapshots, the argument documents, the taps for the backward, the statistics calls, the step and
tensor records, and the writer thread's share of the interpreter. Models with many small steps
(a paper's equations as functions, called per head or per token) pay it at every call.

Method: one model, one recording session per mode. Blocks of iterations alternate between the
session paused (``Run.pause()``: nothing recorded, the same model, the same memory) and resumed,
the order swapping every round; a resumed block ends with ``run.flush()``, so the writer's work for
its steps is inside its time. Per round: (recorded block - paused block) / steps recorded; the
median over rounds is shown with its quartiles. One step here is a forward call and its backward
(two recorded steps), with 8 tensor records: input, weight, bias, output; grad output, grad
input, weight grad, bias grad.

Usage:
  python bench/step_cost.py                 # stats, flight, full (~1 min)
  python bench/step_cost.py --write-docs    # also write its section of docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

# The checkout this script is in, before an installed copy: a checkout of another commit measures its own recorder.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from docs_section import paused_and_resumed, write_section  # noqa: E402 (bench/ is the script's directory)

import recorder  # noqa: E402

HEADING = "## Per-step cost"
MODES = ("stats", "flight", "full")
RECORDS_PER_STEP = 8


@recorder.paper_step("Eq. 1", description="a tiny layer: tanh(W x + b)")
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Chain(nn.Module):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = nn.ModuleList(Tiny() for _ in range(steps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


def measure(mode: str, steps: int, iterations: int, rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Chain(steps)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)

    def block() -> float:
        t0 = time.perf_counter()
        for _ in range(iterations):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        return time.perf_counter() - t0

    for _ in range(20):  # warm up unrecorded
        block()
    with tempfile.TemporaryDirectory(prefix="pdbg-stepcost-") as tmp:
        run = recorder.record(str(Path(tmp) / "run.zarr"), model=model, optimizer=opt, mode=mode)

        def timed(recorded: bool) -> float:
            t0 = time.perf_counter()
            block()
            if recorded:
                run.flush()
            return time.perf_counter() - t0

        try:
            for _ in range(2):  # the session's first iterations: fresh buffers, first commits
                timed(True)
            paused, recorded = paused_and_resumed(run, rounds, timed)
        finally:
            run.close()
        if run.status != "complete":
            raise SystemExit(f"the {mode} session ended {run.status}: {run.failure}")
    n = steps * iterations
    per_step = [(on - off) / n for on, off in zip(recorded, paused, strict=True)]
    q1, _, q3 = statistics.quantiles(per_step, n=4, method="inclusive")
    return {"mode": mode, "per_step": statistics.median(per_step), "q": (q1, q3),
            "model_per_step": statistics.median(paused) / n}


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| mode | recording adds per step (fwd + bwd), µs: median (p25–p75) | per tensor record, µs | "
            "the model's own step, µs |", "|---|---:|---:|---:|"]
    for r in results:
        us = r["per_step"] * 1e6
        rows.append(f"| {r['mode']} | {us:.0f} ({r['q'][0] * 1e6:.0f}–{r['q'][1] * 1e6:.0f}) | "
                    f"{us / RECORDS_PER_STEP:.0f} | {r['model_per_step'] * 1e6:.0f} |")
    return "\n".join(rows)


def write_docs(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""{HEADING}

Measured on {now} by `python bench/step_cost.py --write-docs`: what recording adds to one call of a
paper step whose own arithmetic is negligible, i.e. the recorder's fixed cost per step.

A chain of {args.steps} `nn.Module` paper steps (`tanh(Linear(8, 8)(x))`, batch 4), SGD, torch on 1
thread. One session per mode; blocks of {args.iterations} iterations alternate between the session
paused and resumed ({args.rounds} rounds, the order swapping each round; a resumed block ends with
`run.flush()`, so the writer's work is inside it). Per round: (recorded block − paused block) /
steps; median and quartiles over rounds. A step is a forward call and its backward (two recorded
steps) with {RECORDS_PER_STEP} tensor records.

{table(results)}

Machine: {os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__} on {torch.get_num_threads()} thread(s),
Python {platform.python_version()}; statistics kernel {"on (numba)" if recorder.stats.prepare() else "off"}.
"""
    write_section(HEADING, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=16, help="paper steps in the chain (default 16)")
    parser.add_argument("--iterations", type=int, default=10, help="iterations per block (default 10)")
    parser.add_argument("--rounds", type=int, default=16, help="paired blocks per mode (default 16)")
    parser.add_argument("--write-docs", action="store_true", help="write its section of docs/PERFORMANCE.md")
    parser.add_argument("--no-kernel", action="store_true",
                        help="statistics through torch's reductions, not the numba kernel (to compare)")
    args = parser.parse_args()
    kernel = recorder.stats.use_kernel(not args.no_kernel)
    print(f"statistics kernel {'on (numba)' if kernel else 'off'}", flush=True)
    torch.set_num_threads(1)
    results = []
    for mode in args.modes:
        r = measure(mode, args.steps, args.iterations, args.rounds)
        print(f"{mode}: {r['per_step'] * 1e6:.0f} us per step ({r['q'][0] * 1e6:.0f}-{r['q'][1] * 1e6:.0f}), "
              f"model {r['model_per_step'] * 1e6:.0f} us per step", flush=True)
        results.append(r)
    print(table(results))
    if args.write_docs:
        write_docs(results, args)


if __name__ == "__main__":
    main()
