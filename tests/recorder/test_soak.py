"""Soak: flight mode over thousands of iterations keeps memory flat and the disk bounded by the ring.

bench/soak.py runs the same for 20,000 iterations and reports where memory goes (docs/RELIABILITY.md,
"Soak")."""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recorder
from recorder import capture, items
from recorder.store import layout
from recorder.store.reader import RunReader

ITERATIONS = 3000
SAMPLES = (1000, 2000, 3000)
WINDOW = 1000  # iterations between samples
KEEP = 2
# What a flat recording may gain per iteration once warm (measured: about 0 of each, give or take a
# few hundred per window). Leaking one small object per iteration gains 1 block (a tuple of ints is
# 2-3) and, when it is a container, 1 gc object; one per step, 4 times that.
BLOCKS_PER_ITERATION = 0.5
OBJECTS_PER_ITERATION = 0.25
RSS_GROWTH = 24 << 20  # from the first sample to the last (measured: a few MB at most)


@recorder.paper_step("Eq. 1", description="hidden layer")
class Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


@recorder.paper_step("Eq. 2", description="read-out")
class Readout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc(h)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def payload_bytes_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in (path / "rank0" / "blobs").rglob("*") if f.is_file() and f.name != "zarr.json")


def iterations_with_payloads(rank: object) -> set[int]:
    """Iterations with a tensor record that has its bytes (written with it, or attached late)."""
    direct = np.flatnonzero(rank.column("tensors/payload") != layout.NO_REF)
    late = rank.column("late/tensor") if rank.lengths.get("late") else np.zeros(0, dtype=np.int64)
    rows = np.union1d(direct, late).astype(np.int64)
    return {int(it) for it in rank.column("steps/iteration")[rank.column("tensors/step")[rows]]}


def train(model: nn.Module, opt: torch.optim.Optimizer, data: torch.Generator, nan: bool = False) -> None:
    x = torch.randn(4, 8, generator=data)
    if nan:
        x[0, 0] = float("nan")
    y = torch.randint(0, 4, (4,), generator=data)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if torch.isfinite(loss):  # a non-finite loss skips the update, as a loss scaler does
        opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_flight_mode_keeps_memory_flat_and_disk_bounded_by_the_ring(run_path: Path) -> None:
    """3,000 iterations (12,000 steps) in flight mode, keep=2: after warming up, Python's live memory
    blocks and gc-tracked objects do not grow with iterations (the last window of 1,000 gains no more
    than the tolerance, whatever the first did), nor does RSS beyond a margin; no payload is written
    during the run; after close only the last two iterations have payloads, no more bytes than the
    ring held.

    Batches come from their own generator: the global RNG state, recorded at every step, stays the
    same, so the writer's bounded caches of RNG documents (up to 65,536 and 262,144 entries, filled
    by a new state at every step) do not grow through the test and look like a leak."""
    torch.set_num_threads(1)  # tiny tensors: a second thread only waits for work, slowly on a busy machine
    model = nn.Sequential(Hidden(), Readout())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(0)
    samples: dict[int, tuple[int, int, int]] = {}  # iteration -> (blocks, gc objects, RSS)
    with recorder.record(run_path, model=model, optimizer=opt, mode="flight", keep=KEEP) as run:
        for i in range(1, ITERATIONS + 1):
            train(model, opt, data)
            if i in SAMPLES:
                assert run.flush()
                gc.collect()
                samples[i] = (sys.getallocatedblocks(), len(gc.get_objects()), rss())
        assert payload_bytes_on_disk(run_path) == 0  # the ring is written at the end, not before
        peak_ring = run.session.ring.peak_bytes if run.session.ring is not None else 0

    first, last = SAMPLES[0], SAMPLES[-1]
    windows = {f"{a}-{b}": (samples[b][0] - samples[a][0], samples[b][1] - samples[a][1])
               for a, b in zip(SAMPLES, SAMPLES[1:])}
    why = f"growth per window of {WINDOW} iterations (blocks, gc objects): {windows}"
    blocks, objects = windows[f"{SAMPLES[-2]}-{last}"]
    assert blocks <= BLOCKS_PER_ITERATION * WINDOW, why
    assert objects <= OBJECTS_PER_ITERATION * WINDOW, why
    assert (samples[last][0] - samples[first][0]) <= BLOCKS_PER_ITERATION * (last - first), why
    assert samples[last][2] - samples[first][2] <= RSS_GROWTH, \
        f"RSS grew {(samples[last][2] - samples[first][2]) / 1e6:.1f} MB from {first} to {last} iterations"

    reader = RunReader(str(run_path))
    rank = reader.rank(0)
    assert reader.status == "complete" and len(rank) == 4 * ITERATIONS
    assert iterations_with_payloads(rank) == set(range(ITERATIONS - KEEP, ITERATIONS))
    flight = reader.attrs["final"]["flight"]
    assert [(d["reason"], d["iterations"]) for d in flight["dumps"]] == [("end", [ITERATIONS - KEEP, ITERATIONS - 1])]
    units = np.array([1, 2, 4, 8])[rank.column("payloads/blob").astype(np.int64)]
    written = int(np.sum(units * rank.column("payloads/count")))
    assert 0 < written <= flight["dumps"][0]["bytes"] <= peak_ring == flight["peak_ring_bytes"]
    # Compressed, plus the zero padding of each unit's last 4 MB chunk (~17 KB compressed).
    assert payload_bytes_on_disk(run_path) <= peak_ring + 64 * 1024


def test_a_ring_full_in_bytes_lets_the_writer_forget_the_iterations_it_dropped(run_path: Path) -> None:
    """keep=10, but room for about one iteration: each iteration's bytes push the one before out of the
    ring. The writer holds every record whose bytes wait in the ring until told they will not come;
    the iterations dropped for room must be told too, or their records pile up at every iteration."""
    model = nn.Sequential(Hidden(), Readout())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(0)
    with recorder.record(run_path, model=model, optimizer=opt, mode="flight", keep=10, max_ring_bytes=4000) as run:
        for _ in range(60):
            train(model, opt, data)
        assert run.flush()
        waiting = len(run.pipeline._waiting)
        per_iteration = sum(len(r) for r in run.session.ring._iterations.values()) / len(run.session.ring._iterations)
    assert waiting <= 3 * per_iteration, f"{waiting} records wait for bytes (about {per_iteration:.0f} per iteration)"
    rank = RunReader(str(run_path)).rank(0)
    kept = iterations_with_payloads(rank)
    assert kept and max(kept) == 59 and len(kept) < 10


def test_contents_remembered_as_sent_are_bounded_in_flight_mode(run_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that stays non-finite writes every iteration (the ring at its first NaN, the rest directly),
    and each payload written is remembered so as not to be copied again: a bounded memory, in flight
    mode as in full mode; forgetting costs a copy, never a payload."""
    monkeypatch.setattr(capture, "_SEEN_LIMIT", 40)
    model = nn.Sequential(Hidden(), Readout())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(0)
    with recorder.record(run_path, model=model, mode="flight", keep=2) as run:
        for _ in range(20):
            train(model, opt, data, nan=True)
            run.next_iteration()  # (no optimizer step to count iterations by)
        assert len(run.session.seen) <= 40, f"{len(run.session.seen)} contents remembered as sent"
    rank = RunReader(str(run_path)).rank(0)
    assert iterations_with_payloads(rank) == set(range(20))
    for step in (0, len(rank) - 1):
        for rec in rank.tensor_records(step):
            assert rec.has_payload and rank.tensor(rec).shape == rec.shape


def test_ring_writes_listed_in_the_metadata_are_bounded() -> None:
    """Every ring write is listed in the run's final metadata; a run anomalous at every iteration lists
    the first and the last ``DUMPS_KEPT`` and sums up the ones between."""
    k = items.DUMPS_KEPT
    session = SimpleNamespace(dumps=[])
    for i in range(2 * k + 100):
        capture.Session._log_dump(session, {"reason": "nonfinite", "iterations": [i], "bytes": 10})  # type: ignore[arg-type]
    assert len(session.dumps) == 2 * k + 1
    assert [d["iterations"] for d in session.dumps[:k]] == [[i] for i in range(k)]
    assert session.dumps[k] == {"reason": "omitted", "dumps": 100, "bytes": 1000, "first_iteration": k,
                                "last_iteration": k + 99}
    assert [d["iterations"] for d in session.dumps[k + 1:]] == [[i] for i in range(k + 100, 2 * k + 100)]


def test_modules_made_at_every_call_are_not_kept_alive(run_path: Path) -> None:
    """A module made anew at every iteration (and its parameters) is freed once it is no longer
    used: the recording's memory of module documents does not hold it."""
    data = torch.Generator().manual_seed(0)
    refs = []
    # No automatic collection while the test runs: gc.collect() does nothing where one is under way, on the
    # writer thread say, and a module whose backward hooks reach it through a cycle waits for a collection.
    was = gc.isenabled()
    gc.disable()
    try:
        with recorder.record(run_path, mode="flight", keep=2) as run:
            for _ in range(10):
                step = Hidden()
                refs.append(weakref.ref(step))
                step(torch.randn(4, 8, generator=data)).sum().backward()
                del step
                run.next_iteration()
            gc.collect()
            alive = [i for i, ref in enumerate(refs) if ref() is not None]
            held = _holders(refs[alive[0]]()) if alive else ""
    finally:
        if was:
            gc.enable()
    assert alive == [], f"modules of iterations {alive} are still alive, held by: {held}"


@pytest.mark.parametrize("mode", ["full", "flight"])
def test_a_step_leaves_no_reference_cycle_behind(tmp_path: Path, mode: str) -> None:
    """A module made anew at every call, its output and its input are freed as soon as training drops them,
    as without a recording: the recorder's own code makes no reference cycle that holds a step's call (its
    encoders' recursive closures did, so that a step's module and tensors waited for a garbage collection,
    and GPU memory with them)."""
    data = torch.Generator().manual_seed(0)
    refs: list[weakref.ref] = []
    was = gc.isenabled()
    gc.disable()
    try:
        with recorder.record(tmp_path / "run.zarr", mode=mode) as run:
            for _ in range(3):
                step, x = Hidden(), torch.randn(4, 8, generator=data).requires_grad_()
                y = step(x.tanh())
                refs += [weakref.ref(step), weakref.ref(x), weakref.ref(y)]
                y.sum().backward()
                del step, x, y
                run.next_iteration()
            alive = [i for i, ref in enumerate(refs) if ref() is not None]
    finally:
        if was:
            gc.enable()
    assert alive == [], f"held until a collection: {[('module', 'input', 'output')[i % 3] for i in alive]}"


def _holders(obj: object, depth: int = 4) -> str:
    """What refers to ``obj``, and what refers to those, ``depth`` levels out (types, and the keys of
    dictionaries): names the holder when a module that should be freed is not."""
    seen, lines, here = {id(obj)}, [], sys._getframe()
    level = [obj]
    for d in range(depth):
        outer = []
        for target in level:
            for holder in gc.get_referrers(target):
                if id(holder) in seen or holder is level or holder is here or isinstance(holder, list) and \
                        any(isinstance(x, weakref.ref) for x in holder[:1]):
                    continue
                seen.add(id(holder))
                what = type(holder).__qualname__
                if isinstance(holder, dict):
                    what += f" keys {[str(k)[:40] for k in list(holder)[:8]]}"
                elif hasattr(holder, "f_code"):
                    what += f" {holder.f_code.co_qualname}"
                lines.append(f"{'  ' * d}{what}")
                outer.append(holder)
        level = outer[:20]
    return "\n".join(lines[:80])
