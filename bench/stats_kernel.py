"""The statistics kernel (recorder/kernels.py) against torch's own reductions, per tensor, on one core.

Every recorded float32/float64 CPU tensor needs its min, max, sum and sum of squares; a payload that
is kept (full and flight modes) is copied as well. Side by side in one process, for tensors of a
few sizes, float32, torch on one thread:

  torch       torch.aminmax, sum and dot: three reads (what recorder.stats does without the kernel)
  kernel      kernels.sums: one read
  torch+copy  the three reductions and a copy (numpy.copyto) into a reused buffer
  copy_sums   kernels.copy_sums: the copy and the sums in one read

"cold": each call on another tensor of a set larger than the last-level cache (as in training, where
a step's tensors were written a while ago); "warm": the same tensor again and again. The figure is
the median over repeats of the time per tensor; ratios are to ``torch`` (and ``torch+copy``) of the
same size and temperature, measured in the same process.

Usage:
  python bench/stats_kernel.py                # ~20 s
  python bench/stats_kernel.py --write-docs   # also write its section of docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

# The checkout this script is in, before an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from docs_section import torch_threads, write_section  # noqa: E402 (bench/ is the script's directory)

from recorder import kernels  # noqa: E402
from recorder.items import copy_buffer  # noqa: E402

HEADING = "## Statistics kernel"
SIZES = (3 << 10, 30 << 10, 768 << 10, 2 << 20, 8 << 20)  # bytes of float32
COLD_BYTES = 192 << 20  # a set of tensors this large per size: no cache holds it
REPEATS = 5


def _torch3(x: np.ndarray, out: np.ndarray) -> None:
    t = torch.from_numpy(x)
    torch.aminmax(t)
    t.sum()
    torch.dot(t, t)


def _torch3_copy(x: np.ndarray, out: np.ndarray) -> None:
    _torch3(x, out)
    np.copyto(out, x)


METHODS: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {
    "torch": _torch3,
    "kernel": lambda x, out: kernels.sums(x),
    "torch+copy": _torch3_copy,
    "copy_sums": kernels.copy_sums,
}


def per_tensor(fn: Callable[[np.ndarray, np.ndarray], object], xs: list[np.ndarray], outs: list[np.ndarray],
               warm: bool) -> float:
    """Median over repeats of seconds per call: over the whole set (cold) or its first tensor (warm)."""
    times = []
    for _ in range(REPEATS):
        pairs = [(xs[0], outs[0])] * len(xs) if warm else list(zip(xs, outs, strict=True))
        t0 = time.perf_counter()
        for x, out in pairs:
            fn(x, out)
        times.append((time.perf_counter() - t0) / len(pairs))
    return statistics.median(times)


def measure() -> list[dict[str, object]]:
    rows = []
    gen = np.random.default_rng(0)
    with torch_threads(1):
        for size in SIZES:
            n = size // 4
            count = max(8, min(4096, COLD_BYTES // size))
            xs = [gen.standard_normal(n, dtype=np.float32) for _ in range(count)]
            outs = [copy_buffer(x.nbytes).view(x.dtype) for x in xs]  # aligned as the recorder's buffers
            for out in outs:
                out[:] = 1  # written once: no page is fresh when timed
            for name, fn in METHODS.items():
                fn(xs[0], outs[0])  # compiled, loaded
                for warm in (False, True):
                    rows.append({"bytes": size, "method": name, "warm": warm,
                                 "s": per_tensor(fn, xs, outs, warm)})
            print(f"  {size >> 10} KB done", flush=True)
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def table(rows: list[dict[str, object]]) -> str:
    by = {(r["bytes"], r["method"], r["warm"]): float(r["s"]) for r in rows}  # type: ignore[arg-type]
    lines = ["| tensor | | torch µs | kernel µs | kernel vs torch | kernel GB/s | torch+copy µs | copy_sums µs "
             "| copy_sums vs torch+copy |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for size in SIZES:
        for warm in (False, True):
            t, k = by[(size, "torch", warm)], by[(size, "kernel", warm)]
            tc, kc = by[(size, "torch+copy", warm)], by[(size, "copy_sums", warm)]
            lines.append(f"| {_size(size)} | {'warm' if warm else 'cold'} | {t * 1e6:.1f} | {k * 1e6:.1f} | "
                         f"{k / t:.2f}x | {size / k / 1e9:.1f} | {tc * 1e6:.1f} | {kc * 1e6:.1f} | {kc / tc:.2f}x |")
    return "\n".join(lines)


def machine() -> str:
    import multiprocessing

    import llvmlite.binding
    import numba

    return (f"{multiprocessing.cpu_count()} CPUs, torch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, "
            f"LLVM CPU {llvmlite.binding.get_host_cpu_name()}, "
            f"numba {numba.__version__}, Python {platform.python_version()}, {platform.machine()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-docs", action="store_true", help="write its section of docs/PERFORMANCE.md")
    args = parser.parse_args()
    print(f"Machine: {machine()}", flush=True)
    rows = measure()
    text = table(rows)
    print(text)
    if args.write_docs:
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        write_section(HEADING, f"""{HEADING}

Measured on {when} by `python bench/stats_kernel.py --write-docs`. Machine: {machine()}.

What one recorded float32 tensor costs in statistics on one core: torch's three reductions
(`aminmax`, `sum`, `dot`; the path without the kernel) against `recorder/kernels.py` (one read),
and with a copy of the tensor (full and flight modes keep its bytes): the reductions and a
`numpy.copyto` against `copy_sums` (into buffers aligned as the recorder's are). Cold: each call on
another tensor of a set of ~{COLD_BYTES >> 20} MB;
warm: one tensor again and again. Median of {REPEATS} repeats, µs per tensor; ratios below 1 favour
the kernel.

{text}
""")


if __name__ == "__main__":
    main()
