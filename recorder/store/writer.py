"""Synchronous writer of the store layout. Used by the recorder's background thread only.

Crash safety rests on one ordering: chunks are written first, the manifest (committed lengths) last,
atomically and durably. Rows past a committed length may exist on disk after a kill; readers never
look at them.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import numpy as np
import xxhash
import zarr
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from ..errors import RecordingError
from . import backend, codecs, layout
from .layout import Column

_DOC_CACHE = 1 << 16  # documents remembered for deduplication (~10 MB of index at most)
_STR_CACHE = 1 << 16  # short strings (names, dtypes, devices) remembered by value
# Whole payload chunks (layout.BLOB_CHUNK_BYTES each, encoded) being written and synced at once.
PUTS_IN_FLIGHT = 4


class _DaemonThreads:
    """A few daemon threads running submitted calls, each answered by a Future: the writer's I/O
    threads. Unlike a ThreadPoolExecutor's workers, which the interpreter joins at exit, a thread
    stuck in a write to a store that stopped answering never holds up the exit of the user's process
    (the writer thread is a daemon for the same reason)."""

    def __init__(self, n: int, name: str) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for it
                    future.set_exception(exc)

    def map(self, fn: Any, items: list[Any]) -> None:
        """``fn`` over ``items`` on these threads; returns when all are done, raising the first failure."""
        for future in [self.submit(fn, item) for item in items]:
            future.result()

    def shutdown(self, wait: bool = False, timeout: float | None = None) -> None:
        """Let the threads end once the calls submitted before are done; ``wait``: join them (each
        for ``timeout`` seconds at most: one stuck in a store that stopped answering is left)."""
        for _ in self._threads:
            self._calls.put(None)
        if wait:
            for thread in self._threads:
                thread.join(timeout)


def dumps(doc: Any) -> bytes:
    """Compact JSON bytes of a document (no NaN tokens), its keys in the order its objects hold them:
    a module's children and parameters, a dict argument's items (schema 1.16; before, sorted, which
    put "10" before "2" and a ModuleDict's children out of their order)."""
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


class AppendArray:
    """One growing zarr array, written a whole encoded chunk at a time from a RAM buffer."""

    def __init__(self, store: Store, key: str, meta: dict[str, Any], col: Column, comp: codecs.Compression) -> None:
        self.store, self.col, self.comp = store, col, comp
        self.key = key
        self.meta = meta  # the array's zarr.json, rewritten by this class when the shape changes
        self.capacity = int(meta["shape"][0])  # rows the zarr.json declares (see _template)
        self._buf: np.ndarray | None = None  # allocated on first use: most runs never touch u1/u2/u8
        self._dropped = False  # drop_buffer(): the run is closed
        self.fill = 0  # rows in buf
        self._tail: list[Any] = []  # rows appended after those, as Python values (see append)
        self.chunk = 0  # index of the chunk buf holds
        self.length = 0  # rows in all: chunk * chunk_rows + fill + len(_tail), kept up to date
        self._full_at = col.chunk_rows  # the length at which the chunk buf holds is whole
        self.dirty = False  # buf has rows not yet on disk
        self._suffix = "/0" * len(col.row_shape)
        self._stored_left = 0  # adaptive compression: whole chunks to store uncompressed before a retest
        self._spare: str | None = None  # the key whose previous version is kept (backend.put(spare=True))
        self._partial_codec = False  # the partial last chunk on disk is in the codec's partial_cname
        # Where whole chunks go once encoded (StoreWriter._put_later for payload bytes); None: written here.
        self.put_whole: Any = None

    def __len__(self) -> int:
        return self.length

    def _counted(self) -> None:
        """Recompute ``length`` and ``_full_at`` after rows moved or chunks were written."""
        per = self.col.chunk_rows
        self.length = self.chunk * per + self.fill + len(self._tail)
        self._full_at = (self.chunk + 1) * per

    @property
    def buf(self) -> np.ndarray:
        # Uninitialised: rows are always written before they are read, and a partial chunk's
        # remainder is zeroed when it is committed.
        if self._buf is None:
            if self._dropped and self.fill:
                raise RuntimeError(f"{self.key}: the run is closed; its partial chunk is on disk only")
            self._buf = np.empty((self.col.chunk_rows, *self.col.row_shape), dtype=self.col.dtype)
        return self._buf

    def drop_buffer(self) -> None:
        """After the final commit: the chunk buffer's rows are in the store; its memory goes (a
        closed run's writer stays with its ``Run``, for as long as that is held). Rows of the
        partial chunk are then gone from memory: ``buf`` refuses to hand out a fresh buffer in
        its place."""
        self._buf = None
        self._dropped = True

    def append(self, row: Any) -> int:
        """Append one row (a Python value, or a tuple for a row of several); returns its index. Rows
        wait as Python values and reach the chunk buffer in bulk (one conversion per commit, not one
        numpy assignment per row). Called for every column of every step: kept to a few operations."""
        index = self.length
        self._tail.append(row)
        self.length = index + 1
        self.dirty = True
        if index + 1 >= self._full_at:  # a whole chunk waits: seal it
            self._drain()
        return index

    def append_rows(self, rows: list[Any]) -> int:
        """Append several rows given as Python values; returns the index of the first."""
        start = self.length
        self._tail += rows
        self.length = start + len(rows)
        self.dirty = True
        if self.length >= self._full_at:
            self._drain()
        return start

    def extend(self, rows: np.ndarray) -> int:
        """Append many rows (1-D data for 1-D arrays); returns the index of the first."""
        self._drain()
        start = len(self)
        n, pos, per = len(rows), 0, self.col.chunk_rows
        while pos < n:
            if self.fill == 0 and n - pos >= per:  # aligned whole chunk: encode straight from the source
                self._write(self.chunk, rows[pos:pos + per], whole=True)
                self.chunk += 1
                pos += per
                continue
            take = min(per - self.fill, n - pos)
            self.buf[self.fill:self.fill + take] = rows[pos:pos + take]
            self.fill += take
            self.dirty = True
            pos += take
            if self.fill == per:
                self._seal()
        self._counted()
        return start

    def _drain(self) -> None:
        """Move the rows appended as Python values into the chunk buffer (sealing full chunks)."""
        if self._tail:
            rows = np.asarray(self._tail, dtype=self.col.dtype).reshape(-1, *self.col.row_shape)
            self._tail = []
            self.length -= len(rows)  # counted again as extend() appends them
            self.extend(rows)

    def flush(self, final: bool = False) -> None:
        """Write the partial last chunk if it changed, padded with the fill value (not stale rows).
        It is written again at the next commit, so its previous version is kept to be overwritten
        (``backend.put(spare=True)``), unless this is the ``final`` write, which also re-encodes an
        unchanged chunk stored in the codec's faster ``partial_cname``."""
        self._drain()
        if (self.dirty or (final and self._partial_codec)) and self.fill:
            self.buf[self.fill:] = 0
            self._write(self.chunk, self.buf, spare=not final)
        elif final and self._spare is not None:  # unchanged since the last commit: only its spare goes
            backend.drop_spare(self.store, self._spare)
            self._spare = None
        self.dirty = False

    def trim(self) -> None:
        """Set the zarr shape to the exact length, so plain zarr reads exactly the committed rows."""
        self._drain()
        if self.capacity != len(self):  # arrays never written (payloads in stats mode) stay as made
            self._resize(len(self))

    def resume(self, length: int) -> None:
        """Continue after the first ``length`` rows of the array on disk, written by a writer that
        died (``self.meta`` must be its zarr.json as stored). The committed rows of the partial last
        chunk are loaded, so the next append lands at row ``length``; rows and chunks past it may be
        what the dead writer wrote after its last commit, and are overwritten as rows are appended."""
        self.capacity = int(self.meta["shape"][0])
        if not 0 <= length <= self.capacity:
            raise RecordingError(f"cannot resume {self.key}: {length} rows committed, but its zarr.json declares "
                                 f"{self.capacity}; the recording is damaged")
        self.chunk, self.fill = divmod(length, self.col.chunk_rows)
        self._tail = []
        self._counted()
        self.dirty = False
        if self.fill:
            start = self.chunk * self.col.chunk_rows
            stored = zarr.open_array(self.store, path=self.key, mode="r")
            self.buf[:self.fill] = np.asarray(stored[start:length])

    def _seal(self) -> None:
        self._write(self.chunk, self.buf, whole=True)
        self.chunk += 1
        self.fill = 0
        self.dirty = False

    def _resize(self, rows: int) -> None:
        # Written directly rather than through zarr.Array.resize: same JSON, a fraction of the cost.
        self.capacity = rows
        self.meta["shape"] = [rows, *self.col.row_shape]
        backend.put(self.store, f"{self.key}/zarr.json", json.dumps(self.meta, indent=2).encode())

    def _write(self, index: int, data: np.ndarray, whole: bool = False, spare: bool = False) -> None:
        needed = (index + 1) * self.col.chunk_rows
        if needed > self.capacity:
            self._resize(max(needed, 2 * self.capacity))  # geometric: few metadata rewrites
        # A whole chunk is written once, which also takes the spare a partial version of it left.
        key = f"{self.key}/c/{index}{self._suffix}"
        encoded = self._encode(data, whole, spare)  # here, in order: adaptive compression decides chunk by chunk
        if whole and self.put_whole is not None:
            self.put_whole(key, encoded)
        else:
            backend.put(self.store, key, encoded, spare=spare)
        if spare or key == self._spare:
            self._spare = key if spare else None

    def _encode(self, data: np.ndarray, whole: bool, spare: bool = False) -> bytes:
        """Compressed, or (adaptive compression, data that did not shrink) stored as it is. Only whole
        chunks decide: a partial one is padded with zeros, which compress whatever the data. A chunk
        the next commit writes again (``spare``) uses the codec's ``partial_cname``, if it has one."""
        comp = self.comp
        if not comp.adaptive:
            self._partial_codec = spare and comp.partial_cname is not None
            return comp.encode(data, partial=spare)
        if not whole:  # a partial chunk: as the whole ones are now
            return comp.encode_stored(data) if self._stored_left else comp.encode(data)
        if self._stored_left > 1:
            self._stored_left -= 1
            return comp.encode_stored(data)
        out = comp.encode(data)  # the first whole chunk, or a retest
        self._stored_left = codecs.RETEST if len(out) * codecs.MIN_RATIO > data.nbytes else 0
        return out


class StoreWriter:
    """Creates a run and appends steps, tensor records, payloads and documents to one rank."""

    def __init__(self, store: Store, *, run_attrs: dict[str, Any], compression: codecs.Compression,
                 rank: int = 0, world_size: int = 1, schema_version: str = layout.SCHEMA_VERSION) -> None:
        """Claim the store (rank 0: its root ``zarr.json``; rank k: its group ``rank<k>/zarr.json``);
        ``create()`` lays out the rest. ``schema_version``: the version to stamp, another than this one's
        only for a copy of an older recording's data (a bundle), which its readers must read as that.

        Split in two so that the training thread pays only for the claim: the ~50 files and
        directories of a rank's arrays are made by the writer thread (``create``), next to training.
        Ranks write disjoint files (rank 0 alone the root's), so they need no lock between them."""
        self.store, self.rank, self.schema_version = store, rank, schema_version
        group_key = f"{layout.rank_group(rank)}/zarr.json"
        claim = "zarr.json" if rank == 0 else group_key
        where = "a zarr hierarchy" if rank == 0 else f"a recording of rank {rank}"
        if backend.get(store, claim) is not None:
            raise RecordingError(f"the store already holds {where}; record into a new, empty one")
        self._files = dict(_template(rank, compression))
        root_meta = json.loads(self._files.pop("zarr.json"))
        ours = {"format": layout.FORMAT_NAME, "schema_version": schema_version,
                "compression": compression.describe(), "run": run_attrs}
        if world_size > 1:
            ours["world_size"] = world_size
        root_meta["attributes"] = {layout.ATTRS_KEY: ours}
        self.group_meta = json.loads(self._files[group_key])
        self.group_meta["attributes"] = {layout.ATTRS_KEY: {"rank": rank, "world_size": world_size,
                                                            "run": run_attrs}}
        self._files[group_key] = self._meta_bytes(self.group_meta)
        # The claim, exclusive: a process that started recording to the same path at the same moment
        # is refused here (checks of the path before it cannot tell which of two came first).
        if not backend.put_new(store, claim, self._meta_bytes(root_meta) if rank == 0 else self._files.pop(group_key)):
            raise RecordingError(f"the store already holds {where} (another process began recording there just now); "
                                 "record into a new, empty one")
        self.root_meta = root_meta
        self.dist: dict[str, Any] = {"rank": rank, "world_size": world_size, "backend": run_attrs.get("backend")}
        self.arrays: dict[str, AppendArray] = {}
        for col in layout.columns():
            key = f"{layout.rank_group(rank)}/{col.path}"
            self.arrays[col.path] = AppendArray(store, key, json.loads(self._files[f"{key}/zarr.json"]), col,
                                                _compression_of(col, compression))
        self._payload_ids: dict[tuple[int, int, int], int] = {}
        self._fresh_state()
        self.steps = 0  # committed-in-order step rows appended
        self.seq = 0
        self.status = "recording"
        self.info: dict[str, Any] = {}

    def _fresh_state(self) -> None:
        """What this process's writer knows of its own (new, or resumed from a dead writer's store)."""
        self._identity = {"pid": os.getpid(), "host": socket.gethostname(), "boot": backend.boot_id(),
                          "start": backend.process_start(os.getpid())}
        self._doc_ids: dict[bytes, int] = {}
        self._str_ids: dict[str, int] = {}
        self._identity_ids: dict[int, tuple[Any, int]] = {}
        self._pending: dict[int, dict[str, Any]] = {}
        self._io: _DaemonThreads | None = None
        self._puts: deque[Future[None]] = deque()  # whole payload chunks on their way to disk (_put_later)
        self._puts_lock = threading.Lock()
        self._put_pool: _DaemonThreads | None = None
        for arr in self.arrays.values():
            if arr.col.kind == "blob":
                arr.put_whole = self._put_later

    @staticmethod
    def _meta_bytes(meta: dict[str, Any]) -> bytes:
        """A group's zarr.json, its PaperDebugger attributes sealed with their checksum."""
        ours = meta.get("attributes", {}).get(layout.ATTRS_KEY)
        if isinstance(ours, dict):
            ours[layout.CHECKSUM_KEY] = layout.checksum(ours)
        return json.dumps(meta, indent=2, allow_nan=False).encode()

    def _publish_final(self) -> None:
        """The final status and what the run says about itself: in the rank's group (and, for
        rank 0, the root, where readers before schema 1.4 look)."""
        final = {"status": self.status, **self.info}
        for meta in (self.group_meta, self.root_meta):  # a process group made after the recording began
            run = meta["attributes"][layout.ATTRS_KEY]["run"]
            if run.get("backend") is None and self.dist.get("backend") is not None:
                run["backend"] = self.dist["backend"]
        self.group_meta["attributes"][layout.ATTRS_KEY]["final"] = final
        backend.put(self.store, f"{layout.rank_group(self.rank)}/zarr.json", self._meta_bytes(self.group_meta))
        if self.rank == 0:
            self.root_meta["attributes"][layout.ATTRS_KEY]["final"] = final
            backend.put(self.store, "zarr.json", self._meta_bytes(self.root_meta))

    def create(self) -> None:
        """Write the rank's group and array metadata, then the first manifest (0 steps)."""
        backend.remove_partials(self.store, layout.rank_group(self.rank), top=self.rank == 0)
        self._parallel(lambda kv: backend.put(self.store, *kv), list(self._files.items()))
        self._files = {}
        self.write_manifest()

    @classmethod
    def resume(cls, store: Store, rank: int = 0) -> StoreWriter:
        """Reopen a rank whose writer died without closing it, to append after its committed lengths
        (the parent of a crashed flight recording writes out the ring this way: recorder.recover).

        Every array continues at the length the rank's manifest commits; payloads already stored are
        known by their content key, so appending the same bytes again returns the stored row. Then
        ``close`` (trim, manifest, final status) as for a writer that never died. Raises
        RecordingError when there is no committed manifest to resume from."""
        raw_root, raw = backend.get(store, "zarr.json"), backend.get(store, layout.manifest_key(rank))
        try:
            root_meta = json.loads(raw_root) if raw_root is not None else None
            manifest = json.loads(raw) if raw is not None else None
            lengths = manifest["ranks"][str(rank)] if manifest is not None else None
            ours = root_meta["attributes"][layout.ATTRS_KEY] if root_meta is not None else None
        except (ValueError, KeyError, TypeError):
            lengths = ours = None
        if not isinstance(lengths, dict) or not isinstance(ours, dict):
            raise RecordingError(f"cannot resume rank {rank}: no committed manifest or no PaperDebugger metadata")
        group_meta = json.loads(backend.get(store, f"{layout.rank_group(rank)}/zarr.json") or b"null")
        if not isinstance(group_meta, dict):
            raise RecordingError(f"cannot resume rank {rank}: its group metadata is missing")
        group_meta.setdefault("attributes", {}).setdefault(layout.ATTRS_KEY, {"rank": rank})
        self = cls.__new__(cls)  # what __init__ sets, from the store instead of anew
        self.store, self.rank, self._files, self.root_meta = store, rank, {}, root_meta
        version = ours.get("schema_version")
        self.schema_version = version if isinstance(version, str) else layout.SCHEMA_VERSION
        self.group_meta = group_meta
        dist = manifest.get("dist")
        self.dist = dict(dist) if isinstance(dist, dict) else {"rank": rank, "world_size": 1, "backend": None}
        compression = codecs.Compression.described(ours.get("compression") or {})
        backend.remove_partials(store, layout.rank_group(rank), top=rank == 0)
        self.arrays = {}
        for col in layout.columns():
            key = f"{layout.rank_group(rank)}/{col.path}"
            meta = json.loads(backend.get(store, f"{key}/zarr.json") or b"null")
            if not isinstance(meta, dict):
                raise RecordingError(f"cannot resume rank {rank}: {key}/zarr.json is missing")
            arr = AppendArray(store, key, meta, col, _compression_of(col, compression))
            table = col.path.split("/")[0]
            arr.resume(int(lengths.get(col.path, lengths.get(table, 0))))
            self.arrays[col.path] = arr
        self._fresh_state()
        hashes, units = self.committed("payloads/hash"), self.committed("payloads/blob")
        self._payload_ids = {(int(h[0]), int(h[1]), int(u)): pid for pid, (h, u) in enumerate(zip(hashes, units))}
        self.steps = int(lengths.get("steps", 0))
        self.seq = int(manifest.get("seq", 0))
        self.status = str(manifest.get("status", "recording"))
        self.info = dict(manifest.get("info") or {})
        return self

    def committed(self, path: str) -> np.ndarray:
        """The rows of one array written so far (after ``resume``: the committed ones, and any appended
        since), read back from the store and this writer's unflushed tail."""
        arr = self.arrays[path]
        arr._drain()
        on_disk = arr.chunk * arr.col.chunk_rows
        stored = zarr.open_array(self.store, path=arr.key, mode="r")
        head = np.asarray(stored[:on_disk]) if on_disk else np.zeros((0, *arr.col.row_shape), dtype=arr.col.dtype)
        return np.concatenate([head, arr.buf[:arr.fill]]) if arr.fill else head

    def _put_later(self, key: str, data: bytes) -> None:
        """Write a whole, encoded payload chunk on a thread of its own, at most ``PUTS_IN_FLIGHT`` at
        once (waiting for the oldest beyond that; its failure is raised here). Each one is written,
        synced and dropped from the page cache (backend.put); the syncs of several overlap instead of
        adding up (a flight ring written at close: ~50 chunks of 4 MB, ~10 ms of fdatasync each, ~2/3
        of the close). The next commit waits for all of them first (``_settle``): no manifest counts
        a chunk that is not on disk."""
        with self._puts_lock:
            if self._put_pool is None:
                # Threads apart from _parallel's: those append to arrays too, and must never wait
                # for a put queued behind them.
                self._put_pool = _DaemonThreads(PUTS_IN_FLIGHT, "pdbg-put")
            while len(self._puts) >= PUTS_IN_FLIGHT:
                self._puts.popleft().result()
            self._puts.append(self._put_pool.submit(backend.put, self.store, key, data))

    def _settle(self) -> None:
        """Wait for every chunk ``_put_later`` is writing; raises the first failure."""
        with self._puts_lock:
            while self._puts:
                self._puts.popleft().result()

    def _parallel(self, fn: Any, items: list[Any]) -> None:
        """Run ``fn`` over items on a few I/O threads (file writes and Blosc release the GIL): a
        commit touches dozens of files, and one at a time their latencies add up."""
        if len(items) < 4:
            for item in items:
                fn(item)
            return
        if self._io is None:
            self._io = _DaemonThreads(4, "pdbg-io")
        self._io.map(fn, items)

    # -- documents, dims, payloads ------------------------------------------------------------
    def doc(self, obj: Any, *, remember: bool = True) -> int:
        """Store a JSON document once; returns its id. ``remember=False``: for documents the caller
        deduplicates itself (RNG states, new at most steps): looked up, but not added to the index."""
        if isinstance(obj, str):  # names, paths, dtypes: looked up on every tensor record
            found = self._str_ids.get(obj)
            if found is None:
                if len(self._str_ids) >= _STR_CACHE:  # names that change at every step: a bounded cache
                    self._str_ids.clear()
                found = self._str_ids[obj] = self._doc(obj)
            return found
        return self._doc(obj, remember)

    def doc_of(self, obj: Any) -> int:
        """``doc`` for an object that never changes once made (a step definition): looked up by
        identity, so its JSON (which holds source code) is not re-encoded on every step."""
        entry = self._identity_ids.get(id(obj))
        if entry is None or entry[0] is not obj:
            if len(self._identity_ids) >= 4096:  # only a cache: the documents stay deduplicated by content
                self._identity_ids.clear()
            entry = self._identity_ids[id(obj)] = (obj, self._doc(obj))  # holds obj: its id stays unique
        return entry[1]

    def _doc(self, obj: Any, remember: bool = True) -> int:
        data = dumps(obj)
        key = xxhash.xxh3_128_digest(data)
        found = self._doc_ids.get(key)
        if found is not None:
            return found
        offset = self.arrays["docs/bytes"].extend(np.frombuffer(data, dtype=np.uint8))
        self.arrays["docs/offset"].append(offset)
        doc_id = self.arrays["docs/length"].append(len(data))
        if remember:
            if len(self._doc_ids) >= _DOC_CACHE:  # a bounded index: a document seen again after it was
                self._doc_ids.clear()            # cleared is stored twice, which costs bytes, not correctness
            self._doc_ids[key] = doc_id
        return doc_id

    def find_payload(self, key: tuple[int, int, int]) -> int | None:
        """The payload row of stored contents, or None."""
        return self._payload_ids.get(key)

    def late(self, tensor_row: int, payload: int) -> None:
        """Attach a payload to a tensor record written before its bytes were (flight mode)."""
        self.arrays["late/tensor"].append(tensor_row)
        self.arrays["late/payload"].append(payload)

    def payload(self, key: tuple[int, int, int], data: np.ndarray | None) -> int:
        """Store payload bytes under their content key (hash high, hash low, unit); returns the id.

        ``data`` may be None only when the key is already stored."""
        found = self._payload_ids.get(key)
        if found is not None:
            return found
        if data is None:
            raise KeyError(f"payload {key} is not stored and no data was given")
        unit = layout.BLOB_UNITS[key[2]]
        offset = self.arrays[f"blobs/{unit}"].extend(data)
        self.arrays["payloads/hash"].append((key[0], key[1]))
        self.arrays["payloads/blob"].append(key[2])
        self.arrays["payloads/offset"].append(offset)
        pid = self.arrays["payloads/count"].append(len(data))
        self._payload_ids[key] = pid
        return pid

    # -- steps and tensors ---------------------------------------------------------------------
    def tensors_of_step(self, step: int, columns: dict[str, list[Any]], dims: list[int]) -> int:
        """Append a step's tensor records at once (one call per column, not per record).

        Args:
            step: the step's index.
            columns: every column of TENSOR_COLUMNS but ``step`` and ``dims_start``, a list each.
            dims: the records' shapes and strides, concatenated in record order.
        Returns the row of the first record."""
        start = self.tensors
        n = len(columns["role"])
        if n == 0:
            return start
        at = self.arrays["dims/values"].append_rows(dims)
        dims_start = []
        for ndim in columns["ndim"]:  # shape then stride of each record
            dims_start.append(at)
            at += 2 * ndim
        data = dict(columns, step=[step] * n, dims_start=dims_start)
        for name in layout.TENSOR_COLUMNS:
            self.arrays[f"tensors/{name}"].append_rows(data[name])
        return start

    def step(self, index: int, row: dict[str, Any]) -> None:
        """Queue a finished step's row; rows are appended strictly in index order."""
        self._pending[index] = row
        while self.steps in self._pending:
            ready = self._pending.pop(self.steps)
            for name in layout.STEP_COLUMNS:
                self.arrays[f"steps/{name}"].append(ready[name])
            self.steps += 1

    @property
    def tensors(self) -> int:
        return len(self.arrays["tensors/step"])

    # -- commit ----------------------------------------------------------------------------------
    def lengths(self) -> dict[str, int]:
        tables = {"steps": self.steps, "tensors": self.tensors, "payloads": len(self.arrays["payloads/count"]),
                  "docs": len(self.arrays["docs/length"]), "late": len(self.arrays["late/payload"])}
        out = dict(tables)
        for path, arr in self.arrays.items():
            if arr.col.kind != "index" or path.startswith("dims/"):  # logs, not table columns
                out[path] = len(arr)
        return out

    def flush(self) -> None:
        """Make everything appended so far durable: chunks first, then the manifest."""
        dirty = [a for a in self.arrays.values() if a.dirty]
        # Payload chunks are large and synced: in parallel. The tails of index and document columns
        # are small and cost less written here than handed to other threads.
        self._parallel(AppendArray.flush, [a for a in dirty if a.col.kind == "blob"])
        for arr in dirty:
            if arr.col.kind != "blob":
                arr.flush()
        self._settle()
        self.write_manifest()

    def close(self, status: str, info: dict[str, Any] | None = None) -> None:
        """Flush, trim every array to its length, and publish the final status."""
        self.info.update(info or {})
        if self._files:  # closed before the writer thread got to create()
            self.create()
        if status == "complete" and self._pending:
            status = "crashed"  # a step that never finished (its enclosing call is still open)

        def finish(arr: AppendArray) -> None:
            arr.flush(final=True)
            arr.trim()

        try:
            self._parallel(finish, list(self.arrays.values()))
            self._settle()
        finally:
            if self._io is not None:
                self._io.shutdown(wait=True)
            if self._put_pool is not None:
                self._put_pool.shutdown()  # settled above, or failed: nothing is waited for
            self._io = self._put_pool = None
        self.status = status
        self.write_manifest()
        self._publish_final()
        for arr in self.arrays.values():
            arr.drop_buffer()
        self._str_ids.clear()  # the documents' ids: only for rows that will not come

    def abandon(self, info: dict[str, Any]) -> None:
        """After a failed write (a full disk, a store gone): mark the run ``incomplete`` and say why,
        committing nothing more.

        What was appended since the last commit may be half written (the failure can strike inside
        a step, between one column and the next), so the manifest keeps the lengths of the one on
        disk. Nothing is trimmed: no file but the manifest and the root metadata is written (there
        may be room for no more), and readers slice to the manifest anyway."""
        self.info.update(info)
        if self._put_pool is not None:  # chunks of rows that will never be committed: not waited for
            self._put_pool.shutdown()
            self._put_pool, self._puts = None, deque()
        try:
            # The spare copies of partial chunks: room on a full disk for the manifest that says incomplete.
            backend.remove_partials(self.store, layout.rank_group(self.rank), top=self.rank == 0)
            raw = backend.get(self.store, layout.manifest_key(self.rank))
            try:
                committed = json.loads(raw)["ranks"][str(self.rank)] if raw is not None else None
            except (ValueError, KeyError, TypeError):
                committed = None
            if not isinstance(committed, dict):  # nothing committed (the layout may be unfinished): leave it
                return
            self.status = "incomplete"
            self.write_manifest(committed)
            self._publish_final()
        finally:  # nothing more is written: its threads end (a process that records again keeps none)
            if self._io is not None:  # (idle: every call of theirs was waited for)
                self._io.shutdown(wait=True, timeout=5.0)
                self._io = None

    def write_manifest(self, lengths: dict[str, int] | None = None) -> None:
        """Commit: the manifest with ``lengths`` (default: everything appended and flushed)."""
        self.seq += 1
        manifest = {
            "format": "paperdebugger.manifest", "schema_version": self.schema_version,
            "status": self.status, "seq": self.seq, "updated_unix": time.time(),
            "writer": self._identity, "dist": self.dist,
            "ranks": {str(self.rank): self.lengths() if lengths is None else lengths}, "info": self.info,
        }
        manifest[layout.CHECKSUM_KEY] = layout.checksum(manifest)
        backend.put(self.store, layout.manifest_key(self.rank), dumps(manifest), durable=True)


def _compression_of(col: Column, payloads: codecs.Compression) -> codecs.Compression:
    """Payload bytes use the run's compression; documents and index columns fixed ones."""
    return {"blob": payloads, "docs": codecs.DOCS}.get(col.kind, codecs.INDEX)


_WRITTEN_BY_EVERY_RUN = ("steps", "tensors", "docs", "dims")


@functools.lru_cache(maxsize=8)
def _template(rank: int, compression: codecs.Compression) -> dict[str, bytes]:
    """The zarr.json files of an empty rank group, built once by zarr in memory (the same bytes
    zarr would write, without ~2 ms of store calls per array)."""
    template = zarr.storage.MemoryStore()
    group = zarr.open_group(template, mode="w").create_group(layout.rank_group(rank))
    for col in layout.columns():
        # Tables every run writes start one chunk long, so that their first chunk needs no second
        # write of their zarr.json (~35 files in a session's first commit); the others (payloads,
        # late/ rows) start empty. Closing trims every array to its length.
        rows = col.chunk_rows if col.path.split("/")[0] in _WRITTEN_BY_EVERY_RUN else 0
        group.create_array(col.path, shape=(rows, *col.row_shape), chunks=(col.chunk_rows, *col.row_shape),
                           dtype=col.dtype, fill_value=0, compressors=_compression_of(col, compression).zarr_codecs())
    return _contents(template)


def _contents(store: zarr.storage.MemoryStore) -> dict[str, bytes]:
    """Every key of a memory store and its bytes."""
    async def collect() -> dict[str, bytes]:
        out = {}
        async for key in store.list():
            buf = await store.get(key, prototype=default_buffer_prototype())
            assert buf is not None
            out[key] = buf.to_bytes()
        return out

    return sync(collect())
