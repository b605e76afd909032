"""Strict-JSON encoding of non-tensor call arguments and module constructor arguments (never pickle)."""

from __future__ import annotations

import base64
import collections
import dataclasses
import enum
import functools
import importlib
import itertools
import json
import math
import os
import random
import re
import sys
import sysconfig
import types
import typing
from collections import abc
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np
import torch

from .errors import FormatError, UnknownTagError

TensorNamer = Callable[[Any, str], str | None]
NDARRAY_VALUES = 4096  # a numpy array of more values is not recorded as data ($opaque)
CONTAINER_ITEMS = 4096  # nor a list, tuple, dict or set of more items (a DQN's replay memory passed whole)
ENCODED_ITEMS = 65536  # nor containers met after this many items were encoded in one value (lists of long lists)
_NDARRAY_SPAN = 1 << 24  # bytes: a rebuilt array's memory in its recorded strides, at most (else its order)
_BIGINT_BITS = 13000  # ~3900 decimal digits: below CPython's 4300-digit int/str conversion limit
_NP_KINDS = "biufcSU"
_SURROGATE = re.compile("[\ud800-\udfff]")
_INTS, _NUMBERS = (int,), (int, float)
_CALLBACK_NOTE = "raised by the tensor callback of recorder.jsonval.decode"
_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_QSCHEMES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.qscheme)}


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """A tensor stored elsewhere under ``name`` (the default decoding of ``{"$tensor": name}``)."""
    name: str


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype (``"float32"``) and device (``"cuda:0"``) of a tensor whose data was not kept."""
    shape: tuple
    dtype: str
    device: str


@dataclasses.dataclass(frozen=True)
class Opaque:
    """A value that could not be encoded: its ``module:QualName`` and its repr, cut to 200 chars."""
    type: str
    repr: str


@dataclasses.dataclass(frozen=True)
class Record:
    """A dataclass/namedtuple/enum/plain object whose type was not imported, or a class that was not
    (``kind`` "class", no fields); enums have ``fields={"name": ...}``; ``kind`` is "dataclass",
    "namedtuple", "enum", "object" or "class"."""
    type: str
    kind: str
    fields: dict

    def __hash__(self) -> int:  # hashable (for sets and dict keys) although ``fields`` is a dict
        return hash((self.type, self.kind, tuple(self.fields)))


def type_ref(obj_or_type: Any) -> str:
    """Return ``"module:QualName"`` of a class, or of the class of an instance.

    Args:
        obj_or_type: a class, or any object whose class is named.
    """
    cls = obj_or_type if isinstance(obj_or_type, type) else type(obj_or_type)
    ref = f"{getattr(cls, '__module__', None)}:{getattr(cls, '__qualname__', None)}"
    return ref.encode("utf-8", "backslashreplace").decode()  # escapes lone surrogates


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python, not in C
_MAX_FIELDS = 64
_NOT_PLAIN = (type, types.FunctionType, types.MethodType, types.ModuleType, types.BuiltinFunctionType,
              torch.nn.Module, torch.Tensor, np.ndarray)


# Bases that hold no state of an instance and change nothing of how one is made: typing.Generic (torch's
# Independent derives from Generic[D]; a C type from Python 3.12), whatever their own flags say.
_STATELESS_BASES = (typing.Generic,)


def _plain_object(value: Any) -> bool:
    """A user object that is only its fields: an instance of a class defined in Python whose state is
    its ``__dict__`` (no custom pickling, no C base class, no slot holding state: the empty ``__slots__``
    of typing.Generic or of a mixin holds none), with a modest number of fields. torch.distributions'
    transforms too, whose ``__getstate__`` only drops the link to their inverse (``_state``)."""
    cls = type(value)
    if cls is types.SimpleNamespace:  # argparse-like configs: only its fields
        return len(value.__dict__) <= _MAX_FIELDS
    if type(cls) is not type or isinstance(value, _NOT_PLAIN) or not isinstance(getattr(value, "__dict__", None), dict):
        return False
    bases = [c for c in cls.__mro__[:-1] if c not in _STATELESS_BASES]
    if any(not (c.__flags__ & _HEAPTYPE) or _holds_slots(c) for c in bases):
        return False
    transform = _transform_class(cls)
    if any(name in c.__dict__ and not (transform and name == "__getstate__") for c in bases
           for name in ("__reduce__", "__reduce_ex__", "__getstate__")):
        return False
    return len(value.__dict__) <= _MAX_FIELDS


def _holds_slots(cls: type) -> bool:
    """Whether ``cls`` itself declares slots that hold state (not an empty ``__slots__``, nor one of only
    ``__dict__`` and ``__weakref__``)."""
    if "__slots__" not in cls.__dict__:
        return False
    slots = cls.__dict__["__slots__"]
    try:
        names = [slots] if isinstance(slots, str) else list(slots)
    except TypeError:
        return True
    return any(n not in ("__dict__", "__weakref__") for n in names)


def _transform_class(cls: type) -> bool:
    """A torch.distributions transform's class whose ``__getstate__`` is torch's ``Transform.__getstate__``
    (which only drops the link to its inverse: ``_state``). Where torch.distributions is not loaded, no
    value is a transform."""
    module = sys.modules.get("torch.distributions.transforms")
    base = getattr(module, "Transform", None)
    return isinstance(base, type) and issubclass(cls, base) and getattr(cls, "__getstate__", None) is \
        base.__getstate__


def _state(value: Any) -> dict:
    """The fields a plain object is recorded by: its ``__dict__``; a torch.distributions transform's
    without its cached inverse (``_inv``, made again when asked for, and a cycle back to the transform),
    as its ``__getstate__`` gives it, where it is not that inverse itself (whose ``_inv`` is the transform)."""
    state = value.__dict__
    if state.get("_inv") is not None and _transform_class(type(value)) and \
            type(value) is not sys.modules["torch.distributions.transforms"]._InverseTransform:
        return {**state, "_inv": None}
    return state


def _mapping_class(cls: type) -> bool:
    """A dict subclass that is its items and its ``__dict__`` (EasyDict, addict's Dict, yacs's CfgNode,
    Counter, OrderedDict and subclasses of it): classes defined in Python between it and ``dict`` (or
    ``OrderedDict``), metaclass ``type``, no ``__slots__`` (state outside both). Not defaultdict: its
    default factory is code."""
    if type(cls) is not type or not issubclass(cls, dict) or cls is dict or issubclass(cls, collections.defaultdict):
        return False
    for c in cls.__mro__:
        if c in (dict, collections.OrderedDict):
            return True
        if not (c.__flags__ & _HEAPTYPE) or c.__dict__.get("__slots__", ()) != ():
            return False
    return False


def _mapping(value: dict, pairs: list, sub: Callable[[Any, Any], Any]) -> dict | None:
    """``$mapping`` of a dict subclass: its type, its items in order (a list of pairs: JSON objects are
    sorted when written) and its attributes that are not the same-named item (EasyDict's all are)."""
    state = getattr(value, "__dict__", None)
    own = {k: v for k, v in state.items() if not (dict.__contains__(value, k) and dict.__getitem__(value, k) is v)
           } if isinstance(state, dict) else {}
    if len(own) > _MAX_FIELDS or not all(type(k) is str and not _SURROGATE.search(k) for k in own):
        return None
    out = {"type": type_ref(value), "items": [[sub(k, k), sub(k, v)] for k, v in pairs]}
    if own:
        out["attrs"] = {k: sub(k, v) for k, v in own.items()}
    return {"$mapping": out}


_LARGE = "<numpy array of {} values of {}, shape {}>"  # an $opaque's repr for an array too large to be data
_NP_GENERATORS = {f"numpy.random.{m}:{c}" for m, c in (
    ("_generator", "Generator"), ("mtrand", "RandomState"), ("_pcg64", "PCG64"), ("_pcg64", "PCG64DXSM"),
    ("_mt19937", "MT19937"), ("_philox", "Philox"), ("_sfc64", "SFC64"))}
# Generator objects a ``$rng`` holds the state of (numpy's own and random.Random; not SystemRandom, a subclass)
_RNGS = (np.random.Generator, np.random.RandomState, np.random.BitGenerator, random.Random)
_LARGE_RE = re.compile(r"<numpy array of (\d+) values of (\S+), shape (\[[\d, ]*\])>")
_MANY = "<{} of {} items{}>"  # an $opaque's repr for a container too long to be data (its items not looked at)
_MANY_RE = re.compile(r"<(\w+) of (\d+) items( past the first \d+ encoded)?>")
# an Opaque's repr for a $rng this version cannot make (a newer recorder's kind or bit generator): its words
_UNMADE_RNG = "<{} in a recorded state this PaperDebugger cannot make again>"
_UNMADE_RNG_RE = re.compile(re.escape(_UNMADE_RNG).replace(r"\{\}", "(.+)"))


def opaque_reason(value: Opaque) -> str | None:
    """Why a value was not recorded as data, where the recording says and it is not its type alone:
    a numpy array over the size recorded as data ("a numpy array of 12,288 values (float32, shape
    [4, 3, 32, 32]), over the 4,096 recorded as data"), a numpy or Python generator passed as an argument
    that a recording before 1.23 held as ``$opaque`` (since, ``$rng``), a random.SystemRandom; or why a
    ``$rng`` recorded as data cannot be made again here (a newer version's kind or bit generator); None for
    another (and for such an array in a recording before this note, which kept numpy's repr)."""
    if value.type in _NP_GENERATORS:
        return (f"a numpy {value.type.rpartition(':')[2]} passed as an argument, whose state is not recorded (a "
                "recording made before schema 1.23 holds none; since, only one on numpy's own bit generators is): "
                "record again with this version, using one of numpy's bit generators, to replay it")
    if value.type == "random:Random":
        return ("a random.Random passed as an argument, whose state a recording made before schema 1.23 does not "
                "hold: record again with this version to replay it")
    unmade = _UNMADE_RNG_RE.fullmatch(value.repr) if ":" not in value.type else None  # ($opaque types have one)
    if unmade is not None:
        return (f"a {unmade[1]} passed as an argument, whose state the recording holds, but of a kind this "
                "PaperDebugger cannot make (recorded by a newer version: upgrade paperdebugger to replay it)")
    if value.type == "random:SystemRandom":
        return ("a random.SystemRandom passed as an argument, which draws from the operating system: it has no "
                "state to record or replay (pass a random.Random, whose state is recorded at each call)")
    many = _MANY_RE.fullmatch(value.repr)
    if many is not None:
        over = (f"met after the first {ENCODED_ITEMS:,} items of the value were recorded as data" if many[3] else
                f"over the {CONTAINER_ITEMS:,} items recorded as data")
        return (f"a {many[1]} of {int(many[2]):,} items, {over} (taking it apart at every call would slow training "
                "down: make it a tensor, or give the step only the part it uses, the sampled batch)")
    found = _LARGE_RE.fullmatch(value.repr) if value.type == "numpy:ndarray" else None
    if found is None:
        return None
    return (f"a numpy array of {int(found[1]):,} values ({found[2]}, shape {found[3]}), over the "
            f"{NDARRAY_VALUES:,} recorded as data")


# Objects whose work runs as their caller iterates or awaits them, after the call that made them returned, by the
# type a recording names them by (an $opaque's "type"): generators and coroutines, and the builtin iterators
# (map, zip, a list's iterator) and itertools'
_LAZY_NAMED = {type_ref(types.GeneratorType): "a generator", type_ref(types.CoroutineType): "a coroutine",
               type_ref(types.AsyncGeneratorType): "an async generator"}
_LAZY_ITERATORS = {type_ref(t) for t in (
    map, filter, zip, enumerate, reversed, type(iter([])), type(iter(())), type(iter(range(0))), type(iter({})),
    type(iter({}.values())), type(iter({}.items())), type(iter(set())), type(iter("")), type(iter(b"")),
    *(t for t in vars(itertools).values() if isinstance(t, type)))}


def lazy_kind(value: Any) -> str | None:
    """What ``value`` is where it does its work only as its caller iterates or awaits it ("a generator",
    "a coroutine", "an async generator", "a lazy iterator (builtins:map)"): a step that returns one did
    not do that work inside the call. None for anything else (a tensor, a tuple, a list)."""
    if value is None or isinstance(value, (torch.Tensor, tuple, list, dict)):
        return None
    ref = type_ref(value)
    if ref in _LAZY_NAMED:
        return _LAZY_NAMED[ref]
    if ref in _LAZY_ITERATORS or isinstance(value, (abc.Iterator, abc.AsyncIterator)):
        return f"a lazy iterator ({ref})"
    return f"an awaitable ({ref})" if isinstance(value, abc.Awaitable) else None


def lazy_doc(doc: Any) -> str | None:
    """``lazy_kind`` of the value a recorded document holds (an output structure), where its type tells: a
    generator, a coroutine or a builtin lazy iterator, recorded as ``$opaque``."""
    inner = doc.get("$opaque") if isinstance(doc, dict) and len(doc) == 1 else None
    ref = inner.get("type") if isinstance(inner, dict) else None
    if ref in _LAZY_NAMED:
        return _LAZY_NAMED[ref]
    return f"a lazy iterator ({ref})" if ref in _LAZY_ITERATORS else None


def _opaque(value: Any) -> dict:
    try:
        if isinstance(value, types.FunctionType):  # by where it was defined, which messages name it by
            text = f"<function {value.__module__}:{value.__qualname__}>"
        else:
            text = repr(value)
        text = text.encode("utf-8", "backslashreplace").decode()[:200]
    except Exception:  # noqa: BLE001 - a raising __repr__ must not stop the recording
        text = "<unrepresentable>"
    return {"$opaque": {"type": type_ref(value), "repr": text}}


_FUNCTION_REPR = re.compile(r"<function (?P<name>\S+?)(?: at 0x[0-9a-fA-F]+)?>")


def function_name(value: Opaque) -> str | None:
    """A function a recording holds as ``$opaque`` (or names by a ``$function`` reference that a
    replay did not find), by its qualified name: "the function __main__:main.<locals>.causal", "the
    lambda __main__:<lambda>"; None for a value that is no function."""
    if value.type != "builtins:function":
        return None
    found = _FUNCTION_REPR.fullmatch(value.repr)
    name = found["name"] if found is not None else value.repr
    return f"the {'lambda' if name.endswith('<lambda>') else 'function'} {name}"


def function_label(value: Any) -> str | None:
    """``function_name`` of a live function ("the function torch.optim.swa_utils:get_ema_multi_avg_fn.
    <locals>.ema_update"), for a message of the recorder's; None for anything else."""
    if not isinstance(value, types.FunctionType):
        return None
    return function_name(Opaque("builtins:function", f"<function {value.__module__}:{value.__qualname__}>"))


def function_words(value: Opaque) -> str | None:
    """``function_name``, with why a replay cannot have it: "the lambda __main__:<lambda>, which could
    not be recorded as data (a lambda has no name to import it by: ...)"; None for no function."""
    name, why = function_name(value), function_why(value)
    if name is None:
        return None
    if _FUNCTION_REPR.fullmatch(value.repr) is None:  # a $function reference the replay could not find here
        return f"{name}, which the recording names but which cannot be found here now (renamed or removed since?)"
    return f"{name}, which could not be recorded as data{f' ({why})' if why else ''}"


def function_why(value: Opaque) -> str | None:
    """Why a function was recorded as ``$opaque``: a lambda, one defined inside a function, another
    package's; None where the recording does not tell (one made before functions' names were kept)."""
    found = _FUNCTION_REPR.fullmatch(value.repr) if value.type == "builtins:function" else None
    if found is None:
        return None
    name = found["name"]
    if name.endswith("<lambda>"):
        return ("a lambda has no name to import it by: define it with def at module level in the training code, "
                "which is recorded by its name")
    if "<locals>" in name:
        return "it was defined inside a function: only a module-level function is recorded, by its import reference"
    if ":" in name:
        return ("only torch's tensor math and the training code's own module-level functions are recorded, by "
                "import reference")
    return None


def _enc_int(value: int) -> Any:
    value = int.__index__(value)  # the exact int, without calling a subclass's methods
    return {"$bigint": hex(value)} if value.bit_length() > _BIGINT_BITS else value


def _enc_float(value: float) -> Any:
    value = float.__float__(value)
    return value if math.isfinite(value) else {"$float": "nan" if math.isnan(value) else f"{value}"}


_LEAVES: list[tuple[Any, str | None, Callable[[Any], Any]]] = [  # (type, tag or None for bare, convert)
    (int, None, _enc_int),
    (float, None, _enc_float),
    (complex, "$complex", lambda v: [_enc_float(v.real), _enc_float(v.imag)]),
    (bytes, "$bytes", lambda v: base64.b64encode(v).decode()),
    (bytearray, "$bytearray", lambda v: base64.b64encode(v).decode()),
    (type(Ellipsis), "$ellipsis", lambda v: None),
    (torch.dtype, "$dtype", lambda v: str(v).removeprefix("torch.")),
    (torch.qscheme, "$qscheme", lambda v: str(v).removeprefix("torch.")),  # a torch.ao observer's per_tensor_affine
    (torch.device, "$device", str),
    (torch.Size, "$size", lambda v: [int(d) for d in v]),
    (range, "$range", lambda v: [_enc_int(x) for x in (v.start, v.stop, v.step)]),
]


def int_key_part(key: int) -> str:
    """The path part of a dict's int key whose text is also one of the dict's string keys (``{1: a, "1": b}``):
    ``[1]`` (``output.[1]``), so that the two values' records have names of their own (1.29; both were
    ``output.1`` before). An int key alone is named by its text, as a string key is."""
    return f"[{key}]"


def shadowed(key: Any, texts: set[str]) -> bool:
    """Whether ``key`` is a dict's int key whose text is one of its string keys (``texts``): named ``[1]``."""
    return type(key) is int and str(key) in texts


def encode(value: Any, *, tensor_name: TensorNamer | None = None, max_depth: int = 32, bounded: bool = False,
           module_doc: Callable[[torch.nn.Module], Any] | None = None) -> Any:
    """Encode an arbitrary Python value into JSON-compatible data (dict/list/str/int/float/bool/None).

    Never raises: unsupported objects, cycles and values deeper than ``max_depth`` become ``$opaque``;
    ``$bigint`` (hex) and ``$ustr`` carry ints too long for JSON parsers and strings with lone surrogates.
    Lost: dict subclasses other than ``$mapping``'s (defaultdict, those defined in C: plain dicts),
    subclasses of list/tuple (unless namedtuples) and of int/float/str (unless enums), nan sign/payload
    bits, key order under dumps.

    Args:
        value: the value to encode.
        tensor_name: ``callable(tensor, path) -> str | None`` called for every tensor with its dotted path
            below the root (``"a.0"`` for ``t`` in ``{"a": [t]}``, ``""`` for the root): a name is stored as
            ``{"$tensor": name}``, None as ``{"$tensor_meta": ...}``; if it raises, the tensor is opaque.
        max_depth: nesting depth (the root is 0) beyond which values become opaque.
        bounded: a step call's arguments or results, encoded at every call: a list, tuple, dict or set of more
            than ``CONTAINER_ITEMS`` items, or met after ``ENCODED_ITEMS`` items were encoded, becomes opaque
            (``opaque_reason`` says why), so that a replay memory passed whole does not slow training down.
            Not for what is encoded once (a module's attributes, its constructor's arguments).
        module_doc: ``callable(module) -> skeleton document | None``: an ``nn.Module`` met in the value (a
            target network given to a soft update, a method's ``self.net``) is ``$module`` (1.30): that
            skeleton and its parameters and buffers, each a tensor at ``<path>.<its name>``; None (or a
            None skeleton): ``$opaque``, as before.
    """
    active: set[int] = set()  # ids of the containers being encoded: meeting one again is a cycle
    spent = [0]  # items of containers encoded so far (``ENCODED_ITEMS``)

    def enc(value: Any, path: str, depth: int) -> Any:
        try:
            return leaf(value, path, depth) if depth <= max_depth else _opaque(value)
        except Exception:  # noqa: BLE001 - encode never raises: whatever fails becomes opaque
            return _opaque(value)

    def leaf(value: Any, path: str, depth: int) -> Any:
        if isinstance(value, torch.Tensor):  # Parameter included; first: a step's arguments are mostly tensors
            name = tensor_name(value, path) if tensor_name is not None else None
            if isinstance(name, str):
                return {"$tensor": name}
            return {"$tensor_meta": {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                                     "device": str(value.device)}}
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, enum.Enum):  # before int/str/float: IntEnum, StrEnum
            return {"$enum": {"type": type_ref(value), "name": value.name}}
        if isinstance(value, np.generic):  # before float/str/bytes: np.float64, np.str_ subclass them
            dt = value.dtype
            if dt.kind not in _NP_KINDS or (dt.kind in "fc" and dt.itemsize > (16 if dt.kind == "c" else 8)):
                return _opaque(value)  # longdouble: item() would round
            item = str.__str__(value) if dt.kind == "U" else bytes(value) if dt.kind == "S" else value.item()
            return {"$npscalar": {"dtype": str(dt), "value": leaf(item, path, depth)}}  # item() strips NULs
        if isinstance(value, str):
            value = str.__str__(value)
            if _SURROGATE.search(value):
                return {"$ustr": base64.b64encode(value.encode("utf-32-le", "surrogatepass")).decode()}
            return value
        for kind, tag, convert in _LEAVES:
            if isinstance(value, kind):
                return convert(value) if tag is None else {tag: convert(value)}
        if isinstance(value, torch.Generator):  # its state before the call: a replay draws the same numbers
            state = base64.b64encode(value.get_state().numpy().tobytes()).decode()
            return {"$generator": {"device": str(value.device), "state": state}}
        if isinstance(value, _RNGS):  # (1.23) numpy's and Python's, so too: the state document a global one's is
            from . import snapshot  # (which encodes numpy's states with this module: imported when first needed)
            doc = snapshot.argument_rng(value)
            return {"$rng": doc} if doc is not None else _opaque(value)
        if isinstance(value, type):  # a class a constructor takes (torch.ao's FakeQuantize(observer=...))
            ref = class_ref(value)
            return {"$class": ref} if ref is not None else _opaque(value)
        if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
            ref = function_ref(value)
            return {"$function": ref} if ref is not None else _opaque(value)
        if type(value) is functools.partial:  # an activation with its options; Hugging Face's checkpoint function
            ref = function_ref(value.func)
            if ref is None or id(value) in active:
                return _opaque(value)
            active.add(id(value))
            try:
                return {"$partial": {"function": ref,
                                     "args": [enc(a, f"{path}.args.{i}" if path else f"args.{i}", depth + 1)
                                              for i, a in enumerate(value.args)],
                                     "kwargs": enc(dict(value.keywords), f"{path}.kwargs" if path else "kwargs",
                                                   depth + 1)}}
            finally:
                active.discard(id(value))
        if type(value) is np.ndarray:
            dt = value.dtype
            if dt.kind not in _NP_KINDS + "mM" or np.dtype(str(dt)) != dt:
                return _opaque(value)
            if value.size > NDARRAY_VALUES:  # (its repr is numpy's summary: what a reader says is why)
                return {"$opaque": {"type": type_ref(value), "repr": _LARGE.format(
                    value.size, str(dt).encode("ascii", "backslashreplace").decode(), list(value.shape))}}
            data = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode()
            out = {"dtype": str(dt), "shape": list(value.shape), "data": data}
            if not value.flags.c_contiguous:  # (1.17) its layout: numpy's sums, torch.from_numpy depend on it
                out["strides"] = [int(s) for s in value.strides]
            return {"$ndarray": out}
        if module_doc is not None and isinstance(value, torch.nn.Module) and id(value) not in active:
            return module(value, path, depth)  # (only reached by values no branch above took: free for the rest)
        if id(value) in active or not (isinstance(value, (list, tuple, dict, set, frozenset, slice)) or (
                dataclasses.is_dataclass(value) and not isinstance(value, type)) or _plain_object(value)):
            return _opaque(value)  # unsupported, or a reference cycle
        if bounded and isinstance(value, (list, tuple, dict, set, frozenset)):
            # (a replay memory of 20,000 transitions took 2 s to encode at every call: training 4,000 times slower)
            items = len(value)
            spent[0] += items
            if items > CONTAINER_ITEMS or spent[0] > ENCODED_ITEMS:
                kind = type(value).__name__.encode("ascii", "backslashreplace").decode()
                past = f" past the first {ENCODED_ITEMS} encoded" if items <= CONTAINER_ITEMS else ""
                return {"$opaque": {"type": type_ref(value), "repr": _MANY.format(kind, items, past)}}
        active.add(id(value))
        try:
            return container(value, path, depth + 1)
        finally:
            active.discard(id(value))

    def module(value: torch.nn.Module, path: str, depth: int) -> Any:
        skel = module_doc(value)  # type: ignore[misc]
        if not isinstance(skel, dict):
            return _opaque(value)
        active.add(id(value))
        try:
            state = {}
            for kind, named in (("params", value.named_parameters()), ("buffers", value.named_buffers())):
                state[kind] = {n: enc(t, f"{path}.{n}" if path else n, depth + 1) for n, t in named}
            return {"$module": {"skeleton": skel, **state}}
        finally:
            active.discard(id(value))

    def container(value: Any, path: str, depth: int) -> Any:
        def sub(key: Any, item: Any) -> Any:
            part = str(key) if type(key) in (str, int) else _opaque(key)["$opaque"]["repr"]
            return enc(item, f"{path}.{part}" if path else part, depth)

        if isinstance(value, slice):
            return {"$slice": [sub(i, v) for i, v in enumerate((value.start, value.stop, value.step))]}
        if isinstance(value, list):
            return [sub(i, v) for i, v in enumerate(list.__iter__(value))]
        if isinstance(value, tuple):
            names = getattr(type(value), "_fields", None)
            if isinstance(names, tuple) and all(type(n) is str for n in names):
                fields = {n: sub(n, v) for n, v in zip(names, tuple.__iter__(value), strict=False)}
                return {"$namedtuple": {"type": type_ref(value), "fields": fields}}
            return {"$tuple": [sub(i, v) for i, v in enumerate(tuple.__iter__(value))]}
        if isinstance(value, dict):
            pairs = list(dict.items(value))
            if type(value) is not dict and _mapping_class(type(value)):
                mapping = _mapping(value, pairs, sub)
                if mapping is not None:
                    return mapping
            if all(type(k) is str and k[:1] != "$" and not _SURROGATE.search(k) for k, _ in pairs):
                return {k: sub(k, v) for k, v in pairs}
            texts = {k for k, _ in pairs if type(k) is str}
            return {"$dict": [[sub(k, k), sub(int_key_part(k) if shadowed(k, texts) else k, v)] for k, v in pairs]}
        if isinstance(value, (set, frozenset)):  # sorted by JSON text (as UTF-8, same order): deterministic
            items = sorted((sub(i, v) for i, v in enumerate(value)), key=dumps)
            return {"$frozenset" if isinstance(value, frozenset) else "$set": items}
        if dataclasses.is_dataclass(value):
            init = [f.name for f in dataclasses.fields(value) if f.init]
            out = {"type": type_ref(value), "fields": {n: sub(n, getattr(value, n)) for n in init}}
            state = getattr(value, "__dict__", None)
            extra = [k for k in state if k not in init] if isinstance(state, dict) else []
            if extra:  # set after __init__ (Hugging Face configs keep their attention implementation so)
                if not all(type(k) is str and not _SURROGATE.search(k) for k in extra):
                    return _opaque(value)
                out["attrs"] = {k: sub(k, state[k]) for k in extra}
            return {"$dataclass": out}
        state = _state(value)
        if not all(type(n) is str and not _SURROGATE.search(n) for n in state):
            return _opaque(value)
        return {"$object": {"type": type_ref(value), "fields": {n: sub(n, v) for n, v in list(state.items())}}}

    try:
        return enc(value, "", 0)
    finally:
        # The three call one another through their closures: a reference cycle, which would keep ``tensor_name``
        # (the recorder's, holding the step's call: its module, its tensors) alive until a garbage collection.
        enc = leaf = container = module = None  # type: ignore[assignment]


# Where torch's tensor math lives: the functions a module may keep as an attribute (an activation).
_MATH_MODULES = frozenset(("torch", "torch.nn.functional", "torch._C._nn", "torch.special", "torch.fft",
                           "torch.linalg", "torch._C._special", "torch._C._fft", "torch._C._linalg"))
# Other functions of torch's that a module may keep: activation checkpointing's (Hugging Face's layers hold
# it as functools.partial(checkpoint, use_reentrant=...)), which calls only the function it is given; flex
# attention's mask that masks nothing (a BlockMask's mask_mod where none was given).
_ALSO_CALLABLE = frozenset(("torch.utils.checkpoint:checkpoint", "torch.nn.attention.flex_attention:noop_mask"))


def _callable_by_ref(ref: str) -> bool:
    """May a decoded ``$function`` be looked up by its reference alone? Only torch's tensor math (an
    activation a module keeps, ``F.gelu``), never ``torch.load`` and the like; a paper step is
    looked up as the replay finds code, and nothing else a recording names is ever called."""
    if ref in _ALSO_CALLABLE:
        return True
    module, _, name = ref.partition(":")
    return (module in _MATH_MODULES and name.isidentifier() and not name.startswith("_")  # no dotted path out
            and not name.startswith(("load", "save", "hub", "compile", "set_", "use_")))


def may_construct(cls: type) -> bool:
    """May a replay hand a class a recording names (``$class``) to the code it runs, which may call it
    (an observer class a FakeQuantize constructs)? torch's modules (an nn.Module subclass, torch.ao's
    observers) and the training code's own classes: not the standard library's nor another installed
    package's, so that a recording from elsewhere cannot hand a constructor subprocess.Popen."""
    module = str(getattr(cls, "__module__", "") or "")
    if module.partition(".")[0] == "torch":
        return issubclass(cls, torch.nn.Module) or module.startswith("torch.ao.")
    return user_code(module)


def may_bind(obj: Any) -> bool:
    """May a replay bind a module-level name of the training code to this class or function, which the
    step's code then calls? A class as ``may_construct`` says; a function of torch's tensor math (F.gelu,
    as a recorded attribute's) or of the training code (not os.system, torch.load or another installed
    package's function)."""
    if isinstance(obj, type):
        return may_construct(obj)
    module = str(getattr(obj, "__module__", "") or "")
    if module.partition(".")[0] == "torch":
        return function_ref(obj) is not None
    return user_code(module)


def _training_function(fn: Any, ref: str) -> bool:
    """A function defined at module level in the training code (the script, ``__main__``, as a replay
    loads it; a module of the project), under the name ``ref`` gives: not another function bound to
    that name there (``from os import system``), not an installed package's."""
    module = getattr(fn, "__module__", None)
    return isinstance(fn, types.FunctionType) and isinstance(module, str) and \
        f"{module}:{getattr(fn, '__qualname__', None)}" == ref and (module == "__main__" or user_code(module))


def user_code(module: str) -> bool:
    """Whether a loaded module is the training code's: a file outside the installed packages (site- or
    dist-packages) and the standard library (a script, a project on the path, an editable install)."""
    if module.partition(".")[0] in sys.stdlib_module_names or module == "builtins":
        return False
    file = getattr(sys.modules.get(module), "__file__", None)
    if not isinstance(file, str):
        return False
    path = os.path.normpath(os.path.abspath(file))
    parts = path.split(os.sep)
    stdlib = os.path.normpath(sysconfig.get_paths()["stdlib"])
    return "site-packages" not in parts and "dist-packages" not in parts and not path.startswith(stdlib + os.sep)


def _is_torch_function(fn: Any, ref: str) -> bool:
    """A function (not a class, module or method of another object) defined in torch's math modules,
    or one of ``_ALSO_CALLABLE`` where ``ref`` names it."""
    return isinstance(fn, (types.FunctionType, types.BuiltinFunctionType)) and (
        getattr(fn, "__module__", None) in _MATH_MODULES
        or (ref in _ALSO_CALLABLE and f"{fn.__module__}:{fn.__qualname__}" == ref))


def function_ref(fn: Any) -> str | None:
    """``"module:QualName"`` of a function that importing that name gives back: one of torch's
    (``torch.nn.functional:relu``, ``torch._C._nn:gelu``, ``torch:tanh``), a paper step, or a
    module-level function of the training code (``__main__:causal``, a flex_attention BlockMask's
    mask_mod, an activation passed as an argument); else None (a lambda, a function defined inside
    another, an installed package's)."""
    module = getattr(fn, "__module__", None)
    if not isinstance(module, str):
        return None
    step = getattr(fn, "__pdbg_step__", None) is not None
    own = isinstance(fn, types.FunctionType) and (module == "__main__" or user_code(module))
    for name in (getattr(fn, "__qualname__", None), getattr(fn, "__name__", None)):
        ref = f"{module}:{name}"
        if isinstance(name, str) and "<" not in name and (step or own or _callable_by_ref(ref)):
            try:
                if import_ref(ref) is fn:
                    return ref
            except (ImportError, AttributeError):
                continue
    return None


def class_ref(cls: type) -> str | None:
    """``"module:QualName"`` of a class that importing that name gives back, else None (a class
    defined inside a function, or one no longer reachable by its name)."""
    ref = type_ref(cls)
    if "<" in ref:
        return None
    try:
        return ref if import_ref(ref) is cls else None
    except (ImportError, AttributeError, ValueError):
        return None


def walk(doc: Any) -> Iterator[Any]:
    """Every value in an encoded document, the document itself first, depth first (objects' values
    and arrays' items; keys are not values)."""
    stack = [doc]
    while stack:
        value = stack.pop()
        yield value
        if isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, list):
            stack.extend(reversed(value))


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """A number of an encoded document (not a tensor) holding NaN or Inf: where (``"args.5"``), what
    (``"numpy float64[4]"``, ``"float"``) and how many of its values are NaN and Inf."""
    path: str
    kind: str
    nan: int
    inf: int
    size: int = 1

    def counts(self) -> str:
        """'1 NaN of 4'."""
        counts = ", ".join(f"{n} {w}" for n, w in ((self.nan, "NaN"), (self.inf, "Inf")) if n)
        return f"{counts}{f' of {self.size}' if self.size > 1 else ''}"

    def text(self) -> str:
        """'args.5 (numpy float64[4], 1 NaN of 4)'."""
        return f"{self.path} ({self.kind}, {self.counts()})"


def _float_tag(value: Any) -> tuple[int, int] | None:
    """(NaN, Inf) of an encoded float: ``{"$float": "nan"}``; None for a finite one."""
    if isinstance(value, dict) and len(value) == 1 and isinstance(value.get("$float"), str):
        return (1, 0) if value["$float"] == "nan" else (0, 1)
    return None


def nonfinite(doc: Any, path: str = "") -> list[NonFinite]:
    """The numbers of an encoded document (``encode``'s: floats, numpy scalars and arrays, complex
    numbers, inside any container) that hold NaN or Inf, with their paths below ``path``. Cheap where
    there are none: a float is finite unless tagged ``$float``, and only float and complex ``$ndarray``
    data are decoded (4,096 values at most)."""
    found: list[NonFinite] = []
    _nonfinite_into(doc, path, found)
    return found


def _nonfinite_into(value: Any, where: str, found: list[NonFinite]) -> None:
    """``nonfinite``'s walk: what ``value``, at ``where``, holds, put in ``found``."""
    if isinstance(value, list):
        for i, v in enumerate(value):
            _nonfinite_into(v, f"{where}.{i}" if where else str(i), found)
        return
    if not isinstance(value, dict):
        return
    tag = next(iter(value)) if len(value) == 1 else None
    if tag is None or not tag.startswith("$"):
        for k, v in value.items():
            _nonfinite_into(v, f"{where}.{k}" if where else str(k), found)
        return
    payload = value[tag]
    counted = _float_tag(value)
    if counted is not None:
        found.append(NonFinite(where, "float", *counted))
    elif tag == "$complex" and isinstance(payload, list):
        parts = [c for c in map(_float_tag, payload) if c is not None]
        if parts:
            found.append(NonFinite(where, "complex", int(any(c[0] for c in parts)),
                                   int(not any(c[0] for c in parts))))
    elif tag == "$npscalar" and isinstance(payload, dict):
        inner = nonfinite(payload.get("value"), where)
        found.extend(dataclasses.replace(f, kind=f"numpy {payload.get('dtype')}") for f in inner)
    elif tag == "$ndarray" and isinstance(payload, dict):
        try:
            dt = np.dtype(payload["dtype"])
            if dt.kind not in "fc":
                return
            data = np.frombuffer(base64.b64decode(payload["data"]), dtype=dt)
            nan = int(np.isnan(data).sum())
            inf = int(np.isinf(data).sum())
        except (KeyError, TypeError, ValueError):
            return
        if nan or inf:
            shape = ", ".join(str(d) for d in payload.get("shape", []))
            found.append(NonFinite(where, f"numpy {dt}[{shape}]", nan, inf, int(data.size)))
    elif tag in ("$tuple", "$list", "$set", "$frozenset", "$slice"):
        _nonfinite_into(payload, where, found)
    elif tag in ("$namedtuple", "$dataclass", "$object", "$mapping") and isinstance(payload, dict):
        for part in ("fields", "attrs"):
            if isinstance(payload.get(part), dict):
                _nonfinite_into(payload[part], where, found)
        for pair in payload.get("items") or []:
            if isinstance(pair, list) and len(pair) == 2:
                _nonfinite_into(pair[1], f"{where}.{pair[0]}" if where else str(pair[0]), found)
    elif tag == "$dict" and isinstance(payload, list):
        texts = {pair[0] for pair in payload if isinstance(pair, list) and len(pair) == 2 and type(pair[0]) is str}
        for pair in payload:
            if isinstance(pair, list) and len(pair) == 2:
                key = int_key_part(pair[0]) if shadowed(pair[0], texts) else pair[0]
                _nonfinite_into(pair[1], f"{where}.{key}" if where else str(key), found)
    elif tag == "$partial" and isinstance(payload, dict):
        _nonfinite_into(payload.get("args"), f"{where}.args" if where else "args", found)
        _nonfinite_into(payload.get("kwargs"), f"{where}.kwargs" if where else "kwargs", found)


def first_opaque(doc: Any, path: str = "") -> tuple[str, Opaque] | None:
    """The first value of an encoded document that could not be encoded (``$opaque``), with its path
    below ``path`` ("args.1.mask_mod": a field of an object, an item of a container), or None."""
    def at(key: Any) -> str:
        return f"{path}.{key}" if path else str(key)

    if isinstance(doc, list):
        return next((f for f in (first_opaque(v, at(i)) for i, v in enumerate(doc)) if f is not None), None)
    if not isinstance(doc, dict):
        return None
    tag = next(iter(doc)) if len(doc) == 1 else None
    if tag is None or not str(tag).startswith("$"):
        return next((f for f in (first_opaque(v, at(k)) for k, v in doc.items()) if f is not None), None)
    payload = doc[tag]
    if tag == "$opaque":
        return (path, Opaque(str(payload.get("type")), str(payload.get("repr")))) if isinstance(payload, dict) else None
    if tag in ("$tuple", "$set", "$frozenset", "$slice"):
        return first_opaque(payload, path)
    pairs: list[Any] = []
    if tag in ("$namedtuple", "$dataclass", "$object") and isinstance(payload, dict):
        pairs = [(k, v) for part in ("fields", "attrs") if isinstance(payload.get(part), dict)
                 for k, v in payload[part].items()]
    elif tag in ("$mapping", "$dict"):
        items = payload.get("items") if isinstance(payload, dict) else payload
        pairs = [tuple(p) for p in items or () if isinstance(p, list) and len(p) == 2 and isinstance(p[0], (str, int))]
    elif tag == "$partial" and isinstance(payload, dict):
        pairs = [("args", payload.get("args")), ("kwargs", payload.get("kwargs"))]
    return next((f for f in (first_opaque(v, at(k)) for k, v in pairs) if f is not None), None)


def _fail(message: str) -> NoReturn:
    raise FormatError(f"malformed argument document: {message}; the recording is damaged")


def _expect(payload: Any, kind: type | tuple, tag: str, size: int | None = None) -> Any:
    if not isinstance(payload, kind) or (kind in (_INTS, _NUMBERS) and isinstance(payload, bool)):
        _fail(f"{tag} payload {payload!r:.60} has the wrong type")
    if size is not None and len(payload) != size:
        _fail(f"{tag} payload must have {size} entries, not {len(payload)}")
    return payload


def _keys(payload: Any, tag: str, *keys: str) -> list:
    if not isinstance(payload, dict) or set(payload) != set(keys):
        _fail(f"{tag} payload must be an object with exactly the keys {', '.join(keys)}")
    return [payload[k] for k in keys]


def _unb64(payload: Any, tag: str) -> bytes:
    return base64.b64decode(_expect(payload, str, tag), validate=True)


Resolver = Callable[[str], Any]
ModuleMaker = Callable[[dict, dict, dict], Any]  # (skeleton, parameters by name, buffers by name) -> module


def import_ref(ref: str) -> Any:
    """The object a ``"module:QualName"`` reference names: import the module, then getattr along the
    qualified name. Raises ImportError or AttributeError."""
    module, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Decoder:
    def __init__(self, tensor: Callable[[str], Any] | None, resolve: Resolver | None,
                 module: ModuleMaker | None = None) -> None:
        self.tensor, self.resolve, self.module_maker = tensor, resolve, module

    def dec(self, doc: Any) -> Any:
        if isinstance(doc, list):
            return [self.dec(x) for x in doc]
        if not isinstance(doc, dict):
            return doc if doc is None or isinstance(doc, (bool, int, float, str)) else _fail(
                f"{type(doc).__name__} {doc!r:.60} is not JSON data")
        if not any(isinstance(k, str) and k.startswith("$") for k in doc):
            return {_expect(k, str, "object key"): self.dec(v) for k, v in doc.items()}
        if len(doc) != 1:
            _fail(f"a tag object must have exactly one key, not {list(doc)!r:.60}")
        ((tag, payload),) = doc.items()
        handler = _TAGS.get(tag)
        if handler is None:
            raise UnknownTagError(f"malformed argument document: unknown tag {tag!r:.60} (written by a newer "
                                  "PaperDebugger? upgrade paperdebugger); the recording is damaged", str(tag))
        try:
            return handler(self, tag, payload)
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            if isinstance(exc, FormatError) or _CALLBACK_NOTE in getattr(exc, "__notes__", ()):
                raise
            _fail(f"bad {tag} payload {payload!r:.60} ({exc})")

    def items(self, payload: Any, tag: str, size: int | None = None, kind: Any = object) -> list:
        return [_expect(self.dec(x), kind, tag) for x in _expect(payload, list, tag, size)]

    def record(self, tag: str, payload: Any) -> Any:
        kind = tag[1:]
        extra: dict[str, Any] = {}
        if kind == "dataclass" and isinstance(payload, dict) and "attrs" in payload:  # (1.7)
            payload = dict(payload)
            extra = {k: self.dec(v) for k, v in _expect(payload.pop("attrs"), dict, tag).items()}
        ref, raw = _keys(payload, tag, "type", "name" if kind == "enum" else "fields")
        ref = _expect(ref, str, tag)
        fields = {"name": _expect(raw, str, tag)} if kind == "enum" else {
            k: self.dec(v) for k, v in _expect(raw, dict, tag).items()}
        try:  # only now, and only if asked to, look the type up
            cls: Any = self.resolve(ref) if self.resolve is not None else None
            cls = cls if isinstance(cls, type) else object  # os:system is no type: never called
            if kind == "enum" and issubclass(cls, enum.Enum):
                return cls[raw]
            if kind == "namedtuple" and issubclass(cls, tuple) and hasattr(cls, "_fields"):
                return cls(**fields)
            if kind == "dataclass" and dataclasses.is_dataclass(cls):
                try:
                    obj = cls(**fields)
                except Exception:  # noqa: BLE001 - __init__ refused: set the fields on a bare instance
                    obj = object.__new__(cls)
                    for name, value in fields.items():
                        object.__setattr__(obj, name, value)  # works for frozen dataclasses too
                _set_attrs(obj, extra)
                return obj
            if kind == "object" and cls is types.SimpleNamespace:
                return types.SimpleNamespace(**{k: v for k, v in fields.items() if isinstance(k, str)})
            if kind == "object" and cls is not object and _plain_class(cls):
                obj = cls.__new__(cls)
                obj.__dict__.update(fields)  # the fields only: no __init__ runs
                return obj
        except Exception:  # noqa: BLE001, S110 - unimportable, or the type changed since recording
            pass
        return Record(ref, kind, fields)

    def mapping(self, tag: str, payload: Any) -> Any:
        """A dict subclass (1.13): made by its class from its items (``cls(items)``, as EasyDict and
        addict's Dict take them) where that holds them (values of the same types), else a bare instance
        given them (through its ``__setitem__`` where that works); then its other attributes. A
        class not importable here, or no longer a dict of this kind: its items, a plain dict."""
        if not isinstance(payload, dict) or not {"type", "items"} <= set(payload) <= {"type", "items", "attrs"}:
            _fail(f"{tag} payload must be an object with the keys type, items and (optionally) attrs")
        ref = _expect(payload["type"], str, tag)
        items = dict(self.items(pair, tag, 2) for pair in _expect(payload["items"], list, tag))
        attrs = {k: self.dec(v) for k, v in _expect(payload.get("attrs", {}), dict, tag).items()}
        try:
            cls: Any = self.resolve(ref) if self.resolve is not None else None
            if not (isinstance(cls, type) and _mapping_class(cls)):
                return items
            try:
                obj = cls(items)
                if type(obj) is not cls or list(dict.keys(obj)) != list(items) or any(
                        type(dict.__getitem__(obj, k)) is not type(v) for k, v in items.items()):
                    raise TypeError("not made of its items")  # ModelOutput takes them as its first field
            except Exception:  # noqa: BLE001 - its __init__ takes something else: a bare instance given them
                obj = cls.__new__(cls)
                try:
                    for k, v in items.items():
                        obj[k] = v  # through its own __setitem__ (EasyDict's sets the attribute too)
                except Exception:  # noqa: BLE001 - one that needs what __init__ sets: the items alone
                    obj = cls.__new__(cls)
                    (collections.OrderedDict if isinstance(obj, collections.OrderedDict) else dict).update(obj, items)
            _set_attrs(obj, attrs)
            return obj
        except Exception:  # noqa: BLE001 - unimportable, or the type changed since recording
            return items

    def tensor_ref(self, tag: str, payload: Any) -> Any:
        name = _expect(payload, str, tag)
        try:
            return TensorRef(name) if self.tensor is None else self.tensor(name)
        except Exception as exc:
            exc.add_note(_CALLBACK_NOTE)  # so that it passes unchanged, not as a malformed document
            raise

    def numpy(self, tag: str, payload: Any) -> Any:
        strides = None
        if tag == "$ndarray" and isinstance(payload, dict) and "strides" in payload:  # (1.17) a layout other than C
            payload = dict(payload)
            strides = payload.pop("strides")
        name, *rest = _keys(payload, tag, "dtype", *(("value",) if tag == "$npscalar" else ("shape", "data")))
        dtype = np.dtype(_expect(name, str, tag))
        if dtype.kind not in _NP_KINDS + ("mM" if tag == "$ndarray" else ""):
            _fail(f"{tag} dtype {name!r:.60} is not allowed")
        if tag == "$npscalar":
            return dtype.type(self.dec(rest[0]))
        values = np.frombuffer(_unb64(rest[1], tag), dtype=dtype).reshape(_expect(rest[0], list, tag)).copy()
        if strides is None:
            return values
        strides = [_expect(s, _INTS, tag) for s in _expect(strides, list, tag)]
        if len(strides) != values.ndim:
            _fail(f"{tag} strides {strides!r:.60} do not match its shape {list(values.shape)!r:.60}")
        return as_strides(values, strides)

    def generator(self, tag: str, payload: Any) -> torch.Generator:
        device, state = _keys(payload, tag, "device", "state")
        made = torch.Generator(device=torch.device(_expect(device, str, tag)))
        made.set_state(torch.frombuffer(bytearray(_unb64(state, tag)), dtype=torch.uint8))
        return made

    def rng(self, tag: str, payload: Any) -> Any:
        """A numpy or Python generator object (1.23): a new one of the recorded kind in the recorded state;
        one of a kind or bit generator this version does not make, a description (a replay refuses it)."""
        from . import snapshot

        kind = _expect(_expect(payload, dict, tag).get("kind"), str, tag)
        try:
            made = snapshot.made_argument_rng(payload)
        except KeyError as exc:
            _fail(f"{tag} payload of kind {kind!r:.60} lacks {exc}")
        if made is None:
            return Opaque(kind, _UNMADE_RNG.format(snapshot.argument_rng_words(payload)))
        return made

    def function(self, tag: str, payload: Any) -> Any:
        ref = _expect(payload, str, tag)
        if self.resolve is not None:  # only when asked to import, and only what function_ref writes
            try:
                torch_own = _callable_by_ref(ref)
                # (the training code's, a paper step among them: found as the replay finds code)
                fn = import_ref(ref) if torch_own else self.resolve(ref)
                if _is_torch_function(fn, ref) if torch_own else (
                        getattr(fn, "__pdbg_step__", None) is not None or _training_function(fn, ref)):
                    return fn
            except Exception:  # noqa: BLE001, S110 - not importable here: stays a description
                pass
        return Opaque("builtins:function", ref)

    def cls(self, tag: str, payload: Any) -> Any:
        """A class (since 1.16): looked up only when asked to import, as the replay finds code, and
        only a class comes back; otherwise a ``Record`` of kind "class"."""
        ref = _expect(payload, str, tag)
        if self.resolve is not None:
            try:
                found = self.resolve(ref)
                if isinstance(found, type) and may_construct(found):
                    return found
            except Exception:  # noqa: BLE001, S110 - not importable here: stays a description
                pass
        return Record(ref, "class", {})

    def partial(self, tag: str, payload: Any) -> Any:
        ref, args, kwargs = _keys(payload, tag, "function", "args", "kwargs")
        fn = self.function("$function", ref)
        args = self.items(args, tag)
        kwargs = _expect(self.dec(kwargs), dict, tag)
        if not all(type(k) is str for k in kwargs):
            _fail(f"bad {tag} keyword {next(k for k in kwargs if type(k) is not str)!r:.60}")
        if isinstance(fn, Opaque):  # not asked to import, or not importable here: a description
            shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
            return Opaque("functools:partial", f"functools.partial({', '.join([ref, *shown])})")
        return functools.partial(fn, *args, **kwargs)

    def module(self, tag: str, payload: Any) -> Any:
        """A module given as an argument (1.30): made by the ``module`` callback from its skeleton and its
        decoded parameters and buffers; without one, a description (``Opaque``: a reader rebuilds nothing)."""
        skel, params, buffers = _keys(payload, tag, "skeleton", "params", "buffers")
        skel = _expect(skel, dict, tag)
        state = [{_expect(k, str, tag): self.dec(v) for k, v in _expect(d, dict, tag).items()}
                 for d in (params, buffers)]
        if self.module_maker is None:
            ref = str(skel.get("class", "torch.nn:Module"))
            return Opaque(ref, f"<{ref.rpartition(':')[2]} module given as an argument: a replay rebuilds it>")
        return self.module_maker(skel, state[0], state[1])

    def tensor_meta(self, tag: str, payload: Any) -> TensorMeta:
        shape, dtype, device = _keys(payload, tag, "shape", "dtype", "device")
        shape = tuple(_expect(n, _INTS, tag) for n in _expect(shape, list, tag))
        return TensorMeta(shape, _expect(dtype, str, tag), _expect(device, str, tag))


_TAGS: dict[str, Callable[[_Decoder, str, Any], Any]] = {
    "$float": lambda d, t, p: float(p) if p in ("nan", "inf", "-inf") else _fail(f"bad $float {p!r:.60}"),
    "$bigint": lambda d, t, p: int(_expect(p, str, t), 16),
    "$ustr": lambda d, t, p: _unb64(p, t).decode("utf-32-le", "surrogatepass"),
    "$tuple": lambda d, t, p: tuple(d.items(p, t)),
    "$set": lambda d, t, p: set(d.items(p, t)),
    "$frozenset": lambda d, t, p: frozenset(d.items(p, t)),
    "$dict": lambda d, t, p: dict(d.items(pair, t, 2) for pair in _expect(p, list, t)),
    **dict.fromkeys(("$namedtuple", "$dataclass", "$enum", "$object"), _Decoder.record),
    "$mapping": _Decoder.mapping,
    "$bytes": lambda d, t, p: _unb64(p, t),
    "$bytearray": lambda d, t, p: bytearray(_unb64(p, t)),
    "$complex": lambda d, t, p: complex(*d.items(p, t, 2, _NUMBERS)),
    "$slice": lambda d, t, p: slice(*d.items(p, t, 3)),
    "$ellipsis": lambda d, t, p: ... if p is None else _fail("$ellipsis payload must be null"),
    "$range": lambda d, t, p: range(*d.items(p, t, 3, _INTS)),
    "$dtype": lambda d, t, p: _DTYPES.get(_expect(p, str, t)) or _fail(f"unknown torch dtype {p!r:.60}"),
    "$qscheme": lambda d, t, p: _QSCHEMES.get(_expect(p, str, t)) or _fail(f"unknown torch qscheme {p!r:.60}"),
    "$device": lambda d, t, p: torch.device(_expect(p, str, t)),
    "$size": lambda d, t, p: torch.Size(d.items(p, t, None, _INTS)),
    "$tensor": _Decoder.tensor_ref,
    "$tensor_meta": _Decoder.tensor_meta,
    "$generator": _Decoder.generator,
    "$rng": _Decoder.rng,
    "$function": _Decoder.function,
    "$partial": _Decoder.partial,
    "$class": _Decoder.cls,
    "$module": _Decoder.module,
    "$opaque": lambda d, t, p: Opaque(*(_expect(x, str, t) for x in _keys(p, t, "type", "repr"))),
    **dict.fromkeys(("$npscalar", "$ndarray"), _Decoder.numpy),
}


def module_places(doc: Any, path: str = "") -> list[str]:
    """The places of the modules a forward step was given (``$module``, 1.30: ``args.0``, ``args.0.net``) in
    its arguments document, in its order."""
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in module_places(v, f"{path}.{i}" if path else str(i))]
    if not isinstance(doc, dict):
        return []
    if len(doc) == 1 and "$module" in doc:
        return [path]
    if len(doc) == 1 and next(iter(doc)) in ("$tuple", "$object", "$dataclass"):
        payload = doc[next(iter(doc))]
        inner = payload.get("fields") if isinstance(payload, dict) else payload
        return module_places(inner, path)
    if any(isinstance(k, str) and k.startswith("$") for k in doc):
        return []
    return [p for k, v in doc.items() for p in module_places(v, f"{path}.{k}" if path else str(k))]


def given_networks(doc: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The parameters requiring grad of the networks a call was given (``$module`` places of its recorded arguments
    ``doc``, found in its live ``args`` and ``kwargs``), each with the name of its record (``args.1.0.weight``):
    the names its backward step's ``network_grad`` records have (1.31). A place not found alive is left out."""
    out: list[tuple[str, torch.Tensor]] = []
    if not isinstance(doc, dict):
        return out
    live = {"args": list(args), "kwargs": kwargs}
    for place in module_places(doc):
        recorded, value = _at(doc, place), _at(live, place)
        if not isinstance(value, torch.nn.Module) or not isinstance(recorded, dict):
            continue
        names = (recorded.get("$module") or {}).get("params") or {}
        for n, p in value.named_parameters():
            ref = names.get(n)
            if p.requires_grad and isinstance(ref, dict) and isinstance(ref.get("$tensor"), str):
                out.append((ref["$tensor"], p))
    return out


def _at(value: Any, place: str) -> Any:
    """What lies at a place of ``module_places`` (``args.0.net``) in arguments, live or their document."""
    for part in place.split("."):
        if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in ("$tuple", "$object", "$dataclass"):
            payload = value[next(iter(value))]
            value = payload.get("fields") if isinstance(payload, dict) else payload
        if isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict):
            value = value.get(part, value.get(int(part)) if part.lstrip("-").isdigit() else None)
        else:
            value = getattr(value, part, None)
    return value


def as_strides(values: np.ndarray, strides: list[int]) -> np.ndarray:
    """``values`` (C-contiguous) laid out with ``strides`` (bytes, as ``ndarray.strides``): a view with
    these strides over memory of its own, as a transposed, reversed or sliced array was recorded, so that
    what depends on the layout (numpy's summation order, ``torch.from_numpy`` refusing negative strides)
    does as it did. Where that memory would be too large (a recorded stride past the others), the same
    order of dimensions and directions without the gaps."""
    if values.size <= 1 or list(values.strides) == list(strides):
        return values
    shape, item = values.shape, values.itemsize
    span = item + sum((n - 1) * abs(s) for n, s in zip(shape, strides, strict=True))
    if span <= max(_NDARRAY_SPAN, values.nbytes):
        start = sum((n - 1) * -s for n, s in zip(shape, strides, strict=True) if s < 0)
        memory = np.zeros(span, dtype=np.uint8)
        out = np.lib.stride_tricks.as_strided(memory[start:start + item].view(values.dtype), shape, strides)
        out[...] = values
        return out
    order = sorted(range(values.ndim), key=lambda d: -abs(strides[d]))  # outermost first, as they were in memory
    flip = tuple(slice(None, None, -1) if s < 0 else slice(None) for s in strides)
    return np.ascontiguousarray(values[flip].transpose(order)).transpose(np.argsort(order))[flip]


def _set_attrs(obj: Any, attrs: dict[str, Any]) -> None:
    """A decoded dataclass's attributes beyond its fields, as they were when recorded, whatever its
    ``__init__`` made of them: written into its ``__dict__`` (no setter of the class runs), never
    over a name the class defines (a property, a method); one that could not be recorded (a lock)
    is left as ``__init__`` made it, when it made one."""
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return
    for name, value in attrs.items():
        if hasattr(type(obj), name) or (isinstance(value, (Opaque, Record)) and name in state):
            continue
        state[name] = value


def plain_instance(value: Any) -> bool:
    """Whether ``value`` is an instance of a class a ``$object`` decodes to (its state: its ``__dict__``)."""
    return not isinstance(value, type) and _plain_class(type(value)) and isinstance(getattr(value, "__dict__", None),
                                                                                   dict)


def _plain_class(cls: type) -> bool:
    return type(cls) is type and not issubclass(cls, _NOT_PLAIN) and all(
        c.__flags__ & _HEAPTYPE for c in cls.__mro__[:-1] if c not in _STATELESS_BASES) and \
        cls.__new__ is object.__new__


def decode(doc: Any, *, tensor: Callable[[str], Any] | None = None, import_types: bool = False,
           resolve: Resolver | None = None, module: ModuleMaker | None = None) -> Any:
    """Inverse of :func:`encode`; raises FormatError (a ValueError) for a malformed document.

    Args:
        doc: data produced by :func:`encode` (or read back by :func:`loads`).
        tensor: ``callable(name) -> Any`` for ``{"$tensor": name}`` (its errors pass); default TensorRef.
        import_types: import dataclass/namedtuple/enum/object/mapping types and ``$class`` classes (importlib,
            then getattr along the qualname) and rebuild the values. Otherwise, or when that fails, nothing is called:
            Records come back. Plain objects get their fields set on a bare instance (no ``__init__``).
        resolve: ``callable("module:QualName") -> type`` used instead of importing (implies import_types).
        module: ``callable(skeleton, params, buffers) -> nn.Module`` for ``$module`` (1.30), given the decoded
            parameters and buffers by name; default: an ``Opaque`` describing it.
    """
    if resolve is None and import_types:
        resolve = import_ref
    try:
        return _Decoder(tensor, resolve, module).dec(doc)
    except RecursionError:  # a document nested deeper than any value a step is given
        raise FormatError("a document is nested too deeply to decode; the recording is damaged") from None


def dumps(doc: Any) -> bytes:
    """Serialize an encoded document as compact, strict (no NaN/Infinity) UTF-8 JSON, its keys in order.

    Args:
        doc: the output of :func:`encode`.
    """
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return text.encode("utf-8")


def loads(data: bytes) -> Any:
    """Parse JSON written by :func:`dumps`; NaN/Infinity tokens and bad UTF-8 raise ValueError.

    Args:
        data: UTF-8 JSON bytes (a ``str`` is accepted too).
    """
    text = data if isinstance(data, str) else bytes(data).decode("utf-8")
    return json.loads(text, parse_constant=lambda token: _fail(f"non-standard JSON constant {token}"))
