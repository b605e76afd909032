"""RNG and numerics-settings snapshots: capture (cheap, at every step entry) and scoped restore.

Capturing reads state only: it consumes no random numbers, changes no setting and never initialises
CUDA as a side effect. Restoring happens inside context managers that put the caller's own state
back in ``finally``.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import ctypes
import functools
import inspect
import os
import random
import re
import struct
import sys
import types
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributions import Distribution

from . import jsonval

# Environment variables that change numerics or how kernels are chosen.
ENV_VARS = ("CUBLAS_WORKSPACE_CONFIG", "CUDA_LAUNCH_BLOCKING", "NVIDIA_TF32_OVERRIDE", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "ATEN_CPU_CAPABILITY", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")


# -- RNG ------------------------------------------------------------------------------------------
def rng_parts() -> dict[str, tuple[Any, Any]]:
    """Every generator's state as {part: (cheap key, raw state)}; keys let a writer skip re-encoding
    states it has already stored. Parts: torch (CPU), cuda:N (initialised devices only), numpy, python.
    A recording takes one at every step through its own ``RngReader``, which skips unchanged states."""
    return RngReader().parts()


class RngReader:
    """``rng_parts`` for a recording, which takes one at every step: the numpy and Python generators'
    states are read only when they changed.

    ``np.random.get_state()`` costs ~55 us (numpy copies the Mersenne Twister's 624 words one by
    one in Python) and ``random.getstate()`` ~15 us with its hash, at every step, while most steps
    draw from neither. Both generators keep their words in memory this reader can see: numpy's
    bit generator publishes the address of its state (``bit_generator.ctypes.state_address``), and
    CPython's ``random.Random`` holds them in the object itself. Reading those bytes (2,500 of
    them, ~1 us) tells whether the state changed; only then is it read the public way. Where the
    words are is found once, on private generators, and checked against their public state over
    several draws; where it cannot be confirmed (another Python, another numpy), that generator is
    read the public way at every step, as ``rng_parts`` does. Reading never writes.
    """

    def __init__(self) -> None:
        self._py_at = _python_words_offset()
        self._np_at = _numpy_gauss_offset()
        self._last: dict[str, tuple[Any, Any]] = {}

    def parts(self) -> dict[str, tuple[Any, Any]]:
        parts: dict[str, tuple[Any, Any]] = {}
        cpu = torch.get_rng_state()
        parts["torch"] = (xxhash.xxh3_64_intdigest(cpu.numpy().data), cpu)
        if torch.cuda.is_initialized() and torch.cuda.is_available():  # (the cheaper test first: almost always False)
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                parts[f"cuda:{i}"] = (xxhash.xxh3_64_intdigest(state.numpy().data), state)
        parts["numpy"] = self._numpy()
        parts["python"] = self._python()
        return parts

    def _numpy(self) -> tuple[Any, Any]:
        rs = np.random.mtrand._rand
        bits = getattr(rs, "_bit_generator", None)
        if self._np_at is None or type(rs) is not np.random.RandomState or type(bits) is not np.random.MT19937:
            state = np.random.get_state()
            return (xxhash.xxh3_64_intdigest(state[1].data), *state[2:]), state
        has_gauss, gauss = _GAUSS.unpack(ctypes.string_at(id(rs) + self._np_at, _GAUSS.size))
        words = ctypes.string_at(bits.ctypes.state_address, _MT_BYTES)
        key = ("raw", xxhash.xxh3_64_intdigest(words), has_gauss, gauss if has_gauss else 0.0)
        return self._known("numpy", key, np.random.get_state)

    def _python(self) -> tuple[Any, Any]:
        inst = getattr(random, "_inst", None)
        if self._py_at is None or type(inst) is not random.Random:
            state = random.getstate()
            return hash(state), state
        words = ctypes.string_at(id(inst) + self._py_at, _MT_BYTES)
        gauss = inst.gauss_next
        key = ("raw", xxhash.xxh3_64_intdigest(words), gauss if isinstance(gauss, float) else None)
        return self._known("python", key, random.getstate)

    def _known(self, name: str, key: Any, read: Any) -> tuple[Any, Any]:
        last = self._last.get(name)
        if last is not None and last[0] == key:
            return last
        found = self._last[name] = (key, read())
        return found


_MT_WORDS = 624
_MT_BYTES = 4 * _MT_WORDS + 4  # numpy: the words, then the position; CPython: the position, then the words
_GAUSS = struct.Struct("=i4xd")  # numpy's legacy generator: has_gauss (int), padding, gauss (double)


@functools.cache
def _python_words_offset() -> int | None:
    """Where a ``random.Random`` keeps its position and Mersenne Twister words, relative to the
    object's address, confirmed on a private generator over several draws; None if not found."""
    if sys.implementation.name != "cpython":  # elsewhere id() need not be an address
        return None
    try:
        probe = random.Random(20261201)
        size = type(probe).__basicsize__
        at = None
        for draws in (0, 1, 700, 3):  # 700: past the 624 words, so they are regenerated
            for _ in range(draws):
                probe.random()
            _, internal, _ = probe.getstate()
            expected = struct.pack(f"=i{_MT_WORDS}I", internal[_MT_WORDS], *internal[:_MT_WORDS])
            raw = ctypes.string_at(id(probe), size)
            found = raw.find(expected[4:]) - 4 if at is None else at
            if found < 0 or found + _MT_BYTES > size or raw[found:found + _MT_BYTES] != expected:
                return None
            at = found
        return at
    except Exception:  # noqa: BLE001 - an interpreter laid out otherwise: read the public way
        return None


@functools.cache
def _numpy_gauss_offset() -> int | None:
    """Where numpy's legacy ``RandomState`` keeps its cached Gaussian (has_gauss, gauss), relative to
    the object's address, confirmed on a private generator through several draws; None if not
    found, or if its bit generator's state is not where ``ctypes.state_address`` says."""
    if sys.implementation.name != "cpython":  # elsewhere id() need not be an address
        return None
    try:
        probe = np.random.RandomState(20261201)
        size = type(probe).__basicsize__
        candidates: list[int] | None = None
        for _ in range(8):  # draws alternately make a pair (one cached: has_gauss 1) and take the cached one
            probe.standard_normal()
            _, key, pos, has_gauss, gauss = probe.get_state()
            words = ctypes.string_at(probe._bit_generator.ctypes.state_address, _MT_BYTES)
            if words != np.ascontiguousarray(key, dtype=np.uint32).tobytes() + struct.pack("=i", pos):
                return None
            raw = ctypes.string_at(id(probe), size)
            here = [at for at in range(0, size - _GAUSS.size + 1, 8)
                    if _GAUSS.unpack_from(raw, at)[0] == has_gauss
                    and (not has_gauss or _GAUSS.unpack_from(raw, at)[1] == gauss)]
            candidates = here if candidates is None else [at for at in candidates if at in here]
        return candidates[0] if candidates is not None and len(candidates) == 1 else None
    except Exception:  # noqa: BLE001 - a numpy laid out otherwise: read the public way
        return None


# -- generator objects a step's code reads as module-level globals -------------------------------
GLOBAL_PREFIX = "global:"  # a step's RNG document part of a generator object: "global:RNG", "global:utils.GEN"
_MAX_CODE = 64  # code objects looked through per step definition: its own, nested ones, helpers it calls


def is_global_rng(obj: Any) -> bool:
    """Whether ``obj`` is a generator object of its own (not one of the global ones every step records)."""
    if isinstance(obj, torch.Generator):
        return obj is not torch.default_generator
    if isinstance(obj, np.random.RandomState):
        return obj is not np.random.mtrand._rand
    if isinstance(obj, (np.random.Generator, np.random.BitGenerator)):
        return True
    return isinstance(obj, random.Random) and obj is not getattr(random, "_inst", None)


def rng_kind(obj: Any) -> str:
    """How a message names a generator object's kind: "numpy Generator", "torch Generator (cuda)"."""
    if isinstance(obj, torch.Generator):
        return "torch Generator" + ("" if obj.device.type == "cpu" else f" ({obj.device})")
    if isinstance(obj, np.random.Generator):
        return "numpy Generator"
    if isinstance(obj, np.random.RandomState):
        return "numpy RandomState"
    if isinstance(obj, np.random.BitGenerator):
        return f"numpy {type(obj).__name__}"
    return f"random.{type(obj).__name__}" if type(obj).__module__ == "random" else type(obj).__qualname__


def find_global_rngs(target: Any) -> tuple[tuple[str, dict[str, Any], str], ...]:
    """``_find_global_rngs``, never raising: code of an unusual kind is looked through for none (its step
    is recorded, and replayed, without them)."""
    try:
        return _find_global_rngs(target)
    except Exception:  # noqa: BLE001
        return ()


def _find_global_rngs(target: Any) -> tuple[tuple[str, dict[str, Any], str], ...]:
    """The generator objects a step's code reads as module-level globals, as (part, namespace, name):
    ``part`` names it in the step's RNG document, ``namespace[name]`` is where it is read at each call
    (code may rebind it). Found once per step definition, from names alone (``_global_reads``)."""
    found: dict[str, tuple[dict[str, Any], str]] = {}
    for label, space, name, value in _rng_reads(target)[1]:
        if is_global_rng(value):
            found.setdefault(GLOBAL_PREFIX + label, (space, name))
    return tuple((part, space, name) for part, (space, name) in found.items())


_HELD = 64  # items of a container looked through for generators (a config's fields, a dict of generators)
_NOT_HOLDERS = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                torch.nn.Module, torch.Tensor)


def held_rngs(label: str, value: Any) -> list[tuple[str, dict[Any, Any], Any, Any]]:
    """The generator objects one level inside ``value``, a module-level name a step's code reads, as
    (label, namespace, key, generator): the items of a dict (``RNGS['aug']``: namespace the dict) and
    the attributes of a plain object (a config ``CFG.rng``: namespace its ``__dict__``). A generator
    there is drawn from as one read by name is, and recorded the same way: otherwise a replay of a later
    call alone would draw from the generator's state at loading, though ``pdbg verify``, which replays in
    order, matches. Lists and tuples are not looked in (a replay could not set an item by name)."""
    try:
        return _held_rngs(label, value)
    except Exception:  # noqa: BLE001 - an object of an unusual kind (a __dict__ that raises): looked in for none
        return []


def _held_rngs(label: str, value: Any) -> list[tuple[str, dict[Any, Any], Any, Any]]:
    if is_global_rng(value) or isinstance(value, _NOT_HOLDERS):
        return []
    if isinstance(value, dict):
        space: Any = value
        label_of = "{}[{!r}]"
    else:
        space = getattr(value, "__dict__", None)
        label_of = "{}.{}"
        if not isinstance(space, dict) or type(value).__module__.partition(".")[0] in ("torch", "numpy"):
            return []
    if len(space) > _HELD:
        return []
    return [(label_of.format(label, key), space, key, item) for key, item in list(space.items())
            if isinstance(key, (str, int)) and is_global_rng(item)]


def unheld_rngs(target: Any) -> list[str]:
    """Where the step's code reads generator objects the recorder does not record (``held_rngs`` looks
    one level into dicts and plain objects, never into lists, tuples or further), as a warning names
    them: "GENS[0] (torch Generator)". Looked through once per step definition; never raises (none)."""
    try:
        out = []
        for label, _, _, value in _rng_reads(target)[1]:
            inner = [(f"{label}[{i}]", item) for i, item in enumerate(value)] if isinstance(
                value, (list, tuple)) and len(value) <= _HELD else []
            if isinstance(value, dict) and len(value) <= _HELD:
                inner = [(f"{label}[{key!r}]", item) for key, item in value.items()]
            for where, item in inner:
                if isinstance(item, (list, tuple, dict)) and len(item) <= _HELD:
                    found = item.values() if isinstance(item, dict) else item
                    out += [f"{where}[...] ({rng_kind(g)})" for g in found if is_global_rng(g)][:1]
                elif is_global_rng(item) and isinstance(value, (list, tuple)):
                    out.append(f"{where} ({rng_kind(item)})")
        return list(dict.fromkeys(out))
    except Exception:  # noqa: BLE001
        return []


def _rng_reads(target: Any) -> tuple[dict[str, Any] | None, list[tuple[str, Any, Any, Any]]]:
    """``_global_reads``, with the generators held one level inside what the code reads (``held_rngs``)."""
    own, reads = _global_reads(target)
    held = [h for label, _, _, value in reads for h in held_rngs(label, value)]
    return own, reads + held


def global_rng_places(target: Any, parts: Iterable[str]) -> dict[str, tuple[dict[str, Any], str]]:
    """Where the step's code reads the generator parts ``parts`` ("global:RNG") as (namespace, name),
    whatever each name holds now: a replay's loaded script binds ``RNG = None`` where its main() made
    the generator, which ``find_global_rngs`` does not take for one. A bare name the code reads that
    its own module does not bind at all is placed in that module. Never raises (none found)."""
    wanted = {p for p in parts if p.startswith(GLOBAL_PREFIX)}
    if not wanted:
        return {}
    try:
        own, reads = _rng_reads(target)
        places: dict[str, tuple[dict[str, Any], str]] = {}
        for label, space, name, _ in reads:
            if GLOBAL_PREFIX + label in wanted:
                places.setdefault(GLOBAL_PREFIX + label, (space, name))
        for part in wanted - set(places):
            label = part.removeprefix(GLOBAL_PREFIX)
            item = _ITEM.fullmatch(label)
            if own is not None and label.isidentifier() and label not in own:
                places[part] = (own, label)
            elif own is not None and item is not None and isinstance(own.get(item[1]), dict):
                with contextlib.suppress(ValueError, SyntaxError):  # (RNGS = {} at import, filled by main())
                    places[part] = (own[item[1]], ast.literal_eval(item[2]))
        return places
    except Exception:  # noqa: BLE001 - code of an unusual kind
        return {}


_ITEM = re.compile(r"([A-Za-z_]\w*)\[(.+)\]")  # a global: part's label of a module-level dict's item


def _code_of(fn: Any) -> tuple[types.CodeType, dict[str, Any]] | None:
    """The code object and globals of a function (unwrapped: a decorator's wrapper leads to it)."""
    try:
        fn = inspect.unwrap(getattr(fn, "__func__", fn))
    except ValueError:  # a cycle of __wrapped__
        return None
    code, env = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if not isinstance(code, types.CodeType) or not isinstance(env, dict):
        return None
    return code, env


def _own(fn: Any) -> bool:
    """Whether a function is the user's code, not a library's."""
    module = getattr(getattr(fn, "__func__", fn), "__module__", None) or ""
    return module.partition(".")[0] not in ("torch", "numpy", "recorder", "replayer")


def code_globals(target: Any) -> dict[str, Any] | None:
    """The module globals a step's code reads its names in (a module step's: its class's ``forward``'s)."""
    first = _code_of(getattr(target, "forward", None) if isinstance(target, type) else target)
    return first[1] if first is not None else None


def _global_reads(target: Any) -> tuple[dict[str, Any] | None, list[tuple[str, dict[str, Any], str, Any]]]:
    """(the globals of the step's own code, what its code reads at module level, as (label, namespace,
    name, value)): the names its code (``co_names``, nested code objects') holds,
    looked up in its module's globals (label ``RNG``) and as attributes of the modules among them
    (``utils.RNG``: namespace that module's), through the functions of its own code it calls
    (module-level helpers, ``self.method`` of a module step's class; not torch's), from names alone
    (nothing is called). For a module step, ``target`` is its class, and its code starts at ``forward``."""
    cls = target if isinstance(target, type) else None
    first = _code_of(getattr(cls, "forward", None) if cls is not None else target)
    if first is None:
        return None, []
    todo, seen, reads = [first], set(), []
    while todo and len(seen) < _MAX_CODE:
        code, env = todo.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        names = list(code.co_names)
        todo += [(c, env) for c in code.co_consts if isinstance(c, types.CodeType)]
        for name in names:
            value = env.get(name)
            if value is None and cls is not None and name not in env:
                value = getattr(cls, name, None)  # self.helper(): a method of the step's class
                if isinstance(value, (types.FunctionType, types.MethodType)) and _own(value):
                    nested = _code_of(value)
                    if nested is not None:
                        todo.append(nested)
                continue
            if name in env:
                reads.append((name, env, name, value))
            if isinstance(value, types.ModuleType):
                space = getattr(value, "__dict__", {})
                reads += [(f"{name}.{attr}", space, attr, space[attr]) for attr in names
                          if attr != name and attr in space]
            elif isinstance(value, types.FunctionType) and _own(value):
                nested = _code_of(value)
                if nested is not None:
                    todo.append(nested)
    return first[1], reads


def global_modules(target: Any) -> list[torch.nn.Module]:
    """The modules (``torch.nn.Module`` objects) a step's code reads by module-level names (``_global_reads``:
    through the helpers it calls), each once: a per-sample loss's ``functional_call(MODEL, params, ...)``
    runs the steps inside ``MODEL`` without the model being its argument. Never raises (none found)."""
    try:
        found = {id(v): v for _, _, _, v in _global_reads(target)[1] if isinstance(v, torch.nn.Module)}
    except Exception:  # noqa: BLE001 - code of an unusual kind
        return []
    return list(found.values())


# -- classes and functions a step's code reads as module-level globals ----------------------------
# A script's main() may rebind one (STE = STES[args.ste]); a replay loads the code without running main,
# and would run what the import binds. The step's definition document names what each was bound to.
_CODE_KINDS = (type, types.FunctionType, types.BuiltinFunctionType)
_LIBRARIES = frozenset(("torch", "numpy", "recorder", "replayer", *sys.stdlib_module_names))


def code_ref(value: Any) -> str | None:
    """The import reference ``module:qualname`` of a class or function (None for anything else)."""
    if not isinstance(value, _CODE_KINDS):
        return None
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    return f"{module}:{qualname}"


def find_global_code(target: Any) -> tuple[tuple[tuple[dict[str, Any], str, Any], ...], dict[str, str]]:
    """``_find_global_code``, never raising (code of an unusual kind: none found)."""
    try:
        return _find_global_code(target)
    except Exception:  # noqa: BLE001
        return (), {}


def _find_global_code(target: Any) -> tuple[tuple[tuple[dict[str, Any], str, Any], ...], dict[str, str]]:
    """(the places (namespace, name, value) of the classes and functions a step's code reads as
    module-level globals (``_global_reads``; in modules not torch's, numpy's or the standard library's:
    ``modules=`` globs' steps have none), to be checked by identity at each call; {place: import reference}
    of those bound to something else than the definition of that very name, which a replay binds
    again): ``{"STE": "__main__:SmoothSTE"}``, a place in another module's globals as
    ``"module:NAME"`` (an attribute of a module the code imported, a helper's global)."""
    own_env, reads = _global_reads(target)
    places: dict[tuple[int, str], tuple[dict[str, Any], str, Any]] = {}
    refs: dict[str, str] = {}
    for _, space, name, value in reads:
        ref = code_ref(value)
        if ref is None or (id(space), name) in places:
            continue
        module = space.get("__name__")
        if not isinstance(module, str) or module.partition(".")[0] in _LIBRARIES:
            continue
        places[(id(space), name)] = (space, name, value)
        if ref != f"{module}:{name}":  # (the definition of that name: what importing the module binds it to)
            refs[name if space is own_env else f"{module}:{name}"] = ref
    return tuple(places.values()), refs


def _state_key(value: Any) -> Any:
    """A hashable key of a numpy bit generator's state dict (its arrays by hash)."""
    if isinstance(value, dict):
        return tuple((k, _state_key(v)) for k, v in value.items())
    if isinstance(value, np.ndarray):
        return (str(value.dtype), xxhash.xxh3_64_intdigest(np.ascontiguousarray(value).data))
    return value


def global_rng_kind(obj: Any) -> str | None:
    """The kind a generator object's state document names ("numpy.random.Generator"), or None for an
    object whose state cannot be read."""
    if isinstance(obj, torch.Generator):
        return "torch.Generator"
    if isinstance(obj, np.random.Generator):
        return "numpy.random.Generator"
    if isinstance(obj, np.random.RandomState):
        return "numpy.random.RandomState"
    if isinstance(obj, np.random.BitGenerator):
        return "numpy.random.BitGenerator"
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        return "random.Random"
    return None


def read_global_rng(obj: Any) -> tuple[Any, Any] | None:
    """(cheap key, state) of a generator object (see ``decode_rng_part`` for the state), or None for
    an object that is not one whose state can be read (``random.SystemRandom`` has none). Reads only."""
    kind = global_rng_kind(obj)
    if kind == "torch.Generator":
        state = obj.get_state()
        return (kind, xxhash.xxh3_64_intdigest(state.numpy().data)), (kind, str(obj.device), state)
    if kind == "random.Random":
        state = obj.getstate()
        return (kind, hash(state)), (kind, None, state)
    if kind is None:
        return None
    state = (obj.bit_generator.state if kind == "numpy.random.Generator" else
             obj.get_state(legacy=False) if kind == "numpy.random.RandomState" else obj.state)
    return (kind, _state_key(state)), (kind, None, state)


def global_rng_parts(found: tuple[tuple[str, dict[str, Any], str], ...]) -> dict[str, tuple[Any, Any]]:
    """The states of the generator objects ``find_global_rngs`` found, as ``rng_parts`` gives them."""
    parts = {}
    for part, space, name in found:
        read = read_global_rng(space.get(name))
        if read is not None:
            parts[part] = read
    return parts


# -- tensors and generators a step's parameters default to ---------------------------------------
DEFAULT_PREFIX = "default:"  # a step's RNG part of a generator object a parameter defaults to: "default:rng"


def step_defaults(target: Any) -> tuple[tuple[int | None, str, Any, bool], ...]:
    """The parameters of a step's function (a module step's: its class's ``forward``, past ``self``) whose
    default is a tensor (``def add_bias(x, bias=BIAS)``) or a generator object of its own (``generator=G_EVAL``,
    ``rng=np.random.default_rng(0)``), as (position, None for a keyword-only one, name, the default, whether
    it is positional-only). A call that does not pass one computes with it as it is then: a tensor training
    changes in place, a generator drawn from at every call. A positional-only one (``bias=BIAS, /``) can be
    recorded as passed only by position, with every positional-only default before it, so those come too,
    whatever they hold. Found once per step definition (through a decorator's ``functools.wraps``,
    ``torch.no_grad()``'s); never raises (none found)."""
    try:
        fn = inspect.unwrap(getattr(target, "forward", None) if isinstance(target, type) else target)
        params = list(inspect.signature(fn).parameters.values())[1 if isinstance(target, type) else 0:]
    except Exception:  # noqa: BLE001 - no signature (a builtin, a callable of an unusual kind)
        return ()
    found: list[tuple[int | None, str, Any, bool]] = []
    positional: list[tuple[tuple[int | None, str, Any, bool], bool]] = []  # (entry, a tensor or generator)
    for position, p in enumerate(params):
        held = p.default
        wanted = isinstance(held, torch.Tensor) or (is_global_rng(held) and global_rng_kind(held) is not None)
        if p.kind is p.POSITIONAL_ONLY and held is not p.empty:
            positional.append(((position, p.name, held, True), wanted))
        elif wanted and p.kind is p.POSITIONAL_OR_KEYWORD:
            found.append((position, p.name, held, False))
        elif wanted and p.kind is p.KEYWORD_ONLY:
            found.append((None, p.name, held, False))
    last = max((i for i, (_, wanted) in enumerate(positional) if wanted), default=-1)
    return tuple(entry for entry, _ in positional[:last + 1]) + tuple(found)


def defaults_taken(found: tuple[tuple[int | None, str, Any, bool], ...], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> dict[str, Any]:
    """The defaults of ``step_defaults`` a call with ``args`` and ``kwargs`` leaves to the function, in the
    order of its parameters (a positional-only one's name in ``kwargs`` is a ``**kwargs`` key: not it)."""
    return {name: held for position, name, held, only in found
            if (only or name not in kwargs) and (position is None or position >= len(args))}


def defaults_apart(found: tuple[tuple[int | None, str, Any, bool], ...], taken: dict[str, Any]
                   ) -> tuple[list[Any], dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The defaults a call takes (``defaults_taken``) as a recording holds them: (the positional-only ones
    from the call's last argument up to the last tensor or torch.Generator among them, in order, appended to
    its ``args``, since a replay can pass them by position only; the other tensors and torch.Generators,
    recorded as if passed by keyword; so a replay passes them with their values or state at the call; the
    states of the other generator objects, which no argument encoding holds, as the RNG parts
    ``default:<name>``, as ``global_rng_parts`` gives them, which a replay sets in the default of the code it
    loaded)."""
    last = max((position for position, name, held, only in found
                if only and name in taken and isinstance(held, (torch.Tensor, torch.Generator))), default=-1)
    appended: list[Any] = []
    passed: dict[str, Any] = {}
    parts: dict[str, tuple[Any, Any]] = {}
    for position, name, held, only in found:
        if name not in taken:
            continue
        if only and position is not None and position <= last:
            appended.append(held)
        elif isinstance(held, (torch.Tensor, torch.Generator)):
            passed[name] = held
        else:
            read = read_global_rng(held)
            if read is not None:
                parts[DEFAULT_PREFIX + name] = read
    return appended, passed, parts


# -- generator objects a step's module holds as attributes ----------------------------------------
MODULE_PREFIX = "module:"  # a step's RNG part of a generator its module holds: "module:gen", "module:inner.rng"


def find_module_rngs(module: torch.nn.Module) -> tuple[tuple[str, Any, Any], ...]:
    """The generator objects (``is_global_rng``) that a module and its submodules hold as attributes,
    as (part, weak reference to the module holding it, attribute name): ``part`` names it in the
    step's RNG document by its path from ``module`` ("module:gen", "module:inner.rng"). Looked for
    once per module object (the recorder does so where it builds the module's skeleton, again only
    when an attribute was rebound); a generator held at two places is a part at each. Never raises: a
    tree of an unusual kind is looked through for none (its step is recorded, and replayed, without them)."""
    found = []
    try:
        for path, m in module.named_modules():
            for name, value in list(m.__dict__.items()):
                place = f"{path}.{name}" if path else name
                if is_global_rng(value) and global_rng_kind(value) is not None:
                    found.append((MODULE_PREFIX + place, weakref.ref(m), name))
                elif isinstance(value, dict) and len(value) <= _HELD:  # self.gens = {"z": torch.Generator()}
                    found += [(f"{MODULE_PREFIX}{place}[{key!r}]", weakref.ref(m), (name, key))
                              for key, item in value.items() if isinstance(key, (str, int))
                              and is_global_rng(item) and global_rng_kind(item) is not None]
    except Exception:  # noqa: BLE001
        return ()
    return tuple(found)


def held_by(module: Any, name: str | tuple[str, Any]) -> Any:
    """What ``module`` holds at a place ``find_module_rngs`` names: an attribute, or (attribute, key) an
    item of a dict attribute; None where there is nothing there."""
    if module is None:
        return None
    if isinstance(name, str):
        return module.__dict__.get(name)
    held = module.__dict__.get(name[0])
    return held.get(name[1]) if isinstance(held, dict) else None


_PLACE = re.compile(r"(?:(?P<path>[^\[]*)\.)?(?P<name>[^.\[]+)(?:\[(?P<key>.+)\])?")


def module_rng_place(place: str) -> tuple[str, str | tuple[str, Any]] | None:
    """(the path of the submodule holding it, its attribute name or (attribute, key)) of a place
    ``find_module_rngs`` names ("inner.gen", "gens['z']"); None for one this version cannot read."""
    found = _PLACE.fullmatch(place)
    if found is None:
        return None
    path, name, key = found["path"] or "", found["name"], found["key"]
    if key is None:
        return path, name
    try:
        value = ast.literal_eval(key)
    except (ValueError, SyntaxError):
        return None
    return (path, (name, value)) if isinstance(value, (str, int)) else None


def module_rng_parts(found: tuple[tuple[str, Any, Any], ...]) -> dict[str, tuple[Any, Any]]:
    """The states of the generator objects ``find_module_rngs`` found, as ``rng_parts`` gives them
    (read at each call: two reads of a dict, and the generator's state)."""
    parts = {}
    for part, owner, name in found:
        m = owner()
        try:
            read = read_global_rng(held_by(m, name)) if m is not None else None
        except Exception:  # noqa: BLE001 - a subclass whose state cannot be read: replayed as rebuilt, and named
            read = None
        if read is not None:
            parts[part] = read
    return parts


def made_rng(state: Any) -> Any:
    """A new generator object of a decoded state's kind, in that state (a module's numpy Generator,
    which its skeleton cannot hold as data, made again for a replay), or None where the state names
    no kind this version makes. Only numpy's own bit generators are made, whatever the state names."""
    kind, device, value = state
    if value is None:
        return None
    try:
        if kind == "torch.Generator":
            made: Any = torch.Generator(device=torch.device(str(device)))
        elif kind == "random.Random":
            made = random.Random()
        else:
            name = value.get("bit_generator") if isinstance(value, dict) else None
            bits = getattr(np.random, name, None) if isinstance(name, str) else None
            if not (isinstance(bits, type) and issubclass(bits, np.random.BitGenerator)):
                return None
            made = (np.random.Generator(bits()) if kind == "numpy.random.Generator" else
                    np.random.RandomState(bits()) if kind == "numpy.random.RandomState" else bits())
    except (RuntimeError, TypeError, ValueError):  # a device this machine lacks, or one torch does not know
        return None
    return made if set_global_rng(made, state) else None


# -- numpy and Python generator objects passed as arguments ($rng, since 1.23) --------------------
def argument_rng(value: Any) -> dict[str, Any] | None:
    """The state document of a generator object passed as an argument (``$rng``), read at the call: a
    ``global:`` part's (``_encode_global``). Only numpy's own Generator, RandomState and bit generators and
    ``random.Random`` itself, which a replay makes again as they were (``made_rng``): None for a subclass of
    them, whose methods a new generator of the base kind would not run, a Generator of another package's bit
    generator, and ``random.SystemRandom``, which has no state. Reads only."""
    cls = type(value)
    own = (value.bit_generator if cls is np.random.Generator else value if isinstance(value, np.random.BitGenerator)
           else None)
    if own is not None and getattr(np.random, type(own).__name__, None) is not type(own):
        return None
    if own is None and cls is not np.random.RandomState and cls is not random.Random:
        return None
    read = read_global_rng(value)
    return None if read is None else _encode_global(read[1])


def made_argument_rng(doc: dict[str, Any]) -> Any:
    """A new generator object in the state of an argument's document (``argument_rng``), or None where it
    names a kind or a bit generator this version does not make (a newer version's)."""
    return made_rng(argument_rng_state(doc))


def argument_rng_state(doc: dict[str, Any]) -> tuple[str, str | None, Any]:
    """(kind, device, state) of an argument's generator document (``argument_rng``), as ``made_rng`` takes it:
    a numpy one's state its bit generator's dict; a kind this version does not know, its state None."""
    return _decode_global(doc)


def argument_rng_words(doc: dict[str, Any]) -> str:
    """What generator an argument's document (``argument_rng``) holds, for a message: its kind, and a numpy
    one's bit generator ("numpy.random.Generator on the bit generator PCG64"). Never raises."""
    kind = str(doc.get("kind"))
    try:
        state = argument_rng_state(doc)[2]
    except Exception:  # noqa: BLE001 - a state this version cannot read: its kind alone
        state = None
    bits = state.get("bit_generator") if isinstance(state, dict) else None
    return f"{kind:.60} on the bit generator {bits:.60}" if isinstance(bits, str) else f"{kind:.60}"


def set_global_rng(obj: Any, state: Any) -> bool:
    """Give a generator object a decoded state of its own kind; False (nothing set) where it is not
    of that kind now, or the state does not fit it."""
    kind, _, value = state
    if value is None or global_rng_kind(obj) != kind:
        return False
    try:
        if kind == "torch.Generator":
            obj.set_state(value)
        elif kind == "numpy.random.Generator":
            obj.bit_generator.state = value
        elif kind == "numpy.random.RandomState":
            obj.set_state(value)
        elif kind == "numpy.random.BitGenerator":
            obj.state = value
        else:
            obj.setstate(value)
    except (TypeError, ValueError, RuntimeError):  # another bit generator, another size of state
        return False
    return True


@contextmanager
def applied_global_rngs(wanted: list[tuple[Any, Any]]) -> Iterator[None]:
    """Run a block with generator objects set to states ([(object, decoded state or None)]; None:
    left as it is), then give every one of them back the state it had."""
    saved = []
    try:
        for obj, state in wanted:
            now = read_global_rng(obj)
            if now is None:
                continue
            saved.append((obj, now[1]))
            if state is not None:
                set_global_rng(obj, state)
        yield
    finally:
        for obj, state in reversed(saved):
            set_global_rng(obj, state)


def encode_rng_part(name: str, state: Any) -> dict[str, Any]:
    """JSON form of one generator's state."""
    if name == "numpy":
        kind, key, pos, has_gauss, gauss = state
        return {"kind": kind, "key": _b64(np.ascontiguousarray(key, dtype="<u4").tobytes()), "pos": int(pos),
                "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}
    if name == "python":
        version, internal, gauss_next = state
        return {"version": version, "state": _b64(np.asarray(internal, dtype="<u4").tobytes()),
                "gauss_next": gauss_next}
    if name.startswith((GLOBAL_PREFIX, MODULE_PREFIX, DEFAULT_PREFIX)):
        return _encode_global(state)
    return {"bytes": _b64(state.numpy().tobytes())}  # torch and cuda:N: uint8 state tensors


def _encode_global(state: Any) -> dict[str, Any]:
    """A generator object's state document. Each kind keeps its state in ``bytes`` (a reader of 1.14,
    which takes a part it does not know for a torch state, reads and ignores it): torch's state
    tensor, Python's 625 words, numpy's bit generator state dict as JSON (integers exact, arrays as
    ``$ndarray``)."""
    kind, device, value = state
    if kind == "torch.Generator":
        return {"kind": kind, "device": device, "bytes": _b64(value.numpy().tobytes())}
    if kind == "random.Random":
        version, internal, gauss_next = value
        return {"kind": kind, "version": version, "bytes": _b64(np.asarray(internal, dtype="<u4").tobytes()),
                "gauss_next": gauss_next}
    return {"kind": kind, "bytes": _b64(jsonval.dumps(jsonval.encode(value)))}


def decode_rng_part(name: str, doc: dict[str, Any]) -> Any:
    if name == "numpy":
        key = np.frombuffer(base64.b64decode(doc["key"]), dtype="<u4").astype(np.uint32)
        return (doc["kind"], key, doc["pos"], doc["has_gauss"], doc["cached_gaussian"])
    if name == "python":
        internal = tuple(int(v) for v in np.frombuffer(base64.b64decode(doc["state"]), dtype="<u4"))
        return (doc["version"], internal, doc["gauss_next"])
    if name.startswith((GLOBAL_PREFIX, MODULE_PREFIX, DEFAULT_PREFIX)):
        return _decode_global(doc)
    return torch.frombuffer(bytearray(base64.b64decode(doc["bytes"])), dtype=torch.uint8)


def _decode_global(doc: dict[str, Any]) -> tuple[str, str | None, Any]:
    """(kind, device, state) of a generator object's document; a kind this version does not know:
    its state None (the replay leaves that generator as it is, and says so)."""
    kind, raw = doc["kind"], base64.b64decode(doc["bytes"])
    if kind == "torch.Generator":
        return kind, str(doc["device"]), torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if kind == "random.Random":
        return kind, None, (doc["version"], tuple(int(v) for v in np.frombuffer(raw, dtype="<u4")), doc["gauss_next"])
    if kind in ("numpy.random.Generator", "numpy.random.RandomState", "numpy.random.BitGenerator"):
        state = jsonval.decode(jsonval.loads(raw))
        if not isinstance(state, dict):
            raise ValueError(f"a {kind} state is a dict, not {type(state).__name__}")
        return kind, None, state
    return str(kind), None, None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


@contextmanager
def applied_rng(parts: dict[str, Any], *, cuda: bool = False) -> Iterator[None]:
    """Run a block with the given generator states ({part: decoded state}), then restore the
    caller's. CUDA parts are applied only to devices that exist; the caller's CUDA states are saved
    when CUDA parts are given, or ``cuda`` asks for it (the block seeds them), and CUDA is available."""
    saved_cpu, saved_np, saved_py = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda_parts = {int(k.split(":")[1]): v for k, v in parts.items() if k.startswith("cuda:")}
    saved_cuda = None
    if (cuda_parts or cuda) and torch.cuda.is_available():
        saved_cuda = torch.cuda.get_rng_state_all()
    try:
        if "torch" in parts:
            torch.set_rng_state(parts["torch"])
        if "numpy" in parts:
            np.random.set_state(parts["numpy"])
        if "python" in parts:
            random.setstate(parts["python"])
        for device, state in cuda_parts.items():
            if saved_cuda is not None and device < len(saved_cuda):
                torch.cuda.set_rng_state(state, device)
        yield
    finally:
        torch.set_rng_state(saved_cpu)
        np.random.set_state(saved_np)
        random.setstate(saved_py)
        if saved_cuda is not None:
            torch.cuda.set_rng_state_all(saved_cuda)


# -- settings -------------------------------------------------------------------------------------
def _safe(get: Any) -> Any:
    try:
        value = get()
    except Exception:  # a backend this build lacks
        return None
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


def _first(pair: Any) -> Any:
    return pair[0] if isinstance(pair, tuple) else pair


_SMALLEST_NORMAL, _HALF = np.float32(np.finfo(np.float32).tiny), np.float32(0.5)


def flushes_denormals() -> bool:
    """Whether this thread's floating point unit flushes denormal results to zero (FTZ): set by
    ``torch.set_flush_denormal(True)``, and by any shared library built with ``-ffast-math`` that the
    process loaded. It changes the results of operators whose values reach the denormal range. Read by
    computing one (~0.3 us; there is no getter), so it is what the thread does, whoever set it."""
    return bool(_SMALLEST_NORMAL * _HALF == 0)


def _default_device() -> str:
    """``str(torch.get_default_device())``, without its imports and closures where no torch function mode
    (a ``with torch.device(...)`` block is one) and no ``torch.set_default_device`` is in force: read at every
    step entry, and ~30 us there against ~10 (its code and data out of the cache after the training's own
    operators)."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    if torch._C._len_torch_function_stack() or context is not None:
        return str(torch.get_default_device())
    return "cpu"


def _validates_distributions() -> bool:
    """torch.distributions' default ``validate_args`` (``Distribution.set_default_validate_args``)."""
    return bool(Distribution._validate_args)


def _candidates() -> list[tuple[str, Any, Any]]:
    """(setting, fast getter or None, public getter) for every numerics setting.

    The fast getters are the C functions behind torch.backends' properties: reading a flag through
    the property costs ~1 us of Python, and this runs at every step entry. Each fast getter is
    checked against its public twin once (``_getters``); a build that lacks it, or disagrees, uses
    the public one."""
    b, c = torch.backends, torch._C

    def fast(name: str, *args: Any, pick: Any = None) -> Any:
        fn = getattr(c, name, None)
        if fn is None:
            return None
        if pick is None:
            return (lambda: fn(*args)) if args else fn
        return lambda: pick(fn(*args))

    return [
        ("deterministic_algorithms", None, torch.are_deterministic_algorithms_enabled),
        ("deterministic_warn_only", None, torch.is_deterministic_algorithms_warn_only_enabled),
        ("cudnn_enabled", fast("_get_cudnn_enabled"), lambda: b.cudnn.enabled),
        ("cudnn_deterministic", fast("_get_cudnn_deterministic"), lambda: b.cudnn.deterministic),
        ("cudnn_benchmark", fast("_get_cudnn_benchmark"), lambda: b.cudnn.benchmark),
        ("mkldnn_enabled", fast("_get_mkldnn_enabled"), lambda: b.mkldnn.enabled),  # oneDNN's CPU kernels (1.11)
        ("cudnn_allow_tf32", fast("_get_cudnn_allow_tf32"), lambda: b.cudnn.allow_tf32),
        ("cuda_matmul_allow_tf32", fast("_get_cublas_allow_tf32"), lambda: b.cuda.matmul.allow_tf32),
        ("cuda_matmul_fp16_reduced_precision",
         fast("_get_cublas_allow_fp16_reduced_precision_reduction", pick=_first),
         lambda: b.cuda.matmul.allow_fp16_reduced_precision_reduction),
        ("cuda_matmul_bf16_reduced_precision",
         fast("_get_cublas_allow_bf16_reduced_precision_reduction", pick=_first),
         lambda: b.cuda.matmul.allow_bf16_reduced_precision_reduction),
        ("float32_matmul_precision", None, torch.get_float32_matmul_precision),
        ("fp32_precision", fast("_get_fp32_precision_getter", "generic", "all"), lambda: b.fp32_precision),
        ("cuda_matmul_fp32_precision", fast("_get_fp32_precision_getter", "cuda", "matmul"),
         lambda: b.cuda.matmul.fp32_precision),
        ("cudnn_fp32_precision", fast("_get_fp32_precision_getter", "cuda", "all"), lambda: b.cudnn.fp32_precision),
        ("mkldnn_fp32_precision", fast("_get_fp32_precision_getter", "mkldnn", "all"),
         lambda: b.mkldnn.fp32_precision),
        ("sdp_flash", fast("_get_flash_sdp_enabled"), lambda: b.cuda.flash_sdp_enabled()),  # noqa: PLW0108 (looked up late: older builds lack it)
        ("sdp_mem_efficient", fast("_get_mem_efficient_sdp_enabled"), lambda: b.cuda.mem_efficient_sdp_enabled()),  # noqa: PLW0108 (looked up late: older builds lack it)
        ("sdp_math", fast("_get_math_sdp_enabled"), lambda: b.cuda.math_sdp_enabled()),  # noqa: PLW0108 (looked up late: older builds lack it)
        ("sdp_cudnn", fast("_get_cudnn_sdp_enabled"), lambda: b.cuda.cudnn_sdp_enabled()),  # noqa: PLW0108 (looked up late: older builds lack it)
        ("default_dtype", None, torch.get_default_dtype),
        # set by torch.set_default_device or a `with torch.device(...)` block
        ("default_device", _default_device if hasattr(torch, "_GLOBAL_DEVICE_CONTEXT") else None,
         lambda: str(torch.get_default_device())),
        ("num_threads", None, torch.get_num_threads),
        ("num_interop_threads", None, torch.get_num_interop_threads),
        ("cpu_capability", None, lambda: b.cpu.get_cpu_capability()),  # noqa: PLW0108 (looked up late: a test, or a tool, may patch it)
        ("grad_enabled", None, torch.is_grad_enabled),
        ("inference_mode", None, torch.is_inference_mode_enabled),
        ("flush_denormal", None, flushes_denormals),
        # torch.distributions' default: whether a distribution made without validate_args checks its parameters and
        # the values log_prob is given (set_default_validate_args; a NaN sample raises where it does)
        ("distributions_validate_args", None, _validates_distributions),
        ("autocast_cpu", None, lambda: torch.is_autocast_enabled("cpu")),
        ("autocast_cpu_dtype", None, lambda: torch.get_autocast_dtype("cpu")),
        ("autocast_cuda", None, lambda: torch.is_autocast_enabled("cuda")),
        ("autocast_cuda_dtype", None, lambda: torch.get_autocast_dtype("cuda")),
    ]


_PLAIN = (bool, int, float, str, type(None))


@functools.cache
def _getters() -> list[tuple[str, Any]]:
    """The getter used for each setting: the fast one where it exists and agrees with the public
    one, else the public one; getters that raise, or return non-JSON values, go through ``_safe``."""
    chosen = []
    for name, quick, public in _candidates():
        reference = _safe(public)
        if quick is not None and reference is not None and _safe(quick) == reference:
            chosen.append((name, quick))
            continue
        try:
            plain = isinstance(public(), _PLAIN)
        except Exception:
            plain = False
        chosen.append((name, public if plain else functools.partial(_safe, public)))
    return chosen


def settings() -> dict[str, Any]:
    """Everything that changes numerics, as plain JSON values (None where this build lacks it)."""
    return settings_of(settings_values())


def settings_values() -> tuple[Any, ...]:
    """The values ``settings()`` holds, in its order, the environment variables' last: a key that
    tells whether anything changed without building the document (a recording reads it at every
    step; ``settings_of`` makes the document of a new one)."""
    try:
        values = [get() for _, get in _getters()]
    except Exception:  # a getter that worked before fails now: read each one carefully
        values = [_safe(get) for _, get in _getters()]
    values += _env_values()
    return tuple(values)


def settings_of(values: tuple[Any, ...]) -> dict[str, Any]:
    """The ``settings()`` document of ``settings_values()``."""
    getters = _getters()
    s = {name: value for (name, _), value in zip(getters, values)}
    s["env"] = dict(zip(ENV_VARS, values[len(getters):], strict=True))
    return s


_ENV_KEYS = tuple((k, os.fsencode(k)) for k in ENV_VARS) if os.name == "posix" else ()


def _env_values() -> list[str | None]:
    """The values of ``ENV_VARS``, in order (None where unset)."""
    # os.environ.get encodes the key and decodes the value on every call (~1.5 us each); on POSIX
    # the mapping keeps the raw bytes in ``_data``, which is what os.environ.get reads too.
    data = getattr(os.environ, "_data", None)
    if not _ENV_KEYS or not isinstance(data, dict):
        return [os.environ.get(k) for k in ENV_VARS]
    out = []
    for _, raw in _ENV_KEYS:
        value = data.get(raw)
        out.append(None if value is None else os.fsdecode(value))
    return out
