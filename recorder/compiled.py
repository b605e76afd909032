"""torch.compile: the recorder stays out of compiled graphs.

Dynamo traces the Python a compiled function reaches, the recorder's hooks and step wrappers
included; it cannot trace them (threads, locks, numpy copies). Each entry point asks ``tracing()``
and, when Dynamo is tracing it, hands the call to ``eagerly(fn, *args)``: Dynamo breaks the graph
there and runs ``fn`` as plain Python, with everything it calls (``torch.compiler.disable``). A
recorded step under torch.compile therefore runs eagerly, as its replay does; the code between
steps stays compiled.

Where Dynamo may not break the graph (``fullgraph=True``, ``torch._dynamo.error_on_graph_break(True)``), a
break raises and would end the training: there ``whole_graph()`` is true, and the entry points let the
step be traced into the graph as it is unrecorded, with a warning that it is not recorded.

``torch._disable_dynamo`` imports ``torch._dynamo`` at its first call, which only happens while
Dynamo traces (it is loaded then): ``import recorder`` and eager recording never pay its import.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

tracing: Callable[[], bool] = torch.compiler.is_compiling


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _skip_recorder_frames()
    return fn(*args, **kwargs)


def keep_dynamo_out() -> None:
    """At a recording's start: where torch._dynamo is loaded (something was compiled, or a framework
    imported it), tell it now never to compile the recorder's own frames (``_skip_recorder_frames``).
    Otherwise the first ``eagerly`` call does, since Dynamo is then running."""
    if "torch._dynamo" in sys.modules:
        _skip_recorder_frames()


@functools.cache
def _skip_recorder_frames() -> None:
    """Tell Dynamo never to compile a frame of the recorder's own code, nor what it calls.

    ``eagerly`` covers the calls Dynamo traces into. The recorder's backward callbacks are different:
    autograd calls them from C++ during a backward that runs in a compiled function's graph break,
    where Dynamo compiles each new frame it sees; it would trace the recorder's hooks (graph breaks
    at their locks, recompiles as their arguments change, and recompile-limit warnings naming
    recorder files). Marking each of the recorder's code objects SKIP (itself and the frames it
    calls: eager) leaves them alone at no cost per call. Done once, when a recording starts with
    torch._dynamo loaded or at the first ``eagerly`` call (without importing torch._dynamo
    otherwise); it concerns the recorder's code objects only.
    On a torch without per-code strategies, nothing is marked (the recording is unchanged, the
    warnings stay)."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for code in _recorder_code():
        set_code_exec_strategy(code, strategy)


def _recorder_code() -> list[types.CodeType]:
    """Every code object of the recorder's loaded modules: their functions, their classes' methods,
    and the functions defined inside those (closures, wrappers)."""
    roots: list[Any] = []
    for name, module in list(sys.modules.items()):
        if (name == "recorder" or name.startswith("recorder.")) and module is not None:
            roots.extend(vars(module).values())
    found: dict[int, types.CodeType] = {}
    classes: set[int] = set()
    while roots:
        obj = roots.pop()
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property):
            roots.extend(f for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, types.FunctionType):
            roots.append(obj.__code__)
        elif isinstance(obj, type) and id(obj) not in classes and getattr(obj, "__module__", "").startswith("recorder"):
            classes.add(id(obj))
            roots.extend(vars(obj).values())
        elif isinstance(obj, types.CodeType) and id(obj) not in found and obj.co_filename.startswith(_PACKAGE_DIR):
            found[id(obj)] = obj
            roots.extend(c for c in obj.co_consts if isinstance(c, types.CodeType))
    return list(found.values())


# How many times ``whole_graph`` let a step or a selected module stay in a graph unrecorded (a recording
# compares it with its value at its start: the module paths of those calls are not known to it).
_unrecorded = [0]
_unrecorded_what: list[str] = []  # what each of them was ("paper step 'Block'"), the first 4096 of the process's


def unrecorded_traces() -> int:
    return _unrecorded[0]


def unrecorded_doc(since: int) -> dict[str, Any] | None:
    """What stayed in graphs unrecorded since the count was ``since`` (a recording's start), as its final
    ``compiled_unrecorded`` keeps it (docs/FORMAT.md): ``{"count", "what"}``, ``what`` the distinct ones
    ("paper step 'Block'", "module Linear", "watch('w')"), 32 at most; None where none stayed."""
    count = _unrecorded[0] - since
    if count <= 0:
        return None
    return {"count": count, "what": list(dict.fromkeys(_unrecorded_what[since:]))[:32]}


def whole_graph(what: str = "a paper step") -> bool:
    """Whether the code Dynamo traces now must be one graph (``fullgraph=True`` or
    ``error_on_graph_break``), where ``eagerly`` would raise instead of breaking the graph: then a
    RecorderWarning says that ``what`` is not recorded there, and True. Dynamo runs this function while
    it traces and takes its result as a constant (``_dynamo_marked_constant``, what
    ``torch._dynamo.assume_constant_result`` sets): it warns at each trace, not at each call of the
    compiled code, and never breaks the graph itself. On a torch whose tracer does not say, False."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._dynamo.utils import _get_error_on_graph_break

        tx = InstructionTranslator.current_tx()
        whole = bool(getattr(tx, "one_graph", False) or _get_error_on_graph_break())
    except Exception:  # noqa: BLE001 - a torch without these: break the graph as before
        return False
    if whole:
        _unrecorded[0] += 1
        if len(_unrecorded_what) < 4096:  # (once per trace, not per call: a few per compiled function)
            _unrecorded_what.append(what)
        from .capture import warn

        warn(f"{what} called inside code torch.compile traces with fullgraph=True (or error_on_graph_break) is "
             "not recorded: it cannot leave the graph to run eagerly. It runs compiled, as without recording; "
             "compile without fullgraph=True to record it", stacklevel=1)
    return whole


whole_graph._dynamo_marked_constant = True  # type: ignore[attr-defined]


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

