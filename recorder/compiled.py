"""torch.compile: the recorder stays out of compiled graphs.

Dynamo traces the Python a compiled function reaches, the recorder's hooks and step wrappers
included; it cannot trace them (threads, locks, numpy copies). Each entry point asks ``tracing()``
and, when Dynamo is tracing it, hands the call to ``eagerly(fn, *args)``: Dynamo breaks the graph
there and runs ``fn`` as plain Python, with everything it calls (``torch.compiler.disable``). A
recorded step under torch.compile therefore runs eagerly, as its replay does; the code between
steps stays compiled.

``torch._disable_dynamo`` imports ``torch._dynamo`` at its first call, which only happens while
Dynamo traces (it is loaded then): ``import recorder`` and eager recording never pay its import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

tracing: Callable[[], bool] = torch.compiler.is_compiling


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


# ``eagerly(fn, *args, **kwargs)``: ``fn(*args, **kwargs)`` as plain Python, and all it calls, also
# when called from code Dynamo traces or compiles.
eagerly: Callable[..., Any] = torch._disable_dynamo(_call)


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile(module)`` wrapper (an ``OptimizedModule``) compiles, else itself."""
    if type(module).__name__ == "OptimizedModule":
        inner = module._modules.get("_orig_mod")
        if isinstance(inner, torch.nn.Module):
            return inner
    return module


def path_without_wrappers(path: str) -> str:
    """A module path with the ``_orig_mod`` segments of ``torch.compile`` wrappers taken out: the
    path the module has in the model as written (``h.0._orig_mod.attn`` is ``h.0.attn``)."""
    if "_orig_mod" not in path:
        return path
    return ".".join(seg for seg in path.split(".") if seg != "_orig_mod")

