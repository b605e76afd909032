"""What the training thread hands to the writer thread: snapshots, never live objects it may change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class PayloadItem:
    """Bytes of one tensor. ``key`` is known for CPU tensors (hashed on the training thread, so
    repeats are never copied); for device tensors ``pinned`` holds an in-flight copy and ``token``
    names it until this thread has hashed it."""

    key: tuple[int, int, int] | None
    unit: int
    data: np.ndarray | None = None
    pinned: torch.Tensor | None = None
    event: Any = None
    token: int = -1

    @property
    def nbytes(self) -> int:
        if self.data is not None:
            return int(self.data.nbytes)
        return int(self.pinned.numel()) if self.pinned is not None else 0


@dataclass
class TensorItem:
    role: int
    name: str
    dtype: str
    device: str
    requires_grad: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    stats: Any  # tuple of 8 floats, or a device tensor of 8
    payload: tuple[int, int, int] | int | None  # content key, device token, or None (statistics only)


@dataclass
class StepItem:
    index: int
    row: dict[str, Any]  # integer/float columns known on the training thread
    docs: dict[str, Any]  # name, definition, module_path, module, settings, args, output -> JSON or None
    rng: dict[str, tuple[Any, Any]]
    tensors: list[TensorItem]
    exception: dict[str, Any] | None = None
    expectations: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
