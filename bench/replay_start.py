"""Replay start latency: how soon after the call a step replayed from a ~1 GB recording starts computing.

Acceptance point: "replay of one step from a 1 GB recording starts computing within 0.5 s of the
call (opening included)". The figure is, from ``t0 = perf_counter()``::

    rec = replayer.open(path)
    res = replayer.replay(rec, step)        # an index, or a selector "Eq. 1@iter=K#0"

to the first line of the replayed step's own code, which appends ``perf_counter()`` to a list in
its module. The total (to the return of ``replay``, comparison included) and ``res.match`` are
reported with it. ``replayer.replay(rec, step)`` is ``Replayer(rec).replay(step)``; the bench calls
the latter so that it can reach the copy of this script the replayer loads.

The recording (built in a temporary directory, deleted at the end) holds, per iteration: one call of
an ``nn.Module`` step defined in an importable helper module (written to the temporary directory:
rebuilt from its skeleton, its weight loaded), one call of a function step defined in this script
(found again through the recorded script path, re-loaded without its ``__main__`` block), each on a
fresh random float32 tensor, and some small function steps. The step replayed is the middle
iteration's call of each. Settings:

  warm   same process as the build, what the replay reads in the page cache (earlier runs read it)
  cold   same process, the store's pages dropped from the page cache first (fsync and
         posix_fadvise DONTNEED per file; the VM's host may still cache the disk)
  fresh  a new Python process (imports done before t0, the helper module imported by the replay
         itself), the page cache dropped as for cold

Usage:
  python bench/replay_start.py                    # ~1 GB recording, 5 runs per case (~2-3 min, 2 cores)
  python bench/replay_start.py --write-docs       # also add/replace "## Replay start latency" in docs/PERFORMANCE.md
  python bench/replay_start.py --gb 0.2 --repeat 2          # quick look
  python bench/replay_start.py --profile          # cProfile of one cold replay per kind, by selector
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import math
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from docs_section import evict, write_section  # bench/ is the script's directory

import recorder
import replayer
from replayer.replay import Replayer

DOCS = Path(__file__).resolve().parent.parent / "docs" / "PERFORMANCE.md"
SECTION = "## Replay start latency"
TARGET_S = 0.5
HELPER = "replay_start_steps"  # the importable module written into the temporary directory
WIDTH = 1024  # features of the big tensors (rows follow from --tensor-mb)
SMALL_NUMEL = 256
COMPRESSION = 1.13  # random normal float32 under the default lz4 + bit shuffle (docs: 1.129)
KINDS = ("module", "script")
BYS = ("index", "selector")
SETTINGS = ("warm", "cold", "fresh")

HELPER_SOURCE = '''"""Steps of bench/replay_start.py that live in an importable module (written by the bench)."""

import time

import torch

import recorder

ENTERED: list[float] = []  # perf_counter() at each entry of Projection.forward


@recorder.paper_step("Eq. 1", description="projection (an nn.Module step in an importable module)")
class Projection(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ENTERED.append(time.perf_counter())
        return torch.tanh(x @ self.weight).sum(dim=-1)
'''

# perf_counter() at each entry of softplus_sum. The replayer runs its own copy of this script (a
# second module named __main__), whose list this is not: see entries().
ENTERED: list[float] = []


@recorder.paper_step("Eq. 2", description="softplus row sums (a function step defined in the script)")
def softplus_sum(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    ENTERED.append(time.perf_counter())
    return torch.nn.functional.softplus(x, beta=beta).sum(dim=-1)


@recorder.paper_step("Eq. 3", description="a small step (makes the step table longer)")
def small_step(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


# -- building the recording -----------------------------------------------------------------------
@dataclass
class Built:
    path: Path
    iterations: int
    steps: int
    raw_bytes: int  # payload bytes before compression (big tensors, weight once, small tensors)
    disk_bytes: int
    seconds: float
    targets: dict[str, tuple[int, str]]  # kind -> (step index, selector)


def write_helper(where: Path) -> None:
    (where / f"{HELPER}.py").write_text(HELPER_SOURCE)


def build(path: Path, helper: Any, gb: float, tensor_mb: float, small: int) -> Built:
    """Record iterations of one module step, one script step (both on fresh random data) and
    ``small`` small steps until about ``gb`` GB of compressed payload is written."""
    rows = max(1, int(tensor_mb * 2**20) // (4 * WIDTH))
    big = rows * WIDTH * 4
    per_iteration = 2 * big + 2 * small * SMALL_NUMEL * 4  # inputs of both big steps; small: in + out
    iterations = max(3, math.ceil(gb * 1e9 * COMPRESSION / per_iteration))
    torch.manual_seed(0)
    proj = helper.Projection(WIDTH)
    t0 = time.perf_counter()
    with torch.no_grad(), recorder.record(path, mode="full") as run:
        for _ in range(iterations):
            proj(torch.randn(rows, WIDTH))
            softplus_sum(torch.randn(rows, WIDTH))
            for _ in range(small):
                small_step(torch.randn(SMALL_NUMEL))
            run.next_iteration()
    seconds = time.perf_counter() - t0
    ENTERED.clear()
    helper.ENTERED.clear()
    rec = replayer.open(path)
    middle = iterations // 2
    targets = {}
    for kind, label in (("module", "Eq. 1"), ("script", "Eq. 2")):
        selector = f"{label}@iter={middle}#0"
        targets[kind] = (rec.step(selector).index, selector)
    raw = iterations * (per_iteration + 2 * rows * 4) + WIDTH * WIDTH * 4  # + outputs of the big steps
    return Built(path, iterations, len(rec), raw, rec.reader.nbytes(), seconds, targets)


# -- one timed replay -------------------------------------------------------------------------------
def entries(kind: str, rp: Replayer) -> list[float]:
    """The list the replayed step's code appended to: the helper module's (imported by reference,
    so the one in sys.modules), or that of the replayer's own copy of this script."""
    if kind == "module":
        return sys.modules[HELPER].ENTERED
    return rp.loader.main().ENTERED


def time_replay(path: Path, kind: str, which: int | str) -> dict[str, Any]:
    """Open and replay one step; seconds from the call to the step's first line, and to the end."""
    if kind == "module" and HELPER in sys.modules:
        sys.modules[HELPER].ENTERED.clear()
    t0 = time.perf_counter()
    rec = replayer.open(path)
    rp = Replayer(rec)
    res = rp.replay(which)
    t1 = time.perf_counter()
    seen = entries(kind, rp)
    if len(seen) != 1 or not t0 < seen[0] < t1:
        raise RuntimeError(f"the replayed {kind} step's entry time was not recorded once during the call: {seen}")
    if ENTERED:
        raise RuntimeError("the replay ran this process's own softplus_sum, not the replayer's copy of the script")
    return {"start": seen[0] - t0, "total": t1 - t0, "match": bool(res.match), "warnings": list(res.warnings)}


def fresh_replay(path: Path, helper_dir: Path, kind: str, which: int | str) -> dict[str, Any]:
    """time_replay in a new Python process (its imports happen before the clock starts)."""
    spec = json.dumps({"path": str(path), "helper_dir": str(helper_dir), "kind": kind, "which": which})
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(spec: str) -> None:
    args = json.loads(spec)
    sys.path.insert(0, args["helper_dir"])  # the helper module is imported by the replay, not here
    print(json.dumps(time_replay(Path(args["path"]), args["kind"], args["which"])))


def phases(path: Path, index: int, selector: str) -> dict[str, float]:
    """Seconds of the pieces a replay starts with, each on its own (one fresh open)."""
    out: dict[str, float] = {}
    t = time.perf_counter()
    rec = replayer.open(path)
    out["replayer.open(path)"] = time.perf_counter() - t
    t = time.perf_counter()
    step = rec.step(index)
    out["rec.step(index)"] = time.perf_counter() - t
    t = time.perf_counter()
    rec.step(selector)
    out["rec.step(selector), first on this open"] = time.perf_counter() - t
    t = time.perf_counter()
    records = step.records
    out["step.records (tensor records)"] = time.perf_counter() - t
    t = time.perf_counter()
    _ = (step.definition, step.arguments, step.settings, step.rng, step._doc("module"))
    out["step documents (definition, args, settings, rng, module)"] = time.perf_counter() - t
    t = time.perf_counter()
    for r in records:
        if r.role in ("input", "param", "buffer"):
            step.tensor(r.name, r.role)
    out["input and parameter payloads read"] = time.perf_counter() - t
    return out


# -- measuring ------------------------------------------------------------------------------------
def measure(built: Built, helper_dir: Path, repeat: int) -> dict[str, Any]:
    cases: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for setting in SETTINGS:
        for _ in range(repeat):
            for kind in KINDS:
                index, selector = built.targets[kind]
                for by in BYS:
                    which: int | str = index if by == "index" else selector
                    if setting != "warm":
                        evict(built.path)
                    if setting == "fresh":
                        sample = fresh_replay(built.path, helper_dir, kind, which)
                    else:
                        sample = time_replay(built.path, kind, which)
                    cases.setdefault((kind, by, setting), []).append(sample)
        print(f"  {setting}: done", flush=True)
    breakdown: dict[str, dict[str, float]] = {}
    index, selector = built.targets["module"]
    for setting in ("warm", "cold"):
        runs = []
        for _ in range(repeat):
            if setting == "cold":
                evict(built.path)
            runs.append(phases(built.path, index, selector))
        breakdown[setting] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"cases": cases, "breakdown": breakdown}


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    starts = [s["start"] for s in samples]
    return {"median": statistics.median(starts), "max": max(starts),
            "total": statistics.median(s["total"] for s in samples),
            "match": all(s["match"] for s in samples), "n": len(samples)}


KIND_TEXT = {"module": "`nn.Module` in an imported module", "script": "function in the `__main__` script"}


def tables(res: dict[str, Any]) -> str:
    lines = ["| step | by | setting | start: median ms | start: max ms | total: median ms | match |",
             "|---|---|---|---:|---:|---:|---|"]
    for kind in KINDS:
        for by in BYS:
            for setting in SETTINGS:
                s = summary(res["cases"][(kind, by, setting)])
                lines.append(f"| {KIND_TEXT[kind]} | {by} | {setting} | {s['median'] * 1e3:.0f} | "
                             f"{s['max'] * 1e3:.0f} | {s['total'] * 1e3:.0f} | {'yes' if s['match'] else '**no**'} |")
    lines += ["", "| piece (module step, each on one fresh open) | warm ms | cold ms |", "|---|---:|---:|"]
    warm, cold = res["breakdown"]["warm"], res["breakdown"]["cold"]
    lines += [f"| `{k}` | {warm[k] * 1e3:.1f} | {cold[k] * 1e3:.1f} |" if k.startswith(("replayer.", "rec."))
              else f"| {k} | {warm[k] * 1e3:.1f} | {cold[k] * 1e3:.1f} |" for k in warm]
    return "\n".join(lines)


def target_lines(res: dict[str, Any]) -> list[str]:
    lines = []
    for setting in SETTINGS:
        samples = [s for (_, _, st), v in res["cases"].items() if st == setting for s in v]
        worst = max(s["start"] for s in samples)
        verdict = "**met**" if worst <= TARGET_S else "**not met**"
        lines.append(f"- starts computing ≤ {TARGET_S:.2f} s after the call, opening included ({setting}; slowest "
                     f"of {len(samples)} runs over all four cases): {worst:.3f} s — {verdict}")
    return lines


def machine() -> str:
    return (f"{os.cpu_count()} CPUs (nproc), torch {torch.__version__}, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, Python {platform.python_version()}, "
            f"{platform.machine()}, {platform.platform()}")


def section(built: Built, res: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    mid = built.iterations // 2
    rows = max(1, int(args.tensor_mb * 2**20) // (4 * WIDTH))
    return f"""{SECTION}

Measured on {time.strftime("%Y-%m-%d %H:%M")} by `{command}`. Acceptance point: replay of one step from
a 1 GB recording starts computing within {TARGET_S} s of the call, opening included.

### What was measured

A recording of {built.disk_bytes / 1e9:.2f} GB on disk (`rec.reader.nbytes()`; about
{built.raw_bytes / 1e9:.2f} GB of payload before compression), {built.iterations} iterations,
{built.steps} steps, `mode="full"`, built in {built.seconds:.0f} s. Each iteration calls, on fresh
random float32 tensors of {rows} × {WIDTH} ({rows * WIDTH * 4 / 2**20:.0f} MiB; no deduplication):

- `Projection` (`"Eq. 1"`), an `nn.Module` step defined in an importable module: replay rebuilds
  it from its skeleton and loads its {WIDTH} × {WIDTH} weight;
- `softplus_sum` (`"Eq. 2"`), a function step defined in the script that ran as `__main__`: replay
  loads the script again (without its `if __name__ == "__main__":` block) to find it;
- {args.small} small function steps (`"Eq. 3"`, {SMALL_NUMEL} elements).

The step replayed is the first call of `"Eq. 1"` or `"Eq. 2"` in the middle iteration ({mid}), named
by its index or by the selector `"Eq. 1@iter={mid}#0"`. From `t0 = perf_counter()`:
`rec = replayer.open(path); replayer.replay(rec, step)` (as `Replayer(rec).replay(step)`, the same
thing). **start**: until the first line of the step's own code runs (it appends `perf_counter()`
to a list); **total**: until `replay` returns, the comparison with the recording included.

### Method

- **warm**: in the process that built the recording, the files the replay reads in the page cache
  (the writer drops the chunks it writes from the cache; earlier runs have read them back);
  **cold**: the same process, every file of the store written back and dropped from the page cache
  (`fsync`, `posix_fadvise(DONTNEED)`) before the call; **fresh**: a new Python process each time
  (torch, `recorder` and `replayer` imported before `t0`; the helper module is imported by the
  replay itself), the page cache dropped as for cold. Caches of the VM's host, below `/dev/vda`,
  cannot be dropped from here.
- Every call opens the recording anew. {args.repeat} runs per case; the cases are interleaved.
- The pieces a replay starts with are timed on their own in a second table (median of
  {args.repeat} fresh opens each).
- Where the time goes: `python bench/replay_start.py --profile` (cProfile of one cold replay per
  step kind, by selector).

Machine: {machine()}.

### Results

{tables(res)}

### Target

{chr(10).join(target_lines(res))}
"""


def write_docs(text: str) -> None:
    write_section(SECTION, text)


def profile(built: Built) -> None:
    for kind in KINDS:
        index, selector = built.targets[kind]
        evict(built.path)
        prof = cProfile.Profile()
        prof.enable()
        sample = time_replay(built.path, kind, selector)
        prof.disable()
        print(f"\n== cProfile: cold replay of {selector} ({kind} step): start {sample['start'] * 1e3:.0f} ms, "
              f"total {sample['total'] * 1e3:.0f} ms (with the profiler's overhead)")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.05, help="compressed payload to record, GB (default 1.05)")
    parser.add_argument("--tensor-mb", type=float, default=8.0, help="MiB per big step input (default 8)")
    parser.add_argument("--small", type=int, default=16, help="small steps per iteration (default 16)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (default 5)")
    parser.add_argument("--write-docs", action="store_true", help=f"add/replace {SECTION!r} in docs/PERFORMANCE.md")
    parser.add_argument("--profile", action="store_true", help="cProfile one cold replay per step kind instead")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    tmp = Path(tempfile.mkdtemp(prefix="pdbg-replay-start-"))
    saved_path = sys.path[:]
    try:
        write_helper(tmp)
        sys.path.insert(0, str(tmp))
        helper = importlib.import_module(HELPER)
        print(f"building the recording in {tmp} ...", flush=True)
        built = build(tmp / "run.zarr", helper, args.gb, args.tensor_mb, args.small)
        print(f"  {built.disk_bytes / 1e9:.2f} GB on disk, {built.iterations} iterations, {built.steps} steps, "
              f"{built.seconds:.0f} s; replaying {built.targets}", flush=True)
        if args.profile:
            profile(built)
            return
        res = measure(built, tmp, args.repeat)
        print()
        print(tables(res))
        print()
        print("\n".join(target_lines(res)))
        notes = {w for v in res["cases"].values() for s in v for w in s["warnings"]}
        if notes:
            print("\nreplay warnings: " + "; ".join(sorted(notes)))
        if args.write_docs:
            write_docs(section(built, res, args, " ".join(["python bench/replay_start.py", *sys.argv[1:]])))
    finally:
        sys.path[:] = saved_path
        sys.modules.pop(HELPER, None)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
