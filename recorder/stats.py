"""Summary statistics of a tensor: min, max, mean, std, abs-max, L2 norm, NaN count, Inf count.

The value statistics are over the finite elements only, so a half-NaN tensor still shows the range of
its other values; the NaN and Inf counts say how many were left out. std is the sample standard
deviation (torch.std's default, correction=1). Complex tensors are summarised by magnitude; integer
and boolean tensors by value. An empty tensor has NaN value statistics and zero counts.

On the CPU the common case (no NaN, no Inf) costs three reads of the data; small tensors are read
through numpy (see ``host_stats``). On an accelerator the
statistics stay on the device as one small tensor (no host synchronisation per tensor); the recorder
copies them to the host in bulk later.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

NAN = float("nan")
EMPTY: tuple[float, ...] = (NAN, NAN, NAN, NAN, NAN, NAN, 0.0, 0.0)


def _working(t: torch.Tensor) -> torch.Tensor:
    """The values to summarise, in a dtype reductions support exactly enough."""
    t = t.detach()
    if t.is_complex():
        return t.abs().to(torch.float64 if t.dtype == torch.complex128 else torch.float32)
    if t.dtype in (torch.float32, torch.float64):
        return t
    if t.is_floating_point():  # half, bfloat16, float8: reduce in float32 as torch does internally
        return t.to(torch.float32)
    return t.to(torch.float64)  # bool and integers: exact up to 2**53


SMALL = 1 << 12  # elements up to which a float32/float64 CPU tensor is summarised through numpy


def host_stats(t: torch.Tensor) -> tuple[float, ...]:
    """Statistics of a CPU tensor as Python floats, in layout.STAT_NAMES order.

    Small float32/float64 tensors go through numpy: a torch call costs ~3-5 us of dispatch, and
    releases the interpreter lock, which the writer thread then holds until its next pause; numpy
    keeps it for arrays this small. Larger ones use torch, whose reductions run on its intra-op
    threads, and so do values whose sums could overflow (numpy would warn in the user's process)."""
    if t.numel() <= SMALL and t.dtype in (torch.float32, torch.float64):
        return _stats(t.detach().numpy().reshape(-1), np)
    return _stats(_working(t).reshape(-1), torch)


def _stats(x: Any, lib: Any) -> tuple[float, ...]:
    """``host_stats`` of a 1-D numpy array (``lib`` numpy) or tensor (``lib`` torch)."""
    if len(x) == 0:
        return EMPTY
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
_NUMPY_SAFE = {np.dtype(np.float32): float(np.finfo(np.float32).max) / 4,
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
    n = len(x)
    big = max(abs(lo), abs(hi))
    if lib is np and big * big * n >= _NUMPY_SAFE[x.dtype]:
        x, lib = torch.from_numpy(x), torch  # the sums could overflow, and numpy would warn of it
    mean = x.sum().item() / n  # divided as Python floats: a tensor division is one more dispatch (~4 us)
    squares = lib.dot(x, x).item()  # sum of x^2
    if n == 1:
        return (lo, hi, mean, NAN, big, math.sqrt(squares), float(nan), float(inf))
    centred = squares - n * mean * mean
    if not centred > 1e-3 * squares:  # cancellation: fewer than ~3 significant digits would survive
        dev = x - mean
        centred = lib.dot(dev, dev).item()
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
