"""One-pass statistics of a float array: min, max, sum and sum of squares, compiled with numba.

torch and numpy need three reads of a tensor for these (``aminmax``, ``sum``, ``dot``), each a
separate call costing ~2-5 us of dispatch; on the CPU the reads are bound by arithmetic, not memory.
This kernel reads the data once, in 32 lanes that the compiler turns into vector instructions: on one
core ~1.2-3x faster than the three calls for tensors of 30 KB to 8 MB, ~6-10x for small ones
(Intel AVX-512 and AMD Zen 3 measured; bench/stats_kernel.py, docs/PERFORMANCE.md). The lanes are
arrays in memory, so every update is a plain store of np.minimum/np.maximum: written as a
conditional, LLVM made masked stores of them, microcoded on AMD Zen, where the kernel then ran 1.2-3.8x
slower than torch. ``copy_sums`` also copies the data as it reads it: a
payload that must be copied (full and flight modes) gets its statistics for the price of the copy.

Importing this module imports numba and compiles (or loads from numba's on-disk cache) the kernel
for float32 and float64; ``recorder.stats`` does so at the first recording, and falls back to torch
and numpy when numba is missing or fails.

Precision: the lanes sum in float64 (a float32 value's square is exact there), so a float32 sum is
more accurate than torch's, and its sum of squares cannot overflow or vanish. Summing float32 in
float32 lanes, in parts of 8192 elements added into float64, ran at the same speed in cache but read
memory that is not in cache far more slowly: a cold 1 MB float32 array was copied and summarised in
~96-138 us that way, ~56-61 us this way (np.copyto alone: ~38-57 us), and the recorder's copies run
right after training's operators have filled the caches with other data. Non-finite values are not
handled here: they show in the results (a NaN anywhere makes the sum NaN, an Inf shows in the min,
the max or the sums), and the caller then uses the exact path that counts them. No fast-math flag
that assumes finite values is used, so that holds by the language's rules, not by luck.
"""

from __future__ import annotations

import numba
import numpy as np

LANES = 32  # independent accumulators, enough for the vector units (AVX-512: the sums take 4 registers of 8 each)
_MATH = {"reassoc", "nsz", "contract", "arcp"}  # reordering of sums allowed; NaN and Inf keep their meaning


# Compiled at import for exactly these types (1-D, C-contiguous): any other array is refused with a
# TypeError instead of being compiled for in the middle of a training step.
_SIGNATURES = ["Tuple((float32, float32, float64, float64))(float32[::1], float32[::1], boolean)",
               "UniTuple(float64, 4)(float64[::1], float64[::1], boolean)"]


@numba.njit(_SIGNATURES, cache=True, fastmath=_MATH, boundscheck=False, error_model="numpy")
def _sums(x, out, copy):  # type: ignore[no-untyped-def]
    n = x.shape[0]
    lo = np.full(LANES, x[0], x.dtype)
    hi = np.full(LANES, x[0], x.dtype)
    s = np.zeros(LANES, np.float64)
    q = np.zeros(LANES, np.float64)
    m = n - n % LANES
    for i in range(0, m, LANES):
        for j in range(LANES):
            v = x[i + j]
            if copy:  # loop-invariant: the compiler makes two loops of this one
                out[i + j] = v
            # np.minimum, not a conditional: see the module's docstring (masked stores on AMD Zen)
            lo[j] = np.minimum(lo[j], v)
            hi[j] = np.maximum(hi[j], v)
            w = np.float64(v)
            s[j] += w
            q[j] += w * w
    total = 0.0
    squares = 0.0
    for j in range(LANES):
        total += s[j]
        squares += q[j]
    a = lo.min()
    b = hi.max()
    for i in range(m, n):
        v = x[i]
        if copy:
            out[i] = v
        a = v if v < a else a
        b = v if v > b else b
        w = np.float64(v)
        total += w
        squares += w * w
    return a, b, total, squares


def sums(x: np.ndarray) -> tuple[float, float, float, float]:
    """(min, max, sum, sum of squares) of a non-empty 1-D contiguous float32 or float64 array, as
    Python floats. Only meaningful when all four are finite (see the module's notes)."""
    lo, hi, total, squares = _sums(x, x, False)
    return float(lo), float(hi), float(total), float(squares)


def copy_sums(x: np.ndarray, out: np.ndarray) -> tuple[float, float, float, float]:
    """``sums(x)``, copying ``x`` into ``out`` (same dtype and size) in the same pass."""
    if out.shape != x.shape:
        raise ValueError(f"copy_sums: {x.shape} into {out.shape}")
    lo, hi, total, squares = _sums(x, out, True)
    return float(lo), float(hi), float(total), float(squares)


def _check() -> None:
    """The compiled kernels against numpy on a small array with a remainder (import fails otherwise)."""
    for dtype in (np.float32, np.float64):
        x = np.arange(-LANES, LANES + 3, dtype=dtype)
        want = (float(x.min()), float(x.max()), float(x.sum()), float(np.dot(x, x)))
        out = np.zeros_like(x)
        got = sums(x), copy_sums(x, out)
        if got != (want, want) or not np.array_equal(out, x) or not np.array_equal(x, np.arange(-LANES, LANES + 3)):
            raise RuntimeError(f"the statistics kernel gave {got} for {dtype.__name__}, numpy {want}")


_check()
