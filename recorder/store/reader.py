"""Reader of the store layout: opens lazily, checks the format first, slices to committed lengths."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from .. import payload as payload_mod
from ..errors import FormatError, NotARecordingError, SchemaVersionError
from . import backend, layout

# A writer that has not updated its manifest for this long, on another machine, is taken as dead.
STALE_AFTER_S = 300.0


@dataclass(frozen=True)
class TensorRecord:
    """One recorded tensor of a step: metadata, statistics and (maybe) a payload reference."""

    row: int
    step: int
    role: str
    name: str
    dtype: str
    device: str
    requires_grad: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    stats: dict[str, float]
    payload: int  # -1 when only statistics were kept

    @property
    def has_payload(self) -> bool:
        return self.payload != layout.NO_REF

    @property
    def nonfinite(self) -> bool:
        return bool(self.stats["nan"] or self.stats["inf"])


class RunReader:
    """A recording opened for reading. Cheap to open whatever its size: nothing but the group
    attributes and the manifest is read until asked for."""

    def __init__(self, target: backend.StoreTarget) -> None:
        self.target = target
        self.label = backend.describe(target)
        if not isinstance(target, zarr.abc.store.Store) and not Path(target).exists():
            raise NotARecordingError(f"{self.label}: no such file or directory; give the path of a recording "
                                     "(made by recorder.record or `pdbg record`)")
        try:
            self.store = backend.open_store(target, mode="r")
        except (FormatError, NotARecordingError):  # a zip refused by its checks: the message says why
            raise
        except Exception as exc:  # a file that is not a zip, a directory we cannot read...
            raise NotARecordingError(f"{self.label} is not a PaperDebugger recording ({exc})") from None
        self.attrs = self._read_attrs()
        self.manifest = self._read_manifest()
        self.group = zarr.open_group(self.store, mode="r")
        self._ranks: dict[int, RankReader] = {}

    # -- checks, in the order a user's mistake is most likely ----------------------------------
    def _read_json(self, key: str) -> Any:
        raw = backend.get(self.store, key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FormatError(f"{self.label}: {key} is truncated or corrupt ({exc.__class__.__name__}); "
                              "this recording cannot be read") from None

    def _read_attrs(self) -> dict[str, Any]:
        meta = self._read_json("zarr.json")
        ours = meta.get("attributes", {}).get(layout.ATTRS_KEY) if isinstance(meta, dict) else None
        if not isinstance(ours, dict) or ours.get("format") != layout.FORMAT_NAME:
            raise NotARecordingError(f"{self.label} is not a PaperDebugger recording (no '{layout.ATTRS_KEY}' "
                                     "metadata in its zarr.json); give the path of a recording")
        self._check_version(ours.get("schema_version"), "zarr.json")
        return ours

    def _check_version(self, version: Any, where: str) -> None:
        try:
            major, _ = layout.parse_version(str(version))
        except ValueError:
            raise FormatError(f"{self.label}: {where} has an invalid schema version {version!r}") from None
        if major > layout.SCHEMA_MAJOR:
            raise SchemaVersionError(
                f"{self.label} uses schema {version}, newer than this PaperDebugger reads "
                f"({layout.SCHEMA_VERSION}); upgrade paperdebugger to open it")
        if major < layout.SCHEMA_MAJOR:
            raise SchemaVersionError(f"{self.label} uses schema {version}, which this PaperDebugger no longer "
                                     "reads; open it with an older paperdebugger")

    def _read_manifest(self) -> dict[str, Any]:
        manifest = self._read_json(layout.MANIFEST_KEY)
        if manifest is None:
            raise FormatError(f"{self.label}: {layout.MANIFEST_KEY} is missing, so no step is known to be "
                              "committed; the recorder was killed before its first commit, or the recording "
                              "was damaged or copied incompletely")
        ranks = manifest.get("ranks") if isinstance(manifest, dict) else None
        if manifest.get("format") != "paperdebugger.manifest" or not isinstance(ranks, dict):
            raise FormatError(f"{self.label}: {layout.MANIFEST_KEY} is not a PaperDebugger manifest")
        self._check_version(manifest.get("schema_version"), layout.MANIFEST_KEY)
        return manifest

    # -- run-level information -------------------------------------------------------------------
    @property
    def run_info(self) -> dict[str, Any]:
        return dict(self.attrs.get("run", {}))

    @property
    def schema_version(self) -> str:
        return str(self.attrs["schema_version"])

    @property
    def status(self) -> str:
        """``complete``, ``crashed``, or ``recording`` while the writer is alive."""
        status = self.manifest.get("status", "recording")
        if status == "recording" and not self._writer_alive():
            return "crashed"
        return str(status)

    def _writer_alive(self) -> bool:
        writer = self.manifest.get("writer", {})
        if writer.get("host") == socket.gethostname() and writer.get("boot") == backend.boot_id():
            try:
                pid = int(writer["pid"])
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except (PermissionError, KeyError, ValueError, TypeError):
                return True
            start = writer.get("start")
            return start is None or backend.process_start(pid) in (start, None)  # a reused pid is not it
        return time.time() - float(self.manifest.get("updated_unix", 0)) < STALE_AFTER_S

    @property
    def ranks(self) -> list[int]:
        return sorted(int(r) for r in self.manifest["ranks"])

    def rank(self, rank: int = 0) -> RankReader:
        if rank not in self._ranks:
            lengths = self.manifest["ranks"].get(str(rank))
            if lengths is None:
                raise FormatError(f"{self.label} has no rank {rank}; it has ranks {self.ranks}")
            self._ranks[rank] = RankReader(self, rank, lengths)
        return self._ranks[rank]

    def nbytes(self) -> int:
        """Bytes on disk (directory stores) or in the zip."""
        root = backend.local_root(self.store)
        if root is not None:
            return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        path = getattr(self.store, "path", None)
        return Path(path).stat().st_size if path else 0


_ROWS_PER_SLICE_READ = 2048  # what reading one slice costs, in rows of a whole-column read (a chunk is 8192)


class RankReader:
    """The tables of one rank, sliced to their committed lengths."""

    def __init__(self, run: RunReader, rank: int, lengths: dict[str, int]) -> None:
        self.run, self.rank = run, rank
        self.lengths = {k: int(v) for k, v in lengths.items()}
        self.group = run.group[layout.rank_group(rank)]
        self._columns: dict[str, np.ndarray] = {}
        self._arrays: dict[str, Any] = {}
        self._sliced: dict[str, int] = {}  # how often each column was read in slices
        self._docs: dict[int, Any] = {}

    def __len__(self) -> int:
        return self.lengths["steps"]

    def _length_of(self, path: str) -> int:
        if path in self.lengths:  # a log (docs/bytes, dims/values, blobs/u4)
            return self.lengths[path]
        table = path.split("/")[0]
        if table not in self.lengths:
            raise FormatError(f"{self.run.label}: the manifest has no length for {path}")
        return self.lengths[table]

    def column(self, path: str) -> np.ndarray:
        """A whole committed column, e.g. ``column("steps/iteration")`` (read once, then cached)."""
        if path not in self._columns:
            n = self._length_of(path)
            try:
                arr = self.group[path]
            except KeyError:
                raise FormatError(f"{self.run.label}: array {path} is missing; the recording is damaged") from None
            if arr.shape[0] < n:
                raise FormatError(f"{self.run.label}: array {path} has {arr.shape[0]} rows but {n} are "
                                  "committed; the recording is damaged")
            self._columns[path] = arr[:n]
        return self._columns[path]

    def _array(self, path: str) -> Any:
        """An array read in slices (documents, payload bytes), opened once: opening reads its metadata."""
        arr = self._arrays.get(path)
        if arr is None:
            try:
                arr = self._arrays[path] = self.group[path]
            except KeyError:
                raise FormatError(f"{self.run.label}: array {path} is missing; the recording is damaged") from None
        return arr

    def doc(self, doc_id: int) -> Any:
        """A JSON document by id (-1 gives None)."""
        if doc_id == layout.NO_REF:
            return None
        if doc_id not in self._docs:
            offsets, lengths = self.column("docs/offset"), self.column("docs/length")
            if not 0 <= doc_id < len(offsets):
                raise FormatError(f"{self.run.label}: document {doc_id} is out of range (0..{len(offsets) - 1})")
            start, size = int(offsets[doc_id]), int(lengths[doc_id])
            end = start + size
            if start < 0 or end > self._length_of("docs/bytes"):
                raise FormatError(f"{self.run.label}: document {doc_id} points past the committed data")
            raw = self._array("docs/bytes")[start:end].tobytes()
            try:
                self._docs[doc_id] = json.loads(raw)
            except ValueError:
                raise FormatError(f"{self.run.label}: document {doc_id} is not valid JSON") from None
        return self._docs[doc_id]

    def rows(self, path: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of a column: sliced from the cached column if it was read whole,
        else read alone (a step's tensor records out of millions), until a column has been sliced
        often enough that reading it whole once is cheaper."""
        if path in self._columns:
            return self._columns[path][start:stop]
        count = self._sliced.get(path, 0) + 1
        self._sliced[path] = count
        if count * _ROWS_PER_SLICE_READ > self._length_of(path):  # slices have cost about a whole read
            return self.column(path)[start:stop]
        if stop > self._length_of(path):
            raise FormatError(f"{self.run.label}: rows {start}:{stop} of {path} are past the committed data")
        return np.asarray(self._array(path)[start:stop])

    def tensor_records(self, step: int) -> list[TensorRecord]:
        """The tensor records of one step, in the order they were captured."""
        start = int(self.rows("steps/tensor_start", step, step + 1)[0])
        count = int(self.rows("steps/tensor_count", step, step + 1)[0])
        if start < 0 or count < 0 or start + count > self.lengths["tensors"]:
            raise FormatError(f"{self.run.label}: step {step} points past the committed tensor records")
        return self._records(start, start + count)

    def tensor_record(self, row: int) -> TensorRecord:
        return self._records(row, row + 1)[0]

    def _records(self, start: int, stop: int) -> list[TensorRecord]:
        if stop <= start:
            return []
        cols = {name: self.rows(f"tensors/{name}", start, stop) for name in
                ("step", "role", "name", "dtype", "device", "requires_grad", "ndim", "dims_start", "stats", "payload")}
        ndims, dstarts = cols["ndim"].astype(np.int64), cols["dims_start"].astype(np.int64)
        lo = int(dstarts.min())
        hi = int((dstarts + 2 * ndims).max())
        dims = self.rows("dims/values", lo, hi) if hi > lo else np.zeros(0, dtype=np.int64)
        out = []
        for i in range(stop - start):
            row, ndim, first = start + i, int(ndims[i]), int(dstarts[i]) - lo
            own = dims[first:first + 2 * ndim]
            if len(own) != 2 * ndim:
                raise FormatError(f"{self.run.label}: tensor record {row} has a shape past the committed data")
            out.append(TensorRecord(
                row=row, step=int(cols["step"][i]), role=layout.ROLES[int(cols["role"][i])],
                name=self.doc(int(cols["name"][i])), dtype=self.doc(int(cols["dtype"][i])),
                device=self.doc(int(cols["device"][i])), requires_grad=bool(cols["requires_grad"][i]),
                shape=tuple(int(d) for d in own[:ndim]), stride=tuple(int(d) for d in own[ndim:]),
                stats={k: float(v) for k, v in zip(layout.STAT_NAMES, cols["stats"][i])},
                payload=self._late.get(row, int(cols["payload"][i]))))
        return out

    @cached_property
    def _late(self) -> dict[int, int]:
        """Payloads attached after their records were written (schema 1.1; none in 1.0 recordings)."""
        if not self.lengths.get("late"):
            return {}
        rows, pids = self.column("late/tensor"), self.column("late/payload")
        return {int(r): int(p) for r, p in zip(rows, pids)}

    def payload_units(self, pid: int) -> tuple[np.ndarray, int]:
        """The stored units of one payload and its unit index."""
        if not 0 <= pid < self.lengths["payloads"]:
            raise FormatError(f"{self.run.label}: payload {pid} is out of range")
        unit = int(self.column("payloads/blob")[pid])
        offset, count = int(self.column("payloads/offset")[pid]), int(self.column("payloads/count")[pid])
        path = f"blobs/{layout.BLOB_UNITS[unit]}"
        if offset < 0 or count < 0 or offset + count > self._length_of(path):
            raise FormatError(f"{self.run.label}: payload {pid} points past the committed data")
        return self._array(path)[offset:offset + count], unit

    def tensor(self, record: TensorRecord) -> torch.Tensor:
        """The recorded tensor's value (a contiguous CPU tensor), exactly as it was."""
        if not record.has_payload:
            raise FormatError(f"{self.run.label}: tensor {record.name!r} of step {record.step} has statistics "
                              "only (recorded in stats mode, on an iteration --every skipped, or in flight mode "
                              "outside the iterations the ring wrote out)")
        units, _ = self.payload_units(record.payload)
        dtype = payload_mod.dtype_from_name(record.dtype)
        expected = int(np.prod(record.shape, dtype=np.int64)) * dtype.itemsize
        if units.nbytes != expected:
            raise FormatError(f"{self.run.label}: payload of {record.name!r} (step {record.step}) has "
                              f"{units.nbytes} bytes, its shape needs {expected}")
        return payload_mod.from_units(units, dtype, record.shape)
