"""The flight ring's bytes in shared memory, so that they outlive a hard crash of the recording process.

``pdbg record --mode flight`` runs the script in a child process (recorder.supervise). The parent
creates this memory (``create``): an anonymous memfd on Linux, else a file in ``$PDBG_RING_DIR``,
/dev/shm or the temp directory, unlinked at once. Either way no name is left to leak: the memory goes
when the last of the two processes closes it. The child maps it (``SharedRing``) and copies ring
payloads straight into it (the copy the in-process ring makes into StagingPool buffers, made into this
memory instead), with a journal beside them: which payloads are held (content key, offset, length)
and which tensor records the writer thread wrote wait for which of them. When the child dies without
closing its recording, the parent reads the journal (``read_journal``) and writes the held bytes out
(recorder.recover).

Layout (little endian; tables 64-byte aligned, the data region page aligned)::

    header  magic, version, capacities, data offset and size, oldest iteration held, counters
    slots   one per held payload: state, unit, offset, nbytes, hash high, hash low  (training thread)
    rows    one per waiting record: state, unit, tensor row, iteration, hash high, hash low  (writer)
    data    payload bytes, in power-of-two blocks (a buddy allocator, lowest addresses first, so the
            pages touched stay close to the bytes held)

An entry is written field by field and published by its state byte last (cleared first when it is
freed): a process killed between two stores leaves no half-written entry that reads as held. The
parent trusts nothing more than that: it hashes every payload before writing it out.
"""

from __future__ import annotations

import contextlib
import heapq
import mmap
import os
import tempfile
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import payload as payload_mod

MAGIC = b"PDBGRNG1"
RING_DIR_ENV = "PDBG_RING_DIR"  # put the ring in a file there instead of anonymous memory (tests, other systems)
_PAGE = 4096
_MIN_ORDER = 8  # smallest block: 256 bytes (aligned for every unit)
_SLOTS = _ROWS = 1 << 20  # entries: sparse, only the pages of entries used cost memory
_HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("pid", "<i4"), ("slot_cap", "<u8"), ("row_cap", "<u8"),
                    ("data_off", "<u8"), ("data_size", "<u8"), ("oldest", "<i8"), ("unshared", "<u8"),
                    ("lost_slots", "<u8"), ("lost_rows", "<u8")])
_SLOT_FIELDS = (("state", "u1"), ("unit", "u1"), ("offset", "<u8"), ("nbytes", "<u8"), ("hi", "<u8"), ("lo", "<u8"))
_ROW_FIELDS = (("state", "u1"), ("unit", "u1"), ("tensor", "<i8"), ("iteration", "<i8"), ("hi", "<u8"), ("lo", "<u8"))


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _tables(slot_cap: int, row_cap: int) -> tuple[dict[str, tuple[int, str, int]], int]:
    """Offsets of every table column ((offset, dtype, length) by "slots/state"...), and of the data."""
    out, pos = {}, _PAGE
    for table, fields, cap in (("slots", _SLOT_FIELDS, slot_cap), ("rows", _ROW_FIELDS, row_cap)):
        for name, dtype in fields:
            out[f"{table}/{name}"] = (pos, dtype, cap)
            pos = _align(pos + cap * np.dtype(dtype).itemsize, 64)
    return out, _align(pos, _PAGE)


@dataclass
class RingFile:
    """The parent's handle on the shared memory: an open file descriptor (no name in any directory)."""

    fd: int
    size: int
    where: str  # "memfd", or the directory of the (unlinked) file

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create(max_ring_bytes: int) -> RingFile:
    """Shared memory for a ring bounded by ``max_ring_bytes``: a sparse file, its data region four
    times the ring's bound rounded up to a power of two (blocks are powers of two, and bytes written
    out wait for their commit beside a ring filling again); only pages touched cost memory.

    Raises OSError (no shared memory to be had) or ValueError."""
    if not isinstance(max_ring_bytes, int) or max_ring_bytes < 1:
        raise ValueError(f"max_ring_bytes must be a positive integer, not {max_ring_bytes!r}")
    data_size = 1 << (4 * max(max_ring_bytes, 1 << 20) - 1).bit_length()
    tables, data_off = _tables(_SLOTS, _ROWS)
    directory = os.environ.get(RING_DIR_ENV)
    if directory is None and hasattr(os, "memfd_create"):
        fd, where = os.memfd_create("pdbg-flight-ring", os.MFD_CLOEXEC), "memfd"
    else:
        fd, where, data_size = _unlinked_file(directory, data_off, data_size)
    try:
        os.ftruncate(fd, data_off + data_size)
        header = np.zeros(1, dtype=_HEADER)
        header[0] = (MAGIC, 1, 0, _SLOTS, _ROWS, data_off, data_size, -1, 0, 0, 0)
        os.pwrite(fd, header.tobytes(), 0)
    except BaseException:
        os.close(fd)
        raise
    return RingFile(fd, data_off + data_size, where)


def _unlinked_file(directory: str | None, data_off: int, data_size: int) -> tuple[int, str, int]:
    """A file in ``directory`` (default /dev/shm, else the temp directory), unlinked at once. A file
    system cannot give more than it has free (writing past it would be a SIGBUS in the training
    process): the data region is cut to a power of two within half of the free space."""
    if directory is None:
        directory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        directory = directory or tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="pdbg-ring-", dir=directory)
    os.unlink(path)
    try:
        stats = os.fstatvfs(fd)
        free = stats.f_bavail * stats.f_frsize // 2 - data_off
        if free < 1 << 20:
            raise OSError(f"{directory} has too little free space for the flight ring")
        data_size = min(data_size, 1 << (free.bit_length() - 1))
    except BaseException:
        os.close(fd)
        raise
    return fd, directory, data_size


def _views(buf: Any) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """The header, the table columns and the data region of a mapped ring."""
    whole = np.frombuffer(buf, dtype=np.uint8)
    header = whole[:_HEADER.itemsize].view(_HEADER)
    if bytes(header["magic"][0]) != MAGIC or int(header["version"][0]) != 1:
        raise ValueError("not a PaperDebugger flight ring (bad magic or version)")
    tables, data_off = _tables(int(header["slot_cap"][0]), int(header["row_cap"][0]))
    size = int(header["data_size"][0])
    if int(header["data_off"][0]) != data_off or data_off + size > len(whole):
        raise ValueError("the flight ring's header does not match its size")
    cols = {name: whole[off:off + cap * np.dtype(dt).itemsize].view(dt) for name, (off, dt, cap) in tables.items()}
    return header, cols, whole[data_off:data_off + size]


class SharedRing:
    """The child's side: buffers for ring payloads in shared memory, and the journal about them.

    Used as the pipeline's staging pool in flight mode (``take``/``give``, as StagingPool), plus
    ``publish`` (the training thread: these bytes, under this content key, are held) and ``wait``/
    ``done`` (the writer thread: this tensor row waits for that content). ``give`` only queues the
    buffer (any thread, no lock): it is freed at the next ``take``. So the writer thread never waits
    for a lock the training thread holds, which a signal handler on that thread could keep forever.
    """

    shared = True

    def __init__(self, fd: int) -> None:
        """Map the ring the parent made (raises OSError or ValueError when that fails)."""
        self._mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.header, self._cols, self.data = _views(self._mm)
        self.header["pid"] = os.getpid()
        self._lock = threading.RLock()  # reentrant: a signal handler may run on a thread inside take()
        self._returned: deque[np.ndarray] = deque()
        self._blocks: dict[int, tuple[int, int, int]] = {}  # id(buffer) -> (offset, order, slot or -1)
        self._top = len(self.data).bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self._top + 1)]
        self._heap: list[list[int]] = [[] for _ in range(self._top + 1)]
        self._push(self._top, 0)
        self._slot_next, self._slot_free = 0, []  # entries never used start at _next; freed ones are reused
        self._row_next, self._row_free = 0, []
        self._row_of: dict[int, int] = {}  # tensor row -> its entry (writer thread only)
        self.unshared = 0  # payloads that found no room here (held in process memory instead)

    # -- training thread: buffers -------------------------------------------------------------------
    def take(self, nbytes: int) -> np.ndarray | None:
        """A uint8 buffer of exactly ``nbytes`` in shared memory; None when there is no room (the
        caller copies into process memory instead) or for no bytes."""
        if nbytes <= 0:
            return None
        order = max(_MIN_ORDER, (nbytes - 1).bit_length())
        with self._lock:
            self._drain()
            offset = self._alloc(order) if order <= self._top else None
            if offset is None:
                self.unshared += 1
                self.header["unshared"] = self.unshared
                return None
            buf = self.data[offset:offset + nbytes]
            self._blocks[id(buf)] = (offset, order, -1)
        return buf

    def publish(self, buf: np.ndarray, key: tuple[int, int, int]) -> None:
        """Journal ``buf`` (filled) as held, holding the contents ``key`` (hash high, low, unit)."""
        with self._lock:
            entry = self._blocks.get(id(buf))
            if entry is None or entry[2] >= 0:
                return
            slot = self._new_entry("slot")
            if slot < 0:
                self.header["lost_slots"] += 1
                return
            cols = self._cols
            cols["slots/unit"][slot] = key[2]
            cols["slots/offset"][slot] = entry[0]
            cols["slots/nbytes"][slot] = buf.nbytes
            cols["slots/hi"][slot] = key[0]
            cols["slots/lo"][slot] = key[1]
            cols["slots/state"][slot] = 1  # published last
            self._blocks[id(buf)] = (entry[0], entry[1], slot)

    def give(self, buf: np.ndarray) -> None:
        """A buffer is no longer needed (any thread): freed at the next ``take``."""
        self._returned.append(buf)

    def release(self) -> None:
        """The recording is over (``StagingPool.release``): nothing to let go here. The ring is
        the supervisor's shared memory, mapped for the child's life; the parent reads what it
        holds after the child ends."""

    def held_from(self, iteration: int) -> None:
        """The ring holds no iteration before ``iteration`` any more (records of older ones are
        forgotten even if the writer thread has not been told yet)."""
        self.header["oldest"] = iteration

    def _drain(self) -> None:
        while self._returned:
            buf = self._returned.popleft()
            entry = self._blocks.pop(id(buf), None)
            if entry is None:
                continue
            offset, order, slot = entry
            if slot >= 0:
                self._cols["slots/state"][slot] = 0  # unpublished first
                self._slot_free.append(slot)
            self._release(offset, order)

    # -- writer thread: waiting records ---------------------------------------------------------------
    def wait(self, row: int, key: tuple[int, int, int], iteration: int) -> None:
        """Journal that tensor record ``row`` (of ``iteration``) waits for the contents ``key``."""
        i = self._new_entry("row")
        if i < 0:
            self.header["lost_rows"] += 1
            return
        cols = self._cols
        cols["rows/unit"][i] = key[2]
        cols["rows/tensor"][i] = row
        cols["rows/iteration"][i] = iteration
        cols["rows/hi"][i] = key[0]
        cols["rows/lo"][i] = key[1]
        cols["rows/state"][i] = 1
        self._row_of[row] = i

    def done(self, row: int) -> None:
        """Tensor record ``row`` waits no more (its late payload row is committed, or its iteration
        left the ring)."""
        i = self._row_of.pop(row, None)
        if i is not None:
            self._cols["rows/state"][i] = 0
            self._row_free.append(i)

    def _new_entry(self, table: str) -> int:
        if table == "slot":
            if self._slot_free:
                return self._slot_free.pop()
            if self._slot_next >= len(self._cols["slots/state"]):
                return -1
            self._slot_next += 1
            return self._slot_next - 1
        if self._row_free:
            return self._row_free.pop()
        if self._row_next >= len(self._cols["rows/state"]):
            return -1
        self._row_next += 1
        return self._row_next - 1

    # -- the buddy allocator ------------------------------------------------------------------------
    def _alloc(self, order: int) -> int | None:
        found = next((o for o in range(order, self._top + 1) if self._free[o]), None)
        if found is None:
            return None
        offset = self._pop(found)
        while found > order:  # split: keep the lower half, free the upper one
            found -= 1
            self._push(found, offset + (1 << found))
        return offset

    def _release(self, offset: int, order: int) -> None:
        while order < self._top:
            buddy = offset ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)  # its heap entry goes stale
            offset &= ~(1 << order)
            order += 1
        self._push(order, offset)

    def _push(self, order: int, offset: int) -> None:
        free, heap = self._free[order], self._heap[order]
        free.add(offset)
        heapq.heappush(heap, offset)
        if len(heap) > 4 * len(free) + 64:  # too many stale entries: rebuild
            heap[:] = sorted(free)

    def _pop(self, order: int) -> int:
        free, heap = self._free[order], self._heap[order]
        while True:
            offset = heapq.heappop(heap)
            if offset in free:
                free.remove(offset)
                return offset


@dataclass
class Journal:
    """What a dead child's ring held, read by the parent."""

    payloads: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)  # key -> units (views)
    rows: list[tuple[int, int, tuple[int, int, int]]] = field(default_factory=list)  # (tensor row, iteration, key)
    oldest: int = -1  # the oldest iteration the ring still held
    unshared: int = 0  # payloads the child held in its own memory (no room here): lost with it
    lost: int = 0  # payloads or records the journal had no room for
    bad: int = 0  # entries pointing outside the data region (never written by a sane child)


@contextlib.contextmanager
def read_journal(ring: RingFile) -> Iterator[Journal]:
    """The held payloads (views of the shared memory, valid inside the ``with``) and waiting rows."""
    mm = mmap.mmap(ring.fd, ring.size, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        header, cols, data = _views(mm)
        out = Journal(oldest=int(header["oldest"][0]), unshared=int(header["unshared"][0]),
                      lost=int(header["lost_slots"][0]) + int(header["lost_rows"][0]))
        for i in np.flatnonzero(cols["slots/state"] == 1):
            offset, nbytes, unit = (int(cols[f"slots/{n}"][i]) for n in ("offset", "nbytes", "unit"))
            if unit >= 4 or offset + nbytes > len(data) or nbytes % (1 << unit):
                out.bad += 1
                continue
            key = (int(cols["slots/hi"][i]), int(cols["slots/lo"][i]), unit)
            out.payloads[key] = payload_mod.units_of_bytes(data[offset:offset + nbytes], unit)
        for i in np.flatnonzero(cols["rows/state"] == 1):
            key = (int(cols["rows/hi"][i]), int(cols["rows/lo"][i]), int(cols["rows/unit"][i]))
            out.rows.append((int(cols["rows/tensor"][i]), int(cols["rows/iteration"][i]), key))
        out.rows.sort()
        yield out
        del out, header, cols, data
    finally:
        with contextlib.suppress(BufferError):  # views still held by the caller: closed when collected
            mm.close()
