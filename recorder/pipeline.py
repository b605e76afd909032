"""The background writer: one thread, fed by a queue bounded in bytes.

The training thread hands over snapshots (payload bytes it copied, statistics, step rows); this
thread hashes what came from accelerators, deduplicates, encodes and writes, and commits every
``flush_interval`` seconds. Only one thread ever touches the store, so no update is lost.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections import deque
from typing import Any

import torch

from . import jsonval, snapshot
from . import payload as payload_mod
from .items import ForgetIterations, PayloadItem, StagingPool, StepItem
from .store import layout
from .store.writer import StoreWriter

HEARTBEAT_S = 30.0


class Pipeline:
    """Queue + writer thread around a StoreWriter."""

    def __init__(self, writer: StoreWriter, *, max_queue_bytes: int = 512 << 20, flush_interval: float = 1.0,
                 backpressure_timeout: float = 120.0) -> None:
        self.writer = writer
        self.max_queue_bytes, self.flush_interval = max_queue_bytes, flush_interval
        self.backpressure_timeout = backpressure_timeout
        self._queue: deque[Any] = deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.error_trace = ""
        self._tokens: dict[int, tuple[int, int, int]] = {}
        self._waiting: dict[Any, list[tuple[int, int]]] = {}  # payload ref -> [(tensor row, iteration)]
        self.pool = StagingPool()
        self._rng_docs: dict[tuple[str, Any], int] = {}
        self._rng_sets: dict[tuple[tuple[str, int], ...], int] = {}  # {part: doc id} documents by content
        self.peak_queue_bytes = 0
        self.ready = threading.Event()  # set once the store's layout is on disk (or creating it failed)
        self._thread = threading.Thread(target=self._run, name="pdbg-writer", daemon=True)
        self._thread.start()

    # -- training-thread side --------------------------------------------------------------------
    def submit(self, item: Any, nbytes: int = 0) -> bool:
        """Enqueue an item; blocks while the queue holds more than ``max_queue_bytes`` (backpressure).
        Returns False when the writer has failed or stayed stuck past ``backpressure_timeout``."""
        with self._cond:
            deadline = time.monotonic() + self.backpressure_timeout
            while self._bytes > self.max_queue_bytes and self.error is None:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and \
                        time.monotonic() >= deadline:
                    self.error = TimeoutError(f"the recording writer made no progress for "
                                              f"{self.backpressure_timeout:.0f} s (disk stalled?)")
                    break
            if self.error is not None:
                return False
            self._queue.append((item, nbytes))
            self._bytes += nbytes
            self.peak_queue_bytes = max(self.peak_queue_bytes, self._bytes)
            self._cond.notify_all()
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Commit everything submitted so far; waits for it. Returns False on failure or timeout."""
        done = threading.Event()
        if not self.submit(("flush", done)):
            return False
        return done.wait(timeout) and self.error is None

    def close(self, status: str, info: dict[str, Any], timeout: float | None = None) -> None:
        """Drain the queue, write the final status and stop the thread."""
        if self._thread.is_alive():
            self.submit(("close", status, info))
            self._thread.join(timeout)
        if self.error is not None:
            # Still publish what was committed and why the rest is missing; if even that fails, the
            # last manifest stands and readers infer "crashed" from the dead writer.
            with contextlib.suppress(Exception):
                self.writer.close("crashed", {**info, "writer_error": repr(self.error),
                                              "writer_traceback": self.error_trace[-20000:]})

    # -- writer-thread side ----------------------------------------------------------------------
    def _run(self) -> None:
        dirty = False
        item: Any = None
        try:
            try:
                self.writer.create()  # the store's files, made here rather than on the training thread
            finally:
                self.ready.set()
            last_flush = last_commit = time.monotonic()
            while True:
                with self._cond:
                    if not self._queue:
                        self._cond.wait(timeout=self.flush_interval)
                    item, nbytes = self._queue.popleft() if self._queue else (None, 0)
                if isinstance(item, tuple) and item[0] == "close":
                    self.writer.close(item[1], item[2])
                    return
                if isinstance(item, tuple) and item[0] == "flush":
                    self.writer.flush()
                    last_flush = last_commit = time.monotonic()
                    dirty = False
                    item[1].set()
                elif item is not None:
                    self._handle(item)
                    dirty = True
                self._release(nbytes)
                # Checked after every item, so commits keep their pace even when the queue is long.
                now = time.monotonic()
                if (dirty and now - last_flush >= self.flush_interval) or now - last_commit >= HEARTBEAT_S:
                    self.writer.flush()
                    last_flush = last_commit = now
                    dirty = False
        except BaseException as exc:  # never let the writer die silently: the session reports it
            with self._cond:
                self.error, self.error_trace = exc, traceback.format_exc()
                pending = [item, *(queued for queued, _ in self._queue)]
                self._queue.clear()
                self._bytes = 0
                self._cond.notify_all()
            for waiting in pending:  # nobody waits forever on a flush that will not happen
                if isinstance(waiting, tuple) and waiting[0] == "flush":
                    waiting[1].set()

    def _release(self, nbytes: int) -> None:
        if nbytes:
            with self._cond:
                self._bytes -= nbytes
                self._cond.notify_all()

    def _handle(self, item: Any) -> None:
        if isinstance(item, PayloadItem):
            self._store_payload(item)
        elif isinstance(item, StepItem):
            self._store_step(item)
        elif isinstance(item, ForgetIterations):
            gone = set(item.iterations)
            for ref in list(self._waiting):
                rows = [r for r in self._waiting[ref] if r[1] not in gone]
                if rows:
                    self._waiting[ref] = rows
                else:
                    del self._waiting[ref]
        else:
            raise TypeError(f"unexpected queue item {type(item).__name__}")

    def _store_payload(self, item: PayloadItem) -> None:
        data, key = item.data, item.key
        if item.pinned is not None:
            if item.event is not None:
                item.event.synchronize()
            data = payload_mod.units_of_bytes(item.pinned.numpy(), item.unit)
            key = payload_mod.content_key(data, item.unit)
            self._tokens[item.token] = key
        assert key is not None
        pid = self.writer.payload(key, data)
        if item.buffer is not None:
            self.pool.give(item.buffer)
        if self._waiting:  # flight mode: records written before these bytes were kept
            rows = self._waiting.pop(key, []) + (self._waiting.pop(item.token, []) if item.pinned is not None else [])
            for row, _ in rows:
                self.writer.late(row, pid)

    def _rng_doc(self, parts: dict[str, tuple[Any, Any]]) -> int:
        ids = {}
        for name, (key, state) in parts.items():
            cache_key = (name, key)
            doc_id = self._rng_docs.get(cache_key)
            if doc_id is None:
                if len(self._rng_docs) >= 65536:  # states that keep changing (dropout): a bounded cache
                    self._rng_docs.clear()
                doc_id = self.writer.doc({"rng": name, **snapshot.encode_rng_part(name, state)})
                self._rng_docs[cache_key] = doc_id
            ids[name] = doc_id
        key = tuple(ids.items())
        found = self._rng_sets.get(key)
        if found is None:
            if len(self._rng_sets) >= 4096:  # only a cache: the writer deduplicates documents too
                self._rng_sets.clear()
            found = self._rng_sets[key] = self.writer.doc(ids)
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
        nonfinite = False
        watched: dict[str, tuple[float, ...]] = {}
        cols: dict[str, list[Any]] = {name: [] for name in layout.TENSOR_COLUMNS if name not in ("step", "dims_start")}
        dims: list[int] = []
        waiting: list[tuple[int, Any]] = []
        nonfinite_roles = layout.RESULT_ROLES[row["phase"]]
        input_roles = layout.INPUT_ROLES[row["phase"]]
        bad_input = False
        for t in item.tensors:
            stats = t.stats
            if isinstance(stats, torch.Tensor):
                stats = tuple(float(v) for v in stats.cpu().tolist())
            if t.role == _WATCH:
                watched[t.name] = stats
            if stats[6] or stats[7]:
                nonfinite = nonfinite or t.role in nonfinite_roles
                bad_input = bad_input or t.role in input_roles
            pid = layout.NO_REF
            if t.payload is not None:
                ref = t.payload
                key = self._tokens.pop(ref, None) if isinstance(ref, int) else ref
                found = None if key is None else w.find_payload(key)
                if found is None:  # flight mode: the bytes wait in the ring, and may never come
                    waiting.append((len(cols["role"]), ref))
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
        row["tensor_start"] = w.tensors_of_step(item.index, cols, dims)
        for position, ref in waiting:
            self._waiting.setdefault(ref, []).append((row["tensor_start"] + position, row["iteration"]))
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
        row["extra"] = w.doc(jsonval.encode(extra)) if extra else layout.NO_REF  # tags nan/inf
        status = "exception" if item.exception else "nonfinite" if nonfinite else "alert" if alerts else "ok"
        row["status"] = layout.STATUSES.index(status)
        row["flags"] = (layout.NONFINITE_RESULT if nonfinite else 0) | (layout.NONFINITE_INPUT if bad_input else 0)
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
