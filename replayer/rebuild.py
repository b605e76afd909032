"""Rebuilding a recorded step's module without live objects.

From its skeleton (the default): the class is looked up, an instance is made with ``__new__`` and
torch's own ``Module.__init__`` (never the user's ``__init__``), the recorded attributes are set and
the submodules rebuilt the same way. A module whose skeleton names attributes that could not be
recorded as data (a lambda, a closure over a submodule) is built by calling its constructor with
the recorded constructor arguments instead; a generator it held (a numpy Generator, which has no data
form) is not such an attribute where the step's RNG document holds its state: it is made again in that
state. Either way the parameters and buffers are then loaded as they were at the step. ``Rebuilt.how``
says, per module path, which way each module was built.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin
from torch.nn.utils import parametrize, prune
from torch.nn.utils.spectral_norm import SpectralNorm

from recorder import jsonval, skeleton, snapshot
from recorder.errors import ReplayError

from .code import CodeLoader
from .recording import join_path


@dataclass
class Rebuilt:
    """A rebuilt module and how it was made."""

    module: torch.nn.Module
    how: dict[str, str] = field(default_factory=dict)  # relative path ("" the module) -> skeleton/constructor
    warnings: list[str] = field(default_factory=list)
    links: list[tuple[torch.nn.Module, dict[str, Any]]] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)  # parameter name -> the name it is the same tensor as
    unrecorded: list[str] = field(default_factory=list)  # attributes not recorded that a constructor made
    left_out: list[str] = field(default_factory=list)  # attributes it lacks or holds as data only: the warnings
    # (a recording before 1.16, which stored names sorted) containers whose children may be out of order:
    # named where the replay differs
    order_doubts: list[str] = field(default_factory=list)
    # RNNs whose lists of their weights were not recorded as links (skeleton.RNN_FLAT): derived again by link()
    flat: list[tuple[torch.nn.Module, tuple[str, ...]]] = field(default_factory=list)
    # tensor attributes (relative path.name) that code outside the module set before each call (the skeleton's
    # ``computed``): a step enclosing the module replays them, its own does not
    set_outside: list[str] = field(default_factory=list)

    def link(self) -> None:
        """Tie parameters that were one tensor under several names (``tied``), and point attributes
        that referred to a module's own parameters and buffers (an RNN's ``_flat_weights``) at the
        rebuilt ones; after ``load_state``, which replaces buffers."""
        self.warnings += tie(self.module, self.tied)
        for module, linked in self.links:
            for key, spec in linked.items():
                module.__dict__[key] = _linked(module, spec)
        for module, keys in self.flat:
            _flat_weights_again(module, keys)


def tie(module: torch.nn.Module, tied: dict[str, str]) -> list[str]:
    """Make each parameter name in ``tied`` the same Parameter as the name it maps to (tied weights,
    as skeleton.tied_parameters found them); returns what could not be tied."""
    problems = []
    for name, same in tied.items():
        owner, _, leaf = name.rpartition(".")
        try:
            module.get_submodule(owner)._parameters[leaf] = module.get_parameter(same)
        except AttributeError:
            problems.append(f"parameter {name} was the same tensor as {same}, which the rebuilt module lacks; "
                            "left as rebuilt")
    return problems


def share(module: torch.nn.Module, shared: dict[str, str], how: dict[str, str]) -> list[str]:
    """Make each submodule path in ``shared`` the same module as the path it maps to (one module
    reached by two paths, as skeleton.shared_modules found them): its calls then run, and are seen,
    as the recorded ones, under that path. The paths made so are dropped from ``how``, which then
    counts each module once. Returns what could not be shared."""
    problems = []
    for path, same in shared.items():
        owner, _, leaf = path.rpartition(".")
        try:
            parent, target = module.get_submodule(owner), module.get_submodule(same)
        except AttributeError:
            problems.append(f"submodule {path} was the same module as {same}, which the rebuilt module lacks; "
                            "left as rebuilt")
            continue
        if leaf not in parent._modules:
            problems.append(f"submodule {path} was the same module as {same}, but has no place in the rebuilt "
                            "module; left as rebuilt")
            continue
        parent._modules[leaf] = target
        for key in [k for k in how if k == path or k.startswith(f"{path}.")]:
            del how[key]
    return problems


def _unrecorded_names(unrecorded: dict[str, str], made: torch.nn.Module | None = None,
                      computed: Iterable[str] = ()) -> str:
    """A module's attributes that could not be recorded as data, by name and type: "cache_k (a tensor
    that is no parameter or buffer: register_buffer has it recorded)" for a tensor kept as a plain attribute;
    a function by its qualified name where the module's constructor (``made``) made one ("shape_of (the
    lambda mypkg.layers:Anneal.__init__.<locals>.<lambda>)"), else as a function. A tensor the skeleton
    names ``computed`` (a result of autograd, made anew for each call by a wrapper such as AWD-LSTM's
    WeightDrop) is said to be set from outside: a buffer would hold one call's value, not each call's."""
    def named(key: str, kind: str) -> str:
        if kind == "torch:Tensor" and key in computed:
            return ("a tensor that code outside the module sets on it before each call, a wrapper or hook: it was "
                    "computed with autograd, so it is not recorded with this step")
        if kind == "torch:Tensor":
            return "a tensor that is no parameter or buffer: register_buffer has it recorded"
        if kind == "builtins:function":
            return jsonval.function_label(made.__dict__.get(key) if made is not None else None) or "a function"
        return kind

    return ", ".join(f"{k} ({named(k, v)})" for k, v in unrecorded.items())


def unresolved(value: Any) -> str | None:
    """What in a decoded value could not be brought back (an opaque value, a type not importable
    now, a tensor whose data was not kept), or None."""
    if isinstance(value, jsonval.Opaque):
        reason = jsonval.opaque_reason(value)
        if reason is not None:
            return reason + (" (pass it as a tensor, torch.from_numpy(a), to have it recorded)"
                             if value.type == "numpy:ndarray" else "")
        function = jsonval.function_words(value)  # (by its qualified name, not as a builtins:function)
        if function is not None:
            return function
        shown = " ".join(str(value.repr).split())  # one line, whatever the repr's layout
        shown = shown if len(shown) <= 120 else shown[:119] + "…"
        return f"a {value.type} ({shown}), which could not be recorded as data"
    if isinstance(value, jsonval.Record):
        return f"a {value.type}, which cannot be imported now"
    if isinstance(value, (jsonval.TensorMeta, jsonval.TensorRef)):
        return "a tensor whose data was not kept"
    items: Any = ()
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        state = getattr(value, "__dict__", None)  # its fields, and attributes set after __init__
        items = list(state.values()) if isinstance(state, dict) else [getattr(value, f.name, None)
                                                                       for f in dataclasses.fields(value)]
    elif jsonval.plain_instance(value):  # a decoded $object: what its fields hold is passed on with it
        items = vars(value).values()
    for item in items:
        found = unresolved(item)
        if found:
            return found
    return None


_DISTRIBUTED_PREFIXES = ("FSDP", "DDP")  # fully_shard's FSDP<Name>(FSDPModule, <Name>), replicate's DDP<Name>


def distributed_own_ref(ref: str, doc: dict[str, Any] | None) -> str | None:
    """For the reference to a class FSDP2's ``fully_shard`` (or ``replicate``) made at run time, which a
    recorder before schema 1.31 wrote for a module under it (``torch.distributed.fsdp._fully_shard._fsdp_init:
    FSDPBlock``, made as ``FSDPBlock(FSDPModule, Block)``), the reference to the class it wrapped: the class
    the module's constructor was recorded with, if it is named so; else one of that name where the reference
    points outside torch.distributed, or torch.nn's. ``""`` where it is such a class but which it wrapped is not
    known; None where the reference is not one."""
    where, _, qualname = ref.partition(":")
    head, _, name = qualname.rpartition(".")
    prefix = next((p for p in _DISTRIBUTED_PREFIXES if name.startswith(p) and len(name) > len(p)), None)
    if prefix is None:
        return None
    wrapped = name[len(prefix):]
    init = (doc or {}).get("init")
    made_as = init.get("class") if isinstance(init, dict) else None
    if isinstance(made_as, str) and made_as.partition(":")[2].rpartition(".")[2] == wrapped:
        return made_as
    if not where.startswith("torch.distributed."):
        return f"{where}:{head + '.' if head else ''}{wrapped}"
    if isinstance(getattr(torch.nn, wrapped, None), type) and issubclass(getattr(torch.nn, wrapped), torch.nn.Module):
        return jsonval.type_ref(getattr(torch.nn, wrapped))
    return ""


class Builder:
    def __init__(self, loader: CodeLoader, *, names_sorted: bool = False,
                 generators: dict[str, Any] | None = None) -> None:
        """``names_sorted``: the recording is older than 1.16, whose documents kept their keys in sorted
        order: a module's children, parameters and buffers are not in the order the module held them.
        ``generators``: the recorded states of the generators the module held at the call, by place
        ("rng", "inner.rng"; the step's RNG parts "module:<place>", decoded): an attribute the skeleton
        could not hold as data (a numpy Generator) that was such a generator is made again in its state,
        not taken from a constructor."""
        self.loader = loader
        self.names_sorted = names_sorted
        self.generators = generators or {}
        self._override: type | None = None
        self._top_hooks_ran = True
        self.top_name = "the step's module"  # what warnings call the module built (one the step was given: 1.30)

    def module_class(self, ref: str, doc: dict[str, Any] | None = None) -> type:
        """The class ``ref`` names; ``doc``: the skeleton node it is the class of, whose constructor's class
        names the class that FSDP2's run-time class wrapped (below)."""
        try:
            cls = self.loader.resolve(ref)
        except ReplayError as missing:
            own = distributed_own_ref(ref, doc)
            if own is None:
                raise
            if own:
                try:
                    cls = self.loader.resolve(own)
                except ReplayError:
                    if not ref.startswith("torch.distributed."):
                        raise missing from None  # (not one: a class of its own, DDPMScheduler, renamed)
                    own = ""
            if not own:
                raise ReplayError(f"{ref.partition(':')[2]} is the class FSDP2's fully_shard (or replicate) made at "
                                  "run time for a module, which a recording made before schema 1.31 named in place "
                                  "of the module's own class and no replay can import; record the run again to "
                                  "replay this step") from None
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise ReplayError(f"{ref} is not an nn.Module class now; the recording's module cannot be rebuilt")
        if issubclass(cls, torch.jit.ScriptModule):  # compiled code and state, nothing a skeleton can make again
            raise ReplayError("the step holds a TorchScript module (made by torch.jit.script or trace), which a "
                              "replay cannot rebuild; to replay it, record the Python module it was scripted from")
        return cls

    def build(self, doc: dict[str, Any], label: str, cls: type | None = None, top_hooks_ran: bool = True) -> Rebuilt:
        """Rebuild a module from its skeleton document; ``cls`` overrides the class of the top module.

        ``top_hooks_ran``: the top module's own forward pre-hooks had run when its state and
        arguments were recorded (a decorated class or annotated instance: recorded inside its
        forward, or by a ``modules=`` glob's pre-hook, last, since schema 1.26), so a replay must not run
        them again; False where they ran after (a ``modules=`` glob's module recorded before 1.26, or a
        call noted so: ``layout.UNRUN_PRE_HOOKS_NOTE``)."""
        if not isinstance(doc, dict) or "class" not in doc:
            raise ReplayError(f"the recording holds no description of module {label!r}; it cannot be rebuilt")
        out = Rebuilt(torch.nn.Module())
        tied = doc.get("tied") if isinstance(doc, dict) else None
        if isinstance(tied, dict):
            out.tied = {k: v for k, v in tied.items() if isinstance(k, str) and isinstance(v, str)}
        self._top_hooks_ran = top_hooks_ran
        if cls is not None:
            self._override = cls
        if "attrs" not in doc:  # written before skeletons were recorded: the constructor is all there is
            module = self._construct(doc, "", out)
            if module is None:
                raise ReplayError(f"module {label!r} ({doc['class']}) was recorded without a skeleton and without "
                                  "constructor arguments; record it again to replay it")
            out.module = module
            return out
        out.module = self._node(doc, "", out)
        shared = doc.get("shared_modules")
        if isinstance(shared, dict):
            out.warnings += share(out.module, {k: v for k, v in shared.items()
                                               if isinstance(k, str) and isinstance(v, str)}, out.how)
        return out

    @staticmethod
    def _children_in_order(kind: type, children: dict[str, Any], where: str, out: Rebuilt) -> dict[str, Any]:
        """A recording older than 1.16 holds a module's children in name order ("0", "1", "10", "2"):
        numbered ones are put back in their numbers' order (a Sequential's, a ModuleList's, children
        added in a loop), but a ModuleDict's, whose keys are names even when they are numbers (an FPN's
        "32", "16", "8"); a container that runs or lists its children in order and whose order cannot
        be told is named where the replay differs (``order_doubts``)."""
        if len(children) < 2:
            return children
        if all(name.isdigit() for name in children) and not issubclass(kind, torch.nn.ModuleDict):
            return dict(sorted(children.items(), key=lambda item: int(item[0])))
        if issubclass(kind, (torch.nn.Sequential, torch.nn.ModuleDict)):
            out.order_doubts.append(f"{where}: this {kind.__name__}'s children")
        return children

    def _node(self, doc: dict[str, Any], path: str, out: Rebuilt) -> torch.nn.Module:
        where = path or self.top_name
        override, self._override = self._override, None  # a swap: another class in this module's place
        unrecorded = doc.get("unrecorded") or {}
        lazy = override is None and issubclass(self.module_class(doc["class"], doc), LazyModuleMixin)
        if lazy:  # the handles of the hooks that initialize it: made again (_lazy_again)
            unrecorded = {k: v for k, v in unrecorded.items() if k not in _LAZY_HANDLES}
        flat: tuple[str, ...] = ()
        if override is None and issubclass(self.module_class(doc["class"], doc), torch.nn.RNNBase):
            flat = tuple(k for k in skeleton.RNN_FLAT if k in unrecorded)
            unrecorded = {k: v for k, v in unrecorded.items() if k not in flat}
        generators = self._generators(unrecorded, path)
        if generators:
            unrecorded = {k: v for k, v in unrecorded.items() if k not in generators}
        grafted: dict[str, Any] = {}
        computed = [k for k in doc.get("computed") or () if unrecorded.get(k) == "torch:Tensor"]
        if computed and override is None:
            out.set_outside += [join_path(path, k) for k in computed]
        if unrecorded and override is None:
            names = _unrecorded_names(unrecorded, computed=computed)
            if _set_up_after_construction(doc):  # a constructor would make it without what was set up later:
                scratch = Rebuilt(torch.nn.Module())  # the skeleton, with those attributes from a constructed one
                made = self._construct(doc, path, scratch)
                grafted = {} if made is None else {k: made.__dict__[k] for k in unrecorded if k in made.__dict__}
                missing = [k for k in unrecorded if k not in grafted]
                if missing:
                    out.warnings.append(f"{where}: attributes "
                                        f"{_unrecorded_names({k: unrecorded[k] for k in missing}, computed=computed)} "
                                        "could not be recorded as data and "
                                        "the module was not built with known constructor arguments; rebuilt "
                                        "without them")
                    out.left_out.append(out.warnings[-1])
            else:
                module = self._construct(doc, path, out)
                if module is not None:
                    _overlay(module, doc)
                    _hooks_nodes(module, doc)
                    for key, generator in generators.items():  # (one the constructor made is set for the call)
                        module.__dict__.setdefault(key, generator)
                    out.unrecorded.append(f"{where}: {_unrecorded_names(unrecorded, module, computed)}")
                    return module
                out.warnings.append(f"{where}: attributes {names} could not be recorded as data and the module was "
                                    "not built with known constructor arguments; rebuilt without them")
                out.left_out.append(out.warnings[-1])
        cls = override if override is not None else self.module_class(doc["class"], doc)
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)  # torch's bookkeeping only; the user's __init__ does not run
        module.training = bool(doc.get("training", True))
        for key, value in (doc.get("attrs") or {}).items():
            decoded = jsonval.decode(value, resolve=self._resolve_type)
            if callable(decoded) and (key.startswith("__") or callable(getattr(cls, key, None))):
                # a recording does not replace the class's own code (its forward, a method)
                out.warnings.append(f"{where}: attribute {key} would replace {cls.__qualname__}.{key}; left out")
                continue
            missing = unresolved(decoded)
            if missing:
                out.warnings.append(f"{where}: attribute {key} holds {missing}; left as recorded data")
                out.left_out.append(out.warnings[-1])
            module.__dict__[key] = decoded
        module.__dict__.update(grafted)
        module.__dict__.update(generators)
        for key, spec in (doc.get("made") or {}).items():
            made = self._made(spec, f"{where}: attribute {key}", out)
            if made is not None:
                module.__dict__[key] = made
        for name, spec in (doc.get("params") or {}).items():
            module._parameters[name] = None if spec is None else _placeholder()
        for name, spec in (doc.get("buffers") or {}).items():
            module._buffers[name] = None if spec is None else torch.empty(0, device="cpu")
            if spec is not None and not spec.get("persistent", True):
                module._non_persistent_buffers_set.add(name)
        if lazy:
            _lazy_again(module, doc.get("params") or {})
        children = doc.get("children") or {}
        if self.names_sorted:
            children = self._children_in_order(cls, children, where, out)
        for name, child in children.items():
            module._modules[name] = None if child is None else self._node(child, join_path(path, name), out)
        if doc.get("linked"):
            out.links.append((module, doc["linked"]))
        if flat:
            out.flat.append((module, flat))
        try:
            if doc.get("parametrized"):
                _parametrize(module, doc["parametrized"], where)
            self._hooks(module, doc, path, out)
        except (AttributeError, TypeError, ValueError, KeyError, AssertionError) as exc:
            raise ReplayError(f"{where}: the recording's description of its parametrizations or hooks is not one "
                              f"this version can set up ({type(exc).__name__}: {exc}); the recording is damaged or "
                              "newer") from None
        out.how[path] = "skeleton"
        return module

    def _made(self, spec: Any, what: str, out: Rebuilt) -> Any:
        """An attribute the skeleton's ``made`` describes (``skeleton.made_again``): a module that is only its
        class, or a dict of them, each made again by calling its class with no arguments. None, with a
        warning naming it, where that cannot be done here (the replay then runs without the attribute)."""
        try:
            if isinstance(spec, dict) and isinstance(spec.get("dict"), dict):
                return {name: self._made_module(one) for name, one in spec["dict"].items()}
            return self._made_module(spec)
        except ReplayError as exc:
            out.warnings.append(f"{what} could not be made again ({exc}); rebuilt without it")
            out.left_out.append(out.warnings[-1])
            return None

    def _made_module(self, spec: Any) -> torch.nn.Module:
        if not isinstance(spec, dict) or not isinstance(spec.get("class", spec.get("type_of")), str):
            raise ReplayError("the recording's description of it is not one this version reads")
        if "class" in spec:
            cls = self.module_class(spec["class"])
        else:  # a class made inside a function: the type of a module-level object
            cls = type(self.loader.resolve(spec["type_of"]))
            if not issubclass(cls, torch.nn.Module) or issubclass(cls, torch.jit.ScriptModule):
                raise ReplayError(f"{spec['type_of']} is not a module now")
        try:
            with snapshot.applied_rng({}):
                module = cls()
        except Exception as exc:  # noqa: BLE001 - the class's constructor refused: said, the replay goes on
            raise ReplayError(f"{cls.__qualname__}() failed: {type(exc).__name__}: {exc}") from None
        if skeleton.made_again(module) is None:
            raise ReplayError(f"{cls.__qualname__}() now makes a module with state of its own")
        module.training = bool(spec.get("training", True))
        return module

    def _generators(self, unrecorded: dict[str, str], path: str) -> dict[str, Any]:
        """The attributes among ``unrecorded`` (name -> the type the skeleton names) that held generators
        whose state at the call the recording holds, made again of that very type in that state."""
        made = {}
        for key, kind in unrecorded.items():
            state = self.generators.get(join_path(path, key))
            generator = snapshot.made_rng(state) if state is not None else None
            if generator is not None and jsonval.type_ref(type(generator)) == kind:  # (not a subclass of its own)
                made[key] = generator
        return made

    def _hooks(self, module: torch.nn.Module, doc: dict[str, Any], path: str, out: Rebuilt) -> None:
        """Put back the forward pre-hooks that compute a tensor (hook-based weight_norm and
        spectral_norm); say which other hooks the module had, where the replay misses them."""
        top, where = not path, path or self.top_name
        for spec in doc.get("hooks") or ():
            cls = skeleton.HOOK_CLASSES.get(spec.get("kind"))
            if cls is None:
                out.warnings.append(f"{where}: a {spec.get('kind')} hook is not known to this "
                                    "version; left out of the replay")
                continue
            hook = cls.__new__(cls)
            vars(hook).update(jsonval.decode(spec.get("attrs") or {}))
            module.register_forward_pre_hook(_Recompute(hook) if top and self._top_hooks_ran else hook)
        _hooks_nodes(module, doc, children=False)
        for text in doc.get("other_hooks") or ():
            if isinstance(module, LazyModuleMixin) and text.endswith(LazyModuleMixin._infer_parameters.__qualname__):
                continue  # made again (_lazy_again)
            # The step's own forward hooks ran after its output was recorded; its pre-hooks, before
            # its arguments and state were, unless they ran after (see build's top_hooks_ran); its backward
            # pre-hooks, before its grad outputs were (named apart since schema 1.29).
            if top and (text.startswith(("forward hook", "backward pre-hook")) or (
                    text.startswith("forward pre-hook") and self._top_hooks_ran)):
                continue
            out.warnings.append(f"{where} had a {text} when it was recorded, which cannot be "
                                "recorded as data; the replay runs without it (a likely cause of any difference)")

    def _construct(self, doc: dict[str, Any], path: str, out: Rebuilt) -> torch.nn.Module | None:
        init = doc.get("init")
        where = path or self.top_name
        if not isinstance(init, dict):
            return None
        try:
            cls = self.module_class(init.get("class") or doc["class"], doc)
            args = jsonval.decode(init.get("args", []), resolve=self._resolve_type)
            kwargs = jsonval.decode(init.get("kwargs", {}), resolve=self._resolve_type)
        except ReplayError as exc:
            out.warnings.append(f"{where}: constructor arguments unusable ({exc})")
            return None
        missing = unresolved([args, kwargs])
        if missing:
            out.warnings.append(f"{where}: its constructor was called with {missing}; cannot call it again")
            return None
        try:
            with snapshot.applied_rng({}):  # its random initialisation must not move the caller's generators
                module = cls(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's constructor refused: report, fall back
            out.warnings.append(f"{where}: calling {cls.__qualname__}(...) with the recorded arguments failed "
                                f"({type(exc).__name__}: {exc})")
            return None
        for name, _ in module.named_modules():
            out.how[join_path(path, name)] = "constructor"
        return module

    def _resolve_type(self, ref: str) -> Any:
        return self.loader.resolve(ref)


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Generator)


def _plain(value: Any) -> bool:
    return isinstance(value, _PLAIN) or (type(value) in (tuple, list) and all(map(_plain, value)))


def _overlay(module: torch.nn.Module, doc: dict[str, Any]) -> None:
    """Set on a module the constructor made (and its children) the recorded attributes that are
    plain values and their training flags: what the call saw, where training changed them after
    construction (a temperature schedule, a counter, a child put in eval mode). Objects stay the
    constructor's."""
    if "training" in doc:
        module.training = bool(doc["training"])
    state = module.__dict__
    for key, value in (doc.get("attrs") or {}).items():
        if key in state and _plain(state[key]):
            try:
                decoded = jsonval.decode(value)
            except (ValueError, TypeError):
                continue
            if _plain(decoded):
                state[key] = decoded
    children = doc.get("children") or {}
    for name, child in module._modules.items():
        if child is not None and isinstance(children.get(name), dict):
            _overlay(child, children[name])


def _set_up_after_construction(doc: Any) -> bool:
    """Does a skeleton (or one below it) hold what a constructor does not make: torch.nn.utils
    parametrizations, weight or spectral norm hooks, attributes linked to its tensors?"""
    if not isinstance(doc, dict):
        return False
    if doc.get("parametrized") or doc.get("hooks") or doc.get("linked"):
        return True
    return any(_set_up_after_construction(child) for child in (doc.get("children") or {}).values())


def _linked(module: torch.nn.Module, spec: Any) -> Any:
    """What skeleton._link described, found in the rebuilt ``module``."""
    try:
        if spec is None:
            return None
        if isinstance(spec, list):
            kind, name = spec
            return module.get_parameter(name) if kind == "param" else module.get_buffer(name)
        ((kind, inner),) = spec.items()
        if kind == "weakref":
            return weakref.ref(_linked(module, inner))
        items = [_linked(module, s) for s in inner]
        return tuple(items) if kind == "tuple" else items
    except (ValueError, TypeError, AttributeError) as exc:
        raise ReplayError(f"the recording's description of a {type(module).__name__} refers to its tensors in a "
                          f"way this version does not know ({exc}); the recording is damaged or newer") from None


def _flat_weights_again(rnn: torch.nn.Module, keys: tuple[str, ...]) -> None:
    """An RNN's ``keys`` among ``_flat_weights`` and ``_flat_weight_refs`` derived from its weights by name, as
    torch's ``RNNBase._init_flat_weights`` does (without flattening them: the recorded forward did that, where
    it did, as it found its weights changed). A weight the rebuilt module lacks, a tensor the recorded code set
    before each call (DropConnect), is None in the list, and its reference refers to a tensor that is gone, as
    the recorded one did to the tensor an earlier call set: a forward given it anew derives the lists again."""
    names = list(getattr(rnn, "_flat_weights_names", None) or [])
    weights = [getattr(rnn, name) if hasattr(rnn, name) else None for name in names]
    if "_flat_weights" in keys:
        rnn.__dict__["_flat_weights"] = weights
    if "_flat_weight_refs" in keys:
        rnn.__dict__["_flat_weight_refs"] = [_gone() if w is None else weakref.ref(w) for w in weights]


def _gone() -> weakref.ReferenceType[Any]:
    """A weak reference whose tensor no longer exists."""
    return weakref.ref(torch.empty(0))


class _Recompute:
    """A hook-computed tensor of the step's own module, computed from the recorded state without
    the hook's side effects: spectral_norm's power iteration had run (in training) when the state
    was recorded, inside the forward; running it again would move its vectors on."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook

    def __call__(self, module: torch.nn.Module, inputs: Any) -> None:
        if isinstance(self.hook, prune.BasePruningMethod):  # a mask applied: no side effect to leave out
            self.hook(module, inputs)
            return
        if isinstance(self.hook, SpectralNorm):
            value = self.hook.compute_weight(module, do_power_iteration=False)
        else:
            value = self.hook.compute_weight(module)
        setattr(module, self.hook.name, value)


def _parametrize(module: torch.nn.Module, names: list[str], where: str) -> None:
    """Make a rebuilt module parametrized again (its ``parametrizations`` child already rebuilt):
    the per-instance class and the properties torch.nn.utils.parametrize gives it."""
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)
            and "parametrizations" in module._modules):
        raise ValueError(f"parametrized {names!r:.60} without a parametrizations child")
    inject_class = getattr(parametrize, "_inject_new_class", None)
    inject_property = getattr(parametrize, "_inject_property", None)
    if inject_class is None or inject_property is None:
        raise ReplayError(f"{where}: its {', '.join(names)} computed by torch.nn.utils.parametrize, which this torch "
                          f"({torch.__version__}) cannot set up again; replay with the torch the recording was made "
                          "with")
    inject_class(module)
    for name in names:
        inject_property(module, name)


_LAZY_HANDLES = ("_initialize_hook", "_load_hook")


def _lazy_again(module: Any, specs: dict[str, Any]) -> None:
    """A lazy module (``nn.LazyLinear``) recorded before the call that gave its parameters their
    shapes, rebuilt from its skeleton: its parameters and buffers uninitialized again (the recorded ones
    are loaded over them) and the hooks its ``__init__`` registers, which initialize them at that call
    with the generator's state it had then (the replay's, applied: the same values). ``specs``: the
    skeleton's parameters (whether each required grad)."""
    for name, p in module._parameters.items():
        if p is not None:
            spec = specs.get(name)
            module._parameters[name] = UninitializedParameter(
                requires_grad=bool(spec.get("requires_grad", True)) if isinstance(spec, dict) else True)
    for name, b in module._buffers.items():
        if b is not None:
            module._buffers[name] = UninitializedBuffer()
    module._load_hook = module._register_load_state_dict_pre_hook(module._lazy_load_hook)
    module._initialize_hook = module.register_forward_pre_hook(module._infer_parameters, with_kwargs=True)


def _placeholder() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(0, device="cpu"), requires_grad=False)


def load_state(module: torch.nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
               requires_grad: dict[str, bool], tied: dict[str, str] | None = None) -> list[str]:
    """Put recorded parameters and buffers into a rebuilt module (keeping Parameter objects, so that
    code holding a reference to one sees the recorded value). Returns what was missing."""
    problems: list[str] = []
    expected_params = dict(module.named_parameters(remove_duplicate=False))
    for kind, values in (("parameter", params), ("buffer", buffers)):
        for name, value in values.items():
            owner, _, leaf = name.rpartition(".")
            try:
                sub = module.get_submodule(owner)
            except AttributeError:
                problems.append(f"recorded {kind} {name} has no place in the rebuilt module")
                continue
            if kind == "buffer":
                sub._buffers[leaf] = value
                continue
            current, grad = sub._parameters.get(leaf), requires_grad.get(name, True)
            if isinstance(current, torch.nn.Parameter) and not isinstance(current, UninitializedTensorMixin):
                with torch.no_grad():
                    current.data = value
                current.requires_grad_(grad)
            else:
                sub._parameters[leaf] = torch.nn.Parameter(value, requires_grad=grad)
    for name, p in expected_params.items():
        if name in (tied or {}) and tied[name] in params:  # Rebuilt.link() makes it that one
            continue
        if isinstance(p, UninitializedTensorMixin):  # a lazy module's, before its first call
            continue
        if name not in params and p is not None and (p.device.type == "meta" or p.numel() == 0):
            problems.append(f"parameter {name} was not recorded (tied to another parameter?)")
    return problems


def _hooks_nodes(module: torch.nn.Module, doc: dict[str, Any], children: bool = True) -> None:
    """Have torch pass the module's calls (with ``children``, also those of the submodules a constructor made)
    through the node of their backward hooks where the recording says it did (``skeleton.hooks_node``). The step's
    own module too: a tensor it was given both by position and by keyword (``blk(h, other=h)``) sends what came
    through the node into its gradient as one contribution, as recorded; its places given apart get what they got."""
    if doc.get("hooks_node"):
        module.register_full_backward_pre_hook(_no_backward_hook)
    docs = (doc.get("children") or {}) if children else {}
    for name, child in module._modules.items():
        if child is not None and isinstance(docs.get(name), dict):
            _hooks_nodes(child, docs[name])


def _no_backward_hook(module: torch.nn.Module, grad_output: Any) -> None:
    """Stands for a module's backward hooks, which a replay cannot run (see ``skeleton.hooks_node``): it has
    torch put their node around the module's calls again, and leaves the gradients as they are."""
