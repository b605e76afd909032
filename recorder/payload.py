"""Tensor bytes: exact conversion between any torch dtype and the store's unsigned-integer units.

numpy has no bfloat16, float8 or complex32, so payloads are stored as a view of same-width unsigned
integers and the true dtype is kept in the tensor record; the round trip is a reinterpretation of
bits, never a conversion of values.
"""

from __future__ import annotations

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
    return str(dtype).removeprefix("torch.")


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


# Dtypes whose tensors numpy views directly (Tensor.numpy()).
_NUMPY_VIEWABLE = {torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool,
                   torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (a dtype numpy has); detached first only when it
    requires grad: a tensor the recorder already detached is not detached again (~1 us each).
    A conjugate or negative view comes back resolved, as a copy: ``z.conj()`` only flips a bit,
    so its memory does not hold its values (and numpy() refuses to view it)."""
    if t.requires_grad:
        t = t.detach()
    try:
        return t.numpy()
    except RuntimeError:
        if not (t.is_conj() or t.is_neg()):
            raise
        return t.resolve_conj().resolve_neg().numpy()


def as_units(t: torch.Tensor) -> tuple[np.ndarray, int, bool]:
    """A 1-D numpy array of a CPU tensor's bytes as store units.

    Returns (array, unit, aliases): when ``aliases`` is True the array shares ``t``'s memory (no copy
    was needed) and must be copied before ``t`` can change.
    """
    unit = unit_of(t.dtype)
    if t.numel() == 0:
        return np.empty(0, dtype=_NUMPY_UNIT[unit]), unit, False
    if t.dtype in _NUMPY_VIEWABLE and not (t.is_conj() or t.is_neg()):
        # One torch call, the rest numpy views: each torch call costs ~2-5 us of dispatch.
        arr = host_array(t)
        if arr.flags.c_contiguous:  # the common case: a view of the tensor's memory
            return arr.reshape(-1).view(_NUMPY_UNIT[unit]), unit, True
        flat_a = arr.reshape(-1)  # a view when the layout allows, else a copy in element order
        if not flat_a.flags.c_contiguous:  # a strided 1-D view: reshape leaves it as it is
            flat_a = flat_a.copy()
        return flat_a.view(_NUMPY_UNIT[unit]), unit, bool(np.may_share_memory(flat_a, arr))
    flat_t = flat(t)
    aliases = flat_t.data_ptr() == t.data_ptr()  # a copy has memory of its own
    # Through uint8 first: a direct view between some dtypes (bool, float8, complex) is refused.
    return units_of_bytes(flat_t.view(torch.uint8).numpy(), unit), unit, aliases


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
