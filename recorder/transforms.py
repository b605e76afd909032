"""Steps called under torch.func transforms (``vmap``, ``grad``, ``jvp``, ``jacrev``...).

Inside a transform a step sees wrapper tensors: a ``vmap`` level's batched tensor (its logical shape
leaves out the batch dimension) and a ``grad``/``jvp`` level's grad-tracking tensor. They have no
memory of their own, and inside a transform torch lifts even plain tensors into it (``numpy()`` of
``torch.get_rng_state()`` fails): the recorder's own work runs ``outside()`` the transforms, on
the tensors the wrappers hold (``plain``). The recorder records the tensor
each wrapper holds: its values, and for ``vmap`` the whole batch, with the batch dimension of each
level kept in the step's ``extra`` document (``vmap``), and the ``randomness`` each ``vmap`` level
ran with (``vmap_randomness``: a replay must draw as it did). Gradients there are computed by the
transform, not by autograd's backward pass, so such a step has no backward step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_functorch = torch._C._functorch
try:
    from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack as _clear
except ImportError:  # an older torch: capture under a transform fails, and recording stops with a warning
    _clear = contextlib.nullcontext  # type: ignore[assignment]
try:
    from torch._functorch.pyfunctorch import VmapInterpreter as _VmapInterpreter
    from torch._functorch.pyfunctorch import coerce_cinterpreter as _coerce
except ImportError:  # (then which randomness a vmap ran with is not recorded: see randomness())
    _VmapInterpreter = _coerce = None  # type: ignore[assignment,misc]

NOTE = ("called under a torch.func transform (vmap, grad, jvp...): recorded forward only, each tensor "
        "as the values the transform holds")


def active() -> bool:
    """Whether a torch.func transform is running on this thread."""
    return _functorch.maybe_current_level() is not None


def plain(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The tensor behind a transform's wrappers, and the batch dimension each ``vmap`` level adds
    (innermost level first; empty when no ``vmap`` batched it). A plain tensor is returned as is."""
    bdims: list[int] = []
    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            bdims.append(_functorch.maybe_get_bdim(t))
        t = _functorch.get_unwrapped(t)
    return t, bdims


def randomness() -> list[str] | None:
    """The ``randomness`` ("error", "same" or "different") of each ``vmap`` level running now, innermost
    first (empty when none is); None where this torch does not tell (its functorch interpreter stack
    is not readable from Python)."""
    stack = getattr(_functorch, "get_interpreter_stack", None)
    if stack is None or _coerce is None:
        return None
    try:
        levels = [_coerce(c) for c in stack() or ()]
        return [str(i.randomness()) for i in reversed(levels) if isinstance(i, _VmapInterpreter)]
    except Exception:  # noqa: BLE001 - an interpreter this code does not know: not recorded, as on an older torch
        return None


@contextlib.contextmanager
def outside() -> Iterator[None]:
    """Run the recorder's own tensor work (statistics, copies, RNG states) as if no transform were running."""
    with _clear():
        yield


_NOTHING = contextlib.nullcontext()


def outside_if(transformed: bool) -> contextlib.AbstractContextManager[Any]:
    """``outside()`` for a step called under a transform, else nothing."""
    return outside() if transformed else _NOTHING

