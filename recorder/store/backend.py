"""Where a recording's bytes go: a directory, memory (for tests), a read-only zip, or a URL
(``s3://bucket/run.zarr``, or any fsspec filesystem's).

Zarr stores do the storage; this module adds the two things the recorder needs beyond them: writing
a pre-encoded chunk with one call (no per-call codec pipeline), and an atomic, durable write for the
manifest (temporary file, fsync, rename), which is what makes a killed recording safe to open. An
object store has no rename, but each PUT is atomic per object (a reader sees the old object or the
new one, never a torn one) and ``put`` returns once the store holds it, so the same order (chunks
first, manifest last) keeps a killed recording safe there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from zarr.abc.store import ByteRequest, Store
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, MemoryStore, ZipStore

from ..errors import NotARecordingError, PdbgError, RecordingError

StoreTarget = str | os.PathLike[str] | Store
T = TypeVar("T")

# fsspec options for URLs opened without ``storage_options`` (``pdbg`` on the command line): a JSON object.
STORAGE_OPTIONS_ENV = "PDBG_STORAGE_OPTIONS"
# Longest one read or write of a remote store may take: a payload chunk is at most a few MiB.
REMOTE_TIMEOUT_S = 60.0
# A remote call that failed after this long (timeouts, retries against an endpoint that is gone)
# marks the store as not answering: later calls fail at once, so closing a recording whose store
# went away costs one timeout, not one per file.
BROKEN_AFTER_S = 1.0
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(::[A-Za-z][A-Za-z0-9+.-]*)*://")


def is_url(target: Any) -> bool:
    """Whether a target is a URL opened through fsspec (any scheme but ``file://``)."""
    return isinstance(target, str) and _URL.match(target) is not None and not target.lower().startswith("file://")


def local_path(target: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """A path, with a ``file://`` prefix removed."""
    if isinstance(target, str) and target.lower().startswith("file://"):
        return target[len("file://"):]
    return target


def open_store(target: StoreTarget, *, mode: str, storage_options: dict[str, Any] | None = None) -> Store:
    """Open a store for reading (``mode="r"``) or create one for writing (``mode="w"``).

    Args:
        target: a directory path, a ``.zip``/``.pdbg`` file (read only), a URL (``s3://bucket/run.zarr``)
            or a zarr Store object.
        mode: "r" or "w".
        storage_options: a URL's fsspec options (credentials, ``client_kwargs={"endpoint_url": ...}``);
            when None, the JSON object in ``$PDBG_STORAGE_OPTIONS``, if set.
    Raises RecordingError (``mode="w"``) or NotARecordingError (``mode="r"``) for a URL that cannot be used.
    """
    error = RecordingError if mode == "w" else NotARecordingError
    if is_url(target):
        return _open_url(str(target), mode, resolve_storage_options(storage_options, error), error)
    if storage_options is not None:
        raise error(f"storage_options apply to URLs (s3://bucket/run.zarr), not to {describe(target)}; "
                    "leave them out")
    if isinstance(target, Store):
        return target
    path = Path(local_path(target))
    if mode == "r" and path.is_file():
        from .zipcheck import check_zip

        check_zip(path)  # before zarr sees it: a bundle may come from anyone
        store = ZipStore(path, mode="r")
        sync(store._ensure_open())  # zarr opens zips lazily; plain key reads need it open
        return store
    if mode == "w":
        path.mkdir(parents=True, exist_ok=True)
        return LocalStore(path, read_only=False)
    return _ReadStore(path, read_only=True)


# A recording directory may come from anyone: what a read takes is bounded. JSON documents (zarr.json,
# the manifests, recipes) stay far below the first limit, payload and index chunks below the second.
MAX_JSON_BYTES = 64 << 20
MAX_KEY_BYTES = 1 << 30


class UnreadableKey(OSError):
    """A key that is not a regular file of a readable size (a FIFO, a device, a sparse giant)."""


def check_readable(path: Path, key: str) -> None:
    """Refuse, before reading, a key that is not a regular file (a FIFO blocks the read, a link to
    /dev/zero never ends it) or that is larger than any key of a recording."""
    st = os.stat(path)  # (follows links: what a read would read)
    if not stat.S_ISREG(st.st_mode):
        raise UnreadableKey(f"{key} is not a regular file")
    limit = MAX_JSON_BYTES if key.endswith(".json") else MAX_KEY_BYTES
    if st.st_size > limit:
        raise UnreadableKey(f"{key} holds {st.st_size:,} bytes, more than any recording's ({limit:,} at most)")


class _ReadStore(LocalStore):
    """A local recording opened for reading: every key is checked before it is read (see
    ``check_readable``); zarr's own reads of metadata and chunks go through here too."""

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        try:
            check_readable(Path(self.root) / key, key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return await super().get(key, prototype, byte_range)


def resolve_storage_options(given: dict[str, Any] | None,
                            error: type[PdbgError] = NotARecordingError) -> dict[str, Any]:
    """The fsspec options of a URL: those given, else ``$PDBG_STORAGE_OPTIONS`` (a JSON object), else none."""
    if given is not None:
        if not isinstance(given, dict):
            raise error(f"storage_options must be a dict of fsspec options, not {type(given).__name__}")
        return dict(given)
    raw = os.environ.get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except ValueError as exc:
        raise error(f"{STORAGE_OPTIONS_ENV} is not valid JSON ({exc}); set it to a JSON object, e.g. "
                    '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'') from None
    if not isinstance(options, dict):
        raise error(f"{STORAGE_OPTIONS_ENV} must hold a JSON object of fsspec options, not "
                    f"{type(options).__name__}")
    return options


class RemoteStore(FsspecStore):
    """A zarr FsspecStore whose calls end within ``REMOTE_TIMEOUT_S`` and fail as OSErrors naming the
    URL, whatever the filesystem raised (botocore's connection errors are not OSErrors): the writer's
    failure path and the reader's checks both catch OSError."""

    def __init__(self, fs: Any, read_only: bool = False, path: str = "/", **kwargs: Any) -> None:
        super().__init__(fs, read_only=read_only, path=path, **kwargs)
        protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        self.url = f"{protocol}://{path}"
        self.broken: str | None = None  # why the store is taken as not answering

    async def _bounded(self, what: str, key: str, call: Awaitable[T]) -> T:
        if self.broken is not None:
            close = getattr(call, "close", None)
            if close is not None:
                close()  # never awaited: no "coroutine was never awaited" warning
            raise ConnectionError(f"{self.url}: {what} {key} not tried: the store stopped answering ({self.broken})")
        start = time.monotonic()
        try:
            return await asyncio.wait_for(call, REMOTE_TIMEOUT_S)
        except Exception as exc:
            took = time.monotonic() - start
            if isinstance(exc, TimeoutError) and took >= REMOTE_TIMEOUT_S:  # ours (asyncio's is the builtin)
                self.broken = f"{what} {key} got no answer in {REMOTE_TIMEOUT_S:g} s"
                raise TimeoutError(f"{self.url}: {self.broken}") from None
            if took >= BROKEN_AFTER_S:
                self.broken = why(exc)
            if isinstance(exc, OSError):
                raise
            raise OSError(f"{self.url}: {what} {key} failed ({why(exc)})") from exc

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        return await self._bounded("reading", key, super().get(key, prototype, byte_range))

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        return await self._bounded("reading", "chunks", super().get_partial_values(prototype, key_ranges))

    async def set(self, key: str, value: Buffer, byte_range: tuple[int, int] | None = None) -> None:
        await self._bounded("writing", key, super().set(key, value, byte_range))

    async def exists(self, key: str) -> bool:
        return await self._bounded("looking up", key, super().exists(key))

    async def getsize(self, key: str) -> int:
        # s3fs answers from listings it cached (nbytes lists the run): a growing run's sizes would be stale.
        self.fs.invalidate_cache(f"{self.path}/{key}")
        return await self._bounded("looking up", key, super().getsize(key))

    async def delete(self, key: str) -> None:
        await self._bounded("deleting", key, super().delete(key))


def remote_nbytes(store: RemoteStore) -> int:
    """Bytes a remote recording holds (one listing of its objects)."""
    return int(sync(store._bounded("listing", "", store.fs._du(store.path, total=True))))


def _open_url(url: str, mode: str, options: dict[str, Any], error: type[PdbgError]) -> RemoteStore:
    """A URL's store, checked at once: a wrong bucket, credentials or endpoint are reported here, in
    one line saying what to do, rather than at the first write on the writer thread."""
    try:
        store = RemoteStore.from_url(url, storage_options=options, read_only=(mode == "r"))
    except ImportError as exc:  # fsspec names the package: "Install s3fs to access S3"
        raise error(f"{url}: cannot open {url.split('://')[0]}:// URLs: {exc}; for s3:// install "
                    "paperdebugger[s3] (pip install s3fs)") from None
    except Exception as exc:  # an unknown protocol, an option the filesystem does not take
        raise error(f"{url}: cannot open this URL ({why(exc)}); check the URL and its storage options") from None
    assert isinstance(store, RemoteStore)
    store.url = url
    sync(store._ensure_open())
    try:
        root_meta = get(store, "zarr.json")
        bucket_found = True if root_meta is not None else _bucket_exists(store)
    except OSError as exc:
        raise error(f"{url}: {remote_problem(exc)}") from None
    if not bucket_found:
        bucket = store.path.split("/")[0]
        raise error(f"{url}: bucket {bucket!r} does not exist; create it, or give a URL in an existing bucket")
    if mode == "w" and root_meta is not None:
        raise error(f"{url} already holds a zarr hierarchy; record into a new, empty URL or delete it")
    if mode == "r" and root_meta is None:
        raise error(f"{url}: no recording there (no zarr.json); give the URL of a recording (made by "
                    "recorder.record or `pdbg record`)")
    return store


def _bucket_exists(store: RemoteStore) -> bool:
    """Whether the bucket (the first part of the path) exists, on a filesystem that has buckets
    (s3fs, gcsfs, adlfs split paths into bucket and key); True elsewhere."""
    if getattr(store.fs, "split_path", None) is None:
        return True
    bucket = store.path.split("/")[0]
    return bool(sync(store._bounded("looking up", f"bucket {bucket}", store.fs._exists(bucket))))


def remote_problem(exc: BaseException) -> str:
    """What a failed remote call means, and what to do, as a phrase."""
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else None
    detail = why(cause or exc)  # what the filesystem said, without the URL our own messages start with
    detail = re.sub(r"^(\w+: )[^ ]+://[^ ]*: ", r"\1", detail)
    if isinstance(exc, PermissionError):
        return (f"access denied ({detail}); check the credentials (storage_options key and secret, or "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY) and that they may use this bucket")
    if isinstance(exc, FileNotFoundError):
        return f"not found ({detail}); check the URL"
    return (f"the store did not answer ({detail}); check the endpoint (storage_options client_kwargs "
            "endpoint_url, or AWS_ENDPOINT_URL) and the network")


def why(exc: BaseException) -> str:
    """An exception as a short phrase for a one-line message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def local_root(store: Store) -> Path | None:
    """The directory behind a LocalStore, else None."""
    return Path(store.root) if isinstance(store, LocalStore) else None


def put(store: Store, key: str, data: bytes, *, durable: bool = False, spare: bool = False) -> None:
    """Write one key. Local files go through a temporary file and an atomic rename so a reader or a
    crash sees either the old bytes or the new ones, never a torn write.

    Files of ``SYNC_BYTES`` or more (payload chunks) are synced to disk before the rename and then
    dropped from the page cache: a recording writes gigabytes nobody reads back soon, and keeping
    them cached costs the training process memory (and, measured on virtual machines, ~6x more CPU
    per byte written). ``durable=True`` syncs any file and its directory, so the rename itself
    survives a power loss (the manifest). Smaller files rely on write order, which a killed process
    cannot break.

    ``spare=True``, for a small key written again and again (the partial last chunk of a growing
    array): the previous version is kept as the temporary file and overwritten the next time, then
    swapped in atomically (``renameat2(RENAME_EXCHANGE)``). Making, filling and freeing a new file
    costs ~10x more CPU than overwriting one that exists (measured on ext4: 0.2 ms against 0.02 ms
    per write); an index commit writes dozens. The spare stays next to the key until a write without
    ``spare`` (or ``remove_partials``) takes it. Where the filesystem cannot exchange two names, this
    is a plain write.
    """
    root = local_root(store)
    if root is None:
        sync(store.set(key, default_buffer_prototype().buffer.from_bytes(data)))
        return
    path = os.path.join(root, key)
    tmp = path + ".partial"
    reuse = spare and not durable and len(data) < SYNC_BYTES and _exchange is not None
    flags = os.O_WRONLY | os.O_CREAT | (0 if reuse else os.O_TRUNC)
    try:
        fd = os.open(tmp, flags, 0o644)
    except FileNotFoundError:
        if not os.path.isdir(root):  # deleted under the writer: not made again (its chunks would be missing)
            raise FileNotFoundError(errno.ENOENT, "the recording's directory is gone", str(root)) from None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, flags, 0o644)
    try:
        view, at = memoryview(data), 0
        while at < len(view):
            at += os.pwrite(fd, view[at:], at)
        if reuse:
            os.ftruncate(fd, len(data))  # a shorter version than the spare's
        if durable or len(data) >= SYNC_BYTES:
            _datasync(fd)
        if _FADVISE and len(data) >= SYNC_BYTES:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if not (reuse and _exchange(tmp, path)):
        os.replace(tmp, path)
    if durable:
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def put_new(store: Store, key: str, data: bytes) -> bool:
    """Write ``key`` only if it does not exist; False (nothing written) when it does. On a local
    store the check and the write are one step (a hard link, which fails when the name exists): of
    two processes claiming one store at the same moment, one wins."""
    root = local_root(store)
    if root is None:  # an object store has no exclusive create here: checked, then written
        if get(store, key) is not None:
            return False
        put(store, key, data)
        return True
    path = os.path.join(root, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.claim"
    with open(tmp, "wb") as f:
        f.write(data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


def drop_spare(store: Store, key: str) -> None:
    """Remove the spare a ``put(spare=True)`` of ``key`` kept, if there is one."""
    root = local_root(store)
    if root is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(root, key) + ".partial")


def _exchanger() -> Any:
    """``exchange(a, b)``: swap two existing paths atomically; False when it cannot (``b`` does not
    exist yet, or the filesystem does not support it: then it is not tried again on that one). None
    where the C library has no renameat2 (not Linux, or glibc older than 2.28)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    unsupported: set[int] = set()  # st_dev of filesystems that refused an exchange

    def exchange(a: str, b: str) -> bool:
        if unsupported and os.stat(a).st_dev in unsupported:
            return False
        if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return True
        if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            unsupported.add(os.stat(a).st_dev)
        return False  # also ENOENT, the first version of the key: a plain rename then

    return exchange


_exchange = _exchanger()


SYNC_BYTES = 256 << 10
_FADVISE = hasattr(os, "posix_fadvise")
_datasync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync


def get(store: Store, key: str) -> bytes | None:
    """Read one key, or None when it does not exist."""
    root = local_root(store)
    if root is not None:
        try:
            if isinstance(store, _ReadStore):
                check_readable(root / key, key)
            return (root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
    buf = sync(store.get(key, prototype=default_buffer_prototype()))
    return None if buf is None else buf.to_bytes()


def remove_partials(store: Store, prefix: str, *, top: bool = False) -> int:
    """Delete ``*.partial`` leftovers of a killed writer under ``prefix`` (and, with ``top``, those
    of the root's own files); returns how many were removed. Only a rank's own files: another rank
    may be writing its own next to it."""
    root = local_root(store)
    if root is None or store.read_only:
        return 0
    found = [*(root / prefix).rglob("*.partial"), *(root.glob("*.partial") if top else [])]
    for tmp in found:
        tmp.unlink(missing_ok=True)
    return len(found)


def describe(target: Any) -> str:
    """How to name a store target in a message."""
    if isinstance(target, MemoryStore):
        return "<memory store>"
    if isinstance(target, RemoteStore):
        return target.url
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
