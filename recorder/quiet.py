"""The recorder's own tensor work, unseen by the training code's torch modes and tensor subclasses.

Capturing a step reads its tensors (``detach``, ``numel``, strides, storage pointers, a copy of
their bytes, statistics) and makes a few of its own. Run as they are, each of those reads would
reach a ``TorchFunctionMode`` or ``TorchDispatchMode`` of the user's (an op or FLOP counter,
a logger) and a tensor subclass's ``__torch_function__`` (a quantisation simulation that rounds
every result, a units tensor that refuses an operation it does not know): counts inflated, and
a subclass free to refuse or change the recorder's reads. Inside ``quiet()`` torch function
handling is off (modes and subclasses: ``torch._C.DisableTorchFunction``) and the user's dispatch
modes are set aside; a subclass's ``__torch_dispatch__`` still runs (a wrapper subclass's values
are read through it), and so do the modes of torch's own tracing (fake, proxy and functional
tensors), whose tensors cannot be read without them. Never around the user's code: checks,
breakpoints and callbacks run outside it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _python_dispatch

_dispatch_depth = torch._C._len_torch_dispatch_stack


class quiet:  # noqa: N801 - used as a function: ``with quiet():``
    """Torch function handling off, and the user's dispatch modes set aside, inside the block. A class,
    not a generator: entered several times a step (~0.3 us, against ~1 us for contextlib's)."""

    __slots__ = ("_function", "_modes")

    def __enter__(self) -> None:
        self._function = torch._C.DisableTorchFunction()
        self._function.__enter__()
        self._modes = None
        if _dispatch_depth() and not _tracing():
            self._modes = _python_dispatch._disable_current_modes()
            self._modes.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._modes is not None:
                self._modes.__exit__(*exc)
        finally:
            self._function.__exit__(*exc)


def _tracing() -> bool:
    """Whether one of torch's own modes (fake tensors, tracing, functionalization) is on the dispatch
    stack: left in place, with the user's modes above it (their tensors are read through it)."""
    return any(getattr(mode, "is_infra_mode", lambda: False)()
               for mode in _python_dispatch._get_current_dispatch_mode_stack())
