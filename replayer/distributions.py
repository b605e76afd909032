"""torch.distributions objects a replayed step was given, made again from an edited parameter.

A distribution is recorded as its fields (``$object``), and a replay gives it back as they were:
with the fields its constructor derived from its parameters (a MultivariateNormal's
``_unbroadcasted_scale_tril``, the Cholesky factor of its ``covariance_matrix``) and those a
``lazy_property`` cached when read (``scale_tril``). An edit of a parameter alone would leave them as
recorded, and what the step computes from them (``log_prob``) unchanged. So a distribution one of
whose parameters an edit changed is made again by its constructor, from the parameters it was made
from, the edited one in place of its recorded value; a distribution holding such a one (an
``Independent``'s ``base_dist``) gets the new one, and is made again too where the new one's shapes
differ. An edit of a field the constructor derives (not a parameter) is applied to that field alone,
with a warning naming the parameters it derives from. Only torch's own distribution classes and the
training code's are made again (``jsonval.user_code``): a replay calls no other constructor a
recording names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.distributions import Distribution

from recorder import jsonval

from .intervene import InterventionError

# An __init__ parameter a distribution keeps under another name.
_KEPT_AS = {"base_distribution": "base_dist"}
_PARAMETER_OF = {v: k for k, v in _KEPT_AS.items()}


def remake(args: list[Any], kwargs: dict[str, Any], edited: dict[int, str], key: Callable[[str], str],
           notes: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """``args`` and ``kwargs`` with each distribution in them that holds an edited tensor made again
    from its parameters (see the module's docstring). ``edited``: id of each tensor an edit made ->
    its record name ("args.2.covariance_matrix"); ``key(name)``: the edit's key as the user gave it,
    for messages; ``notes`` gets the warnings."""
    if not edited:
        return args, kwargs
    done: dict[int, Any] = {}
    seen: list[Any] = []  # (what ``done`` is keyed by stays alive: no id is reused while it walks)
    active: set[int] = set()

    def walk(value: Any, where: str) -> Any:
        if id(value) in done:
            return done[id(value)]
        if id(value) in active or isinstance(value, (torch.Tensor, str, bytes, int, float, type(None))):
            return value
        active.add(id(value))
        seen.append(value)
        try:
            out = visit(value, where)
        finally:
            active.discard(id(value))
        done[id(value)] = out
        return out

    def visit(value: Any, where: str) -> Any:
        if isinstance(value, list):
            for i, item in enumerate(value):
                value[i] = walk(item, f"{where}.{i}")
            return value
        if isinstance(value, dict):
            for k in list(value):
                value[k] = walk(value[k], f"{where}.{k}")
            return value
        if type(value) is tuple:
            items = tuple(walk(item, f"{where}.{i}") for i, item in enumerate(value))
            return value if all(a is b for a, b in zip(items, value, strict=True)) else items
        state = getattr(value, "__dict__", None)
        if not isinstance(state, dict) or isinstance(value, (type, torch.nn.Module)) or \
                not jsonval.plain_instance(value):
            return value
        remade: dict[str, Any] = {}  # fields that now hold a distribution made again: name -> the old one
        for name in list(state):
            old = state[name]
            new = walk(old, f"{where}.{name}")
            if new is not old:
                state[name] = new
                if isinstance(old, Distribution):
                    remade[name] = old
        if not isinstance(value, Distribution):
            return value
        hit = [name for name, v in state.items() if isinstance(v, torch.Tensor) and id(v) in edited]
        if hit:
            return _again(value, where, hit, [key(edited[id(state[n])]) for n in hit], notes)
        reshaped = [n for n, old in remade.items() if (state[n].batch_shape, state[n].event_shape) !=
                    (old.batch_shape, old.event_shape)]
        if reshaped:  # its own shapes derive from them
            return _again(value, where, reshaped, [f"the edit of {where}.{n}" for n in reshaped], notes)
        return value

    args = [walk(a, f"args.{i}") for i, a in enumerate(args)]
    kwargs = {k: walk(v, f"kwargs.{k}") for k, v in kwargs.items()}
    return args, kwargs


def _again(dist: Distribution, where: str, fields: list[str], edits: list[str], notes: list[str]) -> Any:
    """``dist`` made again by its constructor, its fields ``fields`` (changed by ``edits``) given as the
    parameters they hold; where none of them is a parameter (a field the constructor derives), ``dist``
    as it is, and a note."""
    cls = type(dist)
    name = cls.__qualname__
    state = dist.__dict__
    params, alternatives, required = _parameters(cls)
    if params is None:
        raise InterventionError(f"{edits[0]}: {where} is {_a(name)} whose constructor's parameters cannot be read, "
                                f"so it cannot be made again from the edited {fields[0]}, and its other fields, "
                                "derived from it when it was made, would keep their recorded values")
    given = {p: v for p in params if (v := _field(dist, p)) is not _MISSING}
    edited = list(dict.fromkeys(p for p in (_parameter_of(f, params) for f in fields) if p is not None))
    if not edited:  # a field the constructor derives: edited alone
        made_from = [p for p in given if p not in alternatives or p in state]
        notes.append(f"{edits[0]}: {fields[0]} is no parameter of {where}, {_a(name)}, which derives it from "
                     f"{', '.join(made_from) or 'its parameters'} when made: edited alone, its other fields keep "
                     "their recorded values (edit a parameter to have the distribution made again from it)")
        return dist
    module = str(getattr(cls, "__module__", "") or "")
    if not (module.startswith("torch.distributions.") or jsonval.user_code(module)):
        raise InterventionError(f"{edits[0]}: {where} is {_a(name)} ({module}), which a replay does not make again "
                                "from its parameters (only torch's distributions and the training code's), and which "
                                f"derived its other fields from {edited[0]} when it was made: they would keep their "
                                "recorded values; edit the tensors it was made from, before the step")
    # of the alternatives (a MultivariateNormal is made from one of covariance_matrix, precision_matrix,
    # scale_tril): the edited one, else the one it was made from, the first its constructor set
    chosen = [p for p in alternatives if p in edited] or [p for p in state if p in alternatives][:1] or \
        [p for p in alternatives if given.get(p) is not None][:1]
    call = {p: v for p, v in given.items() if p not in alternatives or p in chosen}
    absent = [p for p in required if p not in call]
    if absent:
        raise InterventionError(f"{edits[0]}: {where}, {_a(name)}, does not hold {', '.join(absent)}, which its "
                                f"constructor takes, so it cannot be made again from the edited {edited[0]}; its "
                                "other fields, derived from it when it was made, would keep their recorded values")
    if "_validate_args" in state:
        call["validate_args"] = state["_validate_args"]
    try:
        return cls(**call)
    except Exception as exc:  # noqa: BLE001 - the edited parameters refused: the user's input
        text = " ".join(str(exc).split())[:300]
        raise InterventionError(f"{edits[0]}: {where}, {_a(name)}, made again from the edited {', '.join(edited)}, "
                                f"refused it ({type(exc).__name__}: {text})") from None


def _parameter_of(field: str, params: list[str]) -> str | None:
    """The constructor parameter a distribution's field holds (``_lims`` holds ``lims``, ``base_dist``
    ``base_distribution``), or None (a field it derives)."""
    for name in (field, field[1:] if field.startswith("_") else None, _PARAMETER_OF.get(field)):
        if name in params:
            return name
    return None


_MISSING = object()


def _parameters(cls: type) -> tuple[list[str] | None, list[str], list[str]]:
    """The keyword parameters of a distribution class's constructor (not ``validate_args``), those of
    them that are alternatives (default None: a MultivariateNormal's ``covariance_matrix``,
    ``precision_matrix`` and ``scale_tril``, of which it is made from one), and those without a default;
    None where its signature cannot be read or takes ``*args``."""
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None, [], []
    params, alternatives, missing = [], [], []
    for p in list(signature.parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
            return None, [], []
        if p.kind is p.VAR_KEYWORD or p.name == "validate_args":
            continue
        params.append(p.name)
        if p.default is None:
            alternatives.append(p.name)
        elif p.default is p.empty:
            missing.append(p.name)
    return params, alternatives, missing


def _field(dist: Distribution, param: str) -> Any:
    """What a distribution holds for its constructor's parameter ``param``: the field of that name
    (``loc``), a private one (``_lims``, a MixtureSameFamily's ``_mixture_distribution``), the one it
    keeps it as (``base_dist``), or a property of its class that reads it (a LogNormal's ``loc``); not
    a ``lazy_property`` it has not computed (that would compute it)."""
    state = dist.__dict__
    for name in (param, f"_{param}", _KEPT_AS.get(param)):
        if name is not None and name in state:
            return state[name]
    found = inspect.getattr_static(type(dist), param, None)
    if isinstance(found, property):
        try:
            return getattr(dist, param)
        except Exception:  # noqa: BLE001 - a property that cannot be read now: not held
            return _MISSING
    return _MISSING


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
