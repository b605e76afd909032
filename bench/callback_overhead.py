"""What the framework callbacks cost per training step: PyTorch Lightning and Hugging Face's Trainer
training a small GPT-2 with and without ``PaperDebuggerCallback`` (flight mode, keep=2, no NaN).

Variants, each training its own copy of the model (same initial weights, same batches):
  lightning            a LightningModule around the model, lightning.pytorch.Trainer, no callback
  lightning+callback   the same with recorder.lightning.PaperDebuggerCallback(path)
  lightning+record     (--by-hand) no callback: recorder.record(path, model=m, optimizer="auto",
                       mode="flight", modules=["transformer.h.*"]) around fit(), the same steps
                       recorded by hand
  hf, hf+callback, hf+record   the same with transformers.Trainer and recorder.huggingface

The callback records what ``modules=None`` picks: the model's layers, ``transformer.h.*`` (4 blocks,
forward and backward: 8 steps per training step). The +record variant (``--by-hand``) tells the
callback's own cost (its hooks, pauses, paths) from the recording's; it is left out by default, so
that the rounds the target is judged on come sooner.

Method (as bench/record_overhead.py, paired rounds): one block (one ``fit()``/``train()`` of K
optimizer steps, each into a new recording) per variant per round, round-robin, the order rotating
every round, after a warm-up block each. Each variant trains in a worker process of its own
(``Workers``), one block at a time: a recording changes glibc's heap, and a baseline trained in the
same process as recordings took fewer page faults than one that never recorded. ``--heap`` says what
heap the workers have: ``fixed`` (the default) turns glibc's trimming off in every worker, so no
variant takes page faults and the comparison is of the work each does; ``glibc`` keeps glibc's
defaults (each worker's heap history then sets its faults, a few percent either way); ``shared``
runs every variant in this one process, as before 2026-12-04. A timing callback notes
the end of every training step; a block's figure is (end of its last step - end of step S) /
(K - S), S = ``SETTLE`` (3): the training loop in its steady state, every variant timed
alike. The first step (allocator, kernels) and, with the callback, the flight ring's first fill
(keep=2: full from the third step; new buffers, their page faults) are left out of it: they are paid
once per training. The fixed costs of a recording, opening its store when training starts, that first
fill, and writing the ring at the end, are shown apart (a block's wall time less K steps at its
per-step figure, median over blocks, against the baseline's).
The figures are medians over blocks. The target is judged on the paired ratio: the median over
rounds of the callback's block / the block without it of the same round, with its 95% bootstrap
interval; met when the whole interval is within the target, not met when all of it is above,
undecided when it spans it (docs_section.judge).

Usage:
  python bench/callback_overhead.py                    # 12 blocks x 16 steps per variant, torch on 2
                                                       # then 1 thread(s), ~8 min on 2 cores
  python bench/callback_overhead.py --by-hand          # also record() by hand (~8 min)
  python bench/callback_overhead.py --threads 1        # one thread count only
  python bench/callback_overhead.py --blocks 2 --steps 5 --frameworks hf    # quick look
  python bench/callback_overhead.py --heap glibc       # page faults as glibc's defaults give them
  python bench/callback_overhead.py --write-docs       # also (re)write its section of docs/PERFORMANCE.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from docs_section import DOCS, environment, interval_text, judged, paired, rotated, torch_threads, write_section  # noqa: E402 (bench/ is the script's directory)

import recorder  # noqa: E402
from recorder.framework import auto_modules  # noqa: E402
from recorder.store.reader import RunReader  # noqa: E402

HEADING = "## Framework callbacks"
LAYERS, D_MODEL, HEADS, SEQ, VOCAB, BATCH = 4, 256, 4, 128, 512, 8
TARGET = 1.10  # the callback adds at most 10% to the step time
# A block's per-step figure starts at the end of this step: flight mode's ring (keep=2) is full from the
# third iteration on; the steps before it (the ring's first fill: new buffers, their page faults) are
# part of a recording's fixed cost, paid once per training, as opening the store is
SETTLE = 3
# --heap fixed: glibc's heap never trimmed, and no block under 32 MiB (mmap's largest threshold) served
# by mmap, in every worker: training then takes no page faults, with the callback or without (see Workers)
NO_TRIM = {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}
HEAPS = {
    "fixed": "each variant in a worker process of its own, with glibc's heap trimming off in every worker "
             f"({', '.join(f'{k}={v}' for k, v in NO_TRIM.items())}): no variant takes page faults, so the "
             "comparison is of the work each one does",
    "glibc": "each variant in a worker process of its own, glibc's defaults: page faults as a user's process "
             "takes them, as many as each process's heap history makes (it moved a ratio by up to 7%)",
    "shared": "all variants in this one process, as before 2026-12-04: the baseline then trains in a heap the "
              "recordings before it changed, with fewer page faults than a process that never recorded",
}
MB = 1e6


# -- the model and the data ---------------------------------------------------------------------------
def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # use_cache=False, as the callback advises for recordings that replay (training does not use the cache)
    return GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=D_MODEL, n_head=HEADS, n_positions=SEQ,
                                      vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, use_cache=False))


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# -- one block per framework --------------------------------------------------------------------------
def _now() -> tuple[float, int]:
    """The time, and the minor page faults of the process so far."""
    return time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def lightning_block(model: torch.nn.Module, steps: int, callback: Any) -> list[tuple[float, int]]:
    """One fit of ``steps`` optimizer steps; when each step ended (time, minor faults so far)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[tuple[float, int]] = []

        def on_train_batch_end(self, *_: Any) -> None:
            self.ends.append(_now())

    clock = Clock()
    trainer = pl.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         callbacks=[clock] + ([callback] if callback else []))
    loader = torch.utils.data.DataLoader(Tokens(steps * BATCH), batch_size=BATCH)
    trainer.fit(Module(), loader)
    return clock.ends


def hf_block(model: torch.nn.Module, steps: int, callback: Any, out: Path) -> list[tuple[float, int]]:
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[tuple[float, int]] = []

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.ends.append(_now())

    clock = Clock()
    args = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=BATCH, report_to=[],
                             save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0, learning_rate=3e-4)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(steps * BATCH),
                      callbacks=[clock] + ([callback] if callback else []))
    trainer.remove_callback(PrinterCallback)  # it prints the final metrics (disable_tqdm=True)
    trainer.train()
    return clock.ends


@dataclass
class Variant:
    """One variant's model copy and what its blocks measured."""

    name: str
    framework: str
    model: torch.nn.Module | None  # None in the parent when each variant trains in a worker process
    how: str  # "" (no recording), "callback" or "record"
    per_step: list[float] = field(default_factory=list)  # seconds per step, one per block
    overhead: list[float] = field(default_factory=list)  # block wall time less steps x per-step
    ring_peak: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)  # the process's minor page faults per step, one per block

    def forget(self) -> None:
        for value in (self.per_step, self.overhead, self.ring_peak, self.problems, self.faults):
            value.clear()


def steady(ends: list[tuple[float, int]], settle: int) -> tuple[float, float]:
    """Seconds and minor page faults per step from the end of step ``settle`` (1-based) to the end
    of the last, from when each step ended; a block too short for that times its last step."""
    first = min(settle, len(ends) - 1) - 1
    n = len(ends) - 1 - first
    return (ends[-1][0] - ends[first][0]) / n, (ends[-1][1] - ends[first][1]) / n


def run_block(v: Variant, steps: int, tmp: Path, seq: list[int]) -> None:
    """One block of ``v``, timed from the end of step ``SETTLE`` (see ``steady``)."""
    seq[0] += 1
    path = tmp / f"{v.name}-{seq[0]}.zarr"
    callback = None
    if v.how == "callback":
        if v.framework == "lightning":
            from recorder.lightning import PaperDebuggerCallback
        else:
            from recorder.huggingface import PaperDebuggerCallback  # type: ignore[assignment]
        callback = PaperDebuggerCallback(path)
    block: Callable[[], list[tuple[float, int]]] = (
        (lambda: lightning_block(v.model, steps, callback)) if v.framework == "lightning"
        else (lambda: hf_block(v.model, steps, callback, tmp / f"out-{seq[0]}")))
    t0 = time.perf_counter()
    if v.how == "record":
        with recorder.record(str(path), model=v.model, optimizer="auto", mode="flight",
                             modules=auto_modules(v.model)) as run:
            ends = block()
    else:
        ends = block()
        run = None if callback is None else callback.run
    wall = time.perf_counter() - t0
    per_step, faults = steady(ends, SETTLE)
    v.per_step.append(per_step)
    v.faults.append(faults)
    v.overhead.append(wall - steps * per_step)
    if v.how:
        if run is None or run.status != "complete" or run.failure:
            v.problems.append(f"status {None if run is None else run.status}, failure {run and run.failure}")
        v.ring_peak.append(RunReader(str(path)).rank(0).final["flight"]["peak_ring_bytes"])
        shutil.rmtree(path)
    shutil.rmtree(tmp / f"out-{seq[0]}", ignore_errors=True)


def quiet_frameworks() -> None:
    """The frameworks' advice (data loader workers, ...) and logs left out of the output."""
    warnings.filterwarnings("ignore")
    import lightning.pytorch  # noqa: F401 (before its loggers are quietened: importing sets them up)
    import transformers  # noqa: F401

    for name in ("lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def serve(conn: Any, name: str, framework: str, how: str, threads: int, tmp: Path) -> None:
    """A worker process that trains one variant's copy of the model: one block per request
    ``(steps, seq)`` (``seq`` as ``run_block`` takes it), answered with what the block measured;
    None ends it."""
    quiet_frameworks()
    torch.set_num_threads(threads)
    v = Variant(name, framework, gpt2(), how)
    while (request := conn.recv()) is not None:
        steps, seq = request
        run_block(v, steps, tmp, [seq])
        conn.send((v.per_step[-1], v.overhead[-1], v.ring_peak[-1:], v.problems[:], v.faults[-1]))
        v.forget()


class Workers:
    """One worker process per variant (``serve``), started fresh, with ``env`` added to its
    environment: no variant's blocks run in a process where another variant's ran (a recording
    changes glibc's heap, and with it the page faults of the training after it: see HEAPS and the
    method in ``docs_text``)."""

    def __init__(self, variants: list[Variant], threads: int, tmp: Path, env: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")  # not fork: the parent's torch thread pool is running
        self.conns: dict[str, Any] = {}
        self.procs = []
        with environment(env):  # a spawned process starts with this one's environment: glibc reads it then
            for v in variants:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=serve, args=(child, v.name, v.framework, v.how, threads, tmp),
                                   daemon=True)
                proc.start()
                child.close()  # the worker's end: closed here, so that a worker that dies is seen as EOF
                self.conns[v.name] = parent
                self.procs.append(proc)

    def block(self, v: Variant, steps: int, seq: list[int]) -> None:
        self.conns[v.name].send((steps, seq[0]))
        seq[0] += 1  # as run_block does in the worker: the next block's store gets a name of its own
        per_step, overhead, ring_peak, problems, faults = self.conns[v.name].recv()
        v.per_step.append(per_step)
        v.overhead.append(overhead)
        v.ring_peak += ring_peak
        v.problems += problems
        v.faults.append(faults)

    def close(self) -> None:
        for conn in self.conns.values():
            with contextlib.suppress(OSError):  # a worker that died: its error is the one to see
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()


def measure(frameworks: list[str], steps: int, blocks: int, warmup: int, by_hand: bool, threads: int,
            heap: str = "fixed") -> dict[str, Any]:
    """Blocks of each variant, round-robin; ``heap`` (a key of HEAPS) says where they train."""
    one_process = heap == "shared"
    hows = ("", "callback", "record") if by_hand else ("", "callback")
    base = gpt2() if one_process else None
    variants = [Variant(f"{fw}+{how}" if how else fw, fw, copy.deepcopy(base), how)
                for fw in frameworks for how in hows]
    load0 = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdbg-bench-") as tmp_name:
        tmp, seq = Path(tmp_name), [0]
        workers = None if one_process else Workers(variants, threads, tmp, NO_TRIM if heap == "fixed" else {})
        try:
            def block(v: Variant, n: int) -> None:
                if workers is None:
                    with torch_threads(threads):
                        run_block(v, n, tmp, seq)
                else:
                    workers.block(v, n, seq)

            for v in variants:
                block(v, warmup)
                v.forget()
            for r in range(blocks):
                order = rotated(variants, r)
                for v in order:
                    block(v, steps)
                print(f"  round {r + 1}/{blocks}: " + ", ".join(
                    f"{v.name} {v.per_step[-1] * 1e3:.0f} ms/step ({v.faults[-1]:.0f} faults)" for v in variants),
                    flush=True)
        finally:
            if workers is not None:
                workers.close()
    return {"steps": steps, "blocks": blocks, "seconds": time.perf_counter() - started, "loadavg_before": load0,
            "loadavg_after": os.getloadavg(), "variants": {v.name: v for v in variants}, "frameworks": frameworks,
            "by_hand": by_hand, "heap": heap}


# -- reporting ------------------------------------------------------------------------------------------
def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def table(res: dict[str, Any]) -> str:
    vs = res["variants"]
    rows = ["| framework | variant | median ms/step (p25–p75) | vs without | fixed cost per training, ms "
            "(vs without) | ring peak MB | minor faults per step |", "|---|---|---:|---:|---:|---:|---:|"]
    for fw in res["frameworks"]:
        base = vs[fw]
        b = statistics.median(base.per_step)
        for how, label in (("", "without"), ("callback", "PaperDebuggerCallback"), ("record", "record() by hand")):
            v = vs.get(f"{fw}+{how}" if how else fw)
            if v is None:  # record() by hand: only with --by-hand
                continue
            m, (q1, q3) = statistics.median(v.per_step), quartiles(v.per_step)
            fixed = statistics.median(v.overhead) - statistics.median(base.overhead)
            ring = f"{max(v.ring_peak) / MB:.1f}" if v.ring_peak else "–"
            rows.append(f"| {fw} | {label} | {m * 1e3:.0f} ({q1 * 1e3:.0f}–{q3 * 1e3:.0f}) | {m / b:.2f}x | "
                        f"{f'{fixed * 1e3:.0f}' if how else '–'} | {ring} | "
                        f"{statistics.median(v.faults) if v.faults else float('nan'):.0f} |")
    problems = [f"{v.name}: {p}" for v in vs.values() for p in v.problems]
    if problems:
        rows += ["", "Problems: " + "; ".join(problems)]
    return "\n".join(rows)


def verdicts(res: dict[str, Any]) -> list[str]:
    out = []
    for fw in res["frameworks"]:
        vs = res["variants"]
        callback = vs[f"{fw}+callback"].per_step
        ratio = statistics.median(callback) / statistics.median(vs[fw].per_step)
        estimate, interval, verdict = judged(paired(callback, vs[fw].per_step), TARGET)
        by_hand = vs.get(f"{fw}+record")
        own = ("" if by_hand is None else " (against the same steps recorded by hand with record(): "
               f"{statistics.median(callback) / statistics.median(by_hand.per_step):.2f}x)")
        out.append(f"- {fw}: the callback ≤ {TARGET:.2f}x the step time: paired {estimate:.3f}x "
                   f"(95% interval {interval_text(interval)}) — **{verdict}**; ratio of medians "
                   f"{ratio:.2f}x{own}")
    return out


def docs_text(results: dict[int, dict[str, Any]], command: str) -> str:
    import lightning
    import transformers

    res = next(iter(results.values()))  # the settings every thread count ran with
    n_variants = len(res["variants"])
    by_hand = ("A third variant records the same steps without the callback\n(`recorder.record(path, model=m, "
               'optimizer="auto", mode="flight", modules=["transformer.h.*"])`\naround the training), to tell the '
               "callback's own cost from the recording's." if res["by_hand"] else
               "(`--by-hand` adds a variant that records the same steps with `recorder.record(...)` around the\n"
               "training, to tell the callback's own cost from the recording's.)")
    own = ("the difference between its row and the row of `record()` by hand" if res["by_hand"] else
           "measured with `--by-hand`: in the runs of 2026-12-02 the callback's steps took 0.89–1.05x those\n"
           "of recording the same steps by hand, no cost of its own above the noise")
    heap = res["heap"]
    where = (f"`--heap {heap}`: {HEAPS[heap]}" + ("" if heap == "shared" else
             " (the blocks interleaved in time: one worker trains while the others wait)"))
    parts = []
    for threads, one in results.items():
        parts.append(f"""### torch threads = {threads}

The run took {one['seconds']:.0f} s; load average before it {one['loadavg_before'][0]:.2f}, after it \
{one['loadavg_after'][0]:.2f} (other processes' load inflates every variant, and the ratios' spread).

{table(one)}

Target:

{chr(10).join(verdicts(one))}""")
    return f"""{HEADING}

Measured on {time.strftime("%Y-%m-%d %H:%M")} by `{command}` (bench/callback_overhead.py).

What: a GPT-2 from `GPT2Config(n_layer={LAYERS}, n_embd={D_MODEL}, n_head={HEADS}, n_positions={SEQ},
vocab_size={VOCAB}, use_cache=False)`, batch {BATCH} × {SEQ} tokens, AdamW, CPU, torch threads \
{" and ".join(str(t) for t in results)} (on one thread, a core is free for the recorder's writer, as
on most GPU hosts), trained by Lightning (the model inside a LightningModule) and by transformers'
`Trainer`, with and without `PaperDebuggerCallback(path)`: flight mode, keep=2, no NaN; the callback records the
model's layers (`transformer.h.*`, chosen by `modules=None`: 4 forward and 4 backward steps per
training step), statistics of every tensor, the bytes of the last two iterations held in the ring
and written when training ends. {by_hand}

Method: as bench/record_overhead.py, paired rounds. The {n_variants} variants
train their own copies of the model (same weights, same batches); {where}. One `fit()`/`train()` of
{res['steps']} steps per variant per round, {res['blocks']} rounds, the order rotating, after a warm-up each; each
recorded training into a new store on local disk. Why the heap matters: glibc's heap decides how many
page faults training takes, and a recording changes it (its trim and mmap thresholds rise as large
blocks are freed, a recording's buffers among them when it closes). In one process, a baseline block
after a closed recording took ~3,600 minor faults per step at 171 ms/step; in a process that never
recorded, ~10,000 at 184 ms/step (Hugging Face, 2 threads, 8 rounds each way, 2026-12-04); each
worker's heap history sets its faults for its whole life. Minor faults per step: the process's
(`getrusage`), median over blocks. A block's figure is the time between the end of its step
{SETTLE} and of its last step over the steps between (the training loop in its steady state: with
keep=2 the flight ring is full from the third step on; every variant is timed the same way); the
median over blocks is shown, with the quartiles. The fixed cost of a recording (opening the store
when training starts, the ring's first fill in the steps before, writing the ring and closing at its
end) is the median of (block wall time − steps × its per-step figure), less the baseline's. Ring
peak: the most bytes the flight ring held (the run's final metadata).
The target is judged on the paired ratio (each round's callback block over the same round's block
without it, median over rounds), with its 95% bootstrap interval: met when the whole interval is
within the target, not met when all of it is above, undecided when the interval spans it.

{(chr(10) * 2).join(parts)}

Reading it: the callback's own work (its hooks at every batch, pausing and resuming, the module
paths) is {own}; the rest is what
flight-mode recording of these steps costs (statistics of every tensor, and copies of the
parameters, activations and gradients of four blocks into the ring at every step), as measured for
`record()` in "Recording overhead" above. With torch on two threads both cores train, and the
recorder's copies and its writer take their time from training; with one, the writer has a core to
itself and what remains is the training thread's own share (statistics, copies into the ring).

Versions: torch {torch.__version__}, lightning {lightning.__version__}, transformers \
{transformers.__version__}; {os.cpu_count()} CPUs (nproc), CPU capability \
{torch.backends.cpu.get_cpu_capability()}, Python {platform.python_version()}, {platform.platform()}.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per block (default %(default)s)")
    ap.add_argument("--blocks", type=int, default=12, help="rounds of blocks (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=3, help="steps of each variant's warm-up block (default 3)")
    ap.add_argument("--threads", type=int, choices=(1, 2), action="append",
                    help="torch threads (repeatable; default: 2, then 1)")
    ap.add_argument("--frameworks", nargs="+", choices=("lightning", "hf"), default=["lightning", "hf"])
    ap.add_argument("--by-hand", action="store_true",
                    help="also time the same steps recorded with record() by hand, to tell the callback's own cost")
    ap.add_argument("--heap", choices=HEAPS, default="fixed",
                    help="where the variants train: "
                    + "; ".join(f"{k}: {v}" for k, v in HEAPS.items()).replace("%", "%%") + " (default %(default)s)")
    ap.add_argument("--write-docs", action="store_true", help=f"write {HEADING!r} in docs/PERFORMANCE.md")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the file --write-docs writes (default: %(default)s)")
    args = ap.parse_args()
    if args.steps < SETTLE + 2 or args.blocks < 1 or args.warmup < 2:
        ap.error(f"--steps needs at least {SETTLE + 2} steps, --warmup at least 2, --blocks at least 1")
    quiet_frameworks()
    results: dict[int, dict[str, Any]] = {}
    for threads in dict.fromkeys(args.threads or [2, 1]):  # each thread count once, in the order given
        print(f"{', '.join(args.frameworks)}: {args.blocks} blocks x {args.steps} steps per variant, "
              f"{threads} torch threads; load average {os.getloadavg()[0]:.2f}", flush=True)
        results[threads] = measure(args.frameworks, args.steps, args.blocks, args.warmup, args.by_hand, threads,
                                   args.heap)
        print("\n" + table(results[threads]) + "\n" + "\n".join(verdicts(results[threads])) + "\n", flush=True)
    if args.write_docs:
        write_section(HEADING, docs_text(results, " ".join(["python bench/callback_overhead.py", *sys.argv[1:]])),
                      args.docs)


if __name__ == "__main__":
    main()
