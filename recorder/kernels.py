"""One-pass statistics of a float array: min, max, sum and sum of squares, compiled with numba.

torch and numpy need three reads of a tensor for these (``aminmax``, ``sum``, ``dot``), each a
separate call costing ~2-5 us of dispatch. This kernel reads the data once, in one loop over plain
scalar accumulators that LLVM's loop vectorizer turns into vector registers: the sums because
reassociation is allowed, the min and max because they are LLVM's ``llvm.minimum``/``llvm.maximum``
(IEEE 754-2019 minimum and maximum: a NaN operand gives NaN), which it knows how to vectorize as
reductions. Written any other way in numba they stayed scalar, or in memory: ``np.minimum`` and
``v if v < a else a`` are not reductions the vectorizer takes without assuming that no value is
NaN, and accumulators kept in lane arrays (this kernel's earlier form) were loaded and stored at
every step, ~5 instructions per element, which also left too few loads in flight for memory that
is not in cache (bench/stats_kernel.py, docs/PERFORMANCE.md: a cold 768 KB float32 array ~260 ->
~120 us on Intel Xeon, AVX-512). ``copy_sums`` also copies the data as it reads it: a payload that
must be copied (full and flight modes) gets its statistics for the price of the copy.

Importing this module imports numba and compiles (or loads from numba's on-disk cache) the kernel
for float32 and float64; ``recorder.stats`` does so at the first recording, and falls back to torch
and numpy when numba is missing or fails.

Precision: the sums are in float64 (a float32 value's square is exact there), so a float32 sum is
more accurate than torch's, and its sum of squares cannot overflow or vanish. Non-finite values are
not handled here: they show in the results (a NaN anywhere makes the sums and the min and max NaN,
an Inf shows in the min, the max or the sums), and the caller then uses the exact path that counts
them. No fast-math flag that assumes finite values is used, so that holds by the language's rules,
not by luck.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core.extending import intrinsic

_MATH = {"reassoc", "nsz", "contract", "arcp"}  # reordering of sums allowed; NaN and Inf keep their meaning


def _binary(name: str):  # type: ignore[no-untyped-def]
    """A numba function calling the LLVM intrinsic ``name`` on two floats of one type."""

    @intrinsic
    def call(typingctx, a, b):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            t = args[0].type
            fn = builder.module.declare_intrinsic(name, [t], ir.FunctionType(t, [t, t]))
            return builder.call(fn, args)

        return a(a, b), codegen

    return call


_minimum = _binary("llvm.minimum")
_maximum = _binary("llvm.maximum")

# Compiled at import for exactly these types (1-D, C-contiguous): any other array is refused with a
# TypeError instead of being compiled for in the middle of a training step.
_SIGNATURES = ["Tuple((float32, float32, float64, float64))(float32[::1], float32[::1], boolean)",
               "UniTuple(float64, 4)(float64[::1], float64[::1], boolean)"]


@numba.njit(_SIGNATURES, cache=True, fastmath=_MATH, boundscheck=False, error_model="numpy")
def _sums(x, out, copy):  # type: ignore[no-untyped-def]
    n = x.shape[0]
    lo = x[0]
    hi = x[0]
    total = 0.0
    squares = 0.0
    if copy:  # two loops: the vectorizer takes each whole
        for i in range(n):
            v = x[i]
            out[i] = v
            lo = _minimum(lo, v)
            hi = _maximum(hi, v)
            w = np.float64(v)
            total += w
            squares += w * w
    else:
        for i in range(n):
            v = x[i]
            lo = _minimum(lo, v)
            hi = _maximum(hi, v)
            w = np.float64(v)
            total += w
            squares += w * w
    return lo, hi, total, squares


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
    """The compiled kernels against numpy on a small array with a remainder past whole vectors, and a
    NaN's meaning kept (import fails otherwise)."""
    for dtype in (np.float32, np.float64):
        x = np.arange(-33, 34 + 3, dtype=dtype)
        want = (float(x.min()), float(x.max()), float(x.sum()), float(np.dot(x, x)))
        out = np.zeros_like(x)
        got = sums(x), copy_sums(x, out)
        if got != (want, want) or not np.array_equal(out, x) or not np.array_equal(x, np.arange(-33, 34 + 3)):
            raise RuntimeError(f"the statistics kernel gave {got} for {dtype.__name__}, numpy {want}")
        x[40] = np.nan
        if not all(np.isnan(sums(x))):
            raise RuntimeError(f"the statistics kernel gave {sums(x)} for a {dtype.__name__} array with a NaN")


_check()
