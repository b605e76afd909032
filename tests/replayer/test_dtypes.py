"""Tensors of every dtype through a recorded step, and what a replay says of them: a quantized result
(qint8) has the statistics of its dequantized values, by which a replay compares it and two runs are told
apart; a replay that differs only in the sign of zeros says so; distances are counted in the tensor's
own format (a float8 ULP, a uint64 difference)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import recorder
import replayer
from replayer.compare import BY_STATISTICS, compare

QSCALE = {"scale": 0.1}


@recorder.paper_step("Eq. Q", description="quantize activations to int8")
def quantize(h: torch.Tensor) -> torch.Tensor:
    return torch.quantize_per_tensor(h, QSCALE["scale"], 0, torch.qint8)


@recorder.paper_step("Eq. DQ")
def dequantize(q: torch.Tensor) -> torch.Tensor:
    return q.dequantize() * 2


def _record_quantized(path: Path, scale: float) -> None:
    QSCALE["scale"] = scale
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch deprecates quantize_per_tensor)
        with recorder.record(path, mode="full"):
            for _ in range(2):
                dequantize(quantize(torch.randn(4, 4)))


def test_a_quantized_result_has_the_statistics_of_its_values_and_replays_by_them(tmp_path: Path) -> None:
    """A step that returns a qint8 tensor is recorded with its dequantized values' statistics, and a
    replay compares it by them, saying so, instead of failing on a dtype it cannot summarise."""
    _record_quantized(tmp_path / "run.zarr", 0.1)
    rec = replayer.open(tmp_path / "run.zarr")
    step = rec.steps.filter(name="quantize")[0]
    out = step.record("output")
    values = torch.quantize_per_tensor(step.tensor("args.0"), 0.1, 0, torch.qint8).dequantize()
    assert out.dtype == "qint8" and not out.has_payload
    assert (out.stats["min"], out.stats["max"], out.stats["nan"]) == (values.min().item(), values.max().item(), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = replayer.replay(rec, step)
    assert result.match
    assert result.diffs["output"].reason.startswith(BY_STATISTICS)


def test_two_runs_whose_quantized_results_differ_part_at_the_quantizing_step(tmp_path: Path) -> None:
    """bisect --against names the step whose qint8 result differs, not the step after it."""
    _record_quantized(tmp_path / "a.zarr", 0.1)
    _record_quantized(tmp_path / "b.zarr", 0.05)
    div = replayer.first_divergence(tmp_path / "a.zarr", tmp_path / "b.zarr")
    assert div.step is not None and div.step.name == "quantize"


SIGN = {"sign": 1.0}


@recorder.paper_step("Eq. Z")
def zero_out(x: torch.Tensor) -> torch.Tensor:
    return x * 0.0 * SIGN["sign"]


def test_a_replay_that_differs_in_the_sign_of_zeros_only_says_so(tmp_path: Path) -> None:
    """+0 recorded and -0 replayed are a mismatch (other bits), whose reason says why: no distance shows it."""
    SIGN["sign"] = 1.0
    with recorder.record(tmp_path / "run.zarr"):
        zero_out(torch.ones(4))
        zero_out(torch.ones(2, 3, dtype=torch.complex64))
    SIGN["sign"] = -1.0
    try:
        rec = replayer.open(tmp_path / "run.zarr")
        real, complex_ = (replayer.replay(rec, s).diffs["output"] for s in rec.steps.filter(name="zero_out"))
    finally:
        SIGN["sign"] = 1.0
    assert not real.match and real.mismatched == 4 and real.max_ulp == 0
    assert real.reason is not None and real.reason.startswith("signed zeros differ: 4 values")
    assert real.summary() == f"output: {real.reason}"
    assert not complex_.match and complex_.reason is not None and "signed zeros differ: 6 values" in complex_.reason


def test_signed_zeros_beside_values_that_differ_keep_the_distance_in_the_summary() -> None:
    diff = compare("output", "output", torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.5]))
    assert diff.max_ulp == 1 << 22 and diff.reason is not None
    assert diff.summary().startswith("output: 2 elements differ, max abs 0.5") and "signed zeros differ: 1 value" in \
        diff.summary()


def test_float8_distances_count_their_own_ulps() -> None:
    """One representable step of a float8 format is 1 ULP, not the float32 ULPs between the two values."""
    for name, a, b in (("float8_e4m3fn", 2.0, 2.25), ("float8_e5m2", 2.0, 2.5), ("float8_e4m3fnuz", 2.0, 2.25),
                       ("float8_e5m2fnuz", -2.0, -2.5), ("float8_e8m0fnu", 2.0, 4.0)):
        dtype = getattr(torch, name)
        diff = compare("output", "output", torch.tensor([1.0, a]).to(dtype), torch.tensor([1.0, b]).to(dtype))
        assert (name, diff.mismatched, diff.max_ulp) == (name, 1, 1)
    across_zero = compare("output", "output", torch.tensor([0.015625]).to(torch.float8_e4m3fn),
                          torch.tensor([-0.015625]).to(torch.float8_e4m3fn))
    assert across_zero.max_ulp == 16  # 2 ** -6, the smallest normal (0x08), and its negation: 8 steps each side


def test_uint64_distances_are_the_values_gaps() -> None:
    recorded = torch.tensor([5, 2**63, 2**64 - 1], dtype=torch.uint64)
    replayed = torch.tensor([9, 2**63 + 4, 0], dtype=torch.uint64)
    diff = compare("output", "output", recorded, replayed)
    assert (diff.mismatched, diff.max_abs_diff, diff.max_ulp) == (3, float(2**64 - 1), 2**64 - 1)
    small = compare("output", "output", recorded[:2], replayed[:2])
    assert (small.max_abs_diff, small.max_rel_diff, small.max_ulp) == (4.0, 0.8, 4)


@recorder.paper_step("Eq. S")
def layout_of(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([*x.stride(), int(x.is_contiguous())])


def test_an_empty_argument_is_replayed_with_its_recorded_strides(tmp_path: Path) -> None:
    """A zero-size view (a transposed empty batch) keeps its strides in a replay, as a tensor with values does."""
    with recorder.record(tmp_path / "run.zarr"):
        layout_of(torch.randn(4, 0, 3).transpose(0, 2))
        layout_of(torch.randn(6, 8)[2:, 3:].t())
    rec = replayer.open(tmp_path / "run.zarr")
    for step in rec.steps.filter(name="layout_of"):
        assert replayer.replay(rec, step).match, step.tensor("output")
    assert rec.steps.filter(name="layout_of")[0].tensor("output").tolist() == [1, 3, 3, 1]


@recorder.paper_step("Eq. B")
def passthru(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_dtypes_without_arithmetic_replay_and_compare_by_bits(tmp_path: Path) -> None:
    """bits16 and float4_e2m1fn_x2 (packed formats torch stores but does not compute with) replay bit for
    bit; a difference in them is said in bits, without a distance."""
    dtypes = [getattr(torch, n) for n in ("bits16", "bits8", "float4_e2m1fn_x2") if hasattr(torch, n)]
    tensors = [torch.arange(6, dtype=torch.int16 if d.itemsize == 2 else torch.uint8).view(d) for d in dtypes]
    with recorder.record(tmp_path / "run.zarr"):
        for t in tensors:
            passthru(t)
    rec = replayer.open(tmp_path / "run.zarr")
    for t, step in zip(tensors, rec.steps.filter(name="passthru")):
        assert replayer.replay(rec, step).match, t.dtype
    other = torch.tensor([0, 1, 7], dtype=torch.int16).view(torch.bits16)
    diff = compare("output", "output", torch.tensor([0, 1, 2], dtype=torch.int16).view(torch.bits16), other)
    assert not diff.match and diff.mismatched == 1 and diff.max_ulp is None and not diff.measured
    assert diff.reason == "bits differ: 1 value (torch has no arithmetic for bits16: no distance)"
