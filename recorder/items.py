"""What the training thread hands to the writer thread: snapshots, never live objects it may change."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class PayloadItem:
    """Bytes of one tensor. ``key`` is known for the bytes hashed on the training thread (CPU
    parameters and buffers, so that repeats are never copied); the others are named by ``token``
    until the writer thread has hashed them: a CPU copy in ``data``, or, for device tensors, an
    in-flight copy in ``pinned``."""

    key: tuple[int, int, int] | None
    unit: int
    data: np.ndarray | None = None
    buffer: np.ndarray | None = None  # the StagingPool buffer ``data`` lives in, returned once written
    pinned: torch.Tensor | None = None
    event: Any = None
    token: int = -1

    @property
    def nbytes(self) -> int:
        if self.buffer is not None:
            return int(self.buffer.nbytes)
        if self.data is not None:
            return int(self.data.nbytes)
        return int(self.pinned.numel()) if self.pinned is not None else 0


@dataclass(slots=True)
class TensorItem:
    role: int
    name: str
    dtype: str
    device: str
    requires_grad: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    stats: Any  # tuple of 8 floats, or a device tensor of 8
    # A content key, a token (bytes the writer hashes), or None (statistics only).
    payload: tuple[int, int, int] | int | None
    # The iteration in which the tensor was captured, under which the flight ring holds its bytes:
    # the step's own, except after an optimizer step inside the step's call (the next one).
    held: int


@dataclass
class StepItem:
    index: int
    row: dict[str, Any]  # integer/float columns known on the training thread
    docs: dict[str, Any]  # name, definition, module_path, module, settings, args, output -> JSON or None
    rng: dict[str, tuple[Any, Any]]
    tensors: list[TensorItem]
    exception: dict[str, Any] | None = None
    expectations: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)  # from user checks and breakpoints
    collectives: list[dict[str, Any]] = field(default_factory=list)  # torch.distributed calls inside the step
    vmap: dict[str, list[int]] | None = None  # record name -> its vmap batch dims (recorder.transforms)
    vmap_randomness: list[str] | None = None  # each vmap level's randomness, innermost first (recorder.transforms)
    own_grads: list[str] = field(default_factory=list)  # parameter grads that are the call's own (not totals)
    arguments: dict[str, Any] | None = None  # "aliases", "parameter_args", "misaligned" (capture.Frame.arguments)


@dataclass
class ForgetIterations:
    """Flight mode: these iterations left the ring unwritten; their records keep statistics only."""

    iterations: list[int]


DUMPS_KEPT = 256  # flight mode: ring writes listed in the run's metadata, first and last each


def log_ring_write(dumps: list[dict[str, Any]], dump: dict[str, Any]) -> None:
    """List a write-out of the flight ring in ``dumps`` (the run's ``flight.dumps``). A run whose every
    iteration is anomalous writes the ring at every iteration: the first and the last ``DUMPS_KEPT``
    writes are listed, the ones between are summed up in one entry between them (reason ``"omitted"``)."""
    if len(dumps) < 2 * DUMPS_KEPT:
        dumps.append(dump)
        return
    if dumps[DUMPS_KEPT]["reason"] != "omitted":
        gone = dumps[DUMPS_KEPT]
        dumps[DUMPS_KEPT] = {"reason": "omitted", "dumps": 1, "bytes": gone["bytes"],
                             "first_iteration": gone["iterations"][0], "last_iteration": gone["iterations"][-1]}
    else:
        summary, gone = dumps[DUMPS_KEPT], dumps.pop(DUMPS_KEPT + 1)
        summary["dumps"] += 1
        summary["bytes"] += gone["bytes"]
        summary["last_iteration"] = gone["iterations"][-1]
    dumps.append(dump)


@dataclass
class RingWritten:
    """Flight mode: the ring was written out (``dump``, an entry of ``flight.dumps``). Sent before the
    bytes it writes; the writer lists it in the run's ``info``, committed with each manifest, so that
    the run still names the iterations it kept when its process dies before closing it (``pdbg record``'s
    parent then closes it with what was committed: recorder.recover)."""

    dump: dict[str, Any]

    def add_to(self, info: dict) -> None:
        log_ring_write(info.setdefault("flight", {}).setdefault("dumps", []), dict(self.dump))


SKIPS_KEY = "grad_scaler_skipped"  # in the run's final attributes and its manifest's info (docs/FORMAT.md)
SKIPS_LISTED = 1024  # skipped iterations listed whatever their scale; past that, those at a scale above 1


@dataclass
class ScalerSkip:
    """GradScaler skipped the optimizer step ending ``iteration`` at loss ``scale``. The writer lists
    it in the run's ``info`` (committed with each manifest, so that a run killed before it closed
    still says which overflows its scaler handled; ``final`` at the end)."""

    iteration: int
    scale: float | None

    def add_to(self, info: dict) -> None:
        """Count it in ``info[SKIPS_KEY]`` and list it: the first SKIPS_LISTED of any scale, and every
        one bisect passes over (at a scale above 1: about one per growth interval of the scaler)."""
        doc = info.setdefault(SKIPS_KEY, {"count": 0, "iterations": [], "scales": []})
        doc["count"] += 1
        if len(doc["iterations"]) < SKIPS_LISTED or self.scale is None or self.scale > 1.0:
            doc["iterations"].append(self.iteration)
            doc["scales"].append(self.scale)


OBJECTS_KEY = "module_objects"  # in the run's final attributes and its manifest's info (docs/FORMAT.md, 1.16)
OBJECTS_LISTED = 256  # module objects listed per place; past that, only counted


class ModuleObjects:
    """The writer's account of the module objects each step ran as (the skeleton's ``instance``), so
    that readers can say which object ran a call where several ran as one step at one module path (a
    student and its EMA teacher, deep copies of one class). Only such places are listed in the run's
    ``info`` (``{"name", "module_path", "instances", "count"}``, committed with each manifest): a
    reader then tells one step's object from its own documents, without reading a column whole."""

    def __init__(self) -> None:
        self._seen: set[int] = set()  # module document ids already accounted for
        self._places: dict[tuple[str, str], dict[str, Any]] = {}  # (step name, module path) -> its entry
        self._last: dict[tuple[str, str], int] = {}  # the highest instance seen there

    def note(self, info: dict, module_doc_id: int, docs: dict[str, Any]) -> None:
        """Account for a step's module document (a few per module object: once each)."""
        if module_doc_id in self._seen:
            return
        self._seen.add(module_doc_id)
        module = docs.get("module")
        instance = module.get("instance") if isinstance(module, dict) else None
        if not isinstance(instance, int):
            return
        place = (str(docs.get("name")), str(docs.get("module_path") or ""))
        entry = self._places.get(place)
        if entry is None:
            self._places[place] = {"name": place[0], "module_path": place[1], "instances": [instance], "count": 1}
            self._last[place] = instance
            return
        # Instances are numbered in the order first called: one above the highest seen is a new object (past
        # the listed ones, an object's other documents, a later state of its skeleton, are not counted again)
        if instance in entry["instances"] or instance <= self._last[place] and entry["count"] > OBJECTS_LISTED:
            return
        self._last[place] = max(self._last[place], instance)
        entry["count"] += 1
        if len(entry["instances"]) < OBJECTS_LISTED:
            entry["instances"].append(instance)
        if entry["count"] == 2:
            info.setdefault(OBJECTS_KEY, []).append(entry)  # the same dict: the listing follows it as it grows


ALIGN = 64  # bytes: torch's CPU allocator's alignment
ALIGNED_FROM = 16 << 10  # bytes: from this size the statistics kernel's copy uses nontemporal stores (recorder.kernels)


def copy_buffer(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of ``nbytes`` to copy a payload into. From ``ALIGNED_FROM`` bytes
    it starts at a multiple of ``ALIGN`` bytes: the statistics kernel copies large arrays with
    nontemporal stores, which need 32 (into an unaligned buffer it uses ordinary stores, ~1.5x
    slower), and numpy's own allocations are only 16-byte aligned. Those are allocated by torch, as
    training's own tensors are: a buffer of another size or alignment than theirs leaves holes in
    the heap that training then grows it around (page faults at every step)."""
    if nbytes < ALIGNED_FROM:
        return np.empty(nbytes, dtype=np.uint8)  # (~0.2 us against ~1.4 through torch)
    try:  # (the device given: the user's default device may be another; a mode they run under may refuse)
        raw = torch.empty(nbytes, dtype=torch.uint8, device="cpu").numpy()  # (its base keeps the tensor alive)
    except Exception:
        raw = None
    if raw is None or raw.ctypes.data % ALIGN:  # an allocator other than torch's own
        raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
        at = -raw.ctypes.data % ALIGN
        raw = raw[at:at + nbytes]
    return raw


class StagingPool:
    """Reusable host buffers for payload copies, handed from the training thread to the writer.

    Copying into freshly allocated memory ran at ~1.6 GB/s here (every large allocation is new pages
    from the kernel), into reused buffers at ~10 GB/s; for ~90 MB of new tensor bytes per iteration
    that is ~50 ms of the training thread's time. Buffers come in power-of-two sizes from 64 KiB;
    at most ``keep_bytes`` of free buffers are kept. Each starts at a multiple of ``ALIGN`` bytes.
    """

    MIN_BYTES = 64 << 10

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray | None:
        """A uint8 buffer of at least ``nbytes``; None for small sizes (allocate those directly)."""
        if nbytes < self.MIN_BYTES:
            return None
        size = 1 << (nbytes - 1).bit_length()
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                self._free_bytes -= size
                return bucket.pop()
        return copy_buffer(size)

    @property
    def free_bytes(self) -> int:
        """Bytes of the buffers kept for reuse."""
        return self._free_bytes

    def release(self) -> None:
        """The recording is over: drop the buffers kept for reuse, and keep none given back from now
        on. A closed recording's ``Run`` stays with whoever holds it (a framework callback keeps its
        last one), and its pool would otherwise keep up to ``keep_bytes`` of memory with it."""
        with self._lock:
            self._free.clear()
            self._free_bytes = 0
            self.keep_bytes = 0

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer once its bytes have been written."""
        with self._lock:
            if self._free_bytes + buf.nbytes <= self.keep_bytes:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._free_bytes += buf.nbytes
