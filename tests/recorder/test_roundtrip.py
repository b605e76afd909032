"""Property: any tensor a step sees comes back from the store bit for bit, whatever its dtype,
shape, strides and values (NaN payloads, -0.0, subnormals included), lazy conjugates included."""

from __future__ import annotations

import numpy as np
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import recorder
from recorder import payload
from recorder.store.reader import RunReader

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
          torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
          torch.complex32, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
          torch.bits8, torch.bits16]


@recorder.paper_step("Eq. 0", description="identity over keyword tensors")
def identity(**tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(tensors)


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    if dtype == torch.bool:  # only 0/1 bytes are valid booleans
        raw = bytes(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if n else \
        torch.empty(shape, dtype=dtype)
    view = draw(st.sampled_from(["contiguous", "transpose", "step", "expand", "conj", "conj imag"]))
    if view == "conj" and t.is_complex():  # a lazy conjugate: its memory does not hold its values
        t = t.conj()
    elif view == "conj imag" and t.is_complex():  # a real view with the negative bit set
        t = t.conj().imag
    elif view == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif view == "step" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[::2]
    elif view == "expand" and t.dim() >= 1 and t.shape[0] == 1:
        t = t.expand(3, *t.shape[1:])
    return t


def _bits(t: torch.Tensor) -> bytes:
    # The values, not the memory, of a conjugate or negative view; contiguous_format recomputes
    # strides: a size-1 dimension may carry any stride otherwise.
    dense = t.resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format).reshape(-1)
    return dense.view(torch.uint8).numpy().tobytes() if t.numel() else b""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tensors(), min_size=1, max_size=4))
def test_tensors_round_trip_bitwise(ts):
    """Inputs and outputs read back with the same dtype, shape, strides and bytes."""
    store = zarr.storage.MemoryStore()
    kwargs = {f"t{i}": t for i, t in enumerate(ts)}
    with recorder.record(store) as run:
        identity(**kwargs)
    assert run.failure is None
    rank = RunReader(store).rank(0)
    records = {(r.role, r.name): r for r in rank.tensor_records(0)}
    for i, t in enumerate(ts):
        for key in (("input", f"kwargs.t{i}"), ("output", f"output.t{i}")):
            rec = records[key]
            assert rec.dtype == payload.dtype_name(t.dtype)
            assert rec.shape == tuple(t.shape) and rec.stride == tuple(t.stride())
            back = rank.tensor(rec)
            assert back.dtype == t.dtype and back.shape == t.shape
            assert _bits(back) == _bits(t)
        assert records[("input", f"kwargs.t{i}")].payload == records[("output", f"output.t{i}")].payload


def test_every_materialisable_dtype_is_covered():
    """The property above draws every torch dtype that has a plain byte layout."""
    skip = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}  # quantized: scale/zero-point, not bytes
    sub_byte = {f"{p}{n}" for p in ("int", "uint") for n in range(1, 8)}  # cannot be materialised by torch
    every = {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}
    drawn = {payload.dtype_name(d) for d in DTYPES}
    assert every - skip - sub_byte - {"bits1x8", "bits2x4", "bits4x2"} <= drawn


def test_quantized_tensor_kept_as_metadata(run_path):
    """A tensor without a plain byte layout is recorded as metadata with a note, not an error."""
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with recorder.record(run_path) as run:
        identity(q=q)
    assert run.failure is None
    rank = RunReader(run_path).rank(0)
    rec = rank.tensor_records(0)[0]
    assert rec.dtype == "qint8" and not rec.has_payload
    assert any("qint8" in n for n in rank.doc(int(rank.column("steps/extra")[0]))["notes"])


@recorder.paper_step("Eq. 0b", description="lazy conjugate and negation views")
def conjugates(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return z.conj(), z.conj().imag


def test_conjugate_and_negative_views_keep_their_values_and_statistics(run_path):
    """``z.conj()`` only flips a bit (and ``z.conj().imag`` is a real view with the negative bit):
    their payloads hold the values the step returned, and their statistics are those values'."""
    z = torch.complex(torch.randn(3, 4), torch.randn(3, 4))
    with recorder.record(run_path, mode="full") as run:
        conj, imag = conjugates(z)
    assert conj.is_conj() and imag.is_neg() and run.failure is None
    rank = RunReader(run_path).rank(0)
    records = {r.name: r for r in rank.tensor_records(0) if r.role == "output"}
    assert rank.column("steps/extra")[0] == -1  # no notes: nothing was kept as metadata only
    for name, want in (("output.0", conj), ("output.1", imag)):
        back = rank.tensor(records[name])
        assert not (back.is_conj() or back.is_neg())
        assert _bits(back) == _bits(want)
    assert records["output.1"].stats["max"] == float(-z.imag.min())
    assert records["output.1"].stats["min"] == float(-z.imag.max())
