"""Tests of recorder.jsonval: strict-JSON encoding of non-tensor call arguments."""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import importlib
import io
import json
import math
import os
import random
import struct
import typing
from typing import Any, NamedTuple

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from recorder import jsonval
from recorder.errors import FormatError
from recorder.jsonval import Opaque, Record, TensorMeta, TensorRef, decode, dumps, encode, loads, type_ref


@dataclasses.dataclass
class Point:
    x: Any
    y: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenPoint:
    x: Any
    y: Any


@dataclasses.dataclass
class Derived:
    a: Any
    total: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.a == "refuse":
            raise ValueError("refused")
        self.total = 7


class Pair(NamedTuple):
    left: Any
    right: Any


class GlobalSubPair(Pair):
    pass


class Color(enum.Enum):
    RED = 1
    GREEN = "g"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(enum.StrEnum):
    TRAIN = "train"
    EVAL = "eval"


class Thing:
    __slots__ = ()  # no __dict__: not a plain object, so opaque

    def __repr__(self) -> str:
        return "Thing()"


class BadRepr:
    __slots__ = ()

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class AttrDict(dict):
    """A config dict read by attribute, as EasyDict keeps one: every item is also an attribute, nested
    dicts become AttrDicts."""

    def __init__(self, d: dict | None = None, **kwargs: Any) -> None:
        super().__init__()
        for k, v in {**(d or {}), **kwargs}.items():
            setattr(self, k, v)

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, dict) and not isinstance(value, AttrDict):
            value = AttrDict(value)
        super().__setattr__(name, value)
        super().__setitem__(name, value)

    __setitem__ = __setattr__


class ItemAttrs(dict):
    """A config dict read by attribute through ``__getattr__`` (addict's way), with its own flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "frozen", False)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Registry(collections.OrderedDict):
    """An OrderedDict whose constructor takes something else than its items."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def roundtrip(value: Any, **kwargs: Any) -> Any:
    return decode(loads(dumps(encode(value))), import_types=True, **kwargs)


def float_same(a: float, b: float) -> bool:
    if math.isnan(a):
        return math.isnan(b)  # "$float": "nan" keeps nan-ness, not the sign/payload bits
    return struct.pack("<d", a) == struct.pack("<d", b)


def same_items(a: list, b: list) -> bool:
    """Whether the items of a and b pair up one to one under same()."""
    rest = list(b)
    for x in a:
        match = next((i for i, y in enumerate(rest) if same(x, y)), None)
        if match is None:
            return False
        rest.pop(match)
    return not rest


def same(a: Any, b: Any) -> bool:
    """Exact structural equality: same types, floats bitwise (-0.0 != 0.0), nan == nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        if a.dtype.kind in "fc" and np.isnan(a):
            return bool(np.isnan(b)) and a.dtype == b.dtype
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return float_same(a, b)
    if isinstance(a, complex):
        return float_same(a.real, b.real) and float_same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):  # dumps sorts the keys of str-keyed dicts, so compare as sets of items
        return same_items(list(a.items()), list(b.items()))
    if isinstance(a, (set, frozenset)):
        return same_items(list(a), list(b))
    if isinstance(a, slice):
        return same((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


TORCH_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
DEVICES = ["cpu", "cuda", "cuda:0", "cuda:3", "meta", "mps"]

np_scalars = st.one_of(
    st.floats(width=16).map(np.float16),
    st.floats(width=32).map(np.float32),
    st.floats().map(np.float64),
    st.integers(-128, 127).map(np.int8),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.booleans().map(np.bool_),
    st.builds(complex, st.floats(width=32), st.floats(width=32)).map(np.complex64),
    st.text(max_size=5).map(np.str_),
    st.binary(max_size=5).map(np.bytes_),
)
hashable_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(),
    st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=6),  # lone surrogates
    st.binary(),
    st.builds(complex, st.floats(), st.floats()),
    st.just(Ellipsis),
    st.builds(range, st.integers(), st.integers(), st.integers().filter(bool)),
    st.sampled_from(TORCH_DTYPES),
    st.sampled_from(DEVICES).map(torch.device),
    st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size),
    st.sampled_from([*Color, *Level, *Mode]),
    np_scalars,
)
ndarrays = hnp.arrays(
    dtype=st.one_of(hnp.scalar_dtypes(), hnp.byte_string_dtypes(), hnp.unicode_string_dtypes()),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
)
hashables = st.recursive(
    hashable_leaves,
    lambda c: st.one_of(
        st.lists(c, max_size=3).map(tuple),
        st.frozensets(c, max_size=3),
        st.builds(Pair, c, c),
        st.builds(FrozenPoint, c, c),
    ),
    max_leaves=8,
)
values = st.recursive(
    st.one_of(hashables, st.binary().map(bytearray), ndarrays),
    lambda c: st.one_of(
        st.lists(c, max_size=4),
        st.lists(c, max_size=4).map(tuple),
        st.dictionaries(st.text(), c, max_size=4),
        st.dictionaries(st.text(st.characters(categories=["Cs", "Lu"]), max_size=2), c, max_size=3),
        st.dictionaries(st.text().map(lambda s: "$" + s), c, max_size=3),
        st.dictionaries(hashables, c, max_size=3),
        st.sets(hashables, max_size=4),
        st.frozensets(hashables, max_size=4),
        st.builds(Pair, c, c),
        st.builds(Point, c, c),
        st.builds(slice, c, c, c),
    ),
    max_leaves=16,
)
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


@SETTINGS
@given(values)
def test_roundtrip_property(value: Any) -> None:
    """Every supported value survives encode -> dumps -> loads -> decode exactly."""
    assert same(roundtrip(value), value)


@SETTINGS
@given(values)
def test_reencoding_is_stable(value: Any) -> None:
    """Re-encoding a decoded value gives the same bytes (encoding is deterministic)."""
    data = dumps(encode(value))
    assert dumps(encode(decode(loads(data), import_types=True))) == data


@SETTINGS
@given(values)
def test_dumps_is_strict_json(value: Any) -> None:
    """dumps never emits NaN/Infinity tokens and its output is valid UTF-8 strict JSON."""
    doc = encode(value)
    json.dumps(doc, allow_nan=False)

    def refuse(token: str) -> None:
        raise AssertionError(f"non-standard token {token}")

    assert json.loads(dumps(doc).decode("utf-8"), parse_constant=refuse) == doc


@pytest.mark.parametrize("x", [0.0, -0.0, 1.5, 5e-324, -1.7976931348623157e308, math.inf, -math.inf,
                               math.nan])
def test_float_bits(x: float) -> None:
    """Floats, -0.0 and the non-finite values round-trip bit for bit."""
    assert float_same(roundtrip(x), x) and float_same(roundtrip([x])[0], x)
    if not math.isfinite(x):
        assert encode(x) == {"$float": {math.inf: "inf", -math.inf: "-inf"}.get(x, "nan")}


def test_tag_shapes() -> None:
    """The documented tag shapes are produced."""
    assert encode((1, [2])) == {"$tuple": [1, [2]]}
    assert encode(b"\x00\xff") == {"$bytes": "AP8="} and encode(bytearray(b"a")) == {"$bytearray": "YQ=="}
    assert encode(complex(math.nan, -0.0)) == {"$complex": [{"$float": "nan"}, -0.0]}
    assert encode(slice(1, None, 2)) == {"$slice": [1, None, 2]} and encode(...) == {"$ellipsis": None}
    assert encode(range(0, 10, 3)) == {"$range": [0, 10, 3]}
    assert encode(torch.float32) == {"$dtype": "float32"}
    assert encode(torch.device("cuda:0")) == {"$device": "cuda:0"}
    assert encode(torch.Size([2, 3])) == {"$size": [2, 3]}
    assert encode(Color.RED) == {"$enum": {"type": type_ref(Color), "name": "RED"}}
    assert encode(Level.HIGH)["$enum"]["name"] == "HIGH" and encode(Mode.TRAIN)["$enum"]["name"] == "TRAIN"
    assert encode(Pair(1, 2)) == {"$namedtuple": {"type": type_ref(Pair), "fields": {"left": 1, "right": 2}}}
    assert encode(np.float32(1.5)) == {"$npscalar": {"dtype": "float32", "value": 1.5}}
    assert encode({"b", "a", "c"}) == {"$set": ["a", "b", "c"]}
    assert encode(frozenset({3, 1})) == {"$frozenset": [1, 3]}


def test_a_generator_is_its_device_and_state() -> None:
    """Encoding reads a generator's state without moving it; decoding makes a generator in that state."""
    g = torch.Generator().manual_seed(3)
    torch.rand(5, generator=g)
    doc = encode({"g": g})
    expected = torch.rand(5, generator=g)
    made = decode(doc)["g"]
    assert isinstance(made, torch.Generator) and made is not g
    assert torch.equal(torch.rand(5, generator=made), expected)
    assert doc["g"]["$generator"]["device"] == "cpu"
    with pytest.raises(FormatError, match="bad \\$generator payload"):
        decode({"$generator": {"device": "cpu", "state": "AAAA"}})


@pytest.mark.parametrize("make", [lambda: np.random.default_rng(3), lambda: np.random.RandomState(3),
                                  lambda: np.random.Generator(np.random.MT19937(3)), lambda: np.random.Philox(3),
                                  lambda: random.Random(3)])
def test_a_numpy_or_python_generator_is_its_kind_and_state(make: Any) -> None:
    """Encoding reads a numpy or Python generator's state without drawing from it (1.23: $rng; before,
    $opaque); decoding, through strict JSON, makes a new one of its kind that draws the same numbers."""
    g = make()
    draw = (lambda r: r.random_raw(3).tolist()) if isinstance(g, np.random.BitGenerator) else (
        lambda r: [r.random() for _ in range(3)])
    draw(g)
    doc = loads(dumps(encode([g])))
    made = decode(doc)[0]
    assert type(made) is type(g) and made is not g
    assert draw(made) == draw(g)


def test_torch_math_functions_by_reference_and_nothing_else() -> None:
    """An activation a module keeps (F.relu, F.gelu, torch.tanh) is recorded by reference and comes back
    as itself when asked to import; any other function stays a description and is never looked up."""
    fns = [torch.nn.functional.relu, torch.nn.functional.gelu, torch.tanh, torch.special.expit]
    doc = encode(fns)
    assert doc[:3] == [{"$function": "torch.nn.functional:relu"}, {"$function": "torch._C._nn:gelu"},
                       {"$function": "torch:tanh"}]
    assert decode(doc, import_types=True) == fns
    assert all(isinstance(v, Opaque) for v in decode(doc))  # not asked to import: descriptions
    for fn in (os.system, print, torch.load, lambda x: x):
        assert "$opaque" in encode(fn)
    for ref in ("os:system", "builtins:eval", "torch:load", "torch.serialization:load", "torch.hub:load",
                "torch:os.system", "torch.nn.functional:torch.load", "torch:serialization.load",
                "torch:ops.load_library", "torch:Tensor", "torch:_C"):
        assert decode({"$function": ref}, import_types=True) == Opaque("builtins:function", ref)


def causal_mask(b: Any, h: Any, q: Any, k: Any) -> Any:
    """A module-level function of the training code, as a flex_attention BlockMask's mask_mod is."""
    return q >= k


def test_module_level_functions_of_the_training_code_by_reference() -> None:
    """A function of the training code passed as an argument (a BlockMask's mask_mod) was opaque, "a
    builtins:function", so every step given one was refused, while F.gelu replayed. A module-level one is
    recorded by reference and comes back as itself when asked to import; a lambda or a function defined
    inside another stays opaque, named by its qualified name; a reference to anything that is not the
    training code's own function defined under that name (the standard library's, an installed package's)
    is never called."""
    def inner(x: Any) -> Any:
        return x

    doc = encode([causal_mask, {"mask_mod": causal_mask}])
    assert doc == [{"$function": f"{__name__}:causal_mask"}, {"mask_mod": {"$function": f"{__name__}:causal_mask"}}]
    assert decode(loads(dumps(doc)), import_types=True) == [causal_mask, {"mask_mod": causal_mask}]
    described = Opaque("builtins:function", f"{__name__}:causal_mask")
    assert decode(doc) == [described, {"mask_mod": described}]  # not asked to import: descriptions
    made = decode(encode(inner))
    assert made == Opaque("builtins:function", f"<function {__name__}:test_module_level_functions_of_the_training_"
                                               "code_by_reference.<locals>.inner>")
    assert jsonval.function_name(made) == f"the function {made.repr[len('<function '):-1]}"
    assert jsonval.function_name(decode(encode(lambda x: x))).startswith(f"the lambda {__name__}:")
    assert jsonval.function_name(Opaque("builtins:function", "<function causal at 0x7f00aa>")) == "the function causal"
    from torch.nn.attention.flex_attention import noop_mask  # (a BlockMask's mask_mod where none was given)

    assert decode(encode(noop_mask), import_types=True) is noop_mask
    for ref in ("shutil:rmtree", "json:dumps", "numpy:save", f"{__name__}:encode", f"{__name__}:os.system"):
        assert decode({"$function": ref}, import_types=True) == Opaque("builtins:function", ref)


def test_qschemes_and_classes_by_name() -> None:
    """A torch.ao observer's qscheme and the observer class FakeQuantize is built with were opaque, so
    its replay lacked them: a qscheme is its name; a class that importing its reference gives back is
    that reference, looked up only when asked to import (a class only), else a description."""
    from torch.ao.quantization import MovingAverageMinMaxObserver

    values = [torch.per_tensor_affine, torch.per_channel_symmetric, MovingAverageMinMaxObserver, Point, torch.nn.ReLU]
    doc = encode(values)
    assert doc == [{"$qscheme": "per_tensor_affine"}, {"$qscheme": "per_channel_symmetric"},
                   {"$class": "torch.ao.quantization.observer:MovingAverageMinMaxObserver"},
                   {"$class": type_ref(Point)}, {"$class": "torch.nn.modules.activation:ReLU"}]
    assert decode(loads(dumps(doc)), import_types=True) == values
    assert decode(doc)[:2] == values[:2]  # a qscheme needs no import
    assert decode(doc)[2] == Record("torch.ao.quantization.observer:MovingAverageMinMaxObserver", "class", {})

    def local() -> type:
        class Local:
            pass
        return Local

    assert "$opaque" in encode(local())  # not found again by its name
    assert decode({"$class": "os:system"}, import_types=True) == Record("os:system", "class", {})  # no class
    # A class a recording from elsewhere names is handed to the code a replay runs (a constructor may call
    # it) only where it is torch's module or observer, or the training code's: not subprocess.Popen, not a
    # torch class that starts processes, not another installed package's
    for ref in ("subprocess:Popen", "multiprocessing:Process", "numpy:ndarray",
                "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler:SubprocessHandler"):
        assert decode({"$class": ref}, import_types=True) == Record(ref, "class", {}), ref
    assert decode({"$class": "no_such_module:X"}, import_types=True) == Record("no_such_module:X", "class", {})
    with pytest.raises(FormatError, match="unknown torch qscheme"):
        decode({"$qscheme": "float32"})


def test_a_partial_of_torch_math_or_checkpoint_by_reference() -> None:
    """functools.partial of a function recorded by reference (an activation with its options,
    Hugging Face's checkpoint function) is recorded with its arguments and comes back as an equal
    partial when asked to import; anything else in it stays a description, and a partial of any
    other function is opaque."""
    from torch.utils.checkpoint import checkpoint

    gelu = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    ckpt = functools.partial(checkpoint, use_reentrant=False)
    doc = encode([gelu, ckpt, functools.partial(torch.clamp, -1.0, max=math.inf)])
    assert doc[:2] == [{"$partial": {"function": "torch._C._nn:gelu", "args": [], "kwargs": {"approximate": "tanh"}}},
                       {"$partial": {"function": "torch.utils.checkpoint:checkpoint", "args": [],
                                     "kwargs": {"use_reentrant": False}}}]
    made = decode(loads(dumps(doc)), import_types=True)
    assert [(p.func, p.args, p.keywords) for p in made] == [
        (torch._C._nn.gelu, (), {"approximate": "tanh"}), (checkpoint, (), {"use_reentrant": False}),
        (torch.clamp, (-1.0,), {"max": math.inf})]
    x = torch.randn(5)
    assert torch.equal(made[0](x), gelu(x))
    assert decode(doc)[1] == Opaque("functools:partial",
                                    "functools.partial(torch.utils.checkpoint:checkpoint, use_reentrant=False)")
    for fn in (os.system, torch.load, lambda x: x, print):
        assert "$opaque" in encode(functools.partial(fn, 1))
    for ref in ("os:system", "torch:load", "builtins:eval"):
        sneaky = {"$partial": {"function": ref, "args": ["echo hi"], "kwargs": {}}}
        assert decode(sneaky, import_types=True) == Opaque("functools:partial", f"functools.partial({ref}, 'echo hi')")
    with pytest.raises(FormatError, match="bad \\$partial"):
        decode({"$partial": {"function": "torch:tanh", "args": [], "kwargs": {"$dict": [[1, 2]]}}},
               import_types=True)


def test_type_ref() -> None:
    """type_ref names a class or an instance's class as module:QualName."""
    assert type_ref(Point) == type_ref(Point(1)) == f"{__name__}:Point"
    assert type_ref(collections.OrderedDict) == "collections:OrderedDict"


def test_user_dicts_with_dollar_and_non_str_keys() -> None:
    """User dicts with "$" keys or non-str keys are not mistaken for tags and round-trip."""
    cases = [
        {"$tuple": [1, 2]},
        {"$opaque": {"type": "x", "repr": "y"}, "other": 1},
        {1: "a", (1, 2): "b", None: 3, "x": 4, 2.5: [5], frozenset({1}): 6, Color.RED: 7},
        {True: 1, "$": 2},
    ]
    for value in cases:
        assert "$dict" in encode(value)
        assert same(roundtrip(value), value)
    assert encode({"a": 1, "b": {"c": [2]}}) == {"a": 1, "b": {"c": [2]}}


def test_dict_subclasses() -> None:
    """Configs kept in dict subclasses (EasyDict's attribute access, addict's, OrderedDict) come back
    as their class, with their items in order and their own attributes; before, they decoded as plain
    dicts and a module reading ``self.cfg.lr`` could not be replayed. defaultdict stays a plain dict."""
    cfg = AttrDict(lr=0.1, model={"width": 8, "act": "gelu"}, betas=(0.9, 0.99))
    doc = encode(cfg)
    assert doc == {"$mapping": {"type": type_ref(AttrDict), "items": [
        ["lr", 0.1], ["model", {"$mapping": {"type": type_ref(AttrDict), "items": [["width", 8], ["act", "gelu"]]}}],
        ["betas", {"$tuple": [0.9, 0.99]}]]}}
    out = roundtrip(cfg)
    assert type(out) is AttrDict and out == cfg and out.lr == 0.1 and out.model.act == "gelu"
    assert type(out.model) is AttrDict and out.betas == (0.9, 0.99)

    flags = ItemAttrs(b=1, a={"x": [1, 2]})
    object.__setattr__(flags, "frozen", True)
    assert encode(flags)["$mapping"]["attrs"] == {"frozen": True}
    out = roundtrip(flags)
    assert type(out) is ItemAttrs and out.a == {"x": [1, 2]} and list(out) == ["b", "a"] and out.frozen is True
    assert list(roundtrip(AttrDict(z=1, a=2))) == ["z", "a"]  # in their order, though dumps sorts JSON objects

    ordered = collections.OrderedDict(b=1, a=2)
    out = roundtrip(ordered)
    assert type(out) is collections.OrderedDict and list(out.items()) == [("b", 1), ("a", 2)]
    registry = Registry("layers")
    registry.update({"conv": 1, 5: "five"})
    out = roundtrip(registry)  # its __init__ takes a name: a bare instance given its items and attributes
    assert type(out) is Registry and list(out.items()) == [("conv", 1), (5, "five")] and out.name == "layers"

    counts = roundtrip(collections.Counter("aab"))
    assert type(counts) is collections.Counter and counts == {"a": 2, "b": 1}
    factory = collections.defaultdict(list, {"k": [1]})  # its default factory is code: a plain dict
    assert encode(factory) == {"k": [1]} and type(roundtrip(factory)) is dict
    # not importing types, or a type that is gone: the items, as a plain dict
    assert decode(encode(cfg)) == cfg and type(decode(encode(cfg))) is dict
    gone = {"$mapping": {"type": "no_such_module:Cfg", "items": [["a", 1]], "attrs": {"b": 2}}}
    assert decode(gone, import_types=True) == {"a": 1}
    assert decode(gone, resolve=lambda ref: os.system) == {"a": 1}  # not a dict class: never called


def test_dict_order() -> None:
    """encode/decode and dumps/loads keep dict order (a MAML step's {name: fast weight}; sorted, as dumps
    once wrote them, its items came back in another order)."""
    value = {"b": 1, "a": 2}
    assert list(decode(encode(value))) == ["b", "a"] and list(roundtrip(value)) == ["b", "a"]
    value = {3: "x", 1: "y", "z": 0}
    assert list(roundtrip(value)) == [3, 1, "z"]


def test_big_ints_and_lone_surrogates() -> None:
    """Ints beyond the JSON parser's digit limit and strings with lone surrogates round-trip."""
    for n in (2**64, -(2**64), 10**5000, -(10**5000) + 1, 2**13000, 2**13001):
        assert roundtrip(n) == n and type(roundtrip(n)) is int
    for s in ("\ud83d\ude00", "a\udc80b", "\ud800", "😀"):
        assert roundtrip(s) == s and len(roundtrip(s)) == len(s)
    assert roundtrip({"\udc80": 1}) == {"\udc80": 1}


def test_all_torch_dtypes_and_devices() -> None:
    """Every torch dtype, several devices and sizes round-trip."""
    for dtype in TORCH_DTYPES:
        assert roundtrip(dtype) is dtype
    for name in DEVICES:
        assert roundtrip(torch.device(name)) == torch.device(name)
    assert roundtrip(torch.Size([])) == torch.Size([]) and type(roundtrip(torch.Size([1]))) is torch.Size


def test_numpy_values() -> None:
    """Small arrays (any layout/byte order) round-trip; big, object and structured arrays become opaque."""
    arrays = [np.arange(12, dtype=">f4").reshape(3, 4).T, np.array(3.5), np.zeros((0, 2)),
              np.array(["a\x00", "bc"]), np.array([1, 2], dtype="datetime64[ns]")]
    for arr in arrays:
        out = roundtrip(arr)
        assert same(out, arr) and out.flags.writeable
    opaque = (np.zeros(4097), np.array([object()]), np.zeros(2, dtype=[("a", "i4")]), np.ma.masked_array([1]))
    for arr in opaque:
        assert isinstance(roundtrip(arr), Opaque)
    assert isinstance(roundtrip(np.longdouble(1)), Opaque) or np.longdouble(1).dtype.itemsize <= 8
    assert str.__str__(roundtrip(np.str_("a\x00"))) == "a\x00"  # np.str_'s own str() hides the NUL
    assert bytes(roundtrip(np.bytes_(b"a\x00"))) == b"a\x00"


def test_tensor_paths() -> None:
    """tensor_name receives each tensor with its dotted path and names are stored as $tensor."""
    t = [torch.zeros(2), torch.ones(3), torch.nn.Parameter(torch.ones(1)), torch.zeros(1)]
    seen: list[tuple[Any, str]] = []

    def name(tensor: torch.Tensor, path: str) -> str:
        seen.append((tensor, path))
        return f"T{len(seen)}"

    value = {"args": [t[0], (t[1], {"mask": t[2]})], "kwargs": {"x": t[3]}}
    doc = encode(value, tensor_name=name)
    assert [(p, tensor is orig) for (tensor, p), orig in zip(seen, t, strict=True)] == [
        ("args.0", True), ("args.1.0", True), ("args.1.1.mask", True), ("kwargs.x", True)]
    assert doc["kwargs"] == {"x": {"$tensor": "T4"}}
    table = {f"T{i + 1}": tensor for i, tensor in enumerate(t)}
    out = decode(loads(dumps(doc)), tensor=table.__getitem__)
    assert out["args"][1][1]["mask"] is t[2] and out["kwargs"]["x"] is t[3]
    assert decode(doc)["args"][0] == TensorRef("T1")
    paths: list[str] = []
    encode(t[0], tensor_name=lambda _t, p: paths.append(p))
    encode(Point(x=[t[0]]), tensor_name=lambda _t, p: paths.append(p))
    assert paths == ["", "x.0"]


def test_tensor_callback_errors() -> None:
    """A raising tensor_name makes the tensor opaque; a raising tensor resolver's error passes unchanged."""

    def broken(_t: torch.Tensor, _p: str) -> str:
        raise RuntimeError("broken namer")

    doc = encode([torch.zeros(1), 2], tensor_name=broken)
    assert doc[1] == 2 and doc[0]["$opaque"]["type"] == "torch:Tensor"
    assert encode(torch.zeros(1), tensor_name=lambda _t, _p: 5)["$tensor_meta"]["shape"] == [1]

    def resolver(name: str) -> Any:
        raise ValueError(f"no tensor {name}")

    for doc in ({"$tensor": "x"}, {"$tuple": [{"$dict": [[1, {"$tensor": "x"}]]}]}):
        with pytest.raises(ValueError, match="no tensor x") as info:
            decode(doc, tensor=resolver)
        assert not isinstance(info.value, FormatError)


def test_lossy_subclasses() -> None:
    """Non-enum subclasses of int/str/list decode as the base type; namedtuple subclasses keep their type."""

    class MyInt(int):
        def __index__(self) -> int:
            raise AssertionError("user code called")

    class MyStr(str):
        pass

    class SubPair(Pair):
        pass

    out = roundtrip([MyInt(3), MyStr("s"), collections.UserList([1])])
    assert out[:2] == [3, "s"] and type(out[0]) is int and type(out[1]) is str and isinstance(out[2], Opaque)
    assert roundtrip(SubPair(1, 2)) == Record(type_ref(SubPair), "namedtuple", {"left": 1, "right": 2})
    assert type(decode(encode(GlobalSubPair(1, 2)), import_types=True)) is GlobalSubPair


def test_tensor_meta_without_name() -> None:
    """Without a callback (or when it returns None) tensors are stored as TensorMeta."""
    t = torch.zeros(2, 3, dtype=torch.float16)
    assert encode(t) == {"$tensor_meta": {"shape": [2, 3], "dtype": "float16", "device": "cpu"}}
    assert roundtrip([t]) == [TensorMeta((2, 3), "float16", "cpu")]
    assert roundtrip(t.to("meta")) == TensorMeta((2, 3), "float16", "meta")
    assert decode(encode(t, tensor_name=lambda _t, _p: None)) == TensorMeta((2, 3), "float16", "cpu")


def test_opaque_objects(tmp_path: Any) -> None:
    """Unsupported objects become Opaque with their type and a (truncated, guarded) repr."""
    with open(tmp_path / "f.txt", "w") as handle:
        cases = [lambda x: x, handle, io.BytesIO(b"x"), Thing(), type("Unreachable", (), {}), os, object()]
        for value in cases:
            out = roundtrip(value)
            shown = f"<function {__name__}:test_opaque_objects.<locals>.<lambda>>" if type(value).__name__ == \
                "function" else repr(value)[:200]  # (a function: where it was defined, no address)
            assert isinstance(out, Opaque) and out.type == type_ref(value) and out.repr == shown
    assert roundtrip(Thing()) == Opaque(f"{__name__}:Thing", "Thing()")
    assert roundtrip(BadRepr()) == Opaque(f"{__name__}:BadRepr", "<unrepresentable>")
    assert roundtrip([BadRepr()])[0].repr == "<unrepresentable>"
    long = roundtrip(type("Long", (), {"__slots__": (), "__repr__": lambda self: "x" * 1000})())
    assert long.repr == "x" * 200
    odd = roundtrip(type("Odd", (), {"__slots__": (), "__repr__": lambda self: "\udc80"})())
    assert odd.repr == "\\udc80"


class Config:
    """A plain user class (not a dataclass): recorded as its class and fields."""

    def __init__(self, width: int, names: tuple) -> None:
        self.width, self.names = width, names
        self.inner = Point(1, 2)


class Custom:
    def __init__(self) -> None:
        self.x = 1

    def __reduce__(self) -> Any:  # its state is not just its fields: not a plain object
        return (Custom, ())


def test_plain_objects() -> None:
    """A plain user object round-trips as class reference + fields, without its __init__ running;
    without importing it comes back as a Record; objects with custom pickling stay opaque."""
    cfg = Config(8, ("a", "b"))
    doc = encode(cfg)
    assert doc == {"$object": {"type": f"{__name__}:Config", "fields": {
        "width": 8, "names": {"$tuple": ["a", "b"]},
        "inner": {"$dataclass": {"type": f"{__name__}:Point", "fields": {"x": 1, "y": 2}}}}}}
    back = roundtrip(cfg)
    assert type(back) is Config and back.__dict__ == cfg.__dict__
    assert decode(doc) == Record(f"{__name__}:Config", "object", {"width": 8, "names": ("a", "b"),
                                                                 "inner": Record(f"{__name__}:Point", "dataclass",
                                                                                 {"x": 1, "y": 2})})
    seen = []
    assert decode(doc, resolve=lambda ref: seen.append(ref) or Config).width == 8 and seen[-1].endswith(":Config")
    assert isinstance(roundtrip(Custom()), Opaque)
    assert isinstance(roundtrip(torch.nn.Linear(1, 1)), Opaque)
    many = Config(1, ())
    many.__dict__.update({f"f{i}": i for i in range(100)})
    assert isinstance(roundtrip(many), Opaque)


T = typing.TypeVar("T")


class Box(typing.Generic[T]):
    """A user class deriving from Generic[T]: typing.Generic's empty __slots__ holds no state."""

    def __init__(self, item: T) -> None:
        self.item = item


class Quiet:
    __slots__ = ()  # a mixin without state


class Mixed(Quiet):
    def __init__(self) -> None:
        self.x = 1.5


class Slotted:
    __slots__ = ("hidden", "__dict__")  # a slot holding state outside its __dict__

    def __init__(self) -> None:
        self.hidden, self.shown = 1, 2


def test_generic_and_slotless_bases_leave_an_object_plain() -> None:
    """A class deriving from Generic[T] (as torch's Independent does) or from a mixin with an empty
    __slots__ was refused as data, its whole object opaque: an empty __slots__ holds no state. A slot
    that holds state still makes the object opaque."""
    box = roundtrip(Box([1, 2]))
    assert type(box) is Box and box.item == [1, 2]
    assert encode(Box(3)) == {"$object": {"type": f"{__name__}:Box", "fields": {"item": 3}}}
    mixed = roundtrip(Mixed())
    assert type(mixed) is Mixed and mixed.x == 1.5
    assert isinstance(roundtrip(Slotted()), Opaque)


def test_torch_distributions_are_recorded_as_data() -> None:
    """torch.distributions objects are data: their fields, tensors named by their paths (what the recorder
    captures as tensor records: a replay compares them, bisect sees NaN in them), their lazily cached fields
    included, as a distribution holds them. Independent (a Generic[D]) was opaque, and so was a transform
    (its __getstate__ drops the link to its inverse, a cycle: so is it here). Each comes back as it was,
    log_prob bit for bit."""
    D = torch.distributions
    torch.manual_seed(0)
    a = torch.randn(3, 3)
    mvn = D.MultivariateNormal(torch.zeros(3), covariance_matrix=a @ a.T + torch.eye(3))
    mvn.scale_tril  # noqa: B018 - a lazy_property: cached in its __dict__ when read
    ind = D.Independent(D.Normal(torch.randn(2, 3), torch.rand(2, 3) + 0.5), 1)
    flow = D.TransformedDistribution(D.Normal(torch.zeros(3), torch.ones(3)),
                                     [D.transforms.AffineTransform(1.0, 2.0), D.transforms.ExpTransform(),
                                      D.transforms.ExpTransform().inv, D.transforms.SigmoidTransform()])
    cat = D.Categorical(logits=torch.randn(2, 4), validate_args=False)
    tensors: dict[str, torch.Tensor] = {}

    def name(t: torch.Tensor, path: str) -> str:
        tensors[path] = t
        return path

    for dist in (mvn, ind, flow, cat):
        tensors.clear()
        text = dumps(encode(dist, tensor_name=name))
        assert b"$opaque" not in text, text
        back = decode(loads(text), tensor=tensors.__getitem__, import_types=True)
        assert type(back) is type(dist) and back.__dict__.keys() == dist.__dict__.keys()
        x = dist.sample((5,))
        assert torch.equal(back.log_prob(x), dist.log_prob(x))
    tensors.clear()
    encode(ind, tensor_name=name)
    assert set(tensors) == {"base_dist.loc", "base_dist.scale"}
    tensors.clear()
    encode(mvn, tensor_name=name)
    assert set(tensors) == {"covariance_matrix", "loc", "_unbroadcasted_scale_tril", "scale_tril"}
    inverse = decode(encode(flow), import_types=True).transforms[2]
    assert type(inverse._inv) is D.transforms.ExpTransform and inverse._inv._inv is None


def test_cycles_and_depth() -> None:
    """Reference cycles and over-deep nesting become opaque instead of recursing forever."""
    a: list = [1]
    a.append(a)
    assert encode(a) == [1, {"$opaque": {"type": "builtins:list", "repr": "[1, [...]]"}}]
    d: dict = {}
    d["self"] = d
    assert isinstance(roundtrip(d)["self"], Opaque)
    p = Point(1)
    p.y = [p]
    assert isinstance(roundtrip(p).y[0], Opaque)
    shared = [1]
    assert roundtrip([shared, shared]) == [[1], [1]]
    nested: list = []
    for _ in range(60):
        nested = [nested]
    out = decode(encode(nested, max_depth=5))
    for _ in range(5):
        out = out[0]
    assert isinstance(out[0], Opaque)
    for _ in range(20000):
        nested = [nested]
    assert isinstance(encode(nested, max_depth=10**9), list)  # RecursionError is contained
    assert loads(dumps(encode(nested)))


def test_dataclass_decoding() -> None:
    """Dataclasses skip init=False fields and fall back to setting fields when __init__ refuses."""
    assert encode(Derived(1))["$dataclass"]["fields"] == {"a": 1}
    assert roundtrip(Derived(1)) == Derived(1)
    doc = {"$dataclass": {"type": type_ref(Derived), "fields": {"a": "refuse"}}}
    refused = decode(doc, import_types=True)
    assert type(refused) is Derived and refused.a == "refuse"
    assert roundtrip(FrozenPoint(1, [2])) == FrozenPoint(1, [2])
    assert roundtrip(Point(x=Color.GREEN)) == Point(Color.GREEN)


def test_without_import_types_records() -> None:
    """import_types=False decodes dataclasses, namedtuples and enums as Records."""
    doc = encode([Point(1, (2,)), Pair(1, 2), Color.GREEN, {FrozenPoint(1, 2)}])
    out = decode(loads(dumps(doc)))
    assert out[0] == Record(type_ref(Point), "dataclass", {"x": 1, "y": (2,)})
    assert out[1] == Record(type_ref(Pair), "namedtuple", {"left": 1, "right": 2})
    assert out[2] == Record(type_ref(Color), "enum", {"name": "GREEN"})
    assert out[3] == {Record(type_ref(FrozenPoint), "dataclass", {"x": 1, "y": 2})}


def test_import_types_false_never_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding "os:system" without import_types imports and calls nothing."""
    calls: list[Any] = []
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(a))
    doc = {"$dataclass": {"type": "os:system", "fields": {"command": "echo hi"}}}
    assert decode(doc) == Record("os:system", "dataclass", {"command": "echo hi"})
    assert decode({"$enum": {"type": "os:system", "name": "x"}}) == Record("os:system", "enum", {"name": "x"})
    assert calls == []


def test_import_types_true_only_builds_matching_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """With import_types=True, non-types, wrong kinds and failed imports still give Records."""
    calls: list[Any] = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(a))
    cases = [
        ("dataclass", "os:system", {"command": "echo hi"}),
        ("dataclass", type_ref(Pair), {"left": 1, "right": 2}),
        ("namedtuple", type_ref(Point), {"x": 1}),
        ("namedtuple", "no_such_module_jsonval:Thing", {}),
        ("dataclass", f"{__name__}:Missing", {}),
    ]
    for kind, ref, fields in cases:
        doc = {f"${kind}": {"type": ref, "fields": fields}}
        assert decode(doc, import_types=True) == Record(ref, kind, fields)
    assert decode({"$enum": {"type": type_ref(Color), "name": "BLUE"}}, import_types=True) == Record(
        type_ref(Color), "enum", {"name": "BLUE"})
    assert calls == []


NP_LAYOUTS = {
    "transposed": lambda a: a.T,
    "reversed": lambda a: a[::-1],
    "both reversed, transposed": lambda a: a[::-1, ::-1].T,
    "columns with gaps, reversed": lambda a: a[:, ::-3],
    "a column": lambda a: a[:, 5],
    "broadcast": lambda a: np.broadcast_to(a[0], (4, 64)),
    "Fortran order": np.asfortranarray,
    "big-endian, reversed": lambda a: a.astype(">f8")[::-1],
}


@pytest.mark.parametrize("make", list(NP_LAYOUTS.values()), ids=list(NP_LAYOUTS))
def test_a_numpy_array_comes_back_in_its_layout(make: Any) -> None:
    """A transposed, reversed, sliced or broadcast numpy array decodes with its strides (numpy's sums
    follow them, torch.from_numpy refuses negative ones), its values and dtype as encoded; a
    C-contiguous one's document holds no strides, as before 1.17, and such a document decodes
    C-contiguous."""
    value = make(np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32))
    doc = encode(value)
    back = decode(loads(dumps(doc)))
    assert back.strides == value.strides and back.dtype == value.dtype and back.tobytes() == value.tobytes()
    assert back.sum(axis=0).tobytes() == value.sum(axis=0).tobytes()
    plain = {"$ndarray": {k: v for k, v in doc["$ndarray"].items() if k != "strides"}}
    assert "strides" not in encode(np.ascontiguousarray(value))["$ndarray"]
    assert decode(plain).flags.c_contiguous and decode(plain).tobytes() == value.tobytes()


def test_a_numpy_layout_too_large_to_rebuild_keeps_its_order_and_directions() -> None:
    """Strides spanning more memory than may be made again for a few values (a document's, whatever
    it says) give the same order of dimensions and directions without the gaps."""
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    doc = {"$ndarray": {**encode(value)["$ndarray"], "strides": [4, -(1 << 40)]}}
    back = decode(doc)
    assert back.strides == (4, -8) and back.tobytes() == value.tobytes()


@pytest.mark.parametrize(
    "doc",
    [
        {"$nope": 1}, {"$tuple": 3}, {"$tuple": [1], "x": 2}, {"$float": "NaN"}, {"$float": 1.0},
        {"$dict": [[1]]}, {"$dict": [[[1], 2]]}, {"$set": [[1]]}, {"$bytes": "!!"}, {"$bytes": 1},
        {"$complex": [1]}, {"$complex": ["a", 1]}, {"$slice": [1, 2]}, {"$ellipsis": 1},
        {"$range": [0, 1, 0]},
        {"$range": [0, 1.5, 1]}, {"$size": [True]}, {"$dtype": "load"}, {"$dtype": 3}, {"$device": "nope:x"},
        {"$tensor": 1}, {"$tensor_meta": {"shape": "x", "dtype": "f", "device": "cpu"}},
        {"$tensor_meta": {"shape": [1]}}, {"$opaque": {"type": "x"}}, {"$opaque": ["x", "y"]},
        {"$enum": {"type": "x", "fields": {}}}, {"$dataclass": {"type": 1, "fields": {}}},
        {"$npscalar": {"dtype": "object", "value": 1}}, {"$npscalar": {"dtype": "int8", "value": 999}},
        {"$ndarray": {"dtype": "float32", "shape": [3], "data": "AAAA"}}, {"$bigint": "0xzz"},
        {"$ustr": "AAA="}, [{"$tuple": None}], {"a": {"$nope": None}}, (1, 2), {1: 2}, object(),
        {"$mapping": {"type": "x:Y"}}, {"$mapping": {"type": "x:Y", "items": [1]}},
        {"$mapping": {"type": "x:Y", "items": {"a": 1}}}, {"$mapping": {"type": 1, "items": []}},
        {"$mapping": {"type": "x:Y", "items": [], "extra": 1}}, {"$mapping": {"type": "x:Y", "items": [], "attrs": []}},
        {"$mapping": {"type": "x:Y", "items": [[[1], 2]]}},
        {"$ndarray": {"dtype": "float32", "shape": [2], "data": "AAAAAAAAAAA=", "strides": [4, 4]}},
        {"$ndarray": {"dtype": "float32", "shape": [2], "data": "AAAAAAAAAAA=", "strides": "F"}},
        {"$ndarray": {"dtype": "float32", "shape": [2], "data": "AAAAAAAAAAA=", "strides": [4.0]}},
    ],
)
def test_malformed_docs_raise_value_error(doc: Any) -> None:
    """Malformed documents raise a ValueError (FormatError) naming the problem."""
    with pytest.raises(ValueError, match="malformed") as info:
        decode(doc)
    assert isinstance(info.value, FormatError)


def test_loads_rejects_non_standard_json() -> None:
    """loads refuses NaN/Infinity tokens and invalid JSON with a ValueError."""
    for data in (b"[NaN]", b"Infinity", b"{", b"\xff"):
        with pytest.raises(ValueError):
            loads(data)
    assert loads(dumps({"b": 1, "a": [1.5]})) == {"a": [1.5], "b": 1}
    assert dumps({"b": 1, "a": "é"}) == '{"b":1,"a":"é"}'.encode()


class _ReplayMemory:
    """A DQN's replay memory: a plain object holding its transitions in a list."""

    def __init__(self, n: int) -> None:
        self.data = [(np.zeros(4, np.float32), float(i % 3)) for i in range(n)]
        self.capacity = n


def test_a_replay_memory_passed_whole_is_not_taken_apart_at_every_call() -> None:
    """A step given a replay memory of 20,000 transitions (``sample_batch(memory, 32)``) took its list apart at every
    call: 2 s a call, training 4,000 times slower. A container of more than 4,096 items, or met after 65,536 items
    were encoded, is a placeholder that says why, and the rest of the object is data as before."""
    doc = encode({"memory": _ReplayMemory(jsonval.CONTAINER_ITEMS + 1), "k": 32}, bounded=True)
    fields = doc["memory"]["$object"]["fields"]
    assert fields["capacity"] == jsonval.CONTAINER_ITEMS + 1 and doc["k"] == 32
    assert fields["data"] == {"$opaque": {"type": "builtins:list", "repr": "<list of 4097 items>"}}
    assert jsonval.opaque_reason(decode(fields["data"])) == (
        "a list of 4,097 items, over the 4,096 items recorded as data (taking it apart at every call would slow "
        "training down: make it a tensor, or give the step only the part it uses, the sampled batch)")
    assert encode([0] * jsonval.CONTAINER_ITEMS, bounded=True) == [0] * jsonval.CONTAINER_ITEMS  # (up to it: data)
    episodes = [[1.0] * 4000 for _ in range(20)]  # 80,000 items in lists of 4,000: past the total
    out = encode(episodes, bounded=True)
    past = jsonval.ENCODED_ITEMS // 4000  # (the outer list's 20 items count too)
    assert out[:past - 1] == episodes[:past - 1]
    assert out[past] == {"$opaque": {"type": "builtins:list", "repr": "<list of 4000 items past the first 65536 "
                                                                       "encoded>"}}
    assert jsonval.opaque_reason(decode(out[past])).startswith(
        "a list of 4,000 items, met after the first 65,536 items of the value were recorded as data")
