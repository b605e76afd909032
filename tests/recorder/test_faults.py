"""Faults of the store under a running recording, each simulated where the writer really writes
(``recorder.store.backend.put``): a disk that fills up, a store that is slow or hangs, and a reader
opening the recording while it is being written. Training must go on untouched, every fault must be
reported once, and everything committed must stay readable, bitwise (docs/RELIABILITY.md).

The sleeping store wrapper is the fault being simulated; no test sleeps to synchronise.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import recorder
import replayer
from recorder import pipeline as pipeline_mod
from recorder.store import backend, layout
from recorder.store.reader import RunReader
from tests.models import TinyGPT, train_step
from tests.recorder.crash_child import Affine

ITERATIONS = 12
FILL_AT = 4  # the disk fills after this iteration's commit
STEPS_PER_ITERATION = 12  # TinyGPT: Block, Attention and smooth_relu twice, forward and backward


# -- store wrappers: the faults ------------------------------------------------------------------
class DiskFull:
    """``backend.put`` on a disk that fills up. Until ``fill`` writes go through; after it, only
    ``leave`` more bytes fit: a write needs its size free (the temporary file exists next to the old
    one until the rename) and then frees the old file's; one that does not fit raises ENOSPC having
    written nothing, as ``os.write`` into the temporary file would. With ``manifest_first`` the
    next commit's chunks still fit and its manifest is what fails (leaving a truncated ``.partial``
    behind, as a real failed write does); nothing fits after that."""

    def __init__(self, real: Callable[..., None]) -> None:
        self.real = real
        self.lock = threading.Lock()
        self.free: int | None = None
        self.manifest_first = False
        self.sizes: dict[str, int] = {}
        self.manifests: list[dict[str, Any]] = []  # every manifest written, in order
        self.failures = 0
        self.at_fault: int | None = None  # manifests written before the first failure
        self.puts_after_fill = 0

    def fill(self, leave: int, *, manifest_first: bool = False) -> None:
        with self.lock:
            self.free, self.manifest_first = leave, manifest_first

    def __call__(self, store: Any, key: str, data: bytes, **options: bool) -> None:
        with self.lock:
            if self.manifest_first and key == layout.MANIFEST_KEY:
                self.manifest_first, self.free = False, 0
                self._failed()
                root = backend.local_root(store)
                if root is not None:
                    (root / f"{key}.partial").write_bytes(data[:len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if self.free is not None and not self.manifest_first:
                if len(data) > self.free:
                    self._failed()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                self.free -= len(data) - self.sizes.get(key, 0)
            if self.free is not None:
                self.puts_after_fill += 1
        self.real(store, key, data, **options)
        with self.lock:
            self.sizes[key] = len(data)
            if key == layout.MANIFEST_KEY:
                self.manifests.append(json.loads(data))

    def _failed(self) -> None:
        self.failures += 1
        if self.at_fault is None:
            self.at_fault = len(self.manifests)


class SlowStore:
    """``backend.put`` that sleeps ``seconds`` before each write (a slow disk or network store)."""

    def __init__(self, real: Callable[..., None], seconds: float) -> None:
        self.real, self.seconds = real, seconds
        self.puts = 0

    def __call__(self, store: Any, key: str, data: bytes, **options: bool) -> None:
        time.sleep(self.seconds)
        self.puts += 1
        self.real(store, key, data, **options)


class HungStore:
    """``backend.put`` that, once armed, blocks every write until released (a hard-mounted NFS
    server gone away)."""

    def __init__(self, real: Callable[..., None]) -> None:
        self.real = real
        self.armed = threading.Event()
        self.released = threading.Event()
        self.blocked = threading.Event()  # a write is blocked now

    def __call__(self, store: Any, key: str, data: bytes, **options: bool) -> None:
        if self.armed.is_set():
            self.blocked.set()
            self.released.wait(timeout=300)
        self.real(store, key, data, **options)


# -- training and reading back -------------------------------------------------------------------
def train(path: Path | None, iterations: int = ITERATIONS, during: Callable[[int, Any], None] | None = None,
          **record_kwargs: Any) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], Any, float]:
    """Train a fresh TinyGPT (seed 0, AdamW), recorded into ``path`` unless it is None; ``during(i,
    run)`` runs after each iteration. Returns the losses, the final parameters, the run and the
    training loop's wall time (closing excluded)."""
    torch.manual_seed(0)
    np.random.seed(0)  # recorded with every step: the same in every run
    random.seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    ctx = recorder.record(path, model=model, optimizer=opt, mode="full", **record_kwargs) if path is not None \
        else contextlib.nullcontext()
    with ctx as run:
        start = time.perf_counter()
        for i in range(iterations):
            losses.append(train_step(model, opt, i))
            if during is not None:
                during(i, run)
        seconds = time.perf_counter() - start
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}, run, seconds


def assert_training_untouched(losses: list[torch.Tensor], params: dict[str, torch.Tensor],
                              unrecorded: tuple[list[torch.Tensor], dict[str, torch.Tensor]]) -> None:
    """Losses and final parameters bitwise equal to training without a recording."""
    base_losses, base_params = unrecorded
    assert len(losses) == len(base_losses)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(losses, base_losses))
    assert params.keys() == base_params.keys()
    for name in params:
        assert torch.equal(params[name].view(torch.uint8), base_params[name].view(torch.uint8)), name


_VALUES = ("phase", "iteration", "call", "parent", "forward", "status", "flags", "tensor_count")
_DOCS = ("name", "definition", "module_path", "module", "settings", "args", "output")


def step_signature(rec: Any, i: int, *, notes: bool = True, read: bool = True) -> tuple[Any, ...]:
    """Everything recorded about step ``i`` but its times, read through the replayer: its row, with
    every document resolved (RNG states part by part), its extra document (without notes if asked),
    and per tensor record its metadata, statistics (bitwise) and payload or None: the xxh3-128 of
    the bytes ``rank.tensor`` reads (checksum verified), or with ``read=False`` the one the writer
    recorded for them, so a read payload compares bitwise with a recorded one."""
    rank, step = rec.rank, rec.step(i)

    def col(name: str) -> int:
        return int(rank.rows(f"steps/{name}", i, i + 1)[0])

    row = [col(name) for name in _VALUES] + [rank.doc(col(name)) for name in _DOCS]
    rng = rank.doc(col("rng")) or {}
    row.append({part: rank.doc(int(doc_id)) for part, doc_id in rng.items()})
    extra = dict(step.extra)
    if not notes:
        extra.pop("notes", None)
    records = []
    for r in step.records:
        if not r.has_payload:
            payload = None
        elif read:  # the hash of the bytes read, in the form the writer records hashes
            digest = xxhash.xxh3_128_intdigest(rank.tensor(r).reshape(-1).view(torch.uint8).numpy().tobytes())
            payload = (digest >> 64, digest & ((1 << 64) - 1))
        else:
            payload = tuple(int(v) for v in rank.column("payloads/hash")[r.payload])
        records.append((r.role, r.name, r.dtype, r.device, r.requires_grad, r.shape, r.stride,
                        np.asarray([r.stats[k] for k in layout.STAT_NAMES]).tobytes(), payload))
    return (*row, json.dumps(extra, sort_keys=True), tuple(records))


def recording_ours(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, recorder.RecorderWarning)]


@pytest.fixture(scope="module")
def unrecorded() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    losses, params, _, _ = train(None)
    return losses, params


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Any, ...]]:
    """Signatures of every step of the same training recorded without a fault."""
    path = tmp_path_factory.mktemp("reference") / "run.zarr"
    _, _, run, _ = train(path)
    assert run.status == "complete" and run.failure is None
    rec = replayer.open(path)
    assert len(rec) == ITERATIONS * STEPS_PER_ITERATION
    return [step_signature(rec, i, read=False) for i in range(len(rec))]


# -- 1. a full disk ------------------------------------------------------------------------------
def record_until_full(path: Path, monkeypatch: pytest.MonkeyPatch, leave: int, *, manifest_first: bool = False,
                      ) -> tuple[Any, DiskFull, int, list[str], list[torch.Tensor], dict[str, torch.Tensor]]:
    """Record ITERATIONS iterations; after iteration FILL_AT is committed, the disk fills up."""
    disk = DiskFull(backend.put)
    monkeypatch.setattr(backend, "put", disk)
    committed: list[int] = []

    def during(i: int, run: Any) -> None:
        if i == FILL_AT:
            assert run.flush()
            committed.append(run.steps)
            disk.fill(leave, manifest_first=manifest_first)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params, run, _ = train(path, during=during, flush_interval=0.02)
    assert disk.failures > 0, "the disk never filled: the test checked nothing"
    return run, disk, committed[0], recording_ours(caught), losses, params


def assert_committed_prefix(path: Path, n: int, reference: list[tuple[Any, ...]]) -> Any:
    """The recording opens with exactly ``n`` steps, each bitwise the reference's."""
    rec = replayer.open(path)
    assert len(rec) == n
    for i in range(n):
        assert step_signature(rec, i) == reference[i], f"step {i}"
    return rec


def assert_disk_full_warning(messages: list[str]) -> None:
    assert len(messages) == 1, messages
    message = messages[0]
    assert "\n" not in message
    assert "is full" in message and "No space left on device" in message and "free space" in message, message
    assert "incomplete" in message, message


def test_disk_full_mid_run_marks_the_run_incomplete(tmp_path, monkeypatch, unrecorded, reference):
    """The disk fills after iteration 4 (room left for small files only): training finishes
    untouched, one warning names the full disk, and the run is `incomplete` with exactly the steps
    committed before the fault, each readable and bitwise equal to a run without fault."""
    path = tmp_path / "run.zarr"
    threads = set(threading.enumerate())
    run, disk, filled_at, messages, losses, params = record_until_full(path, monkeypatch, leave=256 << 10)
    assert_training_untouched(losses, params, unrecorded)
    assert_disk_full_warning(messages)
    assert run.status == "incomplete" and "is full" in run.failure
    assert filled_at == (FILL_AT + 1) * STEPS_PER_ITERATION
    # Committed before the fault: the last manifest written before the first failed write.
    good = disk.manifests[disk.at_fault - 1]
    committed = good["ranks"]["0"]["steps"]
    assert good["status"] == "recording" and filled_at <= committed < ITERATIONS * STEPS_PER_ITERATION
    rec = assert_committed_prefix(path, committed, reference)
    assert rec.status == "incomplete"
    final = rec.reader.attrs["final"]
    assert final["status"] == "incomplete" and "No space left on device" in final["writer_error"]
    # The close's information. Every step may have started: training can end before the writer
    # reaches the write that fails (its commits are asynchronous).
    assert committed <= final["steps_started"] <= ITERATIONS * STEPS_PER_ITERATION
    # The incomplete manifest commits what the last good one did, nothing more.
    manifest = json.loads((path / layout.MANIFEST_KEY).read_text())
    assert manifest["status"] == "incomplete" and manifest["ranks"] == good["ranks"]
    # The recording's threads ended with it (its 4 I/O threads lived as long as the process).
    assert not [t.name for t in set(threading.enumerate()) - threads if t.name.startswith("pdbg-")]


def test_disk_full_with_no_room_left_keeps_the_last_manifest(tmp_path, monkeypatch, unrecorded, reference):
    """No byte fits after iteration 4, so not even the status can be written: the last manifest
    stands (status `recording`, read as `crashed` once this process is gone) and is consistent:
    exactly the steps it commits, each readable and bitwise right."""
    path = tmp_path / "run.zarr"
    run, disk, committed, messages, losses, params = record_until_full(path, monkeypatch, leave=0)
    assert_training_untouched(losses, params, unrecorded)
    assert_disk_full_warning(messages)
    assert run.status == "incomplete"
    assert disk.puts_after_fill == 0
    manifest = json.loads((path / layout.MANIFEST_KEY).read_text())
    assert manifest == disk.manifests[-1] and manifest["status"] == "recording"
    assert manifest["ranks"]["0"]["steps"] == committed
    rec = assert_committed_prefix(path, committed, reference)
    assert rec.status == "recording"  # its writer (this process) is alive


def test_disk_full_when_writing_the_manifest(tmp_path, monkeypatch, unrecorded, reference):
    """The next commit's chunks fit and its manifest does not (its truncated manifest.json.partial is
    deleted with the other spares): the previous manifest stands, and the chunks written past it
    are not read."""
    path = tmp_path / "run.zarr"
    run, disk, committed, messages, losses, params = record_until_full(path, monkeypatch, leave=0,
                                                                       manifest_first=True)
    assert_training_untouched(losses, params, unrecorded)
    assert_disk_full_warning(messages)
    assert run.status == "incomplete"
    assert disk.puts_after_fill > 0, "the failed commit wrote no chunk: the test checked nothing"
    assert not list(path.rglob("*.partial"))  # (the truncated manifest.json.partial too: room for the status)
    manifest = json.loads((path / layout.MANIFEST_KEY).read_text())
    assert manifest == disk.manifests[-1] and manifest["ranks"]["0"]["steps"] == committed
    assert_committed_prefix(path, committed, reference)
    # The failed commit's chunks are on disk past the committed rows (a payload row, at least).
    rank = RunReader(path).rank(0)
    payloads = manifest["ranks"]["0"]["payloads"]
    assert int(rank.group["payloads/count"][payloads]) > 0


# -- 2. a slow store -----------------------------------------------------------------------------
SLOW_PUT_S = 0.05
SLOW_QUEUE = 64 << 10
SLOW_ITERATIONS = 50


def test_slow_store_drops_payloads_never_steps(tmp_path, monkeypatch):
    """A store that takes 50 ms per write, a 64 KiB queue: payloads that find no room are dropped
    (counted, warned once, their records say payload -1 and the step says why), every step row and
    statistic is recorded, the queue stays within its bound, and training waits for the queue at
    most WAIT_CAP_S plus WAIT_SHARE of its time."""
    fast_losses, fast_params, fast_run, fast_s = train(tmp_path / "fast.zarr", iterations=SLOW_ITERATIONS)
    assert fast_run.status == "complete" and fast_run.pipeline.dropped_payloads == 0
    slow = SlowStore(backend.put, SLOW_PUT_S)
    monkeypatch.setattr(backend, "put", slow)
    # A small allowance, so that this short run uses it up however fast the machine is (with the
    # default 1 s, a run of 2 s may never need to drop anything).
    monkeypatch.setattr(pipeline_mod, "WAIT_CAP_S", 0.25)
    # Time training spends inside the queue's calls, measured here (not by the pipeline's own count).
    blocked = {"s": 0.0, "calls": 0, "on": True}
    trainer = threading.current_thread()

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                if blocked["on"] and threading.current_thread() is trainer:
                    blocked["s"] += time.perf_counter() - start
                    blocked["calls"] += 1
        return call

    for name in ("reserve", "submit"):
        monkeypatch.setattr(pipeline_mod.Pipeline, name, timed(getattr(pipeline_mod.Pipeline, name)))

    def during(i: int, run: Any) -> None:
        blocked["on"] = i < SLOW_ITERATIONS - 1  # the training loop only, not closing

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params, run, slow_s = train(tmp_path / "slow.zarr", iterations=SLOW_ITERATIONS, during=during,
                                            max_queue_bytes=SLOW_QUEUE)
    messages = recording_ours(caught)
    pipe = run.pipeline
    print(f"\nslow store: training {slow_s:.2f} s (fast store {fast_s:.2f} s), in queue calls {blocked['s']:.2f} s "
          f"({blocked['calls']} calls; the pipeline counts {pipe.waited_s:.2f} s of waits), dropped "
          f"{pipe.dropped_payloads} payloads ({pipe.dropped_bytes} bytes), peak queue {pipe.peak_queue_bytes} of "
          f"{SLOW_QUEUE} bytes, peak step records {pipe.peak_record_bytes} bytes, {slow.puts} writes")
    assert_training_untouched(losses, params, (fast_losses, fast_params))
    assert run.status == "complete" and run.failure is None
    assert len(messages) == 1 and "dropping tensor payloads" in messages[0] and "when_slow='wait'" in messages[0]
    assert 0 < pipe.peak_queue_bytes <= SLOW_QUEUE
    assert pipe.peak_record_bytes <= pipe.max_record_bytes
    bound = pipeline_mod.WAIT_CAP_S + pipeline_mod.WAIT_SHARE * slow_s
    assert pipe.waited_s <= bound + 0.2, (pipe.waited_s, bound)
    # Each call's own cost (a lock, a comparison) comes on top; on a loaded machine a thread woken
    # from a wait may also wait for a core.
    assert blocked["s"] <= bound + 0.5 + 1e-4 * blocked["calls"], (blocked, bound)
    # Wall time against the fast store, with room for the noise of a shared 2-core machine (where a
    # fast-store run can take twice as long as the next one): a sanity bound, the waits are the measure.
    assert slow_s <= blocked["s"] + 3 * fast_s + 2.0, (slow_s, fast_s)

    fast, rec = replayer.open(tmp_path / "fast.zarr"), replayer.open(tmp_path / "slow.zarr")
    assert len(rec) == len(fast) == run.steps == SLOW_ITERATIONS * STEPS_PER_ITERATION
    final = rec.reader.attrs["final"]
    assert final["dropped_payloads"] == pipe.dropped_payloads > 0
    assert final["peak_queue_bytes"] == pipe.peak_queue_bytes and final["when_slow"] == "drop_payloads"
    without = noted = 0
    for i in range(len(rec)):
        mine, theirs = step_signature(rec, i, notes=False, read=False), step_signature(fast, i, notes=False, read=False)
        assert mine[:-1] == theirs[:-1], f"step {i}"  # the row, every document, the extra but notes
        assert len(mine[-1]) == len(theirs[-1])
        lost = 0
        for a, b in zip(mine[-1], theirs[-1]):
            assert a[:-1] == b[:-1], f"step {i}: {a[1]}"  # metadata and statistics, bitwise
            if a[-1] is None:
                lost += 1
            else:
                assert a[-1] == b[-1], f"step {i}: {a[1]}"  # the payload, bitwise
        without += lost
        notes = rec.step(i).extra.get("notes", [])
        if lost:
            assert f"{lost} payload(s) not recorded: the store could not keep up (when_slow='drop_payloads')" in notes
            without_payload = next(r for r in rec.step(i).records if not r.has_payload)
            assert "dropped" in rec.step(i).why_statistics_only(without_payload)
            kept = [r for r in rec.step(i).records if r.has_payload]  # (it said "recorded in stats mode" of these)
            assert all(rec.step(i).why_statistics_only(r) == "it has its bytes, not statistics only" for r in kept)
            noted += 1
    assert without == pipe.dropped_payloads, "every dropped payload is one record without payload"
    assert noted > 0


def test_slow_store_with_when_slow_wait_keeps_every_payload(tmp_path, monkeypatch):
    """when_slow="wait": nothing is dropped, the queue stays within its bound, training waits."""
    slow = SlowStore(backend.put, SLOW_PUT_S)
    monkeypatch.setattr(backend, "put", slow)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, run, seconds = train(tmp_path / "run.zarr", iterations=6, max_queue_bytes=SLOW_QUEUE,
                                   when_slow="wait")
    assert recording_ours(caught) == []
    pipe = run.pipeline
    print(f"\nwhen_slow='wait': training {seconds:.2f} s, waited {pipe.waited_s:.2f} s, peak queue "
          f"{pipe.peak_queue_bytes} bytes")
    assert run.status == "complete" and pipe.dropped_payloads == 0 and pipe.waited_s > 0
    assert 0 < pipe.peak_queue_bytes <= SLOW_QUEUE
    rec = replayer.open(tmp_path / "run.zarr")
    assert len(rec) == 6 * STEPS_PER_ITERATION
    assert all(r.has_payload for i in range(len(rec)) for r in rec.step(i).records)


def test_unknown_when_slow_is_refused(run_path):
    with pytest.raises(recorder.RecordingError, match="unknown when_slow 'later'"):
        recorder.record(run_path, when_slow="later")
    assert not run_path.exists()


def test_hung_store_is_given_up_and_close_returns(tmp_path, monkeypatch, unrecorded):
    """A write that never returns: once the writer has made no progress for backpressure_timeout,
    recording stops with one warning, training goes on and close() returns; when the write returns
    at last, the writer thread marks the run incomplete itself."""
    hung = HungStore(backend.put)
    monkeypatch.setattr(backend, "put", hung)

    def during(i: int, run: Any) -> None:
        if i == 0:
            run.pipeline.backpressure_timeout = 1.0
            run.pipeline.max_record_bytes = 256 << 10  # a few steps: the queue fills soon
            assert run.flush()
            hung.armed.set()

    path = tmp_path / "run.zarr"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.perf_counter()
            losses, params, run, _ = train(path, during=during, flush_interval=0.02)
            seconds = time.perf_counter() - start
        messages = recording_ours(caught)
        assert hung.blocked.is_set()
        assert_training_untouched(losses, params, unrecorded)
        assert len(messages) == 1 and "made no progress for 1 s" in messages[0], messages
        assert run.status == "incomplete"
        assert seconds < 30, seconds
        assert run.pipeline._thread.is_alive()  # still inside the hung write
    finally:
        hung.released.set()
    run.pipeline._thread.join(timeout=60)
    assert not run.pipeline._thread.is_alive()
    rec = replayer.open(path)
    assert rec.status == "incomplete" and len(rec) >= STEPS_PER_ITERATION
    final = rec.reader.attrs["final"]
    assert "WriterStalled" in final["writer_error"] and len(rec) <= final["steps_started"]
    for i in range(len(rec)):
        step_signature(rec, i)  # every committed step reads


# -- 3. reading while recording ------------------------------------------------------------------
@recorder.paper_step("Eq. 2", description="scaled tanh")
def squash(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 1.5


READ_ITERATIONS = 18
CHECK_EVERY = 3  # iterations between the writer's waits for a read
MAX_READS = 10_000  # a bound on the reader's loop; it ends when the recording has


def test_reading_while_recording_sees_consistent_committed_prefixes(tmp_path):
    """A recording made on a thread while the main thread opens it again and again and reads every
    committed step whole (row, documents, tensor records, statistics, payloads): each read sees a
    prefix of the final recording, bitwise, and step counts never go down. Every CHECK_EVERY
    iterations the writer commits and waits until a read that started after that has finished, so
    the reads see many prefixes; between, they race the writer."""
    path = tmp_path / "run.zarr"
    cond = threading.Condition()
    state = {"started": 0, "done": 0, "ready": False, "finished": False}
    errors: list[BaseException] = []

    def record() -> None:
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(Affine(64), torch.nn.ReLU(), Affine(64))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            with recorder.record(path, model=model, optimizer=opt, mode="full", flush_interval=0.005) as run:
                run.pipeline.ready.wait(60)  # the first manifest is on disk
                with cond:
                    state["ready"] = True
                    cond.notify_all()
                for i in range(READ_ITERATIONS):
                    x = torch.randn(16, 64)
                    squash(model(x)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    if i % CHECK_EVERY == CHECK_EVERY - 1:
                        assert run.flush()
                        with cond:
                            wanted = state["started"] + 1
                            assert cond.wait_for(lambda: state["done"] >= wanted, timeout=120), "no read came"
        except BaseException as exc:
            errors.append(exc)
        finally:
            with cond:
                state["finished"] = True
                cond.notify_all()

    writer = threading.Thread(target=record, name="recording")
    writer.start()
    with cond:
        assert cond.wait_for(lambda: state["ready"] or state["finished"], timeout=120)
    seen: dict[int, tuple[Any, ...]] = {}  # step -> its signature, as first read
    counts: list[int] = []
    try:
        for _ in range(MAX_READS):
            with cond:
                if state["finished"]:
                    break
                state["started"] += 1
            rec = replayer.open(path)
            n = len(rec)
            assert not counts or n >= counts[-1], f"the step count went down: {counts[-1]} -> {n}"
            for i in range(n):
                sig = step_signature(rec, i)
                assert seen.setdefault(i, sig) == sig, f"step {i} read differently"
            counts.append(n)
            with cond:
                state["done"] += 1
                cond.notify_all()
    finally:
        writer.join(timeout=300)
    assert not errors, errors
    rec = replayer.open(path)
    assert rec.status == "complete" and len(rec) == READ_ITERATIONS * 6  # Affine twice and squash, both ways
    for i in range(len(rec)):
        sig = step_signature(rec, i)
        assert seen.setdefault(i, sig) == sig, f"step {i} differs from what a read during recording saw"
    partial = sorted({n for n in counts if 0 < n < len(rec)})
    print(f"\n{len(counts)} reads during recording; committed prefixes seen: {partial}")
    assert len(partial) >= READ_ITERATIONS // CHECK_EVERY - 1, partial


@recorder.paper_step("Eq. 6", description="a scale that underflows")
def _tiny(x: torch.Tensor) -> torch.Tensor:
    return x * 1e-30


def test_warnings_as_errors_never_reach_training(tmp_path, monkeypatch, capfd):
    """Under ``-W error`` (warnings filters that raise), an internal capture failure and the
    unmatched-glob warning at close do not raise into training: the first degrades the run to
    incomplete and recording stops, the second still closes the run complete; both messages go to
    stderr."""
    from recorder import capture

    failing = capture.Session._capture_inputs
    calls = []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated capture failure")
        return failing(self, *args, **kwargs)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with recorder.record(tmp_path / "glob.zarr", model=model, optimizer=opt, modules=["*", "nomatch.*"]) as run:
            for _ in range(2):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
        assert run.status == "complete"
        monkeypatch.setattr(capture.Session, "_capture_inputs", flaky)
        with recorder.record(tmp_path / "fail.zarr", model=model, optimizer=opt, modules=["*"]) as failed:
            for _ in range(3):
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
    assert failed.status == "incomplete" and not failed.session.enabled and len(calls) == 2
    err = capfd.readouterr().err
    assert "RecorderWarning: module glob(s) 'nomatch.*' matched no module" in err
    assert "RecorderWarning: PaperDebugger stopped recording (capturing a step's inputs: RuntimeError" in err
    assert replayer.open(tmp_path / "glob.zarr").status == "complete"


def test_numpy_errors_set_to_raise_do_not_stop_recording(tmp_path):
    """``np.seterr(all="raise")``, a common way to hunt NaN: the recorder's own statistics (tiny
    values beside a NaN underflow in numpy's dot) do not raise, and the NaN is recorded."""
    saved = np.seterr(all="raise")
    try:
        with recorder.record(tmp_path / "run.zarr", mode="stats") as run:
            _tiny(torch.tensor([1.0, float("nan"), 2.0]))
            _tiny(torch.ones(5000))
    finally:
        np.seterr(**saved)
    assert run.status == "complete"
    rec = replayer.open(tmp_path / "run.zarr")
    assert [r.stats["nan"] for r in rec.step(0).records] == [1, 1]


def test_a_store_deleted_while_recording_is_not_made_again(tmp_path):
    """The recording's directory is deleted mid-run (a cleaner of temporary files): training goes
    on, one warning says what happened and that nothing is left, and the directory is not made
    again (it held files written after the deletion and not the chunks before: `complete`, and
    unreadable)."""
    path = tmp_path / "run.zarr"

    @recorder.paper_step("Eq. 1")
    def double(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2

    outputs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with recorder.record(path, mode="full", flush_interval=0.02) as run:
            for i in range(400):
                outputs.append(double(torch.full((8,), float(i))))
                if i == 200:
                    assert run.flush()
                    shutil.rmtree(path)
    assert len(outputs) == 400 and torch.equal(outputs[-1], torch.tanh(torch.full((8,), 399.0)) * 2)
    said = recording_ours(caught)
    assert said == [f"PaperDebugger stopped recording: {path} was deleted while it was being recorded, and nothing of "
                    "it is left to read; record to a path nothing else deletes. Training continues"], said
    # the warning points at the training code's line, not at the recorder's (recorder/capture.py:520)
    assert [w.filename for w in caught if "stopped recording" in str(w.message)] == [__file__]
    assert not path.exists() and run.status == "incomplete"


DELETES_ITS_STORE = """
import shutil, sys, torch, recorder

@recorder.paper_step("Eq. 1")
def double(x):
    return torch.tanh(x) * 2

for i in range(400):
    double(torch.full((8,), float(i)))
    if i == 200:
        shutil.rmtree(sys.argv[1])  # a cleaner of temporary files
print("trained", flush=True)
"""


def test_pdbg_record_does_not_count_steps_of_a_recording_that_is_gone(tmp_path):
    """pdbg record's last line said "recording in run.zarr (incomplete, 400 steps)" for a directory
    that no longer existed: the steps started, not those on disk."""
    from tests.cli import pdbg

    (tmp_path / "train.py").write_text(DELETES_ITS_STORE)
    res = pdbg("record", "-o", "run.zarr", "--", "train.py", "run.zarr", cwd=tmp_path)
    assert res.returncode == 0 and "trained" in res.stdout, res.stderr
    assert res.stderr.rstrip().splitlines()[-1] == (
        "pdbg: no readable recording in run.zarr (incomplete; recording stopped: writer: run.zarr was deleted while "
        "it was being recorded, and nothing of it is left to read; record to a path nothing else deletes)")


FULL_FROM_THE_START = """
import errno, os, sys, torch, recorder
from recorder.store import backend


def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


backend.put = full  # the disk has no room left at all


@recorder.paper_step("Eq. 1")
def double(x):
    return torch.tanh(x) * 2


for i in range(50):
    double(torch.full((8,), float(i)))
print("trained", flush=True)
"""


@pytest.mark.parametrize("mode", ["full", "flight"])
def test_pdbg_record_on_a_full_disk_says_the_disk_is_full(tmp_path, mode):
    """On a disk with no room for the first commit, pdbg record's last line did not say why the
    recording was incomplete, and in flight mode it said that the script's process died (exit status
    0 before the recording was closed) and to record with a larger --keep. No room is left for the status
    either, so the recording reads as crashed, as pdbg info then says, and the line says so (it said
    "incomplete"): in flight mode the child that wrote it is gone; in full mode pdbg is its writer, and the
    line says that the status could not be written."""
    from tests.cli import pdbg

    (tmp_path / "train.py").write_text(FULL_FROM_THE_START)
    res = pdbg("record", "--mode", mode, "-o", "run.zarr", "--", "train.py", cwd=tmp_path)
    assert res.returncode == 0 and "trained" in res.stdout, res.stderr
    last = res.stderr.rstrip().splitlines()[-1]
    status = "crashed, 0 steps" if mode == "flight" else \
        "incomplete, 0 steps; that status could not be written: it reads as crashed once pdbg exits"
    assert last == (f"pdbg: recording in run.zarr ({status}); recording stopped: writer: the disk holding "
                    "run.zarr is full (No space left on device); free space on it or record to another disk "
                    "(mode='stats' or every=k record less)"), last
    info = pdbg("info", "run.zarr", cwd=tmp_path)
    assert info.returncode == 0 and info.stdout.startswith("run.zarr: crashed, 0 steps"), info.stdout
