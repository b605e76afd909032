"""Where recording's time goes on the training thread: CPU time inside the recorder's entry points,
by part, on a real model, next to what the same iterations cost unrecorded.

Wall-time ratios on a shared 2-core machine move by several percent from run to run (see
docs/PERFORMANCE.md); the training thread's CPU time inside the recorder's own calls moves far less,
so it is the figure to compare two versions of the recorder by, and it says what a ratio is made of.

Models:
  gpt-like   bench/record_overhead.py's model (4 layers, d_model 256, seq 128, batch 16), its attention
             and MLP classes decorated as paper steps (8 forward and 8 backward steps per iteration)
  gpt2       bench/callback_overhead.py's GPT-2 (4 layers, n_embd 256, seq 128, batch 8), recording
             what the framework callbacks pick (``modules=["transformer.h.*"]``: 4 blocks, forward
             and backward); needs transformers

Method: one recording session (``--mode``, default flight). Blocks of ``--iterations`` iterations
alternate between the session paused and resumed (``--rounds`` rounds, the order swapping each
round); a resumed block ends with ``run.flush()``, so the writer's work for it is inside it. For
each block, per iteration: wall time; the training thread's CPU time (``time.thread_time``), in
forward, backward and the optimizer, and inside the recorder's entry points (a step's begin and end,
its gradient hooks, the end of a backward pass, the iteration's end); within those, the parts:
copying payloads with their statistics (``stats.copy_stats``), statistics without a copy, hashing
parameters (``payload.content_key``), the RNG and settings snapshots; the rest is bookkeeping
(records, argument documents, taps, queueing). Also the writer thread's CPU and the training
thread's minor page faults. Medians over rounds. The entry points are timed by wrapping them
(~1 us per call, restored afterwards).

Usage:
  python bench/entry_points.py                          # gpt-like, then gpt2, flight, 2 then 1 thread(s) (~6 min)
  python bench/entry_points.py --models gpt2 --threads 2 --rounds 4     # quick look
  python bench/entry_points.py --mode stats
  python bench/entry_points.py --write-docs             # also write its section of docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import logging
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# The checkout this script is in, before an installed copy: a checkout of another commit measures its own recorder.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from docs_section import paused_and_resumed, torch_threads, write_section  # noqa: E402 (bench/ is the script's directory)

import recorder  # noqa: E402
from recorder import capture, payload, snapshot  # noqa: E402
from recorder import stats as stats_mod  # noqa: E402

HEADING = "## Where the training thread's time goes"
MODELS = ("gpt-like", "gpt2")
# Where recording enters from the training loop: hooks, step calls, the iteration's end.
ENTRY_POINTS = ("begin", "end", "end_with_exception", "add_kwargs", "_on_grad_output", "_on_grad_input",
                "_on_param_grad", "_end_of_backward", "next_iteration")
# Parts timed inside the entry points: (object, attribute, label).
PARTS = ((stats_mod, "copy_stats", "copy"), (stats_mod, "host_stats", "stats"), (stats_mod, "device_stats", "stats"),
         (payload, "content_key", "hash"), (snapshot.RngReader, "parts", "snapshots"),
         (capture.Session, "_settings", "snapshots"))


# -- the two models --------------------------------------------------------------------------------
def gpt_like() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[int], None], dict[str, Any]]:
    import record_overhead as ro

    torch.manual_seed(0)
    model = ro.GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = ro.make_batches()
    return model, opt, lambda i: ro.train_step(model, opt, *batches[i % len(batches)]), {}


def gpt2() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[int], None], dict[str, Any]]:
    import callback_overhead as cb  # sets HF_HUB_OFFLINE: no download
    import transformers  # noqa: F401 (before its logger is quietened: importing sets it up)

    logging.getLogger("transformers").setLevel(logging.ERROR)

    from recorder.framework import auto_modules

    model = cb.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ids = torch.randint(0, cb.VOCAB, (cb.BATCH, cb.SEQ), generator=torch.Generator().manual_seed(1))

    def step(_: int) -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step, {"modules": auto_modules(model)}


# -- timing ----------------------------------------------------------------------------------------
class Probe:
    """Training-thread CPU time inside the recorder's entry points and their parts, and the calls
    that make tensor records; installed by ``installed()``, which restores what it replaced."""

    def __init__(self) -> None:
        self.ns: collections.Counter[str] = collections.Counter()
        self.records = 0
        self.depth = 0
        self.thread = threading.get_ident()

    def timed(self, fn: Callable[..., Any], label: str | None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:  # the writer hashes payloads too
                return fn(*args, **kwargs)
            outer = label is None and self.depth == 0
            self.depth += label is None
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - t0
                self.depth -= label is None
                if outer:
                    self.ns["entry"] += spent
                elif label is not None and self.depth:
                    self.ns[label] += spent
        return wrapper

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = [(capture.Session, name, capture.Session.__dict__[name]) for name in ENTRY_POINTS]
        saved += [(obj, name, obj.__dict__[name]) for obj, name, _ in PARTS]
        saved.append((capture.Session, "_capture", capture.Session.__dict__["_capture"]))
        try:
            for name in ENTRY_POINTS:
                setattr(capture.Session, name, self.timed(getattr(capture.Session, name), None))
            for obj, name, label in PARTS:
                setattr(obj, name, self.timed(getattr(obj, name), label))
            counted = capture.Session._capture

            def record(*args: Any, **kwargs: Any) -> Any:
                self.records += threading.get_ident() == self.thread
                return counted(*args, **kwargs)

            capture.Session._capture = record  # type: ignore[method-assign]
            yield
        finally:
            for obj, name, value in saved:
                setattr(obj, name, value)


def writer_cpu_ns() -> int:
    """CPU time of the recording's writer thread so far (0 when there is none)."""
    for t in threading.enumerate():
        if t.name == "pdbg-writer" and t.ident is not None:
            with contextlib.suppress(OSError):
                return time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
    return 0


def block(step: Callable[[int], None], iterations: int, probe: Probe, run: Any | None) -> dict[str, float]:
    """One block of iterations; ``run`` given: recorded (flushed at its end). Per-iteration figures."""
    probe.ns.clear()
    probe.records = 0
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    writer, cpu, t0 = writer_cpu_ns(), time.thread_time_ns(), time.perf_counter_ns()
    for i in range(iterations):
        step(i)
    if run is not None:
        run.flush()
    out = {"wall": time.perf_counter_ns() - t0, "cpu": time.thread_time_ns() - cpu,
           "writer": writer_cpu_ns() - writer if run is not None else 0,
           "faults": resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults, "records": probe.records,
           **{k: probe.ns[k] for k in ("entry", "copy", "stats", "hash", "snapshots")}}
    return {k: v / iterations for k, v in out.items()}


def measure(model_name: str, mode: str, threads: int, iterations: int, rounds: int) -> dict[str, Any]:
    with torch_threads(threads), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, step, options = (gpt_like if model_name == "gpt-like" else gpt2)()
        for i in range(3):  # unrecorded warm-up: allocator, kernels
            step(i)
        probe = Probe()
        with tempfile.TemporaryDirectory(prefix="pdbg-entry-") as tmp, probe.installed():
            run = recorder.record(str(Path(tmp) / "run.zarr"), model=model, optimizer=opt, mode=mode, **options)
            try:
                for _ in range(2):  # the session's first iterations: fresh buffers, first commits
                    block(step, iterations, probe, run)
                paused, recorded = paused_and_resumed(
                    run, rounds, lambda on: block(step, iterations, probe, run if on else None))
            finally:
                run.close()
            if run.status != "complete":
                raise SystemExit(f"the {mode} session ended {run.status}: {run.failure}")

    def med(blocks: list[dict[str, float]], key: str) -> float:
        return statistics.median(b[key] for b in blocks)

    pairs = list(zip(recorded, paused, strict=True))
    return {"model": model_name, "mode": mode, "threads": threads,
            "recorded": {k: med(recorded, k) / 1e6 for k in ("wall", "writer", "entry", "copy", "stats", "hash",
                                                              "snapshots")},
            "paused": {"wall": med(paused, "wall") / 1e6},
            "paired": statistics.median(on["wall"] / off["wall"] for on, off in pairs),
            "added_cpu": statistics.median(on["cpu"] - off["cpu"] for on, off in pairs) / 1e6,
            "records": med(recorded, "records"), "faults": (med(paused, "faults"), med(recorded, "faults"))}


# -- report ----------------------------------------------------------------------------------------
def table(results: list[dict[str, Any]]) -> str:
    rows = ["| model, mode, threads | ms/iter unrecorded → recorded (paired) | training thread CPU added | "
            "in entry points (share of an unrecorded iteration) | copies + statistics | statistics alone | "
            "hashing | RNG + settings | bookkeeping (per tensor record) | writer CPU | minor faults |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        m = r["recorded"]
        rest = m["entry"] - m["copy"] - m["stats"] - m["hash"] - m["snapshots"]
        share = m["entry"] / r["paused"]["wall"]
        per = f" ({rest / r['records'] * 1e3:.0f} µs × {r['records']:.0f})" if r["records"] else ""
        rows.append(
            f"| {r['model']}, {r['mode']}, {r['threads']} | {r['paused']['wall']:.0f} → {m['wall']:.0f} "
            f"({r['paired']:.3f}x) | {r['added_cpu']:.1f} | {m['entry']:.1f} ({share:.1%}) | "
            f"{m['copy']:.1f} | {m['stats']:.1f} | "
            f"{m['hash']:.1f} | {m['snapshots']:.1f} | {rest:.1f}{per} | {m['writer']:.1f} | "
            f"{r['faults'][0]:.0f} → {r['faults'][1]:.0f} |")
    return "\n".join(rows)


def write_docs(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""{HEADING}

Measured on {now} by `python bench/entry_points.py --write-docs` (bench/entry_points.py): the
training thread's CPU time inside the recorder's entry points, by part, per iteration, on the
models of "Recording overhead" (gpt-like) and "Framework callbacks" (gpt2, the blocks the callbacks
record), next to the same iterations unrecorded. One session; blocks of {args.iterations} iterations
alternate between the session paused and resumed ({args.rounds} rounds; a resumed block ends with
`run.flush()`); medians over rounds, in ms per iteration unless said. "Training thread CPU
added": recorded block's CPU less the paused block's, paired by round. Copies + statistics:
payloads copied into the flight ring or the writer's queue, their statistics taken in the same
read. Bookkeeping: the rest of the entry points (tensor and step records, argument documents,
taps, queueing), also per tensor record. The wall-time ratio here comes from few rounds and
moves by several percent between runs; the CPU figures move far less. The entry points' share of an
unrecorded iteration is what recording costs at the least where nothing else competes (one torch
thread, the writer on a core of its own); with torch on every core, the writer's CPU and the
training thread's slower operators come on top of it. With torch on two threads the training
thread's CPU time also includes its spinning while torch's second thread finishes an operator, and
moves with the machine's load almost as much as wall time does; the entry points' CPU does not.

{table(results)}

Machine: {os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__},
Python {platform.python_version()}; statistics kernel {"on (numba)" if stats_mod.prepare() else "off"}.
"""
    write_section(HEADING, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--mode", choices=("stats", "flight", "full"), default="flight")
    parser.add_argument("--threads", nargs="+", type=int, default=[2, 1], help="torch threads (default 2 then 1)")
    parser.add_argument("--iterations", type=int, default=5, help="iterations per block (default 5)")
    parser.add_argument("--rounds", type=int, default=8, help="paired blocks per setting (default 8)")
    parser.add_argument("--write-docs", action="store_true", help="write its section of docs/PERFORMANCE.md")
    args = parser.parse_args()
    results = []
    for name in args.models:
        for threads in args.threads:
            r = measure(name, args.mode, threads, args.iterations, args.rounds)
            print(f"{name}, {args.mode}, {threads} thread(s): {r['paused']['wall']:.0f} -> {r['recorded']['wall']:.0f} "
                  f"ms/iter, entry points {r['recorded']['entry']:.1f} ms/iter", flush=True)
            results.append(r)
    print(table(results))
    if args.write_docs:
        write_docs(results, args)


if __name__ == "__main__":
    main()
