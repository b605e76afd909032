"""What each kind of tensor record costs a training step: one flight-mode session on the framework
callbacks' GPT-2, its blocks of iterations recorded in full, or with some records left out.

bench/entry_points.py times the recorder's calls from inside (CPU clock, wrapped functions). This
script measures the other way round, by wall time: how much less a step costs when a kind of record
is not made at all, so that the cache misses and slower operators a record causes beside its own
code are counted too. The variants (measurement only: what they leave out, the ring does not hold):

  everything           recorded as a user's session is
  no parameter records parameters and parameter gradients not captured at all
  params: copy+stats   parameters and their gradients copied into the staging pool with their
                       statistics (the kernel's fused copy), and nothing else (no record, no ring)
  params: stats only   their statistics read, no copy, no record
  params after forward each call's parameters captured when its forward returns (just read by its
                       operators) instead of before it runs; recorded in full
  no tensor records    no tensor captured: steps, RNG and settings, taps and hooks only
  no tensors, no snapshots   as "no tensor records", each step also given the RNG and settings
                       snapshots the session took first instead of taking its own

Method: blocks of ``--iterations`` iterations rotate over the session paused and each variant
resumed (``--rounds`` rounds, the order rotating every round; a resumed block ends with
``run.flush()``, so the writer's work for it is inside it). A variant's cost is its block's ms per
iteration less the paused block's of the same round: median over rounds, with its 95% bootstrap
interval.

Usage:
  python bench/record_parts.py                      # 2 torch threads, 16 rounds (~3 min)
  python bench/record_parts.py --threads 1 --rounds 8
  python bench/record_parts.py --write-docs         # also (re)write its section of docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's recorder, before an installed one
from docs_section import median_interval, rotated, torch_threads, write_section  # noqa: E402 (bench/ is the script's directory)
from entry_points import gpt2  # noqa: E402

import recorder  # noqa: E402
from recorder import capture, payload, snapshot  # noqa: E402
from recorder import stats as stats_mod  # noqa: E402
from recorder.items import copy_buffer  # noqa: E402

HEADING = "## What each kind of record costs"
PARAMS = frozenset({"param", "param_grad"})
VARIANTS = ("everything", "no parameter records", "params: copy+stats", "params: stats only",
            "params after forward", "no tensor records", "no tensors, no snapshots")


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """``Session._capture`` (and, for "params after forward", ``Session._exit``) as the variant has
    them inside the block; the recorder's own put back after it."""
    Session, Rng = capture.Session, snapshot.RngReader
    saved = {k: Session.__dict__[k] for k in ("_capture", "_exit", "_settings")}
    saved_parts = Rng.__dict__["parts"]
    full: Callable[..., str] = saved["_capture"]
    deferred: dict[int, list[tuple[str, torch.Tensor]]] = {}

    def lean(self: Any, frame: Any, role: str, rec: str, t: torch.Tensor) -> str:
        if name.startswith("no tensor") or (name == "no parameter records" and role in PARAMS):
            return rec
        if role not in PARAMS:
            return full(self, frame, role, rec, t)
        if name == "params after forward":
            if role == "param":
                deferred.setdefault(id(frame), []).append((rec, t))
                return rec
            return full(self, frame, role, rec, t)
        t = t.detach()
        if name == "params: stats only":
            stats_mod.host_stats(t)
            return rec
        units, _, _ = payload.as_units(t)  # params: copy+stats
        buf = self.pipeline.pool.take(units.nbytes)
        dst = copy_buffer(units.nbytes) if buf is None else buf[:units.nbytes]
        stats_mod.copy_stats(t, dst.view(units.dtype), units)
        if buf is not None:
            self.pipeline.pool.give(buf)
        return rec

    def exit_after_params(self: Any, frame: Any, out: Any, link: Any) -> Any:
        for rec, t in deferred.pop(id(frame), ()):
            full(self, frame, "param", rec, t)
        return saved["_exit"](self, frame, out, link)

    try:
        if name != "everything":
            Session._capture = lean  # type: ignore[method-assign]
        if name == "params after forward":
            Session._exit = exit_after_params  # type: ignore[method-assign]
        if name == "no tensors, no snapshots":
            Session._settings = _first_call(saved["_settings"])  # type: ignore[method-assign]
            Rng.parts = _first_call(saved_parts)  # type: ignore[method-assign]
        yield
    finally:
        for k, v in saved.items():
            setattr(Session, k, v)
        Rng.parts = saved_parts  # type: ignore[method-assign]


def _first_call(method: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``method`` answering every call with what its first call returned."""
    first: list[Any] = []

    def again(self: Any) -> Any:
        if not first:
            first.append(method(self))
        return first[0]
    return again


def measure(threads: int, iterations: int, rounds: int, names: list[str]) -> dict[str, Any]:
    """Per variant: ms per iteration added over the paused blocks, paired by round."""
    with torch_threads(threads), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, step, options = gpt2()
        for i in range(3):  # unrecorded warm-up: allocator, kernels
            step(i)
        ms: dict[str, list[float]] = {n: [] for n in ["paused", *names]}
        with tempfile.TemporaryDirectory(prefix="pdbg-parts-") as tmp:
            run = recorder.record(str(Path(tmp) / "run.zarr"), model=model, optimizer=opt, mode="flight", **options)
            try:
                for i in range(2 * iterations):  # the ring's first fill, fresh buffers
                    step(i)
                run.flush()
                order = ["paused", *names]
                for r in range(rounds):
                    for n in rotated(order, r):
                        if n == "paused":
                            run.pause()
                        t0 = time.perf_counter()
                        with variant(n if n != "paused" else "everything"):
                            for i in range(iterations):
                                step(i)
                            if n != "paused":
                                run.flush()
                        ms[n].append((time.perf_counter() - t0) / iterations * 1e3)
                        if n == "paused":
                            run.resume()
            finally:
                run.close()
            if run.status != "complete":
                raise SystemExit(f"the session ended {run.status}: {run.failure}")
    added = {n: [v - p for v, p in zip(ms[n], ms["paused"], strict=True)] for n in names}
    return {"threads": threads, "paused": statistics.median(ms["paused"]),
            "added": {n: (statistics.median(a), median_interval(a)) for n, a in added.items()}}


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| torch threads | unrecorded ms/iter | " + " | ".join(VARIANTS) + " |",
            "|---:|---:|" + "---:|" * len(VARIANTS)]
    for r in results:
        cells = []
        for n in VARIANTS:
            if n in r["added"]:
                med, (lo, hi) = r["added"][n]
                cells.append(f"{med:+.1f} ({lo:+.1f} to {hi:+.1f})")
            else:
                cells.append("–")
        rows.append(f"| {r['threads']} | {r['paused']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_docs(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""{HEADING}

Measured on {now} by `python bench/record_parts.py --write-docs` (bench/record_parts.py): the
framework callbacks' GPT-2 (4 blocks recorded, forward and backward: per iteration 96 parameter and
parameter-gradient records, 25 MB; 20 activation and gradient records, 16 MB; 8 steps) in one
flight-mode session, its blocks of {args.iterations} iterations recorded in full or with a kind of
record left out (measurement variants: what they leave out, the ring does not hold), against the
session paused; {args.rounds} rounds, the order rotating. ms added per iteration over the paused
block of the same round: median over rounds (95% bootstrap interval).

{table(results)}

Variants: "no parameter records": parameters and their gradients not captured; "params:
copy+stats": they are copied into the staging pool with their statistics, and nothing else is
done with them; "params: stats only": their statistics read, no copy; "params after forward":
each call's parameters captured when its forward returns (their bytes just read by its operators)
instead of before; "no tensor records": no tensor captured at all (steps, RNG and settings
snapshots, taps and hooks, the writer's step records); "no tensors, no snapshots": that, with
every step given the first RNG and settings snapshots of the block instead of taking its own.
What the parts say about the callbacks' target: "Where the callbacks' 2-thread target falls short,
by kind of record" in "Recording overhead: spread between runs, and what changed".

Machine: {os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, Python
{platform.python_version()}; statistics kernel {"on (numba)" if stats_mod.prepare() else "off"}.
"""
    write_section(HEADING, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", nargs="+", type=int, default=[2], help="torch threads (default 2)")
    parser.add_argument("--iterations", type=int, default=5, help="iterations per block (default 5)")
    parser.add_argument("--rounds", type=int, default=16, help="rounds of blocks (default 16)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--write-docs", action="store_true", help="write its section of docs/PERFORMANCE.md")
    args = parser.parse_args()
    results = []
    for threads in args.threads:
        r = measure(threads, args.iterations, args.rounds, args.variants)
        print(f"{threads} thread(s): unrecorded {r['paused']:.0f} ms/iter; added: "
              + ", ".join(f"{n} {m:+.1f}" for n, (m, _) in r["added"].items()), flush=True)
        results.append(r)
    print(table(results))
    if args.write_docs:
        write_docs(results, args)


if __name__ == "__main__":
    main()
