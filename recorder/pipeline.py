"""The background writer: one thread, fed by a queue bounded in bytes.

The training thread hands over snapshots (payload bytes it copied, statistics, step rows); this
thread hashes what was sent under a token (activations, gradients, accelerator bytes), deduplicates,
encodes and writes, and commits every ``flush_interval`` seconds. Only one thread ever touches the
store, so no update is lost.

The writer is woken in batches, not for every item: once ``WAKE_ITEMS`` items are queued, once the
queued bytes reach ``WAKE_SHARE`` of a budget, for a flush or the close, before training waits for
room, and otherwise ``WAKE_S`` after it went idle. A wake-up costs the training thread more than
the item it is for: the writer takes the interpreter lock at once and holds it while training's
next Python line waits; woken for each of a small step's items, it doubled what a step cost
(bench/step_cost.py, docs/PERFORMANCE.md "Per-step cost").

When the store is slower than training (docs/RELIABILITY.md, "A slow store"), payload bytes are
what gives way: with ``when_slow="drop_payloads"`` (the default) training waits for room at most
``WAIT_CAP_S`` at a time and ``WAIT_SHARE`` of its time overall, and a payload that finds no room
after that is dropped (its tensor record keeps its statistics, payload -1). Step rows and statistics
are never dropped: they have a queue budget of their own, and wait for room when even that is full.
With ``when_slow="wait"`` payloads wait too. Either way, a writer that makes no progress for
``backpressure_timeout`` seconds is given up on: recording stops and the run is ``incomplete``.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import jsonval, snapshot
from . import payload as payload_mod
from .items import ForgetIterations, ModuleObjects, PayloadItem, RingWritten, ScalerSkip, StagingPool, StepItem
from .store import backend, layout
from .store.writer import StoreWriter

HEARTBEAT_S = 30.0
WHEN_SLOW = ("drop_payloads", "wait")
WAIT_CAP_S = 1.0  # drop_payloads: the longest training waits at once for room for a payload...
WAIT_SHARE = 0.05  # ...and the share of its time it may spend waiting overall (the allowance refills at this rate)
RECORD_QUEUE_BYTES = 256 << 20  # step rows and statistics queued at most (estimated, see record_bytes)
STEP_BYTES, TENSOR_BYTES = 32 << 10, 1 << 10  # a queued step's memory: its RNG states (~30 KB), then per tensor record
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_MIN_WAIT_S = 0.002
ABANDON_WAIT_S = 10.0  # close(): the longest it waits for a failed writer to publish "incomplete"
WAKE_ITEMS = 64  # items queued before the writer is woken (see the module's docstring)...
WAKE_SHARE = 8  # ...or 1/8 of the queue's byte budget (payloads), or of the records' budget
WAKE_S = 0.25  # ...or this long after the writer went idle: an item waits at most this before it is written


class WriterStalled(TimeoutError):
    """The writer made no progress (no item written, no commit) for ``backpressure_timeout`` seconds."""


def record_bytes(item: StepItem) -> int:
    """Estimated memory of a queued step: mostly its RNG states (Python's alone is a tuple of 625
    ints) and its tensor records. Counted against ``max_record_bytes``, not ``max_queue_bytes``."""
    return STEP_BYTES + TENSOR_BYTES * len(item.tensors)


def _label(writer: StoreWriter) -> str:
    """The recording's name in a message: its directory, URL or kind of store."""
    root = backend.local_root(writer.store)
    return str(root) if root is not None else backend.describe(writer.store)


class Pipeline:
    """Queue + writer thread around a StoreWriter."""

    def __init__(self, writer: StoreWriter, *, max_queue_bytes: int = 512 << 20, flush_interval: float = 1.0,
                 backpressure_timeout: float = 120.0, when_slow: str = "drop_payloads",
                 max_record_bytes: int = RECORD_QUEUE_BYTES) -> None:
        if when_slow not in WHEN_SLOW:
            raise ValueError(f"unknown when_slow {when_slow!r}: use one of {', '.join(WHEN_SLOW)}")
        self.writer = writer
        self.max_queue_bytes, self.flush_interval = max_queue_bytes, flush_interval
        self.backpressure_timeout = backpressure_timeout  # seconds without progress before the writer is given up on
        self.when_slow, self.max_record_bytes = when_slow, max_record_bytes
        self._queue: deque[tuple[Any, int, int]] = deque()  # (item, payload bytes, record bytes)
        self._bytes = 0  # payload bytes queued or reserved
        self._record_bytes = 0  # estimated bytes of queued step records
        self._cond = threading.Condition()  # reentrant: a signal handler may hand over items (flight mode)
        self.error: BaseException | None = None
        self.error_trace = ""
        self._tokens: dict[int, tuple[int, int, int]] = {}
        self._waiting: dict[Any, list[tuple[int, int]]] = {}  # payload ref -> [(tensor row, iteration)]
        self.pool: Any = StagingPool()
        # Flight mode with its ring in shared memory (recorder.shmring, set by Session.share_ring): records
        # waiting for ring bytes are journaled there, and bytes and records written out stay journaled
        # until they are committed, so a parent process can write them after a hard crash.
        self.journal: Any = None
        self._uncommitted_rows: list[int] = []
        self._uncommitted_buffers: list[Any] = []
        self._rng_docs: dict[tuple[str, Any], int] = {}
        self._objects = ModuleObjects()  # several module objects run as one step: the run's info lists them
        self._rng_sets: dict[tuple[tuple[str, int], ...], int] = {}  # {part: doc id} documents by content
        self.peak_queue_bytes = 0  # payload bytes, at most max_queue_bytes (or one larger payload alone)
        self.peak_record_bytes = 0
        self.dropped_payloads = 0  # payloads not recorded because the store could not keep up
        self.dropped_bytes = 0
        self.waited_s = 0.0  # time training spent waiting for room in the queue
        self._allowance = WAIT_CAP_S  # drop_payloads: seconds training may still wait for room
        self._allowance_at = time.monotonic()
        self._progress = time.monotonic()  # the writer's last finished item or commit
        self._final: dict[str, Any] = {}  # the run's final information, once close() has it
        self._published = False  # the final information went out with the status "incomplete"
        self.ready = threading.Event()  # set once the store's layout is on disk (or creating it failed)
        self._thread = threading.Thread(target=self._run, name="pdbg-writer", daemon=True)
        self._thread.start()

    # -- training-thread side --------------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        """Take room for a payload that may be dropped (full mode), before its bytes are copied; the
        item follows with ``submit(item, nbytes, reserved=True)`` (or ``unreserve``). Returns False
        when there is no room, per ``when_slow`` (counted in ``dropped_payloads``), or when the
        writer has stopped (``error`` is set)."""
        with self._cond:
            if self.error is None and not self._fits(nbytes):
                if self.when_slow == "wait":
                    self._wait_for(lambda: self._fits(nbytes))
                else:
                    self._wait_briefly(nbytes)
            if self.error is not None:
                return False
            if not self._fits(nbytes):
                self.dropped_payloads += 1
                self.dropped_bytes += nbytes
                return False
            self._take(nbytes)
            return True

    def unreserve(self, nbytes: int) -> None:
        """Give back room taken by ``reserve`` for an item that will not be submitted."""
        with self._cond:
            self._bytes = max(0, self._bytes - nbytes)
            self._cond.notify_all()

    def submit(self, item: Any, nbytes: int = 0, *, reserved: bool = False) -> bool:
        """Enqueue an item. Payloads not ``reserved`` (flight mode's) and step records wait while the
        queue has no room for them: they are never dropped. Returns False when the writer has failed
        or was given up on (``error`` says why)."""
        with self._cond:
            record = 0
            if isinstance(item, StepItem):
                record, nbytes = max(nbytes, record_bytes(item)), 0
                if self._record_bytes and self._record_bytes + record > self.max_record_bytes:
                    self._wait_for(lambda: not self._record_bytes or
                                   self._record_bytes + record <= self.max_record_bytes)
            elif nbytes and not reserved and not self._fits(nbytes):
                self._wait_for(lambda: self._fits(nbytes))
            if self.error is not None:
                return False
            if not self._queue:
                self._progress = time.monotonic()  # the writer's time to show progress starts now
            self._queue.append((item, nbytes, record))
            if not reserved:
                self._take(nbytes)
            if record:
                self._record_bytes += record
                self.peak_record_bytes = max(self.peak_record_bytes, self._record_bytes)
            if self._wake_due(item):
                self._cond.notify_all()
        return True

    def _wake_due(self, item: Any) -> bool:
        """Whether to wake the writer for the item just queued (the module's docstring says why not always)."""
        return (not isinstance(item, (StepItem, PayloadItem, ForgetIterations, ScalerSkip, RingWritten))
                or len(self._queue) >= WAKE_ITEMS
                or self._bytes * WAKE_SHARE >= self.max_queue_bytes
                or self._record_bytes * WAKE_SHARE >= self.max_record_bytes)

    def _fits(self, nbytes: int) -> bool:
        # A payload larger than the whole bound goes alone, or it could never be recorded.
        return self._bytes + nbytes <= self.max_queue_bytes or self._bytes == 0

    def _take(self, nbytes: int) -> None:
        self._bytes += nbytes
        self.peak_queue_bytes = max(self.peak_queue_bytes, self._bytes)

    def _wait_briefly(self, nbytes: int) -> None:
        """drop_payloads: wait for room as long as the allowance lasts. The allowance refills at
        ``WAIT_SHARE`` of the time passed, up to ``WAIT_CAP_S``: a short hiccup of the store costs
        no payload, a store that stays slow costs training at most that share of its time."""
        now = time.monotonic()
        self._allowance = min(WAIT_CAP_S, self._allowance + WAIT_SHARE * (now - self._allowance_at))
        self._allowance_at = now
        if self._allowance < _MIN_WAIT_S:  # a wait this short would cost more than it could gain
            return
        deadline = now + self._allowance
        self._cond.notify_all()  # the writer makes the room: it may be waiting for a batch to fill
        while self.error is None and not self._fits(nbytes):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(timeout=left)
        waited = time.monotonic() - now
        self._allowance -= waited  # below 0 when waking up took longer than asked: repaid before the next wait
        self.waited_s += waited

    def _wait_for(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``; give the writer up (``error``) once it has made no progress for
        ``backpressure_timeout`` seconds, so training is never held forever."""
        start = time.monotonic()
        self._cond.notify_all()  # the writer makes the room: it may be waiting for a batch to fill
        while self.error is None and not ready():
            idle = time.monotonic() - self._progress
            if idle >= self.backpressure_timeout:
                self._stalled()
                break
            self._cond.wait(timeout=min(1.0, self.backpressure_timeout - idle))
        self.waited_s += time.monotonic() - start

    def _stalled(self) -> None:
        with self._cond:
            if self.error is None:
                self.error = WriterStalled(f"the recording writer made no progress for "
                                           f"{self.backpressure_timeout:.0f} s")
            self._cond.notify_all()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """While it lasts, the queue's lock is not held by this thread, even when this thread held it
        when it was interrupted (a signal handler run inside ``submit``): the handler's wait for the
        writer thread, which needs the lock, would wait forever. Taken again, as it was, after."""
        if not self._cond._is_owned():  # type: ignore[attr-defined]  # (Condition's own, as wait() uses)
            yield
            return
        state = self._cond._release_save()  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self._cond._acquire_restore(state)  # type: ignore[attr-defined]

    def flush(self, timeout: float | None = None) -> bool:
        """Commit everything submitted so far; waits for it. Returns False on failure or timeout."""
        done = threading.Event()
        if not self.submit(("flush", done)):
            return False
        return done.wait(timeout) and self.error is None

    def close(self, status: str, info: dict[str, Any], timeout: float | None = None) -> None:
        """Drain the queue, write the final status and stop the thread.

        Waits while the writer makes progress (a slow store takes its time), up to ``timeout``. A
        writer that failed, or makes no progress for ``backpressure_timeout`` seconds, leaves the
        run ``incomplete``: published here when its thread has ended, else by the thread itself if
        it ever returns from the store."""
        with self._cond:
            self._final = dict(info)
        if self._thread.is_alive() and self.submit(("close", status, info)):
            self._join(timeout)
        elif self._thread.is_alive() and not isinstance(self.error, WriterStalled):
            # The writer failed on its own and is publishing "incomplete" (two small writes): let it
            # finish, so that the run reads as closed once close() returns. A stalled one is stuck in
            # the store; waiting for it is what was given up on.
            self._thread.join(ABANDON_WAIT_S if timeout is None else min(timeout, ABANDON_WAIT_S))
        if self.error is not None and not self._thread.is_alive() and not self._published:
            self._abandon()
        self.pool.release()  # no payload comes after the close; a writer given up on drops what it gives back

    def _join(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread.is_alive():
            self._thread.join(1.0)
            now = time.monotonic()
            if self._thread.is_alive() and (now - self._progress >= self.backpressure_timeout or
                                            (deadline is not None and now >= deadline)):
                self._stalled()
                return

    def problem(self) -> str:
        """What stopped the writer and what to do, as a phrase for a one-line message."""
        exc, where = self.error, _label(self.writer)
        if self.store_gone():
            return (f"{where} was deleted while it was being recorded, and nothing of it is left to read; record to "
                    "a path nothing else deletes")
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return (f"the disk holding {where} is full ({exc.strerror or exc}); free space on it or record to "
                    "another disk (mode='stats' or every=k record less)")
        if isinstance(exc, WriterStalled):
            return f"{exc} writing {where}; check the disk or network store it is on"
        return f"writing {where} failed ({type(exc).__name__}: {exc}); check the disk or store it is on"

    def store_gone(self) -> bool:
        """Whether the writer stopped because the local directory it writes was deleted."""
        root = backend.local_root(self.writer.store)
        return isinstance(self.error, FileNotFoundError) and root is not None and not root.exists()

    def where(self) -> str:
        """The recording's name in a message."""
        return _label(self.writer)

    # -- writer-thread side ----------------------------------------------------------------------
    def _run(self) -> None:
        dirty = False
        entry: tuple[Any, int, int] | None = None
        try:
            try:
                self.writer.create()  # the store's files, made here rather than on the training thread
            finally:
                self.ready.set()
            last_flush = last_commit = time.monotonic()
            interval = self.flush_interval
            while True:
                with self._cond:
                    if entry is not None:  # done with it: its room is free (one lock per item)
                        self._bytes = max(0, self._bytes - entry[1])
                        self._record_bytes = max(0, self._record_bytes - entry[2])
                        self._progress = time.monotonic()
                        self._cond.notify_all()
                        entry = None
                    if not self._queue and self.error is None:
                        self._cond.wait(timeout=min(self.flush_interval, WAKE_S))
                    if self.error is not None:  # the training side gave up on this thread (stalled)
                        break
                    entry = self._queue.popleft() if self._queue else None
                item = entry[0] if entry is not None else None
                if isinstance(item, tuple) and item[0] == "close":
                    self.writer.close(item[1], item[2])
                    return
                if isinstance(item, tuple) and item[0] == "flush":
                    self.writer.flush()
                    self._committed()
                    last_flush = last_commit = time.monotonic()
                    dirty = False
                    item[1].set()
                elif item is not None:
                    self._handle(item)
                    dirty = True
                # Checked after every item, so commits keep their pace even when the queue is long.
                now = time.monotonic()
                if (dirty and now - last_flush >= interval) or now - last_commit >= HEARTBEAT_S:
                    self.writer.flush()
                    self._committed()
                    last_flush = last_commit = time.monotonic()
                    # A commit slower than flush_interval (a slow store) spaces the next one as far:
                    # at most half of this thread's time goes to commits, the rest to the queue.
                    interval = max(self.flush_interval, last_flush - now)
                    self._progress = last_flush
                    dirty = False
        except BaseException as exc:  # never let the writer die silently: the session reports it
            with self._cond:
                if self.error is None:
                    self.error, self.error_trace = exc, traceback.format_exc()
        with self._cond:
            pending = ([entry[0]] if entry is not None else []) + [queued for queued, *_ in self._queue]
            self._queue.clear()
            self._bytes = self._record_bytes = 0
            self._cond.notify_all()
        for waiting in pending:  # nobody waits forever on a flush that will not happen
            if isinstance(waiting, tuple) and waiting[0] == "flush":
                waiting[1].set()
        self._abandon()

    def _abandon(self) -> None:
        """Publish the status ``incomplete`` and why, committing nothing more (the writer's own
        state past its last commit may be half updated). On a full disk this may fail too: then
        the last manifest stands, and readers see ``recording`` until this process ends."""
        with self._cond:
            final = dict(self._final)
        info = {**final, "writer_error": repr(self.error), "writer_traceback": self.error_trace[-20000:]}
        with contextlib.suppress(Exception):
            self.writer.abandon(info)
            self._published = bool(final)

    def _handle(self, item: Any) -> None:
        if isinstance(item, PayloadItem):
            self._store_payload(item)
        elif isinstance(item, StepItem):
            self._store_step(item)
        elif isinstance(item, ForgetIterations):
            gone = set(item.iterations)
            for ref in list(self._waiting):
                rows = [r for r in self._waiting[ref] if r[1] not in gone]
                if self.journal is not None:
                    for row, iteration in self._waiting[ref]:
                        if iteration in gone:
                            self.journal.done(row)
                if rows:
                    self._waiting[ref] = rows
                else:
                    del self._waiting[ref]
        elif isinstance(item, (ScalerSkip, RingWritten)):
            item.add_to(self.writer.info)
        else:
            raise TypeError(f"unexpected queue item {type(item).__name__}")

    def _store_payload(self, item: PayloadItem) -> None:
        data, key = item.data, item.key
        if item.pinned is not None:
            if item.event is not None:
                item.event.synchronize()
            data = payload_mod.units_of_bytes(item.pinned.numpy(), item.unit)
        assert data is not None
        if key is None:  # sent under a token (device bytes, CPU activations and gradients): hashed here
            key = payload_mod.content_key(data, item.unit)
            if item.token not in self._waiting:  # the record comes after its bytes (full mode, an
                self._tokens[item.token] = key  # anomaly's iteration, a ring written while the step runs)
        pid = self.writer.payload(key, data)
        if item.buffer is not None:
            if self.journal is not None:  # shared ring: the bytes stay journaled until committed
                self._uncommitted_buffers.append(item.buffer)
            else:
                self.pool.give(item.buffer)
        if self._waiting:  # flight mode: records written before these bytes were kept
            rows = self._waiting.pop(key, []) + (self._waiting.pop(item.token, []) if item.key is None else [])
            for row, _ in rows:
                self.writer.late(row, pid)
                if self.journal is not None:
                    self._uncommitted_rows.append(row)

    def _committed(self) -> None:
        """After a commit: journaled bytes and records that are now on disk are journaled no more."""
        if self.journal is None:
            return
        for row in self._uncommitted_rows:
            self.journal.done(row)
        for buf in self._uncommitted_buffers:
            self.pool.give(buf)
        self._uncommitted_rows, self._uncommitted_buffers = [], []

    def _rng_doc(self, parts: dict[str, tuple[Any, Any]]) -> int:
        ids = {}
        for name, (key, state) in parts.items():
            cache_key = (name, key)
            doc_id = self._rng_docs.get(cache_key)
            if doc_id is None:
                if len(self._rng_docs) >= 4096:  # states that keep changing (dropout): a bounded cache
                    self._rng_docs.clear()
                doc_id = self.writer.doc({"rng": name, **snapshot.encode_rng_part(name, state)}, remember=False)
                self._rng_docs[cache_key] = doc_id
            ids[name] = doc_id
        key = tuple(ids.items())
        found = self._rng_sets.get(key)
        if found is None:
            if len(self._rng_sets) >= 4096:  # only a cache: a set seen again after a clear is stored twice
                self._rng_sets.clear()
            found = self._rng_sets[key] = self.writer.doc(ids, remember=False)
        return found

    def _store_step(self, item: StepItem) -> None:
        w = self.writer
        row = dict(item.row)
        for col, value in item.docs.items():
            if value is None:
                row[col] = layout.NO_REF
            else:  # definitions, module documents and unchanged settings are the same objects each step
                row[col] = w.doc_of(value) if col in ("definition", "module", "settings") else w.doc(value)
        row["rng"] = self._rng_doc(item.rng) if item.rng else layout.NO_REF
        if row.get("module", layout.NO_REF) != layout.NO_REF:
            self._objects.note(w.info, row["module"], item.docs)
        nonfinite = False
        watched: dict[str, tuple[float, ...]] = {}
        cols: dict[str, list[Any]] = {name: [] for name in layout.TENSOR_COLUMNS if name not in ("step", "dims_start")}
        dims: list[int] = []
        waiting: list[tuple[int, Any, int]] = []
        nonfinite_roles = layout.RESULT_ROLES[row["phase"]]
        input_roles = layout.INPUT_ROLES[row["phase"]]
        bad_input = nan_result = nan_input = False
        for t in item.tensors:
            stats = t.stats
            if isinstance(stats, torch.Tensor):
                stats = tuple(float(v) for v in stats.cpu().tolist())
            if t.role == _WATCH:
                watched[t.name] = stats
            if stats[6] or stats[7]:
                if t.role in nonfinite_roles:
                    nonfinite, nan_result = True, nan_result or bool(stats[6])
                elif t.role in input_roles:
                    bad_input, nan_input = True, nan_input or bool(stats[6])
            pid = layout.NO_REF
            if t.payload is not None:
                ref = t.payload
                key = self._tokens.pop(ref, None) if isinstance(ref, int) else ref
                found = None if key is None else w.find_payload(key)
                if found is None:  # flight mode: the bytes wait in the ring, and may never come
                    waiting.append((len(cols["role"]), ref, t.held))
                else:
                    pid = found
            cols["role"].append(t.role)
            cols["name"].append(w.doc(t.name))
            cols["dtype"].append(w.doc(t.dtype))
            cols["device"].append(w.doc(t.device))
            cols["requires_grad"].append(t.requires_grad)
            cols["ndim"].append(len(t.shape))
            cols["stats"].append(stats)
            cols["payload"].append(pid)
            dims += t.shape
            # Sparse and meta tensors have no strides: -1 each, so every record keeps 2 * ndim dims.
            dims += t.stride if len(t.stride) == len(t.shape) else (-1,) * len(t.shape)
        # NaN/Inf in the numbers that are no tensors (numpy arrays, floats): a step that made them is where
        # they were made, and one that took them did not make them of finite inputs
        for doc, is_result in ((item.docs.get("output"), True), (item.docs.get("args"), False)):
            for found in jsonval.nonfinite(doc) if doc is not None else ():
                if is_result:
                    nonfinite, nan_result = True, nan_result or bool(found.nan)
                else:
                    bad_input, nan_input = True, nan_input or bool(found.nan)
        row["tensor_start"] = w.tensors_of_step(item.index, cols, dims)
        # Each record waits under the iteration whose ring holds its bytes, and is forgotten with it.
        for position, ref, held in waiting:
            self._waiting.setdefault(ref, []).append((row["tensor_start"] + position, held))
            if self.journal is not None and isinstance(ref, tuple):  # device bytes are not in shared memory
                self.journal.wait(row["tensor_start"] + position, ref, held)
        row["tensor_count"] = len(item.tensors)
        alerts = [a for e in item.expectations for a in _check(e, watched.get(e["name"]))]
        alerts += [e["shape_alert"] for e in item.expectations if e.get("shape_alert")]
        alerts += item.alerts
        extra: dict[str, Any] = {}
        if item.exception:
            extra["exception"] = item.exception
        if alerts:
            extra["alerts"] = alerts
        if item.expectations:
            extra["watches"] = [{k: v for k, v in e.items() if k != "shape_alert"} for e in item.expectations]
        if item.notes:
            extra["notes"] = item.notes
        if item.collectives:
            extra["collectives"] = item.collectives
        if item.vmap:
            extra["vmap"] = item.vmap
        if item.vmap_randomness:
            extra["vmap_randomness"] = item.vmap_randomness
        if item.own_grads:
            extra["own_grads"] = sorted(item.own_grads)
        if item.arguments:
            extra.update(item.arguments)
        row["extra"] = w.doc(jsonval.encode(extra)) if extra else layout.NO_REF  # tags nan/inf
        status = "exception" if item.exception else "nonfinite" if nonfinite else "alert" if alerts else "ok"
        row["status"] = layout.STATUSES.index(status)
        row["flags"] = ((layout.NONFINITE_RESULT if nonfinite else 0) | (layout.NONFINITE_INPUT if bad_input else 0)
                        | (layout.NAN_RESULT if nan_result else 0) | (layout.NAN_INPUT if nan_input else 0)
                        | (layout.ALERTS if alerts else 0))
        w.step(item.index, row)


_WATCH = layout.ROLES.index("watch")


def _check(expect: dict[str, Any], stats: tuple[float, ...] | None) -> list[dict[str, Any]]:
    """Broken value expectations of one watched tensor, from its statistics."""
    if stats is None:
        return []
    lo, hi, mean, norm, nan, inf = (stats[0], stats[1], stats[2], stats[5], stats[6], stats[7])
    out = []
    base = {"watch": expect["name"], "reference": expect.get("reference")}
    if expect.get("expected_range") is not None:
        a, b = expect["expected_range"]
        if nan or inf or lo < a or hi > b:
            out.append({**base, "check": "range", "expected": [a, b], "actual": [lo, hi],
                        "nonfinite": int(nan + inf)})
    if expect.get("expected_norm_range") is not None:
        a, b = expect["expected_norm_range"]
        if nan or inf or not a <= norm <= b:
            out.append({**base, "check": "norm", "expected": [a, b], "actual": norm})
    if expect.get("expected_mean") is not None:
        value, tol = expect["expected_mean"]
        if nan or inf or not abs(mean - value) <= tol:
            out.append({**base, "check": "mean", "expected": [value, tol], "actual": mean})
    return out
