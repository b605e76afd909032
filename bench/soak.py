"""Soak: flight mode over 20,000 iterations of a small model keeps memory flat and disk bounded by the ring.

A two-layer MLP whose layers are paper steps (``Eq. 1`` hidden layer, ``Eq. 2`` read-out; 4 steps
per iteration: 2 forward, 2 backward) trains for ``--iterations`` under
``recorder.record(path, model=..., optimizer=..., mode="flight", keep=2)``. Each batch is drawn from
the global torch generator, as a data loader's shuffling or dropout would, so every step has a new
RNG state to record.

At 1k, 2k, 5k, 10k and 20k iterations (after a commit and a garbage collection) it samples:
  - RSS (VmRSS) and peak RSS (VmHWM, or a higher RSS sampled before) from /proc/self/status;
  - Python's allocated memory blocks (``sys.getallocatedblocks``) and gc-tracked objects;
  - the store's bytes on disk by kind: statistics (steps, tensor records and their statistics,
    documents, shapes), payloads (``blobs/``: tensor bytes; ``payloads/`` and ``late/``: their index)
    and metadata (zarr.json, the manifest);
  - the sizes of the recorder's caches and per-step structures (training thread, writer thread).
Then gc-tracked objects by type at the first sample and the last are compared, and one more window
of iterations runs under ``tracemalloc`` (after the last sample, so it does not inflate its RSS):
the source lines whose allocations are still alive at its end are what grows with steps.

After close it checks that disk is bounded by the ring: only the last ``keep`` iterations have
payloads, their bytes are the ring's last write, and no more than the ring's peak.

Usage:
  nice -n 19 python bench/soak.py                        # 20,000 iterations (~3 min on 2 cores)
  nice -n 19 python bench/soak.py --iterations 2000      # quick look
  nice -n 19 python bench/soak.py --write-docs           # also write its section of docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import gc
import linecache
import os
import platform
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from docs_section import DOCS, write_section  # noqa: E402 (bench/ is the script's directory)

import recorder
from recorder.store import layout
from recorder.store.reader import RunReader

D_IN, HIDDEN, CLASSES, BATCH = 32, 128, 10, 32
CHECKPOINTS = (1000, 2000, 5000, 10000, 20000)
HEADING = "## Flight mode over 20,000 iterations"
MB = 1e6


# -- the model ------------------------------------------------------------------------------------
@recorder.paper_step("Eq. 1", description="hidden layer: h = tanh(W1 x + b1)")
class Hidden(nn.Module):
    def __init__(self, d_in: int, d_hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@recorder.paper_step("Eq. 2", description="read-out: logits = W2 h + b2")
class Readout(nn.Module):
    def __init__(self, d_hidden: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_hidden, classes)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.readout = Hidden(D_IN, HIDDEN), Readout(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.hidden(x))


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One iteration; the optimizer's step starts the next (``optimizer=`` given to record)."""
    x = torch.randn(BATCH, D_IN)
    y = torch.randint(0, CLASSES, (BATCH,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# -- samples ------------------------------------------------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def disk_bytes(path: Path) -> dict[str, int]:
    """Bytes on disk by kind: statistics (``tables``: steps/, tensors/, dims/; ``docs``: documents, RNG
    states among them), payload bytes (blobs/), payload index (payloads/, late/), metadata."""
    out = {"statistics": 0, "tables": 0, "docs": 0, "payloads": 0, "payload_index": 0, "metadata": 0}
    for file in path.rglob("*"):
        if not file.is_file():
            continue
        parts = file.relative_to(path).parts
        group = parts[1] if len(parts) > 2 else ""
        size = file.stat().st_size
        if file.name == "zarr.json" or len(parts) == 1:
            out["metadata"] += size
        elif group == "blobs":
            out["payloads"] += size
        elif group in ("payloads", "late"):
            out["payload_index"] += size
        else:
            out["statistics"] += size
            out["docs" if group == "docs" else "tables"] += size
    return out


def structure_sizes(run: recorder.run.Run) -> dict[str, int]:
    """Sizes of what the recorder keeps across steps (0 for a structure this version lacks)."""
    session, pipeline = run.session, run.pipeline
    writer = pipeline.writer
    ring = session.ring

    def size(obj: Any, name: str) -> int:
        value = getattr(obj, name, None)
        return len(value) if value is not None and hasattr(value, "__len__") else 0

    return {
        "session.seen": size(session, "seen"), "session._links": size(session, "_links"),
        "session.calls": size(session, "calls"), "session._module_docs": size(session, "_module_docs"),
        "session._known_settings": size(session, "_known_settings"), "session.dumps": size(session, "dumps"),
        "ring iterations": size(ring, "_iterations"), "ring._owners": size(ring, "_owners"),
        "pipeline._waiting": size(pipeline, "_waiting"), "pipeline._tokens": size(pipeline, "_tokens"),
        "pipeline._rng_docs": size(pipeline, "_rng_docs"), "pipeline._rng_sets": size(pipeline, "_rng_sets"),
        "writer._doc_ids": size(writer, "_doc_ids"), "writer._str_ids": size(writer, "_str_ids"),
        "writer._payload_ids": size(writer, "_payload_ids"), "writer._identity_ids": size(writer, "_identity_ids"),
        "writer._pending": size(writer, "_pending"),
    }


@dataclass
class Sample:
    iteration: int
    seconds: float
    steps: int
    rss: int
    hwm: int
    blocks: int
    gc_objects: int
    disk: dict[str, int]
    ring_bytes: int
    sizes: dict[str, int] = field(default_factory=dict)


def sample(run: recorder.run.Run, path: Path, iteration: int, t0: float, peak: int = 0) -> tuple[Sample, Counter[str]]:
    """One sample; ``peak``: the highest RSS seen before. The kernel updates VmHWM lazily (when memory
    is unmapped), so it can read below an RSS sampled earlier: the peak is the highest of the three."""
    run.flush()
    gc.collect()
    objects = gc.get_objects()
    types = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
    status = proc_status()
    ring = run.session.ring
    s = Sample(iteration=iteration, seconds=time.perf_counter() - t0, steps=run.steps, rss=status["VmRSS"],
               hwm=max(status["VmHWM"], status["VmRSS"], peak), blocks=sys.getallocatedblocks(),
               gc_objects=len(objects),
               disk=disk_bytes(path), ring_bytes=ring.bytes if ring is not None else 0, sizes=structure_sizes(run))
    del objects
    return s, types


def baseline_ms(iterations: int) -> float:
    """Milliseconds per iteration of the same loop without recording."""
    torch.manual_seed(1)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t = time.perf_counter()
    for _ in range(iterations):
        train_step(model, opt)
    return (time.perf_counter() - t) / iterations * 1e3


# -- the run ------------------------------------------------------------------------------------
@dataclass
class Result:
    iterations: int
    keep: int
    samples: list[Sample]
    type_growth: list[tuple[str, int, int]]  # (type, count at first sample, at last)
    traced: list[tuple[str, str, int, int]]  # (file:line, its code, bytes alive, blocks alive) after the window
    trace_window: int
    traced_bytes: int
    seconds: float
    close_seconds: float
    baseline_ms: float
    final_disk: dict[str, int]
    payload_units_bytes: int  # payload bytes written, uncompressed
    payload_iterations: list[int]
    ring_peak: int
    last_dump: dict[str, Any]
    dumps: list[dict[str, Any]]
    steps: int
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average at the start and the end


def soak(iterations: int, keep: int, trace_window: int, work: Path) -> Result:
    path = work / "soak.zarr"
    load_start = os.getloadavg()[0]
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    marks = sorted({c for c in CHECKPOINTS if c < iterations} | {iterations})
    samples: list[Sample] = []
    first_types: Counter[str] = Counter()
    last_types: Counter[str] = Counter()
    t0 = time.perf_counter()
    run = recorder.record(path, model=model, optimizer=opt, mode="flight", keep=keep)
    with run:
        done = 0
        for mark in marks:
            while done < mark:
                train_step(model, opt)
                done += 1
            s, types = sample(run, path, done, t0, samples[-1].hwm if samples else 0)
            samples.append(s)
            if not first_types:
                first_types = types
            last_types = types
            print(f"  {done:>6} iterations  {s.seconds:6.1f} s  RSS {s.rss / MB:6.1f} MB  peak {s.hwm / MB:6.1f} MB  "
                  f"blocks {s.blocks:>8}  statistics {s.disk['statistics'] / MB:6.2f} MB", flush=True)
        seconds = time.perf_counter() - t0
        traced: list[tuple[str, str, int, int]] = []
        traced_bytes = 0
        if trace_window:
            gc.collect()
            tracemalloc.start(1)
            for _ in range(trace_window):
                train_step(model, opt)
            run.flush()
            gc.collect()
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.DomainFilter(True, 0)])
            tracemalloc.stop()
            stats = snap.statistics("lineno")
            traced_bytes = sum(st.size for st in stats)
            traced = [(f"{_short(st.traceback[0].filename)}:{st.traceback[0].lineno}",
                       linecache.getline(st.traceback[0].filename, st.traceback[0].lineno).strip(), st.size, st.count)
                      for st in stats[:12]]
        t_close = time.perf_counter()
    close_seconds = time.perf_counter() - t_close
    steps = run.steps
    total = iterations + trace_window
    growth = sorted(((name, first_types.get(name, 0), n) for name, n in last_types.items()),
                    key=lambda t: t[1] - t[2])[:10]
    reader = RunReader(str(path))
    rank = reader.rank(0)
    final = reader.attrs["final"]["flight"]
    units = np.array([1, 2, 4, 8])[rank.column("payloads/blob").astype(int)] if rank.lengths["payloads"] else []
    payload_units_bytes = int(np.sum(units * rank.column("payloads/count"))) if len(units) else 0
    return Result(iterations=total, keep=keep, samples=samples, type_growth=growth, traced=traced,
                  trace_window=trace_window, traced_bytes=traced_bytes, seconds=seconds, close_seconds=close_seconds,
                  baseline_ms=baseline_ms(min(2000, iterations)), final_disk=disk_bytes(path),
                  payload_units_bytes=payload_units_bytes, payload_iterations=payload_iterations(rank),
                  ring_peak=int(final["peak_ring_bytes"]), last_dump=final["dumps"][-1] if final["dumps"] else {},
                  dumps=final["dumps"], steps=steps, load=(load_start, os.getloadavg()[0]))


def payload_iterations(rank: Any) -> list[int]:
    """Iterations with any tensor record that has its bytes (written with it, or attached late)."""
    if not rank.lengths["tensors"]:
        return []
    direct = np.flatnonzero(rank.column("tensors/payload") != layout.NO_REF)
    late = rank.column("late/tensor") if rank.lengths.get("late") else np.zeros(0, dtype=np.int64)
    rows = np.union1d(direct, late).astype(np.int64)
    steps = rank.column("tensors/step")[rows]
    return sorted({int(i) for i in rank.column("steps/iteration")[steps]})


def _short(filename: str) -> str:
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    if filename.startswith(root):
        return filename[len(root):]
    marker = "site-packages" + os.sep
    return filename.split(marker, 1)[1] if marker in filename else filename


# -- report ---------------------------------------------------------------------------------------
def per_step(res: Result, key: str, a: Sample, b: Sample) -> float:
    return (b.disk[key] - a.disk[key]) / max(1, b.steps - a.steps)


def report(res: Result) -> str:
    s0, s1 = res.samples[0], res.samples[-1]
    lines = [
        "| iterations | steps | time (s) | RSS (MB) | peak RSS (MB) | Python blocks | gc objects | "
        "statistics on disk (MB) | payloads on disk (MB) | ring (KB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in res.samples:
        lines.append(f"| {s.iteration:,} | {s.steps:,} | {s.seconds:.1f} | {s.rss / MB:.1f} | {s.hwm / MB:.1f} | "
                     f"{s.blocks:,} | {s.gc_objects:,} | {s.disk['statistics'] / MB:.2f} | "
                     f"{(s.disk['payloads'] + s.disk['payload_index']) / MB:.3f} | {s.ring_bytes / 1e3:.0f} |")
    span = s1.iteration - s0.iteration
    lines += [
        "",
        f"From {s0.iteration:,} to {s1.iteration:,} iterations: RSS {(s1.rss - s0.rss) / MB:+.1f} MB, peak RSS "
        f"{(s1.hwm - s0.hwm) / MB:+.1f} MB, Python blocks {s1.blocks - s0.blocks:+,} "
        f"({(s1.blocks - s0.blocks) / max(1, span):+.2f} per iteration), gc objects "
        f"{s1.gc_objects - s0.gc_objects:+,}.",
        f"Statistics on disk: {per_step(res, 'statistics', s0, s1):.0f} bytes per step "
        f"({per_step(res, 'statistics', s0, s1) * (s1.steps - s0.steps) / max(1, span):.0f} per iteration of "
        f"{(s1.steps - s0.steps) / max(1, span):.0f} steps): step and tensor tables "
        f"{per_step(res, 'tables', s0, s1):.0f}, documents {per_step(res, 'docs', s0, s1):.0f} (a new RNG state "
        f"at every iteration is a new document). Payload bytes on disk during the run: "
        f"{s1.disk['payloads']:,} (the ring is written only at the end or on an anomaly).",
        f"Run: {res.seconds:.1f} s for {s1.iteration:,} iterations ({res.seconds / s1.iteration * 1e3:.2f} ms per "
        f"iteration; {res.baseline_ms:.2f} ms without recording); close {res.close_seconds:.2f} s.",
        "",
        "After close (disk bounded by the ring):",
        "",
        f"- iterations with payloads: {res.payload_iterations} (the last {res.keep} of {res.iterations:,}: "
        f"{'yes' if res.payload_iterations == list(range(res.iterations - res.keep, res.iterations)) else 'NO'})",
        f"- payload bytes written (uncompressed): {res.payload_units_bytes:,}; the ring's last write "
        f"({res.last_dump.get('reason')}, iterations {res.last_dump.get('iterations')}): "
        f"{res.last_dump.get('bytes', 0):,}; its peak: {res.ring_peak:,} "
        f"({'bounded' if res.payload_units_bytes <= res.ring_peak else 'NOT BOUNDED'})",
        f"- on disk: payload bytes (blobs/) {res.final_disk['payloads']:,}, payload index (payloads/, late/) "
        f"{res.final_disk['payload_index']:,}, statistics {res.final_disk['statistics']:,}, metadata "
        f"{res.final_disk['metadata']:,}",
        f"- ring writes: {[(d['reason'], d.get('iterations')) for d in res.dumps]}",
        "",
        "Recorder structures (entries) at the first and last sample:",
        "",
        "| structure | " + " | ".join(f"{s.iteration:,}" for s in (s0, s1)) + " |",
        "|---|---:|---:|",
    ]
    for name in s0.sizes:
        lines.append(f"| `{name}` | {s0.sizes[name]:,} | {s1.sizes[name]:,} |")
    lines += ["", f"gc-tracked objects by type, most grown from {s0.iteration:,} to {s1.iteration:,} iterations:", "",
              "| type | " + f"{s0.iteration:,} | {s1.iteration:,} |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {a:,} | {b:,} |" for name, a, b in res.type_growth if b != a]
    if res.trace_window:
        lines += ["", f"Allocations of the {res.trace_window:,} iterations after the last sample still alive at their "
                  f"end (tracemalloc, after a commit and a collection): {res.traced_bytes / 1e3:.0f} KB, "
                  f"{res.traced_bytes / res.trace_window:.0f} bytes per iteration. Largest source lines:", "",
                  "| line | code | KB | blocks |", "|---|---|---:|---:|"]
        lines += [f"| `{where}` | `{code[:80].replace('|', '/')}` | {size / 1e3:.1f} | {count:,} |"
                  for where, code, size, count in res.traced]
    return "\n".join(lines)


def docs_text(res: Result, table: str) -> str:
    return "\n".join([
        HEADING, "",
        "`bench/soak.py`: a two-layer MLP (32 -> 128 -> 10, batch 32; both layers paper steps: 4 steps per "
        "iteration) trained under `recorder.record(path, model=m, optimizer=opt, mode=\"flight\", keep=2)`, "
        "batches drawn from the global torch generator. Samples after a commit and a garbage collection; "
        "statistics, payloads and metadata are the store's files by kind (see the script). "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}, 1 torch thread; run with `nice -n 19` on a shared machine (load "
        f"average {res.load[0]:.1f} at the start, {res.load[1]:.1f} at the end: times are upper bounds).", "",
        "    nice -n 19 python bench/soak.py --write-docs", "",
        table, "",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--trace-window", type=int, default=2000,
                    help="iterations run under tracemalloc after the last sample (0: none)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    ap.add_argument("--write-docs", action="store_true", help=f"write {HEADING!r} in docs/PERFORMANCE.md")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the file --write-docs writes (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="pdbg-soak-"))
    try:
        print(f"flight mode, keep={args.keep}, {args.iterations:,} iterations (+{args.trace_window:,} traced)")
        res = soak(args.iterations, args.keep, args.trace_window, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = report(res)
    print()
    print(table)
    if args.write_docs:
        write_section(HEADING, docs_text(res, table), args.docs)


if __name__ == "__main__":
    main()
