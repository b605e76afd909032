"""Where in memory a replay puts the tensors it gives a call: at the address, modulo ``layout.ALIGNMENT``,
at which the recorded call found them.

CPU kernels (oneDNN, MKL) pick their code by the address of their operands: ``F.linear(xs[1], w, b)``, a
view of a time-major batch whose rows are 72 bytes long, rounds otherwise than ``F.linear(xs[1].clone(),
w, b)``. A replay makes its tensors in fresh memory, which the allocators align; a step whose argument
was such a view would replay as a mismatch. The recorder notes each misaligned tensor it records in the
step's extra ``misaligned`` (schema 1.25), and the replay makes that one where it lay, in its strides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from recorder.payload import overlaps_itself
from recorder.store import layout
from recorder.store.reader import TensorRecord

if TYPE_CHECKING:
    from .recording import Step


def misaligned(step: Step, rec: TensorRecord) -> int:
    """The bytes past a multiple of ``layout.ALIGNMENT`` at which the tensor of ``rec`` began when
    recorded (the step's extra ``misaligned``); 0 where it began at one, or the recording does not say."""
    noted = step.extra.get("misaligned")
    at = noted.get(rec.name) if isinstance(noted, dict) else None
    return at % layout.ALIGNMENT if type(at) is int else 0


def unplaceable(rec: TensorRecord, at: int, element_size: int) -> str | None:
    """Why the tensor of ``rec`` cannot be made again ``at`` bytes past an aligned address, where it
    cannot: its elements cannot begin between two of its own dtype's."""
    if at % element_size == 0:
        return None
    return (f"{rec.role} {rec.name} began {at} bytes past a {layout.ALIGNMENT}-byte boundary when recorded (a "
            f"view), not a multiple of its {element_size}-byte elements, which a replay cannot make again: it is "
            "given aligned memory, and a kernel that picks its code by the address may round otherwise")


def empty_at(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             at: int) -> torch.Tensor:
    """An uninitialized tensor of ``shape`` and ``stride`` (non-negative) whose first element lies ``at``
    bytes past a multiple of ``layout.ALIGNMENT`` (a multiple of the element size). It holds its storage
    itself, as a tensor ``torch.empty_strided`` makes does: no view, for autograd."""
    if not at:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    buffer = torch.empty(span + layout.ALIGNMENT // size, dtype=dtype, device=device)
    offset = (at - buffer.data_ptr()) % layout.ALIGNMENT // size
    return torch.empty(0, dtype=dtype, device=device).set_(buffer.untyped_storage(), offset, shape, stride)


def placed(value: torch.Tensor, at: int) -> torch.Tensor:
    """``value`` (which requires no grad) copied, in its strides, to memory that begins ``at`` bytes past
    a multiple of ``layout.ALIGNMENT``; itself where it lies there already, or cannot be put there (no
    elements, negative strides, ``at`` not a multiple of its element size)."""
    shape, stride = tuple(value.shape), tuple(value.stride())
    if value.layout != torch.strided or not value.numel() or at % value.element_size() or any(s < 0 for s in stride) \
            or value.data_ptr() % layout.ALIGNMENT == at:
        return value
    if not overlaps_itself(shape, stride):
        return empty_at(shape, stride, value.dtype, value.device, at).copy_(value)
    # (copy_ refuses to write one element twice: an expanded tensor's or windows' storage, copied as it lies)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    flat = empty_at((span,), (1,), value.dtype, value.device, at).copy_(value.as_strided((span,), (1,)))
    return torch.empty(0, dtype=value.dtype, device=value.device).set_(flat.untyped_storage(), flat.storage_offset(),
                                                                       shape, stride)
