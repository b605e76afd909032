"""Interventions: swap a module or function, edit a tensor, override settings or the seed, and
replay to see what changes.

    replayer.replay(rec, origin, swap={"smooth_relu": "mypkg.stable:smooth_relu"})
    replayer.replay(rec, origin, edit={"args.0": "x.clamp(-50, 50)"})
    replayer.replay(rec, "Model@iter=5", edit={"smooth_relu#0/args.0": "torch.nan_to_num(x)"})

Keys: a swap key is a module path, a step name or paper label (``.`` is the replayed module itself);
an edit key is ``TENSOR`` for the replayed step's own tensors (inputs ``args.0``/``kwargs.mask``,
parameters, buffers, grad outputs) or ``STEP/TENSOR`` for a step inside it (STEP as in a selector,
``NAME[#CALL]``, NAME a step name, paper label, or module path, also relative to the replayed step's
as swap keys are). A change is an expression in ``x`` (which may reach only ``x``, torch's
operations, tensor methods and ``math``: see ``expression``), a callable, or a tensor/array.
Everything happens to the rebuilt objects of one replay.
"""

from __future__ import annotations

import ast
import builtins
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from recorder import skeleton
from recorder.errors import PdbgError
from recorder.monitors import parse_selector
from recorder.payload import dtype_from_name

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
    reshaped: str = ""  # what the change made of the tensor's shape or dtype, the first time it changed one

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The edited value of ``x``. The change gets a copy: an in-place expression (``x.mul_(0)``) must
        not reach the tensor the replay goes on using (an inner step's input that its enclosing step
        reads again after the call), or the replay would answer another question than the edit asks."""
        try:
            out = self.apply(x.clone())
            if isinstance(out, np.ndarray):
                out = torch.from_numpy(out)
            if not isinstance(out, torch.Tensor):
                raise InterventionError(f"edit {self.key} gave {_a(type(out).__name__)}, not a tensor")
            if not self.reshaped and (out.shape != x.shape or out.dtype != x.dtype):
                self.reshaped = f"{self.key}: the edit changed {_changed(x, out)}; the step ran with it as it is"
            return out.to(x.device)
        except InterventionError:
            raise
        except Exception as exc:
            raise InterventionError(f"edit {self.key}: {type(exc).__name__}: {_one_line(exc)}") from None


def _changed(was: torch.Tensor, now: torch.Tensor) -> str:
    """What an edit changed of a tensor besides its numbers: ``shape (4, 8) to (3, 8)``."""
    parts = [f"shape {tuple(was.shape)} to {tuple(now.shape)}"] if now.shape != was.shape else []
    if now.dtype != was.dtype:
        parts.append(f"dtype {str(was.dtype).removeprefix('torch.')} to {str(now.dtype).removeprefix('torch.')}")
    return "its " + " and ".join(parts)


# What an edit expression may reach. Everything is checked as it is reached (``_Sandbox``): names
# beginning with "_" anywhere, modules other than these, and objects other than tensors, numbers and
# their small companions are refused, so an expression cannot import, open files or change the process.
_OP_MODULES = ("torch.nn.functional", "torch.nn.init", "torch.linalg", "torch.special", "torch.fft")
_TORCH_CONSTANTS = ("pi", "e", "inf", "nan")
_TORCH_TYPES = ("finfo", "iinfo", "Size", "device", "Generator")
_TORCH_GETTERS = ("get_", "is_", "are_")  # torch's own questions (get_default_dtype, is_tensor): not its setters
_TORCH_REFUSED = {"from_file"}  # maps a file into memory
_TENSOR_REFUSED = {"storage", "untyped_storage", "register_hook", "register_post_accumulate_grad_hook", "apply_",
                   "map_", "map2_", "backward", "share_memory_", "grad_fn", "set_", "module_load"}
# Objects whose attributes an expression may use: exactly these types (numpy's float64 is a float, and
# has dump()), and tensors (a Parameter is one).
_VALUE_TYPES = frozenset({torch.dtype, torch.device, torch.Size, torch.finfo, torch.iinfo, torch.Generator, bool, int,
                          float, complex, tuple, list})
_MATH_REFUSED = {"factorial", "comb", "perm"}  # exact integers that grow past any bound (factorial(10**8))
_BIG_SEQUENCE = 1 << 24  # items a repeated list, tuple or str may have ([0] * 10**9)
_BIG_INT_BITS = 1 << 20  # an int result larger than this (bits) is refused: 9**9**9 would hang the replay
_NODES = (ast.Expression, ast.Constant, ast.Name, ast.Load, ast.Attribute, ast.Subscript, ast.Slice, ast.Tuple,
          ast.List, ast.Call, ast.keyword, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp,
          ast.ListComp, ast.comprehension, ast.Store, ast.operator, ast.unaryop, ast.boolop, ast.cmpop)
_ALLOWED = ("an edit may use x, the operations of torch, torch.nn.functional, torch.nn.init, torch.linalg, "
            "torch.special and torch.fft, tensor methods and math")


class _Sandbox:
    """Attribute access and the two operators whose int results can grow without bound, as an edit
    expression evaluates them. Refusals raise InterventionError naming what was reached."""

    def __init__(self, key: str, text: str) -> None:
        self.key, self.text = key, text

    def refuse(self, what: str) -> InterventionError:
        return InterventionError(f"edit {self.key}: {self.text!r} reaches {what}, which an edit may not use; "
                                 f"{_ALLOWED}")

    def attr(self, obj: Any, name: str) -> Any:
        if name.startswith("_"):
            raise self.refuse(f"the attribute {name}")
        if isinstance(obj, type(math)):
            where = obj.__name__
            if obj is math:
                if name in _MATH_REFUSED:
                    raise self.refuse(f"math.{name}")
                value = getattr(math, name)
            elif obj is torch:
                if name == "nn":
                    return torch.nn
                found = getattr(torch, name, None)
                module = getattr(found, "__module__", None)
                if not (name in _TORCH_CONSTANTS or name in _TORCH_TYPES or isinstance(found, torch.dtype)
                        or (name not in _TORCH_REFUSED and hasattr(torch._C._VariableFunctions, name))
                        or module == "torch.functional" or f"torch.{name}" in _OP_MODULES
                        or (module == "torch" and name.startswith(_TORCH_GETTERS) and name != "get_device_module")):
                    raise self.refuse(f"torch.{name}")
                value = getattr(torch, name)
            elif obj is torch.nn:
                if f"torch.nn.{name}" not in _OP_MODULES:
                    raise self.refuse(f"torch.nn.{name}")
                value = getattr(torch.nn, name)
            elif where in _OP_MODULES:
                value = getattr(obj, name)
                if isinstance(value, type(math)) and value.__name__ not in _OP_MODULES or not callable(value) \
                        or not str(getattr(value, "__module__", "") or "").startswith("torch"):
                    raise self.refuse(f"{where}.{name}")
            else:  # pragma: no cover - no other module is ever handed out
                raise self.refuse(where)
            return value
        tensor = isinstance(obj, torch.Tensor)
        if not (tensor or type(obj) in _VALUE_TYPES) or tensor and name in _TENSOR_REFUSED:
            raise self.refuse(f"{type(obj).__name__}.{name}")
        return getattr(obj, name)

    def power(self, a: Any, b: Any) -> Any:
        if _plain_int(a) and _plain_int(b) and b > 0 and abs(a) > 1 and b * a.bit_length() > _BIG_INT_BITS:
            raise self.refuse(f"an integer of ~{b * a.bit_length()} bits ({a} ** {b})")
        return a ** b

    def times(self, a: Any, b: Any) -> Any:
        for seq, n in ((a, b), (b, a)):
            if isinstance(seq, (list, tuple, str)) and _plain_int(n) and len(seq) * n > _BIG_SEQUENCE:
                raise self.refuse(f"a {type(seq).__name__} of {len(seq) * n} items")
        return a * b

    def shift(self, a: Any, b: Any) -> Any:
        if _plain_int(a) and _plain_int(b) and a and b > _BIG_INT_BITS:
            raise self.refuse(f"an integer of ~{b} bits ({a} << {b})")
        return a << b


def _plain_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Guard(ast.NodeTransformer):
    """``a.b`` becomes ``_attr(a, 'b')``, ``a ** b`` ``_pow(a, b)``, ``a << b`` ``_shift(a, b)``,
    ``a * b`` ``_times(a, b)``."""

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        call = ast.Call(ast.Name("_attr", ast.Load()), [self.visit(node.value), ast.Constant(node.attr)], [])
        return ast.copy_location(call, node)

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        helper = {ast.Pow: "_pow", ast.LShift: "_shift", ast.Mult: "_times"}.get(type(node.op))
        if helper is None:
            return node
        return ast.copy_location(ast.Call(ast.Name(helper, ast.Load()), [node.left, node.right], []), node)


def expression(text: str, key: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """An expression in ``x``, checked now and evaluated in a sandbox: ``x``, ``torch``'s operations
    (and those of ``torch.nn.functional``, ``linalg``, ``special``, ``fft``), tensor methods, ``math``."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise InterventionError(f"edit {key}: {text!r} is not a Python expression ({exc.msg}); write one in x, "
                                "e.g. 'x.clamp(-50, 50)'") from None
    sandbox = _Sandbox(key, text)
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            raise InterventionError(f"edit {key}: {text!r} uses {_a(type(node).__name__)} expression, which an edit "
                                    "may not; write calls, operators, indexing and attributes on x, torch and math")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise sandbox.refuse(f"the attribute {node.attr}")
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, ast.Store):
            raise InterventionError(f"edit {key}: {text!r} assigns to {ast.unparse(node)}; an edit computes a new "
                                    "value of x, it changes nothing in place")
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound -= {"x", "torch", "math"}  # a comprehension's own names ([r / r.norm() for r in x])
    for name in sorted(bound):
        if name.startswith("_"):
            raise sandbox.refuse(f"the name {name}")
    unknown = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - {"x", "torch", "math"} - bound)
    if unknown:
        raise InterventionError(f"edit {key}: {text!r} uses {', '.join(unknown)}; an edit may use only x, torch "
                                "and math")
    for top in ast.walk(tree):  # torch.os and the like: refused now, before any replay
        chain, node = [], top
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in ("torch", "math"):
            obj = torch if node.id == "torch" else math
            for name in reversed(chain):
                if not isinstance(obj, type(math)):
                    break
                try:
                    obj = sandbox.attr(obj, name)
                except AttributeError:
                    raise InterventionError(f"edit {key}: {text!r}: {getattr(obj, '__name__', obj)} has no "
                                            f"{name}") from None
    try:
        code = compile(ast.fix_missing_locations(_Guard().visit(tree)), f"<edit {key}>", "eval")
    except (SyntaxError, ValueError, TypeError) as exc:
        raise InterventionError(f"edit {key}: {text!r} cannot be evaluated ({exc})") from None
    # Torch imports some of its modules the first time an operation needs them, through the
    # evaluating frame's __import__: it is there for torch, and out of the expression's reach
    # (no name or attribute beginning with "_" gets through the checks above).
    scope = {"__builtins__": {"__import__": builtins.__import__}, "_attr": sandbox.attr, "_pow": sandbox.power,
             "_shift": sandbox.shift, "_times": sandbox.times, "torch": torch, "math": math}

    def apply(x: torch.Tensor) -> torch.Tensor:
        return eval(code, {**scope, "x": x})  # noqa: S307 - checked above, and guarded as it runs

    return apply


def parse_edits(edit: dict[str, Any] | None) -> list[Change]:
    if edit is not None and not isinstance(edit, dict):
        raise InterventionError(f"edit: give a dict of tensor keys and changes, not {type(edit).__name__}")
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


_MATMUL_PRECISIONS = ("highest", "high", "medium")
_SEEDS = (-(1 << 63), (1 << 64) - 1)  # what torch.manual_seed takes


def parse_seed(seed: Any) -> int | None:
    """A seed override as torch takes it, or None."""
    if seed is not None and not (_plain_int(seed) and _SEEDS[0] <= seed <= _SEEDS[1]):
        raise InterventionError(f"seed {seed!r}: give an integer from {_SEEDS[0]} to {_SEEDS[1]}")
    return seed


def parse_settings(settings: dict[str, Any] | None, known: dict[str, Any]) -> dict[str, Any]:
    if settings is not None and not isinstance(settings, dict):
        raise InterventionError(f"settings: give a dict of setting names and values, not {type(settings).__name__}")
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
            wanted = "a true/false" if isinstance(recorded, bool) else _a(type(recorded).__name__)
            raise InterventionError(f"setting {key}={value!r}: it was {recorded!r} when recorded; give {wanted} value")
        if name in ("num_threads", "num_interop_threads") and not (_plain_int(value) and value >= 1):
            raise InterventionError(f"setting {key}={value!r}: a thread count is a positive integer")
        if name == "float32_matmul_precision" and value not in _MATMUL_PRECISIONS:
            raise InterventionError(f"setting {key}={value!r}: give one of {', '.join(_MATMUL_PRECISIONS)}")
        if name == "default_dtype" and value is not None:
            try:
                dtype_from_name(value)
            except (ValueError, TypeError):
                raise InterventionError(f"setting {key}={value!r}: give a torch dtype by name, e.g. "
                                        "'torch.float64'") from None
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
    if sel.matches_name(name, label, path, step.definition.get("kind") == "module"):
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
                             f"failed ({type(exc).__name__}: {exc}); built from the original's skeleton, so it has the "
                             "original's recorded attributes, not its own constructor's")
        rebuilt = None
        if new is None and init is None:  # (a torch class's arguments are not recorded: said, as a failed call is)
            notes.append(f"swap {key}: {replacement.__qualname__} built from the original's skeleton (no constructor "
                         f"arguments of {type(original).__qualname__} were recorded), so it has the original's "
                         "recorded attributes, not its own constructor's; to build it yourself, give a factory "
                         f"(lambda original: {replacement.__qualname__}(...))")
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
    _own_values(original, new, key, notes)
    return new


def _own_values(original: torch.nn.Module, new: torch.nn.Module, key: str, notes: list[str]) -> None:
    """Name the parameters and buffers of a factory's module that the original has too (same name and
    shape) but with other values: a class swapped in takes the original's, a factory's module keeps what
    it made (``lambda original: StableNorm(8)``: fresh weights), which reads as the fix failing where it
    is the weights that changed."""
    theirs = {**dict(original.named_parameters(remove_duplicate=False)), **dict(original.named_buffers())}
    mine = {**dict(new.named_parameters(remove_duplicate=False)), **dict(new.named_buffers())}
    other = []
    for name, value in mine.items():
        source = theirs.get(name)
        if source is None or source is value or source.shape != value.shape or source.device != value.device \
                or torch.strided not in (source.layout, value.layout) or source.layout != value.layout:
            continue
        if source.dtype != value.dtype or not torch.equal(_as_bytes(source), _as_bytes(value)):  # NaN too
            other.append(name)
    if other:
        notes.append(f"swap {key}: the factory's module runs with its own {', '.join(sorted(other))}, not the "
                     "original's recorded values (a class swapped in takes those); to use them, have the factory "
                     "copy them (new.load_state_dict(original.state_dict(), strict=False))")


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


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (torch's own carry their C++ context on more)."""
    return " ".join(str(exc).split())[:400]


def _a(noun: str) -> str:
    """``noun`` with its indefinite article ("an int", "a float")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
