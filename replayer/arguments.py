"""A step's arguments that could not be recorded as data (``$opaque`` values: a Hugging Face KV cache,
an object of a class the encoder does not take apart), named as the user wrote them: what bisect must
not call finite, and what a replay refusal names."""

from __future__ import annotations

import ast
import math
import textwrap
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from recorder import jsonval
from recorder.payload import dtype_from_name
from recorder.store import layout
from recorder.store.reader import TensorRecord

from .compare import tensors_by_name
from .recording import Step


@dataclass(frozen=True)
class Unrecorded:
    """One argument of a step that holds a value not recorded as data."""

    path: str  # where it is in the arguments document: "args.1", "kwargs.cache"
    name: str  # the parameter's name where the step's recorded source tells it ("past_key_values"), else ``path``
    type: str  # the argument's own type: "transformers.cache_utils:DynamicCache"
    inner: str  # where inside it the part that was not recorded is ("its layers: DynamicLayer objects"), or ""
    function: str = ""  # a function not recorded, by its qualified name: "the lambda __main__:<lambda>"

    def kind(self) -> str:
        """The argument's type in words: "a transformers DynamicCache", "a tensor", or the function it is
        ("the function __main__:main.<locals>.causal")."""
        return self.function or type_words(self.type)

    def text(self) -> str:
        """"past_key_values (a transformers DynamicCache)"."""
        return f"{self.name} ({self.kind()})"


def type_words(ref: str) -> str:
    """A type reference in words, with its article: "transformers.cache_utils:DynamicCache" is "a
    transformers DynamicCache", "builtins:list" "a list", "__main__:Box" (the script's) "a Box"."""
    module, _, name = ref.rpartition(":")
    top = module.partition(".")[0]
    return _article(name if top in ("", "builtins", "__main__") else f"{top} {name}")


def _article(words: str) -> str:
    return f"{'an' if words[:1].lower() in ('a', 'e', 'i', 'o', 'u') else 'a'} {words}"


def unrecorded_arguments(step: Step) -> list[Unrecorded]:
    """The arguments of a forward step that hold a value not recorded as data (an ``$opaque`` value, a
    tensor recorded by its metadata alone), in the order of the arguments document."""
    if step.phase != "forward":
        return []
    try:
        doc = step.arguments
    except Exception:  # noqa: BLE001 - a damaged document: nothing is said of it
        return []
    if not isinstance(doc, dict):
        return []
    tops: list[tuple[str, Any]] = []
    if isinstance(doc.get("args"), list):
        tops += [(f"args.{i}", v) for i, v in enumerate(doc["args"])]
    if isinstance(doc.get("kwargs"), dict):
        tops += [(f"kwargs.{k}", v) for k, v in doc["kwargs"].items()]
    names: dict[str, str] | None = None
    out = []
    for path, value in tops:
        found = list(_leaves(value, ""))
        if not found:
            continue
        if names is None:
            names = _parameter_names(step, len(doc.get("args") or []))
        inner, function = "", ""
        if found[0][0]:  # inside the argument: say which part, and what it held
            first = found[0][0].split(".")[0]
            kinds = list(dict.fromkeys(_short(t) for p, t, _ in found if p.split(".")[0] == first))
            count = sum(1 for p, _, _ in found if p.split(".")[0] == first)
            what = f"{', '.join(kinds)} objects" if count > 1 else _named(found[0][1], found[0][2])
            inner = f"its {first}: {what}"
        else:  # the argument itself: a function is named by its qualified name
            function = _named(found[0][1], found[0][2]) if found[0][1] == "builtins:function" else ""
        name = names.get(path) or (path.removeprefix("kwargs.") if path.startswith("kwargs.") else path)
        out.append(Unrecorded(path, name, _own_type(value), inner, function))
    return out


def module_arguments(doc: Any) -> list[str]:
    """The places of the modules a forward step was given (``$module``, 1.30: ``args.0``, ``args.0.net``) in
    its arguments document, in its order."""
    return jsonval.module_places(doc)


def network_records(doc: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The parameters requiring grad of the networks a call was given, with their record names (1.31): see
    ``jsonval.given_networks``."""
    return jsonval.given_networks(doc, args, kwargs)


def unrecorded_outputs(doc: Any) -> list[str]:
    """The parts of a forward step's output document not recorded as data (``$opaque`` values: its type
    and repr alone: an object with slots or custom pickling), each with its path and type in words, and
    why where the recording says: ["output (a mypkg Handle)", "output.1 (a numpy array of 12,288 values
    ..., over the 4,096 recorded as data)"]. A replay compares them by their type alone: never as a match
    of their values."""
    out = []
    for path, ref, payload in _leaves(doc, "output", metadata=False):
        reason = None
        if isinstance(payload, dict) and isinstance(payload.get("repr"), str):
            reason = jsonval.opaque_reason(jsonval.Opaque(ref, payload["repr"]))
        out.append(f"{path} ({reason or type_words(ref)})")
    return out


_NOT_IN_GRAPH = "appears to not have been used in the graph"  # torch.autograd.grad, an input its outputs miss


def linked_outside(exc: BaseException | None, step: Step, args: Any, kwargs: Any) -> str | None:
    """Why a forward step whose replay raised ``exc`` (where the recorded call returned) cannot be replayed,
    when ``exc`` is torch.autograd.grad refusing to differentiate the step's own argument (``args``,
    ``kwargs``: the replayed call's): a gradient penalty written as ``gradient_penalty(d_out, interp)``, whose
    ``d_out = D(interp)`` was computed outside the step. The recorded call's arguments were linked by that
    graph; a replay is given them as recorded tensors, unlinked, so no replay can redo the step."""
    if not isinstance(exc, RuntimeError) or _NOT_IN_GRAPH not in str(exc):
        return None
    given = {id(t): name[2:] for name, t in tensors_by_name({"args": args, "kwargs": kwargs}, "@").items()}
    wrt = [given[id(t)] for t in _grad_inputs(exc) if id(t) in given]
    if not wrt:
        return None
    names = _parameter_names(step, len(args) if isinstance(args, (list, tuple)) else 0)

    def named(path: str) -> str:
        top = ".".join(path.split(".")[:2])
        return names.get(top, top.removeprefix("kwargs.")) + path[len(top):]

    wrt_names = ", ".join(dict.fromkeys(named(p) for p in wrt))
    others = ", ".join(dict.fromkeys(named(r.name) for r in step.records
                                     if r.role == "input" and r.requires_grad and r.name not in wrt))
    made = f"{others} computed from {wrt_names}" if others else f"what it differentiates computed from {wrt_names}"
    return (f"its arguments are linked by autograd history made outside the step, which a replay cannot rebuild: "
            f"it calls torch.autograd.grad with respect to its argument {wrt_names}, and the recorded call was given "
            f"{made} before the call (a critic's output on it, in a gradient penalty); a replay is given the recorded "
            f"tensors without that graph, and torch finds {wrt_names} unused. To replay it, make the step compute "
            f"{others or 'what it differentiates'} itself: a paper-step module holding the model (self.D = D) whose "
            f"forward takes {wrt_names} and calls it, or a function step given D and {wrt_names} that calls D itself")


def _grad_inputs(exc: BaseException) -> list[torch.Tensor]:
    """The tensors given as ``inputs`` to the torch.autograd.grad call that raised ``exc``, read from its frame."""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_name == "grad" and frame.f_globals.get("__name__") == "torch.autograd":
            inputs = frame.f_locals.get("inputs")
            if isinstance(inputs, torch.Tensor):
                return [inputs]
            return [t for t in inputs if isinstance(t, torch.Tensor)] if isinstance(inputs, (list, tuple)) else []
    return []


def data_writes_unseen(record: TensorRecord) -> bool:
    """Whether a write through ``.data`` (``p.data.add_(...)``, which leaves the version counter as it was) to the
    input a record holds goes unseen by the recorder: it keeps the bits of CPU inputs up to 1 MiB only
    (``layout.data_writes_seen``) to see one."""
    if record.role != "input" or any(d < 0 for d in record.shape):
        return False
    try:
        size = dtype_from_name(record.dtype).itemsize
    except (AttributeError, TypeError, ValueError):  # (a dtype this torch does not have)
        return False
    return not layout.data_writes_seen(record.device, math.prod(record.shape) * size)


def unseen_writes(step: Step) -> list[TensorRecord]:
    """A forward step's input records that hold no record of a change (an ``after:`` output) where a change would
    go unseen, written through ``.data`` (``data_writes_unseen``): what the call left them is not known."""
    if step.phase != "forward":
        return []
    changed = {r.name[len(layout.AFTER_PREFIX):] for r in step.records
               if r.role == "output" and r.name.startswith(layout.AFTER_PREFIX)}
    return [r for r in step.records if r.name not in changed and data_writes_unseen(r)]


def _short(ref: str) -> str:
    return ref.rpartition(":")[2] or ref


def _named(ref: str, payload: Any) -> str:
    """A value not recorded as data in words (``payload``: its ``$opaque`` payload, or None): a function by
    its qualified name, else its type with an article."""
    shown = payload.get("repr") if isinstance(payload, dict) else None
    return jsonval.function_name(jsonval.Opaque(ref, shown if isinstance(shown, str) else "")) or _article(_short(ref))


_CONTAINERS = {"$tuple": "builtins:tuple", "$list": "builtins:list", "$set": "builtins:set",
               "$frozenset": "builtins:frozenset", "$dict": "builtins:dict"}


def _own_type(doc: Any) -> str:
    """The type of an encoded value, as a type reference."""
    if isinstance(doc, list):
        return "builtins:list"
    if isinstance(doc, dict) and len(doc) == 1:
        tag, payload = next(iter(doc.items()))
        if tag in ("$opaque", "$object", "$dataclass", "$namedtuple", "$mapping") and isinstance(payload, dict):
            return str(payload.get("type"))
        if tag in ("$tensor", "$tensor_meta"):
            return "torch:Tensor"
        if tag in _CONTAINERS:
            return _CONTAINERS[tag]
    return "builtins:dict" if isinstance(doc, dict) else f"builtins:{type(doc).__name__}"


def _leaves(doc: Any, path: str, metadata: bool = True) -> Any:
    """(path below the argument, type reference, the ``$opaque`` payload or None) of each value in
    ``doc`` not recorded as data; ``metadata`` False: not a tensor recorded by its metadata alone."""
    def at(key: Any) -> str:
        return f"{path}.{key}" if path else str(key)

    if isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, at(i), metadata)
        return
    if not isinstance(doc, dict):
        return
    if len(doc) == 1:
        tag, payload = next(iter(doc.items()))
        if tag == "$opaque":
            yield path, str(payload.get("type")) if isinstance(payload, dict) else "?", payload
            return
        if tag == "$tensor_meta":
            if metadata:
                yield path, "torch:Tensor", None
            return
        if tag in ("$object", "$dataclass", "$namedtuple") and isinstance(payload, dict):
            fields = payload.get("fields")
            for k, v in (fields.items() if isinstance(fields, dict) else ()):
                yield from _leaves(v, at(k), metadata)
            attrs = payload.get("attrs")
            for k, v in (attrs.items() if isinstance(attrs, dict) else ()):
                yield from _leaves(v, at(k), metadata)
            return
        if tag in _CONTAINERS and isinstance(payload, list):
            for i, v in enumerate(payload):
                yield from _leaves(v[1] if tag == "$dict" and isinstance(v, list) and len(v) == 2 else v, at(i),
                                   metadata)
            return
        if tag == "$module" and isinstance(payload, dict):  # (1.30) its skeleton is rebuilt: its tensors alone
            for part in ("params", "buffers"):
                for k, v in (payload[part].items() if isinstance(payload.get(part), dict) else ()):
                    yield from _leaves(v, at(k), metadata)
            return
        if tag.startswith("$"):  # another tagged value ($mapping, $partial): where inside it is not said
            for v in payload.values() if isinstance(payload, dict) else payload if isinstance(payload, list) else ():
                for _, t, inner in _leaves(v, "", metadata):
                    yield path, t, inner
            return
    for k, v in doc.items():
        yield from _leaves(v, at(k), metadata)


def _parameter_names(step: Step, positional: int) -> dict[str, str]:
    """Argument path to parameter name ("args.1" to "past_key_values"), from the ``def`` of the
    step's recorded source (a module's ``forward``, less ``self``); empty where it does not tell."""
    definition = step.definition
    source = definition.get("source")
    if not isinstance(source, str):
        return {}
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError):
        return {}
    top = tree.body[0] if tree.body else None
    func: Any = None
    if isinstance(top, ast.ClassDef):
        func = next((f for f in top.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and f.name == "forward"), None)
    elif isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
        func = top
    if func is None:
        return {}
    params = [a.arg for a in func.args.posonlyargs + func.args.args]
    if isinstance(top, ast.ClassDef) and params:
        params = params[1:]  # self
    out = {f"args.{i}": p for i, p in enumerate(params[:positional])}
    if func.args.vararg is not None:
        out.update({f"args.{i}": f"*{func.args.vararg.arg}[{i - len(params)}]"
                    for i in range(len(params), positional)})
    return out
