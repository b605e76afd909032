"""Reader of the store layout: opens lazily, checks the format first, slices to committed lengths.

A recording may be damaged (a failing disk, an incomplete copy, a hand edit) or hostile (a bundle
from someone else), so what is read is checked before it is used: metadata against the layout,
chunk files against the rows the manifest commits (zarr would read a missing chunk as zeros), index
values against the tables they point into, and payload bytes against their recorded checksum. A
failed check is a FormatError naming the file or array; docs/RELIABILITY.md lists what the format
cannot detect.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.abc.store import RangeByteRequest, Store
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, Endian
from zarr.core.buffer import default_buffer_prototype
from zarr.core.metadata import ArrayV3Metadata
from zarr.core.sync import sync

from .. import payload as payload_mod
from ..errors import ChecksumError, FormatError, NotARecordingError, PdbgError, SchemaVersionError
from . import backend, layout

# A writer that has not updated its manifest for this long, on another machine, is taken as dead.
STALE_AFTER_S = 300.0

_TABLES = ("steps", "tensors", "payloads", "docs")  # lengths every manifest gives (and "late", since 1.1)
_COLUMNS = {col.path: col for col in layout.columns()}
_LOGS = frozenset(c.path for c in _COLUMNS.values() if c.kind != "index" or c.path.startswith("dims/"))  # own lengths
_MAX_CHUNK_BYTES = 256 << 20  # far above what the writer makes (4 MiB); a larger chunk is an edit, not data
_BLOSC_HEADER = 16  # version, versionlz, flags, typesize, then uint32 LE: nbytes, blocksize, cbytes

# Columns whose values point into a table or name a choice: (lowest value, exclusive bound: a number,
# the name of the table whose committed length it is, or None for none). A value outside would index
# the wrong row (negative indices wrap in numpy) or fail deep inside a caller.
_DOC_REFS = [f"steps/{c}" for c in ("name", "definition", "module_path", "module", "rng", "settings", "args",
                                    "output", "extra")] + [f"tensors/{c}" for c in ("name", "dtype", "device")]
_BOUNDS: dict[str, tuple[int, int | str | None]] = {
    "steps/phase": (0, len(layout.PHASES)), "steps/status": (0, len(layout.STATUSES)),
    "steps/parent": (layout.NO_REF, "steps"), "steps/forward": (layout.NO_REF, "steps"),
    "tensors/step": (0, None),  # may be past the committed steps: a step's records are written before its row
    "tensors/role": (0, len(layout.ROLES)), "tensors/ndim": (0, None), "tensors/dims_start": (0, None),
    "tensors/payload": (layout.NO_REF, "payloads"), "payloads/blob": (0, len(layout.BLOB_UNITS)),
    "late/tensor": (0, "tensors"), "late/payload": (0, "payloads"),
    **{path: (layout.NO_REF, "docs") for path in _DOC_REFS},
}


def _checked(version: Any) -> bool:
    """Whether a document or recording of this schema version must carry its checksums (1.5 on)."""
    try:
        return layout.parse_version(str(version)) >= layout.CHECKED_SINCE
    except ValueError:  # refused by the version check, which runs first
        return False


def _why(exc: BaseException) -> str:
    """An exception as a short phrase for a one-line message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


def _head(store: Store, key: str) -> tuple[bytes, int] | None:
    """The first bytes of a stored file and its size, or None when there is no such file."""
    root = backend.local_root(store)
    if root is not None:
        try:
            backend.check_readable(root / key, key)  # not a FIFO, a device, a giant
            with open(root / key, "rb") as fh:
                return fh.read(_BLOSC_HEADER), os.fstat(fh.fileno()).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None
    head = sync(store.get(key, prototype=default_buffer_prototype(), byte_range=RangeByteRequest(0, _BLOSC_HEADER)))
    return None if head is None else (head.to_bytes(), sync(store.getsize(key)))


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


@dataclass(frozen=True)
class PayloadCheck:
    """One payload as ``RankReader.check_payloads`` found it: its row, its size in bytes, and None where its
    bytes are those recorded, else what is wrong (a line of a listing, without the recording's name)."""

    payload: int
    nbytes: int
    problem: str | None


@dataclass(frozen=True)
class SparseParts:
    """The records a sparse record's tensor is made of (schema 1.19: its ``component`` records), all kept
    with their bytes: by part name (``payload.SPARSE_PARTS``), with its layout and, for COO, whether it
    was coalesced."""

    layout: str  # "sparse_coo", "sparse_csr", ...
    records: dict[str, TensorRecord]  # part name ("indices", "values") -> its component record
    coalesced: bool


class RunReader:
    """A recording opened for reading. Cheap to open whatever its size: nothing but the group
    attributes and the manifest is read until asked for."""

    def __init__(self, target: backend.StoreTarget, *, storage_options: dict[str, Any] | None = None) -> None:
        """``storage_options``: a URL's fsspec options (see ``backend.open_store``)."""
        self.target = target
        self.label = backend.describe(target)
        # What a newer minor schema's warning said (once), or None: the TUI shows it, and a replay refuses the
        # steps that hold what the newer schema added (unknown tags and tensor roles) instead of calling them damage.
        self.newer: str | None = None
        if isinstance(target, (str, os.PathLike)) and not os.fspath(target):  # not "." (Path("") is the cwd)
            raise NotARecordingError("the path of the recording is empty; give the path of a recording (made by "
                                     "recorder.record or `pdbg record`)")
        if not isinstance(target, zarr.abc.store.Store) and not backend.is_url(target) and \
                not Path(backend.local_path(target)).exists():
            raise NotARecordingError(f"{self.label}: no such file or directory; give the path of a recording "
                                     "(made by recorder.record or `pdbg record`)")
        try:
            self.store = backend.open_store(target, mode="r", storage_options=storage_options)
        except PdbgError:  # a zip refused by its checks, a URL that cannot be read: the message says why
            raise
        except Exception as exc:  # a file that is not a zip, a directory we cannot read...
            raise NotARecordingError(f"{self.label} is not a PaperDebugger recording ({exc})") from None
        self.attrs = self._read_attrs()
        self.world_size = self._world_size()
        self.manifests = self._read_manifests()  # rank -> its manifest
        self.manifest = self.manifests[min(self.manifests)]  # rank 0's (the only one before schema 1.4)
        try:
            self.group = zarr.open_group(self.store, mode="r")
        except (KeyError, ValueError, TypeError, OSError) as exc:  # zarr's metadata errors are ValueErrors
            raise FormatError(f"{self.label}: zarr.json is damaged ({_why(exc)}); this recording cannot be "
                              "read") from None
        self._ranks: dict[int, RankReader] = {}

    # -- checks, in the order a user's mistake is most likely ----------------------------------
    def close(self) -> None:
        """Let go of the store: a bundle's zip file stays open until then (or until the reader is
        collected). Reading after it opens the zip again (close once more to let it go)."""
        close = getattr(self.store, "close", None)
        if self.store is not self.target and callable(close):  # (a store the caller gave stays theirs)
            close()

    def _read_json(self, key: str) -> Any:
        try:
            raw = backend.get(self.store, key)
        except OSError as exc:  # a directory in its place, no permission
            raise FormatError(f"{self.label}: {key} cannot be read ({_why(exc)})") from None
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise FormatError(f"{self.label}: {key} is truncated or corrupt ({exc.__class__.__name__}); "
                              "this recording cannot be read") from None

    def _rank_part(self) -> int | None:
        """The rank of a rank group found where a recording's root should be (its rank 0 wrote the
        root elsewhere), or None. Local recordings only (a listing; a remote store is not searched)."""
        root = backend.local_root(self.store)
        try:
            names = sorted(p.name for p in root.iterdir()) if root is not None and root.is_dir() else []
        except OSError:
            return None
        for name in names:
            rank = name.removeprefix("rank")
            if rank.isdigit() and int(rank) > 0 and (root / name / layout.MANIFEST_KEY).is_file():
                return int(rank)
        return None

    def _rank_group_of(self) -> tuple[int, Path] | None:
        """(rank, the recording) where this path is a rank's group inside a recording (``run.zarr/rank1``, given
        for rank 1's recording of a run of several processes), else None. Local recordings only."""
        root = backend.local_root(self.store)
        rank = root.name.removeprefix("rank") if root is not None else ""
        if root is None or not rank.isdigit() or not (root.parent / "zarr.json").is_file():
            return None
        try:
            meta = json.loads((root.parent / "zarr.json").read_bytes())
        except (OSError, ValueError, RecursionError):
            return None
        ours = (meta.get("attributes") or {}).get(layout.ATTRS_KEY) if isinstance(meta, dict) else None
        if not isinstance(ours, dict) or ours.get("format") != layout.FORMAT_NAME:
            return None
        given = Path(backend.local_path(self.target)) if isinstance(self.target, (str, os.PathLike)) else root
        return int(rank), given.parent

    def _read_attrs(self) -> dict[str, Any]:
        meta = self._read_json("zarr.json")
        attributes = meta.get("attributes") if isinstance(meta, dict) else None
        ours = attributes.get(layout.ATTRS_KEY) if isinstance(attributes, dict) else None
        if not isinstance(ours, dict) or ours.get("format") != layout.FORMAT_NAME:
            if meta is None:
                part = self._rank_part()
                if part is not None:
                    raise NotARecordingError(
                        f"{self.label} holds only rank {part}'s part of a run of several processes: rank 0 recorded "
                        f"to another path, and every rank must record to the same one; move {layout.rank_group(part)}/"
                        " into the recording rank 0 made, and open that")
            inside = self._rank_group_of()
            if inside is not None:
                rank, parent = inside
                raise NotARecordingError(
                    f"{self.label} is rank {rank}'s part of the recording {parent}, not a recording of its own: give "
                    f"{parent} with --rank {rank} (replayer.open({str(parent)!r}, rank={rank}) in Python)")
            raise NotARecordingError(f"{self.label} is not a PaperDebugger recording (it has no zarr.json with "
                                     f"'{layout.ATTRS_KEY}' metadata); give the path of a recording")
        self._check_version(ours.get("schema_version"), "zarr.json")
        self._check_sum(ours, ours.get("schema_version"), "zarr.json", "its PaperDebugger attributes")
        for key in ("run", "final"):
            if not isinstance(ours.get(key, {}), dict):
                raise FormatError(f"{self.label}: zarr.json holds a malformed '{key}' record; the recording's "
                                  "metadata is damaged")
        return ours

    def _check_version(self, version: Any, where: str) -> None:
        try:
            major, minor = layout.parse_version(str(version))
        except ValueError:
            raise FormatError(f"{self.label}: {where} has an invalid schema version {version!r}") from None
        if major == layout.SCHEMA_MAJOR and minor > layout.parse_version(layout.SCHEMA_VERSION)[1] and \
                self.newer is None:
            from recorder.capture import warn

            self.newer = (f"{self.label} was written by a newer PaperDebugger (schema {version}; this one reads "
                          f"{layout.SCHEMA_VERSION}): what the newer schema added is not read, and an answer may "
                          "differ from the newer version's; upgrade paperdebugger")
            warn(self.newer, stacklevel=3)
        if major > layout.SCHEMA_MAJOR:
            raise SchemaVersionError(
                f"{self.label} uses schema {version}, newer than this PaperDebugger reads "
                f"({layout.SCHEMA_VERSION}); upgrade paperdebugger to open it")
        if major < layout.SCHEMA_MAJOR:
            raise SchemaVersionError(f"{self.label} uses schema {version}, which this PaperDebugger no longer "
                                     "reads; open it with an older paperdebugger")

    @cached_property
    def checked(self) -> bool:
        """Whether this recording's schema carries checksums of its metadata and index chunks (1.5)."""
        return _checked(self.attrs["schema_version"])

    def _check_sum(self, doc: dict[str, Any], version: Any, where: str, what: str) -> None:
        """A metadata document of schema ``version`` must match its checksum (from 1.5: have one)."""
        stored = doc.get(layout.CHECKSUM_KEY)
        if stored is None and not _checked(version):
            return
        try:
            computed = layout.checksum(doc)
        except (ValueError, TypeError):
            computed = None
        if stored != computed:
            raise FormatError(f"{self.label}: {what} in {where} do not match their checksum: the file was damaged "
                              "or edited; this recording cannot be trusted")

    def _world_size(self) -> int:
        world = self.attrs.get("world_size", 1)
        if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= 1 << 20:
            raise FormatError(f"{self.label}: zarr.json gives an invalid world size {world!r}; the recording's "
                              "metadata is damaged")
        return world

    def _read_manifests(self) -> dict[int, dict[str, Any]]:
        """Every rank's manifest: rank 0's at the root, rank k's in its group (schema 1.4). A rank of a
        distributed run that has none yet (killed before its first commit, or not started) is
        listed in ``missing_ranks``; the run opens as long as one rank committed."""
        found: dict[int, dict[str, Any]] = {}
        self.missing_ranks: list[int] = []
        for rank in range(self.world_size):
            key = layout.manifest_key(rank)
            manifest = self._read_json(key)
            if manifest is None:
                self.missing_ranks.append(rank)
                continue
            found[rank] = self._check_manifest(manifest, key, rank)
        if not found:
            raise FormatError(f"{self.label}: {layout.MANIFEST_KEY} is missing, so no step is known to be "
                              "committed; the recorder was killed before its first commit, or the recording "
                              "was damaged or copied incompletely")
        return found

    def _check_manifest(self, manifest: Any, key: str, rank: int) -> dict[str, Any]:
        ranks = manifest.get("ranks") if isinstance(manifest, dict) else None
        if not isinstance(ranks, dict) or manifest.get("format") != "paperdebugger.manifest":
            raise FormatError(f"{self.label}: {key} is not a PaperDebugger manifest")
        self._check_version(manifest.get("schema_version"), key)
        self._check_sum(manifest, manifest.get("schema_version"), key, "the committed lengths and status")
        if manifest.get("status", "recording") not in layout.RUN_STATUSES:
            raise FormatError(f"{self.label}: {key} gives an unknown status "
                              f"{manifest.get('status')!r}; the manifest is damaged")
        if str(rank) not in ranks or (rank and len(ranks) != 1):
            raise FormatError(f"{self.label}: {key} does not commit rank {rank}; the manifest is damaged")
        for name, lengths in ranks.items():
            if not (isinstance(name, str) and name.isdigit() and isinstance(lengths, dict)):
                raise FormatError(f"{self.label}: {key} has a malformed entry for rank {name!r}; "
                                  "the manifest is damaged")
            for table in (*_TABLES, *lengths):
                value = lengths.get(table)
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise FormatError(f"{self.label}: {key} gives rank {name} an invalid length "
                                      f"{table}={value!r}; the manifest is damaged")
        return manifest

    def rank_closed(self, rank: int) -> bool:
        """Whether the rank's writer closed it (its manifest says complete or crashed): closing trims
        every array to its committed length, so any other length is damage. An ``incomplete`` rank's
        writer may have failed before it could trim: its arrays may be longer, as while recording."""
        return self.manifests[rank].get("status", "recording") in ("complete", "crashed")

    # -- run-level information -------------------------------------------------------------------
    @property
    def run_info(self) -> dict[str, Any]:
        return dict(self.attrs.get("run", {}))

    @property
    def schema_version(self) -> str:
        return str(self.attrs["schema_version"])

    @property
    def status(self) -> str:
        """``complete``; ``crashed`` (an exception ended the run, or its process died); ``incomplete``
        (recording stopped early, training went on: ``final`` in the run's metadata says why); or
        ``recording`` while the writer is alive. Of a distributed run: ``recording`` while any rank
        records, else the worst of its ranks' (a rank that never committed counts as crashed)."""
        statuses = [self.rank_status(rank) for rank in self.manifests]
        if "recording" in statuses:
            return "recording"
        for status in ("crashed", "incomplete"):
            if status in statuses or (status == "crashed" and self.missing_ranks):
                return status
        return "complete"

    def rank_status(self, rank: int) -> str:
        """One rank's status, as ``status`` describes it; ``missing`` for a rank without a commit."""
        manifest = self.manifests.get(rank)
        if manifest is None:
            return "missing"
        status = manifest.get("status", "recording")
        if status == "recording" and not self._writer_alive(manifest):
            return "crashed"
        if status == "complete" and self.rank(rank).torn:  # it ended well, but what it wrote last is lost
            return "incomplete"
        return str(status)

    def _writer_alive(self, manifest: dict[str, Any]) -> bool:
        writer = manifest.get("writer")
        writer = writer if isinstance(writer, dict) else {}
        if writer.get("host") == socket.gethostname() and writer.get("boot") == backend.boot_id():
            try:
                pid = int(writer["pid"])
                if pid <= 0:  # 0 and negative pids signal process groups
                    raise ValueError(pid)
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except (PermissionError, KeyError, ValueError, TypeError, OverflowError):
                return True
            start = writer.get("start")
            return start is None or backend.process_start(pid) in (start, None)  # a reused pid is not it
        try:
            updated = float(manifest.get("updated_unix", 0))
        except (TypeError, ValueError):
            return False
        return time.time() - updated < STALE_AFTER_S

    @property
    def ranks(self) -> list[int]:
        """The ranks with committed steps (``missing_ranks``: those of the world without)."""
        return sorted(self.manifests)

    def rank(self, rank: int = 0) -> RankReader:
        if rank not in self._ranks:
            manifest = self.manifests.get(rank) if isinstance(rank, int) and not isinstance(rank, bool) else None
            if manifest is None:
                never = " (it never committed a step: killed before its first commit, or never started)" \
                    if rank in self.missing_ranks else ""
                raise FormatError(f"{self.label} has no rank {rank}{never}; it has "
                                  f"rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))}")
            lengths = manifest["ranks"][str(rank)]
            self._ranks[rank] = RankReader(self, rank, lengths)
        return self._ranks[rank]

    def nbytes(self) -> int:
        """Bytes on disk (directory stores), in the zip, or in the remote store."""
        root = backend.local_root(self.store)
        if root is not None:
            return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        if isinstance(self.store, backend.RemoteStore):
            try:
                return backend.remote_nbytes(self.store)
            except OSError as exc:
                raise FormatError(f"{self.label}: cannot list the recording ({backend.remote_problem(exc)})") from None
        path = getattr(self.store, "path", None)
        return Path(path).stat().st_size if path else 0


_ROWS_PER_SLICE_READ = 2048  # what reading one chunk alone costs, in rows of a whole-column read (a chunk is 8192)
_CHUNK_CACHE_BYTES = 32 << 20  # decoded chunks of columns read in slices, kept per rank reader


class RankReader:
    """The tables of one rank, sliced to their committed lengths."""

    def __init__(self, run: RunReader, rank: int, lengths: dict[str, int]) -> None:
        self.run, self.rank = run, rank
        self.lengths = {k: int(v) for k, v in lengths.items()}
        self.prefix = layout.rank_group(rank)
        try:
            self.group = run.group[self.prefix]
        except (KeyError, ValueError, TypeError, OSError) as exc:
            raise FormatError(f"{run.label}: group {self.prefix} is missing or its zarr.json is damaged "
                              f"({_why(exc)}); the recording is damaged") from None
        if not isinstance(self.group, zarr.Group):
            raise FormatError(f"{run.label}: {self.prefix}/zarr.json describes an array, not a group; the "
                              "recording is damaged")
        self._columns: dict[str, np.ndarray] = {}
        self._arrays: dict[str, Any] = {}
        self._framing: dict[str, tuple[str | None, int]] = {}  # chunk encoding and decoded bytes per array
        self._checked: dict[str, set[int]] = {}  # chunks of each array whose files were checked
        self._sliced: dict[str, int] = {}  # how many chunks of each column were read alone
        self._chunks: dict[tuple[str, int, int], np.ndarray] = {}  # (path, chunk, end row): rows, oldest first
        self._chunk_bytes = 0
        self._docs: dict[int, Any] = {}
        self._old_calls: str | None = None
        self.committed = dict(self.lengths)  # what the manifest commits; ``lengths``: what can be read of it
        # Why some committed rows cannot be read (the chunks written last lost: a power cut), or None.
        self.torn: str | None = None
        self._cut_torn_tail()

    def __len__(self) -> int:
        return self.lengths["steps"]

    @cached_property
    def attrs(self) -> dict[str, Any]:
        """The rank group's own attributes (schema 1.4): rank, world size, its process's run record
        and, once closed, ``final``; empty for older recordings."""
        ours = self.group.attrs.get(layout.ATTRS_KEY)
        if ours is None and not self.run.checked:
            return {}
        if not isinstance(ours, dict) or not all(isinstance(ours.get(k, {}), dict) for k in ("run", "final")):
            raise FormatError(f"{self.run.label}: {self.prefix}/zarr.json holds malformed attributes; the "
                              "recording's metadata is damaged")
        self.run._check_sum(ours, self.run.schema_version, f"{self.prefix}/zarr.json", "the rank's attributes")
        return dict(ours)

    @property
    def run_info(self) -> dict[str, Any]:
        """Where and how this rank's process recorded (host, pid, script, versions, rank, world size)."""
        return dict(self.attrs.get("run") or self.run.run_info)

    @property
    def final(self) -> dict[str, Any]:
        """What the rank's writer said when it closed (status, iterations, exception...)."""
        found = self.attrs.get("final")
        if found is None and self.rank == 0:
            found = self.run.attrs.get("final")
        manifest = self.run.manifests.get(self.rank) or {}
        status, info = manifest.get("status", "recording"), manifest.get("info")
        if found is None and status != "recording" and isinstance(info, dict):
            # closed, and killed before the metadata after the manifest was written: the manifest holds the same
            # info the final metadata would (the writer commits its status, then publishes ``final``)
            found = {"status": status, **info}
        return dict(found or {})

    @property
    def committed_info(self) -> dict[str, Any]:
        """What the rank's last manifest says of the run (its ``info``): ``final``'s contents once it
        closed; before that, what the writer committed as it went (schema 1.12: what GradScaler
        skipped), so a run killed before it closed still says it."""
        manifest = self.run.manifests.get(self.rank) or {}
        info = manifest.get("info")
        return dict(info) if isinstance(info, dict) else {}

    @property
    def dist(self) -> dict[str, Any]:
        """Rank, world size and process-group backend (known once the group was made; None before)."""
        info = self.run_info
        out = {"rank": info.get("rank", self.rank), "world_size": info.get("world_size", self.run.world_size),
               "backend": info.get("backend")}
        latest = self.run.manifests[self.rank].get("dist")
        if isinstance(latest, dict) and latest.get("backend") is not None:
            out["backend"] = str(latest["backend"])
        return out

    @property
    def status(self) -> str:
        return self.run.rank_status(self.rank)

    def _length_of(self, path: str, lengths: dict[str, int] | None = None) -> int:
        lengths = self.lengths if lengths is None else lengths
        if path in lengths:  # a log (docs/bytes, dims/values, blobs/u4)
            return lengths[path]
        table = path.split("/")[0]
        if table not in lengths or path in _LOGS:
            raise FormatError(f"{self.run.label}: the manifest has no length for {path}; the manifest is damaged")
        return lengths[table]

    def _cut_torn_tail(self) -> None:
        """Cut the lengths to the rows before chunks at the end of the committed data that are missing,
        empty or truncated, where everything read keeps pointing at rows that can be read.

        The writer commits its manifest synced to disk, and the small chunk files before it only written
        (syncing dozens per commit would cost more than the commit): after a power cut, or a disk that
        lost its last writes, the manifest can commit rows whose chunk files came back empty. Without
        this, every read of the run failed on them; now the steps before them open, and ``torn`` says
        what was lost. Damage elsewhere (not at the end of a column) is still reported when it is read,
        as are payload bytes (a replay that needs them says so). Local stores only: a bundle (a zip) is
        checked whole by ``zipcheck``, and a remote store's writes are whole objects."""
        if backend.local_root(self.run.store) is None or not self.lengths.get("steps"):
            return
        readable: dict[str, int] = {}
        whys: dict[str, str] = {}  # what is wrong with the first chunk of the torn end of each column
        for path in _COLUMNS:
            if path.startswith("blobs/"):
                continue
            try:
                n = self._length_of(path)
                if not n or not self.holds(path):
                    continue
                arr = self._array(path)
            except FormatError:  # damaged otherwise: said when it is read
                continue
            per = arr.chunks[0]
            index = (n - 1) // per
            while index >= 0:
                try:
                    self._check_chunk(path, arr, index)
                    break
                except FormatError as exc:
                    whys[path] = str(exc).removeprefix(f"{self.run.label}: ").removesuffix("; the recording is damaged")
                    index -= 1
            if (index + 1) * per < n:
                readable[path] = (index + 1) * per
        if not readable:
            return
        # Named: the column of the cut (the step table's first, where the steps are cut to).
        why = whys[min(readable, key=lambda p: (not p.startswith("steps/"), readable[p]))]

        def table(name: str) -> int:
            return min([self.committed[name], *(r for p, r in readable.items()
                                                if p.split("/")[0] == name and p not in _LOGS)])

        def first(bad: np.ndarray, limit: int) -> int:
            return int(np.flatnonzero(bad)[0]) if bad.any() else limit

        logs = {log: readable.get(log, self.lengths[log]) for log in ("docs/bytes", "dims/values")
                if log in self.lengths}  # (the lengths are cut only where some step is left: below)
        docs = table("docs")
        ends = self._raw("docs/offset", docs) + self._raw("docs/length", docs)
        docs = first(ends > logs.get("docs/bytes", 0), docs)
        payloads = table("payloads")
        tensors = table("tensors")
        cols = {c: self._raw(f"tensors/{c}", tensors) for c in ("name", "dtype", "device", "payload", "dims_start",
                                                                "ndim")}
        tensors = first((cols["name"] >= docs) | (cols["dtype"] >= docs) | (cols["device"] >= docs)
                        | (cols["payload"] >= payloads)
                        | (cols["dims_start"] + 2 * cols["ndim"].astype(np.int64) > logs["dims/values"]),
                        tensors)
        late = table("late") if self.lengths.get("late") else 0
        if late:
            late = first((self._raw("late/tensor", late) >= tensors) | (self._raw("late/payload", late) >= payloads),
                         late)
        steps = table("steps")
        bad = self._raw("steps/tensor_start", steps) + self._raw("steps/tensor_count", steps) > tensors
        for path in _DOC_REFS:
            if path.startswith("steps/") and self.holds(path):
                bad |= self._raw(path, steps) >= docs
        steps = first(bad, steps)
        if not steps:  # not a torn end: damage from the first chunk on, reported where it is read (info --check
            return  # names each damaged column; a reader of the steps refuses the recording in one line)
        self.lengths.update(logs, steps=steps, tensors=tensors, payloads=payloads, docs=docs, late=late)
        self.torn = (f"the last writes before it ended did not all reach the disk ({why}): {steps} of its "
                     f"{self.committed['steps']} committed steps can be read")

    def _raw(self, path: str, stop: int) -> np.ndarray:
        """Rows ``0:stop`` of a column, their chunk files checked, their values not (``_cut_torn_tail``
        looks for the values that point past what can be read)."""
        arr = self._array(path)
        if not stop:
            return np.zeros(0, dtype=arr.dtype)
        for index in range((stop - 1) // arr.chunks[0] + 1):
            self._check_chunk(path, arr, index)
        try:
            return np.asarray(arr[:stop])
        except (RuntimeError, ValueError, TypeError, OSError) as exc:
            raise FormatError(f"{self.run.label}: {self.prefix}/{path} rows 0:{stop} cannot be decoded "
                              f"({_why(exc)}); the recording is damaged") from None

    def holds(self, path: str) -> bool:
        """Whether the rank has array ``path``: always where its schema has it (a missing one is damage, which
        reading it reports), else whether it was written (``layout.REQUIRED_SINCE``: a 1.0 recording has no
        late/, the first 1.2 recordings no steps/flags)."""
        since = layout.REQUIRED_SINCE.get(path)
        if since is None or layout.parse_version(self.run.schema_version) >= since:
            return True
        return self._stored(f"{self.prefix}/{path}/zarr.json")

    def column(self, path: str) -> np.ndarray:
        """A whole committed column, e.g. ``column("steps/iteration")`` (read once, then cached). The
        ``steps/call`` of a recording before schema 1.10 is counted as 1.10 counts it (``old_calls``)."""
        if path not in self._columns:
            values = self._read(path, 0, self._length_of(path))
            if path == "steps/call" and self._counts_calls_otherwise:
                values = self._renumbered(values)
            self._columns[path] = values
        return self._columns[path]

    @property
    def old_calls(self) -> str | None:
        """How ``steps/call`` counts where it could not be counted anew (a recording before 1.10 whose step
        table lacks calls its recorder counted: ``_renumbered``), for a message; None where it counts as now."""
        if self._counts_calls_otherwise:
            self.column("steps/call")
        return self._old_calls

    @cached_property
    def _counts_calls_otherwise(self) -> bool:
        """Whether this rank's ``steps/call`` was counted by an older rule than the recorder's now: a
        recording before 1.10 (a bundle holds its calls as its recording's reader gave them)."""
        return layout.parse_version(self.run.schema_version) < layout.CALLS_SINCE and not self.final.get("bundle")

    def _renumbered(self, recorded: np.ndarray) -> np.ndarray:
        """The calls of a recording before 1.10 (``recorded``) counted as 1.10 counts them: a forward step's,
        the forward calls before it in its iteration of the same name, paper label and code (its definition
        document); a backward step's, its forward's. Exact where every call the old recorder counted is a
        step of the table, which the recorded numbers are checked to show; otherwise they are kept, and
        ``old_calls`` says how they count."""
        self._old_calls = None
        if not len(recorded):
            return recorded
        cols = {c: np.asarray(self.column(f"steps/{c}")) for c in
                ("iteration", "name", "definition", "module_path", "phase", "forward")}
        for c in ("name", "definition", "module_path"):  # by content (a writer's cache of documents is bounded)
            ids, inverse = np.unique(cols[c], return_inverse=True)
            texts = [json.dumps(self.doc(int(i)), sort_keys=True) for i in ids]
            cols[c] = np.unique(texts, return_inverse=True)[1].reshape(-1)[inverse.reshape(-1)]
        forward = cols["phase"] == 0

        def counts(keys: tuple[str, ...]) -> np.ndarray:  # per forward step: those before it with its keys
            _, group = np.unique(np.stack([cols[k][forward] for k in keys], axis=1), axis=0, return_inverse=True)
            group = group.reshape(-1)
            order = np.argsort(group, kind="stable")
            starts = np.searchsorted(group[order], group[order])
            out = np.empty(len(group), np.int64)
            out[order] = np.arange(len(group)) - starts
            return out

        old = (("iteration", "name", "module_path") if layout.parse_version(self.run.schema_version) < (1, 2)
               else ("iteration", "name"))
        backward = np.flatnonzero(~forward)
        source = cols["forward"][backward]
        if not (np.array_equal(recorded[forward], counts(old)) and np.all(source >= 0)
                and np.array_equal(recorded[backward], recorded[source])):
            self._old_calls = ("per step name and module path" if len(old) == 3 else "per step name") + \
                f" (schema {self.run.schema_version}; since 1.10, per name, paper label and code)"
            return recorded
        out = recorded.astype(np.int32)
        out[forward] = counts(("iteration", "name", "definition"))
        out[backward] = out[source]
        return out

    def _array(self, path: str) -> Any:
        """One array, opened once (opening reads its metadata) and checked against the layout."""
        arr = self._arrays.get(path)
        if arr is None:
            key = f"{self.prefix}/{path}"
            try:
                arr = self.group[path]
            except (KeyError, ValueError, TypeError, OSError) as exc:  # zarr's metadata errors are ValueErrors
                if self._stored(f"{key}/zarr.json"):
                    raise FormatError(f"{self.run.label}: {key}/zarr.json is damaged ({_why(exc)}); the recording "
                                      "cannot be read") from None
                raise FormatError(f"{self.run.label}: array {path} is missing; the recording is damaged") from None
            self._check_array(path, key, arr)
            self._arrays[path] = arr
        return arr

    def _stored(self, key: str) -> bool:
        try:
            return _head(self.run.store, key) is not None
        except OSError:  # there, but unreadable
            return True

    def _check_array(self, path: str, key: str, arr: Any) -> None:
        """Refuse metadata that does not describe the layout's array: zarr would decode the chunks
        with it, into wrong values (another dtype, byte order or row shape) or huge allocations."""
        label, col = self.run.label, _COLUMNS[path]
        if not isinstance(arr, zarr.Array) or not isinstance(arr.metadata, ArrayV3Metadata):
            raise FormatError(f"{label}: {key}/zarr.json does not describe a zarr v3 array; the recording is damaged")
        codecs = arr.metadata.codecs
        big_endian = any(isinstance(c, BytesCodec) and c.endian == Endian.big for c in codecs)
        if np.dtype(arr.dtype) != np.dtype(col.dtype) or big_endian:
            raise FormatError(f"{label}: {key}/zarr.json declares data type {arr.dtype}"
                              f"{' big endian' if big_endian else ''}, but {path} holds little-endian "
                              f"{col.dtype}; the recording is damaged")
        row_bytes = math.prod(col.row_shape) * np.dtype(col.dtype).itemsize
        if arr.shape[1:] != col.row_shape or arr.chunks[1:] != col.row_shape or \
                arr.chunks[0] * row_bytes > _MAX_CHUNK_BYTES:
            raise FormatError(f"{label}: {key}/zarr.json declares shape {arr.shape} in chunks of {arr.chunks}, "
                              f"which {path} cannot have; the recording is damaged")
        rows, n = arr.shape[0], self._length_of(path, self.committed)
        if rows < n or (self.run.rank_closed(self.rank) and rows != n):
            raise FormatError(f"{label}: array {path} has {rows} rows but {n} are committed; the recording is "
                              "damaged")
        kinds = tuple(type(c) for c in codecs)
        sealed = kinds[-1:] == (Crc32cCodec,)  # schema 1.5: a crc32c after the data, 4 bytes
        if self.run.checked and col.kind != "blob" and not sealed:
            raise FormatError(f"{label}: {key}/zarr.json lists no crc32c codec, which every index and document "
                              "array of this schema has; the recording is damaged")
        framing = {(BytesCodec,): "raw", (BytesCodec, BloscCodec): "blosc"}.get(kinds[:-1] if sealed else kinds)
        if framing is None:  # another codec's chunks cannot be sized before they are decoded (a gzip bomb)
            names = ", ".join(type(c).__name__ for c in codecs)
            raise FormatError(f"{label}: {key}/zarr.json lists the codecs {names}; a recording's chunks are raw or "
                              "Blosc-compressed, so it is damaged or was not made by PaperDebugger")
        self._framing[path] = (framing, arr.chunks[0] * row_bytes, 4 if sealed else 0)

    def _read(self, path: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of an array, from chunk files checked to be there and whole, with
        their values checked where they point somewhere."""
        if not 0 <= start <= stop <= self._length_of(path):
            raise FormatError(f"{self.run.label}: rows {start}:{stop} of {path} are past the committed data")
        arr = self._array(path)
        if stop == start:
            return np.zeros((0, *arr.shape[1:]), dtype=arr.dtype)
        per, checked = arr.chunks[0], self._checked.setdefault(path, set())
        for index in range(start // per, (stop - 1) // per + 1):
            if index not in checked:
                self._check_chunk(path, arr, index)
                checked.add(index)
        try:
            values = np.asarray(arr[start:stop])
        except (RuntimeError, ValueError, TypeError, OSError) as exc:  # Blosc raises RuntimeError
            if "checksum" in str(exc):  # zarr's crc32c codec
                raise FormatError(f"{self.run.label}: a chunk of {self.prefix}/{path} (rows {start}:{stop}) fails its "
                                  "crc32c checksum; the recording is damaged") from None
            raise FormatError(f"{self.run.label}: {self.prefix}/{path} rows {start}:{stop} cannot be decoded "
                              f"({_why(exc)}); the recording is damaged") from None
        self._check_values(path, start, values)
        if path.startswith("steps/") and path not in ("steps/forward", "steps/phase"):
            self.rows("steps/forward", start, stop)  # checked as it is read: are these rows steps at all?
        return values

    def _check_chunk(self, path: str, arr: Any, index: int) -> None:
        """A chunk holding committed rows must exist (zarr reads a missing one as zeros) and be as
        long as its header says (Blosc would read past the end of a truncated one)."""
        label = self.run.label
        key = f"{self.prefix}/{path}/{arr.metadata.encode_chunk_key((index,) + (0,) * (arr.ndim - 1))}"
        try:
            found = _head(self.run.store, key)
        except OSError as exc:
            raise FormatError(f"{label}: chunk {key} cannot be read ({_why(exc)}); the recording is damaged") from None
        if found is None:
            raise FormatError(f"{label}: chunk {key} is missing, but the manifest commits rows in it; the recording "
                              "is damaged or was copied incompletely")
        head, size = found
        framing, expected, tail = self._framing[path]
        if framing == "raw" and size != expected + tail:
            raise FormatError(f"{label}: chunk {key} has {size} bytes, an uncompressed chunk has {expected + tail}; "
                              "it is truncated or damaged")
        if framing == "blosc":
            if len(head) < _BLOSC_HEADER:
                raise FormatError(f"{label}: chunk {key} is truncated or damaged (a {size}-byte file, shorter than "
                                  f"the {_BLOSC_HEADER}-byte Blosc header a chunk starts with)")
            nbytes, cbytes = struct.unpack("<4xI4xI", head)
            if nbytes != expected or cbytes + tail != size:
                raise FormatError(f"{label}: chunk {key} is truncated or damaged (a {size}-byte file whose Blosc "
                                  f"header declares {cbytes} bytes holding {nbytes}; a chunk holds {expected})")

    def _check_values(self, path: str, start: int, values: np.ndarray) -> None:
        bound = _BOUNDS.get(path)
        if bound is None or not len(values):
            return
        low, high = bound
        if path == "tensors/role" and self.run.newer:  # a role a newer minor added (as 1.4 added collective)
            high = None
        limit = self._length_of(high) if isinstance(high, str) else high
        bad = values < low if limit is None else (values < low) | (values >= limit)
        if bad.any():
            first = int(np.flatnonzero(bad)[0])
            allowed = f"{low} or more" if limit is None else f"{low}..{limit - 1}"
            raise FormatError(f"{self.run.label}: {path} row {start + first} holds {values[first]} (allowed: "
                              f"{allowed}); the recording is damaged")
        if path == "steps/parent":  # entered before its child: a chain of parents always ends (no cycle)
            bad = values >= np.arange(start, start + len(values))
            if bad.any():
                row = start + int(np.flatnonzero(bad)[0])
                raise FormatError(f"{self.run.label}: step {row} names step {int(values[row - start])} as the step it "
                                  "ran inside, which began after it; the recording is damaged")
        if path == "steps/forward":  # a forward step names none, a backward step an earlier one
            phase = self.rows("steps/phase", start, start + len(values))
            index = np.arange(start, start + len(values))
            bad = np.where(phase == 0, values != layout.NO_REF, (values < 0) | (values >= index))
            if bad.any():  # rows of zeros: a chunk that held fewer rows than the manifest commits
                raise FormatError(f"{self.run.label}: step {start + int(np.flatnonzero(bad)[0])} is not a step the "
                                  "recorder wrote (its rows read as zeros); the recording was copied while it was "
                                  "being written (its manifest after the data), or is damaged: copy it again, or "
                                  "copy manifest.json first")

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
            if start < 0 or size < 0 or end > self._length_of("docs/bytes"):
                raise FormatError(f"{self.run.label}: document {doc_id} points past the committed data; the recording "
                                  "is damaged")
            raw = self._read("docs/bytes", start, end).tobytes()
            try:
                self._docs[doc_id] = json.loads(raw)
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                raise FormatError(f"{self.run.label}: document {doc_id} is not valid JSON; the recording is "
                                  "damaged") from None
        return self._docs[doc_id]

    def _text(self, doc_id: int, what: str, row: int) -> str:
        """A document that must be a string (a tensor record's name, dtype or device)."""
        text = self.doc(doc_id)
        if not isinstance(text, str):
            raise FormatError(f"{self.run.label}: tensor record {row} has a {what} that is not a string "
                              f"(document {doc_id}); the recording is damaged")
        return text

    def rows(self, path: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of a column: sliced from the cached column if it was read whole, else
        from its chunks, each decoded once and kept a while (moving to the next step of millions
        reads nothing new), until so many of a column's chunks were read that reading it whole once
        is cheaper."""
        length = self._length_of(path)
        if not 0 <= start <= stop <= length:
            raise FormatError(f"{self.run.label}: rows {start}:{stop} of {path} are past the committed data")
        if path in self._columns or (path == "steps/call" and self._counts_calls_otherwise):  # (counted whole)
            return self.column(path)[start:stop]
        if stop == start:
            return self._read(path, start, stop)
        per = self._array(path).chunks[0]
        parts = []
        for k in range(start // per, (stop - 1) // per + 1):
            lo, hi = k * per, min((k + 1) * per, length)
            key = (path, k, hi)  # hi: a partial last chunk grows while the run is being written
            chunk = self._chunks.pop(key, None)
            if chunk is None:
                count = self._sliced[path] = self._sliced.get(path, 0) + 1
                if count * _ROWS_PER_SLICE_READ > length:  # chunk reads have cost about a whole read
                    return self.column(path)[start:stop]
                chunk = self._read(path, lo, hi)
                self._chunk_bytes += chunk.nbytes
                while self._chunk_bytes > _CHUNK_CACHE_BYTES and self._chunks:
                    self._chunk_bytes -= self._chunks.pop(next(iter(self._chunks))).nbytes  # least recent
            self._chunks[key] = chunk  # (re)inserted last: the most recently used
            parts.append(chunk[max(start, lo) - lo:min(stop, hi) - lo])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def tensor_records(self, step: int) -> list[TensorRecord]:
        """The tensor records of one step, in the order they were captured."""
        start = int(self.rows("steps/tensor_start", step, step + 1)[0])
        count = int(self.rows("steps/tensor_count", step, step + 1)[0])
        if start < 0 or count < 0 or start + count > self.lengths["tensors"]:
            raise FormatError(f"{self.run.label}: step {step} points past the committed tensor records; the "
                              "recording is damaged")
        records = self._records(start, start + count)
        if any(r.step != step for r in records):
            raise FormatError(f"{self.run.label}: the tensor records of step {step} (rows {start}:{start + count}) "
                              "belong to another step; the recording is damaged")
        return records

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
            if len(own) != 2 * ndim or ((own[:ndim] < 0).any() and not (
                    self._ragged and int(cols["payload"][i]) == layout.NO_REF and row not in self._late
                    and (own[:ndim] >= layout.RAGGED_DIM).all())):
                raise FormatError(f"{self.run.label}: tensor record {row} has a shape past the committed data "
                                  "or with negative sizes; the recording is damaged")
            out.append(TensorRecord(
                row=row, step=int(cols["step"][i]), role=layout.role_name(int(cols["role"][i])),
                name=self._text(int(cols["name"][i]), "name", row),
                dtype=self._text(int(cols["dtype"][i]), "dtype", row),
                device=self._text(int(cols["device"][i]), "device", row), requires_grad=bool(cols["requires_grad"][i]),
                shape=tuple(int(d) for d in own[:ndim]), stride=tuple(int(d) for d in own[ndim:]),
                stats={k: float(v) for k, v in zip(layout.STAT_NAMES, cols["stats"][i])},
                payload=self._late.get(row, int(cols["payload"][i]))))
        return out

    @cached_property
    def _ragged(self) -> bool:
        """Whether a record's shape may hold ``layout.RAGGED_DIM`` (a nested tensor's ragged dimension, 1.16)."""
        return layout.parse_version(self.run.schema_version) >= layout.RAGGED_SINCE

    def payload_column(self) -> np.ndarray:
        """The payload row of every tensor record (-1: statistics only), the payloads attached
        after their records were written included."""
        payload = np.asarray(self.column("tensors/payload")).copy()
        for row, pid in self._late.items():
            payload[row] = pid
        return payload

    @cached_property
    def _late(self) -> dict[int, int]:
        """Payloads attached after their records were written (schema 1.1; none in 1.0 recordings)."""
        if not self.lengths.get("late"):
            return {}
        rows, pids = self.column("late/tensor"), self.column("late/payload")
        return {int(r): int(p) for r, p in zip(rows, pids)}

    def payload_units(self, pid: int, of: str = "") -> tuple[np.ndarray, int]:
        """The stored units of one payload and its unit index, checked against the payload's hash
        (``of`` names what the payload is, for the message).

        Raises ChecksumError when the bytes read are not the bytes recorded: a Blosc chunk has no
        checksum of its own, so a damaged one can decode into other values."""
        where = f"payload {pid}" + (f" ({of})" if of else "")
        if not 0 <= pid < self.lengths["payloads"]:
            raise FormatError(f"{self.run.label}: {where} is out of range; the recording is damaged")
        place = self._payload_place(pid, where)
        path, unit, offset, count = place
        units = self._read(path, offset, offset + count)
        self._check_payload(pid, units, where, place)
        return units, unit

    def _payload_place(self, pid: int, where: str) -> tuple[str, int, int, int]:
        """Where a payload's bytes are stored: its blob array, unit index, first unit and unit count."""
        unit = int(self.column("payloads/blob")[pid])
        offset, count = int(self.column("payloads/offset")[pid]), int(self.column("payloads/count")[pid])
        path = f"blobs/{layout.BLOB_UNITS[unit]}"
        if offset < 0 or count < 0 or offset + count > self._length_of(path):
            raise FormatError(f"{self.run.label}: {where} points past the committed data; the recording is "
                              "damaged")
        return path, unit, offset, count

    def _check_payload(self, pid: int, units: np.ndarray, where: str, place: tuple[str, int, int, int]) -> None:
        """Raise ChecksumError unless ``units``, read at payload ``pid``'s ``place``, hash to its recorded hash."""
        path, unit, offset, count = place
        high, low = (int(v) for v in self.column("payloads/hash")[pid])
        if payload_mod.content_key(units, unit)[:2] != (high, low):
            reason = f"{where}, {self.prefix}/{path}[{offset}:{offset + count}]: payload checksum mismatch"
            raise ChecksumError(f"{self.run.label}: {reason}: the recording is corrupted; restore it from a copy or "
                                "record again", reason)

    def check_payloads(self) -> Iterator[PayloadCheck]:
        """Every payload of the rank once, in the order its bytes are stored, checked against its hash as
        ``payload_units`` checks it. Each blob chunk is read once, however many payloads it holds (a
        payload read alone decodes its whole chunk), and only one is held at a time: a run of any size
        is checked in the memory of its largest payload. A chunk that cannot be read (missing,
        truncated, not decodable) fails each payload in it; damage to the payload table itself
        (``payloads/``) raises FormatError, as it does for any read."""
        if not self.lengths["payloads"]:
            return
        blob, offset, units = (self.column(f"payloads/{c}") for c in ("blob", "offset", "count"))
        self.column("payloads/hash")  # (the whole table read first: damage to it is said once, not per payload)
        itemsize = [np.dtype(layout.BLOB_DTYPES[u]).itemsize for u in layout.BLOB_UNITS]
        held: dict[str, Any] = {}  # the blob chunk read last: {"key": (path, index), "rows" or "error"}
        for pid in np.lexsort((offset, blob)).tolist():
            where, nbytes = f"payload {pid}", max(0, int(units[pid])) * itemsize[int(blob[pid])]
            try:
                place = self._payload_place(pid, where)
                path, _, start, count = place
                self._check_payload(pid, self._scan_read(path, start, start + count, held), where, place)
            except ChecksumError as exc:
                yield PayloadCheck(pid, nbytes, exc.reason)
            except FormatError as exc:  # its message without the recording's name, as a line of a listing says it
                text = str(exc).removeprefix(f"{self.run.label}: ")
                yield PayloadCheck(pid, nbytes, text if text.startswith(where) else f"{where}: {text}")
            else:
                yield PayloadCheck(pid, nbytes, None)

    def check_tables(self) -> Iterator[str]:
        """Every committed column of the rank's tables (steps, tensors, payloads, documents, shapes; not the blobs,
        which ``check_payloads`` reads) read once, a chunk at a time, as any read checks it: a chunk missing,
        truncated or not decodable, or a value that points outside its table. Yields what is wrong with each
        column that fails, at its first damaged chunk, in the words a read would raise it with."""
        for path, col in _COLUMNS.items():
            if col.kind == "blob" or not self.holds(path):
                continue
            try:
                length = self._length_of(path)
                per = self._array(path).chunks[0]
                for start in range(0, length, per):
                    self._read(path, start, min(start + per, length))
            except FormatError as exc:
                yield str(exc).removeprefix(f"{self.run.label}: ")

    def _scan_read(self, path: str, start: int, stop: int, held: dict[str, Any]) -> np.ndarray:
        """Rows ``start:stop`` of a blob array, for ``check_payloads``: from the chunk read last (``held``) where
        they lie in it, else from the chunks they span, each read whole, the last of them kept in ``held``."""
        if stop == start:
            return self._read(path, start, stop)
        per, length = self._array(path).chunks[0], self._length_of(path)
        parts = []
        for k in range(start // per, (stop - 1) // per + 1):
            if held.get("key") != (path, k):
                held.clear()
                held["key"] = (path, k)
                try:
                    held["rows"] = self._read(path, k * per, min((k + 1) * per, length))
                except FormatError as exc:
                    held["error"] = str(exc)
            if "error" in held:
                raise FormatError(held["error"])
            lo = k * per
            parts.append(held["rows"][max(start, lo) - lo:min(stop, lo + per) - lo])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def why_statistics_only(self, record: TensorRecord) -> str:
        """Why a tensor record has statistics and no payload, for a message: its step's note on it (a
        sparse or quantized tensor, a dtype without bytes, dropped bytes), else the ways a recording
        keeps statistics only. A record that kept its bytes says so."""
        if record.has_payload:
            return "it has its bytes, not statistics only"
        extra = self.doc(int(self.rows("steps/extra", record.step, record.step + 1)[0]))
        notes = [n for n in extra.get("notes", []) if isinstance(n, str)] if isinstance(extra, dict) else []
        for note in notes:
            if note.startswith(f"{record.name}: "):
                return note.removeprefix(f"{record.name}: ")
        if any(layout.DROPPED_NOTE in n for n in notes):
            return "its bytes were dropped: the store could not keep up with training"
        return self._why_no_bytes_kept(int(self.column("steps/iteration")[record.step]))

    def _extra_of(self, record: TensorRecord) -> dict[str, Any]:
        """The ``extra`` document of a record's step (empty where it holds none, or is not a map)."""
        extra = self.doc(int(self.rows("steps/extra", record.step, record.step + 1)[0]))
        return extra if isinstance(extra, dict) else {}

    @staticmethod
    def _sparse_entry(extra: dict[str, Any], record: TensorRecord) -> dict[str, Any] | None:
        """A record's entry in its step's extra ``sparse`` (1.18), where it has one."""
        found = (extra.get("sparse") or {}).get(record.name) if isinstance(extra.get("sparse"), dict) else None
        return found if isinstance(found, dict) and isinstance(found.get("layout"), str) else None

    def sparse_of(self, record: TensorRecord) -> tuple[str, int | None] | None:
        """A record that was a sparse tensor: its layout (``"sparse_csr"``) and how many values it
        stored, of which its statistics are (None where a recording before schema 1.18 did not say:
        its note names the layout only); None for any other record."""
        if record.has_payload:
            return None
        extra = self._extra_of(record)
        found = self._sparse_entry(extra, record)
        if found is not None:
            count = found.get("values")
            return found["layout"], count if type(count) is int and count >= 0 else None
        for note in extra.get("notes", []) or []:  # (an older recording's sparse gradient: its note names the layout)
            if isinstance(note, str) and note.startswith(f"{record.name}: torch.sparse_") and \
                    note.endswith(layout.STORED_NOTE):
                return note.removeprefix(f"{record.name}: torch.").split(" ", 1)[0], None
        return None

    def _part_names(self, record: TensorRecord) -> tuple[str, dict[str, str], bool] | None:
        """A sparse record's layout, the names of the component records of its parts by part name, and
        whether it was coalesced, as its step's extra ``sparse`` names them (1.19); None where it names no
        parts of a layout this reader makes (a recording before 1.19, a mode or iteration without payloads)."""
        if record.has_payload or record.role == "component":
            return None
        entry = self._sparse_entry(self._extra_of(record), record)
        parts = entry.get("parts") if entry is not None else None
        kind = entry.get("layout") if entry is not None else None
        if not isinstance(parts, dict) or set(parts) != set(payload_mod.SPARSE_PARTS.get(kind, ())) or \
                not all(isinstance(n, str) for n in parts.values()):
            return None
        return kind, parts, entry.get("coalesced") is True

    def sparse_parts(self, record: TensorRecord) -> SparseParts | None:
        """The records a sparse record's tensor is made of (1.19: its indices and values, ``component``
        records named ``<record>:<part>``), where the recording kept the bytes of every one, so that its
        tensor can be made again (``tensor``); None for any other record, and for a sparse one whose parts
        were not kept (``why_no_parts``)."""
        named = self._part_names(record)
        if named is None:
            return None
        kind, parts, coalesced = named
        components = {r.name: r for r in self.tensor_records(record.step) if r.role == "component"}
        found = {part: components.get(name) for part, name in parts.items()}
        if any(r is None or not r.has_payload for r in found.values()):
            return None
        return SparseParts(kind, found, coalesced)  # type: ignore[arg-type]

    def why_no_parts(self, record: TensorRecord) -> str:
        """Why a sparse record's parts were not kept (``sparse_parts`` is None), for a message: a recording
        before schema 1.19 (a gradient's: 1.24), a mode or iteration that kept statistics only, bytes dropped."""
        grad = record.role in ("grad_output", *layout.GRAD_ROLES)
        since = layout.SPARSE_GRAD_PARTS_SINCE if grad else layout.SPARSE_PARTS_SINCE
        if layout.parse_version(self.run.schema_version) < since:
            return (f"a recording before schema {'.'.join(map(str, since))} keeps statistics of a sparse "
                    f"{'gradient' if grad else 'tensor'}'s stored values only")
        named = self._part_names(record)
        if named is not None:
            components = {r.name: r for r in self.tensor_records(record.step) if r.role == "component"}
            for name in named[1].values():
                part = components.get(name)
                if part is None:
                    return f"its part {name} is not among the step's records (the recording is damaged)"
                if not part.has_payload:
                    return self.why_statistics_only(part)
        return self._why_no_bytes_kept(int(self.column("steps/iteration")[record.step]))

    def sparse_tensor(self, record: TensorRecord, parts: SparseParts,
                      values: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """A sparse record's tensor made again from its parts, exactly as it was (its indices and values
        as it held them); ``values``: the parts as the caller read them (on their device), else read here
        (on the CPU). Raises FormatError where they do not make the record's tensor."""
        values = values if values is not None else {p: self.tensor(r) for p, r in parts.records.items()}
        what = f"sparse tensor {record.name!r} of step {record.step}"
        try:
            out = payload_mod.sparse_from_parts(parts.layout, values, record.shape, parts.coalesced)
        except ValueError as exc:
            names = ", ".join(r.name for r in parts.records.values())
            raise FormatError(f"{self.run.label}: the parts of {what} ({names}) do not make a {parts.layout} tensor of "
                              f"shape {list(record.shape)} ({exc}); the recording is damaged") from None
        if payload_mod.dtype_name(out.dtype) != record.dtype:
            raise FormatError(f"{self.run.label}: the values of {what} are {payload_mod.dtype_name(out.dtype)}, its "
                              f"record says {record.dtype}; the recording is damaged")
        return out

    def ring_writes(self) -> list[dict[str, Any]] | None:
        """A flight-mode run's write-outs of its ring (``flight.dumps``): ``final``'s, or for a run whose
        process died before closing it, what its manifests committed as it went; after a hard crash
        under ``pdbg record``, one more, reason ``"died"``, for the iterations its parent wrote out of
        the shared ring (``ring_recovered``). None where the run says nothing of them (another mode, or
        a run still recording whose ring has written nothing yet)."""
        if self.run_info.get("mode") != "flight":
            return None
        final = self.final
        flight = (final or self.committed_info).get("flight")
        dumps = flight.get("dumps") if isinstance(flight, dict) else None
        writes = [d for d in dumps if isinstance(d, dict)] if isinstance(dumps, list) else []
        recovered = final.get("ring_recovered")
        if isinstance(recovered, dict) and recovered.get("iterations"):
            writes.append({"reason": "died", "iterations": recovered["iterations"], "bytes": recovered.get("bytes")})
        if not writes and not final and self.status == "recording":
            return None
        return writes

    def ring_iterations(self) -> list[int] | None:
        """The iterations whose tensors a flight-mode run's ring wrote out, in order (``ring_writes``);
        None where the run says nothing of them."""
        writes = self.ring_writes()
        if writes is None:
            return None
        return sorted({int(i) for d in writes for i in d.get("iterations") or [] if isinstance(i, int)})

    def ring_write_cut(self) -> list[int] | None:
        """The iterations of a flight-mode run's last write-out of its ring where the process died without
        closing the recording (no ``final``): a death during the write-out left only what its last commit
        held of it. None where no write-out can have been cut short (the run was closed, or still records)."""
        if self.final or self.status != "crashed":
            return None
        writes = [d for d in self.ring_writes() or [] if d.get("reason") != "died"]
        if not writes:
            return None
        return sorted(int(i) for i in writes[-1].get("iterations") or [] if isinstance(i, int))

    def _why_no_bytes_kept(self, iteration: int) -> str:
        """Why the run kept no tensor bytes of ``iteration``, from its mode (README, ``record``)."""
        mode, every = self.run_info.get("mode"), self.run_info.get("every")
        if mode == "stats":
            return "the run was recorded in stats mode, which keeps statistics only"
        if mode == "full" and isinstance(every, int) and every > 1 and iteration % every:
            below = iteration - iteration % every  # (counted from iteration 0, also where a resumed run starts later)
            start = self.run_info.get("start_iteration")
            nearest = (f"is {below + every}" if isinstance(start, int) and below < start else
                       f"are {below} and {below + every}")
            return (f"the run kept tensors every {every} iterations (--every {every}), and this is iteration "
                    f"{iteration}: the nearest kept {nearest}")
        if mode == "flight":
            writes = self.ring_writes() or []
            written = self.ring_iterations() or []
            if iteration in (self.ring_write_cut() or []):
                return (f"flight mode was writing out iteration {iteration} when the process died without closing "
                        "the recording, and this tensor's bytes were not committed before the death (or did not fit "
                        "in the ring)")
            if iteration in written and not any(iteration in d.get("iterations") or [] for d in writes
                                                if d.get("reason") != "died"):
                return (f"the recording process died, and pdbg record wrote out iteration {iteration} from the "
                        "flight ring's shared memory, but not this tensor's bytes: they were not there (see "
                        "ring_recovered in the run's final metadata)")
            if iteration in written:  # written out, but this tensor's bytes did not fit in the ring
                return (f"flight mode wrote out iteration {iteration}, but not this tensor's bytes: they did not fit "
                        "in the ring (record with a larger max_ring_bytes)")
            if written:
                shown = ", ".join(str(i) for i in written[:12]) + (", ..." if len(written) > 12 else "")
                return (f"flight mode keeps the tensors of the iterations its ring wrote out ({shown}), and "
                        f"iteration {iteration} is not one of them")
            return "flight mode keeps the tensors of the iterations its ring wrote out, and this is not one of them"
        return ("recorded in stats mode, on an iteration --every skipped, or in flight mode outside the "
                "iterations the ring wrote out")

    def tensor(self, record: TensorRecord) -> torch.Tensor:
        """The recorded tensor's value (a contiguous CPU tensor; a sparse one made again from its parts,
        ``sparse_parts``), exactly as it was."""
        what = f"tensor {record.name!r} of step {record.step}"
        if not record.has_payload:
            parts = self.sparse_parts(record)
            if parts is not None:  # (1.19) a sparse tensor, made again from its parts
                return self.sparse_tensor(record, parts)
            raise FormatError(f"{self.run.label}: {what} has statistics only ({self.why_statistics_only(record)})")
        try:
            dtype = payload_mod.dtype_from_name(record.dtype)
            expected_unit = payload_mod.unit_of(dtype)
        except (ValueError, payload_mod.UnsupportedDtype):
            raise FormatError(f"{self.run.label}: {what} has dtype {record.dtype!r}, which has no stored bytes; "
                              "the recording is damaged") from None
        units, unit = self.payload_units(record.payload, of=what)
        expected = math.prod(record.shape) * dtype.itemsize
        if units.nbytes != expected or unit != expected_unit:
            raise FormatError(f"{self.run.label}: payload of {record.name!r} (step {record.step}) has "
                              f"{units.nbytes} bytes of {layout.BLOB_UNITS[unit]}, its {record.dtype} shape needs "
                              f"{expected} of {layout.BLOB_UNITS[expected_unit]}; the recording is damaged")
        return payload_mod.from_units(units, dtype, record.shape)
