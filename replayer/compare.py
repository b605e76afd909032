"""Comparing a replayed tensor with the recorded one: bitwise, max abs/rel difference, ULP distance."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from recorder import payload
from recorder import stats as stats_mod
from recorder.errors import brief
from recorder.store import layout

_ORDERED_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                torch.bfloat16: torch.int16}
# float8 formats are sign and magnitude like the others (e8m0 has no sign): a ULP is one of their own values
_ORDERED_INT.update({getattr(torch, name): torch.int8 for name in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, name)})
if hasattr(torch, "float8_e8m0fnu"):
    _ORDERED_INT[torch.float8_e8m0fnu] = torch.uint8
SHOWN_STATS = ("min", "max", "mean", "std", "nan", "inf")
BY_STATISTICS = "compared by statistics"  # how the reason of a comparison of statistics (Diff.by_statistics) starts


def stats_dict(values: Any) -> dict[str, float | None]:
    """The statistics the JSON output shows (README, "Command line"): min, max, mean, std, nan, inf
    (None where a value is NaN, so that the JSON stays strict)."""
    full = values if isinstance(values, dict) else dict(zip(layout.STAT_NAMES, (float(v) for v in values)))
    out: dict[str, float | None] = {}
    for key in SHOWN_STATS:
        v = full.get(key)
        v = None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)
        out[key] = int(v) if key in ("nan", "inf") and v is not None else v
    return out


@dataclass
class Diff:
    """How one replayed tensor compares with its recording."""

    name: str
    role: str
    match: bool  # bit for bit (NaN positions and signed zeros included)
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    max_ulp: int | None = 0  # None where NaN/Inf differ (no distance means anything there: ``reason`` says what)
    mismatched: int = 0  # elements whose bits differ
    # A shape, dtype or presence difference, when values cannot be compared; or which NaN/Inf differ
    # (positions, bits), where max_abs_diff and max_rel_diff are inf (null in JSON) and max_ulp None.
    reason: str | None = None
    recorded: dict[str, Any] = field(default_factory=dict)
    replayed: dict[str, Any] = field(default_factory=dict)
    is_complex: bool = False  # a complex tensor, recorded or replayed: its statistics are of magnitudes |z|

    def to_json(self) -> dict[str, Any]:
        def clean(x: float) -> float | None:
            return None if isinstance(x, float) and not math.isfinite(x) else x

        far = self.measured
        return {"name": self.name, "role": self.role, "match": self.match,
                "max_abs_diff": clean(self.max_abs_diff) if far else None,
                "max_rel_diff": clean(self.max_rel_diff) if far else None, "max_ulp": self.max_ulp if far else None,
                "mismatched": self.mismatched, "reason": self.reason, "recorded": self.recorded,
                "replayed": self.replayed}

    def summary(self) -> str:
        if self.reason and not (self.measured and not self.match and self.max_ulp):
            return f"{self.name}: {self.reason}"
        if self.match:
            return f"{self.name}: bitwise equal"
        return (f"{self.name}: {self.mismatched} elements differ, max abs {self.max_abs_diff:.3g}, "
                f"max rel {self.max_rel_diff:.3g}, {self.max_ulp} ULP" + (f"; {self.reason}" if self.reason else ""))

    @property
    def measured(self) -> bool:
        """Whether ``max_abs_diff``, ``max_rel_diff`` and ``max_ulp`` measure a distance: the values were
        compared element by element (of one dtype and shape, both there) and no NaN or Inf differ. Where
        shapes differ (an edit that gives an expert 2 tokens where it had none), or only statistics were
        compared, they mean nothing."""
        return self.max_ulp is not None and (self.match or self.mismatched > 0) and not self.by_statistics

    @property
    def by_statistics(self) -> bool:
        """Whether the comparison was by statistics only, not bit for bit: the recording kept no payload
        of the tensor (a sparse one whose parts it did not keep: stats mode, a recording before schema 1.19;
        dropped bytes)."""
        return (self.reason or "").startswith(BY_STATISTICS)

    @property
    def nonfinite_differs(self) -> bool:
        """Whether NaN or Inf differ between the recording and the replay (``max_ulp`` is None then)."""
        return self.max_ulp is None


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype == torch.bool:
        return t.view(torch.uint8).reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).view(width)


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Floats mapped to integers whose order and distance count representable values (ULPs)."""
    ints = t.contiguous().view(_ORDERED_INT[t.dtype]).to(torch.int64)
    sign_min = -(1 << (8 * t.element_size() - 1))
    return torch.where(ints < 0, sign_min - ints, ints)


def _summary(t: torch.Tensor) -> tuple[float, ...]:
    """``t``'s statistics; those of no values for a dtype torch stores but has no arithmetic for
    (bits16, float4_e2m1fn_x2), as the recorder keeps them."""
    try:
        return stats_mod.host_stats(t)
    except (NotImplementedError, RuntimeError, TypeError):
        return stats_mod.EMPTY


@functools.cache
def _arithmetic(dtype: torch.dtype) -> bool:
    """Whether torch computes with ``dtype`` (a distance between two of its values means something)."""
    if dtype.is_complex:  # (complex32 included: compared by its real and imaginary parts)
        return True
    try:
        torch.zeros(1, dtype=dtype).to(torch.float64)
        return True
    except (NotImplementedError, RuntimeError, TypeError):
        return False


def statistics(value: Any) -> dict[str, float | None]:
    """The statistics of a replayed tensor that no record compares (one a swapped-in replacement returned
    where the recorded call returned another structure): shown, and counted among the non-finite values a
    replay made, as a compared one's are. Empty for anything but a dense tensor."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return {}
    with torch._C.DisableTorchFunction():
        value = payload.materialized(value).detach().cpu().resolve_conj().resolve_neg()
    return stats_dict(_summary(value))


def compare(name: str, role: str, recorded: torch.Tensor, replayed: Any, recorded_stats: Any = None) -> Diff:
    """Compare a replayed value with the recorded tensor (both moved to the CPU)."""
    rec_stats = stats_dict(recorded_stats if recorded_stats is not None else _summary(recorded))
    if not isinstance(replayed, torch.Tensor):
        return Diff(name, role, False, math.inf, math.inf, 0, reason=f"replay gave {type(replayed).__name__}, "
                    "not a tensor", recorded=rec_stats, is_complex=recorded.is_complex())
    # Values, not memory: a lazy conjugate or negation (``z.conj()``) only flips a bit on its tensor. Read
    # as a plain tensor: a subclass's __torch_function__ (one that rounds, or refuses what it does not
    # know) has no say in the replay's reading of it.
    with torch._C.DisableTorchFunction():
        replayed = replayed.detach().cpu().resolve_conj().resolve_neg()
        recorded = recorded.detach().cpu().resolve_conj().resolve_neg()
    rep_stats = stats_dict(_summary(replayed))
    diff = Diff(name, role, True, recorded=rec_stats, replayed=rep_stats,
                is_complex=recorded.is_complex() or replayed.is_complex())
    if replayed.dtype != recorded.dtype or tuple(replayed.shape) != tuple(recorded.shape):
        diff.match, diff.max_abs_diff, diff.max_rel_diff = False, math.inf, math.inf
        what = "shapes differ" if replayed.dtype == recorded.dtype else "dtypes differ" if tuple(
            replayed.shape) == tuple(recorded.shape) else "dtypes and shapes differ"
        diff.reason = (f"{what}: recorded {str(recorded.dtype).removeprefix('torch.')}{list(recorded.shape)}, replayed "
                       f"{str(replayed.dtype).removeprefix('torch.')}{list(replayed.shape)}")
        return diff
    differ = _bits(recorded) != _bits(replayed)
    diff.mismatched = int(differ.sum())
    if recorded.is_complex():
        diff.mismatched = int(differ.reshape(-1, 2).any(dim=1).sum())
    diff.match = diff.mismatched == 0
    if diff.match or recorded.numel() == 0:
        return diff
    if not _arithmetic(recorded.dtype):
        diff.max_abs_diff = diff.max_rel_diff = math.inf
        diff.max_ulp = None
        diff.reason = (f"bits differ: {diff.mismatched} value{'s' if diff.mismatched != 1 else ''} (torch has no "
                       f"arithmetic for {payload.dtype_name(recorded.dtype)}: no distance)")
        return diff
    a, b = recorded, replayed
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        both = torch.isfinite(a64) & torch.isfinite(b64)
        gap = (a64 - b64).abs()
        bits = _bits(a).reshape(a.shape) != _bits(b).reshape(b.shape)
        if recorded.is_complex():  # by element (its real and imaginary part), as the statistics and mismatched count
            whole = both.all(-1)
            special = _nonfinite_difference(_nan_elements(a64), _nan_elements(b64), ~whole & bits.any(-1))
            finite = whole.unsqueeze(-1) & (gap != 0)  # the parts that differ of elements finite in both
            many = int(finite.any(-1).sum())
        else:
            special = _nonfinite_difference(torch.isnan(a64), torch.isnan(b64), ~both & bits)
            finite = both & (gap != 0)
            many = int(finite.sum())
        if special is not None:  # an inf gap and a ULP count mean nothing there: say which differ instead
            diff.max_abs_diff = diff.max_rel_diff = math.inf
            diff.max_ulp = None
            if many:
                rel = gap[finite] / a64[finite].abs()
                special += (f"; {many} value{'s' if many != 1 else ''} finite in both differ{'s' if many == 1 else ''} "
                            "too, by at most "
                            f"{float(gap[finite].max()):.3g} (rel {float(rel.max()):.3g})")
            diff.reason = special
            return diff
        diff.max_abs_diff = float(gap[both].max()) if both.any() else 0.0
        rel = gap / a64.abs()  # where the recorded value is 0 and the replayed one is not: inf (nan where both are 0)
        rel = torch.where(gap == 0, 0.0, rel)
        diff.max_rel_diff = float(rel[both].max()) if both.any() else 0.0
        if a.dtype in _ORDERED_INT:
            ulp = (_ordered(a) - _ordered(b)).abs()
            diff.max_ulp = int(ulp.max())
        else:  # a format without an integer ordering here: count ULPs in the nearest supported one
            diff.max_ulp = int((_ordered(a.to(torch.float32)) - _ordered(b.to(torch.float32))).abs().max())
        diff.reason = _signed_zeros(bits & both & (gap == 0), recorded.is_complex())
    elif a.dtype == torch.uint64:  # (int64 wraps past 2**63: each gap is the larger less the smaller, modulo 2**64)
        ua, ub = a.reshape(-1).view(torch.int64), b.reshape(-1).view(torch.int64)
        flip = torch.tensor(-(1 << 63), dtype=torch.int64)  # xor with it orders them as signed
        above = (ua ^ flip) > (ub ^ flip)
        gap = torch.where(above, ua - ub, ub - ua)
        wide = gap < 0  # 2**63 or more
        largest = int(gap[wide].max() if wide.any() else gap.max()) % (1 << 64)
        unsigned = float(1 << 64)
        rel = (gap.to(torch.float64) + wide * unsigned) / (ua.to(torch.float64) + (ua < 0) * unsigned).clamp_min(1)
        diff.max_abs_diff, diff.max_rel_diff, diff.max_ulp = float(largest), float(rel.max()), largest
    else:
        gap = (a.to(torch.int64) - b.to(torch.int64)).abs()
        diff.max_abs_diff = float(gap.max())
        diff.max_rel_diff = float((gap.to(torch.float64) / a.to(torch.float64).abs().clamp_min(1)).max())
        diff.max_ulp = int(gap.max())
    return diff


def _signed_zeros(only_sign: torch.Tensor, complex_: bool) -> str | None:
    """The reason of a mismatch where values equal as numbers differ in their bits (``only_sign``: +0 and
    -0, the only such finite pair), which no distance shows; None where there are none."""
    count = int((only_sign.any(-1) if complex_ else only_sign).sum())
    if not count:
        return None
    return (f"signed zeros differ: {count} value{'s' if count != 1 else ''} +0 in one and -0 in the other "
            "(equal as numbers, not in bits)")


def _nonfinite_difference(nan_a: torch.Tensor, nan_b: torch.Tensor, differ: torch.Tensor) -> str | None:
    """Which NaN and Inf differ between the recorded and the replayed values where ``differ`` (their
    bits differ and one is not finite), from where each is NaN (``nan_a``, ``nan_b``): NaN positions,
    NaN bits (sign or payload, NaN in both), Inf; None where none does."""
    if not bool(differ.any()):
        return None
    parts = []
    for count, what in ((int((differ & nan_a & ~nan_b).sum()), "NaN in the recording and not in the replay"),
                        (int((differ & nan_b & ~nan_a).sum()), "NaN in the replay and not in the recording"),
                        (int((differ & nan_a & nan_b).sum()), "NaN in both whose bits differ (sign or payload)"),
                        (int((differ & ~nan_a & ~nan_b).sum()), "Inf in one and not the same value in the other")):
        if count:
            parts.append(f"{count} value{'s' if count != 1 else ''} {what}")
    positions = "NaN bits differ" if not (nan_a ^ nan_b).any() and not (differ & ~nan_a & ~nan_b).any() \
        else "NaN/Inf positions differ"
    return f"{positions}: {', '.join(parts)}"


def _nan_elements(parts: torch.Tensor) -> torch.Tensor:
    """Where complex values, as their real and imaginary parts (the last dimension), are NaN as the
    statistics count them: their magnitude is (a NaN part and no Inf one; |inf + nan j| is inf)."""
    return torch.isnan(parts).any(-1) & ~torch.isinf(parts).any(-1)


def tensors_by_name(value: Any, prefix: str, *, copy: bool = False, grads: bool = False) -> dict[str, torch.Tensor]:
    """The tensors in a call's output by the record names the recorder gives them (``output``,
    ``output.0``, ``output.key``); ``copy`` detaches and clones them (later in-place changes must
    not show); ``grads`` adds each one's ``.grad`` where it has one (``NAME:grad``)."""
    from recorder import jsonval
    from recorder.store import layout

    found: dict[str, torch.Tensor] = {}

    def name(t: torch.Tensor, path: str) -> str:
        full = f"{prefix}.{path}" if path else prefix
        with torch._C.DisableTorchFunction():  # (a copy is the replay's reading: a plain tensor, as compare's)
            found[full] = t.detach().clone() if copy else t
            grad = grad_of(t) if grads and t.requires_grad else None
            if grad is not None:
                found[f"{full}{layout.GRAD_SUFFIX}"] = grad.detach().clone() if copy else grad
        return full

    jsonval.encode(value, tensor_name=name, module_doc=lambda m: {})  # (a module argument's parameters: 1.30)
    return found


def grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad``; of a tensor that is not a leaf (a step may set one's ``.grad`` itself), without
    the warning torch gives when it has none (an EMA update over a list of parameters)."""
    if t.is_leaf or t.retains_grad:
        return t.grad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return t.grad


def compare_record(rank: Any, record: Any, value: Any, missing: str) -> Diff:
    """Compare a replayed value with one tensor record: bitwise where its payload was kept (of a sparse
    tensor, its parts: 1.19), by statistics where only those were (of a sparse tensor, of the values it
    stores, as the recorder took them); ``missing`` says why there is no value, when there is none."""
    recorded = stats_dict(record.stats)
    complex_ = record.dtype.startswith("complex")
    if value is None:
        return Diff(record.name, record.role, False, reason=missing, recorded=recorded, is_complex=complex_)
    if not isinstance(value, torch.Tensor):
        return Diff(record.name, record.role, False, math.inf, math.inf, 0, reason=f"replay gave "
                    f"{type(value).__name__}, not a tensor", recorded=recorded, is_complex=complex_)
    value = payload.materialized(value)
    sparse = rank.sparse_of(record)
    if sparse is not None or value.layout in stats_mod.SPARSE_LAYOUTS:
        parts = rank.sparse_parts(record) if sparse is not None else None
        if parts is not None:
            return _compare_sparse_parts(rank, record, parts, value)
        return _compare_sparse(record, sparse, value)
    if not record.has_payload:
        now = stats_dict(stats_mod.host_stats(value.detach().cpu()))
        return Diff(record.name, record.role, now == recorded, reason=f"{BY_STATISTICS} only (no payload "
                    "recorded)", recorded=recorded, replayed=now,
                    is_complex=complex_ or value.is_complex())
    return compare(record.name, record.role, rank.tensor(record), value, record.stats)


def _layout_name(t: torch.Tensor) -> str:
    return str(t.layout).removeprefix("torch.")


def _mismatch(record: Any, recorded: dict[str, Any]) -> Callable[..., Diff]:
    """A function that makes a sparse record's mismatch with the replay: its reason, and the replay's
    statistics where they were taken."""
    def differs(reason: str, replayed: dict[str, Any] | None = None) -> Diff:
        return Diff(record.name, record.role, False, math.inf, math.inf, reason=reason, recorded=recorded,
                    replayed=replayed or {})
    return differs


def _unlike(record: Any, layout: str, value: torch.Tensor) -> str | None:
    """How a replayed value is not of a sparse record's layout, dtype or shape; None where it is."""
    if _layout_name(value) != layout:
        return f"layouts differ: recorded {layout}, replayed {_layout_name(value)}"
    dtype = payload.dtype_name(value.dtype)
    if dtype != record.dtype or tuple(value.shape) != tuple(record.shape):
        return (f"dtypes or shapes differ: recorded {record.dtype}{list(record.shape)}, replayed "
                f"{dtype}{list(value.shape)}")
    return None


def _compare_sparse(record: Any, sparse: tuple[str, int | None] | None, value: torch.Tensor) -> Diff:
    """A record or a replayed value that is a sparse tensor (``sparse``: the record's layout and count of
    stored values, None for a strided record), where the recording did not keep its parts: compared by
    the statistics of the values it stores (its indices were not recorded, so two results of the same
    values at other places compare equal, as the reason says); a layout, dtype, shape or count of
    stored values that differs is a mismatch."""
    recorded = stats_dict(record.stats)
    kind = sparse[0] if sparse is not None else "strided"
    differs = _mismatch(record, recorded)
    unlike = _unlike(record, kind, value)
    if unlike is not None:
        return differs(unlike)
    with torch._C.DisableTorchFunction():
        stored = stats_mod.stored_values(value.detach())
        try:  # (a dtype without statistics: the recorder kept none either)
            now = None if stored is None else stats_dict(stats_mod.host_stats(stored.cpu().resolve_conj()))
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            return differs(f"not compared: no statistics of the replay's {kind} tensor ({brief(exc)})")
    if stored is None or now is None:
        return differs(f"not compared: the replay's {kind} tensor gives no stored values to compare")
    count = sparse[1] if sparse is not None else None
    if count is not None and stored.numel() != count:
        return differs(f"the number of stored values differs: recorded {count}, replayed {stored.numel()}", now)
    of = f"its {count} stored values" if count is not None else "its stored values"
    return Diff(record.name, record.role, now == recorded, reason=f"{BY_STATISTICS} of {of} only (a {kind} "
                "tensor: its indices are not recorded)", recorded=recorded, replayed=now)


def _compare_sparse_parts(rank: Any, record: Any, parts: Any, value: torch.Tensor) -> Diff:
    """A sparse record whose parts were kept (``RankReader.sparse_parts``, 1.19) against the replayed
    value: bit for bit, part by part (its indices and values as it held them, a COO tensor's coalesced
    flag too), after its layout, dtype, shape and number of stored values; the distances are its
    values'. Its statistics are of the stored values, as the recorder took them."""
    recorded = stats_dict(record.stats)
    differs = _mismatch(record, recorded)
    unlike = _unlike(record, parts.layout, value)
    if unlike is not None:
        return differs(unlike)
    with torch._C.DisableTorchFunction():
        value = value.detach().cpu()
        now_parts = payload.sparse_parts(value)
        stored = stats_mod.stored_values(value)
        try:
            now = {} if stored is None else stats_dict(stats_mod.host_stats(stored.resolve_conj()))
        except (RuntimeError, TypeError, NotImplementedError):
            now = {}
    if now_parts is None:
        return differs(f"not compared: the replay's {parts.layout} tensor gives no parts to compare", now)
    held, made = parts.records["values"].shape[:1], tuple(now_parts["values"].shape[:1])
    if held != made:  # (a COO tensor's before it was coalesced, where it was not)
        return differs(f"the number of stored values differs: recorded {held[0] if held else 0}, replayed "
                       f"{made[0] if made else 0}", now)
    coalesced = bool(value.is_coalesced()) if value.layout == torch.sparse_coo else parts.coalesced
    if coalesced != parts.coalesced:
        return differs(f"recorded {'' if parts.coalesced else 'un'}coalesced, replayed {'' if coalesced else 'un'}"
                       "coalesced: its indices and values are held otherwise", now)
    for part, part_record in parts.records.items():  # where the values lie first, then what they are
        if part == "values":
            continue
        one = compare(part, "component", rank.tensor(part_record), now_parts[part], part_record.stats)
        if not one.match:
            return differs(f"its {part} differ (its values lie at other places): " + (
                one.reason or f"{one.mismatched} of {math.prod(part_record.shape)} differ"), now)
    diff = compare(record.name, record.role, rank.tensor(parts.records["values"]), now_parts["values"],
                   parts.records["values"].stats)
    diff.recorded, diff.replayed = recorded, now
    return diff
