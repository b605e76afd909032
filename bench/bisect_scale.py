"""NaN origin at scale: how long ``replayer.first_nonfinite`` takes on a stats-mode recording of 1,000,000 steps.

Acceptance point: "``first_nonfinite`` on a stats-mode recording of 1,000,000 steps answers in < 1 s".
The figure is, in a fresh Python process (torch, ``recorder`` and ``replayer`` imported before the
clock starts), from ``t0 = perf_counter()``::

    rec = replayer.open(path)
    origin = replayer.first_nonfinite(rec)

The recording: a small model (25 blocks, each an ``nn.Module`` step ``"Eq. 1"`` whose forward calls a
nested function step ``"Eq. 2"``; 50 forward and 50 backward steps per iteration, 3 tensor records a
step on average) is first recorded for real with ``recorder.record(..., mode="stats")`` for a few
iterations, a NaN planted in one of them (``Eq. 2`` takes the square root of a negative number
from finite inputs; the NaN loss then poisons every parameter). Recording a million steps that way
takes ~8-9 min here (~500 us a step), so the million-step store is made from the ``StepItem`` objects
that run handed its writer thread: a clean iteration, the NaN iteration and one after it, replayed
with new step indices, iterations, parents, times and a fresh torch RNG state per iteration into a
real ``StoreWriter`` + ``Pipeline`` (the writer thread, deduplication, flags and commits exactly as
``recorder.record`` runs them). Before the big build, a small store made that way is checked
against the real recording of the same length (step columns, flags, tensor records, and the
answer of ``first_nonfinite``). Two million-step stores are timed: the NaN planted at 90 % of the
run, and a clean run (no NaN at all). Stores go to a temporary directory, deleted at the end.

Settings: **fresh**: a new process, the store's files as the build left them in the page cache;
**fresh, cache dropped**: the same after ``fsync`` + ``posix_fadvise(DONTNEED)`` of every file.
Each fresh process also times a second ``open`` + ``first_nonfinite`` (warm).

Usage:
  python bench/bisect_scale.py                    # 1,000,000 steps, 5 fresh runs per case (~4 min, 2 cores)
  python bench/bisect_scale.py --write-docs       # also add/replace the section in docs/PERFORMANCE.md
  python bench/bisect_scale.py --steps 100000 --repeat 2      # quick look
  python bench/bisect_scale.py --profile          # cProfile of first_nonfinite in a fresh process
  python bench/bisect_scale.py --measure PATH [--mode time|profile|columns]   # (child) JSON on stdout
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import xxhash
from docs_section import evict, write_section  # noqa: E402 (bench/ is the script's directory)

import recorder
import replayer
from recorder import run as run_mod
from recorder.items import StepItem
from recorder.pipeline import Pipeline
from recorder.store import backend, codecs
from recorder.store import reader as reader_mod
from recorder.store.writer import StoreWriter

DOCS = Path(__file__).resolve().parent.parent / "docs" / "PERFORMANCE.md"
SECTION = "## NaN origin on a million steps"
TARGET_S = 1.0
LAYERS, WIDTH, BATCH = 25, 8, 4  # 25 x (Eq. 1 + nested Eq. 2), forward and backward: 100 steps an iteration
NAN_LAYER = 12  # the block whose Eq. 2 takes sqrt of a negative number
NAN_SHIFT = 5.0
NAN_AT = 0.9  # the NaN iteration, as a fraction of the run
SAMPLE_ITERATIONS = 20  # the real recording the templates come from (and the check compares with)
SETTINGS = ("fresh", "fresh, cache dropped")
BISECT_FILE = os.path.join("replayer", "bisect.py")


# -- the model ------------------------------------------------------------------------------------
@recorder.paper_step("Eq. 2", description="a(h) = sqrt(softplus(h) - shift)")
def act(h: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
    return torch.sqrt(nn.functional.softplus(h) - shift)


@recorder.paper_step("Eq. 1", description="block: a(W x + b)")
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        return act(self.fc(x), shift)


class Net(nn.Module):
    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, shift if i == NAN_LAYER else 0.0)
        return x


# -- the real recording and its StepItems -------------------------------------------------------------
@dataclass
class Sample:
    path: Path
    items: list[StepItem]  # every StepItem the run's writer thread stored, in order
    iterations: int
    nan_iteration: int | None
    seconds: float

    @property
    def us_per_step(self) -> float:
        return self.seconds / len(self.items) * 1e6


def record_real(path: Path, iterations: int, nan_iteration: int | None) -> Sample:
    """Train the model under ``recorder.record(mode="stats")``, keeping the StepItems it wrote."""
    items: list[StepItem] = []
    rng_state = torch.get_rng_state()
    threads = torch.get_num_threads()
    try:
        torch.manual_seed(0)
        torch.set_num_threads(1)
        model = Net(LAYERS, WIDTH)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        with recorder.record(path, model=model, optimizer=opt, mode="stats") as run:
            store = run.pipeline._store_step  # the bound method; the instance attribute shadows it

            def keep(item: StepItem) -> None:
                items.append(item)
                store(item)

            run.pipeline._store_step = keep  # type: ignore[method-assign]
            for it in range(iterations):
                x = torch.randn(BATCH, WIDTH)
                model(x, NAN_SHIFT if it == nan_iteration else 0.0).sum().backward()
                opt.step()
                opt.zero_grad()
        seconds = time.perf_counter() - t0
    finally:
        torch.set_rng_state(rng_state)
        torch.set_num_threads(threads)
    return Sample(path, items, iterations, nan_iteration, seconds)


@dataclass
class Templates:
    """StepItems of one iteration of each kind, and where the NaN origin is in its iteration."""

    clean: list[StepItem]
    nan: list[StepItem]
    after: list[StepItem]
    origin_offset: int  # index of the origin step minus the NaN iteration's first index
    steps_per_iteration: int = field(init=False)

    def __post_init__(self) -> None:
        self.steps_per_iteration = len(self.clean)
        for kind in (self.nan, self.after):
            if len(kind) != self.steps_per_iteration:
                raise RuntimeError("iterations of the sample recording differ in length")


def templates(sample: Sample) -> Templates:
    assert sample.nan_iteration is not None and 2 <= sample.nan_iteration < sample.iterations - 1
    by_iter: dict[int, list[StepItem]] = {}  # in the order the writer got them: inner steps end first
    for item in sample.items:
        by_iter.setdefault(int(item.row["iteration"]), []).append(item)
    origin = replayer.first_nonfinite(replayer.open(sample.path))
    if origin.step is None or origin.step.iteration != sample.nan_iteration:
        raise RuntimeError(f"the sample recording's NaN origin is not in iteration {sample.nan_iteration}: "
                           f"{origin.cause}")
    nan = by_iter[sample.nan_iteration]
    return Templates(clean=by_iter[1], nan=nan, after=by_iter[sample.nan_iteration + 1],
                     origin_offset=origin.step.index - min(i.index for i in nan))


# -- the fast path: those StepItems, replayed through a real StoreWriter + Pipeline ----------------
@dataclass
class Built:
    path: Path
    steps: int
    iterations: int
    nan_iteration: int | None
    expected_origin: int | None
    tensors: int
    disk_bytes: int
    seconds: float


def _shift(value: int, by: int) -> int:
    return value + by if value >= 0 else value


def _rng_of_iteration(template: dict[str, tuple[Any, Any]], seed: int) -> dict[str, tuple[Any, Any]]:
    """The template's RNG parts with a new torch CPU state (training draws a batch every iteration),
    made on a private generator: the process's RNG is left alone."""
    state = torch.Generator().manual_seed(seed).get_state()
    return {**template, "torch": (xxhash.xxh3_64_intdigest(state.numpy().data), state)}


def build(path: Path, tpl: Templates, iterations: int, nan_iteration: int | None) -> Built:
    """Write ``iterations`` iterations (clean ones, the NaN one, then poisoned ones) as ``Run`` does:
    a StoreWriter on a new directory store, a Pipeline and its writer thread, closed "complete"."""
    t0 = time.perf_counter()
    started = time.time()
    writer = StoreWriter(backend.open_store(path, mode="w"), run_attrs=run_mod.run_metadata(started, "stats", 1),
                         compression=codecs.parse(None))
    # Items are submitted with a nominal size so that backpressure bounds the queue (the real
    # recorder submits StepItems with 0 bytes, but its training loop cannot outrun the writer).
    pipeline = Pipeline(writer, max_queue_bytes=64 << 20, flush_interval=1.0)
    blosc = run_mod._single_threaded_blosc()
    per = tpl.steps_per_iteration
    duration = max(i.row["t_end"] for i in tpl.clean) - min(i.row["t_start"] for i in tpl.clean)
    t_base = min(i.row["t_start"] for i in tpl.clean)
    try:
        for it in range(iterations):
            kind = tpl.clean if nan_iteration is None or it < nan_iteration else \
                tpl.nan if it == nan_iteration else tpl.after
            by = it * per - min(i.index for i in kind)  # template index -> this iteration's index
            rng = _rng_of_iteration(kind[0].rng, it)
            dt = it * duration - t_base
            t_kind = min(i.row["t_start"] for i in kind) if kind is not tpl.clean else t_base
            for item in kind:
                row = dict(item.row, iteration=it, parent=_shift(item.row["parent"], by),
                           forward=_shift(item.row["forward"], by),
                           t_start=item.row["t_start"] - t_kind + t_base + dt,
                           t_end=item.row["t_end"] - t_kind + t_base + dt)
                step = dataclasses.replace(item, index=item.index + by, row=row, rng=rng)  # (the rest as recorded)
                if not pipeline.submit(step, 1024):
                    raise RuntimeError(f"the writer stopped: {pipeline.error!r}")
        info = {"ended_unix": time.time(), "iterations": iterations, "steps_started": iterations * per,
                "peak_queue_bytes": 0}
        pipeline.close("complete", info)
    finally:
        run_mod._restore_blosc(blosc)
    if pipeline.error is not None:
        raise RuntimeError(f"the writer failed: {pipeline.error!r}\n{pipeline.error_trace}")
    seconds = time.perf_counter() - t0
    rec = replayer.open(path)
    if rec.status != "complete" or len(rec) != iterations * per:
        raise RuntimeError(f"the built store is {rec!r}, expected {iterations * per} steps, complete")
    expected = None if nan_iteration is None else nan_iteration * per + tpl.origin_offset
    return Built(path, len(rec), iterations, nan_iteration, expected, int(rec.rank.lengths["tensors"]),
                 rec.reader.nbytes(), seconds)


# -- the check: fast path == recorder.record --------------------------------------------------------
STEP_CHECK = ("name", "definition", "phase", "iteration", "call", "parent", "forward", "module_path", "module",
              "status", "flags", "settings", "args", "output", "extra", "tensor_start", "tensor_count")
TENSOR_CHECK = ("step", "role", "name", "dtype", "device", "requires_grad", "ndim", "dims_start", "payload")


def _docs_equal(a: replayer.Recording, b: replayer.Recording, column: str) -> bool:
    ids_a, ids_b = (np.asarray(r.rank.column(f"steps/{column}")) for r in (a, b))
    pairs = set(zip(ids_a.tolist(), ids_b.tolist()))
    return all(a.rank.doc(int(i)) == b.rank.doc(int(j)) for i, j in pairs)


def check(real: Sample, fast: Built) -> list[str]:
    """Differences between the real recording and the fast path's store of the same run (none: [])."""
    a, b = replayer.open(real.path), replayer.open(fast.path)
    out: list[str] = []
    if len(a) != len(b):
        return [f"steps: {len(a)} real, {len(b)} fast"]
    for col in STEP_CHECK:
        ca, cb = (np.asarray(r.rank.column(f"steps/{col}")) for r in (a, b))
        if col in ("name", "definition", "module_path", "module", "settings", "args", "output", "extra"):
            if not _docs_equal(a, b, col):
                out.append(f"steps/{col}: documents differ")
        elif not np.array_equal(ca, cb):
            out.append(f"steps/{col}: {int((ca != cb).sum())} rows differ")
    if a.rank.lengths["tensors"] != b.rank.lengths["tensors"]:
        return out + ["tensor records: counts differ"]
    for col in TENSOR_CHECK:
        ca, cb = (np.asarray(r.rank.column(f"tensors/{col}")) for r in (a, b))
        if col in ("name", "dtype", "device"):
            ok = all(a.rank.doc(int(i)) == b.rank.doc(int(j)) for i, j in set(zip(ca.tolist(), cb.tolist())))
            if not ok:
                out.append(f"tensors/{col}: documents differ")
        elif not np.array_equal(ca, cb):
            out.append(f"tensors/{col}: {int((ca != cb).sum())} rows differ")
    sa, sb = (np.asarray(r.rank.column("tensors/stats")) for r in (a, b))
    if not np.array_equal(sa[:, 6:] > 0, sb[:, 6:] > 0):
        out.append("tensors/stats: NaN/Inf counts zero in one store and not the other")
    if not np.array_equal(np.asarray(a.rank.column("dims/values")), np.asarray(b.rank.column("dims/values"))):
        out.append("dims/values differ")
    oa, ob = replayer.first_nonfinite(a), replayer.first_nonfinite(b)
    idx = [(o.step.index if o.step else None, [s.index for s in o.spread]) for o in (oa, ob)]
    if idx[0] != idx[1] or oa.cause != ob.cause:
        out.append(f"first_nonfinite: real {idx[0]} {oa.cause!r}, fast {idx[1]} {ob.cause!r}")
    if idx[1][0] != fast.expected_origin:
        out.append(f"first_nonfinite found step {idx[1][0]}, planted {fast.expected_origin}")
    return out


# -- timing, in fresh processes ---------------------------------------------------------------------
def timed(path: Path) -> tuple[float, replayer.Origin]:
    t0 = time.perf_counter()
    rec = replayer.open(path)
    origin = replayer.first_nonfinite(rec)
    return time.perf_counter() - t0, origin


def columns_read(path: Path) -> tuple[float, list[dict[str, Any]]]:
    """One timed call that also notes every whole column read (``RankReader.column``, patched for the
    call and restored): which function of replayer/bisect.py asked, rows, bytes and seconds."""
    original = reader_mod.RankReader.column
    reads: list[dict[str, Any]] = []

    def column(self: reader_mod.RankReader, name: str) -> np.ndarray:
        if name in self._columns:
            return original(self, name)
        t = time.perf_counter()
        out = original(self, name)
        seconds = time.perf_counter() - t
        caller = next((f.name for f in reversed(traceback.extract_stack())
                       if f.filename.endswith(BISECT_FILE) and f.name != "_column"), "?")
        reads.append({"column": name, "by": caller, "rows": len(out), "bytes": int(out.nbytes), "s": seconds})
        return out

    reader_mod.RankReader.column = column  # type: ignore[method-assign]
    try:
        total, _ = timed(path)
    finally:
        reader_mod.RankReader.column = original  # type: ignore[method-assign]
    return total, reads


def child(path: Path, mode: str) -> None:
    """One fresh process: ``time`` (the timed call, a second one, the answer), ``profile`` (the same
    under cProfile, the statistics on stderr) or ``columns`` (see columns_read); JSON on stdout."""
    if mode == "columns":
        total, reads = columns_read(path)
        print(json.dumps({"total": total, "reads": reads}))
        return
    prof = cProfile.Profile() if mode == "profile" else None
    if prof is not None:
        prof.enable()
    first, origin = timed(path)
    if prof is not None:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
        text.write("\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue(), file=sys.stderr)
    second, again = timed(path)
    print(json.dumps({"first": first, "second": second, "found": origin.found,
                      "index": origin.step.index if origin.step else None, "cause": origin.cause,
                      "spread": [s.index for s in origin.spread], "same": again.cause == origin.cause}))


def fresh(path: Path, drop_cache: bool, mode: str = "time") -> dict[str, Any]:
    """``child`` in a new Python process."""
    if drop_cache:
        evict(path)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", str(path), "--mode", mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    if mode == "profile":
        print(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(built: Built, repeat: int) -> dict[str, list[dict[str, Any]]]:
    """``repeat`` fresh runs per setting, interleaved; raises if an answer is wrong."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    for _ in range(repeat):
        for setting in SETTINGS:
            sample = fresh(built.path, drop_cache=setting != "fresh")
            ok = (not sample["found"]) if built.expected_origin is None else sample["index"] == built.expected_origin
            if not ok or not sample["same"]:
                raise RuntimeError(f"wrong answer on {built.path}: {sample}; planted {built.expected_origin}")
            runs[setting].append(sample)
    return runs


# -- report -----------------------------------------------------------------------------------------
def case_name(built: Built) -> str:
    return "clean run" if built.nan_iteration is None else f"NaN in iteration {built.nan_iteration:,}"


def answer(built: Built, sample: dict[str, Any]) -> str:
    if built.expected_origin is None:
        return "no non-finite values (`found` False)"
    return f"step {sample['index']:,} = planted; spread {sample['spread'][0]:,}…"


def table(cases: list[tuple[Built, dict[str, list[dict[str, Any]]]]]) -> str:
    lines = ["| recording | setting | open + first_nonfinite: median ms | max ms | second call: median ms | answer |",
             "|---|---|---:|---:|---:|---|"]
    for built, runs in cases:
        for setting, samples in runs.items():
            first = [s["first"] * 1e3 for s in samples]
            second = [s["second"] * 1e3 for s in samples]
            lines.append(f"| {case_name(built)} | {setting} | {statistics.median(first):.0f} | {max(first):.0f} | "
                         f"{statistics.median(second):.0f} | {answer(built, samples[0])} |")
    return "\n".join(lines)


def sizes(cases: list[tuple[Built, Any]]) -> str:
    lines = ["| recording | steps | iterations | tensor records | on disk | built in |",
             "|---|---:|---:|---:|---:|---:|"]
    for built, _ in cases:
        lines.append(f"| {case_name(built)} | {built.steps:,} | {built.iterations:,} | {built.tensors:,} | "
                     f"{built.disk_bytes / 1e6:.1f} MB | {built.seconds:.0f} s |")
    return "\n".join(lines)


def reads_table(reads: list[tuple[Built, dict[str, Any]]]) -> str:
    """Whole columns read by one fresh call (cache dropped), grouped by the bisect function asking."""
    lines = ["| recording | asked by (`replayer/bisect.py`) | whole columns read | rows each | MB in memory | ms |",
             "|---|---|---|---:|---:|---:|"]
    for built, res in reads:
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in res["reads"]:
            groups.setdefault(r["by"], []).append(r)
        for by, rs in groups.items():
            rows = sorted({r["rows"] for r in rs})
            names = ", ".join(f"`{r['column']}`" for r in rs)
            lines.append(f"| {case_name(built)} | `{by}` | {names} | "
                         f"{', '.join(f'{n:,}' for n in rows)} | {sum(r['bytes'] for r in rs) / 1e6:.0f} | "
                         f"{sum(r['s'] for r in rs) * 1e3:.0f} |")
        lines.append(f"| {case_name(built)} | **the whole call** | {len(res['reads'])} columns, "
                     f"{sum(r['s'] for r in res['reads']) * 1e3:.0f} ms of reads | | "
                     f"{sum(r['bytes'] for r in res['reads']) / 1e6:.0f} | {res['total'] * 1e3:.0f} |")
    return "\n".join(lines)


def worst(cases: list[tuple[Built, dict[str, list[dict[str, Any]]]]]) -> float:
    return max(s["first"] for _, runs in cases for samples in runs.values() for s in samples)


def target_lines(cases: list[tuple[Built, dict[str, list[dict[str, Any]]]]], steps: int) -> list[str]:
    w = worst(cases)
    met = "**met**" if w < TARGET_S else "**not met**"
    return [f"- `first_nonfinite` on {steps:,} steps, opening included, < {TARGET_S:.0f} s (slowest of "
            f"{sum(len(s) for _, r in cases for s in r.values())} fresh runs, both recordings, both settings): "
            f"{w:.3f} s — {met}"]


def machine() -> str:
    return (f"{os.cpu_count()} CPUs (nproc), torch {torch.__version__}, numpy {np.__version__}, "
            f"Python {platform.python_version()}, {platform.machine()}, {platform.platform()}")


def section(sample: Sample, check_steps: int, cases: list[tuple[Built, Any]], reads: list[tuple[Built, Any]],
            repeat: int, command: str) -> str:
    nan_case = next(b for b, _ in cases if b.nan_iteration is not None)
    per = nan_case.steps // nan_case.iterations
    return f"""{SECTION}

Measured on {time.strftime("%Y-%m-%d %H:%M")} by `{command}`. Acceptance point: `first_nonfinite` on a
stats-mode recording of 1,000,000 steps answers in < {TARGET_S:.0f} s.

### What was measured

From `t0 = perf_counter()` in a new Python process (torch, `recorder` and `replayer` imported
before): `rec = replayer.open(path); origin = replayer.first_nonfinite(rec)` (statistics only, no
`ops=True` replay). The answer is checked every time: the planted origin step, or `found` False.

The recordings: a model of {LAYERS} blocks, each an `nn.Module` step (`"Eq. 1"`, `Linear({WIDTH}, {WIDTH})`) whose
forward calls a nested function step (`"Eq. 2"`, `sqrt(softplus(h) - shift)`): {per} steps per
iteration ({per // 2} forward, {per // 2} backward, nested in both phases), 3 tensor records a step on
average (inputs, parameters, outputs; grad outputs, grad inputs, parameter grads), statistics only.
In the NaN iteration block {NAN_LAYER}'s `"Eq. 2"` gets `shift={NAN_SHIFT}`: it produces NaN from finite inputs;
the rest of that iteration's steps, and after the SGD step every step of every later iteration,
see non-finite inputs and results.

- Recording {nan_case.steps:,} steps with `recorder.record(mode="stats")` costs
  {sample.us_per_step:.0f} µs a step here ({sample.us_per_step * nan_case.steps / 60e6:.0f} min), so the
  stores were built from a real one: {sample.iterations} iterations recorded with `recorder.record`,
  and the `StepItem`s its writer thread stored (one clean iteration, the NaN iteration, the one
  after) replayed with new indices, iterations, parents, forward links, times and a new torch RNG
  state per iteration into a `StoreWriter` + `Pipeline` made as `Run` makes them (same writer
  thread: documents deduplicated, `steps/flags` and statuses computed by `Pipeline._store_step`,
  commits every second, closed `complete`).
- Checked first: a store of {check_steps:,} steps made that way equals the real recording of the same run
  (every step column but times and RNG, every tensor record column, dims, which statistics are
  non-finite, and `first_nonfinite`'s origin, spread and cause).
- **fresh**: the store's files as the build left them in the page cache; **fresh, cache dropped**:
  every file written back and dropped from the page cache first (`fsync`, `posix_fadvise(DONTNEED)`;
  the VM host's cache below `/dev/vda` cannot be dropped from here). **second call**: a second
  `open` + `first_nonfinite` in the same process. {repeat} runs per setting, interleaved.
- Where the time goes: one more fresh run per recording (cache dropped) notes every whole column
  `RankReader.column` reads and how long it took (table below); `python bench/bisect_scale.py
  --profile` runs cProfile on one.

Machine: {machine()}.

{sizes(cases)}

### Results

{table(cases)}

{reads_table(reads)}

### Target

{chr(10).join(target_lines(cases, nan_case.steps))}
"""


def write_docs(text: str) -> None:
    write_section(SECTION, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="steps per recording (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=5, help="fresh runs per setting (default 5)")
    parser.add_argument("--write-docs", action="store_true", help=f"add/replace {SECTION!r} in docs/PERFORMANCE.md")
    parser.add_argument("--profile", action="store_true", help="cProfile first_nonfinite (NaN case) instead")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("time", "profile", "columns"), default="time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        child(args.measure, args.mode)
        return
    tmp = Path(tempfile.mkdtemp(prefix="pdbg-bisect-scale-"))
    try:
        nan_sample = int(SAMPLE_ITERATIONS * NAN_AT)
        print(f"recording {SAMPLE_ITERATIONS} iterations with recorder.record in {tmp} ...", flush=True)
        sample = record_real(tmp / "real.zarr", SAMPLE_ITERATIONS, nan_sample)
        print(f"  {len(sample.items)} steps in {sample.seconds:.1f} s ({sample.us_per_step:.0f} us/step)", flush=True)
        tpl = templates(sample)
        small = build(tmp / "small.zarr", tpl, SAMPLE_ITERATIONS, nan_sample)
        diffs = check(sample, small)
        if diffs:
            raise RuntimeError("the fast path's store differs from the real recording:\n  " + "\n  ".join(diffs))
        print(f"  check: a fast-path store of {small.steps} steps equals the real recording "
              f"(origin step {small.expected_origin})", flush=True)
        iterations = max(4, args.steps // tpl.steps_per_iteration)
        cases: list[tuple[Built, dict[str, list[dict[str, Any]]]]] = []
        reads: list[tuple[Built, dict[str, Any]]] = []
        for nan_iteration in (int(iterations * NAN_AT), None):
            name = "nan" if nan_iteration is not None else "clean"
            print(f"building {iterations * tpl.steps_per_iteration:,} steps ({name}) ...", flush=True)
            built = build(tmp / f"{name}.zarr", tpl, iterations, nan_iteration)
            print(f"  {built.steps:,} steps, {built.tensors:,} tensor records, {built.disk_bytes / 1e6:.1f} MB, "
                  f"{built.seconds:.0f} s; planted origin {built.expected_origin}", flush=True)
            if args.profile:
                fresh(built.path, drop_cache=True, mode="profile")
                return
            cases.append((built, measure(built, args.repeat)))
            reads.append((built, fresh(built.path, drop_cache=True, mode="columns")))
            shutil.rmtree(built.path)  # the disk holds one million-step store at a time
        print()
        print(sizes(cases))
        print()
        print(table(cases))
        print()
        print(reads_table(reads))
        print()
        print("\n".join(target_lines(cases, cases[0][0].steps)))
        if args.write_docs:
            command = "python bench/bisect_scale.py " + " ".join(sys.argv[1:])
            write_docs(section(sample, small.steps, cases, reads, args.repeat, command.strip()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
