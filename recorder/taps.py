"""Autograd taps: identity functions whose backward reports the gradients that pass through them.

A step's inputs and outputs pass through a tap during recording, so its backward can be captured
per call (grad outputs when the output tap's backward runs, grad inputs when the input tap's does).
The taps return ``detach()``-ed aliases rather than the inputs themselves: autograd treats an input
returned as-is from a custom Function as a view, and in-place operations on such views are
forbidden, which would break common code (``nn.ReLU(inplace=True)`` on a step's input). Gradients
pass through unchanged and unmaterialised (``None`` stays ``None``), so values are bit-identical.
A call that changes a tapped argument in place (``torch.relu_(x)``, ``nn.ReLU(inplace=True)``) changes
the caller's tensor's values through the alias, while autograd records the change in the alias's history
alone: ``rebase_changed`` then gives the caller's tensor that history (see ``rebase``), as the change
made to the tensor itself would have. Leaves (a parameter given to an update step) pass through no tap:
the step gets them as they are, and their gradients are found on the nodes of the call's graph that use
them (``leaves_apart``).

A step that uses a tapped argument several times (``attn(h, h, h)``, ``x * w1 + (x * w2).sin()``) sends
the tap one gradient per use. Unrecorded, autograd adds each into the caller's tensor's gradient one by
one, among the contributions of the caller's other uses of it; a tap that added them up first and passed
on their sum would change that gradient (and all upstream of it) in its last bits. So a tap of an argument
keeps spare edges to the caller's tensor, and once the call returned, its uses in the call's graph are
found and hooked (``pass_apart``): each use's contribution then goes on alone, by an edge of its own, in
the order autograd sends them, and the tap reports their sum, what autograd would have summed.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import heapq
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd import forward_ad as _forward_ad
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge
from torch.nn.modules.module import _global_backward_hooks, _global_backward_pre_hooks

from . import jsonval
from . import payload as payload_mod

# Called with the gradients of the tapped tensors, in their order; a tap of one of several tensors
# (``tap_each``) calls with its own gradient alone and its place among them: ``callback((grad,), k)``.
GradCallback = Callable[..., None]


# The edges to each caller's tensor a tap of an argument keeps beyond its own: up to 1 + _SPARES uses of the
# argument in the call's graph pass their contributions on apart (see ``pass_apart``), more are summed. A spare
# edge costs ~0.3 us a call (3 -> 15: +4 us per tapped tensor); recordings of schema 1.21 kept 3 (SPARES_BEFORE).
_SPARES = 15
SPARES_BEFORE = 3


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, callback: GradCallback, spares: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # ``tensors``: the n tensors tapped, then each ``spares`` times again (edges to pass uses on by)
        ctx.callback, ctx.spares = callback, spares
        ctx.apart = None  # per tensor: the edges its uses' contributions go on by (pass_apart); None: summed
        ctx.known = None  # per tensor: how many uses the walk at the call's end found (pass_apart); None: no walk
        ctx.ordered = None  # while a pass adds its tensors' uses in order (order_uses): per tensor, their contributions
        ctx.hooked = False  # whether uses_of found a gradient hook of the call's own on an alias
        ctx.set_materialize_grads(False)
        return tuple(_alias(t) for t in tensors[:len(tensors) // (1 + spares)])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.ordered is not None:
            ctx.callback(tuple(g if own is None else _recorded_total(own) for own, g in zip(ctx.ordered, grads)))
            return (None, None, *grads, *(None,) * (len(grads) * ctx.spares))
        if ctx.apart is not None:
            return (None, None, *_passed_apart(ctx, grads))
        ctx.callback(grads)
        return (None, None, *grads, *(None,) * (len(grads) * ctx.spares))

    @staticmethod
    def jvp(ctx: Any, _callback: Any, _spares: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # Forward-mode AD: a tap is an identity, so each tangent passes through as it is, the very
        # tensor (the outputs alias their inputs, and so do their tangents, as without the tap).
        # Without this, a dual tensor meeting a tap raises. A step's dual tensors are not tapped
        # (see ``dual``); a tapped tensor that is dual all the same must not stop training.
        return tangents[:len(tangents) // (1 + ctx.spares)]


class _Rebase(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cell: list[GradCallback | None], view: bool, t: torch.Tensor,
                _changed: torch.Tensor) -> torch.Tensor:
        ctx.cell, ctx.view = cell, view
        ctx.set_materialize_grads(False)
        ctx.mark_dirty(t)
        return t

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[Any, ...]:
        if ctx.cell[0] is not None:
            ctx.cell[0]((grad,))
        # The history before the change gets its gradient through the changed tensor's. A view's base
        # (CopySlices) writes what this returns into the view's part of its own gradient: -0.0, which
        # adds to what that path sends there exactly (x + -0.0 is x, bit for bit, -0.0 included); the
        # zeros that path sends the rest of the base (a slice's backward's) turn a -0.0 there into 0.0.
        before = torch.full_like(grad, -0.0) if ctx.view and grad is not None else None
        return None, None, before, grad


def _unsafe_set_version() -> Callable[[torch.Tensor, int], None] | None:
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:
        return None

    def set_version(t: torch.Tensor, version: int) -> None:
        try:
            setter((t,), (version,))
        except TypeError:  # (before torch 2.5: one tensor and one version)
            setter(t, version)
    return set_version


_SET_VERSION = _unsafe_set_version()
# What a tap gave a call in the place of each caller's tensor: (its place among the tapped names,
# the caller's tensor, the tapped tensor, their version counter when tapped; see ``changed_in_place``)
Watched = list[tuple[int, torch.Tensor, torch.Tensor, int]]
# id(tapped tensor) -> (its place among the tapped names, the caller's tensor, the cell its rebase calls
# back through: ``tap_output`` sets it where the call returned the tapped tensor)
Rebased = dict[int, tuple[int, torch.Tensor, list[GradCallback | None]]]


def rebase(t: torch.Tensor, changed: torch.Tensor) -> list[GradCallback | None]:
    """Give ``t`` the autograd history of ``changed``, its tap's alias that a call changed in place: its
    later uses then send their gradients through the call's in-place operations, as they do where the
    call changed ``t`` itself. The gradient passes as it is, so training is bit for bit as unrecorded.
    Raises what autograd raises for an in-place change to ``t`` (a view of a leaf, one of several views
    ``split`` returned): what the call's change raises unrecorded. The version counter stays as the call
    left it (an in-place change of autograd's own would count one more, and the call's saved tensors
    would then refuse their backward). Returns the cell of the gradient's callback, empty."""
    cell: list[GradCallback | None] = [None]
    version = t._version
    try:
        _Rebase.apply(cell, t._is_view(), t, changed)
    finally:
        if t._version != version:
            _SET_VERSION(t, version)  # type: ignore[misc]
    return cell


def changed_in_place(watched: Watched) -> Watched:
    """The entries of ``watched`` whose caller's tensor the call changed in place through its tap's
    alias: their version counter moved, and the alias has a history of its own. One read of a version
    counter per tensor where none changed; ``watched`` is emptied. A change that did not go through the
    alias (another reference to the caller's tensor) is in autograd's history of the caller's tensor."""
    changed = [w for w in watched if w[1]._version != w[3] and _changed_through(w[2])]
    watched.clear()
    return changed if _SET_VERSION is not None else []  # (no way to keep the version counter: left as it was)


def detached_in_place(watched: Watched) -> list[torch.Tensor]:
    """The caller's tensors of ``watched`` whose tap's alias the call detached in place (``x.detach_()``, a stop
    of the gradient): the alias requires grad no more, while the caller's tensor, which the call would have
    detached itself unrecorded, still does (a detach changes no version counter: ``changed_in_place`` does not
    see it)."""
    return [t for _, t, alias, _ in watched if not alias.requires_grad and t.requires_grad]


def retained_in_call(watched: Watched) -> list[torch.Tensor]:
    """The caller's tensors of ``watched`` whose tap's alias the call asked to keep its gradient
    (``x.retain_grad()``: the caller reads ``x.grad`` after the backward, a saliency map), which the caller's
    tensor, the one the call would have asked unrecorded, does not keep."""
    return [t for _, t, alias, _ in watched if alias.retains_grad and not t.retains_grad and t.requires_grad]


def _changed_through(alias: torch.Tensor) -> bool:
    node = alias.grad_fn
    return node is not None and type(node) is not _TAP_NODE


def rebase_changed(changed: Watched) -> Rebased:
    """Rebase (see ``rebase``) the caller's tensors of ``changed`` (see ``changed_in_place``)."""
    return {id(alias): (i, t, rebase(t, alias)) for i, t, alias, _ in changed}


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``; for a tensor subclass that keeps its class through operations (not ``Parameter``),
    of its class and with its instance attributes, as the call gets it unrecorded. The subclass's
    ``__torch_function__`` does not see this detach (recorder.quiet): it is the recorder's, not the
    training code's (a logging subclass would count it, a strict one could refuse it)."""
    cls = type(t)
    if cls is torch.Tensor:
        return t.detach()
    with torch._C.DisableTorchFunction():
        out = t.detach()
        if type(out) is not cls and cls.__torch_function__ is not torch._C._disabled_torch_function_impl:
            out = out.as_subclass(cls)
            state = getattr(t, "__dict__", None)
            if state:
                out.__dict__.update(state)
    return out


def tap(tensors: list[torch.Tensor], callback: GradCallback, spares: int = 0) -> tuple[torch.Tensor, ...]:
    """Pass tensors through one tap; ``callback(grads)`` runs once when their gradients arrive. ``spares``:
    the edges to each tensor it keeps beyond its own, by which ``pass_apart`` can pass uses on apart."""
    if spares:
        tensors = [*tensors, *(t for t in tensors for _ in range(spares))]
    out = _Tap.apply(callback, spares, *tensors)
    node = out[0].grad_fn
    if node is not None:
        node.aliases = [weakref.ref(t) for t in out]  # (a hook the caller puts on one later: see order_uses)
    return out  # type: ignore[no-any-return]


def tap_each(tensors: list[torch.Tensor], callback: GradCallback, rebased: Rebased | None = None,
             spares: int = 0) -> tuple[torch.Tensor, ...]:
    """Pass each tensor through a tap of its own; ``callback((grad,), k)`` runs when the k-th one's
    gradient arrives (not a tuple of all with the others' as None: a step returning T tensors would
    cost T per gradient, T² per backward). One tap for all would join their graphs: a backward pass from
    one of them (an actor's loss) would then run the others' backward too (the critic's, with no
    gradient), and fail where those saved tensors an optimizer step has since changed in place;
    and none of them would go on before all had their gradient, which changes the order in which
    autograd adds gradients from the step's other uses.

    A tensor of ``rebased`` (an argument's alias the call changed in place and returned) is given back
    as the caller's tensor, which its rebase made it: the caller gets one tensor, as unrecorded, whose
    gradient, that of every later use, its rebase reports in the place of a tap."""
    if rebased and any(id(t) in rebased for t in tensors):
        return tuple(_given_back(t, callback if len(tensors) == 1 else functools.partial(_placed, callback, k),
                                 rebased) for k, t in enumerate(tensors))
    if len(tensors) == 1:
        return tap(tensors, callback, spares)
    return tuple(tap([t], functools.partial(_placed, callback, k), spares)[0] for k, t in enumerate(tensors))


def _given_back(t: torch.Tensor, callback: GradCallback, rebased: Rebased) -> torch.Tensor:
    entry = rebased.get(id(t))
    if entry is None:
        return tap([t], callback)[0]  # type: ignore[no-any-return]
    entry[2][0] = callback
    return entry[1]


def _placed(callback: GradCallback, k: int, grads: tuple[torch.Tensor | None, ...]) -> None:
    callback(grads, k)


def _tap_slots(values: list[tuple[Any, Any]], callback: GradCallback, rebased: Rebased | None = None,
               spares: int = 0, split: frozenset[int] = frozenset()) -> tuple[dict[Any, Any], list[Any]]:
    """Tap the (key, tensor) pairs' tensors, each tensor object once: a tensor passed in several
    places stays one object in all of them (``query is key`` in self-attention, as without recording),
    its gradient reported once, the total, under its first key (its uses there are one tap's, which
    ``pass_apart`` passes on apart); but for a tensor whose id is in ``split`` (see ``split_places``), which
    gets an alias per place, all from one tap, and a gradient per place. Returns {key: tapped} and the keys
    tapped, in the order the callback sees their grads (``rebased``, ``spares``: see ``tap_each``, ``tap``)."""
    if len({id(value) for _, value in values}) == len(values):  # each tensor in one place: the usual call
        keys = [key for key, _ in values]
        return dict(zip(keys, tap_each([value for _, value in values], callback, rebased, spares))), keys
    if split and any(id(value) in split for _, value in values):
        return _tap_places(values, callback, spares, split)
    first: dict[int, Any] = {}
    for key, value in values:
        first.setdefault(id(value), key)
    keys = list(first.values())
    by_key = dict(values)
    tapped = dict(zip(keys, tap_each([by_key[k] for k in keys], callback, rebased, spares)))
    return {key: tapped[first[id(value)]] for key, value in values}, keys


def _tap_places(values: list[tuple[Any, Any]], callback: GradCallback, spares: int, split: frozenset[int]
                ) -> tuple[dict[Any, Any], list[Any]]:
    """``_tap_slots`` where some tensors are tapped per place (``split``): one tap per tensor, with an output
    per place for those, in the order of their places. A tap's outputs send their gradients on together,
    each place's by an edge of its own and in the order of the places, as torch's node for the module's
    backward hooks sends them unrecorded (see ``split_places``)."""
    places: dict[int, list[Any]] = {}
    given: dict[int, torch.Tensor] = {}
    for key, value in values:
        places.setdefault(id(value), []).append(key)
        given[id(value)] = value
    tapped: dict[Any, Any] = {}
    keys: list[Any] = []
    for ident, found in places.items():
        at = found if ident in split else found[:1]
        outs = tap([given[ident]] * len(at), functools.partial(_placed, callback, len(keys)), spares)
        tapped.update(zip(at, outs))
        keys += at
    for key, value in values:
        tapped.setdefault(key, tapped[places[id(value)][0]])
    return tapped, keys


def split_places(module: torch.nn.Module | None, args: tuple[Any, ...]) -> frozenset[int]:
    """Ids of the tensors passed twice or more among a module call's positional arguments (``blk(h, h)``) where
    torch gives them to the call through the node of the module's full backward hooks or backward pre-hooks
    (``BackwardHook.setup_input_hook``): an alias per place, each with a gradient of its own, which that node
    sends on one after the other. A tap of the tensor's places as one would record the sum of those, added
    in another order than a replay's single tensor adds its uses in; a tap per place records each place's
    gradient, as a decorated class, tapped inside its forward, does, and a replay gives each place a tensor.
    Empty where torch passes the arguments as they are (no such hooks: one object, one tap)."""
    if module is None or len(args) < 2:
        return frozenset()
    if not (module._backward_pre_hooks or _global_backward_pre_hooks
            or (module._backward_hooks or _global_backward_hooks) and module._get_backward_hooks()[0]):
        return frozenset()
    seen: set[int] = set()
    twice: set[int] = set()
    for a in args:
        if isinstance(a, torch.Tensor):
            (twice if id(a) in seen else seen).add(id(a))
    return frozenset(twice)


_PROBE = torch.zeros(0, requires_grad=True)  # a leaf whose view makes a node: autograd's sequence number now
_WALK_LIMIT = 100_000  # nodes a walk of one call's graph visits at most (see parameter_uses)


def sequence_now() -> int:
    """Autograd's sequence number now: every node made after this on this thread has a larger one
    (each thread counts its own). -1 when no node can be made here (no grad mode, a mode of the
    user's that refuses a plain tensor)."""
    try:
        node = _PROBE.view(0).grad_fn
    except Exception:  # noqa: BLE001 - then no walk: parameter grads are hooked as totals
        return -1
    return -1 if node is None else node._sequence_nr()


def parameter_uses(outputs: list[torch.Tensor], params: dict[int, Any], since: int,
                   tapped: Uses | None = None) -> tuple[dict[Any, list[tuple[Any, int]]], list[int], bool] | None:
    """Where one call's graph uses its parameters: for each parameter (``params``: id -> name; or a
    leaf argument, see ``leaves_apart``) a node made during the call (sequence number ``since`` or
    later) takes, ``[(node, k)]``, k the place of the parameter's gradient among the node's
    ``next_functions``, found by a walk back from the
    call's ``outputs`` that stops at nodes made before the call. A hook on those nodes sees each
    use's contribution to the parameter's gradient before autograd adds it to the others (another
    call's, a weight decay term in the loss, a tied module's), in the order autograd adds them.
    ``tapped`` (see ``uses_of``): the nodes of the call's input taps, each with a list per tensor it
    tapped, where the walk puts the ``(node, k)`` of each use of that tensor's alias it finds.

    Also returns the sequence numbers of the nodes made before the call that it reached other than
    through a tap of its inputs (a weight an earlier call made and cached, ``parametrize.cached()``):
    made during an earlier call, such a node sends that call's parameters this call's gradients too.
    And whether the walk saw every use: False when it met a node of a custom ``autograd.Function``
    (other than the recorder's taps and rebases), whose backward may reach parameters it was not given
    (reentrant checkpointing runs a backward of its own). None when the walk is longer than
    ``_WALK_LIMIT`` nodes (a graph made on several threads, whose sequence numbers do not bound it)."""
    found: dict[Any, list[tuple[Any, int]]] = {}
    reused: list[int] = []
    whole = True
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[Any] = set()
    taps = tapped or {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if len(seen) > _WALK_LIMIT:
            return None
        if node._sequence_nr() < since:  # an output made before the call (returned as it was)
            reused.append(node._sequence_nr())
            continue
        tap_node = type(node) is _TAP_NODE
        if not tap_node and isinstance(node, BackwardCFunction) and type(node) is not _REBASE_NODE:
            whole = False
        spare = _first_spare(node) if tap_node else None
        for k, (after, nr) in enumerate(node.next_functions):
            if after is None or spare is not None and k >= spare and _unused_spare(node, k):
                continue
            uses = taps.get(after)
            if uses is not None:
                uses[nr].append((node, k))
                continue
            if after in seen:
                continue
            if type(after) is _ACCUMULATE_GRAD:
                name = params.get(id(after.variable))
                if name is not None:
                    found.setdefault(name, []).append((node, k))
            elif after._sequence_nr() >= since:
                stack.append(after)
            elif not tap_node:
                reused.append(after._sequence_nr())
    return found, reused, whole


def root_nodes(roots: Any) -> tuple[Any, ...] | None:
    """The nodes a backward pass begins at, from what autograd's engine is given (a tensor, or a sequence of
    tensors and gradient edges); a leaf begins at none. None where one of them is neither."""
    nodes = []
    try:
        for root in (roots,) if isinstance(roots, (torch.Tensor, GradientEdge)) else roots:
            if isinstance(root, GradientEdge):
                node = root.node
            elif isinstance(root, torch.Tensor):
                node = root.grad_fn
            else:
                return None
            if node is not None:
                nodes.append(node)
    except Exception:  # noqa: BLE001 - a tensor of a mode or subclass that refuses: then the pass is not told
        return None
    return tuple(nodes)


def goes_through(roots: tuple[Any, ...], since: int, until: int) -> bool | None:
    """Whether a backward pass from ``roots`` (``root_nodes``) goes through a node made while a call ran
    (sequence numbers ``since`` to ``until``): its graph, or one it kept aside (an auxiliary loss its module
    holds), not only uses of its parameters made after it (an L2 penalty of a weight alone, a jvp of its
    module). The walk back from the roots stops at nodes made before the call, as ``parameter_uses`` does;
    None when it is longer than ``_WALK_LIMIT`` nodes."""
    def step(node: Any) -> Iterable[Any] | None:
        nr = node._sequence_nr()
        if nr < since:
            return ()
        if nr < until:
            return None  # (found: the walk ends)
        return (after for after, _ in node.next_functions if after is not None)

    return _walk(roots, step)


def _walk(roots: tuple[Any, ...], step: Callable[[Any], Iterable[Any] | None]) -> bool | None:
    """Visit once each node a backward pass from ``roots`` reaches, depth first, but a leaf's AccumulateGrad:
    ``step(node)`` returns the nodes to go on to from it, or None to end the walk there. Returns True where a
    step ended it, False where it ran out of nodes, None past ``_WALK_LIMIT`` nodes."""
    stack = list(roots)
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen or type(node) is _ACCUMULATE_GRAD:
            continue
        seen.add(node)
        if len(seen) > _WALK_LIMIT:
            return None
        after = step(node)
        if after is None:
            return True
        stack.extend(a for a in after if a not in seen)
    return False


# A call's input taps' nodes, each with the alias it gave the call (tap_arguments)
TapNodes = list[tuple[Any, torch.Tensor]]
# A call's input taps' nodes -> per tensor tapped, the (node, k) of each use of its alias in the call's graph
Uses = dict[Any, list[list[tuple[Any, int]]]]


def uses_of(nodes: TapNodes) -> Uses:
    """The taps of ``nodes`` (a call's input taps: ``tap_arguments``) whose uses ``parameter_uses`` is to find,
    each with an empty list per tensor tapped. Not those whose alias has a gradient hook of the call's own
    (``x.register_hook(...)``, ``x.retain_grad()``): the hook sees, and may change, the gradient that reaches
    the tap, which must then be the sum of the uses, passed on as the hook left it."""
    found = {}
    for node, alias in nodes:
        if alias._backward_hooks or alias.retains_grad:
            node.hooked = True
        else:
            found[node] = [[] for _ in range(len(node.next_functions) // (1 + node.spares))]
    return found


def _first_spare(node: Any) -> int | None:
    """The place of a tap's first spare edge among its ``next_functions``; None for a tap without spares."""
    spares = node.spares
    return len(node.next_functions) // (1 + spares) if spares else None


def _unused_spare(node: Any, k: int) -> bool:
    """Whether a tap's spare edge ``k`` passes nothing on: only those of its tensors' uses that it passes on
    apart do (``pass_apart``); its other spares are no uses of the caller's tensor."""
    apart = node.apart
    if apart is None:
        return True
    i, j = divmod(k - _first_spare(node), node.spares)
    return j + 1 >= apart[i]


_TASK_ID: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def pass_apart(tapped: Uses) -> None:
    """Have a call's input taps pass each use's contribution on alone, by an edge of their own, where the
    walk (``parameter_uses``) found two uses of the tapped tensor's alias or more (``attn(h, h, h)``: three)
    and the tap has edges for them. A hook on each using node takes the contribution it sends the tap (its
    post-hook's result: the contribution left out), in the order autograd runs those nodes, and the tap
    sends them on in that order: autograd adds them into the caller's tensor's gradient one by one, among
    its other uses', as it does unrecorded. More uses than the tap's edges are summed as before; a use the
    walk did not find (a tensor the call kept for later) still goes into the tap's own input, and on: a pass
    through such a use adds them all in order instead (``order_uses``), told by the uses found here (``known``)."""
    for tap_node, uses in tapped.items():
        tap_node.known = [len(found) for found in uses]
    if _TASK_ID is None:
        return
    by_node: dict[Any, list[tuple[int, Any, int]]] = {}
    for tap_node, uses in tapped.items():
        edges = [len(found) if 1 < len(found) <= 1 + tap_node.spares else 1 for found in uses]
        if max(edges) == 1:
            continue
        tap_node.apart, tap_node.came, tap_node.task = edges, None, -1
        for i, found in enumerate(uses):
            if edges[i] > 1:
                for node, k in found:
                    by_node.setdefault(node, []).append((k, tap_node, i))
    for node, places in by_node.items():
        node.register_hook(functools.partial(_divert, tuple(places)))


def _divert(places: tuple[tuple[int, Any, int], ...], grads: tuple[torch.Tensor | None, ...], _outputs: Any
            ) -> tuple[torch.Tensor | None, ...] | None:
    """A using node's post-hook: keep the contributions it sends taps that pass their uses on apart
    (``places``: (k, the tap's node, the tensor's place in it)) for those taps' backward, in the order
    they come, and send the taps nothing. Anomaly mode checks the node's results for NaN after its hooks:
    there it keeps them, and the tap passes their sum on, so that a NaN stops the pass at this node."""
    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
        return None
    task = _TASK_ID()  # type: ignore[misc]
    new = list(grads)
    for k, tap_node, i in places:
        g = grads[k]
        if g is None or tap_node.ordered is not None:  # (the pass adds this tensor's uses in order: order_uses)
            continue
        if tap_node.task != task:  # (a pass that did not reach the tap left its contributions behind)
            tap_node.task, tap_node.came = task, [[] for _ in tap_node.apart]
        tap_node.came[i].append(g)
        new[k] = None
    return tuple(new)


def _passed_apart(ctx: Any, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
    """A tap's backward where its uses pass on apart (``pass_apart``): each tensor's contributions, those its
    uses' hooks kept in the order they came, then what reached the tap's own input (uses the walk did not
    find), each by an edge of its own (what exceeds its edges summed on its last); the callback gets their
    sums, added in that order, as autograd would have added them into that input."""
    came = ctx.came if ctx.task == _TASK_ID() else None  # type: ignore[misc]
    ctx.came, ctx.task = None, -1
    n, spares = len(grads), ctx.spares
    out: list[torch.Tensor | None] = [None] * (n * (1 + spares))
    totals = []
    for i, rest in enumerate(grads):
        parts = [*(came[i] if came is not None else ()), *((rest,) if rest is not None else ())]
        totals.append(_recorded_total(parts))
        edges = (i, *range(n + i * spares, n + (i + 1) * spares))
        if len(parts) > len(edges):  # (a use the walk did not find, where every edge has one: summed)
            parts[len(edges) - 1:] = [_total(parts[len(edges) - 1:])]
        for k, g in zip(edges, parts):
            out[k] = g
    ctx.callback(tuple(totals))
    return out


# The node torch puts between a module's caller and its forward for the module's full backward hooks and backward
# pre-hooks (``BackwardHook.setup_input_hook``): its post-hook is theirs, and changes what it sends on.
_MODULE_HOOKS_NODE = "BackwardHookFunctionBackward"


def hook_use(node: Any, hook: Callable[[tuple[torch.Tensor | None, ...], Any], None]) -> None:
    """Hook a node of a call's graph that uses a parameter or a leaf argument: ``hook(grads, outputs)`` gets
    the contributions it sends them. On the node of a module's full backward hooks (a leaf given to the module,
    ``blk(x)``) those are what the hooks made of the gradients: there a pre-hook takes the gradients the
    module's backward computed instead, those a replay of the call computes (the node is an identity, its
    k-th output the k-th input)."""
    if module_hooks_node(node):
        node.register_prehook(functools.partial(_before_module_hooks, hook))
    else:
        node.register_hook(hook)


def module_hooks_node(node: Any) -> bool:
    """Whether an autograd node is the one torch puts before a module's forward for its backward hooks."""
    return node.name() == _MODULE_HOOKS_NODE  # type: ignore[no-any-return]


def _before_module_hooks(hook: Callable[[tuple[torch.Tensor | None, ...], Any], None],
                         grads: tuple[torch.Tensor | None, ...]) -> None:
    hook(grads, None)


def before_backward_hooks(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> None:
    """Have the input taps of a call whose module has full backward hooks report the gradients its
    backward computed, not what those hooks make of them. Torch wraps the arguments for those hooks
    (``BackwardHook.setup_input_hook``) after the forward pre-hooks that tapped them, so the hooks' node
    sits between the call and its taps, and their result is what reaches a tap; a decorated class, tapped
    inside its forward, sees the gradients before the hooks do, and a replay, run without them, computes
    those. ``args``: the arguments as torch passed them to the forward (its forward hooks get them so).
    A pre-hook on the hooks' node keeps the gradients it gets for the taps' callbacks; what goes on is
    left as the hooks made it. Not for a tap whose tensor the call was given in a place torch does not pass
    through that node too (``blk(h, other=h)``, ``blk(h, [h])``: ``kwargs``, or inside a container), whose gradient
    holds what came by that place as well: it reports what reached it."""
    node = next((t.grad_fn for t in args if isinstance(t, torch.Tensor) and t.grad_fn is not None
                 and module_hooks_node(t.grad_fn)), None)
    if node is None:
        return
    past = {t.grad_fn for key, t in argument_slots(args, kwargs or {})
            if (len(key) > 2 or key[0] != "args") and t.grad_fn is not None}
    places: list[tuple[int, dict[int, list[torch.Tensor]], int]] = []
    kept: dict[Any, dict[int, list[torch.Tensor]]] = {}
    for i, (tapped, k) in enumerate(node.next_functions):
        if getattr(tapped, "_forward_cls", None) is not _Tap or tapped in past:
            continue
        raw = kept.get(tapped)
        if raw is None:
            raw = kept[tapped] = {}
            tapped.callback = functools.partial(_with_raw, raw, tapped.callback)
        places.append((i, raw, k))
    if places:
        node.register_prehook(functools.partial(_keep_raw, tuple(places)))


def _keep_raw(places: tuple[tuple[int, dict[int, list[torch.Tensor]], int], ...],
              grads: tuple[torch.Tensor | None, ...]) -> None:
    for raw in {id(raw): raw for _, raw, _ in places}.values():
        raw.clear()  # (what an earlier pass kept and its tap never got: no gradient of this one)
    for i, raw, k in places:
        g = grads[i]
        if g is not None:
            raw.setdefault(k, []).append(g)  # (one tensor passed twice, ``blk(x, x)``: its uses' sum)


def _with_raw(raw: dict[int, list[torch.Tensor]], callback: GradCallback, grads: tuple[torch.Tensor | None, ...],
              *rest: Any) -> None:
    """A tap's callback behind a module's full backward hooks: the gradients kept before the hooks ran,
    where they came (a pass that ran no hook, a double backward's, reports what reached the tap)."""
    if raw:
        grads = tuple(_recorded_total(raw[k]) if k in raw else g for k, g in enumerate(grads))
        raw.clear()
    callback(grads, *rest)


def _total(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of contributions, added one by one in their order, as autograd adds them into a node's input
    (``a + b`` and ``a.add_(b)`` hold the same bits; with grad mode on, in a graph of gradients, as there)."""
    total = parts[0]
    for g in parts[1:]:
        total = total + g
    return total


def _recorded_total(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """``_total`` outside any graph of gradients, for the record; None where none came, or where they do
    not add up (the recording must not stop the pass)."""
    if len(parts) < 2:
        return parts[0] if parts else None
    try:
        if not torch.is_grad_enabled():  # (a backward pass without create_graph: no context to enter)
            return _total(parts)
        with torch.no_grad():
            return _total(parts)
    except Exception:  # noqa: BLE001 - left unrecorded: the contributions themselves go on
        return None


def order_uses(roots: tuple[Any, ...]) -> Callable[[], None] | None:
    """Have a backward pass from ``roots`` (``root_nodes``) add the contributions to a tapped tensor's gradient
    in the order its uses run, as autograd adds them unrecorded, where a tap's uses were not all found when its
    call returned (``pass_apart``'s ``known``): a use made after the call returned (an argument the call kept,
    a generator over it, an output's every use), or one the walk from the call's outputs did not reach (a
    result the call returned inside an object no tap reaches). Such uses send their contributions to the tap,
    which would pass them on only when it runs, summed, among the contributions the caller's other uses of the
    tensor sent it in the meantime: the gradient (and all upstream of it) would differ in its last bits.

    A walk of the pass's graph finds, for each caller's tensor a tap leads to, every use of it: the caller's
    own, and the uses of the taps' aliases (through taps of taps: a step inside a step). Where there are two
    or more and a tap on their way has uses not found before (``_uses_into``), a hook on each using node keeps
    its contribution, in the order they run, and the last one to run sends their sum, added one by one in that
    order: what autograd would have summed. The taps on the way send their callbacks the sums of their own
    uses' contributions (``_Tap.backward``). Returns what undoes the hooks once the pass is over; None where
    there was nothing to order (or the walk was longer than ``_WALK_LIMIT`` nodes, anomaly mode is on: as
    before, the taps pass on what they get)."""
    if torch.is_anomaly_enabled():
        return None
    into: dict[tuple[Any, int], list[tuple[Any, int]]] = {}  # (node, input) -> the (node, k) sending to it
    tap_nodes: list[Any] = []

    def step(node: Any) -> list[Any]:
        tap_node = type(node) is _TAP_NODE
        if tap_node:
            tap_nodes.append(node)
        own = len(node.next_functions) // (1 + node.spares) if tap_node else None
        go_on = []
        for k, (after, nr) in enumerate(node.next_functions):
            if after is None or own is not None and k >= own:  # (a tap's spares: none carries a use of its own)
                continue
            into.setdefault((after, nr), []).append((node, k))
            go_on.append(after)
        return go_on

    if _walk(roots, step) is None or not tap_nodes:
        return None
    # (the caller's tensors: a tap's input that is another tap's alias is among the uses of that tap's tensor)
    targets = {edge for t in tap_nodes for edge in t.next_functions[:len(t.next_functions) // (1 + t.spares)]
               if edge[0] is not None and (type(edge[0]) is not _TAP_NODE or _hooked(edge[0]))}
    hooks: dict[Any, list[tuple[int, list[Any], tuple[tuple[Any, int], ...]]]] = {}
    ordered: list[Any] = []
    for target in targets:
        places: list[tuple[Any, int, tuple[tuple[Any, int], ...]]] = []  # (using node, k, the taps on the way)
        if not _uses_into(into, target, (), places) or len(places) < 2:
            continue
        state = [len(places), []]  # the places yet to run, the contributions come
        for node, k, chain in places:
            for tap_node, i in chain:
                if tap_node.ordered is None:
                    tap_node.ordered = [None] * (len(tap_node.next_functions) // (1 + tap_node.spares))
                    ordered.append(tap_node)
                if tap_node.ordered[i] is None:
                    tap_node.ordered[i] = []
            hooks.setdefault(node, []).append((k, state, chain))
    handles: list[Any] = []

    def undo() -> None:
        for handle in handles:
            handle.remove()
        for tap_node in ordered:
            tap_node.ordered = None
    try:
        for node, places in hooks.items():
            handles.append(node.register_hook(functools.partial(_in_order, tuple(places))))
    except BaseException:
        undo()  # (a use left unhooked would keep the sum from ever being sent: then none is ordered)
        raise
    return undo if hooks else None


def _uses_into(into: dict[tuple[Any, int], list[tuple[Any, int]]], edge: tuple[Any, int],
               chain: tuple[tuple[Any, int], ...], places: list[tuple[Any, int, tuple[tuple[Any, int], ...]]]) -> bool:
    """Put in ``places`` the uses sending gradients into ``edge`` (a node's input: ``into``), through the taps
    of ``chain``, a tap's own uses in its place (but for one whose alias is hooked: ``_hooked``). Returns
    whether a tap on the way has uses its call's end did not find (``pass_apart``'s ``known``)."""
    senders = into.get(edge, [])
    unknown = False
    if chain:
        known = chain[-1][0].known
        unknown = known is None or known[chain[-1][1]] != len(senders)
    for node, k in senders:
        if type(node) is _TAP_NODE and not _hooked(node) and (node, k) not in chain:
            unknown = _uses_into(into, (node, k), (*chain, (node, k)), places) or unknown
        else:
            places.append((node, k, chain))
    return unknown


def _hooked(node: Any) -> bool:
    """Whether a tap's alias has a gradient hook (``uses_of``): it must see the sum of its uses."""
    if node.hooked:
        return True
    aliases = getattr(node, "aliases", ())
    return any(a is not None and (a._backward_hooks or a.retains_grad) for a in (ref() for ref in aliases))


def _in_order(places: tuple[tuple[int, list[Any], tuple[tuple[Any, int], ...]], ...],
              grads: tuple[torch.Tensor | None, ...], _outputs: Any) -> tuple[torch.Tensor | None, ...]:
    """A using node's post-hook (``order_uses``): keep each contribution it sends a tapped tensor, for the
    taps on its way and the sum, sent on by the last of the tensor's uses to run."""
    new = list(grads)
    for k, state, chain in places:
        g = grads[k]
        state[0] -= 1
        if g is not None:
            state[1].append(g)
            for tap_node, i in chain:
                tap_node.ordered[i].append(g)
        new[k] = _total(state[1]) if state[0] == 0 and state[1] else None
    return tuple(new)


def _accumulate_grad_type() -> type:
    leaf = torch.zeros(0, requires_grad=True)
    return type(leaf.view(0).grad_fn.next_functions[0][0])  # type: ignore[union-attr]


_ACCUMULATE_GRAD = _accumulate_grad_type()
_TAP_NODE = _Tap._backward_cls  # type: ignore[attr-defined]
_REBASE_NODE = _Rebase._backward_cls  # type: ignore[attr-defined]


def wants_tap(value: Any) -> bool:
    """Whether a tap can follow ``value`` for gradients: a strided tensor that requires grad (a nested
    tensor's strided layout has no one shape for a tap's view of it: not followed), and carries no
    forward-AD tangent (see ``dual``)."""
    return isinstance(value, torch.Tensor) and value.requires_grad and value.layout == torch.strided \
        and not value.is_nested and not dual(value)


def dual(t: torch.Tensor) -> bool:
    """Whether ``t`` is a forward-AD dual tensor (``torch.autograd.forward_ad.make_dual``) of the dual
    level open now. Not followed for gradients: the gradient that reaches the step through its
    tangent (a JVP penalty's) does not pass its outputs' taps, so the grad inputs of a backward
    recorded from them could not be computed from its grad outputs. Costs one lookup where no dual
    level is open (nearly always)."""
    level = getattr(_forward_ad, "_current_level", -1)
    if level < 0:
        return False
    try:
        return torch._VF._unpack_dual(t, level=level).tangent is not None
    except Exception:  # noqa: BLE001 - a subclass refusing the call: followed as any tensor (the tap's jvp)
        return False


def argument_places(args: tuple[Any, ...], kwargs: dict[str, Any], nested_leaves: bool = True
                    ) -> tuple[list[tuple[tuple[Any, ...], torch.Tensor]], frozenset[str]]:
    """The arguments followed for gradients, and their paths in the call's arguments document: every
    top-level tensor argument that requires grad, keyed ``("args", i)`` or ``("kwargs", name)``, and those
    inside the containers a tapped tensor can be passed in (``_in_place``: lists, dicts, dataclasses;
    ``_REBUILT``: tuples, named tuples such as ``PackedSequence``, torch's return types), nested up to
    ``_DEPTH`` levels, keyed further by their keys (``("args", 0, "data")``), in the order the document
    names them (the first place of a tensor given in several names its record). A tap takes those that
    are not leaves; the leaves among them (a parameter given to an update step, a functional forward's
    weights in a dict) are followed through the call's graph instead (see ``leaves_apart``): a leaf in a
    container since schema 1.23 (``nested_leaves`` False: left out, as a replay of an older recording's
    inner steps leaves them)."""
    found: list[tuple[tuple[Any, ...], str, torch.Tensor]] = []
    active: set[int] = set()
    for i, a in enumerate(args):
        _tensors_in(a, ("args", i), f"args.{i}", found, active, _DEPTH + 2, in_place=True)
    for k, v in kwargs.items():
        _tensors_in(v, ("kwargs", k), f"kwargs.{k}", found, active, _DEPTH + 2, in_place=True)
    taken = [(keys, path, t) for keys, path, t in found
             if wants_tap(t) and (nested_leaves or len(keys) == 2 or not t.is_leaf)]
    return [(keys, t) for keys, _, t in taken], frozenset(path for _, path, _ in taken)


def argument_slots(args: tuple[Any, ...], kwargs: dict[str, Any], nested_leaves: bool = True
                   ) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """The arguments followed for gradients (see ``argument_places``)."""
    return argument_places(args, kwargs, nested_leaves)[0]


_Slots = list[tuple[Any, torch.Tensor]]


def leaves_apart(slots: _Slots) -> tuple[_Slots, _Slots]:
    """The argument_slots a tap takes, and the leaves among them (top-level arguments: a parameter given
    to an update step), which no tap takes. A tap would give the step another tensor, without the
    leaf's ``.grad``, not a leaf, of class ``Tensor`` where it was a ``Parameter``: the step's code
    (``p.data.add_(p.grad, alpha=-lr)``, ``if p.grad is not None``) would see what it does not see
    unrecorded. The step gets the caller's tensor itself; the gradient its graph sends a leaf is found
    as a module's parameter grads are, on the nodes of the call's graph that use it (``parameter_uses``)."""
    if not any(t.is_leaf for _, t in slots):
        return slots, []
    return [s for s in slots if not s[1].is_leaf], [s for s in slots if s[1].is_leaf]


def first_places(slots: _Slots) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of ``slots`` once, named by the path of its first place (``args.0``), as its record is."""
    named: dict[int, tuple[str, torch.Tensor]] = {}
    for key, t in slots:
        named.setdefault(id(t), (".".join(map(str, key)), t))
    return list(named.values())


def follow_leaves(outputs: list[torch.Tensor], leaves: list[tuple[str, torch.Tensor]], since: int,
                  callback: Callable[[str, torch.Tensor], None], taps: TapNodes | None = None) -> bool:
    """Hook the nodes of one call's graph (made at sequence number ``since`` or later) that use the
    ``leaves`` (name, tensor), found by a walk back from the call's ``outputs`` (``parameter_uses``):
    ``callback(name, grad)`` gets each use's contribution to a leaf's gradient, in the order autograd
    adds them. ``taps``: the call's input taps' nodes, whose uses the same walk finds and passes on apart
    (``pass_apart``). False where the walk could not be made (see ``parameter_uses``)."""
    tapped = uses_of(taps) if taps else None
    walked = parameter_uses(outputs, {id(t): name for name, t in leaves}, since, tapped) if since >= 0 else None
    if walked is None:
        return False
    if tapped:
        pass_apart(tapped)
    by_node: dict[Any, list[tuple[int, str]]] = {}
    for name, edges in walked[0].items():
        for node, k in edges:
            by_node.setdefault(node, []).append((k, name))
    for node, places in by_node.items():
        hook_use(node, functools.partial(_leaf_uses, callback, tuple(places)))
    return True


def _leaf_uses(callback: Callable[[str, torch.Tensor], None], places: tuple[tuple[int, str], ...],
               grads: tuple[torch.Tensor | None, ...], _outputs: Any) -> None:
    for k, name in places:
        if grads[k] is not None:
            callback(name, grads[k])


def apart(slots: _Slots) -> tuple[_Slots, _Slots]:
    """The argument_slots whose tensors share no memory with another's, and those that do (two
    views of one buffer, overlapping windows). Those are left untapped, as outputs that share memory
    are (see ``overlapping``): a tap makes each a new object for autograd, so an in-place change the
    step makes to one would no longer reach the other's gradient, and training would change."""
    if len(slots) < 2:
        return slots, []
    shared = overlapping([t for _, t in slots])
    if not shared or _hooks_aliases([t for _, t in slots if id(t) in shared]):
        return slots, []
    return [s for s in slots if id(s[1]) not in shared], [s for s in slots if id(s[1]) in shared]


def _hooks_aliases(tensors: list[torch.Tensor]) -> bool:
    """Whether tensors that share memory are the aliases torch's node for a module's backward hooks gave its
    forward, one per place of a tensor passed twice (``step(x, x)``, a decorated class with a full backward hook,
    tapped inside its forward): each has a gradient of its own, which that node sends on one after the other, so
    a tap per alias records each place's gradient and leaves the order in which they reach the tensor as it was."""
    node = tensors[0].grad_fn
    if node is None or not module_hooks_node(node):
        return False
    first = tensors[0]
    return all(t.grad_fn is node and t.data_ptr() == first.data_ptr() and t.shape == first.shape
               and t.stride() == first.stride() and t.dtype == first.dtype for t in tensors[1:])


class _IntKey(int):
    """A dict's int key whose text is also one of the dict's string keys (``{1: a, "1": b}``): equal to the
    int and hashed as it (a dict finds its item by it), named ``[1]`` where keys are joined into record names
    (``output.[1]``, ``args.0.[1]``), as ``jsonval.int_key_part`` names its path (schema 1.29)."""

    def __str__(self) -> str:
        return jsonval.int_key_part(int(self))

    __repr__ = __str__


def _children(value: Any) -> tuple[str, list[tuple[Any, Any]]] | None:
    """A container's items as (kind, [(key, item)]), keyed as recorder.jsonval names their paths:
    plain tuples and lists and torch's return types by index, named tuples and dataclasses by field
    (a dataclass by the fields its ``__init__`` takes: the others are not recorded), dicts and dict
    subclasses (``OrderedDict``, Hugging Face's ``ModelOutput``) by string or int key (a dict of
    per-scale outputs, ``{0: y0, 1: y1}``), which jsonval names by their text (an int key whose text
    is also a string key of the dict as ``[1]``, and so does ``_IntKey``, its key here). None for
    anything else (a tensor, or an object a tap does not rebuild: see ``_rebuild``)."""
    kind = type(value)
    if kind in (tuple, list):
        return "sequence", list(enumerate(value))
    if isinstance(value, dict):  # not a str or int subclass (StrEnum, bool, IntEnum): jsonval names them otherwise
        pairs = [(k, v) for k, v in dict.items(value) if type(k) is str or type(k) is int]
        if any(type(k) is int for k, _ in pairs):
            texts = {k for k, _ in pairs if type(k) is str}
            pairs = [(_IntKey(k) if jsonval.shadowed(k, texts) else k, v) for k, v in pairs]
        return "mapping", pairs
    if isinstance(value, tuple):
        names = getattr(kind, "_fields", None)
        if isinstance(names, tuple) and all(type(n) is str for n in names) and callable(getattr(kind, "_make", None)):
            return "namedtuple", list(zip(names, tuple.__iter__(value), strict=False))
        if kind.__module__ == "torch.return_types":  # torch.max(x, dim) and the like
            return "return_type", list(enumerate(tuple.__iter__(value)))
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return "dataclass", [(f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value) if f.init]
    return None


_DEPTH = 8  # containers followed below a step's output: deeper tensors are named as not followed


def _followed(output: Any) -> list[tuple[tuple[Any, ...], str, torch.Tensor]]:
    """Every tensor of a step's output that a tap can reach: (its keys from the top, its path in the
    output document, the tensor); the output itself has keys () and path ""."""
    found: list[tuple[tuple[Any, ...], str, torch.Tensor]] = []
    _tensors_in(output, (), "", found, set(), _DEPTH)
    return found


def _tensors_in(value: Any, keys: tuple[Any, ...], path: str, found: list[tuple[tuple[Any, ...], str, torch.Tensor]],
                active: set[int], depth: int, in_place: bool = False) -> None:
    """Put in ``found`` every tensor in ``value`` (at ``keys``, ``path``) and in the containers a tap reaches
    (``_children``; ``in_place``: only those it changes in place or rebuilds, as an argument's), down to
    ``depth`` keys; ``active``: the containers being walked (one met again is a cycle)."""
    if isinstance(value, torch.Tensor):
        found.append((keys, path, value))
        return
    if len(keys) >= depth or id(value) in active:
        return
    items = _children(value)
    if items is None or in_place and not (_in_place(value, items[0]) or items[0] in _REBUILT):
        return
    active.add(id(value))
    for key, item in items[1]:
        _tensors_in(item, (*keys, key), f"{path}.{key}" if path else str(key), found, active, depth, in_place)
    active.discard(id(value))


def output_places(output: Any) -> tuple[list[tuple[Any, torch.Tensor]], frozenset[str], list[torch.Tensor]]:
    """The tensors of a step's output a tap takes, the paths (in the step's output document) of
    every place a tap reaches, and the leaves there that require grad (a parameter returned as it
    is: no tap takes it). A tap takes the tensors that require grad and are not leaves: the output
    itself (keys ``()``) or inside containers a tap rebuilds (see ``_children``), keyed by their
    keys from the top. Tensors in other objects are left alone: rebuilding an arbitrary class is
    not safe."""
    found = _followed(output)
    if len(found) > 1:  # tensors that share memory stay as they are: see overlapping
        shared = overlapping([t for _, _, t in found])
        if shared:
            found = [f for f in found if id(f[2]) not in shared]
    slots = [(keys, t) for keys, _, t in found if wants_tap(t) and not t.is_leaf]
    leaves = [t for _, _, t in found if t.is_leaf and t.requires_grad]
    return slots, frozenset(p for _, p, _ in found), leaves


def shared_outputs(output: Any) -> list[str]:
    """The paths of the tensors in a step's output, in the places a tap reaches, that ``output_places`` leaves
    untapped because they share memory with each other (see ``overlapping``)."""
    found = _followed(output)
    shared = overlapping([t for _, _, t in found]) if len(found) > 1 else set()
    return [path for _, path, t in found if id(t) in shared]


def overlapping(tensors: list[torch.Tensor]) -> set[int]:
    """Ids of the tensors whose memory overlaps another's (a step returning ``x`` and a view of it).
    A tap makes each a new object for autograd: an in-place change to one after the step would no
    longer reach the other's gradient, and training would change. Left untapped, they are not
    followed for gradients (the step's backward leaves them out) and training is as without
    recording. Disjoint parts of one tensor (``x.chunk(3)``: q, k, v) are tapped as usual."""
    spans: dict[tuple[str, int], list[tuple[int, int, torch.Tensor]]] = {}
    for t in tensors:
        if t.numel() == 0 or t.layout != torch.strided or t.device.type == "meta":
            continue
        size = t.element_size()
        start = t.storage_offset() * size
        end = start + size * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))
        spans.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append((start, end, t))
    shared: set[int] = set()
    for group in spans.values():
        if len(group) > 1:
            shared |= _shared_in(group)
    return shared


def _shared_in(group: list[tuple[int, int, torch.Tensor]]) -> set[int]:
    """Ids of the tensors of one storage (``(start byte, end byte, tensor)``) that meet another: the
    pairs whose byte ranges intersect, found in order of their starts (a step's many disjoint
    views, ``h.unbind(0)``, cost one sort), then told apart by ``_meet``. Where those pairs are many
    (``h.unbind(1)``: every range spans the others), by counting how often each byte is used."""
    group = sorted(group, key=lambda span: span[0])
    if sum(end - start for start, end, _ in group) > 4 * (max(end for _, end, _ in group) - group[0][0]):
        counted = _shared_by_bytes(group)  # (ranges four deep on average: ~4 pairs per tensor or more)
        if counted is not None:
            return counted
    budget = 4 * len(group) + 64  # pairs looked at before counting bytes instead
    shared: set[int] = set()
    active: list[tuple[int, int]] = []  # (end, place in group) of the ranges begun and not yet ended
    for i, (start, end, t) in enumerate(group):
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, j in active:
            other = group[j][2]
            if other is t or id(other) in shared and id(t) in shared:  # (one object: one tap)
                continue
            budget -= 1
            if budget < 0:
                counted = _shared_by_bytes(group)
                if counted is not None:
                    return counted
                budget = len(group) ** 2  # too large to count: pair by pair
            if _meet(other, t):
                shared.update((id(other), id(t)))
        heapq.heappush(active, (end, i))
    return shared


_COUNTED_BYTES = 1 << 24  # the span of one storage's tensors that _shared_by_bytes counts at most


def _shared_by_bytes(group: list[tuple[int, int, torch.Tensor]]) -> set[int] | None:
    """``_shared_in`` by counting the tensors that use each byte of the span they lie in (on the
    CPU, from their offsets and strides alone: no data is read); None where that span is larger
    than ``_COUNTED_BYTES``. A tensor whose elements overlap its own meets any other in its range."""
    low, high = group[0][0], max(end for _, end, _ in group)
    if high - low > _COUNTED_BYTES:
        return None
    counts = torch.zeros(high - low, dtype=torch.int16 if len(group) < 1 << 15 else torch.int32)
    places = []
    own = []  # (start, end, tensor) of those overlapping themselves
    for start, end, t in {id(t): (start, end, t) for start, end, t in group}.values():
        size = t.element_size()
        shape, stride = (*t.shape, size), (*(st * size for st in t.stride()), 1)
        if payload_mod.overlaps_itself(tuple(t.shape), t.stride()):
            own.append((start, end, t))
            continue
        place = counts.as_strided(shape, stride, start - low)
        place.add_(1)
        places.append((place, t))
    shared = {id(t) for place, t in places if bool((place > 1).any())}
    for start, end, t in own:
        met = [other for s, e, other in group if other is not t and s < end and start < e]
        if met:
            shared.update(id(other) for other in met)
            shared.add(id(t))
    return shared


def _meet(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors whose byte ranges in one storage intersect share an element. Exact for
    views with the same strides, dtype and dimensions, each without overlaps of its own (the parts
    ``split``/``chunk`` cut along any dimension); True (may share) otherwise."""
    if a.dtype != b.dtype or a.stride() != b.stride() or a.dim() != b.dim() or payload_mod.overlaps_itself(
            tuple(max(na, nb) for na, nb in zip(a.shape, b.shape)), a.stride()):
        return True
    dims = sorted(zip(a.stride(), a.shape, b.shape), reverse=True)
    return _solvable(dims, b.storage_offset() - a.storage_offset(), 0)


def _solvable(dims: list[tuple[int, int, int]], rest: int, d: int) -> bool:
    """Whether an element is in both (``_meet``): (i - j) . stride = offset(b) - offset(a), i in a's index box,
    j in b's, over ``dims`` (stride, a's size, b's size) from the ``d``-th on."""
    if d == len(dims):
        return rest == 0
    stride, na, nb = dims[d]
    low, high = -(nb - 1), na - 1
    return any(low <= k <= high and _solvable(dims, rest - k * stride, d + 1)
               for k in {rest // stride, rest // stride + 1} if stride)


def output_slots(output: Any) -> list[tuple[Any, torch.Tensor]]:
    return output_places(output)[0]


def _key_tree(tapped: dict[tuple[Any, ...], torch.Tensor]) -> dict[Any, Any]:
    """The places of ``tapped``'s tensors as a tree: key -> subtree, a tapped tensor at a leaf."""
    tree: dict[Any, Any] = {}
    for keys, t in tapped.items():
        node = tree
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = t
    return tree


def _new_item(node: dict[Any, Any], made: dict[int, Any], build: Callable[[Any, dict[Any, Any]], Any], key: Any,
              item: Any) -> Any:
    """What a rebuilt container holds at ``key`` in place of ``item``: the tapped tensor at a leaf of ``node``,
    the container ``build`` makes of a subtree, else the container already made of it, or ``item``."""
    sub = node.get(key)
    if sub is None:
        return made.get(id(item), item)
    return sub if isinstance(sub, torch.Tensor) else build(item, sub)


def _rebuild(value: Any, tapped: dict[tuple[Any, ...], torch.Tensor]) -> tuple[Any, bool]:
    """``value`` with the tensors at ``tapped``'s keys replaced; containers on the way to them are
    made anew (each once: a container reached in two places, or from inside itself, is the same new
    one in both), the others kept as they are. Plain containers are rebuilt, named tuples through
    their ``_make`` and torch's return types through their constructor (neither runs code of the
    user's); a dict subclass or dataclass is copied (``copy.copy``, as the standard library copies
    it) and the copy's items or fields set: the step's own objects are left as it made them. A copy
    that fails, or that still holds a replaced value in another place (an ``AttrDict``'s
    attributes), leaves that object as it was: the second value returned says whether any did."""
    if () in tapped:
        return tapped[()], False
    tree = _key_tree(tapped)
    made: dict[int, Any] = {}  # id(container) -> its new one
    kept: list[Any] = []  # objects left as they were

    def build(value: Any, node: dict[Any, Any]) -> Any:
        if id(value) in made:
            return made[id(value)]
        kind, items = _children(value)  # type: ignore[misc]
        new_item = functools.partial(_new_item, node, made, build)

        if kind == "sequence" and type(value) is list or kind == "mapping" and type(value) is dict:
            new = made[id(value)] = type(value)(value)  # first: an item may hold this container again
            for key, item in items:
                new[key] = new_item(key, item)
            return new
        if kind in ("sequence", "return_type"):
            new = type(value)([new_item(i, item) for i, item in items])
        elif kind == "namedtuple":
            new = type(value)._make(new_item(n, v) for n, v in items)
        else:
            try:
                new = _copied(value, kind, items, node, new_item)
            except Exception:
                kept.append(value)
                new = value
        made[id(value)] = new
        return new

    def _copied(value: Any, kind: str, items: list[tuple[Any, Any]], node: dict[Any, Any], new_item: Any) -> Any:
        new = made[id(value)] = copy.copy(value)
        try:
            if type(new) is not type(value):
                raise TypeError(f"a copy of {type(value).__qualname__} is a {type(new).__qualname__}")
            replaced = {id(item) for key, item in items if key in node}
            for key, item in items:
                if key in node or id(item) in made:
                    if kind == "mapping":
                        new[key] = new_item(key, item)  # its own __setitem__ (ModelOutput keeps its attribute)
                    else:
                        object.__setattr__(new, key, new_item(key, item))  # a frozen dataclass's too
            state = getattr(new, "__dict__", None)
            held = [*(state.values() if isinstance(state, dict) else ()), *(new.values() if kind == "mapping" else ())]
            if any(id(v) in replaced for v in held):
                raise TypeError(f"a copy of {type(value).__qualname__} keeps a replaced value in another place")
        except BaseException:
            del made[id(value)]
            raise
        return new

    return build(value, tree), bool(kept)


_REBUILT = ("sequence", "namedtuple", "return_type")  # (a list is a "sequence" too: see _in_place)
# An argument's container a tapped tensor is put in while the call runs, and its item put back after:
# (container, kind, key, item, tapped)
Undo = list[tuple[Any, str, Any, Any, torch.Tensor]]


def _in_place(value: Any, kind: str) -> bool:
    """Whether a tap puts tapped tensors into the argument's container itself while the call runs (its
    items put back after: ``restore``), rather than into a new one. Mutable containers: the caller sees
    what the step does to them (a state dict it updates, a list it appends to), so they stay the
    objects they are. Lists and dicts whose item assignment is ``list``'s or ``dict``'s own (an
    ``EasyDict`` or Hugging Face's ``ModelOutput`` assigns an attribute too, which would keep the
    untapped tensor), and dataclasses (their fields, as ``object.__setattr__`` sets them)."""
    if kind == "dataclass":
        return True
    if kind == "sequence":
        return type(value) is list
    return kind == "mapping" and type(value).__setitem__ in (dict.__setitem__, collections.OrderedDict.__setitem__) \
        and not getattr(value, "__dict__", None)


def _put(container: Any, kind: str, key: Any, value: Any) -> None:
    if kind == "dataclass":
        object.__setattr__(container, key, value)  # (a frozen dataclass's too)
    else:
        container[key] = value


def restore(undo: Undo) -> None:
    """Put back the items ``tap_arguments`` put tapped tensors in the place of, in the arguments'
    containers, where the call left the tapped tensor there (one it replaced stays as the call left it)."""
    for container, kind, key, item, tapped in reversed(undo):
        try:
            now = getattr(container, key) if kind == "dataclass" else \
                container[key] if kind == "mapping" or key < len(container) else None
            if now is tapped:
                _put(container, kind, key, item)
        except Exception:  # noqa: BLE001, S110 - a container the call made unreadable: left as the call left it
            pass
    undo.clear()


def _substitute(value: Any, tapped: dict[tuple[Any, ...], torch.Tensor], undo: Undo, made: dict[int, Any]) -> Any:
    """``value`` (an argument) with the tensors at ``tapped``'s keys (below it) replaced: containers
    ``_in_place`` takes the tapped tensors themselves (``undo`` says how to put their items back),
    the others on the way to them are made anew (each once: one reached in two places, of this
    argument or another, is the same new one in both: ``made``), as ``_rebuild`` makes an output's:
    tuples, named tuples through their ``_make`` and torch's return types through their constructor
    (none runs code of the user's)."""
    if () in tapped:
        return tapped[()]
    tree = _key_tree(tapped)

    def build(value: Any, node: dict[Any, Any]) -> Any:
        if id(value) in made:
            return made[id(value)]
        kind, items = _children(value)  # type: ignore[misc]
        new_item = functools.partial(_new_item, node, made, build)
        if _in_place(value, kind):
            made[id(value)] = value
            for key, item in items:
                if key in node:
                    new = new_item(key, item)
                    if new is not item:
                        _put(value, kind, key, new)
                        undo.append((value, kind, key, item, new))
            return value
        if kind == "namedtuple":
            new = type(value)._make(new_item(n, v) for n, v in items)
        else:
            new = type(value)([new_item(i, item) for i, item in items])
        made[id(value)] = new
        return new

    return build(value, tree)


def tap_arguments(args: tuple[Any, ...], kwargs: dict[str, Any], callback: GradCallback,
                  skip: frozenset[int] = frozenset(), slots: list[Any] | None = None, *, undo: Undo,
                  leaves: bool = False, watched: Watched | None = None, nodes: TapNodes | None = None,
                  spares: int | None = None, split: frozenset[int] = frozenset(),
                  ) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """Tap the argument_slots, but for tensors whose id is in ``skip`` (also passed in a place no tap
    reaches: that place keeps the untapped tensor, and autograd would sum its gradients in another
    order), those that share memory with another (see ``apart``) and leaves (see ``leaves_apart``;
    ``leaves``: tapped too, as recordings before schema 1.19 tapped them, for a replay of one).
    ``slots``: those to tap, when the caller has them. Tensors inside lists, dicts and dataclasses
    are put into them while the call runs: ``undo`` collects what ``restore`` puts back once it
    returned. ``watched`` collects each tapped tensor with its tap's, for ``changed_in_place`` once the
    call returned; ``nodes`` each tap's node with its alias, for ``uses_of`` once the call returned; ``spares``:
    each tap's spare edges (``_SPARES`` unless given: a replay gives a recording's inner steps as many as their
    recorder did); ``split``: ids of tensors tapped per place (``split_places``). Returns new
    args, kwargs and the names (``args.0``, ``kwargs.mask``, ``args.1.data``) of the tapped tensors, in the order the
    callback sees them."""
    slots = [(key, t) for key, t in (apart(argument_slots(args, kwargs))[0] if slots is None else slots)
             if id(t) not in skip and (leaves or not t.is_leaf)]
    if not slots:
        return args, kwargs, []
    tapped, keys = _tap_slots(slots, callback, spares=_SPARES if spares is None else spares, split=split)
    if nodes is not None:
        nodes.extend((tapped[k].grad_fn, tapped[k]) for k in keys)
    if watched is not None:
        given = dict(slots)
        watched.extend((i, given[k], tapped[k], given[k]._version) for i, k in enumerate(keys))
    new_args, new_kwargs = list(args), dict(kwargs)
    below: dict[tuple[str, Any], dict[tuple[Any, ...], torch.Tensor]] = {}
    for key, t in tapped.items():
        below.setdefault(key[:2], {})[key[2:]] = t
    made: dict[int, Any] = {}
    try:
        for (where, key), inner in below.items():
            held = new_args if where == "args" else new_kwargs
            held[key] = _substitute(held[key], inner, undo, made)
    except BaseException:
        restore(undo)  # (the caller calls with its arguments as they were)
        raise
    return tuple(new_args), new_kwargs, [".".join(map(str, k)) for k in keys]


def tap_output(output: Any, callback: GradCallback, skip: frozenset[int] = frozenset(),
               slots: list[Any] | None = None, rebased: Rebased | None = None,
               ) -> tuple[Any, list[str | None], list[str]]:
    """Tap the output_slots (``slots``, when the caller has them) of a step's output, but for tensors
    whose id is in ``skip`` (also in a place no tap reaches: see tap_arguments); an argument's alias
    the call changed in place (``rebased``) is given back as the caller's tensor (see tap_each).
    Returns the new output; the names of the tapped tensors (``output``, ``output.0``, ``output.1.h``) in the order
    the callback sees their grads, None for a tap that went unused (in an object that could not be
    copied: its grad always comes as None); and the names of the slots left untapped so."""
    slots = [(key, t) for key, t in (output_slots(output) if slots is None else slots) if id(t) not in skip]
    if not slots:
        return output, [], []
    tapped, keys = _tap_slots(slots, callback, rebased)
    names = {k: ".".join(("output", *map(str, k))) for k, _ in slots}
    rebuilt, kept = _rebuild(output, tapped)
    if not kept:
        return rebuilt, [names[k] for k in keys], []
    # Objects that could not be copied keep their tensors untapped (those taps go unused: their grads
    # come as None); unless one of those tensors is also in a place that was rebuilt, where autograd
    # would then sum its gradients in another order: then the whole output stays as it was.
    present = {id(t) for _, _, t in _followed(rebuilt)}
    originals = dict(slots)
    if any(id(tapped[k]) in present and id(originals[k]) in present for k in keys):
        return output, [], list(names.values())
    return (rebuilt, [names[k] if id(tapped[k]) in present else None for k in keys],
            [names[k] for k, _ in slots if id(tapped[k]) not in present])
