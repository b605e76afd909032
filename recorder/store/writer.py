"""Synchronous writer of the store layout. Used by the recorder's background thread only.

Crash safety rests on one ordering: chunks are written first, the manifest (committed lengths) last,
atomically and durably. Rows past a committed length may exist on disk after a kill; readers never
look at them.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
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


def dumps(doc: Any) -> bytes:
    """Canonical JSON bytes of a document (sorted keys, no NaN tokens)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


class AppendArray:
    """One growing zarr array, written a whole encoded chunk at a time from a RAM buffer."""

    def __init__(self, store: Store, key: str, meta: dict[str, Any], col: Column, comp: codecs.Compression) -> None:
        self.store, self.col, self.comp = store, col, comp
        self.key = key
        self.meta = meta  # the array's zarr.json, rewritten by this class when the shape changes
        self.capacity = 0  # rows the zarr.json declares: none until the first chunk is written
        self._buf: np.ndarray | None = None  # allocated on first use: most runs never touch u1/u2/u8
        self.fill = 0  # rows in buf
        self.chunk = 0  # index of the chunk buf holds
        self.dirty = False  # buf has rows not yet on disk
        self._suffix = "/0" * len(col.row_shape)
        self._stored_left = 0  # adaptive compression: whole chunks to store uncompressed before a retest

    def __len__(self) -> int:
        return self.chunk * self.col.chunk_rows + self.fill

    @property
    def buf(self) -> np.ndarray:
        # Uninitialised: rows are always written before they are read, and a partial chunk's
        # remainder is zeroed when it is committed.
        if self._buf is None:
            self._buf = np.empty((self.col.chunk_rows, *self.col.row_shape), dtype=self.col.dtype)
        return self._buf

    def append(self, row: Any) -> int:
        """Append one row; returns its index."""
        index = len(self)
        self.buf[self.fill] = row
        self.fill += 1
        self.dirty = True
        if self.fill == self.col.chunk_rows:
            self._seal()
        return index

    def extend(self, rows: np.ndarray) -> int:
        """Append many rows (1-D data for 1-D arrays); returns the index of the first."""
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
        return start

    def flush(self) -> None:
        """Write the partial last chunk if it changed, padded with the fill value (not stale rows)."""
        if self.dirty and self.fill:
            self.buf[self.fill:] = 0
            self._write(self.chunk, self.buf)
        self.dirty = False

    def trim(self) -> None:
        """Set the zarr shape to the exact length, so plain zarr reads exactly the committed rows."""
        if self.capacity != len(self):  # arrays never written (payloads in stats mode) stay as made
            self._resize(len(self))

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

    def _write(self, index: int, data: np.ndarray, whole: bool = False) -> None:
        needed = (index + 1) * self.col.chunk_rows
        if needed > self.capacity:
            self._resize(max(needed, 2 * self.capacity))  # geometric: few metadata rewrites
        backend.put(self.store, f"{self.key}/c/{index}{self._suffix}", self._encode(data, whole))

    def _encode(self, data: np.ndarray, whole: bool) -> bytes:
        """Compressed, or (adaptive compression, data that did not shrink) stored as it is. Only whole
        chunks decide: a partial one is padded with zeros, which compress whatever the data."""
        comp = self.comp
        if not comp.adaptive:
            return comp.encode(data)
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
                 rank: int = 0) -> None:
        """Claim the store (its root ``zarr.json``); ``create()`` lays out the rest.

        Split in two so that the training thread pays only for the claim: the ~50 files and
        directories of a rank's arrays are made by the writer thread (``create``), next to training."""
        self.store, self.rank = store, rank
        if backend.get(store, "zarr.json") is not None:
            raise RecordingError("the store already holds a zarr hierarchy; record into a new, empty one")
        self._files = dict(_template(rank, compression))
        root_meta = json.loads(self._files.pop("zarr.json"))
        root_meta["attributes"] = {layout.ATTRS_KEY: {
            "format": layout.FORMAT_NAME, "schema_version": layout.SCHEMA_VERSION,
            "compression": compression.describe(), "run": run_attrs}}
        backend.put(store, "zarr.json", json.dumps(root_meta, indent=2, allow_nan=False).encode())
        self.root_meta = root_meta
        self.arrays: dict[str, AppendArray] = {}
        for col in layout.columns():
            key = f"{layout.rank_group(rank)}/{col.path}"
            self.arrays[col.path] = AppendArray(store, key, json.loads(self._files[f"{key}/zarr.json"]), col,
                                                _compression_of(col, compression))
        self._identity = {"pid": os.getpid(), "host": socket.gethostname(), "boot": backend.boot_id(),
                          "start": backend.process_start(os.getpid())}
        self._doc_ids: dict[bytes, int] = {}
        self._str_ids: dict[str, int] = {}
        self._identity_ids: dict[int, tuple[Any, int]] = {}
        self._payload_ids: dict[tuple[int, int, int], int] = {}
        self._pending: dict[int, dict[str, Any]] = {}
        self._io: ThreadPoolExecutor | None = None
        self.steps = 0  # committed-in-order step rows appended
        self.seq = 0
        self.status = "recording"
        self.info: dict[str, Any] = {}

    def create(self) -> None:
        """Write the rank's group and array metadata, then the first manifest (0 steps)."""
        backend.remove_partials(self.store)
        self._parallel(lambda kv: backend.put(self.store, *kv), list(self._files.items()))
        self._files = {}
        self.write_manifest()

    def _parallel(self, fn: Any, items: list[Any]) -> None:
        """Run ``fn`` over items on a few I/O threads (file writes and Blosc release the GIL): a
        commit touches dozens of files, and one at a time their latencies add up."""
        if len(items) < 4:
            for item in items:
                fn(item)
            return
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdbg-io")
        for _ in self._io.map(fn, items):  # re-raises the first failure
            pass

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
        values = self.arrays["dims/values"]
        first_dim = values.extend(np.asarray(dims, dtype=np.int64)) if dims else len(values)
        ndim = np.asarray(columns["ndim"], dtype=np.int64)
        data = dict(columns, step=np.full(n, step, dtype=np.int64),
                    dims_start=first_dim + np.concatenate(([0], np.cumsum(2 * ndim)[:-1])))
        for name, (dtype, shape) in layout.TENSOR_COLUMNS.items():
            self.arrays[f"tensors/{name}"].extend(np.asarray(data[name], dtype=dtype).reshape(n, *shape))
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
        self.write_manifest()

    def close(self, status: str, info: dict[str, Any] | None = None) -> None:
        """Flush, trim every array to its length, and publish the final status."""
        self.info.update(info or {})
        if self._files:  # closed before the writer thread got to create()
            self.create()
        if status == "complete" and self._pending:
            status = "crashed"  # a step that never finished (its enclosing call is still open)

        def finish(arr: AppendArray) -> None:
            arr.flush()
            arr.trim()

        try:
            self._parallel(finish, list(self.arrays.values()))
        finally:
            if self._io is not None:
                self._io.shutdown(wait=True)
                self._io = None
        self.status = status
        self.write_manifest()
        self.root_meta["attributes"][layout.ATTRS_KEY]["final"] = {"status": status, **self.info}
        backend.put(self.store, "zarr.json", json.dumps(self.root_meta, indent=2, allow_nan=False).encode())

    def abandon(self, info: dict[str, Any]) -> None:
        """After a failed write (a full disk, a store gone): mark the run ``incomplete`` and say why,
        committing nothing more.

        What was appended since the last commit may be half written (the failure can strike inside
        a step, between one column and the next), so the manifest keeps the lengths of the one on
        disk. Nothing is trimmed: no file but the manifest and the root metadata is written (there
        may be room for no more), and readers slice to the manifest anyway."""
        self.info.update(info)
        raw = backend.get(self.store, layout.MANIFEST_KEY)
        try:
            committed = json.loads(raw)["ranks"][str(self.rank)] if raw is not None else None
        except (ValueError, KeyError, TypeError):
            committed = None
        if not isinstance(committed, dict):  # nothing committed (the layout may be unfinished): leave it
            return
        self.status = "incomplete"
        self.write_manifest(committed)
        self.root_meta["attributes"][layout.ATTRS_KEY]["final"] = {"status": self.status, **self.info}
        backend.put(self.store, "zarr.json", json.dumps(self.root_meta, indent=2, allow_nan=False).encode())

    def write_manifest(self, lengths: dict[str, int] | None = None) -> None:
        """Commit: the manifest with ``lengths`` (default: everything appended and flushed)."""
        self.seq += 1
        manifest = {
            "format": "paperdebugger.manifest", "schema_version": layout.SCHEMA_VERSION,
            "status": self.status, "seq": self.seq, "updated_unix": time.time(),
            "writer": self._identity,
            "ranks": {str(self.rank): self.lengths() if lengths is None else lengths}, "info": self.info,
        }
        backend.put(self.store, layout.MANIFEST_KEY, dumps(manifest), durable=True)


def _compression_of(col: Column, payloads: codecs.Compression) -> codecs.Compression:
    """Payload bytes use the run's compression; documents and index columns fixed ones."""
    return {"blob": payloads, "docs": codecs.DOCS}.get(col.kind, codecs.INDEX)


@functools.lru_cache(maxsize=8)
def _template(rank: int, compression: codecs.Compression) -> dict[str, bytes]:
    """The zarr.json files of an empty rank group, built once by zarr in memory (the same bytes
    zarr would write, without ~2 ms of store calls per array)."""
    template = zarr.storage.MemoryStore()
    group = zarr.open_group(template, mode="w").create_group(layout.rank_group(rank))
    for col in layout.columns():
        group.create_array(col.path, shape=(0, *col.row_shape), chunks=(col.chunk_rows, *col.row_shape),
                           dtype=col.dtype, fill_value=0, compressors=_compression_of(col, compression).zarr_codec())
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
