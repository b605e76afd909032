"""Which module is running: a per-thread stack kept by global module hooks while a recording is on,
and module paths relative to the outermost module called."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules import module as module_mod

from . import compiled


class ModuleStack:
    """Tracks module calls on every thread; removes its hooks on ``close()``."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.local = threading.local()
        self._paths: dict[int, tuple[Any, dict[int, str]]] = {}  # id(root) -> (weak ref to root, {id(module): path})
        self._handles = [
            module_mod.register_module_forward_pre_hook(self._pre),
            module_mod.register_module_forward_hook(self._post, always_call=True),
        ]

    def _stack(self) -> list[torch.nn.Module]:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if compiled.tracing():  # calls inside compiled code are not seen (recorder.compiled)
            return
        self._stack().append(module)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if compiled.tracing():
            return
        stack = self._stack()
        # Pop back to this module: an exception may have skipped inner posts (they are always_call,
        # but a hook added by someone else can still raise before ours runs).
        while stack:
            if stack.pop() is module:
                break

    @contextlib.contextmanager
    def rooted(self, module: torch.nn.Module) -> Iterator[None]:
        """Inside the block, on this thread, ``module`` is the outermost module being called: paths
        are relative to it whatever is called first (a wrapper around it, or one of its children)."""
        self._pre(module, ())
        try:
            yield
        finally:
            self._post(module, (), None)

    def root(self) -> torch.nn.Module | None:
        """The outermost module being called on this thread (what ``torch.compile`` wraps, for a
        compiled one), else the recording's model."""
        stack = self._stack()
        return compiled.unwrapped(stack[0]) if stack else self.model

    def path_of(self, module: torch.nn.Module) -> str:
        """Path of ``module`` relative to the outermost module being called ("" for that module)."""
        root = self.root()
        if root is None or root is module:
            return ""
        entry = self._paths.get(id(root))
        paths = entry[1] if entry is not None and entry[0]() is root else None
        if paths is None or id(module) not in paths:
            paths = {id(m): compiled.path_without_wrappers(name)
                     for name, m in root.named_modules(remove_duplicate=True)}
            if len(self._paths) >= 64:  # a new outermost module per call: forget the old ones
                self._paths.clear()
            self._paths[id(root)] = (weakref.ref(root), paths)  # a reused id is not taken for the old module
            paths.setdefault(id(module), "")  # not under root: do not rebuild on every call
        return paths[id(module)]

    def enclosing_path(self) -> str:
        """Path of the innermost module running (for function steps), or ""."""
        stack = self._stack()
        return self.path_of(stack[-1]) if stack else ""

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
