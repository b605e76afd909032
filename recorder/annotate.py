"""Marking paper steps: ``paper_step`` for functions and module classes, ``annotate`` for module
instances, ``watch`` for named intermediate tensors.

Decorating changes nothing while no recording is active: the wrapper checks one global and calls
through. Definitions (paper reference, import reference, source) are computed once, lazily.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import linecache
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch.nn.modules.lazy import LazyModuleMixin

from . import capture, jsonval, skeleton, snapshot

T = TypeVar("T")


@dataclass(eq=False)
class StepDef:
    """What a paper step is: its name, its place in the paper and where its code lives."""

    name: str
    label: str
    algorithm: str | int | None
    step: str | int | None
    equation: str | None
    description: str | None
    kind: str  # "function" or "module"
    target: Any  # the undecorated function, or the class
    _doc: dict[str, Any] | None = field(default=None, repr=False)
    # the module-level generator objects its code reads (snapshot.find_global_rngs), found at its first call
    rngs: tuple[tuple[str, dict[str, Any], str], ...] | None = field(default=None, repr=False)
    # its parameters whose default is a tensor or a generator object (snapshot.step_defaults), found at its first call
    defaults: tuple[tuple[int | None, str, Any, bool], ...] | None = field(default=None, repr=False)
    # (the places of the classes and functions its code reads as module-level globals, with the values
    # they held (snapshot.find_global_code), the definition document naming those bound elsewhere), noted at
    # its first call and again when one of them is rebound (STE = STES[args.ste] in main)
    _noted: tuple[tuple[tuple[dict[str, Any], str, Any], ...], dict[str, Any]] | None = field(default=None, repr=False)
    _docs: dict[tuple[tuple[str, str], ...], dict[str, Any]] = field(default_factory=dict, repr=False)
    # where the function is a decorator's wrapper without functools.wraps: {"decorator", "around", "variable"}
    wrapper: dict[str, Any] | None = field(default=None, repr=False)
    # where paper_step was called on the function outside the code that defines it (a library's function patched at
    # run time: adam._single_tensor_adam = paper_step(...)(adam._single_tensor_adam)): _made_outside
    made: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def paper(self) -> dict[str, Any]:
        return {"label": self.label, "algorithm": self.algorithm, "step": self.step,
                "equation": self.equation, "description": self.description}

    def doc_now(self) -> dict[str, Any]:
        """The definition document of a call starting now: ``doc()``, with ``"globals"`` naming what the
        module-level names its code reads are bound to where that is not their own definition
        (``{"STE": "__main__:SmoothSTE"}``). At each call, one identity check per name noted; looked
        through again only when one was rebound. The same bindings give the same document object (the
        writer knows it by identity)."""
        noted = self._noted
        if noted is not None:
            for space, name, value in noted[0]:
                if space.get(name) is not value:
                    break
            else:
                return noted[1]
        places, refs = snapshot.find_global_code(self.target)
        doc = self.doc()
        if refs:
            key = tuple(refs.items())
            found = self._docs.get(key)
            if found is None:
                if len(self._docs) >= 64:  # bindings that keep changing: only a cache
                    self._docs.clear()
                found = self._docs[key] = {**doc, "globals": refs}
            doc = found
        self._noted = (places, doc)
        return doc

    def doc(self) -> dict[str, Any]:
        """The definition document stored with every step (computed once, at its first call, on the
        thread that made it: one at a time, as ``ast.parse`` is not safe in two threads at once)."""
        if self._doc is None:
            with _SOURCE_LOCK:
                if self._doc is None:
                    self._doc = {"name": self.name, "paper": self.paper, "kind": self.kind, **code_info(self.target)}
                    if self.wrapper is not None:
                        self._doc["wrapper"] = self.wrapper
        return self._doc

    def unfound(self) -> str | None:
        """A warning where a replay will not find this function step by its import reference: it is a
        decorator's wrapper without functools.wraps (``paper_step`` above the decorator), or its name is bound
        to one made around it (below it: ``bound_wrapper``), or it is a lambda. Said when a recording first
        meets the step, not when it is decorated (a replay loading the code decorates it again)."""
        target = self.target
        if self.kind != "function" or not isinstance(target, types.FunctionType):
            return None
        qualname, said = target.__qualname__, f"PaperDebugger: step {self.name} ({self.label}) is recorded, but"
        if self.wrapper is not None:
            return (f"{said} the function it runs, {qualname}, is a wrapper the decorator {self.wrapper['decorator']} "
                    f"defines around {self.wrapper['around']} without functools.wraps, which a replay cannot find "
                    f"again by its name; add @functools.wraps({self.wrapper['variable']}) to that wrapper")
        if qualname.rpartition(".")[2] == "<lambda>":
            return (f"{said} it is a lambda, which a replay cannot find again by its name; define it with def at "
                    "module level")
        if "<" in qualname:
            return None
        obj: Any = sys.modules.get(target.__module__)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        found = bound_wrapper(obj)
        if found is not None and found[2] is self:
            return (f"{said} {target.__module__}.{qualname} is {found[0]}: a replay finds that wrapper by the step's "
                    f"name, not the step; {found[1]}")
        made = self.made
        if made is None or _runs_again(made):
            return None
        where = f"{made['file']}:{made['line']}"
        return (f"{said} it is a paper step made at run time: paper_step was called on {target.__module__}.{qualname} "
                f"at {where}, outside the code that defines it (a patch of a library's function), and a replay "
                f"imports {target.__module__} and finds the undecorated function there; decorate a function defined "
                "at the top level of your own code that calls it, and patch that in, or make the patch at the top "
                "level of the training script, outside `if __name__ == \"__main__\":` (a replay loads that)")


# Finding a step's source parses files (inspect.getsourcelines, ast.parse). Two training threads that
# call steps for the first time at once made CPython 3.11's parser raise "AST constructor recursion
# depth mismatch", and the recording stopped.
_SOURCE_LOCK = threading.Lock()


def source_lines(target: Any) -> tuple[list[str], int, str | None]:
    """``inspect.getsourcelines`` of a function or class, and its file. The file is that of the code
    the lines come from: ``getsourcelines`` looks through ``__wrapped__`` (a step under
    ``@torch.no_grad()`` or a ``functools.wraps`` decorator is the user's function, not torch's
    ``_contextlib.py``), ``getsourcefile`` does not. A class whose module has no file (defined in a
    notebook cell: its ``__main__`` is the kernel's) is found through its methods' code, which names
    the cell's file. Raises OSError or TypeError when there is none."""
    try:
        lines, line = inspect.getsourcelines(target)
        try:
            inner = inspect.unwrap(target)
        except ValueError:  # a cycle of __wrapped__ (getsourcelines raised it already)
            inner = target
        return lines, line, inspect.getsourcefile(inner)
    except (OSError, TypeError):  # (TypeError: "a built-in class", for a module without a file)
        if not isinstance(target, type):
            raise
    for value in vars(target).values():
        function = getattr(value, "__func__", value)
        with contextlib.suppress(ValueError):  # (a cycle of __wrapped__)
            function = inspect.unwrap(function)  # paper_step's own wrappers of __init__ and forward
        code = getattr(function, "__code__", None)
        lines = linecache.getlines(code.co_filename) if code is not None else []
        if not lines:
            continue
        try:
            tree = ast.parse("".join(lines))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == target.__name__ and \
                    node.lineno <= code.co_firstlineno <= (node.end_lineno or 0):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                return lines[start - 1:node.end_lineno], start, code.co_filename
    raise OSError(f"no source found for {target!r}")


def code_info(target: Any) -> dict[str, Any]:
    """Import reference, file, first line, source text and its SHA-256 for a function or class."""
    module = getattr(target, "__module__", None) or "?"
    info: dict[str, Any] = {"ref": f"{module}:{getattr(target, '__qualname__', repr(target))}",
                            "file": None, "line": None, "source": None, "source_sha256": None}
    try:
        lines, info["line"], file = source_lines(target)
        info["file"] = os.path.abspath(file) if file else None  # a script run by a relative path, too
        source = "".join(lines)
        info["source"] = source
        info["source_sha256"] = hashlib.sha256(source.encode()).hexdigest()
    except (OSError, TypeError):  # built in, or defined where no source exists (a REPL)
        pass
    if module == "__main__":
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None)
        info["script"] = os.path.abspath(script) if script else None
    return info


# Per class: where it is defined and its source's SHA-256, or None (torch's, an installed package's, no
# source): found once per class, however many modules of it a recording meets.
_CLASS_CODE: weakref.WeakKeyDictionary[type, dict[str, Any] | None] = weakref.WeakKeyDictionary()


def class_code(cls: type) -> dict[str, Any] | None:
    """``{"file", "line", "source_sha256"}`` of a class that is the training code's own (a script, a project
    on the path: ``jsonval.user_code``), found once per class; None for torch's and installed packages'
    classes (the recorded versions cover those), one defined inside a function (no replay finds it again)
    and one whose source cannot be read."""
    try:
        return _CLASS_CODE[cls]
    except KeyError:
        pass
    except TypeError:  # a metaclass that makes its classes unhashable
        return None
    module = getattr(cls, "__module__", None)
    qualname = getattr(cls, "__qualname__", None)
    found = None
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname and (
            module == "__main__" or jsonval.user_code(module)):  # (__main__: a notebook's too, which has no file)
        try:
            with _SOURCE_LOCK:
                info = code_info(cls)
        except Exception:  # noqa: BLE001 - a class inspect cannot place: not hashed, the recording goes on
            info = {"source_sha256": None}
        if info["source_sha256"]:
            found = {"file": info["file"], "line": info["line"], "source_sha256": info["source_sha256"]}
    _CLASS_CODE[cls] = found
    return found


def submodule_code(classes: Iterable[type]) -> dict[str, dict[str, Any]]:
    """``{"module:QualName": class_code(cls)}`` for those of ``classes`` that are the training code's own."""
    out = {}
    for cls in classes:
        code = class_code(cls)
        if code is not None:
            out[jsonval.type_ref(cls)] = code
    return out


def _check_label(label: Any, caller: str = "paper_step", **texts: Any) -> None:
    """Refuse a label (and the other texts a step is given) that no listing can show on one line, or no
    selector can name: not a string, empty or blank, or holding a control character. ``caller``: the
    function given them, as the messages name it (``paper_step``, ``annotate``)."""
    example = "paper_step('Eq. 2')" if caller == "paper_step" else "annotate(module, 'Eq. 2')"
    where = "first" if caller == "paper_step" else "after the module"
    if not isinstance(label, str) or not label:
        raise TypeError(f"{caller} needs the paper's label as a non-empty string {where}, e.g. {example}, not "
                        f"{label!r}")
    for what, text in (("label", label), *texts.items()):  # one line each in every listing and message
        if isinstance(text, str) and any(ord(c) < 32 or ord(c) == 127 for c in text):
            raise ValueError(f"{caller}'s {what} {text!r} holds a control character (a newline, a tab, an "
                             "escape); give it on one line of printable text")
        if what in ("label", "name") and isinstance(text, str) and not text.strip():  # (a selector could not name it)
            raise ValueError(f"{caller}'s {what} {text!r} is blank; give it as the paper writes it, e.g. {example}")


def paper_step(label: str, *, algorithm: str | int | None = None, step: str | int | None = None,
               equation: str | None = None, description: str | None = None,
               name: str | None = None) -> Callable[[T], T]:
    """Mark a function or an ``nn.Module`` class as one step of the paper.

    Args:
        label: what the paper calls it ("Algorithm 1", "Eq. 2").
        algorithm: the algorithm it belongs to, if any.
        step: its step number in that algorithm.
        equation: the equation it implements ("Eq. 7").
        description: one line in the paper's words.
        name: the step's name; defaults to the function's or class's qualified name.

    A decorated class records its ``forward`` calls and, as data, the arguments each instance was
    constructed with (so replay can rebuild it).
    """
    _check_label(label, name=name, description=description, algorithm=algorithm, equation=equation)

    def decorate(target: T) -> T:
        return mark(target, sys._getframe(1))

    def mark(target: Any, frame: types.FrameType) -> Any:  # frame: the code that decorates it, running
        where = frame.f_code
        if isinstance(target, (staticmethod, classmethod)):  # above @staticmethod: the function it holds, kept static
            return type(target)(mark(target.__func__, frame))
        _check_not_autograd_function(target)
        if isinstance(target, type) and issubclass(target, torch.nn.Module):
            _check_function(target.forward, f"{target.__qualname__}.forward")
            return _decorate_class(target, name or target.__qualname__, label, algorithm, step, equation,
                                   description)
        if callable(target):
            _check_function(target)
            # a decorator's wrapper without functools.wraps (decorated here, defined and returned by the decorator)
            wrapper = _wrapper_of(target)
            if wrapper is not None and target.__code__ in where.co_consts:
                wrapper = None  # (a factory's own step, defined and decorated in one call)
            inner = getattr(wrapper[2], "__qualname__", None) if wrapper is not None else None
            defn = StepDef(name or inner or target.__qualname__, label, algorithm, step, equation, description,
                           "function", target)
            if wrapper is not None:  # (said when a recording first meets it: StepDef.unfound)
                defn.wrapper = {"decorator": wrapper[0], "around": inner, "variable": wrapper[1]}
            defn.made = _made_outside(target, frame)
            return _wrap_function(target, defn)
        raise TypeError(f"paper_step decorates functions and nn.Module classes, not {type(target).__name__}")

    return decorate


def _wrapper_of(fn: Any) -> tuple[str, str, Any] | None:
    """(the decorator's qualified name, the name the wrapper holds the function by, that function) where
    ``fn`` could be a wrapper a decorator defined inside itself without ``functools.wraps``: a function of
    another's locals (``twice.<locals>.w``) that holds a function and says of none it wraps it (no
    ``__wrapped__``); else None."""
    if not isinstance(fn, types.FunctionType) or "__wrapped__" in fn.__dict__ or not fn.__closure__:
        return None
    decorator, local, _ = fn.__qualname__.rpartition(".<locals>.")
    if not local:
        return None
    for variable, cell in zip(fn.__code__.co_freevars, fn.__closure__):
        try:
            held = cell.cell_contents
        except ValueError:  # (a cell not filled yet)
            continue
        if callable(held) and not isinstance(held, type) and isinstance(getattr(held, "__qualname__", None), str):
            return decorator, variable, held
    return None


def _made_outside(fn: Any, frame: types.FrameType | None) -> dict[str, Any] | None:
    """``{"file", "line", "tops"}`` of the call of ``paper_step`` on ``fn`` (``frame``: the code that made it),
    where no code of the file that defines ``fn`` is on the way to that call: a library's function patched at
    run time (``adam._single_tensor_adam = paper_step(...)(adam._single_tensor_adam)``), which importing its
    module does not decorate again. ``tops``: ``(file, line)`` of each module's top-level code on the way (the
    training script's, where it made the patch or called what did). None otherwise, and for a function of
    ``__main__`` (a replay finds it in the script, or in the session that made it)."""
    if frame is None or getattr(fn, "__module__", None) == "__main__":
        return None
    try:
        code = getattr(inspect.unwrap(fn), "__code__", None)
    except ValueError:  # a cycle of __wrapped__
        code = None
    defined = getattr(code, "co_filename", None)  # (None: a builtin, defined by no file of Python code)
    tops = []
    outer: types.FrameType | None = frame
    while outer is not None:
        if outer.f_code.co_filename == defined:  # its module decorates it (through a factory of another file)
            return None
        if outer.f_code.co_name == "<module>":
            tops.append((outer.f_code.co_filename, outer.f_lineno))
        outer = outer.f_back
    return {"file": frame.f_code.co_filename, "line": frame.f_lineno, "tops": tops}


def is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` in either order, possibly combined with other conditions."""
    if not isinstance(node, ast.If):
        return False
    for sub in ast.walk(node.test):
        if isinstance(sub, ast.Compare) and len(sub.ops) == 1 and isinstance(sub.ops[0], (ast.Eq, ast.Is)):
            sides = [sub.left, *sub.comparators]
            names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
            mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
            if names and mains:
                return True
    return False


def _runs_again(made: dict[str, Any]) -> bool:
    """Whether a replay makes again the call of ``paper_step`` that ``made`` (``_made_outside``) places: one the
    training script's top level made (or called code that made), outside its ``if __name__ == "__main__":``
    block, which a replay loads (the statements of a script without that block are loaded only where they define
    something: not a patch)."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(script, str):
        return False
    lines = [line for file, line in made["tops"] if os.path.abspath(file) == os.path.abspath(script)]
    if not lines:
        return False
    try:
        with _SOURCE_LOCK:  # (ast.parse in two threads at once: see _SOURCE_LOCK)
            tree = ast.parse("".join(linecache.getlines(script)) or Path(script).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return False
    guards = [node for node in tree.body if is_main_guard(node)]
    return bool(guards) and not any(node.lineno <= line <= (node.end_lineno or node.lineno)
                                    for node in guards for line in lines)


def bound_wrapper(obj: Any) -> tuple[str, str, StepDef] | None:
    """(what it is, what to do, the step) where ``obj``, which a step's import reference names, is a wrapper a
    decorator defined around the paper step without ``functools.wraps`` (``@twice`` above ``@paper_step``):
    that name finds the wrapper, and a replay does not look for the step inside it. None otherwise."""
    found = _wrapper_of(obj)
    if found is None or getattr(obj, "__pdbg_step__", None) is not None:
        return None
    decorator, variable, held = found
    defn = getattr(held, "__pdbg_step__", None)
    if not isinstance(defn, StepDef):
        return None
    return (f"{obj.__qualname__}, a wrapper the decorator {decorator} defines around the paper step {defn.name} "
            "without functools.wraps", f"add @functools.wraps({variable}) to that wrapper", defn)


def _check_not_autograd_function(target: Any) -> None:
    """A TypeError for a custom ``torch.autograd.Function`` or its ``apply``: decorating the class would make it
    a function (its ``apply`` gone, the training code broken), and its ``apply`` is torch's one
    ``Function.apply`` bound to it, which a replay cannot find again by the class's name."""
    if isinstance(target, type) and issubclass(target, torch.autograd.Function):
        what = f"{target.__qualname__}: it is a torch.autograd.Function, not a function or an nn.Module class"
        owner = target
    elif inspect.ismethod(target) and isinstance(target.__self__, type) and \
            getattr(target, "__func__", None) is _FUNCTION_APPLY:
        owner = target.__self__
        what = (f"{owner.__qualname__}.apply: it is torch's Function.apply bound to {owner.__qualname__} (every "
                "custom autograd.Function's apply is that one function), which a replay cannot find again")
    else:
        return
    raise TypeError(f"paper_step cannot decorate {what}; decorate a function that calls "
                    f"{owner.__qualname__}.apply(...)")


_FUNCTION_APPLY = getattr(inspect.getattr_static(torch.autograd.Function, "apply"), "__func__", None)


def _check_function(fn: Callable[..., Any], what: str | None = None) -> None:
    """A TypeError for what a function step (or a module step's ``forward``: ``what``) cannot be: code
    whose body runs after the call returns, or a callable with no definition of its own to find again at
    replay."""
    if isinstance(fn, functools.partial) and what is None:
        raise TypeError(f"paper_step cannot decorate functools.partial({getattr(fn.func, '__qualname__', fn.func)!s}, "
                        "...): a partial has no definition of its own to replay; decorate the function it wraps, "
                        "or a def that calls it")
    later = ("a generator function" if inspect.isgeneratorfunction(fn) else
             "an async generator function" if inspect.isasyncgenfunction(fn) else
             "a coroutine function" if inspect.iscoroutinefunction(fn) else None)
    if later is not None:
        fix = "decorate a function that computes" if what is None else "make it compute"
        raise TypeError(f"paper_step cannot record {what or getattr(fn, '__qualname__', fn)!s}: it is {later}, whose "
                        "body runs after the call has returned (as the caller iterates or awaits it), outside the "
                        f"step; {fix} the values and return{'s' if what is None else ''} them")
    if what is None and type(fn).__name__ == "CustomOpDef":  # (torch.library.custom_op's, no __qualname__)
        raise TypeError(f"paper_step cannot decorate the operator {getattr(fn, '_qualname', fn)!s} that "
                        "torch.library.custom_op made (it has no definition to find again at replay); decorate a def "
                        "that calls it (whose backward is then recorded too), or put @recorder.paper_step under "
                        "@torch.library.custom_op")
    if what is None and not isinstance(getattr(fn, "__qualname__", None), str):
        raise TypeError(f"paper_step decorates functions and nn.Module classes, not {type(fn).__name__} objects "
                        "(they have no definition to find again at replay); decorate a def")


_MUTABLE_DEFAULTS = (dict, list, set, bytearray, torch.Tensor, np.ndarray)


def _mutable_defaults(fn: Callable[..., Any]) -> tuple[inspect.Signature | None, dict[str, Any]]:
    """``fn``'s own signature (not that of a function it wraps: a decorator may supply an argument
    itself) and its parameters (passable by keyword) whose default is a mutable object (a dict,
    list, set, tensor or array): state a call may carry over to the next, as a step counter kept in
    ``state={"t": 0}`` does."""
    try:
        sig = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin without a signature
        return None, {}
    held = {name: p.default for name, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and isinstance(p.default, _MUTABLE_DEFAULTS)}
    return (sig, held) if held else (None, {})


def _plain_data(value: Any, budget: list[int], depth: int = 0) -> bool:
    """Whether ``value`` is data a recording holds as it is (numbers, text, tensors, arrays, and
    lists, tuples, sets and dicts of them), within ``budget`` items: a counter or a list of losses,
    not a cache of functions or modules (which a replay could not be given back)."""
    budget[0] -= 1
    if budget[0] < 0 or depth > 8:
        return False
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.Tensor, np.ndarray)):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_plain_data(v, budget, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_plain_data(k, budget, depth + 1) and _plain_data(v, budget, depth + 1) for k, v in value.items())
    return False


def _with_defaults(sig: inspect.Signature, held: dict[str, Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the mutable defaults the call leaves to ``fn`` given as the call would use
    them (the same objects), where they are plain data: recorded as they are when the call begins,
    so that a replay does not depend on the calls before it."""
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:  # a call fn itself refuses: it raises its own error, in the step
        return kwargs
    given = {n: d for n, d in held.items() if n not in bound.arguments and _plain_data(d, [1024])}
    return {**kwargs, **given} if given else kwargs


def _wrap_function(fn: Callable[..., Any], defn: StepDef) -> Callable[..., Any]:
    sig, held = _mutable_defaults(fn)

    @functools.wraps(fn)
    def step_wrapper(*args: Any, **kwargs: Any) -> Any:
        if capture.ACTIVE is None:
            return fn(*args, **kwargs)
        if held:
            kwargs = _with_defaults(sig, held, args, kwargs)  # type: ignore[arg-type]
        return capture.ACTIVE.call(defn, fn, None, args, kwargs)

    step_wrapper.__pdbg_step__ = defn  # type: ignore[attr-defined]
    return step_wrapper


def _decorate_class(cls: type, name: str, *paper: Any) -> type:
    defn = StepDef(name, *paper, kind="module", target=cls)
    forward = cls.forward
    if "forward" not in vars(cls) and getattr(forward, "__pdbg_step__", None) is not None:
        # inherited from a class that is a step too: a call of this class is this step alone (its base's
        # would be recorded inside it as a second step of the same call, and named by bisect as the innermost)
        forward = forward.__wrapped__
    sig, held = _mutable_defaults(forward)

    @functools.wraps(forward)
    def forward_wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if capture.ACTIVE is None:
            return forward(self, *args, **kwargs)
        if held:
            kwargs = _with_defaults(sig, held, (self, *args), kwargs)  # type: ignore[arg-type]
        return capture.ACTIVE.call(defn, forward, self, args, kwargs)

    init = cls.__init__

    @functools.wraps(init)
    def init_wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        skeleton.remember(self, init_wrapper, args, kwargs)
        init(self, *args, **kwargs)

    init_wrapper.__pdbg_init__ = True  # type: ignore[attr-defined]

    forward_wrapper.__pdbg_step__ = defn  # type: ignore[attr-defined]
    cls.forward = forward_wrapper  # type: ignore[attr-defined]
    cls.__init__ = init_wrapper  # type: ignore[misc]
    cls.__pdbg_step__ = defn  # type: ignore[attr-defined]
    _keep_class(cls)
    return cls


def _keep_class(cls: type) -> None:
    """Keep a decorated lazy module (a subclass of ``nn.LazyLinear``) of its class once its first call
    made its parameters: torch then turns it into its ``cls_to_become`` (``nn.Linear``), whose calls are
    no step of the paper, and which drops the class's own methods. It stays a subclass of the lazy class
    (``nn.LazyLinear`` is an ``nn.Linear``; ``nn.LazyBatchNorm1d`` is a ``_BatchNorm``, not an
    ``nn.BatchNorm1d``), whose lazy initialisation does nothing once its parameters are made."""
    becomes = getattr(cls, "cls_to_become", None)
    if issubclass(cls, LazyModuleMixin) and isinstance(becomes, type) and not issubclass(becomes, cls):
        cls.cls_to_become = None  # type: ignore[attr-defined]


def annotate(module: torch.nn.Module, label: str, *, algorithm: str | int | None = None,
             step: str | int | None = None, equation: str | None = None, description: str | None = None,
             name: str | None = None) -> torch.nn.Module:
    """Mark one module instance (one you cannot decorate: a library's) as a paper step.

    Args:
        module: the instance; its ``forward`` calls are recorded from now on.
        label, algorithm, step, equation, description, name: as for ``paper_step``; ``name``
            defaults to the module's class name.

    Returns the same module, so it can wrap a construction expression.
    """
    _check_label(label, "annotate", name=name, description=description, algorithm=algorithm, equation=equation)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"annotate() takes an nn.Module instance, not {type(module).__name__}")
    _check_function(module.forward, f"{type(module).__qualname__}.forward")
    defn = StepDef(name or type(module).__qualname__, label, algorithm, step, equation, description,
                   "module", type(module))
    forward = module.forward  # bound; may itself be an earlier annotation

    def forward_wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if capture.ACTIVE is None:
            return forward(*args, **kwargs)
        return capture.ACTIVE.call(defn, lambda _self, *a, **k: forward(*a, **k), self, args, kwargs)

    forward_wrapper.__pdbg_step__ = defn  # type: ignore[attr-defined]
    module.forward = types.MethodType(forward_wrapper, module)  # type: ignore[method-assign]
    module.__dict__["_pdbg_step"] = defn
    return module


def watch(tensor: T, name: str, *, expected_shape: tuple[int | None, ...] | None = None,
          expected_range: tuple[float, float] | None = None,
          expected_norm_range: tuple[float, float] | None = None,
          expected_mean: tuple[float, float] | None = None, reference: str | None = None) -> T:
    """Record a named intermediate tensor with the step that is running, and check expectations.

    Args:
        tensor: the tensor to record; returned unchanged.
        name: its name in the paper's terms ("attention_weights").
        expected_shape: dimensions it must have; ``None`` matches any size in that position.
        expected_range: (lo, hi) every value must lie in, bounds included (NaN and Inf break it).
        expected_norm_range: (lo, hi) for its L2 norm.
        expected_mean: (value, tolerance) for its mean.
        reference: where the expectation comes from ("Eq. 7").

    A broken expectation marks the step ``alert``. Outside a recording this does nothing. A complex
    tensor's range, norm and mean are those of its magnitudes |z|, as its recorded statistics are.
    """
    if capture.ACTIVE is not None:
        capture.ACTIVE.watch(tensor, name, {
            "name": name, "expected_shape": None if expected_shape is None else list(expected_shape),
            "expected_range": _pair(expected_range), "expected_norm_range": _pair(expected_norm_range),
            "expected_mean": _pair(expected_mean), "reference": reference})
    return tensor


def _pair(value: Any) -> list[float] | None:
    if value is None:
        return None
    lo, hi = value
    return [float(lo), float(hi)]
