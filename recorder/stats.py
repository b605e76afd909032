"""Summary statistics of a tensor: min, max, mean, std, abs-max, L2 norm, NaN count, Inf count.

The value statistics are over the finite elements only, so a half-NaN tensor still shows the range of
its other values; the NaN and Inf counts say how many were left out. std is the sample standard
deviation (torch.std's default, correction=1). Complex tensors are summarised by magnitude; integer
and boolean tensors by value. An empty tensor has NaN value statistics and zero counts.

On the CPU the common case (no NaN, no Inf) of a float32/float64 tensor costs one read of the data,
by the compiled kernel of recorder.kernels once a recording has loaded it (``prepare``); without
it, three reads, small tensors through numpy (see ``host_stats``). On an accelerator the
statistics stay on the device as one small tensor (no host synchronisation per tensor); the recorder
copies them to the host in bulk later.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

from . import payload

NAN = float("nan")
EMPTY: tuple[float, ...] = (NAN, NAN, NAN, NAN, NAN, NAN, 0.0, 0.0)


class _Slot:
    """The statistics kernel in use (the recorder.kernels module) or None, and how it came to be."""

    def __init__(self) -> None:
        self.active: Any = None
        self.loaded: Any = None  # recorder.kernels once prepare() has imported it
        self.tried = False
        self.disabled = False  # use_kernel(False)
        self.lock = threading.Lock()


_slot = _Slot()
KERNEL_THREADS = 2  # above this many torch threads, torch's three parallel reads beat the one-core kernel
_FLOATS = (torch.float32, torch.float64)


def prepare() -> bool:
    """Load the one-pass statistics kernel (numba: compiled once per machine, then loaded from
    numba's cache in ~0.3 s). Called when a recording starts, and by the first ``host_stats`` of a
    process that records nothing (so that its statistics take the same path). False, and statistics
    through torch and numpy, when numba is not installed, the kernel cannot be built here, or after
    ``use_kernel(False)``."""
    with _slot.lock:
        if not _slot.tried:
            _slot.tried = True
            try:
                # No warnings.catch_warnings() here: it swaps the process's filters, which another
                # thread (a TUI worker's replay) may be using. A numba warning under "-W error" is
                # one more exception below.
                from . import kernels

                _slot.loaded = kernels
            except Exception:  # ImportError, or numba's own errors: the torch path is always there
                _slot.loaded = None
        _slot.active = None if _slot.disabled else _slot.loaded
    return _slot.active is not None


def use_kernel(enabled: bool) -> bool:
    """Turn the kernel on (loading it if needed) or off, for comparisons (bench/) and tests; returns
    whether it is now in use."""
    _slot.disabled = not enabled
    return prepare()


def _working(t: torch.Tensor) -> torch.Tensor:
    """The values to summarise, in a dtype reductions support exactly enough."""
    t = t.detach()
    if t.is_quantized:  # (qint8: its integers mean nothing without its scale and zero point)
        return t.dequantize()
    if t.is_complex():
        return t.abs().to(torch.float64 if t.dtype == torch.complex128 else torch.float32)
    if t.dtype in (torch.float32, torch.float64):
        return t
    if t.is_floating_point():  # half, bfloat16, float8: reduce in float32 as torch does internally
        return t.to(torch.float32)
    return t.to(torch.float64)  # bool and integers: exact up to 2**53


SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def stored_values(t: torch.Tensor) -> torch.Tensor | None:
    """The values a sparse tensor stores, of which the recorder takes a sparse tensor's statistics
    (COO: coalesced, duplicates summed as the tensor means them), and so does a replay comparing one;
    None for a tensor without values to read (meta, or a layout torch cannot give them for)."""
    if t.device.type == "meta":
        return None
    try:
        if t.layout == torch.sparse_coo:
            return t.coalesce().values()
        if t.layout in SPARSE_LAYOUTS:
            return t.values()
    except (RuntimeError, NotImplementedError):
        pass
    return None


SMALL = 1 << 12  # elements up to which a float32/float64 CPU tensor is summarised through numpy


def host_stats(t: torch.Tensor) -> tuple[float, ...]:
    """Statistics of a CPU tensor as Python floats, in layout.STAT_NAMES order.

    float32/float64 tensors go through the one-pass kernel when it is loaded and takes them (see
    ``_kernel_takes``), and so do small boolean and integer ones (position ids, masks), as float64
    (exact up to 2**53, as torch's path below): one call instead of numpy's four reductions, ~95 ->
    ~33 us for 128 int64 position ids inside a training step, where every call runs with cold
    caches. Values it finds non-finite take the exact path below, which counts them. Without the
    kernel, those small tensors go through numpy: a torch call costs ~3-5 us of dispatch, and
    releases the interpreter lock, which the writer thread then holds until its next pause; numpy
    keeps it for arrays this small (the position ids took ~550 us through torch inside a training
    step). Larger ones use torch, whose reductions run on its intra-op threads, and so do values
    whose sums could overflow (numpy would warn in the user's process)."""
    if not _slot.tried:  # the same path in every process (a replay's statistics, the recorder's)
        prepare()
    small_ints = t.dtype in _INTEGERS and t.numel() <= SMALL
    takes = (t.dtype in _FLOATS and _kernel_takes(t)) or (small_ints and _slot.active is not None)
    if takes or small_ints or (t.dtype in _FLOATS and t.numel() <= SMALL):
        x = payload.host_array(t)  # a view, or (strided and small) a copy
        if small_ints:
            x = x.astype(np.float64)  # as _working converts them
        if takes and len(x) and x.flags.c_contiguous and x.flags.writeable:
            got = _from_sums(x, _slot.active.sums(x))
            if got is not None:
                return got
        return _exact(x)
    w = _working(t)
    if t.dtype not in _FLOATS or not t.is_contiguous():  # (a copy is made in any case: half, bfloat16,
        # complex, integers, another layout) in logical order, then summed as a contiguous float32/float64
        # tensor is: one layout's statistics are another's to the bit, and low precision gets float64 sums
        w = w.resolve_neg().contiguous()
        if w.dtype in _FLOATS and w.numel() and _kernel_takes(w):
            x = payload.host_array(w)  # (not w.numpy(): see host_array)
            got = _from_sums(x, _slot.active.sums(x))
            return _exact(x) if got is None else got
    return _stats(w.reshape(-1), torch)


_INTEGERS = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


def _exact(x: np.ndarray) -> tuple[float, ...]:
    """Statistics of a 1-D float32/float64 array on the path that counts NaN and Inf: numpy for
    small arrays, torch's reductions (on its intra-op threads) for the others."""
    return _stats(x, np) if len(x) <= SMALL else _stats(torch.from_numpy(x), torch)


def copy_stats(t: torch.Tensor, dst: np.ndarray, src: np.ndarray) -> tuple[float, ...] | None:
    """Copy a CPU tensor's bytes (``src``, its 1-D contiguous store units from payload.as_units) into
    ``dst`` (an array of the same units and size) and return the tensor's statistics, computed from
    the same read when the kernel takes the tensor; None when it does not (the bytes are copied all
    the same: payload.copy_into)."""
    kind = _NUMPY.get(t.dtype)  # (float32 and float64 only)
    if kind is not None and len(src) and src.flags.writeable and _kernel_takes(t):
        x, out = src.view(kind), dst.view(kind)
        got = _from_sums(out, _slot.active.copy_sums(x, out))
        return _exact(out) if got is None else got  # non-finite values: counted, on the copy
    payload.copy_into(dst, src)
    return None


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


def _kernel_takes(t: torch.Tensor) -> bool:
    """Whether the kernel summarises ``t`` (a float32/float64 CPU tensor): any small one, and
    contiguous ones of any size while torch runs on at most ``KERNEL_THREADS`` threads."""
    return _slot.active is not None and (t.numel() <= SMALL or (
        t.is_contiguous() and not t.is_neg() and torch.get_num_threads() <= KERNEL_THREADS))


def _from_sums(x: np.ndarray, sums: tuple[float, float, float, float]) -> tuple[float, ...] | None:
    """The statistics of ``x`` from the kernel's sums; None when they show non-finite values."""
    lo, hi, total, squares = sums
    if math.isfinite(lo) and math.isfinite(hi) and math.isfinite(total) and math.isfinite(squares):
        return _summarise(x, np, lo, hi, total, squares, 0, 0)
    return None


def _stats(x: Any, lib: Any) -> tuple[float, ...]:
    """``host_stats`` of a 1-D numpy array (``lib`` numpy) or tensor (``lib`` torch)."""
    if len(x) == 0:
        return EMPTY
    if lib is np:  # the user's np.seterr (all="raise", to hunt NaN) is not for the recorder's own sums
        with np.errstate(all="ignore"):
            return _stats_of(x, lib)
    return _stats_of(x, lib)


def _stats_of(x: Any, lib: Any) -> tuple[float, ...]:
    lo, hi = _minmax(x, lib)
    if math.isfinite(lo) and math.isfinite(hi):  # NaN propagates into min/max, Inf shows there
        return _finite_stats(x, lib, lo, hi, 0, 0)
    nan = int(lib.isnan(x).sum())
    inf = int(lib.isinf(x).sum())
    kept = x[lib.isfinite(x)]
    if len(kept) == 0:
        return (NAN, NAN, NAN, NAN, NAN, NAN, float(nan), float(inf))
    lo, hi = _minmax(kept, lib)
    return _finite_stats(kept, lib, lo, hi, nan, inf)


# Sums of squares below these cannot overflow (nor can the deviations' sums): numpy's are safe.
_F32 = np.dtype(np.float32)
_NUMPY_SAFE = {_F32: float(np.finfo(np.float32).max) / 4,
               np.dtype(np.float64): float(np.finfo(np.float64).max) / 4}


def _minmax(x: Any, lib: Any) -> tuple[float, float]:
    if lib is np:
        return float(x.min()), float(x.max())
    lo, hi = torch.aminmax(x)
    return lo.item(), hi.item()


def _finite_stats(x: Any, lib: Any, lo: float, hi: float, nan: int, inf: int) -> tuple[float, ...]:
    # Instead of torch.std_mean (a Welford loop ~50x slower on the CPU): the sum and the sum of
    # squares (a BLAS dot product), two reads of data that is usually not in cache. When the mean is
    # large against the spread, that formula cancels; then the deviations are summed exactly (two
    # more passes). The L2 norm comes from the same sums.
    x, lib = _safe(x, lib, lo, hi)
    total = x.sum().item()
    squares = lib.dot(x, x).item()  # sum of x^2
    return _summarise(x, lib, lo, hi, total, squares, nan, inf)


_TINY = 2.0 ** -50  # float32 values all below this in magnitude: their squares lose bits in float32, or vanish
_TINY64 = 2.0 ** -500  # the same for float64


def _safe(x: Any, lib: Any, lo: float, hi: float) -> tuple[Any, Any]:
    """``x`` and its library, as a tensor and torch when numpy's sums over it could overflow (numpy
    would warn of it in the user's process)."""
    big = max(abs(lo), abs(hi))
    if lib is np and big * big * len(x) >= _NUMPY_SAFE[x.dtype]:
        return torch.from_numpy(x), torch
    return x, lib


def _summarise(x: Any, lib: Any, lo: float, hi: float, total: float, squares: float, nan: int,
               inf: int) -> tuple[float, ...]:
    """The statistics from the finite values' min, max, sum and sum of squares; ``x`` (those values)
    is read again only when the sums cancel."""
    n = len(x)
    big = max(abs(lo), abs(hi))
    finite = math.isfinite(total) and math.isfinite(squares)
    if (big < _TINY or not finite or big * big * n >= _NUMPY_SAFE[_F32]) and str(x.dtype).endswith("float32"):
        # float32 sums of squares vanish below ~1e-19 and overflow above ~1e19, and so would the
        # deviations' sums below (the kernel's sums are float64 sums already): sum in float64 instead
        x, lib = torch.from_numpy(x).double() if lib is np else x.double(), torch
        total, squares = x.sum().item(), torch.dot(x, x).item()
        finite = True
    if big and (big < _TINY64 or not finite):  # float64 squares out of range: sum x / big, scale back
        scaled = (torch.from_numpy(x) if lib is np else x).double() / big
        total, squares = scaled.sum().item(), torch.dot(scaled, scaled).item()
        s = _summarise(scaled, torch, lo / big, hi / big, total, squares, nan, inf)
        return (lo, hi, s[2] * big, s[3] * big, big, s[5] * big, float(nan), float(inf))
    mean = total / n  # divided as Python floats: a tensor division is one more dispatch (~4 us)
    if n == 1:
        return (lo, hi, mean, NAN, big, math.sqrt(squares), float(nan), float(inf))
    centred = squares - n * mean * mean
    if not centred > 1e-3 * squares:  # cancellation: fewer than ~3 significant digits would survive
        # Summed about the mean as found: the corrected two-pass formula, which also corrects the
        # mean for the rounding of the first sum (float32 sums of large values are inexact).
        x, lib = _safe(x, lib, lo, hi)
        with np.errstate(all="ignore"):  # (numpy's: see _stats)
            dev = x - mean
            shift = dev.sum().item()
            centred = lib.dot(dev, dev).item() - shift * shift / n
        mean += shift / n
    std = math.sqrt(max(centred, 0.0) / (n - 1))
    return (lo, hi, mean, std, big, math.sqrt(squares), float(nan), float(inf))


def device_stats(t: torch.Tensor) -> torch.Tensor:
    """Statistics as a float64 tensor of 8 on the tensor's own device, without a host sync."""
    x = _working(t)
    if x.numel() == 0:
        return torch.tensor(EMPTY, dtype=torch.float64, device=x.device)
    x = x.reshape(-1)
    finite = torch.isfinite(x)
    count = finite.sum()
    nan = torch.isnan(x).sum()
    inf = x.numel() - count - nan
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    lo = torch.where(finite, x, torch.full_like(x, math.inf)).amin()
    hi = torch.where(finite, x, torch.full_like(x, -math.inf)).amax()
    xs = torch.where(finite, x, zero)
    countf = count.to(x.dtype)
    mean = xs.sum() / countf
    var = torch.where(finite, x - mean, zero).square().sum() / (countf - 1)
    norm = torch.linalg.vector_norm(xs)
    out = torch.stack([lo, hi, mean, var.sqrt(), torch.maximum(lo.abs(), hi.abs()), norm]).to(torch.float64)
    out = torch.where(count > 0, out, torch.full_like(out, math.nan))
    std = torch.where(count > 1, out[3], torch.full_like(out[3], math.nan))
    return torch.cat([out[:3], std.reshape(1), out[4:], torch.stack([nan, inf]).to(torch.float64)])
