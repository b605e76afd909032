"""Recording overhead on a small GPT-like model: what ``recorder.record`` costs per training step.

Variants, each with its own copy of the model and optimizer (same initial weights):
  baseline   no recording
  stats      recorder.record(path, model=m, optimizer=opt, mode="stats")
  full       recorder.record(path, model=m, optimizer=opt, mode="full")
  flight     recorder.record(path, model=m, optimizer=opt, mode="flight") (keep=2; no anomaly, so the
             ring's two iterations are written at close)
  anomaly    torch.autograd.set_detect_anomaly(True), no recording

Method: training steps of all variants run interleaved in one process, one block of K iterations
per variant per round, round-robin (the order rotates every round), so drift and background load hit
every variant alike. A recording variant opens one record() session per block: the block's time runs
from the record() call to the return of run.close(), so writing everything out is paid for. The
figure per variant is the median over blocks of (block time / K).

Then, for each recording mode, one long session: the variant opens one record() session before the
first round and keeps it to the end, paused (Run.pause) while the baseline's blocks run. Each of its
blocks runs from resume() to the return of run.flush() (everything the block produced committed),
and the session's open and close are spread over all its iterations. Only one recording can be
active in a process, so each mode's long session is measured against the baseline on its own.
This is what a training run pays: one session, whose fixed costs (opening the store, the first
iterations' fresh buffers, the close) come once, not once per block.

Usage:
  python bench/record_overhead.py                       # defaults, 2 then 1 torch threads (~26 min)
  python bench/record_overhead.py --threads 2 --iterations 3 --blocks 3      # quick (< 2 min)
  python bench/record_overhead.py --write-docs          # also rewrite docs/PERFORMANCE.md
  python bench/record_overhead.py --profile full --threads 1   # cProfile of the recorder's code
  python bench/record_overhead.py --only full@1 --long-blocks 100   # one target's long session alone,
                                                        # with more rounds for a narrower interval
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import hashlib
import json
import os
import platform
import pstats
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# bench/ is the script's directory
from docs_section import interval_text, judge, judged, median_interval, paired, rotated, torch_threads

import recorder

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH, DROPOUT = 512, 256, 4, 4, 128, 16, 0.1
VARIANTS = ("baseline", "stats", "full", "flight", "anomaly")
RECORDING = ("stats", "full", "flight")
# (variant, torch threads, largest ratio to baseline allowed)
TARGETS = (("stats", 2, 1.10), ("full", 2, 1.5), ("full", 1, 1.10), ("flight", 2, 1.10), ("flight", 1, 1.10))
DOCS = Path(__file__).resolve().parent.parent / "docs" / "PERFORMANCE.md"
MB = 1e6
NOISY = 0.1  # a block during which other processes kept this many cores busy is reported as noisy


# -- the model ------------------------------------------------------------------------------------
@recorder.paper_step("Eq. 1", description="causal multi-head self-attention")
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


@recorder.paper_step("Eq. 2", description="position-wise feed-forward network")
class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention(D_MODEL, HEADS, DROPOUT)
        self.mlp = MLP(D_MODEL, DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def make_batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)) for _ in range(n)]


# -- measuring ------------------------------------------------------------------------------------
@dataclass
class Variant:
    """One variant's model copy and what its blocks measured."""

    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    per_iter: list[float] = field(default_factory=list)  # wall seconds per iteration, one per block
    cpu_per_iter: list[float] = field(default_factory=list)  # process CPU seconds (all threads)
    others: list[float] = field(default_factory=list)  # cores busy with other processes, per block
    store_bytes: list[float] = field(default_factory=list)  # per iteration
    raw_payload: list[float] = field(default_factory=list)  # uncompressed payload bytes per iteration
    disk_payload: list[float] = field(default_factory=list)  # blobs/ bytes on disk per iteration
    open_s: list[float] = field(default_factory=list)
    close_s: list[float] = field(default_factory=list)
    loop_per_iter: list[float] = field(default_factory=list)  # the training loop alone, open and close left out
    peak_queue: list[float] = field(default_factory=list)
    empty_open_s: list[float] = field(default_factory=list)  # sessions that record nothing
    empty_close_s: list[float] = field(default_factory=list)
    empty_bytes: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def forget(self) -> None:
        """Drop what the warm-up measured."""
        for value in vars(self).values():
            if isinstance(value, list):
                value.clear()


def busy_cpu_seconds() -> float:
    """CPU time the whole machine spent busy (all processes, steal included), from /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def store_sizes(path: Path) -> tuple[int, int, int]:
    """(whole store, uncompressed payload, payload on disk) in bytes."""
    lengths = json.loads((path / "manifest.json").read_text())["ranks"]["0"]
    raw = sum(lengths.get(f"blobs/u{w}", 0) * w for w in (1, 2, 4, 8))
    return tree_bytes(path), raw, tree_bytes(path / "rank0" / "blobs")


@contextlib.contextmanager
def timed(v: Variant, iterations: int) -> Iterator[float]:
    """Time a block of ``iterations`` of ``v`` (yields its start): wall time and process CPU time per
    iteration, and the cores other processes kept busy meanwhile, appended to ``v``'s lists."""
    busy0, cpu0, t0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    yield t0
    t1, cpu1, busy1 = time.perf_counter(), time.process_time(), busy_cpu_seconds()
    v.others.append(max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / (t1 - t0))
    v.per_iter.append((t1 - t0) / iterations)
    v.cpu_per_iter.append((cpu1 - cpu0) / iterations)


def run_block(v: Variant, iterations: int, batches: list[Any], tmp: Path, seq: list[int]) -> None:
    """Run one block of ``iterations`` training steps of variant ``v`` and record its costs."""
    steps = [batches[i % len(batches)] for i in range(iterations)]
    path = tmp / f"{v.name}-{seq[0]}.zarr"
    seq[0] += 1
    with timed(v, iterations) as t0:
        if v.name in RECORDING:
            run = recorder.record(str(path), model=v.model, optimizer=v.opt, mode=v.name)
            t_open = time.perf_counter()
            try:
                for x, y in steps:
                    train_step(v.model, v.opt, x, y)
            finally:
                t_body = time.perf_counter()
                run.close()
                t_end = time.perf_counter()
        elif v.name == "anomaly":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..."
                with torch.autograd.set_detect_anomaly(True):
                    for x, y in steps:
                        train_step(v.model, v.opt, x, y)
        else:
            for x, y in steps:
                train_step(v.model, v.opt, x, y)
    if v.name in RECORDING:
        v.open_s.append(t_open - t0)
        v.close_s.append(t_end - t_body)
        v.loop_per_iter.append((t_body - t_open) / iterations)
        v.peak_queue.append(run.pipeline.peak_queue_bytes)
        if run.status != "complete" or run.failure:
            v.problems.append(f"status {run.status}, failure {run.failure}")
        total, raw, disk = store_sizes(path)
        v.store_bytes.append(total / iterations)
        v.raw_payload.append(raw / iterations)
        v.disk_payload.append(disk / iterations)
        shutil.rmtree(path)


def empty_session(v: Variant, tmp: Path, seq: list[int]) -> None:
    """A session of variant ``v`` that records nothing: the fixed costs of opening and closing one."""
    path = tmp / f"empty-{v.name}-{seq[0]}.zarr"
    seq[0] += 1
    t0 = time.perf_counter()
    run = recorder.record(str(path), model=v.model, optimizer=v.opt, mode=v.name)
    t1 = time.perf_counter()
    run.close()
    v.empty_open_s.append(t1 - t0)
    v.empty_close_s.append(time.perf_counter() - t1)
    v.empty_bytes.append(tree_bytes(path))
    shutil.rmtree(path)


def measure(threads: int, iterations: int, blocks: int, warmup: int, log: bool = True) -> dict[str, Any]:
    """Interleaved measurement of every variant at one torch thread count."""
    torch.manual_seed(0)
    base = GPT()
    variants = []
    for name in VARIANTS:
        model = copy.deepcopy(base)
        variants.append(Variant(name, model, torch.optim.AdamW(model.parameters(), lr=3e-4)))
    batches = make_batches()
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    with torch_threads(threads), tempfile.TemporaryDirectory(prefix="pdbg-bench-") as tmp_name:
        tmp, seq = Path(tmp_name), [0]
        for v in variants:  # warm up: allocator, kernels, zarr imports, AdamW state
            run_block(v, warmup, batches, tmp, seq)
            v.forget()
        for r in range(blocks):
            order = rotated(variants, r)
            for v in order:
                run_block(v, iterations, batches, tmp, seq)
            for v in order:
                if v.name in RECORDING:
                    empty_session(v, tmp, seq)
            if log:
                print(f"  [{threads} thread(s)] round {r + 1}/{blocks}: "
                      + ", ".join(f"{v.name} {v.per_iter[-1] * 1e3:.0f} ms" for v in variants)
                      + f" (other processes: {max(v.others[-1] for v in variants):.2f} cores at most)", flush=True)
    return {"threads": threads, "iterations": iterations, "blocks": blocks,
            "seconds": time.perf_counter() - t_start, "loadavg_before": load0, "loadavg_after": os.getloadavg(),
            "others": statistics.mean(o for v in variants for o in v.others),
            "others_max": max(o for v in variants for o in v.others),
            "noisy_blocks": sum(o > NOISY for v in variants for o in v.others),
            "variants": {v.name: summarise(v, iterations) for v in variants}}


def measure_long(threads: int, mode: str, iterations: int, blocks: int, warmup: int,
                 log: bool = True) -> dict[str, Any]:
    """Baseline against one long ``mode`` session, interleaved (see the module's docstring)."""
    torch.manual_seed(0)
    base = GPT()
    variants = []
    for name in ("baseline", mode):
        model = copy.deepcopy(base)
        variants.append(Variant(name, model, torch.optim.AdamW(model.parameters(), lr=3e-4)))
    baseline, rec = variants
    batches = make_batches()
    t_start = time.perf_counter()
    with torch_threads(threads), tempfile.TemporaryDirectory(prefix="pdbg-bench-") as tmp_name:
        tmp, seq = Path(tmp_name), [0]
        for v in variants:  # warm up unrecorded, alike: allocator, kernels, AdamW state
            for x, y in batches[:warmup]:
                train_step(v.model, v.opt, x, y)
        path = tmp / f"{mode}-long.zarr"
        t0 = time.perf_counter()
        run = recorder.record(str(path), model=rec.model, optimizer=rec.opt, mode=mode)
        open_s = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            for x, y in batches[:warmup]:  # the session's first iterations (fresh buffers) count too
                train_step(rec.model, rec.opt, x, y)
            first_s = time.perf_counter() - t0
            run.pause()
            for r in range(blocks):
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    if v is baseline:
                        run_block(baseline, iterations, batches, tmp, seq)
                        continue
                    with timed(rec, iterations):
                        run.resume()
                        for i in range(iterations):
                            train_step(rec.model, rec.opt, *batches[i % len(batches)])
                        committed = run.flush()
                        run.pause()
                    if not committed:
                        rec.problems.append(f"flush failed: {run.failure}")
                if log:
                    print(f"  [{threads} thread(s), one {mode} session] round {r + 1}/{blocks}: baseline "
                          f"{baseline.per_iter[-1] * 1e3:.0f} ms, {mode} {rec.per_iter[-1] * 1e3:.0f} ms", flush=True)
            run.resume()
        finally:
            t0 = time.perf_counter()
            run.close()
            close_s = time.perf_counter() - t0
        if run.status != "complete" or run.failure:
            rec.problems.append(f"status {run.status}, failure {run.failure}")
        total, raw, disk = store_sizes(path)
    n = warmup + blocks * iterations
    base_s = statistics.median(baseline.per_iter)
    # each block against the baseline's block of the same round: drift between rounds cancels
    ratios = paired(rec.per_iter, baseline.per_iter)
    return {"threads": threads, "mode": mode, "iterations": iterations, "blocks": blocks,
            "seconds": time.perf_counter() - t_start, "baseline": base_s,
            "baseline_q": (quantile(baseline.per_iter, 0.25), quantile(baseline.per_iter, 0.75)),
            "per_iter": statistics.median(rec.per_iter),
            "q": (quantile(rec.per_iter, 0.25), quantile(rec.per_iter, 0.75)),
            "paired": ratios,
            "cpu_per_iter": statistics.median(rec.cpu_per_iter), "base_cpu": statistics.median(baseline.cpu_per_iter),
            "open_s": open_s, "close_s": close_s, "session_iterations": n,
            "session_per_iter": (open_s + first_s + sum(rec.per_iter) * iterations + close_s) / n,
            "session_paired": session_paired(ratios, open_s + first_s + close_s, base_s, blocks * iterations, n),
            "store_bytes": total / n, "raw_payload": raw / n, "disk_payload": disk / n,
            "others_max": max(o for v in variants for o in v.others), "problems": rec.problems}


def session_paired(ratios: list[float], fixed_s: float, base_s: float, measured: int,
                   n: int) -> tuple[float, float, float]:
    """A whole session's cost against the baseline, with the drift between rounds taken out: its
    measured iterations at the paired ratio (median over rounds of block / baseline block of the
    same round) of the baseline's median, plus its fixed costs as timed (open, the first
    iterations, close), over all its iterations. Returns the estimate and its 95% interval (the
    bootstrap interval of the paired median carried through)."""

    def whole(ratio: float) -> float:
        return (measured * ratio * base_s + fixed_s) / (n * base_s)

    low, high = median_interval(ratios)
    return whole(statistics.median(ratios)), whole(low), whole(high)


def long_table(longs: list[dict[str, Any]]) -> str:
    rows = ["| mode | baseline ms/iter (p25–p75) | block ms/iter (p25–p75) | vs baseline | paired (p25–p75) | "
            "CPU vs baseline | open ms | close ms | whole session ms/iter | vs baseline | "
            "whole session, paired (95% interval) | disk MB/iter | compression |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in longs:
        comp = f"{r['raw_payload'] / r['disk_payload']:.3f}" if r["raw_payload"] else "–"
        rows.append(f"| {r['mode']} | {r['baseline'] * 1e3:.0f} ({r['baseline_q'][0] * 1e3:.0f}–"
                    f"{r['baseline_q'][1] * 1e3:.0f}) | {r['per_iter'] * 1e3:.0f} ({r['q'][0] * 1e3:.0f}–"
                    f"{r['q'][1] * 1e3:.0f}) | {r['per_iter'] / r['baseline']:.2f}x | "
                    f"{statistics.median(r['paired']):.2f}x ({quantile(r['paired'], 0.25):.2f}–"
                    f"{quantile(r['paired'], 0.75):.2f}) | {r['cpu_per_iter'] / r['base_cpu']:.2f}x | "
                    f"{r['open_s'] * 1e3:.0f} | {r['close_s'] * 1e3:.0f} | "
                    f"{r['session_per_iter'] * 1e3:.0f} | {r['session_per_iter'] / r['baseline']:.2f}x | "
                    f"{r['session_paired'][0]:.2f}x ({r['session_paired'][1]:.2f}–{r['session_paired'][2]:.2f}) | "
                    f"{r['store_bytes'] / MB:.2f} | {comp} |")
    problems = [f"{r['mode']}: {p}" for r in longs for p in r["problems"]]
    if problems:
        rows += ["", "Problems: " + "; ".join(problems)]
    return "\n".join(rows)


def long_header(longs: list[dict[str, Any]]) -> str:
    r = longs[0]
    return (f"#### One long session per mode, torch threads = {r['threads']}\n\n{r['blocks']} blocks × "
            f"{r['iterations']} iterations of each, {sum(x['seconds'] for x in longs):.0f} s in all; each session "
            f"{r['session_iterations']} iterations. Other processes kept at most "
            f"{max(x['others_max'] for x in longs):.2f} cores busy during a block.\n")


def summarise(v: Variant, iterations: int) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {"per_iter": med(v.per_iter), "q1": quantile(v.per_iter, 0.25),
                           "q3": quantile(v.per_iter, 0.75), "cpu_per_iter": med(v.cpu_per_iter),
                           "samples": v.per_iter, "problems": v.problems}
    if v.store_bytes:
        fixed = med(v.empty_open_s) + med(v.empty_close_s)
        out.update(store_bytes=med(v.store_bytes), raw_payload=med(v.raw_payload),
                   disk_payload=med(v.disk_payload), open_s=med(v.open_s), close_s=med(v.close_s),
                   peak_queue=max(v.peak_queue), empty_open_s=med(v.empty_open_s),
                   empty_close_s=med(v.empty_close_s), empty_bytes=med(v.empty_bytes),
                   # estimate: the block time less a session's fixed costs (an empty session's open+close)
                   steady_per_iter=med(t - fixed / iterations for t in v.per_iter),
                   loop_per_iter=med(v.loop_per_iter), loop_samples=v.loop_per_iter)
    return out


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


# -- reporting ------------------------------------------------------------------------------------
def table(res: dict[str, Any]) -> str:
    vs = res["variants"]
    base = vs["baseline"]["per_iter"]
    rows = ["| variant | median ms/iter | p25–p75 ms | vs baseline | CPU ms/iter | disk MB/iter | "
            "payload MB/iter (raw → disk) | compression |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in vs.items():
        disk = f"{s['store_bytes'] / MB:.2f}" if "store_bytes" in s else "–"
        payload = (f"{s['raw_payload'] / MB:.1f} → {s['disk_payload'] / MB:.1f}"
                   if s.get("raw_payload") else "–")
        comp = f"{s['raw_payload'] / s['disk_payload']:.3f}" if s.get("raw_payload") else "–"
        rows.append(f"| {name} | {s['per_iter'] * 1e3:.0f} | {s['q1'] * 1e3:.0f}–{s['q3'] * 1e3:.0f} | "
                    f"{s['per_iter'] / base:.2f}x | {s['cpu_per_iter'] * 1e3:.0f} | {disk} | {payload} | {comp} |")
    rows += ["", "| session | open ms | close ms | peak queue MB | empty session: open ms, close ms, KB | "
             "ms/iter less an empty session's open+close | vs baseline | training loop ms/iter | vs baseline |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for name in RECORDING:
        s = vs[name]
        rows.append(f"| {name} | {s['open_s'] * 1e3:.0f} | {s['close_s'] * 1e3:.0f} | {s['peak_queue'] / MB:.0f} | "
                    f"{s['empty_open_s'] * 1e3:.0f}, {s['empty_close_s'] * 1e3:.0f}, {s['empty_bytes'] / 1e3:.0f} | "
                    f"{s['steady_per_iter'] * 1e3:.0f} | {s['steady_per_iter'] / base:.2f}x | "
                    f"{s['loop_per_iter'] * 1e3:.0f} | {s['loop_per_iter'] / base:.2f}x |")
    problems = [f"{n}: {p}" for n, s in vs.items() for p in s["problems"]]
    if problems:
        rows += ["", "Problems: " + "; ".join(problems)]
    return "\n".join(rows)


def header(res: dict[str, Any]) -> str:
    return (f"### torch threads = {res['threads']}\n\n{res['blocks']} blocks × {res['iterations']} iterations "
            f"per variant, {res['seconds']:.0f} s; load average before {res['loadavg_before'][0]:.2f}, "
            f"after {res['loadavg_after'][0]:.2f}. Other processes kept {res['others']:.2f} cores busy on "
            f"average (at most {res['others_max']:.2f} during a block; {res['noisy_blocks']} of "
            f"{res['blocks'] * len(VARIANTS)} blocks above {NOISY}).\n")


def target_lines(results: dict[int, dict[str, Any]], longs: dict[int, list[dict[str, Any]]]) -> list[str]:
    """Each target against both methods: a session per block, and one long session."""
    lines = []
    for name, threads, limit in TARGETS:
        res, long = results.get(threads), {r["mode"]: r for r in longs.get(threads, [])}.get(name)
        parts = []
        if long is not None:
            estimate, low, high = long["session_paired"]
            parts.append(f"one long session, open and close included, paired: {estimate:.3f}x (95% interval "
                         f"{interval_text((low, high))}) — **{judge((low, high), limit)}** (ratio of medians "
                         f"{long['session_per_iter'] / long['baseline']:.2f}x)")
        if res is not None:
            # Flight mode writes its ring once, when the run ends: shown per block on the training
            # loop (its close, which writes two iterations, is shown with the sessions).
            samples = res["variants"][name]["loop_samples" if name == "flight" else "samples"]
            estimate, interval, verdict = judged(paired(samples, res["variants"]["baseline"]["samples"]), limit)
            what = "training loop of " if name == "flight" else ""
            parts.append(f"{what}a session per {res['iterations']} iterations, paired: "
                         f"{estimate:.3f}x ({interval_text(interval)}) — {verdict}")
        lines.append(f"- {name} ≤ {limit:.2f}x at {threads} thread(s): "
                     + ("; ".join(parts) if parts else "not measured in this run"))
    return lines


def recorder_version() -> str:
    """Fingerprint of the recorder's sources that ran (the working tree may differ from any commit)."""
    root = Path(recorder.__file__).resolve().parent
    files = sorted(root.rglob("*.py"))
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    newest = max(f.stat().st_mtime for f in files)
    return f"sha256 {digest} of recorder/**/*.py, newest file {time.strftime('%Y-%m-%d %H:%M', time.localtime(newest))}"


def machine() -> str:
    return (f"{os.cpu_count()} CPUs (nproc), torch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, Python {platform.python_version()}, "
            f"{platform.machine()}, {platform.platform()}; {kernel_note()}")


def kernel_note() -> str:
    """Whether the recorder's statistics went through its numba kernel (recorder/kernels.py)."""
    return "statistics kernel " + ("on (numba)" if recorder.stats.prepare() else "off (torch's reductions)")


# Sections after this benchmark's own, kept as they are: the hand-written notes on its spread, then
# what the other benchmarks wrote (bench/replay_start.py and the rest).
OTHER_SECTIONS = ("\n## Recording overhead: spread between runs", "\n## Replay start latency")


def write_docs(results: dict[int, dict[str, Any]], longs: dict[int, list[dict[str, Any]]],
               command: str) -> None:
    any_res = next(iter(results.values()))
    rounds = next((r[0]["blocks"] for r in longs.values() if r), 0)
    long_rounds = (f"A long session has {rounds} rounds: the interval narrows as one over the square root of "
                   "the rounds, and single iterations on a shared 2-core VM vary by ±10%." if rounds else
                   "This run had no long sessions (--long-blocks 0).")
    text = f"""# Recording overhead

Measured on {time.strftime("%Y-%m-%d %H:%M")} by `{command}`.
Re-run it after any change to the recorder's hot path; the numbers below are from one run on the
machine named here.

## What was measured

A GPT-like model: {LAYERS} layers, d_model {D_MODEL}, {HEADS} heads, sequence {SEQ}, batch {BATCH},
vocabulary {VOCAB}, dropout {DROPOUT}. Its attention class is a paper step (`@recorder.paper_step("Eq. 1")`)
and so is its MLP class (`"Eq. 2"`): 8 forward and 8 backward steps per iteration. One iteration is
forward, cross-entropy loss, backward, AdamW step, `zero_grad`. Variants:

- **baseline**: no recording;
- **stats**: `recorder.record(path, model=m, optimizer=opt, mode="stats")`;
- **full**: the same with `mode="full"` (payloads of inputs, outputs, parameters and gradients);
- **flight**: `mode="flight"`, `keep=2`: statistics of every step, payloads held in memory for the
  last two iterations and written at close (no anomaly happens);
- **anomaly**: `torch.autograd.set_detect_anomaly(True)`, no recording (for comparison: what
  PyTorch's own debugging aid costs).

## Method

- Each variant trains its own copy of the model and optimizer (same initial weights, same batches).
- Training steps of all variants are interleaved in one process: one block of {any_res['iterations']} iterations per
  variant per round, round-robin, the order rotating each round, so drift and background load affect
  all variants alike. Each variant is warmed up first.
- A recording variant opens one `record()` session per block into a new directory on local disk; the
  block's time runs from the `record()` call to the return of `run.close()`: opening the store,
  draining the writer queue and the final commit are included. The fixed costs of a session
  (median open and close of a session that records nothing, run once per round) are shown on
  their own, with an estimate of the per-iteration cost without them (block time less one empty
  session's open + close, over iterations).
- Then each recording mode once more, as **one long session** against the baseline (one mode at a
  time: a process has one recording at most). The session is opened before the first round and
  closed after the last, and paused (`Run.pause()`) while the baseline's blocks run; its blocks run
  from `resume()` to the return of `run.flush()`, so whatever a block handed to the writer is
  committed inside its time. Both models are first warmed up unrecorded; "whole session" is (open
  + every iteration of the session, its first ones included, + close) / iterations. The targets
  are judged on it, paired (below): a training run opens one session. What a session per block adds on top is the
  session's fixed cost: opening the store, the first iterations' fresh buffers (flight mode copies
  ~94 MB per iteration into buffers the kernel must first fault in and zero; later iterations reuse
  them) and the close.
- The figure is the median over blocks of block time / iterations; "vs baseline" is the ratio of
  medians. For a long session, "paired" is the median (and quartiles) over rounds of its block's
  time / the baseline's block time in the same round: the machine's drift between rounds (this one's
  baseline moves by 10% and more within a run) cancels in it. CPU ms/iter is process CPU time
  (all threads: training, writer, zarr's event loop).
- **Verdicts.** A ratio of medians compares blocks from different moments: each long session has
  its own baseline blocks, and one session's baseline has run 18% faster than the next one's in the
  same run. So a target is judged on the whole session, paired: the measured iterations at the
  paired median ratio, plus the session's fixed costs as timed (open, first iterations, close),
  over all its iterations. Its 95% interval is the percentile-bootstrap interval of the paired
  median (rounds resampled, fixed seed) carried through the same formula. A target is **met** when
  the whole interval is within it, **not met** when all of it is above, and **undecided** when
  the interval spans it: the rounds of that run disagree by more than the margin, and running it
  again decides nothing either. {long_rounds}
  The sessions per block are shown the same way (each block against the baseline's block of its
  round), for comparison: they pay a session's fixed costs in every block.
- disk MB/iter: all files of the store / iterations (apparent sizes); compression: uncompressed
  payload bytes (element counts of `blobs/u1…u8` in `manifest.json` × width) / bytes of the
  `rank0/blobs/` directory. With few iterations per session the fixed bytes of a store (definitions,
  settings, array metadata: see "empty session") weigh on stats mode's MB/iter.
- Stores go to a temporary directory, deleted after each block.
- Other processes' CPU use during each block is read from `/proc/stat` (machine busy time less this
  process's CPU time) and summarised above each table: where other processes kept a core busy,
  every variant slows down (torch's threads wait for each other) and the ratios mean little.
- Where the recorder's time goes: `python bench/record_overhead.py --profile full --threads 1`
  (cProfile of the training and writer threads, in CPU time per iteration).

Machine: {machine()}.
Recorder sources: {recorder_version()}.

## Results
"""
    for threads in sorted(results, reverse=True):
        text += "\n" + header(results[threads]) + "\n" + table(results[threads]) + "\n"
        if longs.get(threads):
            text += "\n" + long_header(longs[threads]) + "\n" + long_table(longs[threads]) + "\n"
    text += "\n## Targets\n\n" + "\n".join(target_lines(results, longs)) + "\n"
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    if DOCS.exists():  # sections other benchmarks wrote (replay start latency) stay as they are
        old = DOCS.read_text()
        keep = [old.index(h) for h in OTHER_SECTIONS if h in old]
        if keep:
            text = text.rstrip("\n") + "\n\n" + old[min(keep):].lstrip("\n")
    DOCS.write_text(text)
    print(f"wrote {DOCS}")


# -- profiling ------------------------------------------------------------------------------------
def profile(mode: str, threads: int, iterations: int, blocks: int, top: int) -> None:
    """cProfile one recording variant on the training thread and on the writer thread.

    Times are CPU time of each thread (time.thread_time), so other processes' load does not inflate
    them; cProfile's own overhead still does, on small Python functions: use them to rank."""
    from recorder import pipeline

    writer_profiles: list[cProfile.Profile] = []
    original = pipeline.Pipeline._run

    def profiled_run(self: Any) -> None:
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()
            writer_profiles.append(prof)

    torch.manual_seed(0)
    model = GPT()
    v = Variant(mode, model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    batches = make_batches()
    main = cProfile.Profile(time.thread_time)
    pipeline.Pipeline._run = profiled_run  # type: ignore[method-assign]
    try:
        with torch_threads(threads), tempfile.TemporaryDirectory(prefix="pdbg-prof-") as tmp_name:
            tmp, seq = Path(tmp_name), [0]
            run_block(v, 2, batches, tmp, seq)
            writer_profiles.clear()
            main.enable()
            for _ in range(blocks):
                run_block(v, iterations, batches, tmp, seq)
            main.disable()
    finally:
        pipeline.Pipeline._run = original  # type: ignore[method-assign]
    n = iterations * blocks
    print(f"\n## cProfile, mode={mode}, {threads} thread(s), {n} iterations in {blocks} session(s); "
          f"wall {statistics.median(v.per_iter) * 1e3:.0f} ms/iter, process CPU "
          f"{statistics.median(v.cpu_per_iter) * 1e3:.0f} ms/iter (both inflated by the profiler)")
    report("training thread", pstats.Stats(main), n, top)
    stats = pstats.Stats(writer_profiles[0])
    for prof in writer_profiles[1:]:
        stats.add(prof)
    report("writer thread", stats, n, top)


def report(title: str, stats: pstats.Stats, n: int, top: int) -> None:
    """Functions of recorder/ by cumulative time, per iteration."""
    rows = []
    for (file, line, func), (_, calls, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/recorder/" in file:
            rows.append((ct, tt, calls, f"{file.split('/recorder/')[1]}:{line} {func}"))
    rows.sort(reverse=True)
    total = sum(tt for (_, _, tt, _, _) in stats.stats.values()) / n  # type: ignore[attr-defined]
    print(f"\n### {title}: {total * 1e3:.0f} ms CPU per iteration in all; recorder/ functions by "
          "cumulative CPU time (ms per iteration)\n")
    print("| cumulative | own | calls/iter | function |\n|---:|---:|---:|---|")
    for ct, tt, calls, name in rows[:top]:
        print(f"| {ct / n * 1e3:.1f} | {tt / n * 1e3:.1f} | {calls / n:.0f} | {name} |")


# -- command line ---------------------------------------------------------------------------------
def target_setting(text: str) -> tuple[str, int]:
    """``full@1`` -> ("full", 1): a recording mode and a torch thread count that a target names."""
    mode, _, threads = text.partition("@")
    if (mode, threads) not in {(m, str(t)) for m, t, _ in TARGETS}:
        raise argparse.ArgumentTypeError(f"{text!r} is not a target's setting; choose one of "
                                         + ", ".join(f"{m}@{t}" for m, t, _ in TARGETS))
    return mode, int(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, choices=(1, 2), action="append",
                        help="torch threads (repeatable; default: 2, then 1)")
    parser.add_argument("--iterations", type=int, default=5, help="iterations per block (default 5)")
    parser.add_argument("--blocks", type=int, default=8,
                        help="measured blocks per variant, a session per block (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up iterations per variant (default 2)")
    parser.add_argument("--long-blocks", type=int, default=30,
                        help="blocks of each mode's long session (default %(default)s; 0 leaves them out)")
    parser.add_argument("--write-docs", action="store_true", help="rewrite its sections of docs/PERFORMANCE.md")
    parser.add_argument("--profile", choices=RECORDING, help="cProfile this variant alone instead")
    parser.add_argument("--top", type=int, default=25, help="rows of the profile (default 25)")
    parser.add_argument("--no-kernel", action="store_true",
                        help="statistics through torch's reductions, not the numba kernel (to compare)")
    parser.add_argument("--only", action="append", type=target_setting, metavar="MODE@THREADS",
                        help="only the long session of this mode at this many torch threads (repeatable; "
                             "e.g. full@1): no session-per-block measurement, the verdicts printed, not written")
    args = parser.parse_args()
    if args.only and (args.write_docs or args.profile or args.threads or not args.long_blocks):
        parser.error("--only runs long sessions alone: leave out --write-docs, --profile and --threads, "
                     "and give --long-blocks above 0")
    if args.no_kernel:
        recorder.stats.use_kernel(False)
    # `timeout` and kill send SIGTERM: exit through the finally blocks, so temporary stores are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    thread_settings = args.threads or [2, 1]
    print(f"# Recording overhead\n\nMachine: {machine()}\nRecorder: {recorder_version()}\n", flush=True)
    if args.profile:
        for threads in thread_settings:
            profile(args.profile, threads, args.iterations, args.blocks, args.top)
        return
    results: dict[int, dict[str, Any]] = {}
    longs: dict[int, list[dict[str, Any]]] = {}
    for mode, threads in args.only or []:  # one target's long session each, nothing else
        long = measure_long(threads, mode, args.iterations, args.long_blocks, args.warmup)
        longs.setdefault(threads, []).append(long)
        print("\n" + long_header([long]) + "\n" + long_table([long]) + "\n", flush=True)
    for threads in () if args.only else thread_settings:
        results[threads] = measure(threads, args.iterations, args.blocks, args.warmup)
        print("\n" + header(results[threads]) + "\n" + table(results[threads]) + "\n", flush=True)
        if args.long_blocks:
            longs[threads] = [measure_long(threads, mode, args.iterations, args.long_blocks, args.warmup)
                              for mode in RECORDING]
            print("\n" + long_header(longs[threads]) + "\n" + long_table(longs[threads]) + "\n", flush=True)
    print("## Targets\n\n" + "\n".join(target_lines(results, longs)))
    if args.write_docs:
        write_docs(results, longs, " ".join(["python bench/record_overhead.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
