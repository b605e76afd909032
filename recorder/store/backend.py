"""Where a recording's bytes go: a directory, memory (for tests) or a read-only zip.

Zarr stores do the storage; this module adds the two things the recorder needs beyond them: writing
a pre-encoded chunk with one call (no per-call codec pipeline), and an atomic, durable write for the
manifest (temporary file, fsync, rename), which is what makes a killed recording safe to open.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import LocalStore, MemoryStore, ZipStore

StoreTarget = str | os.PathLike[str] | Store


def open_store(target: StoreTarget, *, mode: str) -> Store:
    """Open a store for reading (``mode="r"``) or create one for writing (``mode="w"``).

    Args:
        target: a directory path, a ``.zip``/``.pdbg`` file (read only), or a zarr Store object.
        mode: "r" or "w".
    """
    if isinstance(target, Store):
        return target
    path = Path(target)
    if mode == "r" and path.is_file():
        from .zipcheck import check_zip

        check_zip(path)  # before zarr sees it: a bundle may come from anyone
        store = ZipStore(path, mode="r")
        sync(store._ensure_open())  # zarr opens zips lazily; plain key reads need it open
        return store
    if mode == "w":
        path.mkdir(parents=True, exist_ok=True)
    return LocalStore(path, read_only=(mode == "r"))


def local_root(store: Store) -> Path | None:
    """The directory behind a LocalStore, else None."""
    return Path(store.root) if isinstance(store, LocalStore) else None


def put(store: Store, key: str, data: bytes, *, durable: bool = False) -> None:
    """Write one key. Local files go through a temporary file and ``os.replace`` so a reader or a
    crash sees either the old bytes or the new ones, never a torn write.

    Files of ``SYNC_BYTES`` or more (payload chunks) are synced to disk before the rename and then
    dropped from the page cache: a recording writes gigabytes nobody reads back soon, and keeping
    them cached costs the training process memory (and, measured on virtual machines, ~6x more CPU
    per byte written). ``durable=True`` syncs any file and its directory, so the rename itself
    survives a power loss (the manifest). Smaller files rely on write order, which a killed process
    cannot break.
    """
    root = local_root(store)
    if root is None:
        sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))
        return
    path = root / key
    tmp = path.with_name(path.name + ".partial")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable or len(data) >= SYNC_BYTES:
            _datasync(fd)
        if _FADVISE and len(data) >= SYNC_BYTES:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


SYNC_BYTES = 256 << 10
_FADVISE = hasattr(os, "posix_fadvise")
_datasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


def get(store: Store, key: str) -> bytes | None:
    """Read one key, or None when it does not exist."""
    root = local_root(store)
    if root is not None:
        try:
            return (root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
    buf = sync(store.get(key, prototype=default_buffer_prototype()))
    return None if buf is None else buf.to_bytes()


def remove_partials(store: Store) -> int:
    """Delete ``*.partial`` leftovers of a killed writer; returns how many were removed."""
    root = local_root(store)
    if root is None or store.read_only:
        return 0
    removed = 0
    for tmp in root.rglob("*.partial"):
        tmp.unlink(missing_ok=True)
        removed += 1
    return removed


def describe(target: Any) -> str:
    """How to name a store target in a message."""
    if isinstance(target, MemoryStore):
        return "<memory store>"
    if isinstance(target, Store):
        return f"<{type(target).__name__}>"
    return str(target)


def boot_id() -> str | None:
    """Identifies this boot of this machine, so a reader can tell a dead writer from a live one."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When a process started (clock ticks since boot), so a reused pid is not taken for the writer."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces or parentheses: count fields after its last ")".
    return int(stat.rsplit(")", 1)[1].split()[19])
