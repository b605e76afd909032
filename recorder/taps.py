"""Autograd taps: identity functions whose backward reports the gradients that pass through them.

A step's inputs and outputs pass through a tap during recording, so its backward can be captured
per call (grad outputs when the output tap's backward runs, grad inputs when the input tap's does).
The taps return ``detach()``-ed aliases rather than the inputs themselves: autograd treats an input
returned as-is from a custom Function as a view, and in-place operations on such views are
forbidden, which would break common code (``nn.ReLU(inplace=True)`` on a step's input). Gradients
pass through unchanged and unmaterialised (``None`` stays ``None``), so values are bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

GradCallback = Callable[[tuple[torch.Tensor | None, ...]], None]


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, callback: GradCallback, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.callback = callback
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.callback(grads)
        return (None, *grads)


def tap(tensors: list[torch.Tensor], callback: GradCallback) -> tuple[torch.Tensor, ...]:
    """Pass tensors through one tap; ``callback(grads)`` runs once when their gradients arrive."""
    return _Tap.apply(callback, *tensors)  # type: ignore[no-any-return]


def _tap_slots(values: list[tuple[Any, Any]], callback: GradCallback) -> tuple[dict[Any, Any], list[Any]]:
    """Tap the (key, tensor) pairs' tensors, each tensor object once: a tensor passed in several
    places stays one object in all of them (``query is key`` in self-attention, as without recording),
    its gradient reported once, the total, under its first key. Returns {key: tapped} and the keys
    tapped, in the order the callback sees their grads."""
    if len({id(value) for _, value in values}) == len(values):  # each tensor in one place: the usual call
        keys = [key for key, _ in values]
        return dict(zip(keys, tap([value for _, value in values], callback))), keys
    first: dict[int, Any] = {}
    for key, value in values:
        first.setdefault(id(value), key)
    keys = list(first.values())
    by_key = dict(values)
    tapped = dict(zip(keys, tap([by_key[k] for k in keys], callback)))
    return {key: tapped[first[id(value)]] for key, value in values}, keys


def wants_tap(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad and value.layout == torch.strided


def argument_slots(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[tuple[str, Any], torch.Tensor]]:
    """The arguments a tap takes: every top-level tensor argument that requires grad, keyed
    ``("args", i)`` or ``("kwargs", name)``."""
    slots: list[tuple[tuple[str, Any], torch.Tensor]] = [(("args", i), a) for i, a in enumerate(args) if wants_tap(a)]
    return slots + [(("kwargs", k), v) for k, v in kwargs.items() if wants_tap(v)]


def output_slots(output: Any) -> list[tuple[Any, torch.Tensor]]:
    """The tensors of a step's output a tap takes: those that require grad and are not leaves, of a
    tensor (key None) or of a plain tuple/list (key: index) or dict (key: a str key). Other
    containers are left alone: rebuilding a user's class is not safe."""
    def ok(v: Any) -> bool:
        return wants_tap(v) and not v.is_leaf

    if isinstance(output, torch.Tensor):
        return [(None, output)] if ok(output) else []
    if type(output) in (tuple, list):
        return [(i, v) for i, v in enumerate(output) if ok(v)]
    if type(output) is dict:
        return [(k, v) for k, v in output.items() if isinstance(k, str) and ok(v)]
    return []


def tap_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], callback: GradCallback,
                  skip: frozenset[int] = frozenset(), slots: list[Any] | None = None,
                  ) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """Tap the argument_slots, but for tensors whose id is in ``skip`` (also passed inside a list:
    the list keeps the untapped tensor, and autograd would sum its gradients in another order).
    ``slots``: argument_slots, when the caller has them. Returns new args, kwargs and the names
    (``args.0``, ``kwargs.mask``) of the tapped tensors, in the order the callback sees them."""
    slots = [(key, t) for key, t in (argument_slots(args, kwargs) if slots is None else slots) if id(t) not in skip]
    if not slots:
        return args, kwargs, []
    tapped, keys = _tap_slots(slots, callback)
    new_args, new_kwargs = list(args), dict(kwargs)
    for (where, key), t in tapped.items():
        if where == "args":
            new_args[key] = t
        else:
            new_kwargs[key] = t
    return tuple(new_args), new_kwargs, [f"{w}.{k}" for w, k in keys]


def tap_output(output: Any, callback: GradCallback, skip: frozenset[int] = frozenset(),
               slots: list[Any] | None = None) -> tuple[Any, list[str]]:
    """Tap the output_slots (``slots``, when the caller has them) of a step's output, but for tensors
    whose id is in ``skip`` (see tap_arguments). Returns the new output and the names of the tapped
    tensors (``output``, ``output.0``)."""
    slots = [(key, t) for key, t in (output_slots(output) if slots is None else slots) if id(t) not in skip]
    if not slots:
        return output, []
    if isinstance(output, torch.Tensor):
        return tap([output], callback)[0], ["output"]
    tapped, keys = _tap_slots(slots, callback)
    if type(output) is dict:
        return {**output, **tapped}, [f"output.{k}" for k in keys]
    items = list(output)
    for i, t in tapped.items():
        items[i] = t
    return type(output)(items), [f"output.{i}" for i in keys]
