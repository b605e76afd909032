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
~120 us on Intel Xeon, AVX-512). ``copy_sums`` also copies the data: a payload that must be copied
(full and flight modes) gets its statistics for the price of the copy. From 16 KB up it copies in
the read the statistics make (smaller arrays are copied first, then summed in cache), and stores the
copy with nontemporal (streaming) stores on x86-64, written directly as vector code in
LLVM's IR: the copy is not read again soon, so it need not pass through the cache or first read the
destination's old bytes into it (a cold 2 MB array ~400 -> ~260 us), and it does not push training's
own data out of the cache. From 16 KB up on x86-64, both the statistics alone and the copy read
the array as parallel streams, a part of it each, with software prefetches ahead (``_block``):
one sequential read keeps too few lines of memory not in cache on their way at once.

Importing this module imports numba and compiles (or loads from numba's on-disk cache) the kernel
for float32 and float64; ``recorder.stats`` does so at the first recording, and falls back to torch
and numpy when numba is missing or fails.

Precision: the sums are in float64 (a float32 value's square is exact there), so a float32 sum is
more accurate than torch's, and its sum of squares cannot overflow or vanish. Non-finite values are
not handled here: they show in the sums (a NaN anywhere makes them NaN, an Inf makes them Inf or
NaN; the min and max are NaN too, except in the streamed reads of 16 KB and up, whose min and max
skip a NaN),
and the caller then uses the exact path that counts them. No fast-math flag that assumes finite
values is used, so that holds by the language's rules, not by luck.

Same values, same bits: ``sums(x)`` and ``copy_sums(x, out)`` give bitwise the same four numbers,
wherever ``x`` and ``out`` lie. Small arrays go through the one compiled loop of ``_sums`` either
way; large ones through ``_streamed``, whose parts depend only on the length and whose additions
(each part's lanes, then the lanes, then the tail) are IEEE operations in a fixed order, not
reassociated, so that LLVM cannot order them differently with and without the copy.
"""

from __future__ import annotations

import platform

import numba
import numpy as np
from llvmlite import binding, ir
from numba.core.extending import intrinsic

_MATH = {"reassoc", "nsz", "contract", "arcp"}  # reordering of sums allowed; NaN and Inf keep their meaning


# LLVM's x86 back end selects llvm.minimum/llvm.maximum from LLVM 17 on; before (numba 0.60 and 0.61
# ship LLVM 14 and 15) compiling them aborts the whole process ("LLVM ERROR: Cannot select"). Refused
# here instead, before anything is compiled: recorder.stats then uses torch's reductions.
if binding.llvm_version_info < (17,):
    raise ImportError(f"the statistics kernel needs numba >= 0.62 (LLVM 17 or later); this numba {numba.__version__} "
                      f"has LLVM {'.'.join(map(str, binding.llvm_version_info))}")


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
def _signatures(args: str, returns: str | None = None) -> list[str]:
    """A kernel's signatures for float32 and float64 arrays: ``args`` with ``{t}`` for the element
    type; it returns the four sums (min and max in the element type), or ``returns``."""
    sums = (("float32", "Tuple((float32, float32, float64, float64))"), ("float64", "UniTuple(float64, 4)"))
    return [f"{returns or ret}({args.format(t=t)})" for t, ret in sums]


_SIGNATURES = _signatures("{t}[::1]")


def _compiled(signatures: list[str], fastmath: set[str] | bool = _MATH):  # type: ignore[no-untyped-def]
    """numba's ahead-of-time compilation for exactly ``signatures``, as every kernel here is built
    (``fastmath=False``: IEEE arithmetic in the order written)."""
    return numba.njit(signatures, cache=True, fastmath=fastmath, boundscheck=False, error_model="numpy")


@_compiled(_SIGNATURES)
def _sums(x):  # type: ignore[no-untyped-def]
    n = x.shape[0]
    lo = x[0]
    hi = x[0]
    total = 0.0
    squares = 0.0
    for i in range(n):
        v = x[i]
        lo = _minimum(lo, v)
        hi = _maximum(hi, v)
        w = np.float64(v)
        total += w
        squares += w * w
    return lo, hi, total, squares


@_compiled(_signatures("{t}[::1], {t}[::1]", returns="void"))
def _copy(x, out):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        out[i] = x[i]


# Arrays from this size are read as interleaved streams with prefetches, and copied with nontemporal
# stores (copy_sums), on x86-64: the copy's fence instruction is named in the code, which elsewhere
# would not compile.
_STREAM_BYTES = 1 << 14 if platform.machine().lower() in ("x86_64", "amd64") else None
_VECTOR_BYTES = 32  # one AVX register: the loads' and stores' width, the stores' alignment
# A read of memory not in cache is paced by how many lines are on their way at once: one sequential
# stream, whose hardware prefetcher stops at every 4 KB page, keeps too few. The large arrays are
# read as parallel streams (a part of the array each, one vector of each per loop), each with a
# software prefetch this far ahead, which crosses pages. On Intel Xeon (AVX-512), cold float32 data
# (bench/stats_kernel.py, docs/PERFORMANCE.md): statistics alone ~5.5 -> ~14 GB/s with 4 streams; the
# copy with its statistics ~6.5 -> ~9.5 GB/s storing to 2 parts at once (warm data: 4 at once ~25%
# slower; 8 streams of nontemporal stores run out of the core's write-combining buffers: slower than
# one). The copy reads the same parts as the statistics alone do, each part's sums added in the same
# order, so an array's statistics are the same bits whether it was copied or not and wherever
# either array lies: two runs, or a statistics-only record and a replay, are compared by them
# (replayer.bisect, replayer.compare).
_STREAMS = 4
_STORE_STREAMS = 2  # parts a copy stores to at once
_PREFETCH_BYTES = 1024


def _block(streams: int, store: int):  # type: ignore[no-untyped-def]
    """A numba intrinsic ``block(dst, src, start, span, sums, ends)`` over ``streams`` parts of
    ``span`` elements each, the part ``j`` from ``start + j * span`` (``W`` elements a step, ``W``
    = 32 bytes of the array's dtype; ``span`` a multiple of ``W``): add the values and their
    squares (in float64) into the lanes ``sums[:W]`` and ``sums[W:]``, and take the lanes' min and
    max into ``ends[:W]`` and ``ends[W:]``; with ``store`` ``_NONTEMPORAL``, also copy ``src`` into
    ``dst`` with nontemporal stores (``dst[start]`` 32-byte aligned), with ``_PLAIN`` with ordinary
    ones (any alignment); ``_NONE``: no copy. The sums do not depend on ``store``: the same loads
    are added in the same order. Each part has accumulators of its own, so
    the parts' additions do not wait on each other. Min and max are ``llvm.minnum``/``llvm.maxnum``,
    which skip a NaN: the sums still show it, and the caller reads min and max only when the sums
    are finite. (``llvm.minimum`` on an explicit vector was made into scalar code here, ~3x
    slower.)"""

    @intrinsic
    def block(typingctx, dst, src, start, span, sums, ends):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            aty = signature.args[1]
            d = context.make_array(signature.args[0])(context, builder, args[0])
            s = context.make_array(aty)(context, builder, args[1])
            acc = context.make_array(signature.args[4])(context, builder, args[4])
            lim = context.make_array(signature.args[5])(context, builder, args[5])
            begin, part = args[2], args[3]
            elem = context.get_value_type(aty.dtype)
            width = _VECTOR_BYTES * 8 // aty.dtype.bitwidth
            i64, i32 = ir.IntType(64), ir.IntType(32)
            vec, wide = ir.VectorType(elem, width), ir.VectorType(ir.DoubleType(), width)
            byte_ptr = ir.IntType(8).as_pointer()
            module = builder.module
            suffix = f"v{width}f{aty.dtype.bitwidth}"

            # Not module.declare_intrinsic (as _binary): llvmlite cannot name an intrinsic over a vector type.
            def declared(name: str, fnty: ir.FunctionType) -> ir.Function:
                found = module.globals.get(name)
                return found if found is not None else ir.Function(module, fnty, name=name)

            lower = declared(f"llvm.minnum.{suffix}", ir.FunctionType(vec, [vec, vec]))
            upper = declared(f"llvm.maxnum.{suffix}", ir.FunctionType(vec, [vec, vec]))
            prefetch = declared("llvm.prefetch.p0", ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]))
            nontemporal = module.add_metadata([ir.Constant(i32, 1)])

            def at(base, index, ty):  # type: ignore[no-untyped-def]
                return builder.bitcast(builder.gep(base, [index]), ty.as_pointer())

            lane = ir.Constant(i64, width)
            zero = ir.Constant(i64, 0)
            size = aty.dtype.bitwidth // 8  # the lanes' arrays are only aligned to their elements
            ahead = ir.Constant(i64, _PREFETCH_BYTES // size)
            read, keep, data = ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)  # prefetch: read, into L1
            first = [builder.load(at(acc.data, zero, wide), align=8),
                     builder.load(at(acc.data, lane, wide), align=8),
                     builder.load(at(lim.data, zero, vec), align=size),
                     builder.load(at(lim.data, lane, vec), align=size)]
            nothing = ir.Constant(wide, None)  # the other parts' sums start at zero, their ends at the first part's
            # The parts in loops of ``group`` each (a copy stores to at most _STORE_STREAMS places at
            # once); a part's sums do not depend on which loop adds them, nor on what else it does.
            group = streams if store == _NONE else _STORE_STREAMS
            states = []
            for g in range(0, streams, group):
                before = builder.block
                head = builder.append_basic_block("stream.head")
                body = builder.append_basic_block("stream.body")
                done = builder.append_basic_block("stream.done")
                builder.branch(head)
                builder.position_at_end(head)
                k = builder.phi(i64)
                k.add_incoming(zero, before)
                loop = []
                for j in range(g, g + group):
                    start_values = first if j == 0 else [nothing, nothing, first[2], first[3]]
                    phis = [builder.phi(v.type) for v in start_values]
                    for phi, v in zip(phis, start_values):
                        phi.add_incoming(v, before)
                    loop.append((j, phis))
                builder.cbranch(builder.icmp_signed("<", k, part), body, done)
                builder.position_at_end(body)
                for j, state in loop:
                    index = builder.add(builder.add(begin, builder.mul(part, ir.Constant(i64, j))), k)
                    # (a prefetch past the array's end is harmless: a hint, it never faults)
                    builder.call(prefetch, [builder.bitcast(builder.gep(s.data, [builder.add(index, ahead)]),
                                                            byte_ptr), read, keep, data])
                    v = builder.load(at(s.data, index, vec), align=size)
                    if store == _NONTEMPORAL:
                        builder.store(v, at(d.data, index, vec), align=_VECTOR_BYTES).set_metadata("nontemporal",
                                                                                                   nontemporal)
                    elif store == _PLAIN:
                        builder.store(v, at(d.data, index, vec), align=size)
                    w = builder.fpext(v, wide) if aty.dtype.bitwidth == 32 else v
                    total, squares, lo, hi = state
                    # Strict IEEE additions, no fused multiply-add: each part's sums the same bits in
                    # every form of the loop (with or without a copy, in a loop of 2 parts or of 4).
                    after = [builder.fadd(total, w), builder.fadd(squares, builder.fmul(w, w)),
                             builder.call(lower, [lo, v]), builder.call(upper, [hi, v])]
                    for phi, v in zip(state, after):
                        phi.add_incoming(v, body)
                k.add_incoming(builder.add(k, lane), body)
                builder.branch(head)
                builder.position_at_end(done)
                states += [state for _, state in loop]
            total, squares, lo, hi = states[0]
            for other in states[1:]:
                total = builder.fadd(total, other[0])
                squares = builder.fadd(squares, other[1])
                lo, hi = builder.call(lower, [lo, other[2]]), builder.call(upper, [hi, other[3]])
            for value, base, offset, align in zip((total, squares, lo, hi), (acc.data, acc.data, lim.data, lim.data),
                                                  (zero, lane, zero, lane), (8, 8, size, size)):
                builder.store(value, at(base, offset, value.type), align=align)
            if store == _NONTEMPORAL:  # the copy is complete before anything after it (the writer's hand-over)
                builder.call(declared("llvm.x86.sse.sfence", ir.FunctionType(ir.VoidType(), [])), [])
            return context.get_dummy_value()

        return numba.types.none(dst, src, start, span, sums, ends), codegen

    return block


_NONE, _NONTEMPORAL, _PLAIN = 0, 1, 2  # what a block stores: nothing, or a copy, nontemporal or not
_read_block, _copy_block, _plain_copy_block = (_block(_STREAMS, store) for store in (_NONE, _NONTEMPORAL, _PLAIN))


@intrinsic
def _address(typingctx, arr):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.ptrtoint(context.make_array(signature.args[0])(context, builder, args[0]).data, ir.IntType(64))

    return numba.types.int64(arr), codegen


def _stream_sums(x, out):  # type: ignore[no-untyped-def]
    """``_read_sums(x)`` (the same statistics, bit for bit), copying ``x`` into ``out`` in the same
    read. The copy is made with nontemporal stores when ``out`` is 32-byte aligned (the staging
    pool's buffers are: recorder.items.copy_buffer): a copied payload is not read again soon
    (flight mode's ring, the writer's queue), so its bytes need not pass through the cache, and the
    store does not first read the destination (in a GPT-2 step ~200 -> ~155 us per MB of payload,
    and the training's data stays in cache); with ordinary stores otherwise."""
    return _streamed(x, out, _NONTEMPORAL if _address(out) % _VECTOR_BYTES == 0 else _PLAIN)


def _read_sums(x):  # type: ignore[no-untyped-def]
    """The sums of ``x`` read as ``_STREAMS`` parallel streams. The parts depend only on the length
    (no alignment is needed to read), so an array's sums do not change with where it lies."""
    return _streamed(x, x, _NONE)


def _streamed(x, out, store):  # type: ignore[no-untyped-def]
    """The block of ``_STREAMS`` streams from the array's start, each a whole number of vectors, as
    long as the length allows (copying into ``out`` as ``store`` says), then the elements after it.
    Compiled without fast-math: the parts' sums and the tail are added in the order written
    whatever ``store`` is (so that a copy's statistics are those of the read: LLVM may otherwise
    reassociate each version differently)."""
    n = x.shape[0]
    width = _VECTOR_BYTES // x.itemsize
    span = n // (width * _STREAMS) * width
    sums = np.zeros(2 * width, np.float64)
    ends = np.full(2 * width, x[0], x.dtype)
    if store == _NONTEMPORAL:
        _copy_block(out, x, 0, span, sums, ends)
    elif store == _PLAIN:
        _plain_copy_block(out, x, 0, span, sums, ends)
    else:
        _read_block(out, x, 0, span, sums, ends)
    lo = x[0]
    hi = x[0]
    total = 0.0
    squares = 0.0
    for j in range(width):
        total += sums[j]
        squares += sums[width + j]
        lo = min(lo, ends[j])
        hi = max(hi, ends[width + j])
    for i in range(_STREAMS * span, n):  # the tail: fewer than _STREAMS vectors
        v = x[i]
        if store != _NONE:
            out[i] = v
        lo = _minimum(lo, v)
        hi = _maximum(hi, v)
        w = np.float64(v)
        total += w
        squares += w * w
    return lo, hi, total, squares


if _STREAM_BYTES is not None:
    _streamed = _compiled(_signatures("{t}[::1], {t}[::1], int64"), fastmath=False)(_streamed)
    _stream_sums = _compiled(_signatures("{t}[::1], {t}[::1]"))(_stream_sums)
    _read_sums = _compiled(_SIGNATURES)(_read_sums)


def sums(x: np.ndarray) -> tuple[float, float, float, float]:
    """(min, max, sum, sum of squares) of a non-empty 1-D contiguous float32 or float64 array, as
    Python floats. Only meaningful when all four are finite (see the module's notes)."""
    big = _STREAM_BYTES is not None and x.nbytes >= _STREAM_BYTES
    lo, hi, total, squares = _read_sums(x) if big else _sums(x)
    return float(lo), float(hi), float(total), float(squares)


def copy_sums(x: np.ndarray, out: np.ndarray) -> tuple[float, float, float, float]:
    """``sums(x)``, copying ``x`` into ``out`` (same dtype and size) in the same pass."""
    if out.shape != x.shape:
        raise ValueError(f"copy_sums: {x.shape} into {out.shape}")
    big = _STREAM_BYTES is not None and x.nbytes >= _STREAM_BYTES
    if big:
        lo, hi, total, squares = _stream_sums(x, out)
    else:  # the copy, then the sums of the read (one compiled loop: the same bits as sums(x))
        _copy(x, out)
        lo, hi, total, squares = _sums(x)
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
        if _STREAM_BYTES is None:
            continue
        # The streaming copy, into an aligned start (nontemporal stores) and an unaligned one (ordinary
        # stores), with a tail; a NaN shows in its sums.
        x = np.arange(-2000, 2000 + 37, dtype=dtype) / 8
        exact = x.astype(np.float64)  # (every sum here is exact in float64)
        want = (float(x.min()), float(x.max()), float(exact.sum()), float(np.dot(exact, exact)))
        room = np.zeros(len(x) + 16, dtype)
        aligned = (-room.ctypes.data % _VECTOR_BYTES) // x.itemsize
        for at in (aligned, aligned + 3):
            room[:] = 0
            out = room[at:at + len(x)]
            got = _stream_sums(x, out)
            if (tuple(map(float, got)) != want or not np.array_equal(out, x) or room[:at].any()
                    or room[at + len(x):].any()):
                raise RuntimeError(f"the statistics kernel's streaming copy gave {got} for {dtype.__name__}, "
                                   f"numpy {want}")
        got = _read_sums(x)
        if tuple(map(float, got)) != want:
            raise RuntimeError(f"the statistics kernel's streamed read gave {got} for {dtype.__name__}, numpy {want}")
        x[len(x) // 2] = np.nan
        if not all(np.isnan(_stream_sums(x, out)[2:])) or not all(np.isnan(_read_sums(x)[2:])):
            raise RuntimeError(f"the statistics kernel's streams missed a NaN in {dtype.__name__}")


_check()
