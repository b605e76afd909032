"""Interventions: swap a module or function, edit a tensor, override settings or the seed, and
replay to see what changes.

    replayer.replay(rec, origin, swap={"smooth_relu": "mypkg.stable:smooth_relu"})
    replayer.replay(rec, origin, edit={"args.0": "x.clamp(-50, 50)"})
    replayer.replay(rec, "Model@iter=5", edit={"smooth_relu#0/args.0": "torch.nan_to_num(x)"})

Keys: a swap key is a module path, a step name or paper label (``.`` is the replayed module itself);
an edit key is ``TENSOR`` for the replayed step's own tensors (inputs ``args.0``/``kwargs.mask``,
parameters, buffers, grad outputs) or ``STEP/TENSOR`` for a step inside it (STEP as in a selector,
``NAME[#CALL]``, NAME a step name, paper label, or module path, also relative to the replayed step's
as swap keys are). A change is an expression in ``x`` (evaluated with ``torch``, ``math`` and ``x``
only), a callable, or a tensor/array. Everything happens to the rebuilt objects of one replay.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from recorder import skeleton
from recorder.errors import PdbgError
from recorder.monitors import parse_selector

from .rebuild import tie

SETTING_ALIASES = {"deterministic": "deterministic_algorithms", "threads": "num_threads",
                   "tf32": "cuda_matmul_allow_tf32", "matmul_precision": "float32_matmul_precision"}


class InterventionError(PdbgError, ValueError):
    """A swap, edit or override that cannot be applied as given."""


@dataclass
class Change:
    """One edit, ready to apply."""

    key: str  # as the user gave it
    step: str | None  # the inner step part (selector NAME[#CALL]), None for the replayed step itself
    tensor: str
    apply: Callable[[torch.Tensor], torch.Tensor]
    text: str | None  # the expression, when it was one (recipes keep only these)
    used: int = 0

    def run(self, x: torch.Tensor) -> torch.Tensor:
        try:
            out = self.apply(x)
        except Exception as exc:
            raise InterventionError(f"edit {self.key}: {type(exc).__name__}: {exc}") from None
        if isinstance(out, np.ndarray):
            out = torch.from_numpy(out)
        if not isinstance(out, torch.Tensor):
            raise InterventionError(f"edit {self.key} gave {_a(type(out).__name__)}, not a tensor")
        return out.to(x.device)


def expression(text: str, key: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An expression in ``x``, checked now and evaluated with ``torch``, ``math`` and ``x`` only."""
    try:
        code = compile(ast.parse(text, mode="eval"), f"<edit {key}>", "eval")
    except SyntaxError as exc:
        raise InterventionError(f"edit {key}: {text!r} is not a Python expression ({exc.msg}); write one in x, "
                                "e.g. 'x.clamp(-50, 50)'") from None
    names = {n.id for n in ast.walk(ast.parse(text, mode="eval")) if isinstance(n, ast.Name)}
    unknown = sorted(names - {"x", "torch", "math"})
    if unknown:
        raise InterventionError(f"edit {key}: {text!r} uses {', '.join(unknown)}; an edit may use only x, torch "
                                "and math")

    def apply(x: torch.Tensor) -> torch.Tensor:
        return eval(code, {"__builtins__": {}}, {"torch": torch, "math": math, "x": x})  # noqa: S307 - the user's own edit

    return apply


def parse_edits(edit: dict[str, Any] | None) -> list[Change]:
    out = []
    for key, change in (edit or {}).items():
        if not isinstance(key, str) or not key:
            raise InterventionError(f"edit keys name a tensor ('args.0', 'smooth_relu/args.0'), not {key!r}")
        step, _, tensor = key.rpartition("/")
        if step:
            parse_selector(step)  # a bad selector is refused here
        text = None
        if isinstance(change, str):
            text, fn = change, expression(change, key)
        elif isinstance(change, (torch.Tensor, np.ndarray)):
            value = change if isinstance(change, torch.Tensor) else torch.from_numpy(np.array(change))
            fn = lambda x, v=value: v.clone()  # noqa: E731
        elif callable(change):
            fn = change
        else:
            raise InterventionError(f"edit {key}: give an expression in x, a callable or a tensor, not "
                                    f"{type(change).__name__}")
        out.append(Change(key, step or None, tensor, fn, text))
    return out


def parse_settings(settings: dict[str, Any] | None, known: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in (settings or {}).items():
        name = SETTING_ALIASES.get(key, key)
        if name not in known:
            raise InterventionError(f"unknown setting {key!r}; settings of this step: {', '.join(sorted(known))}")
        recorded = known[name]
        numbers = (int, float)
        kind = isinstance(value, numbers) if isinstance(recorded, numbers) else type(value) is type(recorded)
        same_kind = isinstance(value, bool) == isinstance(recorded, bool) and kind
        if recorded is not None and value is not None and not same_kind:
            raise InterventionError(f"setting {key}={value!r}: it was {recorded!r} when recorded; give a "
                                    f"{'true/false' if isinstance(recorded, bool) else type(recorded).__name__} value")
        if name in ("num_threads", "num_interop_threads") and isinstance(value, int) and value < 1:
            raise InterventionError(f"setting {key}={value!r}: a thread count is a positive integer")
        out[name] = value
    return out


@dataclass
class Swap:
    """One swap: where, and with what."""

    key: str
    replacement: Any  # resolved: a class, a function, or a factory callable
    text: str | None  # the import reference, when it was one
    used: int = 0


@dataclass
class Plan:
    """Every intervention of one replay, and what it reported."""

    swaps: list[Swap] = field(default_factory=list)
    edits: list[Change] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.swaps or self.edits or self.settings or self.seed is not None)

    def edits_for(self, step: str | None) -> list[Change]:
        return [c for c in self.edits if c.step == step]

    def edits_inside(self) -> bool:
        return any(c.step is not None for c in self.edits)

    def describe(self) -> dict[str, Any]:
        """The intervention as JSON (what a recipe stores); callables and tensors by their type."""
        return {"swap": {s.key: s.text or f"<{type(s.replacement).__name__}>" for s in self.swaps},
                "edit": {c.key: c.text or "<callable or tensor>" for c in self.edits},
                "settings": self.settings, "seed": self.seed}


def matches(step_part: str, step: Any, relative_to: str = "") -> bool:
    """Whether the STEP part of an edit key names an inner ``step``: by name, paper label or module
    path, that path also taken relative to the replayed step's (``relative_to``), as swap keys are."""
    sel = parse_selector(step_part)
    if sel.call is not None and sel.call != step.call:
        return False
    name, label, path = step.name, step.paper.get("label"), step.module_path
    if sel.matches_name(name, label, path):
        return True
    inside = relative_to and path.startswith(relative_to + ".")
    return bool(inside) and sel.name != "." and sel.matches_name(name, label, path[len(relative_to) + 1:])


def swap_function(original: Callable[..., Any], sw: Swap) -> Callable[..., Any]:
    """The function that replaces a function step: an import reference names it, a callable makes it."""
    sw.used += 1
    new = sw.replacement
    if isinstance(new, type):
        raise InterventionError(f"swap {sw.key}: {new.__qualname__} is a class; a function step is swapped for a "
                                "function (an import reference) or a callable original -> new")
    if sw.text is None:  # a callable given in Python: a factory
        try:
            new = new(original)
        except Exception as exc:
            raise InterventionError(
                f"swap {sw.key}: a callable given in Python is a factory, called with the original function to "
                f"make the replacement, and {getattr(sw.replacement, '__qualname__', 'it')}(original) raised "
                f"{type(exc).__name__}: {exc}; to swap in a function itself, give lambda original: "
                f"{getattr(sw.replacement, '__name__', 'new_function')}, or its import reference "
                "('module:function')") from None
        if not callable(new):
            raise InterventionError(f"swap {sw.key}: the replacement gave {_a(type(new).__name__)}, not a function")
    return getattr(new, "__wrapped__", new)  # a decorated replacement runs as itself, not as a new step


def swap_module(original: torch.nn.Module, replacement: Any, key: str, build_from_skeleton: Callable[[type], Any],
                init: tuple[list[Any], dict[str, Any]] | None, notes: list[str]) -> torch.nn.Module:
    """The module that takes ``original``'s place."""
    if isinstance(replacement, type):
        if not issubclass(replacement, torch.nn.Module):
            raise InterventionError(f"swap {key}: {replacement.__qualname__} is not an nn.Module class")
        new = None
        if init is not None:
            try:
                new = replacement(*init[0], **init[1])
            except Exception as exc:  # noqa: BLE001 - fall back to the skeleton, and say so
                notes.append(f"swap {key}: {replacement.__qualname__}(...) with the original's constructor arguments "
                             f"failed ({type(exc).__name__}: {exc}); built from the original's skeleton")
        rebuilt = None
        if new is None:
            rebuilt = build_from_skeleton(replacement)  # a rebuild.Rebuilt: tensors still to be given
            new = rebuilt.module
        _take_parameters(original, new, key, notes, placeholders=rebuilt is not None)
        if rebuilt is not None:
            rebuilt.link()  # an RNN's _flat_weights and the like: at the tensors just given
        new.train(original.training)
        return new
    factory = ("a module step is swapped for an nn.Module class, or a function that takes the original "
               "module and returns its replacement (a factory)")
    try:
        new = replacement(original)
    except Exception as exc:
        raise InterventionError(f"swap {key}: the replacement, called as a factory with the original module, raised "
                                f"{type(exc).__name__}: {exc}; {factory}") from None
    if not isinstance(new, torch.nn.Module):
        raise InterventionError(f"swap {key}: the replacement, called as a factory with the original module, gave "
                                f"{_a(type(new).__name__)}, not an nn.Module; {factory}")
    return new


def _take_parameters(original: torch.nn.Module, new: torch.nn.Module, key: str, notes: list[str],
                     placeholders: bool = False) -> None:
    """Give ``new`` the original's parameters and buffers where names and shapes match; name the rest.
    ``placeholders``: ``new`` was built from the original's skeleton, its tensors are empty stand-ins
    that take the original's whatever their shape (and its parameters' ``requires_grad``)."""
    theirs = {**dict(original.named_parameters(remove_duplicate=False)), **dict(original.named_buffers())}
    mine = {**dict(new.named_parameters(remove_duplicate=False)), **dict(new.named_buffers())}
    taken, odd = [], []
    for name, value in mine.items():
        source = theirs.get(name)
        if source is None:
            continue
        if source.shape != value.shape and not placeholders:
            odd.append(f"{name} ({list(source.shape)} there, {list(value.shape)} here)")
            continue
        with torch.no_grad():
            value.data = source.detach().clone().to(source.dtype if placeholders else value.dtype)
        if placeholders and isinstance(value, torch.nn.Parameter):
            value.requires_grad_(source.requires_grad)
        taken.append(name)
    # Tied weights of the original are tied in the replacement too, among the names it took.
    tie(new, {a: b for a, b in skeleton.tied_parameters(original).items() if a in taken and b in taken})
    missing = sorted(set(mine) - set(taken) - {o.split(" ")[0] for o in odd})
    unused = sorted(set(theirs) - set(taken) - {o.split(" ")[0] for o in odd})
    if missing:
        notes.append(f"swap {key}: not in the original, left as the replacement made them: {', '.join(missing)}")
    if unused:
        notes.append(f"swap {key}: the original's {', '.join(unused)} have no place in the replacement")
    if odd:
        notes.append(f"swap {key}: shapes differ, left as the replacement made them: {', '.join(odd)}")


def _a(noun: str) -> str:
    """``noun`` with its indefinite article ("an int", "a float")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
