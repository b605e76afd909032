"""Strict-JSON encoding of non-tensor call arguments and module constructor arguments (never pickle).

:func:`encode` turns any Python value into plain JSON data in which the non-JSON kinds are *tags*: dicts
with exactly one key starting with ``"$"`` (``{"$tuple": [...]}``, ``{"$float": "nan"}``, ...); user dicts
that could be mistaken for a tag are stored as ``{"$dict": [[key, value], ...]}``. :func:`decode` inverts
it. Known losses: dict subclasses (``OrderedDict``, ``defaultdict``) decode as ``dict``, list/tuple
subclasses without ``_fields`` (torch return types) as ``list``/``tuple``, non-enum int/float/str
subclasses as the base type. Two tags beyond the basic set keep exactness: ``$bigint`` (hex, for ints
too long for JSON parsers) and ``$ustr`` (strings holding lone surrogates, which JSON cannot carry).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import json
import math
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from .errors import FormatError

TensorNamer = Callable[[Any, str], str | None]
_REPR_LIMIT = 200
_NDARRAY_LIMIT = 4096
_BIGINT_BITS = 13000  # ~3900 decimal digits: below CPython's 4300-digit int/str conversion limit
_NP_KINDS = "biufcSU"
_INTS = (int,)


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
    """A dataclass/namedtuple/enum value whose type was not imported; enums have ``fields={"name": ..}``."""

    type: str
    kind: str
    fields: dict

    def __hash__(self) -> int:  # hashable (for sets and dict keys) although ``fields`` is a dict
        return hash((self.type, self.kind, tuple(self.fields)))


def _clean(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")  # escapes lone surrogates


def type_ref(obj_or_type: Any) -> str:
    """Return ``"module:QualName"`` of a class, or of the class of an instance.

    Args:
        obj_or_type: a class, or any object whose class is named.
    """
    cls = obj_or_type if isinstance(obj_or_type, type) else type(obj_or_type)
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    module = module if isinstance(module, str) else "builtins"
    return _clean(f"{module}:{qualname if isinstance(qualname, str) else '?'}")


def _repr(value: Any) -> str:
    try:
        return _clean(repr(value))[:_REPR_LIMIT]
    except Exception:  # noqa: BLE001 - a raising __repr__ must not stop the recording
        return "<unrepresentable>"


def _opaque(value: Any) -> dict:
    return {"$opaque": {"type": type_ref(value), "repr": _repr(value)}}


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _enc_int(value: int) -> Any:
    value = int.__index__(value)  # exact int, without calling a subclass's methods
    return {"$bigint": hex(value)} if value.bit_length() > _BIGINT_BITS else value


def _enc_float(value: float) -> Any:
    value = float.__float__(value)
    if math.isnan(value):
        return {"$float": "nan"}
    return {"$float": "inf" if value > 0 else "-inf"} if math.isinf(value) else value


def _text(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


class _Encoder:
    def __init__(self, tensor_name: TensorNamer | None, max_depth: int) -> None:
        self.tensor_name, self.max_depth, self.active = tensor_name, max_depth, set()

    def enc(self, value: Any, path: str, depth: int) -> Any:
        if depth > self.max_depth:
            return _opaque(value)
        try:
            return self._enc(value, path, depth)
        except Exception:  # noqa: BLE001 - encode never raises: whatever fails becomes opaque
            return _opaque(value)

    def _enc(self, value: Any, path: str, depth: int) -> Any:  # noqa: PLR0911 - one return per kind
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, enum.Enum):  # before int/str/float: IntEnum, StrEnum
            return {"$enum": {"type": type_ref(value), "name": value.name}}
        if isinstance(value, np.generic):  # before float/str/bytes: np.float64, np.str_ subclass them
            dt = value.dtype
            if dt.kind not in _NP_KINDS or (dt.kind in "fc" and dt.itemsize > (16 if dt.kind == "c" else 8)):
                return _opaque(value)  # longdouble: item() would round
            item = str.__str__(value) if dt.kind == "U" else bytes(value) if dt.kind == "S" else value.item()
            return {"$npscalar": {"dtype": str(dt), "value": self._enc(item, path, depth)}}  # item() strips NULs
        if isinstance(value, int):
            return _enc_int(value)
        if isinstance(value, float):
            return _enc_float(value)
        if isinstance(value, str):
            value = str.__str__(value)
            if _has_surrogates(value):
                return {"$ustr": _b64(value.encode("utf-32-le", "surrogatepass"))}
            return value
        if isinstance(value, complex):
            return {"$complex": [_enc_float(value.real), _enc_float(value.imag)]}
        if isinstance(value, (bytes, bytearray)):
            return {"$bytearray" if isinstance(value, bytearray) else "$bytes": _b64(bytes(value))}
        if value is Ellipsis:
            return {"$ellipsis": None}
        if isinstance(value, torch.Tensor):  # Parameter included
            name = self.tensor_name(value, path) if self.tensor_name is not None else None
            if isinstance(name, str):
                return {"$tensor": name}
            dtype = str(value.dtype).removeprefix("torch.")
            return {"$tensor_meta": {"shape": list(value.shape), "dtype": dtype, "device": str(value.device)}}
        if isinstance(value, torch.dtype):
            return {"$dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"$device": str(value)}
        if isinstance(value, torch.Size):
            return {"$size": [int(d) for d in value]}
        if isinstance(value, range):
            return {"$range": [_enc_int(x) for x in (value.start, value.stop, value.step)]}
        if type(value) is np.ndarray:
            dt = value.dtype
            if value.size > _NDARRAY_LIMIT or dt.kind not in _NP_KINDS + "mM" or np.dtype(str(dt)) != dt:
                return _opaque(value)
            data = _b64(np.ascontiguousarray(value).tobytes())
            return {"$ndarray": {"dtype": str(dt), "shape": list(value.shape), "data": data}}
        is_dataclass = dataclasses.is_dataclass(value) and not isinstance(value, type)
        if not (is_dataclass or isinstance(value, (list, tuple, dict, set, frozenset, slice))):
            return _opaque(value)
        if id(value) in self.active:
            return _opaque(value)  # a reference cycle
        self.active.add(id(value))
        try:
            return self._container(value, path, depth + 1)
        finally:
            self.active.discard(id(value))

    def _container(self, value: Any, path: str, depth: int) -> Any:
        def sub(key: Any, item: Any) -> Any:
            if type(key) in (str, int):
                part = str(key)
            else:
                part = key.name if isinstance(key, enum.Enum) else _repr(key)
            return self.enc(item, f"{path}.{part}" if path else part, depth)

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
            if all(type(k) is str and not k.startswith("$") and not _has_surrogates(k) for k, _ in pairs):
                return {k: sub(k, v) for k, v in pairs}
            return {"$dict": [[sub(k, k), sub(k, v)] for k, v in pairs]}
        if isinstance(value, (set, frozenset)):
            items = sorted((sub(i, v) for i, v in enumerate(value)), key=_text)  # deterministic order
            return {"$frozenset" if isinstance(value, frozenset) else "$set": items}
        fields = {f.name: sub(f.name, getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"$dataclass": {"type": type_ref(value), "fields": fields}}


def encode(value: Any, *, tensor_name: TensorNamer | None = None, max_depth: int = 32) -> Any:
    """Encode an arbitrary Python value into JSON-compatible data (dict/list/str/int/float/bool/None).

    Never raises: unsupported objects, reference cycles and values nested deeper than ``max_depth``
    become ``{"$opaque": {"type": "module:QualName", "repr": ...}}``. ``OrderedDict``/``defaultdict``
    are stored, and decode, as plain dicts.

    Args:
        value: the value to encode.
        tensor_name: ``callable(tensor, path) -> str | None``, called for every tensor found with its
            dot-separated path below the root (``""`` for the root itself, ``"a.0"`` for ``t`` in
            ``{"a": [t]}``). A returned name is stored as ``{"$tensor": name}``; ``None`` (or no
            callback) stores ``{"$tensor_meta": {"shape", "dtype", "device"}}``. A tensor whose
            callback raises becomes opaque.
        max_depth: nesting depth (the root is 0) beyond which values become opaque.
    """
    return _Encoder(tensor_name, max_depth).enc(value, "", 0)


def _fail(message: str) -> NoReturn:
    raise FormatError(f"malformed argument document: {message}; the recording is damaged")


def _expect(payload: Any, kind: type | tuple, tag: str, size: int | None = None) -> Any:
    if not isinstance(payload, kind) or (kind is _INTS and isinstance(payload, bool)):
        _fail(f"{tag} payload {payload!r:.60} has the wrong type")
    if size is not None and len(payload) != size:
        _fail(f"{tag} payload must have {size} entries, not {len(payload)}")
    return payload


def _keys(payload: Any, tag: str, *keys: str) -> list:
    if not isinstance(payload, dict) or set(payload) != set(keys):
        _fail(f"{tag} payload must be an object with exactly the keys {', '.join(keys)}")
    return [payload[k] for k in keys]


def _unb64(payload: Any, tag: str) -> bytes:
    text = _expect(payload, str, tag)
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        _fail(f"{tag} payload is not base64")


def _import_type(ref: str) -> type | None:
    module, _, qualname = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - an unimportable type decodes as a Record
        return None
    return obj if isinstance(obj, type) else None


class _Decoder:
    def __init__(self, tensor: Callable[[str], Any] | None, import_types: bool) -> None:
        self.tensor, self.import_types = tensor, import_types

    def dec(self, doc: Any) -> Any:
        if doc is None or isinstance(doc, (bool, int, float, str)):
            return doc
        if isinstance(doc, list):
            return [self.dec(x) for x in doc]
        if not isinstance(doc, dict) or not all(isinstance(k, str) for k in doc):
            _fail(f"{type(doc).__name__} {doc!r:.60} is not JSON data")
        if not any(k.startswith("$") for k in doc):
            return {k: self.dec(v) for k, v in doc.items()}
        if len(doc) != 1:
            _fail(f"a tag object must have exactly one key, not {sorted(doc)}")
        ((tag, payload),) = doc.items()
        return self._tag(tag, payload)

    def _list(self, payload: Any, tag: str, size: int | None = None, kind: Any = object) -> list:
        return [_expect(self.dec(x), kind, tag) for x in _expect(payload, list, tag, size)]

    def _record(self, tag: str, payload: Any) -> Any:
        kind = tag[1:]
        ref, raw = _keys(payload, tag, "type", "name" if kind == "enum" else "fields")
        _expect(ref, str, tag)
        if kind == "enum":
            fields = {"name": _expect(raw, str, tag)}
        else:
            fields = {k: self.dec(v) for k, v in _expect(raw, dict, tag).items()}
        cls = _import_type(ref) if self.import_types else None
        if kind == "enum" and cls is not None and issubclass(cls, enum.Enum) and raw in cls.__members__:
            return cls[raw]
        if kind == "namedtuple" and cls is not None and issubclass(cls, tuple) and hasattr(cls, "_fields"):
            try:
                return cls(**fields)
            except Exception:  # noqa: BLE001 - the type changed since recording: keep the data
                return Record(ref, kind, fields)
        if kind == "dataclass" and cls is not None and dataclasses.is_dataclass(cls):
            try:
                return cls(**fields)
            except Exception:  # noqa: BLE001, S110 - __init__ refused (type changed?): set fields directly
                pass
            try:
                obj = object.__new__(cls)
                for name, val in fields.items():
                    object.__setattr__(obj, name, val)  # works for frozen dataclasses too
                return obj
            except Exception:  # noqa: BLE001 - not even that: keep the data as a Record
                return Record(ref, kind, fields)
        return Record(ref, kind, fields)

    def _tag(self, tag: str, payload: Any) -> Any:  # noqa: C901, PLR0911, PLR0912 - one branch per tag
        if tag == "$float":
            if payload not in ("nan", "inf", "-inf"):
                _fail(f"$float payload must be 'nan', 'inf' or '-inf', not {payload!r:.60}")
            return float(payload)
        if tag in ("$tensor", "$dtype", "$device", "$bigint", "$ustr"):
            text = _expect(payload, str, tag)
        try:
            if tag in ("$tuple", "$set", "$frozenset"):
                return {"$tuple": tuple, "$set": set, "$frozenset": frozenset}[tag](self._list(payload, tag))
            if tag == "$dict":
                return dict(self._list(x, tag, 2) for x in _expect(payload, list, tag))
            if tag in ("$namedtuple", "$dataclass", "$enum"):
                return self._record(tag, payload)
            if tag in ("$bytes", "$bytearray"):
                return bytes(_unb64(payload, tag)) if tag == "$bytes" else bytearray(_unb64(payload, tag))
            if tag == "$complex":
                return complex(*self._list(payload, tag, 2, (int, float)))
            if tag == "$slice":
                return slice(*self._list(payload, tag, 3))
            if tag == "$ellipsis" and payload is None:
                return Ellipsis
            if tag == "$range":
                return range(*self._list(payload, tag, 3, _INTS))
            if tag == "$size":
                return torch.Size(self._list(payload, tag, None, _INTS))
            if tag == "$bigint":
                return int(text, 16)
            if tag == "$ustr":
                return _unb64(text, tag).decode("utf-32-le", "surrogatepass")
            if tag == "$dtype":
                dtype = getattr(torch, text, None)  # an attribute lookup, never a call
                return dtype if isinstance(dtype, torch.dtype) else _fail(f"unknown torch dtype {text!r:.60}")
            if tag == "$device":
                return torch.device(text)
            if tag == "$tensor":
                return self.tensor(text) if self.tensor is not None else TensorRef(text)
            if tag == "$tensor_meta":
                shape, dtype, device = _keys(payload, tag, "shape", "dtype", "device")
                shape = tuple(_expect(d, _INTS, tag) for d in _expect(shape, list, tag))
                return TensorMeta(shape, _expect(dtype, str, tag), _expect(device, str, tag))
            if tag == "$opaque":
                return Opaque(*(_expect(x, str, tag) for x in _keys(payload, tag, "type", "repr")))
            if tag == "$npscalar":
                dtype, value = _keys(payload, tag, "dtype", "value")
                return self._np_dtype(dtype, tag, _NP_KINDS).type(self.dec(value))
            if tag == "$ndarray":
                dtype, shape, data = _keys(payload, tag, "dtype", "shape", "data")
                dtype, shape = self._np_dtype(dtype, tag, _NP_KINDS + "mM"), _expect(shape, list, tag)
                return np.frombuffer(_unb64(data, tag), dtype=dtype).reshape(shape).copy()
        except FormatError:
            raise
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            _fail(f"bad {tag} payload {payload!r:.60} ({exc})")
        _fail(f"unknown tag {tag!r:.60}" if tag != "$ellipsis" else "$ellipsis payload must be null")

    @staticmethod
    def _np_dtype(name: Any, tag: str, kinds: str) -> np.dtype:
        dtype = np.dtype(_expect(name, str, tag))
        return dtype if dtype.kind in kinds else _fail(f"{tag} dtype {name!r:.60} is not allowed")


def decode(doc: Any, *, tensor: Callable[[str], Any] | None = None, import_types: bool = False) -> Any:
    """Inverse of :func:`encode`.

    Args:
        doc: data produced by :func:`encode` (or read back by :func:`loads`).
        tensor: ``callable(name) -> Any`` resolving ``{"$tensor": name}``; by default a TensorRef.
        import_types: import dataclass/namedtuple/enum types by ``module:QualName`` and rebuild the
            values. When False (the default) nothing is imported or called and a Record is returned;
            so it is when the import fails or does not yield a type of the recorded kind.

    Raises:
        FormatError: (a ValueError) on malformed documents: unknown tag, wrong payload shape, tag keys
            mixed with other keys.
    """
    return _Decoder(tensor, import_types).dec(doc)


def dumps(doc: Any) -> bytes:
    """Serialize an encoded document as compact, key-sorted, strict (no NaN/Infinity) UTF-8 JSON.

    Args:
        doc: the output of :func:`encode`.
    """
    return _text(doc).encode("utf-8")


def _reject_constant(token: str) -> NoReturn:
    _fail(f"non-standard JSON constant {token}")


def loads(data: bytes) -> Any:
    """Parse JSON written by :func:`dumps`, refusing NaN/Infinity tokens.

    Args:
        data: UTF-8 JSON bytes (a ``str`` is accepted too).
    """
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        return json.loads(text, parse_constant=_reject_constant)
    except FormatError:
        raise
    except ValueError as exc:
        _fail(f"not JSON ({exc})")
