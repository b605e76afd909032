"""Tensor bytes: exact conversion between any torch dtype and the store's unsigned-integer units.

numpy has no bfloat16, float8 or complex32, so payloads are stored as a view of same-width unsigned
integers and the true dtype is kept in the tensor record; the round trip is a reinterpretation of
bits, never a conversion of values.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import xxhash

# Element width in bytes -> store unit index (layout.BLOB_UNITS), and each unit's numpy dtype.
_UNIT_OF_WIDTH = {1: 0, 2: 1, 4: 2, 8: 3}
_NUMPY_UNIT = {0: np.uint8, 1: np.uint16, 2: np.uint32, 3: np.uint64}
_COMPLEX_COMPONENT = {torch.complex32: 2, torch.complex64: 4, torch.complex128: 8}
_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


class UnsupportedDtype(TypeError):
    """A dtype whose bytes are not a plain array of elements (quantized tensors)."""


def overlaps_itself(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a strided layout reaches one element from two indices (``expand``, ``unfold``): the
    strides, smallest first, do not each step past all that the smaller ones reach."""
    reach = 0  # the farthest element the smaller strides reach
    for s, n in sorted((s, n) for s, n in zip(stride, shape) if n > 1):
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # (a recording names one at every tensor record: each dtype's name is made once)
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def unit_of(dtype: torch.dtype) -> int:
    """The store unit that holds a dtype's bytes (complex numbers by their component width)."""
    if dtype in _QUANTIZED:
        raise UnsupportedDtype(f"quantized dtype {dtype_name(dtype)} has no plain byte layout")
    width = _COMPLEX_COMPONENT.get(dtype, dtype.itemsize)
    return _UNIT_OF_WIDTH[width]


def flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a 1-D tensor with unit stride: a view when its layout allows, else a copy.
    A conjugate or negative view (what ``z.conj()`` returns, lazily) is resolved into a copy: its
    memory does not hold its values."""
    out = t.detach()
    if out.is_conj() or out.is_neg():
        out = out.resolve_conj().resolve_neg()
    out = out.reshape(-1)
    if out.numel() and out.stride(0) != 1:  # size-1 or expanded dimensions: torch calls these contiguous
        out = out.clone(memory_format=torch.contiguous_format)  # recomputes strides
    return out


# Dtypes numpy has: a tensor of one is viewed directly (host_array).
_NUMPY_DTYPE = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
                torch.complex64: np.complex64, torch.complex128: np.complex128, torch.bool: np.bool_,
                torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
                torch.int64: np.int64}
_NUMPY_VIEWABLE = frozenset(_NUMPY_DTYPE)
_UNITS: dict[torch.dtype, int] = {dtype: unit_of(dtype) for dtype in _NUMPY_DTYPE}  # (as_units: a dtype's unit at once)


class _Memory(ctypes.c_char * (1 << 48)):
    """The bytes from a CPU tensor's data pointer on (as many as any tensor could reach; none is
    read but those an array made over it covers), for ``np.frombuffer``: the array's base, which
    keeps the tensor alive."""

    __slots__ = ("tensor",)


def materialized(t: torch.Tensor) -> torch.Tensor:
    """``t``, or where it is a ZeroTensor (``aten::_efficientzerotensor``: the gradient a backward formula passes
    on where it is zero by construction, ``sgn``'s, or a double backward's through ``abs``) the zeros it stands
    for, in memory of their own: it has none, and a read at its data pointer reads whatever lies there."""
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device) if t._is_zerotensor() else t


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values (a dtype numpy has) as a 1-D numpy array in element order: a view of
    its memory, or (strided) a copy when no view has that order. A conjugate or negative view comes
    back resolved, as a copy: ``z.conj()`` only flips a bit, so its memory does not hold its values.

    Not ``Tensor.numpy()``: it marks the tensor's storage non-resizable for good (even after the
    array is gone), and a torch.ao observer's ``resize_`` of its empty min_val/max_val buffers then
    failed, or left a buffer larger than its storage that the next read crashed the process on.
    Recording changes nothing of the user's tensors. (A view over the data pointer, through ctypes:
    ~0.4 us, numpy() ~0.5 us and a detach, ~1 us, of a tensor that requires grad.)

    That flag kept a tensor from being resized, so its memory freed, under a numpy view of it still
    in use. Without it, no view of user memory may be used once user code can run again. Checked:
    each use (statistics: stats.host_stats, stats.copy_stats; payloads: as_units, then in
    capture._cpu_payload the content hash and the copy) is done on the training thread before the
    step's capture returns; a payload that aliases the tensor's memory is copied before it goes to
    the writer thread, the flight ring or a shared ring (capture._copy_payload), and only the copy is
    hashed later or kept."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return _viewed(t)


def _viewed(t: torch.Tensor) -> np.ndarray:
    """``host_array`` of a tensor that is not a conjugate or negative view."""
    dtype = _NUMPY_DTYPE.get(t.dtype)
    if dtype is None or not t.is_cpu:  # (another layout has no data pointer: data_ptr() raises)
        raise TypeError(f"no numpy view of a {t.dtype} tensor on {t.device}")
    memory = _Memory.from_address(t.data_ptr())
    memory.tensor = t
    if t.is_contiguous():
        return np.frombuffer(memory, dtype, t.numel())
    size = t.element_size()
    return np.ndarray(t.shape, dtype, memory, 0, tuple(s * size for s in t.stride())).reshape(-1)


def wrapper(t: torch.Tensor) -> bool:
    """Whether ``t`` is a wrapper tensor subclass (``_make_wrapper_subclass``: a DTensor, a tensor that
    computes its values in ``__torch_dispatch__``), whose storage has no memory: a read at its data
    pointer reads whatever lies there, or crashes the process."""
    if not t.numel():
        return False
    try:
        return t.untyped_storage().data_ptr() == 0
    except RuntimeError:  # ("Attempted to access the data pointer on an invalid python storage")
        return True


def backed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every element its shape, strides and offset reach: a storage
    resized in place to fewer bytes (by FSDP's freeing, by a ``resize_`` that failed half-way)
    leaves a tensor that any read of crashes the process."""
    nbytes = t.nbytes
    if not nbytes:
        return True
    size = t.element_size()
    if not t.is_contiguous():
        nbytes = size * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
    return t.storage_offset() * size + nbytes <= t.untyped_storage().nbytes()


def as_units(t: torch.Tensor) -> tuple[np.ndarray, int, bool]:
    """A 1-D numpy array of a CPU tensor's bytes as store units.

    Returns (array, unit, aliases): when ``aliases`` is True the array shares ``t``'s memory (no copy
    was needed) and must be copied before ``t`` can change.
    """
    dtype = t.dtype
    unit = _UNITS.get(dtype)
    if unit is None:
        unit = unit_of(dtype)
    count = t.numel()
    if count == 0:
        return np.empty(0, dtype=_NUMPY_UNIT[unit]), unit, False
    numpy_dtype = _NUMPY_DTYPE.get(dtype)
    if numpy_dtype is not None and t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        # The common case (a contiguous tensor numpy has the dtype of), ``_viewed``'s without reading
        # the tensor's attributes again: a view of its memory, which aliases it.
        memory = _Memory.from_address(t.data_ptr())
        memory.tensor = t
        return np.frombuffer(memory, numpy_dtype, count).view(_NUMPY_UNIT[unit]), unit, True
    if dtype in _NUMPY_VIEWABLE and not (t.is_conj() or t.is_neg()):
        # No torch operation (each costs ~2-5 us of dispatch): the tensor's attributes, then numpy views.
        flat_a = _viewed(t)
        if not flat_a.flags.c_contiguous:  # a strided 1-D view (reshape leaves one as it is)
            flat_a = flat_a.copy()
        # (numpy makes a view's base the owner of its memory: the tensor's, or a copy's)
        return flat_a.view(_NUMPY_UNIT[unit]), unit, type(flat_a.base) is _Memory
    flat_t = flat(t)
    aliases = flat_t.data_ptr() == t.data_ptr()  # a copy has memory of its own
    # Through uint8 first: a direct view between some dtypes (bool, float8, complex) is refused.
    return units_of_bytes(host_array(flat_t.view(torch.uint8)), unit), unit, aliases


_PARALLEL_COPY = 1 << 20  # bytes from which torch's copy (on its intra-op threads) beats numpy's (one thread)


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (same size, contiguous). Large copies go through torch, which
    splits them over its intra-op threads: idle while the training thread records, and ~2x faster
    than numpy's single-threaded copy at 2 threads for arrays of 16 MB."""
    if src.nbytes < _PARALLEL_COPY:
        np.copyto(dst, src)
        return
    torch.from_numpy(dst.view(np.uint8)).copy_(torch.from_numpy(src.view(np.uint8)))


def units_of_bytes(raw: np.ndarray, unit: int) -> np.ndarray:
    """A uint8 array's bytes viewed as the store's unsigned integers of one unit."""
    return raw.view(_NUMPY_UNIT[unit])


def content_key(units: np.ndarray, unit: int) -> tuple[int, int, int]:
    """Content address of a payload: xxh3-128 of its bytes (high, low) and its unit."""
    digest = xxhash.xxh3_128_intdigest(units.data)
    return digest >> 64, digest & 0xFFFFFFFFFFFFFFFF, unit


def from_units(units: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a contiguous CPU tensor from stored units (copies, so the result owns its memory)."""
    unit = unit_of(dtype)
    if len(units) == 0:
        return torch.empty(shape, dtype=dtype, device="cpu")
    owned = np.array(units, dtype=_NUMPY_UNIT[unit], copy=True).view(np.uint8)
    return torch.from_numpy(owned).view(dtype).reshape(shape)


# The parts a sparse tensor is made of, by layout (its name without "torch.") and torch's name for each
# part (its accessor), in the order its constructor takes them. Schema 1.19: component records.
SPARSE_PARTS: dict[str, tuple[str, ...]] = {
    "sparse_coo": ("indices", "values"),
    "sparse_csr": ("crow_indices", "col_indices", "values"), "sparse_bsr": ("crow_indices", "col_indices", "values"),
    "sparse_csc": ("ccol_indices", "row_indices", "values"), "sparse_bsc": ("ccol_indices", "row_indices", "values"),
}


def sparse_parts(t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The tensors a sparse tensor is made of, by part name (``SPARSE_PARTS``): a COO tensor's indices
    and values as it holds them (uncoalesced ones with their duplicates: ``is_coalesced`` says which);
    a compressed one's (CSR, CSC, BSR, BSC) compressed and plain indices and values. None for a tensor of
    another layout, or one torch gives no parts of (meta)."""
    kind = str(t.layout).removeprefix("torch.")
    if kind not in SPARSE_PARTS or t.device.type == "meta":
        return None
    try:
        if kind == "sparse_coo":
            return {"indices": t._indices(), "values": t._values()}
        compressed, plain = ((t.crow_indices(), t.col_indices()) if kind in ("sparse_csr", "sparse_bsr")
                             else (t.ccol_indices(), t.row_indices()))
        return dict(zip(SPARSE_PARTS[kind], (compressed, plain, t.values())))
    except (RuntimeError, NotImplementedError):
        return None


def sparse_from_parts(kind: str, parts: dict[str, torch.Tensor], shape: tuple[int, ...],
                      coalesced: bool = False) -> torch.Tensor:
    """The sparse tensor of layout ``kind`` (``"sparse_csr"``) and ``shape`` made of ``parts``
    (``sparse_parts``'s), on their device; ``coalesced``: a COO tensor's ``is_coalesced``. Its invariants
    are checked (indices within the shape, a coalesced one's sorted and unique): parts read from a
    recording may be anything, and torch's kernels trust them. Raises ValueError where they do not make one."""
    import warnings

    order = SPARSE_PARTS.get(kind)
    if order is None or set(parts) != set(order):
        raise ValueError(f"a {kind} tensor is not made of {', '.join(sorted(parts)) or 'nothing'}")
    try:
        with warnings.catch_warnings():  # (torch's beta-state notice on making a compressed one: said when recorded)
            warnings.simplefilter("ignore", UserWarning)
            if kind == "sparse_coo":
                return torch.sparse_coo_tensor(parts["indices"], parts["values"], shape, is_coalesced=coalesced,
                                               check_invariants=True)
            return torch.sparse_compressed_tensor(*(parts[p] for p in order), shape,
                                                  layout=getattr(torch, kind), check_invariants=True)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(" ".join(str(exc).split())[:300]) from None
