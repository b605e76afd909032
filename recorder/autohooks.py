"""Zero-edit capture: modules chosen by path globs, recorded through global module hooks.

``record(..., modules=["blocks.*"])`` (and ``pdbg record --modules``) records every module whose
path matches a glob, without a decorator or any other change to the user's code. Paths are relative
to the outermost module being called; globs match them segment by segment: ``*`` is one segment
(``blocks.*`` is each block, not its children), ``**`` any number of segments, the root included
(``**.attn`` is every ``attn``; ``**`` alone is every module). Within a segment, ``fnmatch``
wildcards apply (``h.*.attn*``; ``[[]`` is a literal ``[``), and a segment spelled exactly as a module's
name selects it whatever characters it holds (``heads.x[0]``, a ModuleDict key), under Unicode
normalisation (``names.glob``).

Global forward pre-hooks see positional arguments only, and run before the module's own. A selected
module is therefore given its own forward pre-hook with keyword arguments, after the module's other
forward pre-hooks: its calls are captured there, with what its ``forward`` is called with (keyword
arguments as positional ones; before the call, followed into the backward pass, recorded again after
the call when it changes them in place), its state and RNG states as its own pre-hooks left them, as
a decorated class's are. torch lists a call's hooks before running them, so the hook exists from the
next call on; the modules that the globs select under the recording's ``model`` get theirs when the
recording starts, those under any other outermost module when it is called. A call that begins
without it (a selected outermost module's first call, compiled code) has its keyword arguments
captured when it ends, and one that the module's own forward pre-hooks run after (those, or ones
registered after ours: ours moves to the end for the next call) says so in a note on the step
(``layout.UNRUN_PRE_HOOKS_NOTE``), by which a replay knows that they ran after its recording.
Decorated classes and annotated instances are recorded by their own wrappers, never twice.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.module import _global_backward_hooks

from . import compiled, names, skeleton, taps
from .errors import RecordingError
from .store import layout

_LAZY_INIT = torch.nn.modules.lazy.LazyModuleMixin._infer_parameters

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
    return bool(segments) and names.glob(segments[0], head) and _match(rest, segments[1:])


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


def _eager_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run eagerly from compiled code (``torch.compiler.disable``), but traced where the
    graph must stay whole (``fullgraph=True``): there the disabled function would raise, and the
    module's call is not recorded (``compiled.whole_graph`` says so)."""
    disabled = torch.compiler.disable(forward)

    @functools.wraps(forward)
    def eager(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if compiled.tracing() and compiled.whole_graph(f"module {type(self).__name__}"):
            return forward(self, *args, **kwargs)
        return disabled(self, *args, **kwargs)

    return eager


def _marked(module: torch.nn.Module) -> bool:
    """Recorded by its own wrapper: a decorated class or an annotated instance. (A TorchScript module's
    class attribute ``forward`` raises when read: it is never a wrapper's.)"""
    if "_pdbg_step" in module.__dict__:
        return True
    try:
        return hasattr(type(module).forward, "__pdbg_step__")
    except Exception:  # noqa: BLE001 - torch.jit.ScriptModule
        return False


class _KeywordHook:
    """The forward pre-hook (with keyword arguments) on a selected module: captures its calls, for
    the ``GlobalCapture`` that registered it. Copies of the module (``copy.deepcopy``, an EMA model)
    share it, and it does nothing for them, nor for any module once the recording closed (it keeps
    no recording alive then), and takes itself off the module it is called for then; a pickled module's
    copy loads as one of no recording."""

    __slots__ = ("capture",)

    def __init__(self, capture: GlobalCapture) -> None:
        self.capture: GlobalCapture | None = capture

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        capture = self.capture
        if capture is None:  # a copy made while recording, called after it closed: leave it as it was before
            for key in [k for k, h in module._forward_pre_hooks.items() if h is self]:
                module._forward_pre_hooks.pop(key, None)
                module._forward_pre_hooks_with_kwargs.pop(key, None)
            return None
        return capture._keyword_pre(module, args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _KeywordHook:
        return self

    def __reduce__(self) -> Any:
        return _unpickled, ()


# A selected module's call's keyword arguments that the call got tapped: name -> (the tapped tensor or
# the container holding taps, the caller's value)
_Given = dict[str, tuple[Any, Any]]


def _give_back(kwargs: dict[str, Any], given: _Given) -> None:
    """Put the caller's keyword arguments back in the dict torch passes the module's forward hooks, which
    run after ours: a hook's own use of a tapped tensor would go into the step's recorded input gradient,
    which the step's replay, run without the hook, does not reproduce. (Positional arguments come to every
    hook in one tuple, which cannot be changed: a hook sees their taps.)"""
    for name, (tapped, caller) in given.items():
        if kwargs.get(name) is tapped:
            kwargs[name] = caller


def _unpickled() -> Any:
    """A pickled module's copy of the hook: one of no recording, which takes itself off at its first call."""
    hook = _KeywordHook.__new__(_KeywordHook)
    hook.capture = None
    return hook


class _Adopted:
    """The handle of a ``_KeywordHook`` a module got by being copied from a hooked one."""

    def __init__(self, module: torch.nn.Module, key: int) -> None:
        self.id, self._module = key, weakref.ref(module)

    def remove(self) -> None:
        module = self._module()
        if module is not None:
            module._forward_pre_hooks.pop(self.id, None)
            module._forward_pre_hooks_with_kwargs.pop(self.id, None)


class GlobalCapture:
    """Global forward hooks that record the modules a selector picks. ``close()`` removes them."""

    def __init__(self, session: Session, selector: ModuleSelector) -> None:
        self.session, self.selector = session, selector
        self.local = threading.local()
        self._defs: dict[type, StepDef] = {}
        # id -> weak ref of the modules whose selected modules are marked (a reused id is not the old module)
        self._roots: dict[int, weakref.ref[torch.nn.Module]] = {}
        self._selected: list[weakref.ref[torch.nn.Module]] = []  # marked modules (see _SELECTED)
        # The classes of selected modules whose forward Dynamo skips while recording: class -> what its
        # __dict__ held under "forward" before (None: nothing, it inherited forward), and ours.
        self._eager: dict[type, tuple[Any, Any]] = {}
        self._eager_roots: set[int] = set()
        # id(module) -> (weak ref to it, the handle of its _KeywordHook): the selected modules whose
        # calls their own pre-hook captures, keyword arguments included
        self._hooked: dict[int, tuple[weakref.ref[torch.nn.Module], Any]] = {}
        self._hook = _KeywordHook(self)
        # Called by the session's module stack's hooks, after it pushed the module (paths are known)
        session.modules.listen(self._pre, self._post)
        if session.modules.model is not None:
            self._guard_mark(session.modules.model)  # (hooks its selected modules before their first call)
            if any(getattr(m, "_compiled_call_impl", None) is not None for m in session.modules.model.modules()):
                self._guard_eager(session.modules.model)  # compiled in place (model.compile()): no wrapper's call

    def _open(self) -> list[tuple[torch.nn.Module, Frame | None, BackwardLink | None, bool, _Given]]:
        open_ = getattr(self.local, "open", None)
        if open_ is None:
            open_ = self.local.open = []
        return open_

    def _defn(self, module: torch.nn.Module) -> StepDef:
        from .annotate import StepDef  # annotate imports capture, which imports this module

        defn = self._defs.get(type(module))  # (per call: one lookup; own_class once per class met)
        if defn is None:
            cls = skeleton.own_class(module)  # (not the class parametrize or fully_shard made for this instance)
            defn = self._defs.get(cls)
            if defn is None:
                defn = self._defs[cls] = StepDef(cls.__qualname__, None, None, None, None, None,  # type: ignore[arg-type]
                                                 "module", cls)
            self._defs[type(module)] = defn
        return defn

    def mark(self, top: torch.nn.Module) -> None:
        """Mark the modules under ``top`` that the globs select (see _SELECTED), with their paths
        relative to the outermost module being called; ``close()`` removes the marks."""
        top = compiled.unwrapped(top)
        root = self._roots.get(id(top))
        if root is not None and root() is top:
            return
        if len(self._roots) >= 256:  # (outermost modules made anew each call: forget the gone ones)
            self._roots = {k: r for k, r in self._roots.items() if r() is not None}
        self._roots[id(top)] = weakref.ref(top)
        for module in top.modules():
            names = [self.session.modules.path_of(module), *self.session.modules.other_paths(module)]
            if not _marked(module) and any(glob_matches(p, n) for p in self.selector.patterns for n in names):
                module.__dict__[_SELECTED] = True
                self._selected.append(weakref.ref(module))
                self._add_hook(module)

    def _add_hook(self, module: torch.nn.Module) -> None:
        """Give a selected module its own pre-hook, which sees keyword arguments (torch runs it after
        the global pre-hooks and the module's own, from the module's next call on); ``close()`` removes it."""
        if self._hooked_now(module) or type(module).__name__ == "OptimizedModule" or isinstance(
                module, torch.jit.ScriptModule):  # (a compile wrapper: no step; TorchScript takes no Python hooks)
            return
        # (a copy of a hooked module, copy.deepcopy's, holds the hook already: it is adopted, not added twice)
        held = next((k for k, h in module._forward_pre_hooks.items() if h is self._hook), None)
        handle = (_Adopted(module, held) if held is not None else
                  module.register_forward_pre_hook(self._hook, with_kwargs=True))
        self._hooked[id(module)] = (weakref.ref(module), handle)

    def _hooked_now(self, module: torch.nn.Module) -> bool:
        entry = self._hooked.get(id(module))
        return entry is not None and entry[0]() is module and entry[1].id in module._forward_pre_hooks

    def _pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if compiled.tracing():
            if not getattr(module, _SELECTED, False) or compiled.whole_graph(f"module {type(module).__name__}"):
                return None
            return compiled.eagerly(self._late, module, args)
        if type(module).__name__ == "OptimizedModule":
            # About to run compiled code: mark what it will call, and have it run the selected
            # modules' forward eagerly. The wrapper is not a step itself; the module it wraps is, at
            # the same path, when called inside.
            self._guard_mark(module)
            self._guard_eager(module)
            return None
        hooked = self._hooked_now(module)  # (before marking: a hook added now is not among this call's)
        if module._modules and self.session.enabled and self.session.modules.outermost(module):
            try:
                self.mark(module)  # (hooks its selected modules before their first call)
            except Exception as exc:
                self.session.fail("selecting modules", exc)
        if hooked:
            self.local.late = None
            return None  # its own pre-hook, last, captures the call with its keyword arguments
        return self._late(module, args)

    def _late(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Capture a call whose keyword arguments are seen only when it ends (see ``_end``); hook the
        module for its next calls."""
        started = self._begin(module, args, None)
        if started is not None:
            self._note_unrun(self._pre_hooks(module))
        if started is not None and not compiled.tracing():
            self.local.late = module  # (a copy of its hook already listed for this call, a deepcopy's, skips it)
            try:
                self._add_hook(module)
            except Exception as exc:
                self.session.fail("hooking a selected module", exc)
        return None if started is None else started[0]

    def _keyword_pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if compiled.tracing() or not self._hooked_now(module):  # (a copy of the module sharing the hook)
            return None
        if getattr(self.local, "late", None) is module:  # begun by _late
            self.local.late = None
            return None
        key = self._hooked[id(module)][1].id
        hooks = module._forward_pre_hooks
        unrun = [] if next(reversed(hooks), key) == key else self._pre_hooks(module, after=key)  # (ours last: none)
        if unrun:  # registered after ours: they run after this call's capture, but before the next's
            hooks.move_to_end(key)
        started = self._begin(module, args, kwargs)
        if started is not None:
            self._note_unrun(unrun)
        return started

    def _pre_hooks(self, module: torch.nn.Module, after: int | None = None) -> list[str]:
        """The names of the module's own forward pre-hooks (those listed after ``after``, the key of
        ours, where given), which run after a call's capture begun before them. A lazy module's
        initialisation is not among them: the parameters it makes are recorded as uninitialized, and a
        replay makes them again."""
        hooks = list(module._forward_pre_hooks.items())
        if after is not None:
            hooks = hooks[next((i + 1 for i, (k, _) in enumerate(hooks) if k == after), len(hooks)):]
        return [skeleton.hook_name(h) for _, h in hooks
                if not isinstance(h, _KeywordHook) and getattr(h, "__func__", None) is not _LAZY_INIT]

    def _note_unrun(self, unrun: list[str]) -> None:
        """Say on the call just begun which of its module's forward pre-hooks run after its capture."""
        frame = self._open()[-1][1]
        if unrun and frame is not None:
            frame.notes.append(f"{', '.join(unrun)}: {layout.UNRUN_PRE_HOOKS_NOTE}")

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
                eager = _eager_forward(cls.forward)
                cls.forward = eager
                self._eager[cls] = (before, eager)

    def _begin(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
               ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Capture a call of a selected module as it begins: the (tapped) arguments to call with, or
        None. ``kwargs`` None: not known yet (taken when it ends)."""
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
        started = session.begin(self._defn(module), module, args, {} if kwargs is None else kwargs, recomputation)
        if started is None:
            return None
        frame, new_args, new_kwargs, link = started
        given = {k: (v, kwargs[k]) for k, v in new_kwargs.items() if k in kwargs and v is not kwargs[k]} \
            if kwargs else {}
        self._open().append((module, frame, link, kwargs is None, given))
        return new_args, new_kwargs

    def _post(self, module: torch.nn.Module, args: tuple[Any, ...], *rest: Any) -> Any:
        if compiled.tracing():
            if not getattr(module, _SELECTED, False) or compiled.whole_graph(f"module {type(module).__name__}"):
                return None
            return compiled.eagerly(self._end, module, args, *rest)
        return self._end(module, args, *rest)

    def _end(self, module: torch.nn.Module, args: tuple[Any, ...], *rest: Any) -> Any:
        # (kwargs, result) normally; (result,) when torch calls it while an exception unwinds.
        kwargs, result = rest if len(rest) == 2 else ({}, rest[0])
        open_ = self._open()
        at = len(open_) - 1  # (a loop, not a generator: this runs at the end of every module call)
        while at >= 0 and open_[at][0] is not module:
            at -= 1
        if at < 0:
            return None
        for _, inner, inner_link, _, _ in reversed(open_[at + 1:]):  # left open by an exception torch's hooks never saw
            self.session.end_with_exception(inner, RuntimeError("this step's forward did not return normally"),
                                            inner_link)
        _, frame, link, late, given = open_[at]
        del open_[at:]
        session = self.session
        exc = sys.exc_info()[1]
        if exc is not None and result is None:  # called by torch while the forward's exception unwinds
            session.end_with_exception(frame, exc, link)
            return None
        if late and kwargs and frame is not None:
            session.add_kwargs(frame, kwargs)
        out = session.end(frame, result, link)
        if frame is not None and (module._backward_hooks or _global_backward_hooks):
            try:
                taps.before_backward_hooks(args, kwargs)
            except Exception as exc:
                session.fail("tapping a call with backward hooks", exc)
        _give_back(kwargs, given)
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
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self._hook.capture = None
        for cls, (before, eager) in self._eager.items():
            if cls.__dict__.get("forward") is eager:  # not replaced since
                if before is None:
                    delattr(cls, "forward")
                else:
                    cls.forward = before
        self._eager.clear()
        open_, self.local.open = self._open(), []
        exc = sys.exc_info()[1]
        for _, frame, link, _, _ in reversed(open_):
            self.session.end_with_exception(frame, exc or KeyboardInterrupt("the recording ended inside this step"),
                                            link)

