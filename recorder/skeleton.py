"""Module skeletons and constructor arguments: what replay needs to rebuild a module as data.

A *skeleton* is a module's structure without its tensors: class reference, training flag, the
non-tensor attributes its code set (as tagged JSON), the names of its parameters and buffers, and
its submodules' skeletons. Replay rebuilds a module from it without calling the user's
``__init__``. What a skeleton cannot carry as data (a lambda, a bound method, an open file) is
named in ``unrecorded``; such a module is rebuilt through its constructor, from the arguments it
was built with (``init``), which ``paper_step`` captures for decorated classes and
:class:`InitCapture` for every module class while ``pdbg record`` runs a script.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Any

import torch
from torch.nn.modules import module as _module
from torch.nn.utils import parametrize, prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from . import jsonval

# A module instance's constructor arguments (plain JSON), beside it rather than in its __dict__: a
# checkpoint of the user's model (torch.save(model)) holds nothing of the recorder's.
_INIT: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Any] | None] = weakref.WeakKeyDictionary()
_BASE_KEYS = frozenset(vars(torch.nn.Module()))  # what torch's Module.__init__ itself sets
# Attributes that are no state of the module's own: the recorder's marks, and torch.distributed's composable
# APIs' (fully_shard, replicate, checkpoint) state and registry, under a key with a new uuid in every process
# (torch.distributed._composable.contract.STATE_KEY): two runs' skeletons would always differ by them.
_NOT_STATE = ("_pdbg", "_paperdebugger", "__composable_api_state_key")
# The hooks replay knows how to rebuild. "prune": any of torch.nn.utils.prune's methods, whose hook
# sets NAME = NAME_orig * NAME_mask before each call whatever the method (Identity does just that).
HOOK_CLASSES = {"weight_norm": WeightNorm, "spectral_norm": SpectralNorm, "prune": prune.Identity}
_HOOK_KINDS = {cls: kind for kind, cls in HOOK_CLASSES.items()}
# An RNN's lists of its weights (and weak references to them), which torch's RNNBase._init_flat_weights derives
# from _flat_weights_names. Where one of those weights is no parameter (DropConnect's WeightDrop sets weight_hh_l0
# before each call) they are not recorded as links to the module's tensors; a replay derives them again as torch does.
RNN_FLAT = ("_flat_weights", "_flat_weight_refs")


def init_record(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Constructor arguments as data (never raises: a failure only loses this record)."""
    try:
        return {"class": jsonval.type_ref(cls), "args": jsonval.encode(list(args)),
                "kwargs": jsonval.encode(kwargs)}
    except Exception:  # noqa: BLE001 - recording must not break construction
        return None


def remember(module: torch.nn.Module, wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Keep the arguments ``module`` is being constructed with, if ``wrapper`` is its class's own
    ``__init__`` (a base class's ``__init__``, reached through ``super()``, gets other arguments).
    Never raises: construction must not break."""
    try:
        if type(module).__init__ is wrapper and module not in _INIT:
            _INIT[module] = init_record(type(module), args, kwargs)
    except TypeError:  # a module class that made itself unhashable: its skeleton is all there is
        pass


def opaque_in(doc: Any) -> str | None:
    """The type of the first opaque value in an encoded document, or None."""
    for value in jsonval.walk(doc):
        if isinstance(value, dict) and len(value) == 1:
            if "$opaque" in value:
                inner = value["$opaque"]
                return str(inner.get("type")) if isinstance(inner, dict) else "?"
            if "$tensor_meta" in value:
                return "torch:Tensor"
    return None


def not_rebuilt(module: torch.nn.Module, doc: dict[str, Any], path: str = "") -> tuple[str, str, str] | None:
    """(path, attribute, type) of the first attribute of ``module``'s tree that a replay cannot put
    back: not data (``unrecorded``), and the module holding it not built with known constructor
    arguments to make it again. Left out: a lazy module's hooks and a generator, which a replay
    makes again; a method patched on it, which a replay runs as its class defines it; a TorchScript
    module, whose replay is refused for its compiled code. ``doc``: ``module``'s skeleton."""
    from torch.nn.modules.lazy import LazyModuleMixin

    if isinstance(module, torch.jit.ScriptModule):
        return None

    from .snapshot import global_rng_kind, is_global_rng

    unrecorded = dict(doc.get("unrecorded") or {})
    if unrecorded and doc.get("init") is None:
        if isinstance(module, LazyModuleMixin):
            unrecorded = {k: v for k, v in unrecorded.items() if k not in ("_initialize_hook", "_load_hook")}
        if isinstance(module, torch.nn.RNNBase):
            unrecorded = {k: v for k, v in unrecorded.items() if k not in RNN_FLAT}
        for key, kind in unrecorded.items():
            value = module.__dict__.get(key)
            if is_global_rng(value) and global_rng_kind(value) is not None:
                continue
            if callable(getattr(type(module), key, None)):  # a method patched on it (forward): replayed as defined
                continue
            return path, key, kind
    for name, child in (doc.get("children") or {}).items():
        sub = module._modules.get(name)
        if child is not None and sub is not None:
            found = not_rebuilt(sub, child, f"{path}.{name}" if path else name)
            if found is not None:
                return found
    return None


_BY_VALUE = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device))
_TENSOR = object()  # a tensor attribute's skeleton holds its type only: which tensor does not matter


def state_key(module: torch.nn.Module) -> tuple[Any, ...]:
    """What ``build(module)`` depends on that may change between calls, cheaply (no encoding): for
    every module of the tree, its class, each attribute's name and value (numbers, strings, flags by
    value; other objects by identity, so a list changed in place goes unseen), the names of its
    parameters and buffers, which of its parameters are one tensor (tied) and whether each requires
    grad, which child objects it holds under which names, and its hooks.
    Surgery mid-run changes the skeleton through these alone: an activation swapped for another class
    with the same attributes (``nn.ReLU`` for ``nn.SiLU``), a weight tied to another module's, a layer
    frozen, a hook registered. A generator is known by identity too: its state at each call is a part
    of the step's RNG document (``snapshot.find_module_rngs``), not a skeleton of its own at every call."""
    key: list[Any] = []
    first: dict[int, int] = {}  # id of a parameter -> the number of the first name it was met under
    stack = [module]
    while stack:
        m = stack.pop()
        state = m.__dict__
        key.append(type(m))
        key.append(m.training)
        for name in state.keys() - _BASE_KEYS:  # (in C: most of a module's attributes are torch's own)
            value = state[name]
            kind = type(value)
            key.append(name)
            if kind in _BY_VALUE:
                key.append(value)
            elif isinstance(value, torch.Tensor):
                key.append(_TENSOR)
            else:
                key.append(id(value))
        # (keys() and values(), not iteration: a TorchScript module's tables are wrappers that cannot be iterated)
        params, buffers, children = m._parameters, m._buffers, m._modules
        if params:
            key.append(tuple(params.keys()))
            for p in params.values():  # which are one tensor, not which tensors (functional_call swaps them)
                key.append(None if p is None else (first.setdefault(id(p), len(first)), p.requires_grad))
        if buffers:
            key.append(tuple(buffers.keys()))
            key.append(len(getattr(m, "_non_persistent_buffers_set", ())))
        if m._forward_pre_hooks or m._forward_hooks or m._backward_pre_hooks or m._backward_hooks:
            key.append((*m._forward_pre_hooks, None, *m._forward_hooks, None, *m._backward_pre_hooks, None,
                        *m._backward_hooks))  # (handle ids: one removed and another registered differ)
        key.append(tuple(children.keys()))
        for c in children.values():
            key.append(id(c))
            if c is not None:
                stack.append(c)
    return tuple(key)


def own_class(module: torch.nn.Module) -> type:
    """The class ``module`` was made as: for a module that ``torch.nn.utils.parametrize`` changed
    (``parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``...), the class it had before,
    not the ``Parametrized...`` class made for that one instance, which nothing can import; for a module
    that torch.distributed's composable APIs changed (``fully_shard``: ``FSDPBlock``, ``replicate``:
    ``DDPBlock``), the class it had before them too (theirs are made at run time, with their own class
    first: ``FSDPBlock(FSDPModule, Block)``)."""
    cls = type(module)
    while True:
        where = cls.__module__
        if where == _PARAMETRIZE and "parametrizations" in module._modules and cls.__bases__:
            cls = cls.__bases__[0]
        elif _made_by_distributed(cls):
            cls = cls.__bases__[-1]
        else:
            return cls


_PARAMETRIZE = parametrize.__name__


def _made_by_distributed(cls: type) -> bool:
    """Whether ``cls`` is a class torch.distributed made at run time to put its own class before a module's
    (``_fsdp_init._apply_to_module``'s ``type(f"FSDP{cls.__name__}", (FSDPModule, cls), ...)``), which
    nothing can import: made in a module of torch.distributed that does not hold it, of two bases, the first
    torch.distributed's."""
    where = cls.__module__
    if not where.startswith("torch.distributed.") or len(cls.__bases__) != 2:
        return False
    if not cls.__bases__[0].__module__.startswith("torch.distributed."):
        return False
    return getattr(sys.modules.get(where), cls.__qualname__, None) is not cls


def parametrized(module: torch.nn.Module) -> list[str]:
    """The tensors of ``module`` that ``torch.nn.utils.parametrize`` computes (empty for most)."""
    cls = type(module)
    while _made_by_distributed(cls):  # (fully_shard of a parametrized module: FSDPParametrizedLinear)
        cls = cls.__bases__[-1]
    if cls.__module__ != _PARAMETRIZE or "parametrizations" not in module._modules or not cls.__bases__:
        return []
    return list(module._modules["parametrizations"]._modules)


def hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


# torch's hooks on every module's calls (torch.nn.modules.module.register_module_forward_hook and
# the like): (what a message calls them, the attribute of torch.nn.modules.module holding them).
GLOBAL_HOOKS = (("forward pre-hook", "_global_forward_pre_hooks"), ("forward hook", "_global_forward_hooks"),
                ("backward pre-hook", "_global_backward_pre_hooks"), ("backward hook", "_global_backward_hooks"))


def is_recorders(hook: Any) -> bool:
    """Whether a global module hook is the recorder's own (a bound method of one of its objects)."""
    owner = getattr(hook, "__self__", None)
    where = type(owner).__module__ if owner is not None else getattr(hook, "__module__", None)
    return isinstance(where, str) and where.startswith("recorder.")


def global_hooks() -> list[str]:
    """The process's global module hooks that are not the recorder's, as a message names them."""
    found = []
    for kind, attr in GLOBAL_HOOKS:
        for hook in getattr(torch.nn.modules.module, attr, {}).values():
            if not is_recorders(hook):
                found.append(f"global {kind} {hook_name(hook)}")
    return found


def _hooks(module: torch.nn.Module) -> tuple[list[dict[str, Any]], set[str], list[str]]:
    """The module's forward pre-hooks that compute a tensor from its parameters (torch's hook-based
    ``weight_norm`` and ``spectral_norm``) as data, the names of the attributes they compute, and a
    description of every other hook on the module."""
    recorded: list[dict[str, Any]] = []
    derived: set[str] = set()
    others: list[str] = []
    for hook in module._forward_pre_hooks.values():
        if is_recorders(hook):  # (the recorder's own, on a module a modules= glob selects: recorder.autohooks)
            continue
        if isinstance(hook, prune.BasePruningMethod) and isinstance(getattr(hook, "_tensor_name", None), str):
            recorded.append({"kind": "prune", "attrs": {"_tensor_name": hook._tensor_name}})  # (the mask: a buffer)
            derived.add(hook._tensor_name)
            continue
        kind = _HOOK_KINDS.get(type(hook))
        if kind is None:
            others.append(f"forward pre-hook {hook_name(hook)}")
        else:
            recorded.append({"kind": kind, "attrs": jsonval.encode(dict(vars(hook)))})
            derived.add(hook.name)
    others += [f"forward hook {hook_name(h)}" for h in module._forward_hooks.values()]
    others += [f"backward pre-hook {hook_name(h)}" for h in module._backward_pre_hooks.values()]
    others += [f"backward hook {hook_name(h)}" for h in module._backward_hooks.values()]
    return recorded, derived, others


def hooks_node(module: torch.nn.Module) -> bool:
    """Whether torch passes the module's calls' tensors through the node of its backward hooks (``BackwardHook``):
    it has full backward hooks or backward pre-hooks, its own or on every module's calls. That node is an identity
    with an edge per argument (one tensor passed twice, ``blk(h, h)``, is two aliases of it, their gradients sent
    on one after the other), so a replay of the module's step, or of one around it, inserts it again, to add
    gradients in the order the recorded pass did, where the hooks themselves cannot be recorded. Read from the
    attributes torch's call reads (a TorchScript module refuses ``_get_backward_hooks``)."""
    own_full = getattr(module, "_is_full_backward_hook", None) is True and getattr(module, "_backward_hooks", None)
    every_full = _module._global_is_full_backward_hook is True and _module._global_backward_hooks
    return bool(getattr(module, "_backward_pre_hooks", None) or _module._global_backward_pre_hooks
                or own_full or every_full)


_NO_LINK = object()


def _owned(module: torch.nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> ["param"|"buffer", name]`` for the parameters and buffers under ``module``."""
    out: dict[int, list[str]] = {}
    for name, b in module.named_buffers(remove_duplicate=False):
        out.setdefault(id(b), ["buffer", name])
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), ["param", name])
    return out


def _link(value: Any, owned: dict[int, list[str]], depth: int = 0) -> Any:
    """An attribute that only refers to the module's own parameters and buffers (an RNN's
    ``_flat_weights`` and their weak references), as those references: ``["param", name]``,
    ``{"weakref": ...}``, ``{"list": [...]}``, ``{"tuple": [...]}``, null; else _NO_LINK."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return owned.get(id(value), _NO_LINK)
    if isinstance(value, weakref.ref) and depth < 4:
        inner = _link(value(), owned, depth + 1)
        return _NO_LINK if inner is _NO_LINK or inner is None else {"weakref": inner}
    if type(value) in (list, tuple) and depth < 4 and len(value) <= 4096:
        items = [_link(v, owned, depth + 1) for v in value]
        return _NO_LINK if any(i is _NO_LINK for i in items) else {type(value).__name__: items}
    return _NO_LINK


def build(module: torch.nn.Module, memo: dict[int, dict[str, Any]] | None = None,
          classes: dict[type, None] | None = None) -> dict[str, Any]:
    """The skeleton of ``module`` and its submodules (plain JSON; shared subtrees via ``memo``; the
    classes of the submodules met into ``classes``)."""
    if memo is None:  # the top: also which parameter names are the same tensor as an earlier one, and the
        memo, classes = {}, {}  # code of the submodules' classes that are the training code's own
        doc = build(module, memo, classes)
        tied = tied_parameters(module)
        if tied:
            doc = {**doc, "tied": tied}
        shared = shared_modules(module)
        if shared:
            doc = {**doc, "shared_modules": shared}
        classes.pop(own_class(module), None)  # (the step's own: its definition holds it)
        from .annotate import submodule_code  # annotate imports this module

        code = submodule_code(classes)
        return {**doc, "submodule_code": code} if code else doc
    found = memo.get(id(module))
    if found is not None:
        return found
    if classes is not None:
        classes[own_class(module)] = None
    attrs: dict[str, Any] = {}
    unrecorded: dict[str, str] = {}
    computed: list[str] = []
    linked: dict[str, Any] = {}
    made: dict[str, Any] = {}
    owned: dict[int, list[str]] | None = None
    hooks, derived, other_hooks = _hooks(module)  # (derived: attributes a hook computes before each call)
    for key, value in module.__dict__.items():
        if key in _BASE_KEYS or key.startswith(_NOT_STATE) or key in derived:
            continue
        if key == "forward" and hasattr(value, "__pdbg_step__"):  # annotate()'s wrapper, not state
            continue
        doc = jsonval.encode(value)
        bad = opaque_in(doc)
        if bad is None:
            attrs[key] = doc
            continue
        spec = made_again(value)
        if spec is not None:
            made[key] = spec
            continue
        if owned is None:
            owned = _owned(module)
        link = _link(value, owned)
        if link is not _NO_LINK:
            linked[key] = link
        else:
            unrecorded[key] = bad
            if _computed(value):
                computed.append(key)
    params = {name: None if p is None else {"requires_grad": bool(p.requires_grad)}
              for name, p in module._parameters.items()}
    buffers = {name: None if b is None else {"persistent": name not in module._non_persistent_buffers_set}
               for name, b in module._buffers.items()}
    doc = {"class": jsonval.type_ref(own_class(module)), "training": bool(module.training), "attrs": attrs,
           "unrecorded": unrecorded, "params": params, "buffers": buffers,
           "init": _INIT.get(module), "children": {}}
    if linked:
        doc["linked"] = linked
    if made:
        doc["made"] = made
    if computed:
        doc["computed"] = computed
    names = parametrized(module)
    if names:
        doc["parametrized"] = names
    if hooks:
        doc["hooks"] = hooks
    if other_hooks:
        doc["other_hooks"] = other_hooks
    if hooks_node(module):
        doc["hooks_node"] = True
    memo[id(module)] = doc
    doc["children"] = {name: None if child is None else build(child, memo, classes)
                       for name, child in module._modules.items()}
    return doc


def _computed(value: Any) -> bool:
    """A tensor that is a result of autograd (a ``grad_fn``): code made it from parameters for the call (a
    wrapper or hook, AWD-LSTM's WeightDrop), anew at each one, so no buffer could have held it. Never raises:
    building a skeleton must not stop training."""
    try:
        return isinstance(value, torch.Tensor) and value.grad_fn is not None
    except Exception:  # noqa: BLE001 - a tensor subclass whose grad_fn cannot be read: said as any tensor
        return False


_MADE_ENTRIES = 64


def made_again(value: Any) -> dict[str, Any] | None:
    """An attribute that a replay makes again by calling a class with no arguments, as data: a module
    that is only its class (no parameters, buffers, submodules, hooks or attributes of its own), or a
    dict of such modules by name (``{"dict": {name: spec}}``), the form transformers' Llama-style
    attention keeps its kernel functions in (``_kernel_funcs``, from ``@use_kernelized_func``: each a
    module wrapping a function, of a class made inside a function). Else None."""
    if isinstance(value, torch.nn.Module):
        return _made_module(value)
    if type(value) is dict and 0 < len(value) <= _MADE_ENTRIES and all(type(k) is str for k in value):
        specs = {k: _made_module(v) if isinstance(v, torch.nn.Module) else None for k, v in value.items()}
        if all(spec is not None for spec in specs.values()):
            return {"dict": specs}
    return None


def _made_module(module: torch.nn.Module) -> dict[str, Any] | None:
    if (module._parameters or module._buffers or module._modules or module._forward_pre_hooks
            or module._forward_hooks or module._backward_pre_hooks or module._backward_hooks
            or module.__dict__.keys() - _BASE_KEYS or isinstance(module, torch.jit.ScriptModule)):
        return None
    cls = type(module)
    try:
        needs = [p for p in inspect.signature(cls).parameters.values()
                 if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        return None
    if needs:
        return None
    where = getattr(cls, "__module__", None)
    qualname = getattr(cls, "__qualname__", "")
    if not isinstance(where, str) or not isinstance(qualname, str):
        return None
    if "<locals>" not in qualname:
        return {"class": jsonval.type_ref(cls), "training": bool(module.training)}
    # A class made inside a function is found again as the type of a module-level object of its module
    # (transformers' ``apply_rotary_pos_emb`` is an instance of the class its kernel functions are of).
    namespace = sys.modules.get(where)
    for name, obj in list(vars(namespace).items()) if namespace is not None else ():
        if type(obj) is cls:
            return {"type_of": f"{where}:{name}", "training": bool(module.training)}
    return None


def tied_parameters(module: torch.nn.Module) -> dict[str, str]:
    """Parameter names that are the same Parameter as one named before them (a language model's output
    layer tied to its embedding): ``{"lm_head.weight": "transformer.wte.weight"}``. A step records
    a tied parameter once, under its first name (``named_parameters()``)."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def shared_modules(module: torch.nn.Module) -> dict[str, str]:
    """Submodule paths that reach the same module object as one reached before them (two experts
    sharing one projection, ``experts[1].fc2 = experts[0].fc2``): ``{"experts.1.fc2": "experts.0.fc2"}``.
    The skeleton holds such a module's document under each path, which alone would make a replay
    build two modules; the recorder names its calls by the first path (``modstack``). A path under
    one named here is left out: it is shared with its parent."""
    first: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        if id(m) not in first:
            first[id(m)] = name
            continue
        parts = name.split(".")
        if not any(".".join(parts[:k]) in shared for k in range(1, len(parts))):
            shared[name] = first[id(m)]
    return shared


class InitCapture:
    """Records the constructor arguments of every ``nn.Module`` subclass defined while it is
    installed (the outermost ``__init__`` of an instance wins). ``close()`` restores every class
    and ``nn.Module`` itself; instances keep their record (plain data, in ``_INIT``)."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[type, Any, Any]] = []
        self._had_hook = "__init_subclass__" in torch.nn.Module.__dict__
        self._previous = torch.nn.Module.__dict__.get("__init_subclass__")
        capture = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            capture.wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]

    def wrap(self, cls: type) -> None:
        init = cls.__dict__.get("__init__")
        if init is None or getattr(init, "__pdbg_init__", False):
            return  # inherits __init__: its class's wrapper records it

        @functools.wraps(init)
        def init_wrapper(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            remember(self, init_wrapper, args, kwargs)
            init(self, *args, **kwargs)

        init_wrapper.__pdbg_init__ = True  # type: ignore[attr-defined]
        cls.__init__ = init_wrapper  # type: ignore[misc]
        self._wrapped.append((cls, init_wrapper, init))

    def close(self) -> None:
        for cls, wrapper, init in reversed(self._wrapped):
            if cls.__dict__.get("__init__") is wrapper:  # (paper_step may have wrapped it again: leave it)
                cls.__init__ = init  # type: ignore[misc]
        self._wrapped.clear()
        if self._had_hook:
            torch.nn.Module.__init_subclass__ = self._previous  # type: ignore[assignment]
        elif "__init_subclass__" in torch.nn.Module.__dict__:
            del torch.nn.Module.__init_subclass__
