"""Zero-edit capture: modules chosen by path globs, recorded through global module hooks.

``record(..., modules=["blocks.*"])`` (and ``pdbg record --modules``) records every module whose
path matches a glob, without a decorator or any other change to the user's code. Paths are relative
to the outermost module being called; globs match them segment by segment: ``*`` is one segment
(``blocks.*`` is each block, not its children), ``**`` any number of segments, the root included
(``**.attn`` is every ``attn``; ``**`` alone is every module). Within a segment, ``fnmatch``
wildcards apply (``h.*.attn*``).

Global forward hooks see positional arguments before the call but keyword arguments only after it,
so for modules recorded this way keyword tensors are captured as inputs at the end of the call and
are not followed into the backward pass (decorate the class, or ``annotate`` the instance, for that).
Decorated classes and annotated instances are recorded by their own wrappers, never twice.
"""

from __future__ import annotations

import fnmatch
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import compiled, skeleton
from .errors import RecordingError

if TYPE_CHECKING:
    from .annotate import StepDef
    from .capture import BackwardLink, Frame, Session


def parse_globs(globs: str | list[str] | tuple[str, ...] | None) -> list[tuple[str, ...]]:
    """Split module-path globs into segments; raises RecordingError on an empty one."""
    if globs is None:
        return []
    if isinstance(globs, str):
        globs = [globs]
    patterns = []
    for glob in globs:
        if not isinstance(glob, str) or not glob or any(not seg for seg in glob.split(".")):
            raise RecordingError(f"invalid module glob {glob!r}: use dotted segments such as 'blocks.*', "
                                 "'**.attn' or '**'")
        patterns.append(tuple(glob.split(".")))
    return patterns


def glob_matches(pattern: tuple[str, ...], path: str) -> bool:
    """Does a module path ("" for the root) match a parsed glob?"""
    return _match(pattern, tuple(path.split(".")) if path else ())


def _match(pattern: tuple[str, ...], segments: tuple[str, ...]) -> bool:
    if not pattern:
        return not segments
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, segments[i:]) for i in range(len(segments) + 1))
    return bool(segments) and fnmatch.fnmatchcase(segments[0], head) and _match(rest, segments[1:])


class ModuleSelector:
    """Which module paths a list of globs selects, remembered per path; tracks globs never matched."""

    def __init__(self, globs: str | list[str] | tuple[str, ...] | None) -> None:
        self.globs = [globs] if isinstance(globs, str) else list(globs or [])
        self.patterns = parse_globs(self.globs)
        self._cache: dict[str, bool] = {}
        self.matched: set[int] = set()  # indices of globs that selected at least one module
        self.paths: dict[str, str] = {}  # every module path seen -> its class name (for messages)

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def selects(self, path: str, module: torch.nn.Module, others: Callable[[], list[str]] | None = None) -> bool:
        """Whether the globs select the module at ``path``; ``others``: its other paths (a module reached
        under several names is recorded under the first, and a glob naming any of them selects it)."""
        found = self._cache.get(path)
        if found is None:
            self.paths.setdefault(path, type(module).__qualname__)
            names = [path, *(others() if others is not None else ())]
            hits = [i for i, p in enumerate(self.patterns) if any(glob_matches(p, n) for n in names)]
            self.matched.update(hits)
            found = self._cache[path] = bool(hits)
        return found

    def unmatched(self) -> list[str]:
        return [g for i, g in enumerate(self.globs) if i not in self.matched]


# Set on the modules the globs select, for the hooks as Dynamo traces them (torch.compile), which
# cannot work out paths: a selected module's call leaves the graph to be recorded, others stay in.
_SELECTED = "_paperdebugger_selected"


def _marked(module: torch.nn.Module) -> bool:
    """Recorded by its own wrapper: a decorated class or an annotated instance. (A TorchScript module's
    class attribute ``forward`` raises when read: it is never a wrapper's.)"""
    if "_pdbg_step" in module.__dict__:
        return True
    try:
        return hasattr(type(module).forward, "__pdbg_step__")
    except Exception:  # noqa: BLE001 - torch.jit.ScriptModule
        return False


class GlobalCapture:
    """Global forward hooks that record the modules a selector picks. ``close()`` removes them."""

    def __init__(self, session: Session, selector: ModuleSelector) -> None:
        self.session, self.selector = session, selector
        self.local = threading.local()
        self._defs: dict[type, StepDef] = {}
        self._roots: set[int] = set()  # ids of the modules whose selected modules are marked
        self._selected: list[weakref.ref[torch.nn.Module]] = []  # marked modules (see _SELECTED)
        # The classes of selected modules whose forward Dynamo skips while recording: class -> what its
        # __dict__ held under "forward" before (None: nothing, it inherited forward), and ours.
        self._eager: dict[type, tuple[Any, Any]] = {}
        self._eager_roots: set[int] = set()
        # Called by the session's module stack's hooks, after it pushed the module (paths are known)
        session.modules.listen(self._pre, self._post)
        if session.modules.model is not None:
            self._guard_mark(session.modules.model)
            if any(getattr(m, "_compiled_call_impl", None) is not None for m in session.modules.model.modules()):
                self._guard_eager(session.modules.model)  # compiled in place (model.compile()): no wrapper's call

    def _open(self) -> list[tuple[torch.nn.Module, Frame | None, BackwardLink | None]]:
        open_ = getattr(self.local, "open", None)
        if open_ is None:
            open_ = self.local.open = []
        return open_

    def _defn(self, module: torch.nn.Module) -> StepDef:
        from .annotate import StepDef  # annotate imports capture, which imports this module

        cls = skeleton.own_class(module)  # (not the class torch.nn.utils.parametrize made for this instance)
        defn = self._defs.get(cls)
        if defn is None:
            defn = self._defs[cls] = StepDef(cls.__qualname__, None, None, None, None, None,  # type: ignore[arg-type]
                                             "module", cls)
        return defn

    def mark(self, top: torch.nn.Module) -> None:
        """Mark the modules under ``top`` that the globs select (see _SELECTED), with their paths
        relative to the outermost module being called; ``close()`` removes the marks."""
        top = compiled.unwrapped(top)
        if id(top) in self._roots:
            return
        self._roots.add(id(top))
        for module in top.modules():
            names = [self.session.modules.path_of(module), *self.session.modules.other_paths(module)]
            if not _marked(module) and any(glob_matches(p, n) for p in self.selector.patterns for n in names):
                module.__dict__[_SELECTED] = True
                self._selected.append(weakref.ref(module))

    def _pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if compiled.tracing():
            return compiled.eagerly(self._begin, module, args) if getattr(module, _SELECTED, False) else None
        if type(module).__name__ == "OptimizedModule":
            # About to run compiled code: mark what it will call, and have it run the selected
            # modules' forward eagerly. The wrapper is not a step itself; the module it wraps is, at
            # the same path, when called inside.
            self._guard_mark(module)
            self._guard_eager(module)
            return None
        return self._begin(module, args)

    def _note_marked(self, module: torch.nn.Module) -> None:
        try:
            if not self.session.recomputing():  # (a recomputation's paths mean nothing)
                self.selector.selects(self.session.modules.path_of(module), module,
                                      lambda: self.session.modules.other_paths(module))
        except Exception as exc:
            self.session.fail("matching module paths", exc)

    def _guard_mark(self, module: torch.nn.Module) -> None:
        try:
            self.mark(module)
        except Exception as exc:
            self.session.fail("selecting modules of a compiled model", exc)

    def _guard_eager(self, module: torch.nn.Module) -> None:
        try:
            self.run_eagerly(module)
        except Exception as exc:
            self.session.fail("selecting modules of a compiled model", exc)

    def run_eagerly(self, top: torch.nn.Module) -> None:
        """Have Dynamo skip the forward of the selected modules under ``top`` (a compiled model's): a
        recorded step then runs the eager code a replay runs (compiled, its kernels' order of
        arithmetic differs, and no step replayed bit for bit). Their class's ``forward`` is replaced
        by ``torch.compiler.disable`` of it while recording (an instance attribute would follow the
        module into copies and checkpoints); ``close()`` puts it back, unless the class's forward was
        replaced since."""
        top = compiled.unwrapped(top)
        if id(top) in self._eager_roots:
            return
        self._eager_roots.add(id(top))
        for module in top.modules():
            cls = type(module)
            if module.__dict__.get(_SELECTED) and cls not in self._eager and "forward" not in module.__dict__:
                before = cls.__dict__.get("forward")
                eager = torch.compiler.disable(cls.forward)
                cls.forward = eager
                self._eager[cls] = (before, eager)

    def _begin(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        session = self.session
        if not session.enabled or session.closed or getattr(session.local, "busy", False):
            return None
        if _marked(module):  # recorded by its own wrapper; a glob naming it has matched it all the same
            self._note_marked(module)
            return None
        try:
            # A recomputation runs outside the model, where paths mean nothing: it is taken when
            # its original call was recorded (see Session._begin_recomputation).
            recomputation = session.recomputing()
            if not recomputation and not self.selector.selects(session.modules.path_of(module), module,
                                                               lambda: session.modules.other_paths(module)):
                return None
        except Exception as exc:
            session.fail("matching module paths", exc)
            return None
        started = session.begin(self._defn(module), module, args, {}, recomputation)
        if started is None:
            return None
        frame, new_args, _, link = started
        self._open().append((module, frame, link))
        return new_args

    def _post(self, module: torch.nn.Module, args: tuple[Any, ...], *rest: Any) -> Any:
        if compiled.tracing():
            return compiled.eagerly(self._end, module, args, *rest) if getattr(module, _SELECTED, False) else None
        return self._end(module, args, *rest)

    def _end(self, module: torch.nn.Module, args: tuple[Any, ...], *rest: Any) -> Any:
        # (kwargs, result) normally; (result,) when torch calls it while an exception unwinds.
        kwargs, result = rest if len(rest) == 2 else ({}, rest[0])
        open_ = self._open()
        at = next((i for i in range(len(open_) - 1, -1, -1) if open_[i][0] is module), None)
        if at is None:
            return None
        for _, inner, inner_link in reversed(open_[at + 1:]):  # left open by an exception torch's hooks never saw
            self.session.end_with_exception(inner, RuntimeError("this step's forward did not return normally"),
                                            inner_link)
        _, frame, link = open_[at]
        del open_[at:]
        session = self.session
        exc = sys.exc_info()[1]
        if exc is not None and result is None:  # called by torch while the forward's exception unwinds
            session.end_with_exception(frame, exc, link)
            return None
        if kwargs and frame is not None:
            session.add_kwargs(frame, kwargs)
        out = session.end(frame, result, link)
        return None if out is result else out

    def close(self) -> None:
        """Remove the hooks; steps still open on this thread (a BaseException such as
        KeyboardInterrupt skips torch's always-called hooks) are ended with the exception in flight."""
        self.session.modules.listen(None, None)
        for ref in self._selected:
            module = ref()
            if module is not None:
                module.__dict__.pop(_SELECTED, None)
        self._selected.clear()
        for cls, (before, eager) in self._eager.items():
            if cls.__dict__.get("forward") is eager:  # not replaced since
                if before is None:
                    delattr(cls, "forward")
                else:
                    cls.forward = before
        self._eager.clear()
        open_, self.local.open = self._open(), []
        exc = sys.exc_info()[1]
        for _, frame, link in reversed(open_):
            self.session.end_with_exception(frame, exc or KeyboardInterrupt("the recording ended inside this step"),
                                            link)

