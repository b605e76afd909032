"""The one-pass statistics kernel (recorder.kernels, numba): the statistics it gives are those of the
exact path, for any float32/float64 values; non-finite values take the exact path; it is what a
recording uses; and without it everything still works."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recorder
from recorder import stats


@pytest.fixture
def kernel():
    """The kernel loaded (it must be, where numba is installed: the fast path is not optional here)."""
    assert stats.prepare(), "numba is installed but the statistics kernel did not load"
    yield stats._slot.active
    stats.use_kernel(True)


def reference(t: torch.Tensor) -> tuple[float, ...]:
    """The statistics of the finite values in numpy's long double (x86's 80-bit extended: the range
    of float64's squares, and more precision)."""
    x = t.detach().reshape(-1).double().numpy()
    nan, inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    finite = x[np.isfinite(x)].astype(np.longdouble)
    if len(finite) == 0:
        return (math.nan,) * 6 + (float(nan), float(inf))
    std = float(finite.std(ddof=1)) if len(finite) > 1 else math.nan
    return (float(finite.min()), float(finite.max()), float(finite.mean()), std, float(np.abs(finite).max()),
            float(np.sqrt(np.dot(finite, finite))), float(nan), float(inf))


def assert_close(got: tuple[float, ...], want: tuple[float, ...], t: torch.Tensor) -> None:
    def same(a: float, b: float) -> bool:
        return a == b or (math.isnan(a) and math.isnan(b))

    assert same(got[0], want[0]) and same(got[1], want[1]) and same(got[4], want[4]), t  # min, max, abs-max: exact
    assert got[6:] == want[6:], t  # NaN and Inf counts: exact
    for name, a, b in zip(("mean", "std", "norm"), (got[2], got[3], got[5]), (want[2], want[3], want[5])):
        scale = max(abs(want[0]), abs(want[1]), 1e-300)
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5, abs=1e-6 * scale), (name, t)


finite32 = st.floats(-2.0**100, 2.0**100, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
special = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, 3.0e38, -3.0e38])


@st.composite
def arrays(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    n = draw(st.one_of(st.integers(1, 70), st.integers(4090, 4100), st.integers(8190, 8200),
                       st.integers(20_000, 40_000)))
    kind = draw(st.sampled_from(["normal", "offset", "constant", "values", "special", "bits"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if kind == "bits":  # any bit pattern: signalling and quiet NaNs with payloads, Inf, subnormals
        words = torch.randint(-2**31, 2**31, (n * dtype.itemsize // 4,), generator=gen, dtype=torch.int64)
        t = words.to(torch.int32).view(dtype).clone()
    elif kind == "constant":
        t = torch.full((n,), draw(finite32), dtype=dtype)
    elif kind == "values":
        t = torch.tensor(draw(st.lists(finite32, min_size=1, max_size=64)), dtype=dtype)
    else:
        t = torch.randn(n, generator=gen, dtype=dtype) * draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e6, 1e15]))
        if kind == "offset":  # mean large against the spread: the sums cancel
            t += draw(st.sampled_from([1e3, 1e6, -1e8]))
        if kind == "special":
            for _ in range(draw(st.integers(1, 5))):
                t[draw(st.integers(0, n - 1))] = draw(special)
    return t


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=arrays())
def test_kernel_statistics_equal_the_exact_ones(kernel, t):
    """min, max and abs-max are exact, counts exact, moments within float32 rounding of float64's."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reaches the user's process
        got = stats.host_stats(t)
    assert_close(got, reference(t), t)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from([torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]),
       values=st.lists(st.integers(-2**53, 2**53), min_size=1, max_size=300))
def test_small_integer_statistics_equal_the_exact_ones(kernel, dtype, values):
    """Small integer and boolean tensors (position ids, masks) go through the kernel as float64:
    the same statistics as the exact path."""
    info = torch.iinfo(dtype) if dtype != torch.bool else None
    t = torch.tensor([v != 0 if info is None else min(max(v, info.min), info.max) for v in values], dtype=dtype)
    assert_close(stats.host_stats(t), reference(t), t)


def test_kernel_is_what_the_statistics_use(kernel, monkeypatch):
    """Tensors of every size go through the kernel while torch runs on at most KERNEL_THREADS
    threads; above that, only small ones do (torch's parallel reductions are faster)."""
    calls = []
    real = kernel.sums
    monkeypatch.setattr(kernel, "sums", lambda x: calls.append(len(x)) or real(x))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        stats.host_stats(torch.randn(10))
        stats.host_stats(torch.randn(100_000))
        stats.host_stats(torch.randn(300, 400).t())  # large and strided: copied in logical order, then the kernel
        assert calls == [10, 100_000, 120_000]
        torch.set_num_threads(stats.KERNEL_THREADS + 1)
        stats.host_stats(torch.randn(100_000))
        stats.host_stats(torch.randn(20))
        stats.host_stats(torch.arange(128).reshape(1, 128))  # position ids: as float64
        assert calls == [10, 100_000, 120_000, 20, 128]
    finally:
        torch.set_num_threads(threads)


def test_kernel_refuses_other_arrays_instead_of_compiling(kernel):
    """Compiled ahead for exactly float32/float64 contiguous arrays: anything else is a TypeError
    (never a compilation in the middle of a training step)."""
    for bad in (np.arange(10, dtype=np.float32)[::2], np.arange(10, dtype=np.int64), np.ones((2, 2))):
        with pytest.raises(TypeError):
            kernel.sums(bad)


def test_recording_without_the_kernel_gives_the_same_statistics(tmp_path, kernel):
    """With the kernel off (numba missing), a recording's statistics are those of the exact path."""

    @recorder.paper_step("Eq. 1", description="scale")
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    x = torch.randn(5000)
    x[7] = math.nan
    records = {}
    for enabled in (True, False):
        stats.use_kernel(enabled)
        with recorder.record(str(tmp_path / f"run{enabled}.zarr")) as run:
            scale(x)
        from recorder.store.reader import RunReader

        rank = RunReader(str(run.path)).rank(0)
        records[enabled] = [r.stats for r in rank.tensor_records(0)]
    for on, off in zip(records[True], records[False], strict=True):
        assert on["nan"] == off["nan"] and on["min"] == off["min"] and on["max"] == off["max"]
        assert on["mean"] == pytest.approx(off["mean"], rel=1e-6) and on["norm"] == pytest.approx(off["norm"], rel=1e-6)
    assert records[True][0]["nan"] == 1 and records[True][1]["nan"] == 1  # input and output


def same_bits(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return np.array_equal(np.array(a, np.float64).view(np.uint64), np.array(b, np.float64).view(np.uint64))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=arrays(), offset=st.integers(0, 7))
def test_copy_with_statistics_copies_bitwise(kernel, t, offset):
    """copy_stats (a payload's copy in full and flight modes) writes the tensor's exact bytes, NaN
    payloads and -0.0 included, into a buffer at any element offset (offset 0 of an aligned buffer:
    nontemporal stores; the others: ordinary ones) and nothing around it, and gives bit for bit the
    statistics host_stats gives (stats mode's read): two runs are compared by them."""
    from recorder import payload
    from recorder.items import copy_buffer

    t[0] = -0.0 if t.numel() > 2 else t[0]
    units, _, _ = payload.as_units(t)
    room = copy_buffer((len(units) + 8) * units.itemsize).view(units.dtype)
    room[:] = 0
    dst = room[offset:offset + len(units)]
    got = stats.copy_stats(t, dst, units)
    assert np.array_equal(dst, units)  # unsigned units: bitwise
    assert not room[:offset].any() and not room[offset + len(units):].any()
    assert got is not None
    assert_close(got, reference(t), t)
    assert same_bits(got, stats.host_stats(t)), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_statistics_of_a_copy_are_those_of_the_read_bitwise(kernel, dtype):
    """Around every size where the kernel changes its form (small arrays, streamed ones, the tail
    past whole vectors of the streams), at every destination alignment: the same bits."""
    from recorder import kernels, payload
    from recorder.items import copy_buffer

    width = 32 // dtype.itemsize
    streamed = kernels._STREAM_BYTES // dtype.itemsize if kernels._STREAM_BYTES else 4096
    sizes = sorted({n for base in (1, 4 * width, streamed, 8 * streamed + 4 * width * 7)
                    for n in range(max(1, base - 4 * width - 2), base + 4 * width + 2)})
    gen = torch.Generator().manual_seed(5)
    for n in sizes:
        t = torch.randn(n, generator=gen, dtype=dtype) * 1e3 + 7
        want = stats.host_stats(t)
        units, _, _ = payload.as_units(t)
        room = copy_buffer((n + 8) * units.itemsize).view(units.dtype)
        for offset in range(8):
            assert same_bits(stats.copy_stats(t, room[offset:offset + n], units), want), (n, offset)
            assert np.array_equal(room[offset:offset + n], units), (n, offset)


def test_the_recorders_copy_buffers_take_the_nontemporal_copy():
    """Payload buffers from the size the kernel streams its copy at start at a multiple of 64 bytes
    (the nontemporal stores need 32: into an unaligned buffer the copy takes ordinary stores, ~1.5x
    slower), those of the staging pool too; smaller ones need not."""
    from recorder import kernels
    from recorder.items import ALIGNED_FROM, StagingPool, copy_buffer

    assert kernels._STREAM_BYTES is None or ALIGNED_FROM <= kernels._STREAM_BYTES
    held = [copy_buffer(n) for n in (ALIGNED_FROM, ALIGNED_FROM + 3, 100_003, 1 << 20) for _ in range(4)]
    pool = StagingPool()
    held += [pool.take(n) for n in (StagingPool.MIN_BYTES, 300_000, 5 << 20)]
    with torch.device("meta"):  # the user's default device, another than the CPU: still host memory
        held.append(copy_buffer(1 << 20))
    assert all(b.ctypes.data % 64 == 0 for b in held)
    assert [len(b) for b in held[:4]] == [ALIGNED_FROM] * 4 and len(copy_buffer(100)) == 100
    held[-1][:] = 7
    assert held[-1].sum() == 7 << 20


def test_copy_without_the_kernel_still_copies(kernel):
    """Dtypes the kernel does not take (and every dtype with the kernel off) are copied as bytes
    and left to host_stats."""
    from recorder import payload

    for t in (torch.arange(10, dtype=torch.int64), torch.randn(100).half()):
        units, _, _ = payload.as_units(t)
        dst = np.zeros_like(units)
        assert stats.copy_stats(t, dst, units) is None and np.array_equal(dst, units)
    stats.use_kernel(False)
    t = torch.randn(1000)
    units, _, _ = payload.as_units(t)
    dst = np.zeros_like(units)
    assert stats.copy_stats(t, dst, units) is None and np.array_equal(dst, units)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [4096 + 37, 100_003])
def test_a_non_finite_value_is_found_in_every_part_of_a_streamed_array(kernel, dtype, n):
    """Large arrays are read as parallel streams, each a part of the array, plus the elements before
    and after them: a NaN or an Inf at any part's first or last element, or anywhere between, is
    counted, with and without a copy, and the other statistics are those of the finite values."""
    from recorder import kernels, payload

    width = 32 // dtype.itemsize
    places = {0, 1, n // 2, n - 2, n - 1}
    span = n // (width * kernels._STREAMS) * width
    places |= {j * span + d for j in range(1, kernels._STREAMS + 1) for d in (-1, 0, 1) if 0 <= j * span + d < n}
    base = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    for where in sorted(places):
        for bad in (math.nan, math.inf, -math.inf):
            t = base.clone()
            t[where] = bad
            want = reference(t)
            assert_close(stats.host_stats(t), want, (where, bad))
            units, _, _ = payload.as_units(t)
            dst = np.zeros_like(units)
            assert_close(stats.copy_stats(t, dst, units), want, (where, bad))
            assert np.array_equal(dst, units)


def test_statistics_of_an_array_do_not_depend_on_its_address(kernel):
    """The streamed read splits an array by its length only: the same values at another address
    give bitwise the same statistics (recorded twice, a tensor summarises the same)."""
    values = torch.randn(50_001, generator=torch.Generator().manual_seed(3)) * 1e3 + 7
    room = torch.zeros(50_001 + 16)
    got = set()
    for offset in range(16):
        room[offset:offset + 50_001] = values
        got.add(stats.host_stats(room[offset:offset + 50_001]))
    assert len(got) == 1

def test_kernel_without_the_streaming_copy_elsewhere_than_x86():
    """Off x86-64 the streaming copy (x86's fence instruction) is not compiled, and the kernel
    still loads and copies bitwise."""
    code = ("import platform; platform.machine = lambda: 'aarch64'\n"
            "import numpy as np\n"
            "from recorder import kernels\n"
            "assert kernels._STREAM_BYTES is None\n"
            "x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32); out = np.empty_like(x)\n"
            "got = kernels.copy_sums(x, out)\n"
            "assert np.array_equal(out.view(np.uint32), x.view(np.uint32))\n"
            "assert got[:2] == (float(x.min()), float(x.max()))\n")
    run_python(code)


def test_numba_with_an_older_llvm_leaves_statistics_to_torch():
    """numba before 0.62 has an LLVM (14, 15) whose x86 back end aborts the process on the kernel's
    min and max: the kernel refuses to load there, before compiling, and statistics come from torch."""
    code = ("import llvmlite.binding as b; b.llvm_version_info = (15, 0, 7)\n"
            "import torch\n"
            "from recorder import stats\n"
            "assert not stats.prepare()\n"
            "got = stats.host_stats(torch.tensor([1.0, -2.0, 4.0]))\n"
            "assert got[:3] == (-2.0, 4.0, 1.0), got\n")
    run_python(code)


def run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter (what it patches stays there); it must exit 0."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("threads", [1, stats.KERNEL_THREADS + 1])
def test_the_statistics_of_one_tensor_are_the_same_bits_in_every_layout(kernel, threads):
    """The same values contiguous, channels_last, as a strided slice of a larger tensor or permuted had
    statistics of other bits (the kernel's float64 sums for the contiguous one, torch's float32 ones for
    the others): comparing two runs by statistics then named a step whose inputs were the same values."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32, 32) * 3 + 0.5
    big = torch.zeros(8, 16, 32, 64)
    big[..., ::2] = x
    forms = [x, x.contiguous(memory_format=torch.channels_last), big[..., ::2],
             x.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)]
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = [stats.host_stats(f) for f in forms]
    finally:
        torch.set_num_threads(saved)
    assert all(np.array_equal(np.array(g), np.array(got[0]), equal_nan=True) for g in got[1:]), got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.complex64])
def test_low_precision_statistics_are_summed_in_float64(kernel, dtype):
    """bfloat16 and float16 values (and complex64 magnitudes) were summed in float32: the std of 100,000
    gains near 1 was off by 2.5e-3 relative; FORMAT.md promises ~1e-7."""
    torch.manual_seed(0)
    t = (1 + 0.04 * torch.randn(100_000)).to(dtype)
    values = (t.abs() if t.is_complex() else t).double()
    got = stats.host_stats(t)
    assert abs(got[3] - values.std().item()) <= 1e-9 * values.std().item()
    assert abs(got[2] - values.mean().item()) <= 1e-12
