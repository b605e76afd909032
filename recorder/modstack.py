"""Which module is running: a per-thread stack kept by global module hooks while a recording is on,
and module paths relative to the outermost module called."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.modules import module as module_mod

from . import compiled


class ModuleStack:
    """Tracks module calls on every thread; removes its hooks on ``close()``.

    Its hooks also call a listener's (``listen``): the recorder's own module hooks (recorder.autohooks)
    run inside these, so that a module call pays for two Python hooks, not four. A module call
    costs ~10-20 us per hook called inside a training step, where caches are cold."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.local = threading.local()
        # id(root) -> (weak ref to root, {id(module): path}, {id(module): its other paths}): a module reached
        # under several names (``self.dec = self.enc``, one block at two places) has the first one as its path
        self._paths: dict[int, tuple[Any, dict[int, str], dict[int, list[str]]]] = {}
        self._enter: Callable[..., Any] | None = None
        self._exit: Callable[..., Any] | None = None
        self._handles = [
            module_mod.register_module_forward_pre_hook(self._pre),
            module_mod.register_module_forward_hook(self._post, with_kwargs=True, always_call=True),
        ]
        # Ours runs first among the forward hooks on every module's calls: a call a modules= glob selects ends
        # with what its forward returned, as a decorated class's does, not with what the user's global forward
        # hooks registered before the recording made of it (which a replay, without them, cannot make).
        hooks = module_mod._global_forward_hooks
        if isinstance(hooks, OrderedDict):  # (torch's table: an OrderedDict in every version we support)
            hooks.move_to_end(self._handles[1].id, last=False)

    def listen(self, enter: Callable[..., Any] | None, exit_: Callable[..., Any] | None) -> None:
        """Call ``enter(module, args)`` after a module is pushed, and ``exit_(module, args, *rest)``
        after it is popped, returning what they return (new arguments, a new output), as global
        forward hooks registered after this stack's would be (``rest``: the keyword arguments and
        the output, or only the output when torch calls the hook as an exception unwinds). None
        and None: stop."""
        self._enter, self._exit = enter, exit_

    def _stack(self) -> list[torch.nn.Module]:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def _pre(self, module: torch.nn.Module, args: Any) -> Any:
        if not compiled.tracing():  # calls inside compiled code are not seen (recorder.compiled)
            self._push(module)
        enter = self._enter
        return None if enter is None else enter(module, args)

    def _post(self, module: torch.nn.Module, args: Any, *rest: Any) -> Any:
        if not compiled.tracing():
            self._pop(module)
        exit_ = self._exit
        return None if exit_ is None else exit_(module, args, *rest)

    def _push(self, module: torch.nn.Module) -> None:
        stack = getattr(self.local, "stack", None)  # (_stack's, inline: this runs at every module call)
        if stack is None:
            stack = self.local.stack = []
        stack.append(module)

    def _pop(self, module: torch.nn.Module) -> None:
        stack = getattr(self.local, "stack", None)  # (_stack's, inline)
        if stack is None:
            stack = self.local.stack = []
        # Pop back to this module: an exception may have skipped inner posts (they are always_call,
        # but a hook added by someone else can still raise before ours runs).
        while stack:
            if stack.pop() is module:
                break

    @contextlib.contextmanager
    def rooted(self, module: torch.nn.Module) -> Iterator[None]:
        """Inside the block, on this thread, ``module`` is the outermost module being called: paths
        are relative to it whatever is called first (a wrapper around it, or one of its children)."""
        self._push(module)
        try:
            yield
        finally:
            self._pop(module)

    def root(self) -> torch.nn.Module | None:
        """The module paths are relative to: the outermost module being called on this thread (what
        ``torch.compile`` wraps, for a compiled one), or the recording's model when that outermost
        module is inside it (the model's own call was not seen: it ran inside compiled code, or the
        training code called one of its children), or the recording's model when nothing is being
        called."""
        stack = self._stack()
        model = self.model
        if not stack:
            return model
        bottom = compiled.unwrapped(stack[0])
        if model is None or bottom is model or not self._paths_under(model, bottom)[id(bottom)]:
            return bottom
        return model

    def _paths_under(self, root: torch.nn.Module, module: torch.nn.Module) -> dict[int, str]:
        """``{id(m): path}`` of the modules under ``root``, cached, rebuilt when ``module`` is not among
        them; a module not under ``root`` is then entered with the path "" (root's own), so that it
        does not rebuild them on every call."""
        return self._entry(root, module)[1]

    def _entry(self, root: torch.nn.Module, module: torch.nn.Module
               ) -> tuple[Any, dict[int, str], dict[int, list[str]]]:
        entry = self._paths.get(id(root))
        if entry is None or entry[0]() is not root or id(module) not in entry[1]:
            paths: dict[int, str] = {}
            others: dict[int, list[str]] = {}
            for named, m in root.named_modules(remove_duplicate=False):
                name = compiled.path_without_wrappers(named)
                if id(m) not in paths:
                    paths[id(m)] = name
                elif name != paths[id(m)]:
                    others.setdefault(id(m), []).append(name)
            if len(self._paths) >= 64:  # a new outermost module per call: forget the old ones
                self._paths.clear()
            entry = self._paths[id(root)] = (weakref.ref(root), paths, others)  # (a reused id is not the old module)
            paths.setdefault(id(module), "")
        return entry

    def outermost(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is the outermost module being called on this thread, and called now."""
        stack = self._stack()
        return len(stack) == 1 and stack[0] is module

    def path_of(self, module: torch.nn.Module) -> str:
        """Path of ``module`` relative to ``root()`` ("" for that module)."""
        root = self.root()
        if root is None or root is module:
            return ""
        return self._paths_under(root, module)[id(module)]

    def other_paths(self, module: torch.nn.Module) -> list[str]:
        """The other paths ``module`` is reached by under ``root()`` (``dec`` for ``self.dec = self.enc``)."""
        root = self.root()
        return [] if root is None or root is module else self._entry(root, module)[2].get(id(module), [])

    def enclosing_path(self) -> str:
        """Path of the innermost module running (for function steps), or ""."""
        stack = self._stack()
        return self.path_of(stack[-1]) if stack else ""

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
            # torch's global handle forgets its with_kwargs flag: left there, it keeps
            # ``_has_any_global_hook()`` true for the rest of the process.
            module_mod._global_forward_hooks_with_kwargs.pop(handle.id, None)
        self._handles.clear()
        self.model = None  # a closed recording keeps no training object alive
