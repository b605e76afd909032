"""Inner steps during a replay: which recorded steps a step encloses, and a stand-in for the
recorder that sees them run again so that each can be compared with its recording.

Module steps are seen through forward hooks on the rebuilt module's submodules at the recorded
paths; function steps (``paper_step`` functions) through the decorator's hook point
(``recorder.capture.ACTIVE``), with the path of the innermost module running around them. Replayed
calls are matched to recorded ones by (name, module path) and their order; a submodule the recorder
named by another path, outside the step's (the model's own, reached first), by its class
(``_shared_paths``). The submodules of the modules the step's code reads by module-level names (a
per-sample loss's ``functional_call(MODEL, ...)``) are watched too, at the recorded paths of their
classes; an inner step at a path no watched module holds is not compared, and said to be.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from recorder import jsonval, skeleton, taps, transforms
from recorder.store import layout

from .arguments import network_records
from .compare import Diff, compare_record, tensors_by_name
from .recording import Step, join_path


@dataclass
class InnerStep:
    """How one step inside the replayed step compares with its recording."""

    step: Step
    match: bool
    diffs: list[Diff] = field(default_factory=list)
    reason: str | None = None

    @property
    def change(self) -> str:
        """"same", "became finite", "became non-finite" or "changed" (recorded vs replayed)."""
        if self.match:
            return "same"

        def bad(stats: dict[str, Any]) -> bool:
            return bool((stats.get("nan") or 0) + (stats.get("inf") or 0))

        recorded = any(bad(d.recorded) for d in self.diffs)
        replayed = any(bad(d.replayed) for d in self.diffs if d.replayed)
        if recorded and not replayed and self.diffs and all(d.replayed for d in self.diffs):
            return "became finite"
        if replayed and not recorded:
            return "became non-finite"
        return "changed"

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step.to_json(), "match": self.match, "change": self.change, "reason": self.reason,
                "outputs": [d.to_json() for d in self.diffs]}


@dataclass
class UnrecordedCall:
    """Inner calls the replay made beyond the recorded ones (an edit that changed a loop's trip
    count): nothing to compare them with. ``count`` of them; the first is call ``number`` (from 0)
    of the step ``name`` at ``module_path`` in the replayed call, where ``recorded`` were recorded."""

    name: str
    module_path: str
    number: int
    recorded: int
    count: int

    @property
    def text(self) -> str:
        calls = f"{self.count} inner call{'s' if self.count != 1 else ''}"
        return (f"{calls} made during the replay {'were' if self.count != 1 else 'was'} not recorded (the first: "
                f"{self.name} at {self.module_path or '.'}, its call {self.number} in this step, where "
                f"{self.recorded} {'were' if self.recorded != 1 else 'was'} recorded)")

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "first": {"name": self.name, "module_path": self.module_path,
                                               "call": self.number, "recorded": self.recorded}}


def descendants(step: Step) -> list[Step]:
    """The forward steps a forward step encloses, in execution order (they follow it directly)."""
    rec = step.rec
    n = len(rec)
    if step.phase != "forward" or step.index + 1 >= n:
        return []
    stop = min(n, step.index + 1 + 1_000_000)
    parents = np.asarray(rec.rank.column("steps/parent")[step.index + 1:stop])
    phases = np.asarray(rec.rank.column("steps/phase")[step.index + 1:stop])
    inside = {step.index}
    found = []
    for offset, (parent, phase) in enumerate(zip(parents.tolist(), phases.tolist())):
        if parent not in inside or phase != 0:
            if parent == layout.NO_REF or phase != 0:
                break
            continue
        index = step.index + 1 + offset
        inside.add(index)
        found.append(Step(rec, index))
    return found


@dataclass
class _Seen:
    """One inner call seen during the replay."""

    kind: str  # "module" or "function:<name>"
    path: str
    outputs: dict[str, torch.Tensor] | None = None  # None until it returns
    raised: str | None = None  # the type (jsonval.type_ref) of the exception it raised, if it raised one
    grad_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    given: Any = None  # a module call's (args, kwargs) as it got them: what it changed in place is compared
    changes: bool = False  # its recorded step changed inputs in place ("after:<input>" records)
    # its module's own parameters that its recorded step changed in place ("after:<parameter>" records), by name
    written: dict[str, torch.Tensor] = field(default_factory=dict)
    step: Step | None = None  # its recorded step
    undo: taps.Undo = field(default_factory=list)  # its arguments' containers' items, put back when it returns
    # Its top-level leaf arguments that require grad (name, tensor), which no tap takes, and autograd's
    # sequence number when it began: at its end, its graph's uses of them are hooked (taps.follow_leaves)
    leaves: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    since: int = -1
    # Its tapped arguments with their taps' aliases: those it changed in place are rebased when it returns,
    # as the recorder rebases them (taps.rebase_changed)
    watched: taps.Watched = field(default_factory=list)
    # A module call's parameters (name under its module -> its own share of their gradient): the sums of
    # the contributions of its graph's uses of them, as the recorder sums a call's own (``own_grads``)
    began: int = -1  # autograd's sequence number when it began (its graph's nodes are numbered from it)
    own: dict[str, torch.Tensor] = field(default_factory=dict)
    # Its input taps' nodes, whose uses pass on apart once it returned, as the recorder's do (taps.pass_apart)
    tap_nodes: taps.TapNodes = field(default_factory=list)


class InnerTap:
    """Installed as ``recorder.capture.ACTIVE`` during a replay; records the replayed inner calls.
    With ``backward=True`` their inputs and outputs also pass through autograd taps (identities for
    the values), so that a backward replay sees each inner step's grad inputs and grad outputs. They are
    tapped as the recorder of the recording's schema (``schema``, the current one where None) tapped them,
    so that autograd's additions upstream, an outer step's gradients in the last bits, are the recording's:
    their top-level leaf arguments are followed through their graphs (tapped too before 1.19); an argument
    an inner call uses several times has each use's gradient passed on apart (their sum before 1.21), up to
    16 uses (4 in 1.21); the leaves inside container arguments are followed too (from 1.23)."""

    enabled = True

    def __init__(self, root: torch.nn.Module | None, root_path: str, inner: list[Step], *,
                 backward: bool = False, plan: Any = None, schema: tuple[int, int] | None = None,
                 reached: list[torch.nn.Module] | None = None) -> None:
        self.inner, self.backward, self.plan, self.root_path = inner, backward, plan, root_path
        since = (lambda version: True) if schema is None else (lambda version: schema >= version)
        self.leaves_tapped = not since(layout.LEAVES_UNTAPPED_SINCE)
        self.uses_apart = since(layout.USES_APART_SINCE)
        self.spares = taps._SPARES if since(layout.MORE_SPARES_SINCE) else taps.SPARES_BEFORE
        self.nested_leaves = since(layout.NESTED_LEAVES_SINCE)
        self.network_grads = since(layout.NETWORK_GRADS_SINCE)
        self._seen_count: dict[tuple[str, str], int] = {}
        self.calls: list[_Seen] = []
        # recorded inner steps (backward: their backward steps) at a path no watched module holds, which the
        # replay could not see called: not compared (``unseen_text``), rather than "not called"
        self.unseen: list[Step] = []
        self._rooted = root is not None
        # The leaf arguments requiring grad that inner calls were given (a gradient penalty's interpolates,
        # made inside the replayed step): their gradients, which the recorded pass computed into .grad, are
        # what a backward replay asks autograd for too, or their uses' hooks never run
        self.leaves: list[torch.Tensor] = []
        self._stack: list[str] = [root_path]
        self._open: dict[str, list[_Seen]] = {}
        self._handles: list[Any] = []
        self._modules_wanted = {s.module_path for s in inner if s.definition.get("kind") == "module"}
        self._root_depth = 0  # calls of the root module open: the first is the replayed step itself
        self._modules: dict[str, torch.nn.Module] = {}  # module path -> the module there
        self._outer_names: dict[int, str] = {}  # id(parameter) -> its name in the root (its grad's record name)
        if root is not None:
            self._outer_names = {id(p): name for name, p in root.named_parameters()}
            recorded_as = _shared_paths(root, root_path, inner)
            for rel, sub in root.named_modules():
                path = recorded_as.get(rel) or join_path(root_path, rel)
                self._modules[path] = sub
                if not rel:  # the root: its calls inside the replayed call (a recursion) are inner steps
                    self._handles.append(sub.register_forward_pre_hook(self._enter_root, with_kwargs=True))
                    self._handles.append(sub.register_forward_hook(self._exit_root, always_call=True))
                    continue
                self._watch(path, sub)
        self._watch_reached(reached or [], root)

    def _watch(self, path: str, module: torch.nn.Module) -> None:
        self._handles.append(module.register_forward_pre_hook(
            lambda m, a, k, p=path: self._enter(p, a, k, m), with_kwargs=True))
        self._handles.append(module.register_forward_hook(lambda m, a, o, p=path: self._exit(p, o),
                                                          always_call=True))

    def _watch_reached(self, reached: list[torch.nn.Module], root: torch.nn.Module | None) -> None:
        """Watch the submodules of the modules the step's code reads by module-level names (``reached``) at
        the recorded paths of inner module steps the root does not hold: a per-sample loss calling
        ``functional_call(MODEL, ...)`` runs the steps inside ``MODEL``, which the recorder named by their
        paths in the outermost module called, ``MODEL`` itself (or the recording's model, which it is where
        it is passed as ``model=``). A submodule is taken at a path only where it is of the class recorded
        there, so that another module's submodule at a path of the same name is not compared with it."""
        classes = _recorded_classes(self.inner)
        held = {id(m) for m in root.modules()} if root is not None else set()
        for top in reached:
            for rel, sub in top.named_modules():
                if id(sub) in held or rel in self._modules or classes.get(rel) != \
                        skeleton.own_class(sub).__qualname__:
                    continue
                held.add(id(sub))
                self._modules[rel] = sub
                self._watch(rel, sub)

    def _tap_in(self, seen: _Seen, args: tuple[Any, ...], kwargs: dict[str, Any],
                module: torch.nn.Module | None = None) -> Any:
        if not self.backward or transforms.active():  # (under torch.func the recorder tapped nothing either)
            return None

        def got(grads: tuple[Any, ...], names: list[str | None]) -> None:
            seen.grad_inputs.update({n: g.detach().clone() for n, g in zip(names, grads) if g is not None})

        holder: list[list[str | None]] = [[]]
        slots, leaves = taps.leaves_apart(taps.apart(taps.argument_slots(args, kwargs, self.nested_leaves))[0])
        self.leaves += [t for _, t in leaves if t.requires_grad]
        if self.leaves_tapped:
            slots, leaves = [*slots, *leaves], []
        elif leaves:
            seen.leaves = taps.first_places(leaves)
        if self.network_grads and seen.step is not None and "$module" in str(seen.step.arguments):
            networks = self._networks(seen, args, kwargs, module)
            seen.leaves += networks
            self.leaves += [t for _, t in networks]
        if seen.leaves or self.uses_apart:
            seen.since = taps.sequence_now()
        split = taps.split_places(module, args)
        if split:  # (as the recorder taps them: tapped, and given as positional arguments alone)
            split = (split & {id(t) for _, t in slots}).difference(
                id(t) for key, t in slots if len(key) > 2 or key[0] != "args")
        new_args, new_kwargs, holder[0] = taps.tap_arguments(args, kwargs,
                                                             lambda g, k=0: got(g, holder[0][k:k + len(g)]),
                                                             slots=slots, undo=seen.undo, leaves=self.leaves_tapped,
                                                             watched=seen.watched,
                                                             nodes=seen.tap_nodes if self.uses_apart else None,
                                                             spares=self.spares, split=split)
        return new_args, new_kwargs

    @staticmethod
    def _networks(seen: _Seen, args: tuple[Any, ...], kwargs: dict[str, Any],
                  module: torch.nn.Module | None) -> list[tuple[str, torch.Tensor]]:
        """The parameters of the networks the inner call was given (1.31), named by their records, as the
        recorder follows them: their grads are its ``network_grad`` records (the call's own module's are not)."""
        assert seen.step is not None
        mine = {id(p) for p in module.parameters()} if module is not None else set()
        known = {id(t) for _, t in seen.leaves}
        return [(n, p) for n, p in network_records(seen.step.arguments, args, kwargs)
                if id(p) not in mine and id(p) not in known]

    def _tap_out(self, seen: _Seen, output: Any) -> Any:
        rebased = taps.rebase_changed(taps.changed_in_place(seen.watched)) if seen.watched else None
        if not self.backward or transforms.active():
            return output

        def got(grads: tuple[Any, ...], names: list[str | None]) -> None:
            seen.grad_outputs.update({n: g.detach().clone() for n, g in zip(names, grads) if g is not None})

        def came(name: str, grad: torch.Tensor) -> None:  # (each use's contribution, added as autograd adds them)
            was = seen.grad_inputs.get(name)
            seen.grad_inputs[name] = grad.detach().clone() if was is None else was + grad

        holder: list[list[str | None]] = [[]]
        slots = taps.output_slots(output)
        if seen.leaves or seen.tap_nodes:
            taps.follow_leaves([t for _, t in slots], seen.leaves, seen.since, came, seen.tap_nodes)
            seen.leaves, seen.tap_nodes = [], []
        output, holder[0], _ = taps.tap_output(output, lambda g, k=0: got(g, holder[0][k:k + len(g)]), slots=slots,
                                               rebased=rebased)
        return output

    def _enter(self, path: str, args: tuple[Any, ...], kwargs: dict[str, Any], module: torch.nn.Module) -> Any:
        self._stack.append(path)
        if path not in self._modules_wanted:
            return None
        seen = _Seen("module", path)
        self.calls.append(seen)
        self._open.setdefault(path, []).append(seen)
        edited = self._edit_args(seen, args, kwargs)
        if seen.changes:
            seen.written = _written(seen.step, module)
        if edited is not None:
            args, kwargs = edited
        if self.backward:
            seen.began = taps.sequence_now()
        tapped = self._tap_in(seen, args, kwargs, module)
        if seen.changes:
            seen.given = tapped if tapped is not None else (args, kwargs)
        return tapped if tapped is not None else edited

    def _enter_root(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._root_depth += 1
        return self._enter(self.root_path, args, kwargs, module) if self._root_depth > 1 else None

    def _exit_root(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        self._root_depth -= 1
        return self._exit(self.root_path, output) if self._root_depth > 0 else None

    def _recorded(self, seen: _Seen) -> Step | None:
        """The recorded inner step this replayed call corresponds to (same key, same order)."""
        key = (seen.kind, seen.path)
        k = self._seen_count.get(key, 0)
        self._seen_count[key] = k + 1
        same = [s for s in self.inner if s.module_path == seen.path and _kind(s) == seen.kind]
        return same[k] if k < len(same) else None

    def _edit_args(self, seen: _Seen, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Apply the plan's edits aimed at this inner call (``STEP/args.0``); None when none apply."""
        step = seen.step = self._recorded(seen)
        seen.changes = step is not None and any(r.role == "output" and r.name.startswith(layout.AFTER_PREFIX)
                                                for r in step.records)
        if self.plan is None or step is None:
            return None
        from .intervene import matches

        changes = [c for c in self.plan.edits if c.step is not None and matches(c.step, step, self.root_path)]
        if not changes:
            return None
        args, kwargs = list(args), dict(kwargs)
        for c in changes:
            where, _, key = c.tensor.partition(".")
            if where == "args" and key.isdigit() and int(key) < len(args) and isinstance(args[int(key)], torch.Tensor):
                args[int(key)] = c.run(args[int(key)])
            elif where == "kwargs" and isinstance(kwargs.get(key), torch.Tensor):
                kwargs[key] = c.run(kwargs[key])
            else:
                continue
            c.used += 1
        return tuple(args), kwargs

    def _exit(self, path: str, output: Any) -> Any:
        if self._stack and self._stack[-1] == path:
            self._stack.pop()
        pending = self._open.get(path)
        if not pending:
            return None
        seen = pending.pop()
        taps.restore(seen.undo)
        exc = sys.exc_info()[1]
        if output is None and exc is not None:  # (an always-called hook, run as the module's forward raises)
            seen.raised = jsonval.type_ref(type(exc))
            return None
        seen.outputs = _snapshot(output)
        seen.outputs.update({f"{layout.AFTER_PREFIX}{n}": p.detach().clone() for n, p in seen.written.items()})
        seen.written = {}
        if seen.given is not None:
            seen.outputs.update(_after(*seen.given))
            seen.given = None
        if not self.backward:
            return None
        output = self._tap_out(seen, output)
        self._follow_params(seen, output)
        return output

    def _follow_params(self, seen: _Seen, output: Any) -> None:
        """Hook the nodes of a module call's graph that use its parameters (found as the recorder finds
        them: taps.parameter_uses from its outputs, through their taps), so that each use's contribution
        is added to the call's own share of the parameter's gradient in the order autograd sends them.
        That share is what a recorded ``own_grads`` record holds: a tied weight's or a shared
        submodule's other users, and the module's other calls, add theirs to the parameter's total only."""
        module = self._modules.get(seen.path)
        if module is None or seen.began < 0 or transforms.active():
            return
        keys = {id(p): name for name, p in module.named_parameters() if p.requires_grad}
        outputs = [t for _, t in taps.output_slots(output)]
        walked = taps.parameter_uses(outputs, keys, seen.began) if keys and outputs else None
        by_node: dict[Any, list[tuple[int, str]]] = {}
        for name, edges in (walked[0] if walked is not None else {}).items():
            for node, k in edges:
                by_node.setdefault(node, []).append((k, name))

        def used(places: list[tuple[int, str]], grads: tuple[torch.Tensor | None, ...], _outputs: Any) -> None:
            for k, name in places:
                g = grads[k]
                if g is not None:
                    was = seen.own.get(name)
                    seen.own[name] = g.detach().clone() if was is None else was + g

        for node, places in by_node.items():
            node.register_hook(lambda grads, outs, places=places: used(places, grads, outs))

    def call(self, defn: Any, fn: Any, module: torch.nn.Module | None, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        if module is not None:  # module steps are seen by the hooks
            return fn(module, *args, **kwargs)
        seen = _Seen(f"function:{defn.name}", self._stack[-1])
        self.calls.append(seen)
        edited = self._edit_args(seen, args, kwargs)
        if edited is not None:
            args, kwargs = edited
        fn = self._swapped(defn, fn)
        tapped = self._tap_in(seen, args, kwargs)
        if tapped is not None:
            args, kwargs = tapped
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            seen.raised = jsonval.type_ref(type(exc))
            raise
        finally:
            taps.restore(seen.undo)
        seen.outputs = _snapshot(out)
        if seen.changes:
            seen.outputs.update(_after(args, kwargs))
        return self._tap_out(seen, out)

    def _swapped(self, defn: Any, fn: Any) -> Any:
        if self.plan is None:
            return fn
        from .intervene import swap_function

        for sw in self.plan.swaps:
            if sw.key in (defn.name, defn.paper.get("label")):
                return swap_function(fn, sw)
        return fn

    def watch(self, tensor: Any, name: str, expect: dict[str, Any]) -> None:
        pass

    def forget_grads(self) -> None:
        """Drop the gradients the inner calls got so far: those of the backward passes the replayed forward
        took itself (a gradient penalty's ``autograd.grad(..., create_graph=True)``), which the recording
        holds as other backward steps. A backward replay compares the inner steps of its own pass, which
        starts after this; the first-order gradients of a leaf argument would be added to its own."""
        for seen in self.calls:
            seen.grad_inputs, seen.grad_outputs, seen.own = {}, {}, {}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pairs(self) -> list[tuple[Step, _Seen | None]]:
        queues: dict[tuple[str, str], list[_Seen]] = {}
        for seen in self.calls:
            queues.setdefault((seen.kind, seen.path), []).append(seen)
        out = []
        for step in self.inner:
            queue = queues.get((_kind(step), step.module_path))
            out.append((step, queue.pop(0) if queue else None))
        return out

    def _seeable(self, step: Step) -> bool:
        """Whether the replay could see a call of the recorded inner ``step``: at the replayed step's path, or at
        that of a module it watches (a function step's path is that of the module around it)."""
        if step.module_path in self._modules:
            return True
        return step.module_path == self.root_path and (self._rooted or step.definition.get("kind") != "module")

    @property
    def unseen_text(self) -> str:
        """Why the inner steps in ``unseen`` were not compared ("" where none)."""
        if not self.unseen:
            return ""
        first = self.unseen[0]
        more = f" (and {len(self.unseen) - 1} more)" if len(self.unseen) > 1 else ""
        return (f"not compared: inner step {first.index} ({first.name} at {first.module_path or '.'}){more}: a replay "
                "sees the steps inside the replayed step's module, inside the modules its code reads by "
                "module-level names and inside the networks it is given, at the paths the recording names them by, "
                "and none of those is at this path (its module was reached another way: an attribute of an object "
                "it is given, a model a helper of another module holds)")

    def unrecorded(self) -> UnrecordedCall | None:
        """The calls the replay made beyond the recorded ones (by key and order, as paired), if any. A function
        step's call inside a module the replay could not watch is seen at another path than its record's: where
        the recording holds an unseen step of that function (``unseen``), it is taken for that one's call."""
        recorded = Counter((_kind(s), s.module_path) for s in self.inner)
        spare = Counter(_kind(s) for s in self.unseen if _kind(s) != "module")
        made: Counter[tuple[str, str]] = Counter()
        first, count = None, 0
        for seen in self.calls:
            key = (seen.kind, seen.path)
            made[key] += 1
            if made[key] > recorded[key] and spare[seen.kind] > 0:
                spare[seen.kind] -= 1
            elif made[key] > recorded[key]:
                count += 1
                if first is None:
                    name = seen.kind.removeprefix("function:") if seen.kind != "module" else next(
                        s.name for s in self.inner if _kind(s) == "module" and s.module_path == seen.path)
                    first = (name, seen.path, made[key] - 1, recorded[key])
        return UnrecordedCall(*first, count=count) if first is not None else None

    def compare(self) -> list[InnerStep]:
        """Pair recorded inner steps with replayed calls (by key and order) and compare outputs."""
        results = []
        for step, seen in self._pairs():
            if seen is None and not self._seeable(step):
                self.unseen.append(step)
            elif seen is None:
                results.append(InnerStep(step, False, reason="recorded, but not called during the replay"))
            elif seen.raised is not None or step.extra.get("exception"):  # one of them raised: which, against which
                recorded = (step.extra.get("exception") or {}).get("type")
                if seen.raised is not None and seen.raised == recorded:
                    results.append(InnerStep(step, True, reason=f"raised {recorded.split(':')[-1]}, as recorded"))
                elif seen.raised is not None:
                    was = f"raised {recorded.split(':')[-1]}" if recorded else "returned"
                    results.append(InnerStep(step, False, reason=f"raised {seen.raised.split(':')[-1]} during the "
                                             f"replay; the recorded call {was}"))
                else:
                    results.append(InnerStep(step, False, reason=f"the recorded call raised {recorded.split(':')[-1]}; "
                                             "the replayed one returned"))
            elif seen.outputs is None:
                results.append(InnerStep(step, False, reason="raised during the replay"))
            else:
                diffs = _diffs(step, ("output",), seen.outputs)
                results.append(InnerStep(step, all(d.match for d in diffs), diffs))
        return results

    def compare_backward(self, param_grads: dict[str, torch.Tensor], root_path: str,
                         outer: int | None = None) -> list[InnerStep]:
        """After a backward replay: each inner step's backward (grad outputs, grad inputs, parameter
        grads) against its recorded backward step, the one of the pass of the outer backward step
        ``outer`` (a retained graph's second pass records another). A recorded parameter grad that is
        the call's own share (1.11) is compared with the share the replay summed for that call; one
        that is a total, with the replayed step's grad of the parameter (``param_grads``), but for a
        module called more than once in the outer call (see ``_param_grads``)."""
        rec = self.inner[0].rec if self.inner else None
        if rec is None:
            return []
        forward_of = np.asarray(rec.rank.column("steps/forward"))
        parent_of = np.asarray(rec.rank.column("steps/parent"))

        def in_pass(index: int) -> bool:  # a backward step of the outer one's pass: its parents lead to it
            while index > outer:
                parent = int(parent_of[index])
                if parent >= index:  # (damaged: a parent begins before its child)
                    return False
                index = parent
            return index == outer

        outer_recorded = {r.name for r in Step(rec, outer).records if r.role == "param_grad"} \
            if outer is not None else None
        pairs = self._pairs()
        calls = Counter(step.module_path for step, seen in pairs if seen is not None and seen.kind == "module")
        if calls[root_path]:  # a recursion: the replayed call is one more call of the root's parameters
            calls[root_path] += 1
        results = []
        for step, seen in pairs:
            hits = np.flatnonzero(forward_of == step.index)
            if not len(hits):
                continue  # no backward was recorded for this call (its outputs needed no grad)
            if outer is not None:  # the one of the outer step's pass: none when no gradient reached it there
                after = [h for h in hits.tolist() if h > outer]
                hits = [h for h in after if in_pass(h)] or [h for h in after if parent_of[h] < 0][:1]
                if not hits:
                    continue
            back = Step(rec, int(hits[0]))
            if seen is None and not self._seeable(step):
                self.unseen.append(back)
                continue
            if seen is None:
                results.append(InnerStep(back, False, reason="recorded, but not called during the replay"))
                continue
            grads, left_out = self._param_grads(step, seen, back, param_grads, root_path, calls[step.module_path],
                                                outer_recorded)
            values = {**{f"grad_output:{k}": v for k, v in seen.grad_outputs.items()},
                      **{f"grad_input:{k}": v for k, v in seen.grad_inputs.items()},
                      **{f"network_grad:{k}": v for k, v in seen.grad_inputs.items()},
                      **{f"param_grad:{k}": v for k, v in grads.items()}}
            diffs = [d for d in _diffs(back, ("grad_output", *layout.GRAD_ROLES), values, keyed=True)
                     if not (d.role == "param_grad" and d.name in left_out)]
            results.append(InnerStep(back, all(d.match for d in diffs), diffs))
        return sorted(results, key=lambda r: r.step.index)  # backward runs inner steps in reverse


    def _param_grads(self, step: Step, seen: _Seen, back: Step, totals: dict[str, torch.Tensor], root_path: str,
                     calls: int, outer_recorded: set[str] | None = None) -> tuple[dict[str, torch.Tensor], set[str]]:
        """An inner module call's parameter grads to compare with its backward step's records, by
        record name, and the names left out. A record of its own share (``own_grads``, 1.11) is
        compared with the share the replay's hooks summed for the call (``_follow_params``); one of
        the total the pass accumulated, with the replayed step's grad of that parameter (``totals``,
        by the root's names: a tied weight's is under the name it was recorded by), but where the
        module ran more than once in the call, each call's total then being no replay's, and where the
        replayed step recorded no grad of that parameter (``outer_recorded``, its param_grad record names):
        the total is then all other code's (a critic's loss terms, where its call inside a gradient penalty
        sent its bias nothing)."""
        if seen.kind != "module":
            return {}, set()
        own_names = back.extra.get("own_grads")
        own_names = set(own_names) if isinstance(own_names, list) else set()
        module = self._modules.get(seen.path)
        if module is None:  # (no root: no module call is seen) the root's names under the module's path
            rel = step.module_path[len(root_path):].lstrip(".") if step.module_path.startswith(root_path) else ""
            prefix = f"{rel}." if rel else ""
            named = {name[len(prefix):]: name for name in totals if name.startswith(prefix)}
        else:
            named = {name: self._outer_names.get(id(p), "") for name, p in module.named_parameters()}
        grads: dict[str, torch.Tensor] = {}
        for name, outer in named.items():
            if name in own_names and name in seen.own:
                grads[name] = seen.own[name]
            elif outer in totals and not (calls > 1 and own_names):
                grads[name] = totals[outer]
        left_out = {r.name for r in back.records if r.role == "param_grad" and r.name not in grads} \
            if calls > 1 and own_names else set()
        if outer_recorded is not None:
            left_out |= {r.name for r in back.records if r.role == "param_grad" and r.name not in grads
                         and r.name not in own_names and named.get(r.name) not in outer_recorded}
        return grads, left_out


def _shared_paths(root: torch.nn.Module, root_path: str, inner: list[Step]) -> dict[str, str]:
    """``{rel: recorded path}`` for the submodules of the rebuilt ``root`` whose recorded inner steps the
    recorder named by a path outside ``root_path``: a module the model holds too and reached first there
    (a gradient penalty's ``self.D = model.D``, recorded at ``D``, runs at ``gp.D``). The recording names
    no other path of a module, so each such step is paired with the one submodule of its class not at a
    recorded path (of several, the one whose own name is the recorded path's last part); none where that
    is still ambiguous: its call is then "not called", as before."""
    if not root_path:
        return {}
    below = f"{root_path}."
    outside: dict[str, str] = {}  # recorded path -> its module's class (qualified name)
    for s in inner:
        path = s.module_path
        if s.definition.get("kind") == "module" and path != root_path and not path.startswith(below):
            doc = s._doc("module")
            cls = doc.get("class") if isinstance(doc, dict) else None
            if isinstance(cls, str):
                outside.setdefault(path, cls.rpartition(":")[2])
    if not outside:
        return {}
    at_recorded = {s.module_path for s in inner}
    free = [(rel, skeleton.own_class(sub).__qualname__) for rel, sub in root.named_modules()
            if rel and join_path(root_path, rel) not in at_recorded]
    out: dict[str, str] = {}
    for path, cls in outside.items():
        fits = [rel for rel, c in free if c == cls and rel not in out]
        if len(fits) > 1:
            fits = [rel for rel in fits if rel.rpartition(".")[2] == path.rpartition(".")[2]]
        if len(fits) == 1:
            out[fits[0]] = path
    return out


def _recorded_classes(inner: list[Step]) -> dict[str, str]:
    """``{recorded path: its module's class (qualified name)}`` of the inner module steps."""
    out: dict[str, str] = {}
    for s in inner:
        if s.definition.get("kind") == "module":
            doc = s._doc("module")
            cls = doc.get("class") if isinstance(doc, dict) else None
            if isinstance(cls, str):
                out.setdefault(s.module_path, cls.rpartition(":")[2])
    return out


def _kind(step: Step) -> str:
    """How a replayed call of ``step`` is keyed: "module", or "function:<name>"."""
    return "module" if step.definition.get("kind") == "module" else f"function:{step.name}"


def _written(step: Step | None, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters whose "after:<parameter>" records ``step`` holds (its recorded call changed
    them in place), by name: compared as the replayed call leaves them."""
    if step is None:
        return {}
    now = dict(module.named_parameters())
    changed = {r.name for r in step.records if r.role == "output"}
    return {r.name: now[r.name] for r in step.records
            if r.role == "param" and r.name in now and f"{layout.AFTER_PREFIX}{r.name}" in changed}


def _after(args: Any, kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A call's tensor arguments as it left them, copied, by the names of the "after:<input>" records
    of the inputs a call changes in place."""
    return {f"{layout.AFTER_PREFIX}{k[2:]}": v for k, v in tensors_by_name(
        {"args": list(args), "kwargs": kwargs}, "@", copy=True, grads=True).items()}


def _diffs(step: Step, roles: tuple[str, ...], values: dict[str, torch.Tensor], keyed: bool = False) -> list[Diff]:
    """``step``'s records of ``roles`` against the replayed values ("after:<input>" records: where
    the replay has them)."""
    return [compare_record(step.rec.rank, r, values.get(f"{r.role}:{r.name}" if keyed else r.name),
                           "not produced during the replay") for r in step.records if r.role in roles
            and (keyed or not r.name.startswith(layout.AFTER_PREFIX) or r.name in values)]


def _snapshot(output: Any) -> dict[str, torch.Tensor]:
    """The output's tensors by record name, copied (later in-place changes must not show). Under a
    torch.func transform (an inner step called under vmap): the tensors its wrappers hold, a vmap's
    whole batch, as the recorder recorded them (a wrapper is no tensor once the transform returns)."""
    if not transforms.active():
        return tensors_by_name(output, "output", copy=True)
    with transforms.outside():
        return {n: transforms.plain(t)[0].detach().clone() for n, t in tensors_by_name(output, "output").items()}
