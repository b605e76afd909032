"""``replayer.replay``: run one recorded step again, alone, and compare it with the recording.

    res = replayer.replay(rec, "Eq. 2@iter=17#3")
    res.match                      # every output bit for bit
    res.diffs["output"].max_ulp    # how far off, where not
    res.warnings                   # drift, settings that could not be applied, likely causes

A forward step is rebuilt (its module from the recorded skeleton or constructor arguments, its
function by import reference), given its recorded inputs, parameters and buffers, and called under
its recorded RNG states and settings; the caller's own come back afterwards. A backward step runs
its forward the same way and then ``torch.autograd.grad`` from the recorded grad outputs, and
compares grad inputs and parameter grads. Replaying a step that encloses other steps also compares
each inner step (``res.inner``, ``res.first_divergence``; inner calls the replay made beyond the
recorded ones: ``res.unrecorded_inner``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import inspect
import math
import os
import random
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map

from recorder import capture, jsonval, skeleton, snapshot, taps
from recorder.annotate import bound_wrapper
from recorder.errors import NewerSchemaError, NotOnThisMachine, PdbgError, ReplayError, UnknownTagError, brief
from recorder.payload import dtype_name, overlaps_itself
from recorder.store import layout
from recorder.store.reader import TensorRecord

from . import collectives, compare, distributions, intervene, placing, state
from .arguments import linked_outside, module_arguments, unrecorded_arguments, unrecorded_outputs, unseen_writes
from .bisect import exception_line
from .code import SESSION_SCRIPT, CodeLoader, late_imports, projects, session_statement, submodule_entries
from .compare import Diff, compare_record, stats_dict, tensors_by_name
from .nested import InnerStep, InnerTap, UnrecordedCall, descendants
from .rebuild import Builder, load_state, unresolved
from .recording import Recording, Step, join_path, opened, paper_reference, skeleton_modules

NOTHING_COMPARED = ("the step returned no tensor and changed none of its inputs, parameters or buffers in place, "
                    "which is what a replay compares: nothing was compared")
UNRECORDED_OUTPUT = ("the step's output was not recorded as data, which a replay compares by its type alone: {}; and "
                     "the step changed none of its inputs, parameters or buffers in place: nothing was compared")


# Modules that only spread their module's work over processes: replayed alone they would communicate,
# and what they compute is their module's.
_WRAPPERS = {"torch.nn.parallel.distributed:DistributedDataParallel": "DistributedDataParallel"}


@dataclass
class ReplayResult:
    """The outcome of replaying one step."""

    step: Step
    match: bool
    outputs: list[Diff]  # forward: the outputs; backward: grad inputs and parameter grads
    warnings: list[str] = field(default_factory=list)
    environment_differences: list[str] = field(default_factory=list)
    rebuilt: dict[str, str] = field(default_factory=dict)  # module path -> "skeleton" | "constructor"
    inner: list[InnerStep] = field(default_factory=list)
    unrecorded_inner: UnrecordedCall | None = None  # inner calls the replay made beyond the recorded ones
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # the replayed tensors by name
    exception: str | None = None  # what the replayed call raised, if it raised
    intervention: dict[str, Any] | None = None  # the swaps, edits and overrides applied, if any
    # parts of the output not recorded as data, not compared (their type alone is): "output.1 (a torch Independent)"
    not_compared: list[str] = field(default_factory=list)
    # generators the step drew from whose state the recording does not hold ("GENS[0] (torch Generator)"): a match
    # holds only where the replay found them as the recorded call did (pdbg verify's order), not for the call alone
    unrecorded_rngs: list[str] = field(default_factory=list)
    # inputs the replayed call changed in place where the recording holds no change of them: written through .data
    # (which leaves the version counter as it was) in a tensor whose bits the recorder does not keep to see that (over
    # 1 MiB, or not on the CPU): what the recorded call left them is not known, so not compared ("args.0")
    unseen_writes: list[str] = field(default_factory=list)
    # a bundle replayed with the code it carries (use_bundled_source): those files, which ran instead of the code here
    bundled_source: list[str] = field(default_factory=list)

    @property
    def diffs(self) -> dict[str, Diff]:
        return {d.name: d for d in self.outputs}

    @property
    def by_statistics(self) -> list[str]:
        """The tensors that matched by their statistics only, not bit for bit (a sparse result whose parts the
        recording did not keep: its stored values' statistics); an inner step's as "output of step 1 (name)"."""
        return [d.name for d in self.outputs if d.match and d.by_statistics] + \
            [f"{d.name} of step {s.step.index} ({s.step.name})" for s in self.inner for d in s.diffs
             if d.match and d.by_statistics]

    @property
    def compared(self) -> bool:
        """Whether the replay had anything to compare with the recording: what the step returns and
        what it changes in place (its inputs, parameters, buffers); a step that does neither with a
        tensor has nothing."""
        return bool(self.outputs or self.inner or self.unrecorded_inner or self.exception
                    or (self.step.extra.get("exception") and not _stopped(self)))

    @property
    def stopped(self) -> bool:
        """Whether the recording stopped training inside this step (``on_anomaly="stop"``, a breakpoint) and
        the replay ran it through: it has no output to compare, the steps inside it have."""
        return _stopped(self)

    @property
    def nothing_compared(self) -> str:
        """Why nothing was compared (where ``compared`` is False): the step returned no tensor, or what
        it returned was not recorded as data."""
        if _stopped(self):
            said = exception_line(self.step.extra["exception"])
            return (f"the recording stopped training inside this step ({said}), "
                    "so it returned no output, and no step inside it was compared: nothing was compared")
        return UNRECORDED_OUTPUT.format(", ".join(self.not_compared)) if self.not_compared else NOTHING_COMPARED

    @property
    def unseen_text(self) -> str:
        """What ``unseen_writes`` leaves out of the comparison, in words ("" where nothing)."""
        if not self.unseen_writes:
            return ""
        them = "them" if len(self.unseen_writes) > 1 else "it"
        return (f"{', '.join(self.unseen_writes)} as the call left {them} (changed through .data, which the recording "
                f"does not see in a tensor over {layout.KEPT_INPUT_BYTES >> 20} MiB or not on the CPU)")

    @property
    def first_divergence(self) -> InnerStep | None:
        """The first inner step, in execution order, whose replay differs from its recording."""
        return next((s for s in self.inner if not s.match), None)

    def to_json(self) -> dict[str, Any]:
        """The ``pdbg replay --json`` object (README, "Command line")."""
        first = self.first_divergence
        return {"step": self.step.to_json(), "match": self.match, "compared": self.compared,
                "outputs": [d.to_json() for d in self.outputs], "warnings": self.warnings,
                "environment_differences": self.environment_differences, "rebuilt": self.rebuilt,
                "inner": [s.to_json() for s in self.inner],
                "first_divergence": first.to_json() if first else None,
                "unrecorded_inner": self.unrecorded_inner.to_json() if self.unrecorded_inner else None,
                "exception": self.exception,
                "intervention": self.intervention, "not_compared": self.not_compared,
                "unseen_writes": self.unseen_writes, "bundled_source": self.bundled_source}

    def __repr__(self) -> str:
        changed = self.intervention is not None  # (said as pdbg replay says it: an edit is meant to differ)
        verdict = ("nothing compared" if not self.compared else ("NO CHANGE" if changed else "match") if self.match
                   else "MISMATCH, as the intervention makes it" if changed else "MISMATCH")
        n = len(self.outputs)
        return f"<ReplayResult step {self.step.index}: {verdict}, {n} output{'s' if n != 1 else ''} compared>"

    def _repr_html_(self) -> str:
        from . import notebook

        return notebook.replay_result(self)


class Replayer:
    """Replays steps of one recording; keeps the code it loaded (a script is loaded once)."""

    def __init__(self, rec: Recording, *, script: str | os.PathLike[str] | None = None,
                 use_bundled_source: bool = False) -> None:
        self.rec = rec
        bundled = None
        if use_bundled_source:
            if rec.bundle_info is None:
                raise ReplayError(f"{rec.reader.label} is not a bundle: there is no bundled source to use")
            bundled = rec.bundle_info.get("sources") or {}
        # (a bundle is a recording from elsewhere: its code is never this process's own __main__;
        # the sources it carries are shown where files are not here, and run only when asked)
        spare = (rec.bundle_info or {}).get("sources") or {} if bundled is None else None
        modules = (rec.bundle_info or {}).get("modules") if bundled is not None else None
        self.loader = CodeLoader(rec.run_info, script, bundled, live_main=rec.bundle_info is None, spare=spare,
                                 bundled_modules=modules if isinstance(modules, dict) else None)
        self._env: list[str] | None = None
        self._repository: str | None | bool = False  # what of the code's repository changed (False: not asked)
        # per loaded step code: (it, find_global_rngs of it, snapshot.unheld_rngs of it)
        self._rng_places: dict[int, tuple[Any, Any, list[str]]] = {}
        # module-level names the replay in progress bound as recorded: (namespace, name, what it held)
        self._rebound: list[tuple[dict[str, Any], str, Any]] = []

    def replay(self, which: int | str | Step, *, threads: int | None = None, nested: bool = True,
               around: Around | None = None, swap: dict[str, Any] | None = None, edit: dict[str, Any] | None = None,
               settings: dict[str, Any] | None = None, seed: int | None = None, stopped: bool = False
               ) -> ReplayResult:
        """Replay one step (see :func:`replay`). ``around(stage)`` gives a context manager entered around
        the call ("forward"; for a backward step "forward" then "backward" around the gradients).
        ``stopped``: a backward step whose pass raised before it sent any gradient (anomaly mode's "returned
        nan values") runs its backward all the same, from its recorded grad outputs to its forward's inputs
        and parameters, with nothing to compare (operation-level bisection looks at what it runs)."""
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or \
                    not 1 <= threads <= state.MAX_THREADS:
                raise ReplayError(f"threads={threads!r:.40}: give a number of intra-op threads from 1 to "
                                  f"{state.MAX_THREADS} (an int), or None for the recorded count")
            threads = int(threads)
        step = self.rec.step(which)
        wrapper = _WRAPPERS.get(str(step.definition.get("ref")))
        if wrapper is not None:
            raise ReplayError(f"{wrapper} is a wrapper that communicates with the other ranks in its forward and "
                              "backward: it is not replayed; replay the module it wraps (the steps at "
                              f"{join_path(step.module_path, 'module')}), recorded with --modules or as paper steps")
        self._around = around or _no_context
        self._newer_than_this(step)
        lazy = _lazy_refusal(step)
        if lazy is not None:  # (before its code runs: a coroutine made and never awaited would warn)
            raise ReplayError(lazy)
        self.plan = self._plan(step, swap, edit, settings, seed)
        backward = step.phase == "backward"
        try:
            with state.neutral({**step.settings, **self.plan.settings}), self.loader.sources(), self._bindings():
                result = self._backward(step, threads, nested, stopped) if backward else \
                    self._forward(step, threads, nested)
        except UnknownTagError as exc:
            if not self.rec.reader.newer:  # a tag no version wrote: damage
                raise
            raise self._too_new(step, f"holds the tag {exc.tag!r:.60}") from None
        result.warnings.extend(self.plan.notes)
        for c in self.plan.edits:
            if not c.used:
                result.warnings.append(_made_by_the_call(step, c) or
                                       f"{c.key}: matched nothing that ran during the replay")
            elif c.reshaped:
                result.warnings.append(c.reshaped)
        for unused in [s.key for s in self.plan.swaps if not s.used]:
            result.warnings.append(f"{unused}: matched nothing that ran during the replay")
        if not self.plan.empty:
            result.intervention = self.plan.describe()
        if self._env is None:
            self._env = state.environment_differences(self.rec.run_info, step.settings)
        result.environment_differences = list(self._env)
        if threads is not None and step.settings.get("num_threads") not in (None, threads):
            recorded = step.settings.get("num_threads")
            result.warnings.append(f"threads: recorded {recorded}, replayed with {threads} (forced)")
            if result.compared and not result.match:
                result.warnings.append(f"the thread count differs from the recording ({recorded} -> {threads}): a "
                                       "likely cause of the difference (reductions split work by thread)")
        result.warnings.extend(self.loader.notes)
        self.loader.notes.clear()
        result.bundled_source = sorted(self.loader.bundled)
        if backward and not self.plan.empty and result.compared and not result.match and \
                layout.SECOND_ORDER_NOTE in step.extra.get("notes", []):
            self._second_order_unedited(step, threads, nested)
        return result

    def _second_order_unedited(self, step: Step, threads: int | None, nested: bool) -> None:
        """An intervention on a second-order backward step whose replay differs: refused as the step is
        without it when the replay without it differs too (the second-order terms it leaves out, not the
        intervention, would be what the comparison shows)."""
        plan, around = self.plan, self._around
        try:
            self.replay(step, threads=threads, nested=nested)
        except ReplayError as exc:
            if str(exc) == _second_order(step):
                raise ReplayError(f"{exc}; a replay with an intervention is refused alike: what it changes cannot be "
                                  "told from what those terms change") from None
            raise
        finally:
            self.plan, self._around = plan, around

    def _networks_unfollowed(self, modules: list[str]) -> str:
        """Why a backward step whose forward was given networks (``modules``: their places) holds no gradient of
        their parameters: a recording before schema 1.31 does not follow them; since, none of them required grad
        (frozen) or the call's graph sent them none."""
        these = f"module{'s' if len(modules) > 1 else ''} its forward was given, {', '.join(modules[:3])}"
        if self._since(layout.NETWORK_GRADS_SINCE):
            return f"the parameters of the {these}, received no gradient from the call: frozen, or not used with grad"
        return (f"the gradients of the parameters of the {these}, are not followed by a recording before schema "
                f"1.31: record again with this PaperDebugger, or make the step a paper-step module holding "
                f"{'them as submodules' if len(modules) > 1 else 'it as a submodule'}, to compare them")

    def _newer_than_this(self, step: Step) -> None:
        """Refuse a step of a newer minor schema's recording that holds what that schema added and this one
        cannot read (a tensor role; tags are found as they are decoded): that step alone, naming it."""
        if not self.rec.reader.newer:
            return
        fwd = self.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
        unknown = sorted({r.role for s in {step, fwd} for r in s.records if r.role.startswith(layout.UNKNOWN_ROLE)})
        if unknown:
            raise self._too_new(step, f"holds tensor records of a role this PaperDebugger does not know "
                                      f"({', '.join(unknown)})")

    def _too_new(self, step: Step, what: str) -> NewerSchemaError:
        """Why a step of a newer minor schema's recording cannot be replayed here: ``what`` it holds."""
        reason = (f"{what}: a newer PaperDebugger recorded it (schema {self.rec.reader.schema_version}; this one "
                  f"reads {layout.SCHEMA_VERSION}), and this one cannot replay it; upgrade paperdebugger to replay it")
        return NewerSchemaError(f"step {step.index} ({step.name}) {reason}", f"the step {reason}")

    def _plan(self, step: Step, swap: dict[str, Any] | None, edit: dict[str, Any] | None,
              settings: dict[str, Any] | None, seed: int | None) -> intervene.Plan:
        plan = intervene.Plan(edits=intervene.parse_edits(edit), seed=intervene.parse_seed(seed))
        plan.settings = intervene.parse_settings(settings, step.settings)
        if swap is not None and not isinstance(swap, dict):
            raise intervene.InterventionError(f"swap: give a dict of keys and replacements, not {type(swap).__name__}")
        for key, given in (swap or {}).items():
            text = given if isinstance(given, str) else None
            resolved = given
            if text is not None:
                try:
                    resolved = self.loader.resolve(text, needed_by="the swap")
                except ReplayError as exc:
                    whose = "of the step itself ('.')" if key == "." else key
                    raise intervene.InterventionError(f"swap {whose}: {exc}") from None
            elif not callable(given):
                raise intervene.InterventionError(f"swap {key}: give an import reference, a class or a callable, "
                                                  f"not {type(given).__name__}")
            plan.swaps.append(intervene.Swap(key, resolved, text))
        if plan.swaps:
            self._check_swap_keys(step, plan.swaps)
        own = [c for c in plan.edits if c.step is None]
        if own:
            fwd = self.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
            names = {r.name for r in fwd.records if r.role in ("input", "param", "buffer")}
            if step.phase == "backward":
                names |= {f"grad_output:{r.name}" for r in step.tensors("grad_output")}
                names |= {r.name for r in step.tensors("grad_output")} - names
            others = {k: v for k, v in fwd.non_tensors().items() if k != "output"}
            for c in own:
                role, _, bare = c.tensor.partition(":")  # ROLE:NAME, as step.tensor takes it ("param:fc.weight")
                if c.tensor not in names and role in ("input", "param", "buffer") and bare in names:
                    c.tensor = bare
                kind = others.get(c.tensor)
                if c.tensor in names or (kind or "").startswith("a numpy ") and not kind.endswith("as data"):
                    continue
                if kind is not None:
                    raise intervene.InterventionError(f"edit {c.key}: {c.tensor} of step {step.index} is {kind}; an "
                                                      "edit changes a tensor or a numpy value")
                raise intervene.InterventionError(f"edit {c.key}: step {step.index} has no tensor {c.tensor!r}; it has "
                                                  f"{', '.join(sorted(names)) or 'no tensors'}{fwd.others_text()}")
        aimed = [c for c in plan.edits if c.step is not None]
        if aimed:
            fwd = self.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
            inner = descendants(fwd)
            named: dict[tuple[str, int], str] = {}  # (tensor, inner step) -> the key that names it
            # the replayed module's own parameters and buffers edited by their paths (attn.qkv.weight)
            state = {c.tensor: c.key for c in own if not c.tensor.startswith(("args.", "kwargs.", "grad_output"))}
            for c in aimed:
                hits = [s for s in inner if intervene.matches(c.step, s, fwd.module_path)]
                for s in hits:  # a relative and a full module path, a name and a label: one tensor, two changes
                    other = named.setdefault((c.tensor, s.index), c.key)
                    below = s.module_path[len(fwd.module_path):].lstrip(".") if fwd.module_path else s.module_path
                    path = f"{below}.{c.tensor}" if below else c.tensor
                    if other == c.key and not c.tensor.startswith(("args.", "kwargs.")) and path in state:
                        other = state[path]  # (the step's parameter by its path, and the inner step's by its own)
                    if other != c.key:
                        raise intervene.InterventionError(
                            f"edit {c.key}: names the tensor edit {other} names ({c.tensor} of step {s.index}, "
                            f"{_selector_name(s)}#{s.call}); give each tensor one change")
                if not hits:
                    there = sorted({f"{_selector_name(s)}#{s.call}" for s in inner})
                    raise intervene.InterventionError(
                        f"edit {c.key}: no step inside step {step.index} is {c.step!r}; " + (
                            f"the steps inside it are {', '.join(there[:12])}" + (" ..." if len(there) > 12 else "")
                            if there else "it has no steps inside"))
                inputs = {r.name for s in hits for r in s.records if r.role == "input"}
                if c.tensor.startswith(("args.", "kwargs.")) and c.tensor not in inputs:
                    raise intervene.InterventionError(
                        f"edit {c.key}: {c.step} has no input {c.tensor!r}; its recorded inputs are "
                        f"{', '.join(sorted(inputs)) or 'none'}")
        return plan

    def _buffers_after(self, step: Step, module: torch.nn.Module | None, warnings: list[str]) -> list[Diff]:
        """The buffers the recorded call changed in place (a BatchNorm's running statistics), as the
        replay left them, against what the module's next call in the recording found. Not in a run of
        several processes (DistributedDataParallel broadcasts buffers between calls). A buffer the
        replay left as it was, though the next call found it changed, was changed between the calls
        (a temperature the loop anneals, ``model.to(torch.bfloat16)``): not compared, and said so;
        under an intervention it is compared (leaving it is what the change did). Nor is one that
        code between the calls wrote or replaced, whatever the call did to it: one the next call
        notes so (the recorder watches buffers' version counters: a checkpoint's load_state_dict),
        or one the next call found in another dtype, shape or device than the call left it
        (``model.double()``, in a recording made before that note). Spectral norm's power-iteration vectors
        (``parametrizations.weight.0._u``, the hook-based ``weight_u``) are compared too, also where the
        replay left them as recorded; the buffers of a module with other hooks (a pruning mask, which
        pruning again replaces between calls; hooks the replay does not remake) are not."""
        before = {r.name: r for r in step.records if r.role == "buffer"}
        if module is None or not before or int(self.rec.run_info.get("world_size") or 1) > 1:
            return []
        following = next_call(self.rec, step)
        now = dict(module.named_buffers(remove_duplicate=False))
        if following is None:  # what the call wrote has nothing recorded after it to be compared with
            changed = [name for name, r in before.items() if r.has_payload and name in now
                       and not compare_record(step.rec.rank, r, now[name], "").match]
            if changed:
                warnings.append(f"not compared: {', '.join(changed)}, which the call changed: no later call of "
                                "this module was recorded, to say what it left")
            return []
        written = following.noted(layout.BUFFERS_WRITTEN_NOTE)  # (escaped, as the recorder wrote them)
        modules = list(skeleton_modules(step._doc("module"), ""))
        in_call = _written_in_call(modules)
        hooked = [p for p, doc in modules if doc.get("other_hooks") or doc.get("hooks") and not any(
            _is_spectral(h) for h in doc["hooks"])]
        diffs, outside, between = [], [], []
        for r in following.records:
            was = before.get(r.name)
            if r.role != "buffer" or was is None or r.name not in now or not (r.has_payload and was.has_payload):
                continue
            if any(r.name.startswith(f"{p}." if p else "") for p in hooked):
                continue
            if r.payload == was.payload:  # the same bytes before and after: the call left it alone
                continue
            if self.plan.empty and not r.name.startswith(in_call) \
                    and compare_record(step.rec.rank, was, now[r.name], "").match:
                outside.append(r.name)  # the same code left it: changed between the calls, not by this one
                continue
            if r.name.encode("unicode_escape").decode() in written:
                between.append(r.name)
                continue
            left = (dtype_name(now[r.name].dtype), tuple(now[r.name].shape))
            if left == (was.dtype, tuple(was.shape)) and (r.dtype, tuple(r.shape), r.device) != \
                    (was.dtype, tuple(was.shape), was.device):  # converted or moved between the calls
                between.append(f"{r.name} (left {was.dtype}{list(was.shape)} on {was.device}, found "
                               f"{r.dtype}{list(r.shape)} on {r.device})")
                continue
            d = compare_record(step.rec.rank, r, now[r.name], "")
            d.name = f"after:{r.name}"
            if not d.match:
                d.reason = (f"{d.summary().split(': ', 1)[-1]}: against what the next call, step {following.index}, "
                            "found (or something between the two calls changed it)")
            diffs.append(d)
        if outside:
            warnings.append(f"not compared: {', '.join(outside)}, changed between this call and the next (step "
                            f"{following.index}) by code outside the step, not by the call (the replay left "
                            f"{'them' if len(outside) > 1 else 'it'} as recorded)")
        if between:
            warnings.append(f"not compared: {', '.join(between)}, written or replaced between this call and the next "
                            f"(step {following.index}) by code outside the step (load_state_dict, .to(), a reset): "
                            "what that call found is not this call's result")
        return diffs

    @contextlib.contextmanager
    def _saved_hooks(self, step: Step, warnings: list[str] | None = None) -> Iterator[None]:
        """Around a replayed call: the saved-tensor hooks it ran under, set outside it when recorded
        (``torch.autograd.graph.saved_tensors_hooks``: a loop packing saved activations to bfloat16), so
        that its backward reads what they made of what it saved, as the recorded one did. Hooks a replay
        may not run (not functions of the training code's own, found by name) are named in ``warnings``
        (a backward replay's) as the likely cause of a difference; torch's ``save_on_cpu``, lossless, needs
        none."""
        doc = step.extra.get("saved_tensors_hooks")
        if isinstance(doc, dict) and doc.get("checkpoint"):
            self._checkpoint_hooks_warning(doc, warnings)
            yield
            return
        hooks = self._hooks_of(doc, warnings) if isinstance(doc, dict) else None
        if hooks is None:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            yield

    @staticmethod
    def _checkpoint_hooks_warning(doc: dict[str, Any], warnings: list[str] | None) -> None:
        """A call inside activation checkpointing under saved-tensor hooks set outside the checkpoint: the
        checkpoint saved the arguments it recomputes from through them, and the recorded backward recomputed
        the call from what they made of those, which a replay of the call alone does not redo (applied
        around the call they would pack what the checkpoint kept exact); lossless ``save_on_cpu`` changes
        nothing."""
        refs = [str(p.get("ref")) if isinstance(p, dict) else "?" for p in (doc.get("pack"), doc.get("unpack"))]
        if warnings is None or all(ref.startswith(_SAVE_ON_CPU) for ref in refs):
            return
        warnings.append(f"the recorded call ran inside activation checkpointing under saved-tensor hooks set "
                        f"outside it (torch.autograd.graph.saved_tensors_hooks: pack {refs[0]}, unpack {refs[1]}): "
                        "the checkpoint saved the tensors it recomputes the call from through them, and the "
                        "recorded backward recomputed it from what they made of them, which the replay does not "
                        "(a likely cause of any difference in the backward)")

    def _hooks_of(self, doc: dict[str, Any], warnings: list[str] | None) -> tuple[Any, Any] | None:
        places = [doc.get("pack"), doc.get("unpack")]
        refs = [str(p.get("ref")) if isinstance(p, dict) else "?" for p in places]
        if all(ref.startswith(_SAVE_ON_CPU) for ref in refs):
            return None
        found, why = [], ""
        for place, ref in zip(places, refs):
            try:
                if not isinstance(place, dict) or place.get("function") is False:
                    raise ReplayError(f"{ref} is no function (a bound method or an object), which a replay cannot "
                                      "find again by name")
                file = place.get("file")
                fn = self.loader.resolve(ref, file if isinstance(file, str) else None)
                if not isinstance(fn, types.FunctionType) or not (ref.startswith("__main__:") or jsonval.may_bind(fn)):
                    raise ReplayError(f"{ref} is not a function of the training code's own, which alone a replay runs")
                found.append(fn)
            except ReplayError as exc:
                why = str(exc)
                break
        if not why:
            return found[0], found[1]
        if warnings is not None:
            warnings.append(f"the recorded call ran under saved-tensor hooks set outside it "
                            f"(torch.autograd.graph.saved_tensors_hooks: pack {refs[0]}, unpack {refs[1]}), which "
                            f"the replay could not apply ({why}): its backward read what they made of the tensors "
                            "its forward saved (a likely cause of any difference)")
        return None

    def _raised_hint(self, exc: BaseException | None, step: Step) -> str:
        """Why the replay of ``step`` raised ``exc`` where the recorded call did not, when the cause is known:
        a name a statement of the training script sets, which a replay left out; what the recording's older
        schema could not keep (a dict subclass before 1.13, a function as a module attribute before 1.6)."""
        if exc is not None and _RANDOMNESS_ERROR in str(exc) and step.extra.get("vmap") and \
                "vmap_randomness" not in step.extra:
            return ("the step drew random numbers under torch.func.vmap, and the recording does not say with which "
                    "randomness= (an older PaperDebugger did not record it, nor does one on a torch whose vmap does "
                    "not tell): the replay ran it with vmap's default, 'error'; record it again to replay it")
        if isinstance(exc, NameError) and exc.name in self.loader.skipped and self.loader.script == SESSION_SCRIPT:
            return session_statement(exc.name, self.loader.skipped.why.get(exc.name))
        if isinstance(exc, NameError) and exc.name in self.loader.skipped:
            return (f"{exc.name} is set at the top level of the training script {self.loader.script}, which has no "
                    "if __name__ == '__main__' guard, so a replay loads only its definitions; put the training under "
                    "such a guard and record again")
        if not isinstance(exc, AttributeError):
            return ""
        version = self.rec.reader.schema_version
        old = f"this recording is of schema {version}, which"
        fix = ("a limitation of the old format, not a difference in the step; record again with this version to "
               "replay it")
        if "'dict' object has no attribute" in str(exc) and layout.parse_version(version) < layout.MAPPINGS_SINCE:
            return (f"{old} kept a dict subclass (an EasyDict-style config read by attribute, an OrderedDict) as a "
                    f"plain dict, and the replay was given that plain dict; {fix} (1.13 keeps its class)")
        module = step._doc("module")
        for _, doc in skeleton_modules(module, ""):
            kind = (doc.get("unrecorded") or {}).get(exc.name) if isinstance(doc.get("unrecorded"), dict) else None
            since = _FUNCTIONS_SINCE.get(str(kind))
            if since is not None and layout.parse_version(version) < since:
                return (f"{old} could not keep a {kind.partition(':')[2]} as data (the module attribute "
                        f"{exc.name}), so the module was rebuilt without it; {fix} (since {since[0]}.{since[1]}, "
                        "torch's functions and paper steps are kept)")
        return ""

    def _unregistered_op(self, exc: BaseException | None) -> str | None:
        """Why a replay raised ``exc`` where the recorded call returned, when it is an operator missing from
        ``torch.ops`` in this process (torch's AttributeError on the namespace): registered when recorded by code a
        replay does not run (``import myops`` inside ``main()``). A refusal, not an outcome of the step's."""
        found = _NO_OP.match(str(exc)) if isinstance(exc, AttributeError) else None
        if found is None:
            return None
        script = self.loader.script if isinstance(self.loader.script, str) else None
        late = late_imports(script, self.loader.dirs, found[1]) if script else []
        by = f"{late[0][0]}, imported inside {late[0][1]}() of {Path(script).name} at line {late[0][2]}" \
            if late and script else "an import inside main(), say"
        return (f"the operator torch.ops.{found[1]}.{found[2]} is not registered in this process: code a replay does "
                f"not run registered it ({by}); import the module that registers it at module level (the script's "
                "top level, not main(), or the step's own file), or in Python before replaying (import "
                f"{late[0][0] if late else 'it'}, then replayer.replay)")

    def _check_swap_keys(self, step: Step, swaps: list[intervene.Swap]) -> None:
        """Refuse, before the replay, a swap key that names nothing the step holds: not the step
        itself, a module inside its module, nor a step inside it (a mistyped key read as "the fix
        changed nothing")."""
        fwd = self.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
        inner = descendants(fwd)
        paths = [p for p, _ in skeleton_modules(fwd._doc("module"), "") if p]
        for sw in swaps:
            key = sw.key
            if _names_step(key, fwd):
                continue
            if any(key in (p, join_path(fwd.module_path, p)) for p in paths):
                continue
            if any(intervene.matches(key, s, fwd.module_path) for s in inner):
                continue
            there = sorted({*paths, *(_selector_name(s) for s in inner)})
            raise intervene.InterventionError(
                f"swap {key}: names nothing in step {step.index} ({fwd.name}); give the step itself ('.'), " + (
                    f"a module or step inside it: {', '.join(there[:12])}" + (" ..." if len(there) > 12 else "")
                    if there else "which has no module or step inside"))

    def _own_swap(self, step: Step) -> intervene.Swap | None:
        """A swap aimed at the replayed step itself (its name, label, module path, or '.')."""
        return next((sw for sw in self.plan.swaps if _names_step(sw.key, step)), None)

    def _swap_inside(self, step: Step, module: torch.nn.Module, inner: list[Step]) -> torch.nn.Module:
        """Apply the swaps aimed at the step's module or its submodules (by path, or by inner step name)."""
        own = self._own_swap(step)
        recorded = list(dict(module.named_modules()))

        def targets_in(paths: list[str], sw: intervene.Swap) -> list[str]:
            if sw is own:
                return [""]
            return [rel for rel in paths if rel and sw.key in (rel, join_path(step.module_path, rel))] + [
                s.module_path[len(step.module_path):].lstrip(".") for s in inner
                if s.definition.get("kind") == "module" and sw.key in (s.name, s.paper.get("label"))]

        for sw in sorted(self.plan.swaps, key=lambda s: s is not own):  # the step's own first: the rest go inside it
            paths = dict(module.named_modules())
            targets = targets_in(list(paths), sw)
            if not targets and sw is not own and targets_in(recorded, sw):
                sw.used += 1  # (said here, not as a key that matched nothing)
                self.plan.notes.append(f"swap {sw.key}: {type(module).__qualname__}, the step's replacement, has no "
                                       f"submodule or step {sw.key}; nothing swapped there")
            for rel in dict.fromkeys(targets):
                if rel not in paths:  # a recorded inner step's module, not in the step's replacement
                    sw.used += 1  # (said here, not as a key that matched nothing)
                    self.plan.notes.append(f"swap {sw.key}: {type(module).__qualname__}, the step's replacement, has "
                                           f"no submodule {rel}; nothing swapped there")
                    continue
                original = paths[rel] if rel else module
                if not isinstance(sw.replacement, type) and not isinstance(original, torch.nn.Module):
                    continue
                doc = self._skeleton_of(step, rel)
                init = self._init_args(doc)
                held = {place[len(rel) + 1:] if rel else place: value for place, value in _held_states(step.rng).items()
                        if not rel or place.startswith(f"{rel}.")}
                new = intervene.swap_module(
                    original, sw.replacement, sw.key,
                    lambda cls, d=doc, k=sw.key, top=not rel, g=held: self._builder(g).build(
                        d, k, cls=cls, top_hooks_ran=top and self._own_hooks_ran(step)),
                    init, self.plan.notes)
                sw.used += 1
                if rel:
                    parent_name, _, leaf = rel.rpartition(".")
                    module.get_submodule(parent_name)._modules[leaf] = new
                else:
                    module = new
        return module

    def _builder(self, generators: dict[str, Any] | None = None) -> Builder:
        """A Builder of this recording's skeletons (before 1.16 their names were stored sorted); ``generators``:
        the states of the generators the module held, by place (``_held_states``)."""
        return Builder(self.loader, names_sorted=layout.parse_version(self.rec.reader.schema_version) < (1, 16),
                       generators=generators)

    def _skeleton_of(self, step: Step, rel: str) -> dict[str, Any]:
        doc = step._doc("module") or {}
        for part in rel.split(".") if rel else ():
            doc = (doc.get("children") or {}).get(part) or {}
        return doc

    def _init_args(self, doc: dict[str, Any]) -> tuple[list[Any], dict[str, Any]] | None:
        init = doc.get("init") if isinstance(doc, dict) else None
        if not isinstance(init, dict):
            return None
        args = jsonval.decode(init.get("args", []), resolve=self.loader.resolve)
        kwargs = jsonval.decode(init.get("kwargs", {}), resolve=self.loader.resolve)
        return None if unresolved([args, kwargs]) else (args, kwargs)

    def _edit_inner_state(self, step: Step, module: torch.nn.Module) -> None:
        """Edits of an inner module step's parameters or buffers (``attn/qkv.weight``): applied to
        the rebuilt submodule before the call. Edits of inner inputs happen as the call reaches them."""
        inner = [s for s in descendants(step if step.phase == "forward" else self.rec.step(step.forward))
                 if s.definition.get("kind") == "module"]
        for c in self.plan.edits:
            if c.step is None or c.tensor.startswith(("args.", "kwargs.")):
                continue
            targets = {s.module_path for s in inner if intervene.matches(c.step, s, step.module_path)}
            for path in sorted(targets):
                rel = path[len(step.module_path):].lstrip(".") if step.module_path else path
                sub = module.get_submodule(rel)
                owner_name, _, leaf = c.tensor.rpartition(".")
                owner = sub.get_submodule(owner_name) if owner_name else sub
                if leaf in owner._parameters and owner._parameters[leaf] is not None:
                    param = owner._parameters[leaf]
                    with torch.no_grad():
                        param.data = c.run(param.detach())
                elif leaf in owner._buffers and owner._buffers[leaf] is not None:
                    owner._buffers[leaf] = c.run(owner._buffers[leaf])
                else:
                    names = sorted(n for n, _ in [*sub.named_parameters(), *sub.named_buffers()])
                    raise intervene.InterventionError(f"edit {c.key}: {path} has no parameter or buffer {c.tensor!r}; "
                                                      f"it has {', '.join(names) or 'none'} (and its inputs, "
                                                      "args.N and kwargs.NAME)")
                c.used += 1

    def _edit(self, name: str, value: torch.Tensor, *aliases: str) -> torch.Tensor:
        """Apply the plan's edits of the replayed step's own tensor ``name`` (or one of its aliases)."""
        for c in self.plan.edits_for(None):
            if c.tensor == name or c.tensor in aliases:
                c.used += 1
                value = c.run(value)
        return value

    def _edit_numpy(self, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Apply the plan's edits of the replayed step's numpy arguments (``args.N``, ``kwargs.NAME``): the
        expression gets the value as a tensor (``x.clamp(min=1)``, ``torch.nan_to_num(x)``), and the call
        gets what it made back as numpy, of the recorded dtype (and, of the recorded shape, layout)."""
        for c in self.plan.edits_for(None):
            where, _, key = c.tensor.partition(".")
            place: Any = args if where == "args" and key.isdigit() and int(key) < len(args) else \
                kwargs if where == "kwargs" and key in kwargs else None
            at: Any = int(key) if place is args else key
            if place is None or not isinstance(place[at], (np.ndarray, np.generic)):
                continue
            was = place[at]
            try:
                x = torch.from_numpy(np.array(was, dtype=was.dtype.newbyteorder("=")))
            except TypeError:
                raise intervene.InterventionError(f"edit {c.key}: {c.tensor} is a numpy {was.dtype} "
                                                  f"{'array' if isinstance(was, np.ndarray) else 'value'}, which "
                                                  "torch cannot hold; an edit changes numbers") from None
            c.used += 1
            made = c.run(x).detach().cpu().numpy().astype(was.dtype)
            if isinstance(was, np.generic):
                place[at] = was.dtype.type(made.item()) if made.size == 1 else made
            elif made.shape == was.shape and not was.flags.c_contiguous:
                place[at] = jsonval.as_strides(np.ascontiguousarray(made), list(was.strides))
            else:
                place[at] = np.ascontiguousarray(made)
        return args, kwargs

    def _likely_causes(self, result: ReplayResult, call: _Call) -> None:
        """A replay that did not match: what the recording did not hold that may be why. Attributes a
        module's constructor made that could not be recorded (a tensor attribute training changed, not
        a buffer); where nothing else is named, the code's repository not as recorded (a helper the
        step calls); module-level data the step's code reads. Where an intervention was applied, only the
        first: the difference is what the intervention made (a fix's file is written after the recording,
        and its constants are not the recording's)."""
        if result.match:
            return
        if call.unrecorded:
            result.warnings.append(f"attributes that could not be recorded as data came from the module's "
                                   f"constructor ({'; '.join(call.unrecorded)}); if training changed them after "
                                   "construction (a tensor kept as an attribute, not a buffer), the replay used other "
                                   "values (a likely cause of any difference)")
        if not result.compared or not self.plan.empty:
            return
        if call.code_drift:  # a submodule's class whose code is not what the recorded call ran
            drifted = set(call.code_drift)
            result.warnings[:] = [f"{w}: a likely cause of the difference" if w in drifted else w
                                  for w in result.warnings]
        if call.unchecked:
            result.warnings.append(f"the step's code reads the module-level {'; '.join(call.unchecked)}, whose "
                                   "recorded binding a replay cannot import to compare with the one loading the "
                                   "code makes: if the training script rebinds it as it runs, the replay ran other "
                                   "code (a likely cause of the difference)")
        if not any("likely cause" in w or "changed since" in w for w in result.warnings):
            if self._repository is False:  # once per replayer: two git processes (verify replays many steps)
                self._repository = _repository_changed(self.rec.run_info)
            if self._repository:
                result.warnings.append(self._repository)
            else:
                reached = self._reached_code(result.step, call)
                named = self._differs_from_bundle(call, reached) or \
                    _files_changed_since(self.rec.run_info, call, self.loader.script, reached)
                result.warnings += named
                if not named and reached and not _committed(self.rec.run_info):  # (a repository as recorded: it is)
                    result.warnings.append(_unhashed(reached))
        version = layout.parse_version(self.rec.reader.schema_version)
        if version < layout.SUBMODULE_CODE_SINCE and call.module is not None:
            own = skeleton.own_class(call.module)
            users = [c.__qualname__ for c in call.classes.values() if c is not own and isinstance(
                where := getattr(c, "__module__", None), str) and (where == "__main__" or jsonval.user_code(where))]
            if users:
                result.warnings.append(
                    f"recorded with schema {self.rec.reader.schema_version}, before 1.17, which held no hash of the "
                    f"code of a module's submodule classes: whether that of {', '.join(users[:4])}"
                    f"{' ...' if len(users) > 4 else ''} changed since recording cannot be checked (a likely cause "
                    "of the difference if it did)")
        if version < (1, 16):
            doubts = f" ({'; '.join(call.order_doubts)} may have run in another order)" if call.order_doubts else ""
            result.warnings.append(
                f"recorded with schema {self.rec.reader.schema_version}, before 1.16: its documents held a module's "
                f"children and parameters and a dict argument's items in name order{doubts}, and it did not record "
                "what the step's module-level names were bound to, which arguments shared memory, nor which was "
                "the module's own parameter (a likely cause of the difference); record it again with this version "
                "to replay it as it ran")
        held = call.unset_rngs or self._unheld_rngs(call)
        if held:  # what it drew is not what the recorded call drew: that, not its constants
            several = len(held) > 1
            its, s = ("their", "s") if several else ("its", "")
            why, then = (f"whose recorded state{s} the replay could not set", "") if call.unset_rngs else (
                f"whose state{s} at each call recordings before schema 1.17 do not hold (this one is "
                f"{self.rec.reader.schema_version})", "; record it again with this version to replay it as it ran")
            result.warnings.append(f"the step's module held the generator{s} {', '.join(held)}, {why}: the replay drew "
                                   f"from {its} state in the rebuilt module (a likely cause of the difference){then}")
        if layout.parse_version(self.rec.reader.schema_version) < (1, 17):
            result.warnings.append(
                f"recorded with schema {self.rec.reader.schema_version}, before 1.17, which did not record which "
                "tensors were of a tensor subclass: the replay gave the step plain tensors (where it was given a "
                "subclass whose __torch_function__ changes results, a fixed-point tensor's, a likely cause of the "
                "difference)")
        if call.unread_rngs:  # what it drew is not what the recorded call drew: that, not its constants
            several = len(call.unread_rngs) > 1
            result.warnings.append(
                f"the step draws from the module-level RNG{'s' if several else ''} {', '.join(call.unread_rngs)}, "
                f"whose state{'s' if several else ''} the recording does not hold: the replay drew from "
                f"{'their' if several else 'its'} state now (a likely cause of the difference; {self._unread_why()})")
            return
        if held:  # (not its constants either)
            return
        self._module_data(result, call)

    def _module_data(self, result: ReplayResult, call: _Call) -> None:
        """The module-level data the step's code reads, and that of the steps inside it, named as a likely
        cause: its values are not recorded. Of the inner steps, those that differ where they were compared (the
        first divergence is often in one, which reads what the step's own code does not); all, where none was
        (``bisect --ops`` replays the step alone)."""
        kind = type(call.module)
        own = call.fn if call.module is None else None if kind.__module__.startswith("torch.") else kind.forward
        names = _data_globals(own)  # (a module step's: its forward's, torch's own modules aside)
        if names:
            result.warnings.append(_data_warning("the step's code", names))
        step = result.step
        fwd = self.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
        inner = [s.step for s in result.inner if not s.match] if result.inner else descendants(fwd)
        done = {fwd.definition.get("ref")}
        for s in inner:
            defn = s.definition
            if defn.get("ref") in done:
                continue
            done.add(defn.get("ref"))
            target = self._code_target(defn)
            names = _data_globals(target.forward if isinstance(target, type) else target)
            if names:
                ref = paper_reference(s.paper)
                who = f"{ref} ({s.name})" if ref and ref != s.name else s.name
                result.warnings.append(_data_warning(f"the code of the inner step {s.index}: {who}", names))

    def _differs_from_bundle(self, call: _Call, reached: dict[str, list[str]]) -> list[str]:
        """For a bundle replayed with the code here, each file the call ran code from (the step's own, its
        module's classes', ``reached``) whose text here is not the copy the bundle carries of it: the bundle
        holds that file, so the difference is known, not guessed from a file's time (which a copy to another
        machine does not keep)."""
        info = self.rec.bundle_info
        if info is None or self.loader.bundled:
            return []
        sources, modules = info.get("sources") or {}, info.get("modules") or {}
        copies: dict[str, str] = {}  # a file here -> the bundle's copy of it, by the module it is
        for name, recorded in modules.items():
            here = getattr(sys.modules.get(name), "__file__", None)
            if isinstance(here, str) and isinstance(sources.get(recorded), str):
                copies[os.path.realpath(here)] = recorded
        script = self.rec.run_info.get("script")
        if self.loader.script and isinstance(script, str) and isinstance(sources.get(script), str):
            copies[os.path.realpath(self.loader.script)] = script
        function = call.module is None
        defined = ([inspect.unwrap(getattr(call.fn, "__func__", call.fn))] if function else
                   list(dict.fromkeys(type(m) for m in call.module.modules())))
        ran: dict[str, list[str]] = {}
        for obj in defined:
            with contextlib.suppress(TypeError, OSError):
                file = self.loader.script if getattr(obj, "__module__", None) == "__main__" else \
                    inspect.getsourcefile(obj)
                if file is not None:
                    ran.setdefault(file, []).append(getattr(obj, "__qualname__", "?"))
        for file, names in reached.items():
            ran.setdefault(file, []).extend(n for n in names if n not in ran.get(file, ()))
        out = []
        for file, names in ran.items():
            recorded = copies.get(os.path.realpath(file))
            if recorded is None:
                continue
            try:
                here = Path(file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if here != sources[recorded]:
                shown = f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                copy = "the copy" if os.path.realpath(recorded) == os.path.realpath(file) else f"the copy of {recorded}"
                out.append(f"{file} is not {copy} this bundle carries, and the step's call ran "
                           f"{shown} from it: a likely cause of the difference (--use-bundled-source runs the "
                           "bundle's copy)")
        return out

    def _reached_code(self, step: Step, call: _Call) -> dict[str, list[str]]:
        """The functions of the training project the replayed call ran (``_Call.reached``), by file, but for
        the code whose source the recording holds a hash of, which a replay checks (the step's definition, the
        classes of its module's submodules, the steps inside it): the body of a custom operator, a helper."""
        fwd = self.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
        refs = [fwd.definition.get("ref"), *(ref for ref, _, _ in submodule_entries(fwd._doc("module"))),
                *(s.definition.get("ref") for s in descendants(fwd))]
        checked = []
        for ref in {r for r in refs if isinstance(r, str) and ":" in r}:
            module, _, qualname = ref.partition(":")
            file = self.loader.file_of(module)
            if file is not None:
                checked.append((file, qualname))
        out: dict[str, list[str]] = {}
        for code in call.reached:
            file, name = code.co_filename, getattr(code, "co_qualname", code.co_name).split(".<locals>")[0]
            if name == "<module>" or file.startswith(_PAPERDEBUGGER) or name in out.get(file, ()) or any(
                    file == where and (name == q or name.startswith(f"{q}.")) for where, q in checked):
                continue
            if (os.path.isfile(file) or file in self.loader.bundled) and projects(file):
                out.setdefault(file, []).append(name)
        return {file: sorted(names) for file, names in out.items()}

    # -- preparing a call ------------------------------------------------------------------------
    def _prepare(self, step: Step, warnings: list[str], rebuilt: dict[str, str],
                 grads: frozenset[str] = frozenset(), backward: Step | None = None) -> _Call:
        """The call of ``step`` ready to run; ``grads``: names of inputs and parameters a backward replay
        takes gradients of, made to require grad even where the recorded call's did not (a forward that
        reentrant checkpointing first ran without grad, its backward recorded from the recomputation) or
        where the recording does not say (before schema 1.2 every requires_grad was recorded false).
        ``backward``: the backward step whose replay runs this call again (a refusal names it first)."""
        defn = step.definition
        module_doc = step._doc("module")
        records = step.records
        warnings += [f"{note} (a likely cause of any difference)" for note in step.extra.get("notes", [])
                     if (layout.GLOBAL_HOOK_NOTE in note or layout.UNRUN_PRE_HOOKS_NOTE in note
                         or layout.CACHED_PARAMETRIZATION_NOTE in note)
                     and not any(note in w for w in warnings)]
        failed = next((n for n in step.extra.get("notes", []) if isinstance(n, str)
                       and n.startswith(f"{layout.CAPTURE_FAILED_NOTE}: ")), None)
        if failed is not None:  # its arguments or outputs are missing: a replay would run another call
            raise ReplayError(f"step {step.index} ({step.name}): the recorder failed to capture this call "
                              f"({failed.removeprefix(f'{layout.CAPTURE_FAILED_NOTE}: ')}) and stopped recording "
                              "there; it cannot be replayed")
        sharded = step.dtensor_refusal()
        if sharded is not None:  # its local shards alone would compute another call than the ranks' together
            refused = ReplayError(f"step {step.index} ({step.name}) cannot be replayed: {sharded}")
            refused.reason = sharded  # (the same for each such step: pdbg verify lists them on one line)
            raise refused
        lazy = step.uninitialized
        for r in records:
            if r.role in ("input", "param", "buffer") and not step.holds_values(r) and r.name not in lazy:
                if step.sparse(r) is not None:  # (its parts not kept: 1.19 keeps them where payloads are kept)
                    why = step.sparse_refusal(r)
                    refused = ReplayError(f"step {step.index} ({step.name}) cannot be replayed: {why}")
                    refused.reason = why  # (the same for each such step: pdbg verify lists them on one line)
                    raise refused
                if backward is not None:
                    raise ReplayError(f"backward step {backward.index} ({backward.name}) runs its forward call, "
                                      f"step {step.index}, again, which kept {step.kept_only(r)}; it cannot be "
                                      "replayed")
                raise ReplayError(f"step {step.index} ({step.name}) kept {step.kept_only(r)}; it cannot be replayed")
        tensors = {r.name: r for r in records if r.role == "input"}
        leaves: dict[str, torch.Tensor] = {}
        given: dict[str, torch.Tensor] = {}  # one object per record: a tensor passed twice was one object

        aliases = _aliases(step, tensors, warnings)
        subclasses = step.extra.get("subclasses")
        subclasses = subclasses if isinstance(subclasses, dict) else {}
        made: dict[str, torch.Tensor] = {}  # record name -> the tensor subclass instance made of given[name]
        own_edits = {c.tensor: c.key for c in self.plan.edits_for(None)}
        edited: dict[int, str] = {}  # id of each tensor the decoded arguments hold that an edit made -> its name

        def tensor(name: str) -> torch.Tensor:
            if name not in given:
                plain(name)
            if name not in subclasses:
                out = given[name]
            else:
                if name not in made:
                    made[name] = self._subclass(name, given[name], subclasses[name], warnings)
                out = made[name]
            if name in own_edits:
                edited[id(out)] = name
            return out

        def plain(name: str) -> None:
            rec = tensors.get(name)
            if rec is None:
                raise ReplayError(f"step {step.index}: argument tensor {name!r} is missing from the recording")
            if name in aliases:
                one_storage(aliases[name])
                return
            leaf = self._edit(name, _materialize(step, rec, self.plan.notes))
            if (rec.requires_grad or name in grads) and (leaf.is_floating_point() or leaf.is_complex()):
                leaf.requires_grad_(True)
            leaves[name] = leaf
            given[name] = _stand_in(leaf) if leaf.requires_grad else leaf  # in-place ops on it must not hit a leaf
            set_grad(name)

        def one_storage(members: dict[str, int]) -> None:
            self._one_storage(step, members, tensors, grads, given, leaves)
            for member in members:
                set_grad(member)

        def set_grad(name: str) -> None:
            """The .grad the argument had (a parameter given to an update step), where it is recorded."""
            grad = tensors.get(f"{name}{layout.GRAD_SUFFIX}")
            if grad is None or name.endswith(layout.GRAD_SUFFIX):
                return
            if grad.name in aliases:  # (1.19) given as an argument too, or a view of one: one storage again
                if grad.name not in given:
                    one_storage(aliases[grad.name])
                given[name].grad = given[grad.name]
            else:
                given[name].grad = self._edit(grad.name, _materialize(step, grad))

        def module_argument(doc: dict[str, Any], params: dict[str, Any], buffers: dict[str, Any]) -> torch.nn.Module:
            """A module the call was given (1.30: a soft update's target network, a method's ``self.net``),
            rebuilt from its skeleton with the parameters and buffers it had (in-place writes to them show in
            the "after:" records' places); the call's grads of its parameters (``.grad``) are given back too."""
            builder = self._builder()
            builder.top_name = f"the {str(doc.get('class', '')).rpartition(':')[2] or 'module'} the step was given"
            built = builder.build(doc, f"a module argument of {step.name}")
            warnings.extend(built.warnings)
            state = {**params, **buffers}
            lost = next((n for n, t in state.items() if not isinstance(t, torch.Tensor)), None)
            if lost is not None:
                raise ReplayError(f"step {step.index} ({step.name}): {lost} of a module it was given is "
                                  f"{unresolved(state[lost])}; it cannot be replayed")
            requires = {n: bool(t.requires_grad) for n, t in params.items()}
            warnings.extend(load_state(built.module, {n: t.detach() for n, t in params.items()}, buffers, requires,
                                       built.tied))
            built.link()
            now = dict(built.module.named_parameters())
            records = {id(t): name for name, t in given.items() if name in grads} if grads else {}
            for n, t in params.items():
                grad = compare.grad_of(t)
                if grad is not None and n in now:
                    now[n].grad = grad
                if id(t) in records and n in now:  # (1.31) a backward replay takes the grads of the module's own
                    leaves[records[id(t)]] = now[n]
            return built.module

        arguments = step.arguments or {"args": [], "kwargs": {}}
        decoded = jsonval.decode(arguments, tensor=tensor, resolve=self.loader.resolve, module=module_argument)
        missing = unresolved(decoded)
        args, kwargs = decoded.get("args", []), decoded.get("kwargs", {})
        if missing:
            qualname = str(defn.get("ref", "")).partition(":")[2]
            owner = qualname.rpartition(".")[0]
            first = args[0] if args else None
            if module_doc is None and owner and isinstance(first, jsonval.Opaque) and \
                    first.type.rpartition(":")[2] == owner:  # a method's self, of the class it is defined in
                raise ReplayError(f"step {step.index} ({step.name}) is the method {qualname}, and its self was "
                                  f"{unresolved(args[0])}: a replay cannot rebuild the object a method belongs to "
                                  "(a module is rebuilt for its forward only); make the step a function of its "
                                  "tensors (a staticmethod), or a module of its own, to replay it")
            opaque = _first_opaque(arguments)
            if opaque is not None and missing == unresolved(opaque):  # (not a class that cannot be imported now)
                missing = _opaque_argument(step, opaque) or missing
            raise ReplayError(f"step {step.index} ({step.name}) was called with {missing}; it cannot be replayed")
        args, kwargs = self._edit_numpy(list(args), dict(kwargs))
        # a distribution given an edited parameter: made again from it (its derived fields, as recorded, would not be)
        args, kwargs = distributions.remake(args, kwargs, edited, lambda name: f"edit {own_edits[name]}",
                                            self.plan.notes)
        held: list[tuple[Any, Any]] = []
        unset: list[str] = []
        if module_doc is not None:
            target = self._code_target(defn)  # first: importing it (from where it was) serves the skeleton too
            recorded_rng = step.rng
            built = self._builder(_held_states(recorded_rng)).build(module_doc, step.module_path or step.name,
                                                                    top_hooks_ran=self._own_hooks_ran(step))
            module = built.module
            warnings.extend(built.warnings)
            rebuilt.update({join_path(step.module_path, k): v for k, v in built.how.items()})
            # the code of its submodules' classes (the rebuilt module's, before any swap) against the recorded
            classes = {jsonval.type_ref(c): c for c in dict.fromkeys(skeleton.own_class(m) for m in module.modules())}
            code_drift = self.loader.submodule_drift(module_doc, step.name, step.module_path, classes)
            warnings.extend(code_drift)
            # (a lazy module's parameters before its first call: left uninitialized, as the call found them)
            params = {r.name: self._edit(r.name, _materialize(step, r, self.plan.notes)) for r in records
                      if r.role == "param" and r.name not in lazy}
            buffers = {r.name: self._edit(r.name, _materialize(step, r, self.plan.notes)) for r in records
                       if r.role == "buffer" and r.name not in lazy}
            devices = {t.device for t in (*params.values(), *buffers.values())}
            if "constructor" in built.how.values() and len(devices) == 1:
                module.to(next(iter(devices)))
            requires_grad = {r.name: r.requires_grad or r.name in grads for r in records if r.role == "param"}
            warnings.extend(load_state(module, params, buffers, requires_grad, built.tied))
            known = len(built.warnings)
            built.link()
            warnings.extend(built.warnings[known:])
            args, kwargs = self._parameter_arguments(step, module, args, kwargs, given, leaves, warnings)
            target = target if target is not None else type(module)
            if self.plan.edits_inside():
                self._edit_inner_state(step, module)
            if self.plan.swaps:  # a replacement's constructor must not draw from the caller's generators
                with snapshot.applied_rng({}, cuda=True):
                    module = self._swap_inside(step, module, descendants(step) if step.phase == "forward" else [])
            held, unset = self._module_rngs(recorded_rng, module, warnings)
            fn: Any = module
        else:
            module, classes, code_drift = None, {}, []
            wrapper = defn.get("wrapper")
            if isinstance(wrapper, dict):  # (1.18) a decorator's wrapper without functools.wraps: no name finds it
                qualname = str(defn.get("ref", "")).partition(":")[2]
                raise ReplayError(f"step {step.index} ({step.name}) runs {qualname}, a wrapper the decorator "
                                  f"{wrapper.get('decorator')} defines around {wrapper.get('around')} without "
                                  "functools.wraps, which a replay cannot find again by its name; add "
                                  f"@functools.wraps({wrapper.get('variable')}) to it, and record again, to replay it")
            target = _operator_step(self.loader.resolve(defn.get("ref", ""), defn.get("file")))
            found = bound_wrapper(target)
            if found is not None:
                raise ReplayError(f"step {step.index} ({step.name}): {defn.get('ref')} is {found[0]}, and a replay "
                                  f"finds that wrapper by the step's name, not the step; {found[1]} to replay it")
            if getattr(target, "__pdbg_step__", None) is None:  # a recording names it: only ever a paper step
                target = self._patched_step(step, defn, target)
            fn = getattr(target, "__wrapped__", target)  # the undecorated function: the step itself is not re-recorded
            if not callable(fn):
                raise ReplayError(f"{defn.get('ref')} is not callable now; step {step.index} cannot be replayed")
            own = self._own_swap(step)
            if own is not None:
                with snapshot.applied_rng({}, cuda=True):
                    fn = intervene.swap_function(fn, own)
        drift = self.loader.drift(defn, target)
        if drift:
            warnings.append(drift)
        code = target if module_doc is not None else getattr(target, "__wrapped__", target)
        rngs, unread = self._global_rngs(step, code, warnings)
        rngs += self._default_rngs(step, code, warnings)
        unchecked: list[str] = []
        self._bind_globals(defn, target, warnings, unchecked)
        if self.plan.seed is not None:
            _seed_generators(args, kwargs, self.plan.seed)
        vmap = _vmap_plan(step, list(args), dict(kwargs), given, self.loader.resolve, warnings)
        return _Call(step, fn, module, list(args), dict(kwargs), leaves, vmap,
                     built.unrecorded if module_doc is not None else [], rngs, unread, held, unset, unchecked,
                     built.left_out if module_doc is not None else [],
                     built.order_doubts if module_doc is not None else [], code_drift, classes,
                     set_outside=built.set_outside if module_doc is not None else [])

    def _patched_step(self, step: Step, defn: dict[str, Any], target: Any) -> Any:
        """The paper step of a function step whose reference finds something that is not one (``target``). The
        function as its module defines it, undecorated, its code the recorded code, was made a step at run time,
        by calling ``paper_step`` on it outside its definition (a patch: ``adam._single_tensor_adam =
        paper_step(...)(adam._single_tensor_adam)``): found where the training script's top level makes the patch
        (the script is loaded as a replay loads it, and the reference looked up again); otherwise a ReplayError
        that says so. Anything else is no paper step: a replay calls nothing else a recording names."""
        ref = str(defn.get("ref", ""))
        module, _, qualname = ref.partition(":")
        recorded = defn.get("source_sha256")
        now = self.loader.source_of(target) if recorded and isinstance(target, types.FunctionType) else None
        if now is None or hashlib.sha256(now.encode()).hexdigest() != recorded:
            raise ReplayError(f"{ref} is not a paper step (a function decorated with @recorder.paper_step) now; step "
                              f"{step.index} cannot be replayed: a replay calls nothing else a recording names")
        loaded = None  # why the training script could not be looked in, if it could not
        if module != "__main__" and self.loader.script:
            try:
                self.loader.main()  # (its top level, as a replay loads it: a patch there is made again)
                again = self.loader.resolve(ref, defn.get("file"))
            except ReplayError as exc:
                loaded = str(exc)
            else:
                if getattr(again, "__pdbg_step__", None) is not None:
                    return again
        said = (f"step {step.index} ({step.name}) cannot be replayed: {ref} is the function as {module} defines it, "
                "undecorated, its code the code recorded: the step was a paper step made at run time, by calling "
                f"recorder.paper_step on it outside its definition (a patch: {module}.{qualname} = "
                f"recorder.paper_step(...)({module}.{qualname})), which importing {module} does not do again")
        if loaded is not None:
            raise ReplayError(f"{said}; the training script, whose top level may make the patch again, could not be "
                              f"loaded to look: {loaded}")
        script = ("" if module == "__main__" or not self.loader.script else
                  f", nor does the training script's top level, which the replay loaded ({self.loader.script})")
        raise ReplayError(f"{said}{script}; decorate a function defined at the top level of your own code that calls "
                          "it, and patch that in, or make the patch at the top level of the training script, outside "
                          "`if __name__ == \"__main__\":`, and record again; in Python, make the patch before "
                          "replaying")

    def _subclass(self, name: str, value: torch.Tensor, doc: Any, warnings: list[str]) -> torch.Tensor:
        """``value`` as an instance of the tensor subclass the recorded call was given at ``name`` (the
        step's extra ``subclasses``), with the attributes its instance held: made with ``as_subclass``
        (an alias: autograd follows it to the leaf), where the class is one a replay may make (the
        training code's own: ``jsonval.may_construct``) and holds its values itself (no
        ``__torch_dispatch__``). Otherwise the plain tensor, and a warning naming the class."""
        ref = doc.get("type") if isinstance(doc, dict) else None
        if not isinstance(ref, str):
            return value
        cls = jsonval.decode({"$class": ref}, resolve=self.loader.resolve)
        why = None
        if not isinstance(cls, type) or not issubclass(cls, torch.Tensor):
            why = ("a replay makes only the training code's own classes, found as it finds the step's code, and "
                   "this one is not, or cannot be imported here")
        elif getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
            why = "it wraps other tensors (__torch_dispatch__), and the recording holds its values alone"
        if why is not None:
            warnings.append(f"{name} was a {ref} (a tensor subclass) when recorded, which the replay does not make "
                            f"again ({why}): the step was given a plain tensor (a likely cause of any difference)")
            return value
        with torch._C.DisableTorchFunction():  # (the subclass's own code does not see the replay's making of it)
            out = value.as_subclass(cls)
        attrs = doc.get("attrs")
        if isinstance(attrs, dict) and attrs:
            values = jsonval.decode(attrs, resolve=self.loader.resolve)
            lost = []
            for key, item in values.items() if isinstance(values, dict) else ():
                if type(key) is not str or unresolved(item) or hasattr(getattr(cls, key, None), "__set__"):
                    lost.append(str(key))  # (not over a property of its class: its code)
                else:
                    out.__dict__[key] = item
            if lost:
                warnings.append(f"{name}: the attributes {', '.join(lost)} of its {cls.__qualname__} could not be "
                                "given back (not recorded as data): the replay left them out (a likely cause of "
                                "any difference)")
        return out

    def _one_storage(self, step: Step, members: dict[str, int], tensors: dict[str, TensorRecord],
                     grads: frozenset[str], given: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor]) -> None:
        """Give the arguments that were views of one storage (``members``: record name -> storage
        offset) views of one storage again, holding their recorded values, so that an in-place change
        the step makes to one reaches the others, as it did. Where one requires grad, the storage is
        a copy of a leaf: its views take in-place changes, and autograd follows them into the others."""
        values = {n: self._edit(n, _materialize(step, tensors[n])) for n in members}
        first = next(iter(values.values()))
        low = min(members.values())
        span = max(members[n] - low + (1 + sum((k - 1) * st for k, st in zip(v.shape, v.stride())) if v.numel() else 0)
                   for n, v in values.items())
        size = first.element_size()
        at = next(((placing.misaligned(step, tensors[n]) - (members[n] - low) * size) % layout.ALIGNMENT
                   for n in members if placing.misaligned(step, tensors[n])), 0)  # (1.25: where its views lay)
        at = 0 if at % size else at
        storage = placing.empty_at((span,), (1,), first.dtype, first.device, at).zero_()
        for n, v in values.items():
            _write_view(storage, v, members[n] - low)
        if any(tensors[n].requires_grad or n in grads for n in members) and (first.is_floating_point() or
                                                                              first.is_complex()):
            storage.requires_grad_(True)  # (in-place changes to views of a leaf are refused: a copy of it)
            storage = placing.empty_at((span,), (1,), first.dtype, first.device, at).copy_(storage)
        for n, v in values.items():
            given[n] = leaves[n] = storage.as_strided(v.shape, v.stride(), members[n] - low)

    def _parameter_arguments(self, step: Step, module: torch.nn.Module, args: list[Any], kwargs: dict[str, Any],
                             given: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor], warnings: list[str]
                             ) -> tuple[list[Any], dict[str, Any]]:
        """Pass the rebuilt module's own parameter where the recorded call was given it as an argument
        (a tied projection's weight: the step's extra ``parameter_args``): the parameter's gradient then
        holds what came through the argument too, as recorded. Before schema 1.19 the recorder passed it
        through a tap, and recorded the argument's gradient, what came through it alone: a replay of such
        a recording passes it through a tap too."""
        passed = step.extra.get("parameter_args")
        if not isinstance(passed, dict) or not passed:
            return args, kwargs
        own = dict(module.named_parameters(remove_duplicate=False))
        edited = {c.tensor for c in self.plan.edits_for(None)}
        swap: dict[int, torch.Tensor] = {}
        for name, param_name in passed.items():
            p, old = own.get(param_name), given.get(name)
            if old is None or name in edited:  # (an edit of the argument: the replay passes what it made)
                continue
            if p is None:
                warnings.append(f"{name} was the module's parameter {param_name}, which the rebuilt module lacks: the "
                                "replay passed a copy, whose gradient does not reach the parameter's (a likely cause "
                                "of any difference)")
                continue
            new = taps.tap([p], _no_gradient_wanted)[0] if p.requires_grad and self._leaves_tapped() else p
            swap[id(old)] = given[name] = leaves[name] = new
        if not swap:
            return args, kwargs
        return [swap.get(id(a), a) for a in args], {k: swap.get(id(v), v) for k, v in kwargs.items()}

    def _own_hooks_ran(self, step: Step) -> bool:
        """Had the step's module run its own forward pre-hooks when the step's arguments and state were
        recorded? Yes for a decorated class or annotated instance (recorded inside its forward), and
        for a module a ``modules=`` glob selected (its definition has no paper label) since schema 1.26,
        which records it after them, unless a note on the call says they ran after (its first call as
        the outermost module); before 1.26, no (recorded before them)."""
        if (step.definition.get("paper") or {}).get("label") is not None:
            return True
        return self._since(layout.HOOKED_INPUTS_SINCE) and not any(
            isinstance(n, str) and n.endswith(layout.UNRUN_PRE_HOOKS_NOTE) for n in step.extra.get("notes", ()))

    def _since(self, version: tuple[int, int]) -> bool:
        """Whether the recording is of schema ``version`` or later."""
        return layout.parse_version(self.rec.reader.schema_version) >= version

    def _leaves_tapped(self) -> bool:
        """Whether the recording tapped a step's top-level leaf arguments (schema before 1.19)."""
        return not self._since(layout.LEAVES_UNTAPPED_SINCE)

    @contextlib.contextmanager
    def _bindings(self) -> Iterator[None]:
        """Inside the block, the module-level names a replayed step's code reads may be bound to what they
        were when recorded (``_bind_globals``); after it, each has what it had again (the user's own
        ``__main__`` in a notebook, a script loaded once for many replays)."""
        saved, self._rebound = self._rebound, []
        try:
            yield
        finally:
            for space, name, old in reversed(self._rebound):
                if old is _UNBOUND:
                    space.pop(name, None)
                else:
                    space[name] = old
            self._rebound = saved

    def _bind_globals(self, defn: dict[str, Any], target: Any, warnings: list[str], unchecked: list[str]) -> None:
        """Bind the module-level names the step's code reads to the classes and functions they were bound
        to when recorded (its definition's ``globals``: a script's main() rebinds ``STE = STES[args.ste]``,
        and loading the code binds the import's), for the replay in progress (``_bindings``), saying so.
        Where a recorded binding cannot be imported: a warning if the loaded code binds another, else its
        name in ``unchecked`` (said where the replay differs). ``target``: the loaded class or function."""
        recorded = defn.get("globals")
        if not isinstance(recorded, dict) or not recorded:
            return
        own = snapshot.code_globals(getattr(target, "__wrapped__", target)) if target is not None else None
        done = {(id(space), name) for space, name, _ in self._rebound}
        for key, ref in recorded.items():
            if not isinstance(key, str) or not isinstance(ref, str):
                continue
            module, _, name = key.rpartition(":")
            label = f"{module}.{name}" if module else name
            try:
                space = vars(self.loader.module(module)) if module else own
            except Exception as exc:  # noqa: BLE001 - named below, as a cause of any difference
                warnings.append(f"the step's code reads the module-level {label}, which was {ref} when recorded, and "
                                f"its module could not be loaded to bind it ({brief(exc)}): a likely cause of any "
                                "difference")
                continue
            if space is None or (id(space), name) in done:
                continue
            now = space.get(name, _UNBOUND)
            now_ref = "nothing" if now is _UNBOUND else snapshot.code_ref(now) or f"a {type(now).__name__}"
            try:
                obj = self.loader.resolve(ref)
                if obj is now:  # (``from torch.func import jacrev``: torch's, bound as recorded; nothing to bind)
                    continue
                if snapshot.code_ref(obj) is None or not jsonval.may_bind(obj):
                    raise ReplayError(f"{ref} is torch's, but not its tensor math nor a module, which alone a replay "
                                      "binds" if ref.partition(".")[0].partition(":")[0] == "torch" else
                                      f"{ref} is not a class or function of the training code or of torch")
            except Exception as exc:  # noqa: BLE001 - the binding is named as what could not be set
                why = str(exc) if isinstance(exc, ReplayError) else brief(exc)
                if now_ref == ref:  # (the same name, not importable: a lambda, or a class made in a function)
                    unchecked.append(f"{label} ({ref}: {why})")
                else:
                    warnings.append(f"the module-level {label} was {ref} when recorded, which a replay cannot bind "
                                    f"again ({why}); loading the code binds it to {now_ref}, which the replay ran "
                                    "(a likely cause of any difference)")
                continue
            if now is obj:
                continue
            self._rebound.append((space, name, now))
            done.add((id(space), name))
            space[name] = obj
            text = (f"the module-level {label} was {ref} when recorded (the training script rebound it as it ran); "
                    f"loading the code binds it to {now_ref}: replayed with {ref}, as recorded")
            if text not in warnings:
                warnings.append(text)

    def _bind_inner(self, inner: list[Step], warnings: list[str], unchecked: list[str]) -> None:
        """``_bind_globals`` for the steps the replayed step encloses (their code runs inside it), each
        definition once."""
        seen: set[tuple[str, ...]] = set()
        for s in inner:
            defn = s.definition
            recorded = defn.get("globals")
            if not isinstance(recorded, dict) or not recorded:
                continue
            key = (str(defn.get("ref")), *map(str, recorded.items()))
            if key in seen:
                continue
            seen.add(key)
            self._bind_globals(defn, self._code_target(defn), warnings, unchecked)

    def _unheld_rngs(self, call: _Call) -> list[str]:
        """The generators the rebuilt module of a recording before schema 1.17 holds whose state at the call
        its skeleton did not hold either (a numpy Generator; a torch.Generator's state was in it), as a
        warning names them."""
        if call.module is None or layout.parse_version(self.rec.reader.schema_version) >= (1, 17):
            return []
        found = []
        for part, owner, name in snapshot.find_module_rngs(call.module):
            obj = snapshot.held_by(owner(), name)
            if not isinstance(obj, torch.Generator):
                found.append(f"{part.removeprefix(snapshot.MODULE_PREFIX)} ({snapshot.rng_kind(obj)})")
        return found

    def _unread_why(self) -> str:
        """Why a generator object's state is not in the recording, and what to do."""
        if layout.parse_version(self.rec.reader.schema_version) < (1, 15):
            return (f"this recording is of schema {self.rec.reader.schema_version}, which holds no generator object's "
                    "state: record it again to replay such a step")
        return ("a recording holds the state of a torch, numpy or random generator read by a module-level name, as an "
                "item of a module-level dict or an attribute of a module-level object, held by the step's module "
                "(as an attribute or a dict attribute's item), taken as a parameter's default, or passed as an "
                "argument: hold it in one of those places")

    def _global_rngs(self, step: Step, target: Any, warnings: list[str]) -> tuple[list[tuple[Any, Any]], list[str]]:
        """The generator objects the loaded code of ``step`` reads as module-level globals, each with
        the state the recording holds for it (None: left as it is: a ``seed`` intervention, or a state
        not recorded), and what names those whose state was not recorded, for the warning of a mismatch.
        Where the loaded code binds a recorded generator's name to None or to another kind (a script's
        main() made it: ``RNG = np.random.default_rng(args.seed)``), one of the recorded kind is made in
        the recorded state and bound there for the replay in progress (``_bindings``)."""
        key = id(target)  # (looked through once per loaded definition, kept alive here: verify replays many steps)
        if key not in self._rng_places:
            self._rng_places[key] = (target, snapshot.find_global_rngs(target), snapshot.unheld_rngs(target))
        found = self._rng_places[key][1]
        ids = step._doc("rng")  # (decoded only where it holds a generator object's state)
        held = isinstance(ids, dict) and any(str(k).startswith(snapshot.GLOBAL_PREFIX) for k in ids)
        recorded = step.rng if found or held else {}
        rngs, unread = [], []
        for part, space, name in found:
            obj = space.get(name)
            state = recorded.get(part)
            what = f"{part.removeprefix(snapshot.GLOBAL_PREFIX)} ({snapshot.rng_kind(obj)})"
            if state is None:
                unread.append(what)
            elif state[2] is None:
                warnings.append(f"the recorded state of the module-level RNG {what} is of a kind ({state[0]}) this "
                                "PaperDebugger cannot set; the replay drew from its state now (upgrade paperdebugger)")
                unread.append(what)
                state = None
            elif snapshot.global_rng_kind(obj) != state[0]:
                made = self._made_global(part, space, name, state, warnings)
                if made is None:
                    warnings.append(f"the module-level RNG {what} is not the kind of generator recorded ({state[0]}); "
                                    "the replay drew from its state now")
                    unread.append(what)
                    state = None
                else:
                    obj = made
            rngs.append((obj, None if self.plan.seed is not None else state))
        seen = {part for part, _, _ in found}
        missing = [p for p in recorded if p.startswith(snapshot.GLOBAL_PREFIX) and p not in seen]
        for part, (space, name) in snapshot.global_rng_places(target, missing).items():
            state, obj = recorded[part], space.get(name)
            if snapshot.global_rng_kind(obj) != state[0]:  # (of that kind: made by this replay for another step)
                obj = self._made_global(part, space, name, state, warnings)
                if obj is None:
                    now = space.get(name, _UNBOUND)
                    what = f"{part.removeprefix(snapshot.GLOBAL_PREFIX)} ({state[0]})"
                    warnings.append(f"the module-level RNG {what} could not be made again in its recorded state, and "
                                    f"loading the code binds it to {_bound_as(now)}: the replay ran with that (a "
                                    "likely cause of any difference)")
                    unread.append(what)
                    continue
            rngs.append((obj, None if self.plan.seed is not None else state))
        return rngs, unread + self._rng_places[key][2]

    def _default_rngs(self, step: Step, target: Any, warnings: list[str]) -> list[tuple[Any, Any]]:
        """The generator objects the loaded code's parameters default to where the recorded call took them
        (its RNG parts "default:<name>"), each with its recorded state (None: left as it is, under a ``seed``
        intervention). One the loaded code does not default to, or of another kind, is left out, saying so."""
        ids = step._doc("rng")  # (decoded only where it holds such a state)
        if not isinstance(ids, dict) or not any(str(k).startswith(snapshot.DEFAULT_PREFIX) for k in ids):
            return []
        loaded = {name: held for _, name, held, _ in snapshot.step_defaults(target)}
        rngs = []
        for part, saved in step.rng.items():
            if not part.startswith(snapshot.DEFAULT_PREFIX):
                continue
            name = part.removeprefix(snapshot.DEFAULT_PREFIX)
            obj = loaded.get(name)
            kind = snapshot.global_rng_kind(obj) if name in loaded else None
            if saved[2] is None or kind != saved[0]:
                now = f"a {snapshot.rng_kind(obj)}" if kind is not None else "no generator"
                why = (f"is of a kind ({saved[0]}) this PaperDebugger cannot set (upgrade paperdebugger)"
                       if saved[2] is None else f"was a {saved[0]}; the loaded code's default is {now}")
                warnings.append(f"the generator the parameter {name} defaults to {why}: the replay drew from its "
                                "state now (a likely cause of any difference)")
                continue
            rngs.append((obj, None if self.plan.seed is not None else saved))
        return rngs

    def _made_global(self, part: str, space: dict[str, Any], name: str, state: Any, warnings: list[str]) -> Any:
        """A generator of the recorded ``state``'s kind, made in that state and bound to ``space[name]`` for
        the replay in progress (``_bindings``), saying so; None (nothing bound) where none can be made."""
        made = snapshot.made_rng(state)
        if made is None:
            return None
        now = space.get(name, _UNBOUND)
        self._rebound.append((space, name, now))
        space[name] = made
        label = part.removeprefix(snapshot.GLOBAL_PREFIX)
        warnings.append(f"the module-level {label} was a {snapshot.rng_kind(made)} when recorded (the training script "
                        f"made it as it ran); loading the code binds it to {_bound_as(now)}: replayed with one made "
                        "from the recording, in its recorded state")
        return made

    def _module_rngs(self, recorded: dict[str, Any], module: torch.nn.Module, warnings: list[str]
                     ) -> tuple[list[tuple[Any, Any]], list[str]]:
        """The generator objects of the rebuilt ``module`` at the places the recorded call's module held
        generators (``recorded``: the step's decoded RNG parts, "module:<path>" among them), each with its
        recorded state at the call's start (None: left as it is, under a ``seed`` intervention), and what
        names those the replay could not set (not on the rebuilt module, another kind or device), for the
        warning of a mismatch."""
        rngs, unset = [], []
        for part, saved in recorded.items():
            if not part.startswith(snapshot.MODULE_PREFIX):
                continue
            place = part.removeprefix(snapshot.MODULE_PREFIX)
            where = snapshot.module_rng_place(place)
            try:
                owner = module.get_submodule(where[0]) if where is not None else None
            except AttributeError:
                owner = None
            obj = snapshot.held_by(owner, where[1]) if owner is not None and where is not None else None
            kind = snapshot.global_rng_kind(obj) if obj is not None else None
            if saved[2] is None:
                warnings.append(f"the recorded state of the module's generator {place} is of a kind ({saved[0]}) this "
                                "PaperDebugger cannot set; the replay drew from its state now (upgrade paperdebugger)")
                unset.append(f"{place} ({saved[0]})")
            elif kind is None:
                unset.append(f"{place} ({saved[0]}, not on the rebuilt module)")
            elif kind != saved[0] or (kind == "torch.Generator" and str(obj.device) != saved[1]):
                recorded_as = f"{saved[0]} on {saved[1]}" if saved[0] == "torch.Generator" else saved[0]
                warnings.append(f"the module's generator {place} is a {snapshot.rng_kind(obj)} in the replay, not the "
                                f"{recorded_as} recorded; the replay drew from its state now")
                unset.append(f"{place} ({snapshot.rng_kind(obj)})")
            else:
                rngs.append((obj, None if self.plan.seed is not None else saved))
        return rngs, unset

    def _other_call(self, step: Step, fwd: Step, other: Step, other_fwd: Step, call: _Call, threads: int | None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run another call of the pass (``other_fwd``) on the module of ``call``; its outputs, paired
        with the grad outputs its backward step (``other``) recorded."""
        sib = self._prepare(other_fwd, [], {})
        held = self._module_rngs(other_fwd.rng, call.module, []) if call.module is not None else ([], [])
        with state.applied(other_fwd.settings, other_fwd.rng, threads=threads), \
                state.per_call(other_fwd.settings, grad=True):
            try:  # (on this call's module: its generators set to the other call's states)
                out = tensors_by_name(_Call(other_fwd, call.module, call.module, sib.args, sib.kwargs, sib.leaves,
                                            sib.vmap, rngs=sib.rngs, held=held[0]).run(), "output")
            except Exception as exc:  # noqa: BLE001 - as for the step's own forward
                raise ReplayError(f"backward step {step.index}: rerunning the forward of step {other_fwd.index}, "
                                  f"another call of {fwd.module_path or fwd.name} in this pass, raised "
                                  f"{brief(exc)}") from exc
        return [(out[r.name], _materialize(other, r)) for r in other.records
                if r.role == "grad_output" and r.name in out]

    def _pass_siblings(self, step: Step, fwd: Step) -> list[tuple[Step, Step]] | None:
        """The other backward steps of the same module in the pass of ``step``, with their forward
        calls, when every one of them can be replayed (payloads kept, the same parameters): their
        backward is replayed with this one, so that the parameter grads are the same total. None
        when any cannot."""
        same = self._in_pass(step, fwd)
        params = {r.name: r.payload for r in fwd.records if r.role == "param"}
        found = []
        for index in same:
            if int(index) == step.index:
                continue
            other = self.rec.step(int(index))
            if other.forward is None or layout.SECOND_ORDER_NOTE in other.extra.get("notes", []):
                return None
            other_fwd = self.rec.step(other.forward)
            if _dual(other_fwd):  # its share of the totals came through tangents too (see _backward)
                return None
            kept = [r for r in [*other_fwd.records, *other.records] if r.role in ("input", "param", "buffer",
                                                                                   "grad_output")]
            if any(not other_fwd.holds_values(r) for r in kept) or other_fwd.extra.get("exception") or \
                    {r.name: r.payload for r in other_fwd.records if r.role == "param"} != params:
                return None
            found.append((other, other_fwd))
        return found

    def _calls_of_module(self, step: Step, fwd: Step) -> int:
        """How many calls of the same module (path) the backward pass of ``step`` went through: the
        calls its parameter grads accumulate over (a Siamese encoder's two views, a recurrent cell's
        steps). A pass is a run of backward steps with no forward between them: micro-batches of
        gradient accumulation, or the closures of LBFGS, are passes of their own, each recorded with
        its own gradient."""
        return 1 if fwd._doc("module") is None else max(1, len(self._in_pass(step, fwd)))

    def _in_pass(self, step: Step, fwd: Step) -> np.ndarray:
        """Indices of the backward steps of ``fwd``'s module (path and name) in the backward pass of
        ``step``: the run of backward steps around it with no forward between."""
        table = self.rec.steps
        phase = table.column("phase")
        forwards = np.flatnonzero(phase == 0)
        start, stop = forwards[forwards < step.index], forwards[forwards > step.index]
        lo, hi = (int(start[-1]) + 1 if len(start) else 0), (int(stop[0]) if len(stop) else len(phase))
        return np.flatnonzero((table.column("module_path")[lo:hi] == fwd.module_path)
                              & (table.column("name")[lo:hi] == fwd.name) & (phase[lo:hi] == 1)) + lo

    def _inner_drift(self, result: ReplayResult) -> None:
        """Drift of the inner steps' code: an inner step that diverges is often one whose code changed. (Those
        of its submodules' classes the step's own check compared are not said again.)"""
        step = result.step
        doc = step._doc("module") if step.phase == "forward" or step.forward is None else \
            self.rec.step(step.forward)._doc("module")
        seen = {ref for ref, _, _ in submodule_entries(doc)}
        for inner in result.inner:
            defn = inner.step.definition
            ref = defn.get("ref")
            if not ref or ref in seen or ref == result.step.definition.get("ref"):
                continue
            seen.add(ref)
            try:
                drift = self.loader.drift(defn, self.loader.resolve(ref, defn.get("file")))
            except ReplayError as exc:
                drift = f"code of inner step {defn.get('name')} cannot be found now ({exc})"
            if drift:
                result.warnings.append(drift)

    def _code_target(self, defn: dict[str, Any]) -> Any:
        try:
            return self.loader.resolve(defn["ref"], defn.get("file")) if defn.get("ref") else None
        except ReplayError:
            return None  # the skeleton's class reference is tried next, and its error is the one shown

    # -- forward ---------------------------------------------------------------------------------
    def _forward(self, step: Step, threads: int | None, nested: bool) -> ReplayResult:
        stopped = (step.extra.get("exception") or {}).get("type")
        if stopped in _STOPPED_FROM_OUTSIDE:
            raise ReplayError(f"step {step.index} was stopped from outside while it ran ({stopped.split(':')[-1]}: "
                              "Ctrl-C, a kernel interrupt, sys.exit): it has no result of its own to compare; the "
                              "steps before it replay")
        warnings: list[str] = []
        rebuilt: dict[str, str] = {}
        call = self._prepare(step, warnings, rebuilt)
        unseen = self._unseen_inputs(step, call)  # (their bits as given, to tell whether the call changes them)
        kept = self._kept_inputs(step, call)
        below = descendants(step)
        self._bind_inner(below, warnings, call.unchecked)
        inner = below if nested or self.plan.edits_inside() or self.plan.swaps else []
        tap = InnerTap(call.module, step.module_path, inner, plan=self.plan, reached=_read_modules(call)) \
            if inner else None
        settings = {**step.settings, **self.plan.settings}
        out, raised = None, None
        with state.applied(settings, step.rng, threads=threads, notes=warnings, seed=self.plan.seed), \
                state.per_call(settings):
            saved, capture.ACTIVE = capture.ACTIVE, tap
            try:
                with self._around("forward"), collectives.replayed(step, inner if nested else None) as talk, \
                        _recursion_room(step, inner), self._saved_hooks(step):
                    out = call.run()
                    _refuse_lazy(step, step, out)
                warnings += talk.warnings
                if talk.used and (self.plan.edits or self.plan.swaps):
                    warnings.append(f"the {talk.used} collective{'s' if talk.used != 1 else ''} called during the "
                                    "replay returned their recorded results: the intervention changes what this "
                                    "rank computes, not what the other ranks sent it")
            except PdbgError:  # an edit that cannot be applied: the user's input, not the step's outcome
                raise
            except Exception as exc:  # noqa: BLE001 - compared with what the recording says
                raised = exc
            finally:
                capture.ACTIVE = saved
                if tap is not None:
                    tap.close()
        written = [name for name, t, version in kept if t._version != version]
        if written:
            warnings.append(f"the replayed call changed {', '.join(written)} in place, which the recorded call left "
                            "as it was given: the intervention also changes what the step's caller goes on with")
        result = ReplayResult(step, True, [], warnings, rebuilt=rebuilt)
        recorded_exc = step.extra.get("exception")
        missing = None if recorded_exc else \
            self._unregistered_op(raised) or linked_outside(raised, step, call.args, call.kwargs)
        if missing:
            raise ReplayError(f"step {step.index} ({step.name}): {missing}")
        hint = self._raised_hint(raised, step)
        if hint:
            warnings.append(f"a likely cause: {hint}")
        if raised is not None and not recorded_exc and call.left_out:
            raise ReplayError(f"step {step.index} ({step.name}): the replay raised {brief(raised)}, where the recorded "
                              "call returned normally, and the module was rebuilt incomplete "
                              f"({_set_outside(step, call.set_outside) or call.left_out[0]}): "
                              "a rebuild that is not the recorded module, not a difference in the step"
                              + (f" (a likely cause: {hint})" if hint else ""))
        if raised is not None or recorded_exc:
            _exception_result(result, raised, recorded_exc)
            if not result.match and self.plan.empty:
                self._module_data(result, call)
            if tap is not None and _stopped(result):  # ran through: the steps inside it are compared as usual
                result.inner, result.unrecorded_inner = tap.compare(), tap.unrecorded()
                result.match = all(s.match for s in result.inner) and result.unrecorded_inner is None
            elif tap is not None:  # one or both raised: the steps inside it, up to where it raised, are compared
                # too (one that raised by its exception's type): where the replay parts from the recording
                result.inner = tap.compare()
                result.unrecorded_inner = tap.unrecorded() if raised is None else None
                result.match = result.match and all(s.match for s in result.inner) and result.unrecorded_inner is None
            if not result.compared:  # never a match: nothing was checked (the steps inside it were not replayed)
                result.match = False
            return result
        values = tensors_by_name(out, "output")
        changed = {r.name for r in step.records if r.role == "output" and r.name.startswith(layout.AFTER_PREFIX)}
        if changed:  # inputs and parameters the recorded call changed in place, as the replayed call left them
            values.update(_changed_parameters(step, call.module, changed))
            after = tensors_by_name({"args": call.args, "kwargs": call.kwargs}, "@", grads=True)
            values.update({n: t for n, t in ((f"{layout.AFTER_PREFIX}{k[2:]}", t) for k, t in after.items())
                           if n in changed})
        result.values = values
        result.outputs = _compare_all(step, [r for r in step.records if r.role == "output"], values)
        doc_now = jsonval.encode(out, tensor_name=lambda t, p: f"output.{p}" if p else "output")
        schema = layout.parse_version(self.rec.rank.run.schema_version)
        as_dicts, layouts = schema < layout.MAPPINGS_SINCE, schema >= layout.STRIDES_SINCE
        was, now = _number_stats(step.output_structure), _number_stats(doc_now)
        if _by_type(doc_now, as_dicts, layouts) != _by_type(step.output_structure, as_dicts, layouts):
            far = _max_value_diff(step.output_structure, doc_now)
            bad = (was["nan"] + was["inf"], now["nan"] + now["inf"])
            result.outputs.append(Diff(
                "output structure", "output", False, max_abs_diff=math.inf if far is None else far, max_ulp=None,
                reason="the non-tensor parts of the output differ from the recording"
                + (f" (numbers that differ: max abs difference {far:.6g})" if far is not None else "")
                + (f" (NaN/Inf among their numbers: {bad[0]} recorded, {bad[1]} now)" if bad[0] != bad[1] else ""),
                recorded=was, replayed=now))
        elif (not result.outputs or was["nan"] or was["inf"]) and _holds_values(step.output_structure):
            # numpy arrays and other values that are no tensor, compared by their encoding (a numpy array
            # by dtype, shape and bytes): bit for bit equal (beside tensors, a row only for the NaN/Inf it counts)
            result.outputs.append(Diff("output structure", "output", True, recorded=was, replayed=now))
        result.outputs += self._buffers_after(step, call.module, result.warnings)
        if tap is not None:
            result.inner, result.unrecorded_inner = tap.compare(), tap.unrecorded()
            if tap.unseen:
                warnings.append(tap.unseen_text)
            self._inner_drift(result)
        result.match = all(d.match for d in result.outputs) and all(s.match for s in result.inner) \
            and result.unrecorded_inner is None
        result.not_compared = unrecorded_outputs(step.output_structure)
        result.unrecorded_rngs = list(call.unread_rngs)
        if result.match and result.unrecorded_rngs:
            several = len(result.unrecorded_rngs) > 1
            result.warnings.append(
                f"the step draws from the generator{'s' if several else ''} {', '.join(result.unrecorded_rngs)}, whose "
                f"state{'s' if several else ''} the recording does not hold: it matched because the replay found "
                f"{'them' if several else 'it'} as the recorded call did (replays in recording order, in one "
                "process); a replay of this call alone, or in another order, draws other numbers")
        if not result.compared:  # never a match: nothing was checked
            result.match = False
            result.warnings.append(result.nothing_compared)
        elif result.not_compared:  # compared by type alone: no match of theirs is claimed
            result.warnings.append(f"not compared: {', '.join(result.not_compared)}, not recorded as data (a replay "
                                   "compares its type alone)")
        result.unseen_writes = [name for name, t, version, kept in unseen  # (its version counter as it was: .data)
                                if t._version == version and not _same_bits(kept, t)]
        if result.unseen_writes:
            result.warnings.append(f"not compared: {result.unseen_text}: the replayed call changed "
                                   f"{'them' if len(result.unseen_writes) > 1 else 'it'}, and what the recorded call "
                                   "left is not recorded")
        self._likely_causes(result, call)
        return result

    def _unseen_inputs(self, step: Step, call: _Call) -> list[tuple[str, torch.Tensor, int, torch.Tensor]]:
        """``(name, tensor, its version counter, a copy of it)`` for the inputs of ``step`` whose change the
        recording could not see (``arguments.unseen_writes``: written through ``.data`` in a tensor whose bits it
        does not keep), as the replayed call is given them, those an edit changes left out: after the call, those
        whose bits differ from the copy while the version counter did not move are ``ReplayResult.unseen_writes``."""
        records = unseen_writes(step)
        if not records:
            return []
        edited = {c.tensor for c in self.plan.edits_for(None)}
        given = tensors_by_name({"args": call.args, "kwargs": call.kwargs}, "@", grads=True)
        out = []
        for r in records:
            t = given.get(f"@.{r.name}")
            if r.name not in edited and isinstance(t, torch.Tensor) and t.layout == torch.strided and \
                    type(t) in (torch.Tensor, torch.nn.Parameter):
                out.append((r.name, t, t._version, t.detach().clone()))
        return out

    def _kept_inputs(self, step: Step, call: _Call) -> list[tuple[str, torch.Tensor, int]]:
        """``(name, tensor, its version counter)`` for the recorded input tensors of a replay with an intervention
        that the recorded call did not change in place (no ``after:`` record): after the call, those whose
        counter moved are what a swapped-in replacement (or an edit) made the step write into its inputs, which
        no output compares."""
        if self.plan.empty:
            return []
        changed = {r.name[len(layout.AFTER_PREFIX):] for r in step.records
                   if r.role == "output" and r.name.startswith(layout.AFTER_PREFIX)}
        inputs = {r.name for r in step.records if r.role == "input"} - changed
        given = tensors_by_name({"args": call.args, "kwargs": call.kwargs}, "@")
        return [(name, t, t._version) for name, t in ((k[2:], v) for k, v in given.items())
                if name in inputs and isinstance(t, torch.Tensor) and not t.is_inference()]

    # -- backward --------------------------------------------------------------------------------
    def _backward(self, step: Step, threads: int | None, nested: bool, stopped: bool = False) -> ReplayResult:
        if step.forward is None:
            raise ReplayError(f"backward step {step.index} does not name its forward call; it cannot be replayed")
        fwd = self.rec.step(step.forward)
        warnings: list[str] = []
        rebuilt: dict[str, str] = {}
        call = self._prepare(fwd, warnings, rebuilt,
                             frozenset(r.name for r in step.records if r.role in layout.GRAD_ROLES),
                             backward=step)
        grad_outputs = {r.name: r for r in step.records if r.role == "grad_output"}
        wanted = [r for r in step.records if r.role in layout.GRAD_ROLES]
        # Parameter grads recorded as the call's own (schema 1.11): what its graph's uses contributed,
        # before autograd added other calls', the loss's or a tied module's; the others are totals.
        own = frozenset(step.extra.get("own_grads") or ())
        totals = [r for r in wanted if r.role == "param_grad" and r.name not in own]
        hooked = [n for n in fwd.extra.get("notes", []) if layout.PARAM_HOOK_NOTE in n
                  and n.split(":", 1)[0] not in own]
        if hooked:  # the recorded gradients passed through hooks the replay does not have
            warnings.append(f"forward step {fwd.index}: " + "; ".join(hooked) + " (a likely cause of any difference)")
        not_compared = ""  # why parameter grads are left out, if they are

        def leave_out(out: list[TensorRecord], why: str) -> None:
            nonlocal wanted, not_compared
            wanted = [r for r in wanted if r not in out]
            not_compared = f"parameter grads not compared: {why}"
            warnings.append(not_compared)

        for note in (layout.RETURNED_PARAM_NOTE, layout.SHARED_PARAM_NOTE):
            # their recorded gradients hold what the caller's use of them sent too, or another module's
            texts = [n for n in fwd.extra.get("notes", []) if note in n]
            names = {name.strip() for text in texts for name in text.split(":", 1)[0].split(",")}
            out = [r for r in totals if r.name in names and r in wanted]
            if out:
                leave_out(out, f"{', '.join(r.name for r in out)}, " + texts[0].split(": ", 1)[1])
        reused = [r for r in totals if r in wanted] if layout.REUSED_NOTE in step.extra.get("notes", []) else []
        if reused:
            leave_out(reused, f"{', '.join(r.name for r in reused)}: {layout.REUSED_NOTE}")
        dual = [r for r in totals if r in wanted] if _dual(fwd) else []
        if dual:  # a JVP penalty's gradient reached them through the call's tangents, which were not recorded
            leave_out(dual, f"{', '.join(r.name for r in dual)}: totals over the pass, which sent them gradients "
                            "through the forward-AD tangents of the call's tensors too (not recorded)")
        calls = self._calls_of_module(step, fwd)
        # Totals over two calls (a Siamese encoder's two views) are the same bits in either order; with
        # more, autograd's order of addition is not one a replay can be sure to follow. (The calls' own
        # grads are each their call's: a replay of the others would add to them.)
        totals = [r for r in totals if r in wanted]
        # The steps inside are tapped whether or not they are compared: the recorded pass ran through the
        # recorder's taps on them, and autograd's order of addition follows the graph's nodes (without
        # them a sum of two paths can differ in its last bit).
        inner = descendants(fwd)
        self._bind_inner(inner, warnings, call.unchecked)
        others = self._pass_siblings(step, fwd) if calls == 2 and totals and self.plan.empty \
            and not inner and len(totals) == sum(r.role == "param_grad" for r in wanted) else None
        if others is not None:  # every call of the pass replayed together: their total is compared
            warnings.append(f"parameter grads compared as the total over the {calls} calls of "
                            f"{fwd.module_path or fwd.name} in this backward pass, replayed together")
        elif calls > 1 and totals:
            leave_out(totals, f"{fwd.module_path or fwd.name} ran {calls} times in this backward pass (iteration "
                              f"{fwd.iteration}), and each recorded parameter grad is the total over all of them "
                              "(autograd accumulates before the hook sees it)")
        unkept = [r for r in wanted if not step.holds_values(r) and layout.METADATA_NOTE in step.why_statistics_only(r)]
        if unkept:  # a sparse gradient whose parts were not kept (a recording before 1.24): nothing to compare with
            wanted = [r for r in wanted if r not in unkept]
            why = step.why_statistics_only(unkept[0])
            if step.sparse(unkept[0]) is not None:
                why += f"; its indices and values were not kept: {step.rec.rank.why_no_parts(unkept[0])}"
            what = f"{', '.join(f'{r.role} {r.name}' for r in unkept)} ({why})"
            if not wanted:
                raise ReplayError(f"backward step {step.index} has nothing a replay could compare: {what}")
            warnings.append(f"not compared: {what}")
        for r in [*grad_outputs.values(), *wanted]:
            if not step.holds_values(r):
                raise ReplayError(f"backward step {step.index} kept {step.kept_only(r)}; it cannot be replayed")
        result = ReplayResult(step, True, [], warnings, rebuilt=rebuilt)
        tap = InnerTap(call.module, fwd.module_path, inner, backward=True, plan=self.plan,
                       schema=layout.parse_version(self.rec.reader.schema_version),
                       reached=_read_modules(call)) if inner else None
        fwd_settings = {**fwd.settings, **self.plan.settings}
        # The pass's other call runs in its recorded order around this one (autograd then adds their
        # parameter grads in the order it did, the last call's first).
        later_pairs = [pair for other, other_fwd in others or () if other_fwd.index < fwd.index
                       for pair in self._other_call(step, fwd, other, other_fwd, call, threads)]
        with state.applied(fwd_settings, fwd.rng, threads=threads, notes=warnings, seed=self.plan.seed), \
                state.per_call(fwd_settings, grad=True):
            saved, capture.ACTIVE = capture.ACTIVE, tap
            try:
                with self._around("forward"), collectives.replayed(fwd, inner if nested else None) as talk, \
                        _recursion_room(fwd, inner), self._saved_hooks(fwd, warnings):
                    out = call.run()
                    _refuse_lazy(step, fwd, out)
                warnings += talk.warnings
            except PdbgError:
                raise
            except Exception as exc:  # noqa: BLE001 - a backward cannot start from a forward that failed
                missing = None if fwd.extra.get("exception") else \
                    self._unregistered_op(exc) or linked_outside(exc, fwd, call.args, call.kwargs)
                if missing:
                    raise ReplayError(f"backward step {step.index}: rerunning its forward (step {fwd.index}, "
                                      f"{fwd.name}): {missing}") from None
                hint = self._raised_hint(exc, fwd)
                if call.left_out and not hint:
                    lacks = _set_outside(step, call.set_outside) or call.left_out[0]
                    hint = f"the module was rebuilt incomplete: {lacks}"
                raise ReplayError(f"backward step {step.index}: rerunning its forward (step {fwd.index}, {fwd.name}) "
                                  f"raised {brief(exc)}" + (f" ({hint})" if hint else "")) from exc
            finally:
                capture.ACTIVE = saved
                if tap is not None:
                    tap.close()
        if tap is not None:
            tap.forget_grads()
        outs = tensors_by_name(out, "output")
        pairs = [(outs[n], self._edit(n, _materialize(step, r, self.plan.notes), f"grad_output:{n}"))
                 for n, r in grad_outputs.items() if n in outs]
        pairs += later_pairs + [pair for other, other_fwd in others or () if other_fwd.index > fwd.index
                                for pair in self._other_call(step, fwd, other, other_fwd, call, threads)]
        lost = sorted(set(grad_outputs) - set(outs))
        if lost:
            warnings.append(f"outputs {', '.join(lost)} had grad outputs recorded but the replay did not produce them")
        params = dict(call.module.named_parameters(remove_duplicate=False)) if call.module is not None else {}
        targets: list[torch.Tensor] = []
        for r in wanted:
            source = params.get(r.name) if r.role == "param_grad" else call.leaves.get(r.name)
            if source is None or not source.requires_grad:
                raise ReplayError(f"backward step {step.index}: {r.role} {r.name} has no tensor requiring grad in "
                                  "the replayed forward")
            targets.append(source)
        unfollowed = [n for n in fwd.extra.get("notes", []) if layout.UNFOLLOWED_NOTE in n or layout.UNCOPIED_NOTE in n
                      or layout.DUAL_NOTE in n or layout.SHARED_OUTPUTS_NOTE in n]
        if not pairs and layout.SECOND_ORDER_NOTE in step.extra.get("notes", []):
            raise ReplayError(_second_order(step))
        sparse = [r for r in fwd.records if r.role == "output" and fwd.sparse(r) is not None]
        if not pairs and sparse and not lost and not unfollowed:
            raise ReplayError(f"backward step {step.index} has no grad outputs to start a backward from: its forward's "
                              f"{sparse[0].name} is {fwd.sparse_text(sparse[0])}, whose gradient the recorder does not "
                              f"follow (it follows strided tensors only); replay the forward, step "
                              f"{fwd.index}, or return the dense values (edge weights) from the step and build the "
                              "sparse tensor after it")
        if not pairs:
            why = (f"the replay produced none of the outputs they were recorded for ({', '.join(lost)})" if lost else
                   "; ".join(unfollowed) or "its forward's output holds no tensor the recorder follows for gradients")
            raise ReplayError(f"backward step {step.index} has no grad outputs to start a backward from: {why}")
        warnings += [f"forward step {fwd.index}: {n} (a likely cause of any difference)" for n in unfollowed]
        changed = [n for n in fwd.extra.get("notes", []) if layout.CHANGED_ARGUMENT_NOTE in n]
        warnings += [f"forward step {fwd.index}: {n}" for n in changed]
        raised_doc = step.extra.get("exception") or {}
        if not targets and raised_doc and stopped:
            # (what the pass would have sent: every input and parameter of the call that requires grad)
            targets = list({id(t): t for t in [*call.leaves.values(), *params.values()] if t.requires_grad}.values())
            wanted = []
        elif not targets and raised_doc:
            raise ReplayError(f"backward step {step.index}: its backward pass raised ({exception_line(raised_doc)}) "
                              "before this step sent any gradient; a replay has nothing to compare (its forward, "
                              f"step {fwd.index}, replays)")
        if not targets and layout.STOPPED_PASS_NOTE in step.extra.get("notes", []):
            raise ReplayError(f"backward step {step.index}: its backward pass stopped (an exception raised during it: "
                              "anomaly mode's, a Ctrl-C) before this step sent any gradient; a replay has nothing "
                              f"to compare (its forward, step {fwd.index}, replays)")
        if not targets:
            shared = [n.partition(": ")[0] for n in fwd.extra.get("notes", []) if layout.SHARED_ARGUMENTS_NOTE in n]
            modules = module_arguments(fwd.arguments) if not shared and not changed else []
            why = f" (its forward's arguments {shared[0]} shared memory: they are not followed for gradients)" \
                if shared else f" (its forward changed its arguments {changed[0].partition(': ')[0]} in place " \
                "without returning them: their grad inputs are not recorded)" if changed else \
                f" ({self._networks_unfollowed(modules)})" if modules else ""
            raise ReplayError(f"backward step {step.index} has no grad input{why}, and " + (
                f"its {not_compared}" if not_compared else
                "no parameter grad recorded") + ": a replay has nothing to compare")
        # A pass taken with create_graph=True ran its backward with grad mode on (what the step's settings
        # record), under which torch computes some gradients by other formulas (SiLU's): the replay takes it so.
        settings = {**step.settings, **self.plan.settings}
        graphed = settings.get("grad_enabled") is True
        with state.applied(settings, step.rng, threads=threads, notes=warnings), \
                self._around("backward"), collectives.refused_in_backward(step):
            try:
                try:
                    inner_leaves = [t for t in tap.leaves if not any(t is x for x in targets)] if tap else []
                    with _reaching(call.reached), _uses_in_order([_plain(o) for o, _ in pairs],
                                                                 self._since(layout.ORDERED_USES_SINCE)):
                        grads = torch.autograd.grad([_plain(o) for o, _ in pairs], [*targets, *inner_leaves],
                                                    grad_outputs=[g for _, g in pairs], allow_unused=True,
                                                    create_graph=graphed)[:len(targets)]
                except RuntimeError as exc:
                    if "use_reentrant=True" not in str(exc) or not all(t.is_leaf for t in targets):
                        raise
                    with _uses_in_order([_plain(o) for o, _ in pairs], self._since(layout.ORDERED_USES_SINCE)):
                        grads = _grads_by_backward(pairs, targets, [*params.values(), *call.leaves.values()])
            except PdbgError:
                raise
            except Exception as exc:  # noqa: BLE001 - an edited grad output of another shape, a swapped module's own
                raise ReplayError(f"backward step {step.index}: torch.autograd.grad from the recorded grad outputs "
                                  f"raised {brief(exc)}") from exc
        if graphed:  # (the graph of the gradients is not kept)
            grads = tuple(g.detach() if g is not None else None for g in grads)
        values = {f"param_grad:{r.name}" if r.role == "param_grad" else r.name: g for r, g in zip(wanted, grads)}
        result.values = values
        result.outputs = [_compare_one(step, r, g) for r, g in zip(wanted, grads)]
        if tap is not None and nested:
            param_grads = {r.name: g for r, g in zip(wanted, grads) if r.role == "param_grad" and g is not None}
            result.inner = tap.compare_backward(param_grads, fwd.module_path, step.index)
            result.unrecorded_inner = tap.unrecorded()
            if tap.unseen:
                result.warnings.append(tap.unseen_text)
            self._inner_drift(result)
        result.match = all(d.match for d in result.outputs) and all(s.match for s in result.inner) \
            and result.unrecorded_inner is None
        if not result.match and self.plan.empty and layout.SECOND_ORDER_NOTE in step.extra.get("notes", []):
            # (a later first-order pass through the same graph, autograd.grad with retain_graph, matches; a
            # what-if is meant to differ)
            raise ReplayError(_second_order(step))
        self._likely_causes(result, call)
        return result


Around = Callable[[str], contextlib.AbstractContextManager[Any]]
_SAVE_ON_CPU = "torch.autograd.graph:save_on_cpu."  # its hooks' references: a copy to the CPU and back, lossless


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass's output as a plain alias of it, in its graph (autograd's ``grad`` of it is the
    replay's call, not the step's: a subclass that refuses operations it does not know refuses it)."""
    if type(t) is torch.Tensor or not isinstance(t, torch.Tensor):
        return t
    with torch._C.DisableTorchFunction():
        return t.as_subclass(torch.Tensor)


def _dual(fwd: Step) -> bool:
    """Whether a forward step's call had forward-AD dual tensors (``layout.DUAL_NOTE``)."""
    return any(isinstance(n, str) and layout.DUAL_NOTE in n for n in fwd.extra.get("notes", []))


def _second_order(step: Step) -> str:
    bundle = step.rec.bundle_info
    where = "" if bundle is None or bundle.get("iteration") else \
        " (in the recording this bundle was made from: bundle that step, or the whole iteration with --iteration)"
    return (f"backward step {step.index} ran through the gradients an earlier backward pass took with "
            "create_graph=True (a gradient penalty): its gradients hold second-order terms that a replay of this "
            f"step's backward alone does not compute; that earlier pass's backward step replays{where}")


def _lazy_text(step: Step, fwd: Step, kind: str) -> str:
    """Why ``step`` is not replayed, where its forward call (``fwd``; itself for a forward step) returned
    ``kind`` (``jsonval.lazy_kind``): a generator or coroutine whose body ran after the call had returned."""
    did = f"{kind}, whose work ran after the call had returned, as its caller iterated or awaited it"
    fix = "make the step compute its values and return them (a tensor, a list) to replay it"
    if step is not fwd:
        return (f"backward step {step.index}: its forward (step {fwd.index}, {fwd.name}) returned {did}: the "
                f"gradients recorded here went through that work, outside the step; {fix}")
    return f"step {step.index} ({step.name}) returned {did}: outside the step, which recorded none of it; {fix}"


def _lazy_refusal(step: Step) -> str | None:
    """``_lazy_text`` where the recorded output of ``step``'s forward call was a generator, a coroutine or
    a builtin lazy iterator, else None."""
    fwd = step.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
    kind = jsonval.lazy_doc(fwd.output_structure)
    return None if kind is None else _lazy_text(step, fwd, kind)


def _same_bits(kept: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` holds the bits ``kept`` does (NaN as NaN: a byte comparison)."""
    try:
        if kept.shape != t.shape or kept.dtype != t.dtype:
            return False
        return torch.equal(kept.reshape(-1).view(torch.uint8), t.detach().reshape(-1).view(torch.uint8))
    except RuntimeError:  # (a dtype without a byte view: its values, then)
        return bool(torch.equal(kept, t.detach()))


def _operator_step(target: Any) -> Any:
    """The paper step an operator of ``torch.library.custom_op`` is made of (``@custom_op(...)`` over
    ``@paper_step(...)``: the step's name finds the operator, whose kernel called the step), else ``target``."""
    made_of = getattr(target, "_init_fn", None)
    if type(target).__name__ == "CustomOpDef" and getattr(made_of, "__pdbg_step__", None) is not None:
        return made_of
    return target


def _seed_generators(args: Any, kwargs: dict[str, Any], seed: int) -> None:
    """Seed the generator objects a replay decoded for the call's arguments (torch.Generators; numpy's and
    Python's, since 1.23; and one level inside its list, tuple and dict arguments) with a ``seed``
    intervention's seed, as it seeds torch's, numpy's and Python's own: a step drawing only from a generator
    passed to it would otherwise draw as recorded, and look independent of the seed."""
    for value in (*args, *kwargs.values()):
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Generator):
                item.manual_seed(seed)
            elif isinstance(item, random.Random):
                item.seed(seed)
            elif isinstance(item, (np.random.Generator, np.random.RandomState, np.random.BitGenerator)):
                _seed_numpy(item, seed)


def _seed_numpy(rng: Any, seed: int) -> None:
    """Seed a numpy generator as one of its kind made with ``seed`` is: a RandomState on MT19937 as
    ``RandomState(seed)`` (32 bits, as numpy's global one is seeded), any other by its bit generator made
    from the seed, as ``np.random.default_rng(seed)`` makes a PCG64 (a RandomState cannot seed another)."""
    kind, _, state = snapshot.read_global_rng(rng)[1]
    if kind == "numpy.random.RandomState" and state["bit_generator"] == "MT19937":
        rng.seed(seed % 2**32)
    else:  # (a torch seed may be negative)
        snapshot.set_global_rng(rng, (kind, None, getattr(np.random, state["bit_generator"])(seed % 2**64).state))


def _refuse_lazy(step: Step, fwd: Step, out: Any) -> None:
    """Refuse ``step`` where its replayed forward call (``fwd``'s) returned a generator, a coroutine or
    another lazy iterator (the recording did not say: a type it does not name as one), closed unrun."""
    kind = jsonval.lazy_kind(out)
    if kind is None:
        return
    close = getattr(out, "close", None)  # (a coroutine never awaited warns when collected, unless closed)
    if callable(close) and kind.startswith(("a generator", "a coroutine")):
        close()
    raise ReplayError(_lazy_text(step, fwd, kind))


def known_refusal(step: Step) -> str | None:
    """Why a replay of ``step`` is sure to be refused, where its documents alone tell (an argument that
    could not be recorded as data; a second-order backward with no grad output to start from; a step
    that returned a generator), or None: what ``pdbg bundle`` warns of without replaying."""
    lazy = _lazy_refusal(step)
    if lazy is not None:
        return lazy
    fwd = step.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
    opaque = _first_opaque(fwd.arguments)
    if opaque is not None:
        what = _opaque_argument(fwd, opaque) or (
            unresolved(opaque) if jsonval.opaque_reason(opaque) is not None or jsonval.function_name(opaque)
            else f"a {opaque.type}, which could not be recorded as data")
        return f"step {fwd.index} ({fwd.name}) was called with {what}; it cannot be replayed"
    if step.phase == "backward" and layout.SECOND_ORDER_NOTE in step.extra.get("notes", []) and \
            not any(r.role == "grad_output" for r in step.records):
        return _second_order(step)
    return None


def _instance(step: Step) -> Any:
    """The module object a module step ran on, as its module document numbers it (None where it does not)."""
    doc = step._doc("module") if step.definition.get("kind") == "module" else None
    return doc.get("instance") if isinstance(doc, dict) else None


def _made_by_the_call(step: Step, edit: intervene.Change) -> str | None:
    """Why an edit of the step's own parameter or buffer matched nothing, where the call itself made it:
    a lazy module's (``nn.LazyLinear``), uninitialized when the call began, which the call initializes
    (lazy initialisation), so that there is nothing to edit before it; the edit belongs at a later call
    of the step, named where the recording holds one. None for another edit."""
    forward = step.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step
    if edit.step is not None or edit.tensor not in forward.uninitialized:
        return None
    instance = _instance(forward)
    if step.module_path or instance is not None:  # by its module (LazyLinear is Linear once made): its path, or
        later = [s for s in step.rec.steps.filter(phase=step.phase, module_path=step.module_path)  # the object
                 if step.module_path or _instance(s) == instance]
    else:
        later = step.rec.steps.filter(phase=step.phase, name=step.name)
    after = next((s for s in later if s.index > step.index and edit.tensor not in (
        s.rec.step(s.forward) if s.phase == "backward" and s.forward is not None else s).uninitialized), None)
    later_call = f"a later call, {after.selector}" if after is not None else \
        "a later call of the step (this recording holds none)"
    what = "it" if edit.key == edit.tensor else edit.tensor
    return (f"{edit.key}: {what} did not exist when this call began: the call itself made it (lazy initialisation: "
            "a lazy module such as nn.LazyLinear makes its parameters at its first call), so there was nothing to "
            f"edit; the edit belongs at {later_call}")


def _opaque_argument(step: Step, opaque: jsonval.Opaque) -> str | None:
    """What a refusal says of the argument that holds ``opaque``, the first value in the step's arguments
    not recorded as data: the argument's own type and name, and the part inside it as the reason ("a
    transformers DynamicCache as past_key_values (its layers: DynamicLayer objects), which could not be
    recorded as data"); None where the value has a reason of its own (a numpy array too large) or is the
    argument itself (``unresolved`` names its type and repr)."""
    if jsonval.opaque_reason(opaque) is not None:
        return None
    found = next(iter(unrecorded_arguments(step)), None)
    if found is None or not found.inner:  # the argument itself: its type and repr say what it was
        return None
    why = jsonval.function_why(opaque)  # (a function inside it, a BlockMask's mask_mod: why it was not recorded)
    return f"{found.kind()} as {found.name} ({found.inner}), which could not be recorded as data" + (
        f" ({why})" if why else "")


def _first_opaque(doc: Any) -> jsonval.Opaque | None:
    """The first value in an encoded document that could not be encoded (``$opaque``), or that this version
    cannot decode but to a description (a ``$rng`` of a newer version's kind)."""
    if isinstance(doc, dict):
        inner = doc.get("$opaque")
        if len(doc) == 1 and isinstance(inner, dict) and isinstance(inner.get("type"), str):
            return jsonval.Opaque(inner["type"], str(inner.get("repr", "")))
        if len(doc) == 1 and "$rng" in doc:
            try:
                made = jsonval.decode(doc)
            except PdbgError:  # (damaged: the replay's decoding says so)
                return None
            return made if isinstance(made, jsonval.Opaque) else None
        items: Any = doc.values()
    elif isinstance(doc, list):
        items = doc
    else:
        return None
    return next((found for found in map(_first_opaque, items) if found is not None), None)


def _names_step(key: str, step: Step) -> bool:
    """Whether a swap key aims at ``step`` itself: its name, label, module path, or '.'."""
    return key in (".", step.name, step.paper.get("label")) or bool(step.module_path and key == step.module_path)


# The types of functions a module skeleton's "unrecorded" names, and the schema that records them as data
# ($function since 1.6: torch's tensor math and paper steps; $partial since 1.9).
_FUNCTIONS_SINCE = {"builtins:function": (1, 6), "builtins:builtin_function_or_method": (1, 6),
                    "functools:partial": (1, 9)}


def _is_spectral(hook: Any) -> bool:
    return isinstance(hook, dict) and hook.get("kind") == "spectral_norm"


def _written_in_call(modules: list[tuple[str, dict[str, Any]]]) -> tuple[str, ...]:
    """The names (prefixes) of the buffers torch's own code writes inside a module's call, of a skeleton's
    ``modules``: spectral norm's power-iteration vectors, in a parametrization (``fc.parametrizations.``)
    or the hook-based form's (``fc.weight_u``). A replay that left one as recorded skipped that work: it
    is compared, not taken for a change between the calls."""
    out: list[str] = []
    for path, doc in modules:
        if doc.get("parametrized"):
            out.append(f"{join_path(path, 'parametrizations')}.")
        for hook in doc.get("hooks") or ():
            attrs = hook.get("attrs") if _is_spectral(hook) else None
            name = attrs.get("name") if isinstance(attrs, dict) else None
            if isinstance(name, str):
                out += [join_path(path, f"{name}_u"), join_path(path, f"{name}_v")]
    return tuple(out)


@contextlib.contextmanager
def _recursion_room(step: Step, inner: list[Step]) -> Iterator[None]:
    """Python's recursion limit raised by the frames the taps add to each level of the steps the
    replay follows inside ``step`` (a step that recursed 400 deep, recorded so, replays so), put
    back after."""
    depth: dict[int, int] = {step.index: 0}
    for s in sorted(inner, key=lambda s: s.index):  # (a parent is entered before its children)
        depth[s.index] = depth.get(s.parent if s.parent is not None else -1, 0) + 1
    before, added = sys.getrecursionlimit(), _TAP_FRAMES * max(depth.values())
    if added:
        sys.setrecursionlimit(before + added)
    try:
        yield
    finally:
        if added and sys.getrecursionlimit() == before + added:
            sys.setrecursionlimit(before)


_TAP_FRAMES = 6  # frames an inner step's call takes through the taps (the step's wrapper, InnerTap.call, ...)


def _number_stats(doc: Any) -> dict[str, Any]:
    """The statistics a replay shows of an output's numbers that are no tensors: how many are NaN and Inf
    (a float, a numpy array's values: ``jsonval.nonfinite``), and where the output is one finite number (the
    float a learning-rate schedule returns), that number as its min and max."""
    try:
        found = jsonval.nonfinite(doc, "output")
    except Exception:  # noqa: BLE001 - a damaged document: no numbers counted
        found = []
    out: dict[str, Any] = {"nan": sum(f.nan for f in found), "inf": sum(f.inf for f in found)}
    value = doc
    if isinstance(doc, dict) and len(doc) == 1 and "$npscalar" in doc:
        try:
            value = jsonval.decode(doc).item()
        except Exception:  # noqa: BLE001 - a damaged number: none shown
            value = None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out["min"] = out["max"] = float(value)
    return out


def _holds_values(doc: Any) -> bool:
    """Whether an output document holds a value that is no tensor and was recorded as data (a numpy array,
    a number, a string), which its encoding compares; not a value recorded by its type alone (``$opaque``),
    nor the type of an object whose fields hold none."""
    if isinstance(doc, list):
        return any(_holds_values(v) for v in doc)
    if isinstance(doc, dict):
        tag = next(iter(doc), None)
        if len(doc) != 1 or not isinstance(tag, str) or not tag.startswith("$"):
            return any(_holds_values(v) for v in doc.values())
        payload = doc[tag]
        if tag in ("$tensor", "$tensor_meta", "$opaque"):
            return False
        if tag in ("$tuple", "$list", "$set", "$frozenset"):
            return _holds_values(payload)
        if tag in ("$dict", "$mapping", "$object", "$dataclass", "$namedtuple"):
            pairs = payload.get("items") if isinstance(payload, dict) and tag == "$mapping" else payload
            if tag in ("$dict", "$mapping"):  # (keys are no result of the step's)
                values = [p[1] for p in pairs if isinstance(p, list) and len(p) == 2] if isinstance(pairs, list) else []
                attrs = payload.get("attrs") if isinstance(payload, dict) else None
                return _holds_values([values, attrs])
            return isinstance(payload, dict) and _holds_values([payload.get("fields"), payload.get("attrs")])
        return True
    return doc is not None


def _max_value_diff(recorded: Any, replayed: Any) -> float | None:
    """The largest absolute difference between the numbers of two output documents where they pair up
    (numpy arrays of one shape, numbers); None where none do, or where NaN/Inf differ."""
    pairs: list[tuple[Any, Any]] = []

    def number(doc: Any) -> Any:
        if isinstance(doc, dict) and len(doc) == 1 and "$ndarray" in doc:
            try:
                return jsonval.decode(doc)
            except Exception:  # noqa: BLE001 - a damaged array: no number for it
                return None
        if isinstance(doc, dict) and len(doc) == 1 and ("$npscalar" in doc or "$float" in doc):
            return jsonval.decode(doc)
        return doc if isinstance(doc, (int, float)) and not isinstance(doc, bool) else None

    def go(a: Any, b: Any) -> None:
        x, y = number(a), number(b)
        if x is not None and y is not None:
            pairs.append((x, y))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for p, q in zip(a, b, strict=True):
                go(p, q)
        elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
            for k in a:
                go(a[k], b[k])

    go(recorded, replayed)
    far = None
    for a, b in pairs:
        try:
            x, y = np.asarray(a), np.asarray(b)
            if x.shape != y.shape or x.dtype.kind not in "biufc" or y.dtype.kind not in "biufc":
                continue
            d = np.abs(x.astype(np.complex128) - y.astype(np.complex128)) if x.size else np.zeros(0)
        except (TypeError, ValueError):
            continue
        if d.size and not np.isfinite(d).all():
            return None
        if d.size:
            far = max(far or 0.0, float(d.max()))
    return far


def _by_type(doc: Any, as_dicts: bool = False, layouts: bool = True) -> Any:
    """An output document with each opaque object stood for by its type alone: its repr may hold
    its address (``<generator object ... at 0x7f...>``), which no replay gives again. ``as_dicts``:
    dict subclasses as their items, as recordings before schema 1.13 kept them. ``layouts`` False:
    numpy arrays by their values alone, as recordings before schema 1.17 kept them (no strides)."""
    if isinstance(doc, dict):
        if len(doc) == 1 and isinstance(doc.get("$opaque"), dict):
            return {"$opaque": doc["$opaque"].get("type")}
        if not layouts and len(doc) == 1 and isinstance(doc.get("$ndarray"), dict):
            return {"$ndarray": {k: v for k, v in doc["$ndarray"].items() if k != "strides"}}
        if as_dicts and len(doc) == 1 and isinstance(doc.get("$mapping"), dict):
            pairs = doc["$mapping"].get("items")
            pairs = [_by_type(p, as_dicts, layouts) for p in pairs] if isinstance(pairs, list) else []
            if all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and p[0][:1] != "$" for p in pairs):
                return dict(pairs)
            return {"$dict": pairs}
        return {k: _by_type(v, as_dicts, layouts) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_by_type(v, as_dicts, layouts) for v in doc]
    return doc


def _files_changed_since(run_info: dict[str, Any], call: _Call, script: str | None,
                         reached: dict[str, list[str]]) -> list[str]:
    """The files of the replayed module's classes (its submodules', whose code a recording does not
    hash: only the step's own is), or of a function step, and of the functions the call ran besides
    (``reached``: by file, those the recording holds no hash of), modified after the recording began:
    code the step ran may differ. ``script``: the training script's path, where its classes and
    functions (``__main__``'s) were loaded from."""
    from .bundles import installed

    started = run_info.get("started_unix")
    if not isinstance(started, (int, float)):
        return []
    function = call.module is None  # a function step: its own body is hashed, not the helpers and data of its file
    defined = ([inspect.unwrap(getattr(call.fn, "__func__", call.fn))] if function else
               list(dict.fromkeys(type(m) for m in call.module.modules())))
    changed: dict[str, list[str]] = {}
    for obj in defined:
        name = getattr(obj, "__qualname__", "?")
        try:
            file = script if getattr(obj, "__module__", None) == "__main__" else inspect.getsourcefile(obj)
        except (TypeError, OSError):
            continue
        if file is None or installed(file) or name in changed.get(file, ()):
            continue
        with contextlib.suppress(OSError):
            if os.path.getmtime(file) > started:
                changed.setdefault(file, []).append(name)
    ran: dict[str, list[str]] = {}
    for file, names in reached.items():
        with contextlib.suppress(OSError):
            if os.path.getmtime(file) > started and not (function and file in changed):
                ran[file] = names
    out = [f"{file} was modified after the recording began, and the step's function {names[0]} is defined there: "
           "the helpers and module-level values it uses from that file may not be what ran (a likely cause of any "
           "difference)" for file, names in changed.items()] if function else []
    for file in dict.fromkeys([*([] if function else changed), *ran]):
        uses, calls = ([] if function else changed.get(file, [])), ran.get(file, [])
        ran_there = f"{', '.join(calls[:6])}{' ...' if len(calls) > 6 else ''}"
        what = (f"the step's module uses {', '.join(uses)} from it" + (f" and its call ran {ran_there} there"
                                                                     if calls else "")
                if uses else f"the step's call ran {ran_there} from it")
        out.append(f"{file} was modified after the recording began, and {what}: its code may not be what ran (a likely "
                   "cause of any difference)")
    return out


# What the warnings of a replay that differs say of the code it ran not being the recorded code (bundle --verify
# names them): a definition's hash, a file's time, the repository's commit, code of which no hash was recorded.
_ABOUT_CODE = ("changed since recording", "was modified after the recording began", "the repository of the training "
               "code", "of which the recording holds no hash")


def about_code(warning: str) -> bool:
    """Whether a replay's warning says that code it ran may not be the recorded code."""
    return any(text in warning for text in _ABOUT_CODE)


def _unhashed(reached: dict[str, list[str]]) -> str:
    """What a replay that differs says of the training project's code it ran besides what the recording holds
    a hash of (``Replayer._reached_code``), where no file of it was modified after the recording began."""
    ran = "; ".join(f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''} in {file}"
                    for file, names in list(reached.items())[:3])
    return (f"the step's call ran code of the training project outside its recorded definition ({ran}), of which the "
            "recording holds no hash: whether it changed since recording is not checked (a likely cause of the "
            "difference if it did: a helper or custom operator edited since); its files were not modified after the "
            "recording began, so another likely cause is a value that code reads which the training changed as it "
            "ran and a recording does not hold (an item of a module-level dict, an attribute of a module-level object "
            "or class: SCHEDULE[\"tau\"] set in the loop, read by a custom Function's forward): pass it to the step "
            "as an argument")


def _committed(run_info: dict[str, Any]) -> bool:
    """Whether the recording names the git commit of the training code's repository (then a replay
    says where the repository is not as recorded, ``_repository_changed``)."""
    git = run_info.get("git")
    return isinstance(git, dict) and isinstance(git.get("commit"), str)


@contextlib.contextmanager
def _uses_in_order(outputs: list[torch.Tensor], wanted: bool) -> Iterator[None]:
    """A replayed backward from ``outputs`` adds the uses of its inner steps' tapped tensors that their ends did
    not find in the order they run, as the recorder of the recording's schema did (``wanted``: 1.28 or later;
    taps.order_uses): an outer step's gradients are then the recording's, bit for bit."""
    roots = taps.root_nodes(outputs) if wanted else None
    undo = taps.order_uses(roots) if roots else None
    try:
        yield
    finally:
        if undo is not None:
            undo()


@contextlib.contextmanager
def _reaching(reached: set[types.CodeType]) -> Iterator[None]:
    """Gathers the Python functions the block runs on this thread, by code object (``_Call.reached``): where a
    replay differs, what it ran of the training project's code besides what the recording holds a hash of is
    named (a custom operator's body in another file). Through cProfile, which calls nothing in Python at each
    call (a Python profile function made verify half as slow again). Where a profiler is set already (the
    user's), it is left alone and nothing is gathered."""
    import cProfile

    profile = cProfile.Profile(builtins=False, subcalls=False)
    try:
        if sys.getprofile() is not None:
            raise ValueError("a profiler is set")
        profile.enable()
    except ValueError:  # (Python 3.12 and later: another profiler is active)
        yield
        return
    try:
        yield
    finally:
        profile.disable()
        reached.update(entry.code for entry in profile.getstats() if isinstance(entry.code, types.CodeType))


# PaperDebugger's own packages (the recorder's paper_step wrapper runs in a replayed call too), where they are
_HERE = Path(__file__).parents[1]
_PAPERDEBUGGER = tuple({str(root / name) + os.sep for root in (_HERE, _HERE.resolve())
                        for name in ("recorder", "replayer", "tui")})


def _repository_changed(run_info: dict[str, Any]) -> str | None:
    """Where the recording names the git commit of the training code's repository: what of it is
    not as it was (another commit, or changes not committed), which the step's own source check
    cannot see (a helper in another module that the step calls)."""
    from recorder.run import git_state

    then = run_info.get("git")
    script, cwd = run_info.get("script"), run_info.get("cwd")
    where = os.path.dirname(script) if isinstance(script, str) else cwd
    if not isinstance(then, dict) or not isinstance(then.get("commit"), str) or not isinstance(where, str) \
            or not os.path.isdir(where):
        return None
    now = git_state(where)
    if now is None:
        return None
    short = then["commit"][:12]
    if now["commit"] != then["commit"]:
        return (f"the repository of the training code ({where}) was at commit {short} when recorded and is at "
                f"{now['commit'][:12]} here: code the step calls may have changed (git diff {short}; a likely cause "
                "of any difference)")
    if now["dirty"] and not then.get("dirty"):
        return (f"the repository of the training code ({where}) has changes not committed since commit {short}, "
                "which it was at, clean, when recorded: code the step calls may have changed (git diff; a likely "
                "cause of any difference)")
    return None


_DATA = (bool, int, float, complex, str, torch.Tensor, np.ndarray, list, dict, set)
_UNBOUND = object()  # a module-level name loading the code does not bind (main() alone does)


def _bound_as(value: Any) -> str:
    """What a message says a module-level name is bound to: "None", "nothing", "a numpy Generator"."""
    if value is _UNBOUND:
        return "nothing"
    if value is None:
        return "None"
    return f"a {snapshot.rng_kind(value)}" if snapshot.is_global_rng(value) else f"a {type(value).__name__}"


def _data_warning(whose: str, names: list[str]) -> str:
    """What a replay says of the module-level data ``names`` (``_data_globals``) that ``whose`` code reads."""
    unset = (": a name None when the code is loaded is set by the training script as it ran (its main()), which a "
             "replay does not run; pass it to the step as an argument, or keep it in the step's module, to have it "
             "recorded") if any(n.endswith(_NONE_AT_LOAD) for n in names) else ""
    return (f"{whose} reads the module-level {', '.join(names)}, whose values are not recorded: the replay used their "
            "values now (a likely cause of any difference, if training changes them, an annealed temperature, a global "
            f"step count, or the environment or command line set them when the code was loaded){unset}")


_NONE_AT_LOAD = " (None when the code is loaded)"


def _data_globals(fn: Any) -> list[str]:
    """The module-level names ``fn``'s own code reads that hold data (numbers, tensors, containers),
    not functions, classes or modules: state a step depends on that is not one of its arguments."""
    import dis

    code_of = inspect.unwrap(getattr(fn, "__func__", fn))
    code, env = getattr(code_of, "__code__", None), getattr(code_of, "__globals__", None)
    if code is None or not isinstance(env, dict):
        return []
    names: list[str] = []
    todo = [code]
    while todo and len(todo) < 64:  # its own code and the code nested in it (comprehensions, lambdas)
        here = todo.pop()
        names += [i.argval for i in dis.get_instructions(here) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
        todo += [c for c in here.co_consts if isinstance(c, types.CodeType)]
    return [n + (_NONE_AT_LOAD if env[n] is None else f" ({type(env[n]).__name__})") for n in dict.fromkeys(names)
            if isinstance(n, str) and n in env and (env[n] is None or isinstance(env[n], _DATA))
            and not n.startswith("__") and not snapshot.is_global_rng(env[n])][:5]


def _read_modules(call: _Call) -> list[torch.nn.Module]:
    """The modules the replayed step's code reads by module-level names (a module step's: its forward's), and the
    networks it was given (1.30: a distillation loss's paper-step teacher), but its own: where the steps inside
    them ran, which a replay pairs with their records (``InnerTap``)."""
    target = call.fn if call.module is None else type(call.module)
    given = [m for m in _modules_in([*call.args, *call.kwargs.values()])]
    found = [*snapshot.global_modules(target), *given]
    return [m for i, m in enumerate(found) if m is not call.module and not any(m is o for o in found[:i])]


def _modules_in(values: list[Any], depth: int = 4) -> list[torch.nn.Module]:
    """The modules among rebuilt arguments, inside lists, tuples and dicts (an ensemble's members) too."""
    out: list[torch.nn.Module] = []
    for v in values:
        if isinstance(v, torch.nn.Module):
            out.append(v)
        elif depth and isinstance(v, (list, tuple)):
            out += _modules_in(list(v), depth - 1)
        elif depth and isinstance(v, dict):
            out += _modules_in(list(v.values()), depth - 1)
    return out


def _grads_by_backward(pairs: list[tuple[torch.Tensor, torch.Tensor]], targets: list[torch.Tensor],
                       leaves: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """The targets' gradients by ``torch.autograd.backward`` into their ``.grad``: a step whose code
    runs ``torch.utils.checkpoint`` with ``use_reentrant=True`` (Hugging Face's gradient
    checkpointing in transformers 4) refuses ``torch.autograd.grad``. Every leaf the replay made or
    rebuilt (``leaves``, ``targets`` among them: all leaves) starts without a gradient and gets its
    own ``.grad`` back after."""
    kept = {id(t): (t, t.grad) for t in [*leaves, *targets]}
    try:
        for t, _ in kept.values():
            t.grad = None
        torch.autograd.backward([_plain(o) for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        return tuple(t.grad for t in targets)
    finally:
        for t, grad in kept.values():
            t.grad = grad


def _held_states(recorded: dict[str, Any]) -> dict[str, Any]:
    """The recorded states of the generators a step's module held, by place ("gen", "inner.rng"), from its
    decoded RNG parts."""
    return {part.removeprefix(snapshot.MODULE_PREFIX): state for part, state in recorded.items()
            if part.startswith(snapshot.MODULE_PREFIX)}


def _selector_name(step: Step) -> str:
    """What names an inner step in an edit or swap key: a module step's path, else its name."""
    return step.module_path if step.definition.get("kind") == "module" and step.module_path else step.name


def _no_context(stage: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass
class _Call:
    step: Step
    fn: Any
    module: torch.nn.Module | None
    args: list[Any]
    kwargs: dict[str, Any]
    leaves: dict[str, torch.Tensor]
    vmap: _Vmap | None = None  # how it runs under torch.func.vmap again, where it ran under it
    unrecorded: list[str] = field(default_factory=list)  # attributes the module's constructor made (Rebuilt)
    # module-level generator objects its code reads, with their recorded states (Replayer._global_rngs)
    rngs: list[tuple[Any, Any]] = field(default_factory=list)
    unread_rngs: list[str] = field(default_factory=list)  # those whose state the recording does not hold
    # generator objects its module holds, with their recorded states (Replayer._module_rngs)
    held: list[tuple[Any, Any]] = field(default_factory=list)
    unset_rngs: list[str] = field(default_factory=list)  # those recorded that the replay could not set
    # module-level names its code reads whose recorded binding cannot be imported to check (Replayer._bind_globals)
    unchecked: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # what the module was rebuilt without (Rebuilt.left_out)
    order_doubts: list[str] = field(default_factory=list)  # (before 1.16) children that may be out of order
    code_drift: list[str] = field(default_factory=list)  # submodule classes whose code changed since recording
    classes: dict[str, Any] = field(default_factory=dict)  # the rebuilt module's classes, by reference
    reached: set[types.CodeType] = field(default_factory=set)  # the Python code the call ran (_reaching)
    set_outside: list[str] = field(default_factory=list)  # tensors code outside the module set (Rebuilt.set_outside)

    def run(self) -> Any:
        # (given back as they were: a notebook's own generators, a module another call of the pass runs on too)
        with snapshot.applied_global_rngs([*self.rngs, *self.held]), _reaching(self.reached):
            if self.vmap is None:
                return self.fn(*self.args, **self.kwargs)
            return self.vmap.run(self.fn, self.module, self.args, self.kwargs)


def _set_outside(step: Step, names: list[str]) -> str:
    """What a module rebuilt without tensors that code outside it set before each call (``Rebuilt.set_outside``)
    lacks, with the step enclosing ``step``'s call, whose code sets them, to replay instead ("" where there
    are none). Said before the rest of what it was rebuilt without: register_buffer would not fit them."""
    if not names:
        return ""
    what = (f"attributes {', '.join(names)} of the step's module are tensors" if len(names) > 1 else
            f"attribute {names[0]} of the step's module is a tensor")
    text = (f"{what} that code outside the module sets on it before each call (a wrapper or hook), so not recorded "
            "with this step")
    them = "them" if len(names) > 1 else "it"
    if step.parent is None:
        return f"{text}; replaying a step that encloses the module's call, whose code sets {them}, works"
    outer = step.rec.step(step.parent)
    return (f"{text}; replaying the step that encloses it, step {outer.index} ({outer.name}{outer.where}), whose "
            f"code sets {them}, works")


@dataclass
class _Vmap:
    """How a step called under torch.func.vmap runs under ``vmap`` again: the batch dimension of each
    argument (``in_dims``, a pytree of the (args, kwargs) pair: nested and keyword tensors too), of the
    module's parameters and buffers a ``stack_module_state`` ensemble batched (``state``: name -> dim,
    passed by ``torch.func.functional_call``), of the outputs (``out_dims``, the recorded output's
    structure: a tuple, dict or nested one), and the ``randomness`` it ran with. ``size``: the batch
    size, where no argument is batched (a random draw of randomness="different" batched the outputs)."""

    in_dims: Any
    state: dict[str, int]
    out_dims: Any
    randomness: str
    size: int | None = None

    def run(self, fn: Any, module: torch.nn.Module | None, args: list[Any], kwargs: dict[str, Any]) -> Any:
        state: dict[str, torch.Tensor] = {}
        if self.state and module is not None:
            own = {**dict(module.named_parameters(remove_duplicate=False)),
                   **dict(module.named_buffers(remove_duplicate=False))}
            state = {n: own[n] for n in self.state if n in own}
        dims = ({n: self.state[n] for n in state}, *self.in_dims)
        given: tuple[Any, ...] = (state, args, kwargs)
        if self.size is not None:  # (vmap needs one batched argument: a stand-in of the batch's size)
            dims, given = (*dims, 0), (*given, torch.empty(self.size))

        def one(state: dict[str, torch.Tensor], a: list[Any], k: dict[str, Any], *_: Any) -> Any:
            if state:
                return torch.func.functional_call(fn, state, tuple(a), k)
            return fn(*a, **k)

        return torch.func.vmap(one, in_dims=dims, out_dims=self.out_dims, randomness=self.randomness)(*given)


_RANDOMNESS_ERROR = "randomness error mode"  # what torch's vmap raises at a random draw under randomness="error"
_NO_OP = re.compile(r"'_OpNamespace' '([\w.]+)' object has no attribute '(\w+)'")  # torch.ops.NS.NAME: none such


def _vmap_plan(step: Step, args: list[Any], kwargs: dict[str, Any], given: dict[str, torch.Tensor],
               resolve: Callable[[str], Any], warnings: list[str]) -> _Vmap | None:
    """For a step called under torch.func.vmap (its ``extra`` names the batch dimension of each
    batched record, and the records hold the whole batch): how to replay it under ``vmap`` again
    (``given``: the argument tensors by record name). One level; a watched tensor batched with them is
    not an argument nor compared, and is left out."""
    dims = step.extra.get("vmap")
    if not dims:
        return None
    if any(len(d) != 1 for d in dims.values()):
        raise ReplayError(f"step {step.index} ({step.name}) ran under nested torch.func.vmap; replaying it is not "
                          "supported")
    roles = {r.name: r.role for r in step.records}
    by_id = {id(t): n for n, t in given.items()}
    state = {n: d[0] for n, d in dims.items() if roles.get(n) in ("param", "buffer")}
    placed: set[str] = set()

    def in_dim(value: Any) -> int | None:
        name = by_id.get(id(value)) if isinstance(value, torch.Tensor) else None
        if name not in dims:
            return None
        placed.add(name)
        return dims[name][0]

    in_dims = tree_map(in_dim, (list(args), dict(kwargs)))
    other = sorted(n for n, role in roles.items() if n in dims and role == "input" and n not in placed)
    if other:
        raise ReplayError(f"step {step.index} ({step.name}) ran under torch.func.vmap with {', '.join(other)} batched "
                          "inside an object torch's vmap does not take apart (it takes tuples, lists, dicts, named "
                          "tuples); it cannot be replayed under vmap")
    size = None
    if not any(d is not None for d in tree_leaves(in_dims)) and not state:
        rec = next(r for r in step.records if r.name in dims)
        size = int(rec.shape[dims[rec.name][0]])
    out_dims = _out_dims(step, step._doc("output"), dims, resolve)
    levels = step.extra.get("vmap_randomness")
    levels = [str(r) for r in levels] if isinstance(levels, list) and levels else ["error"]
    if len(set(levels)) > 1:
        warnings.append(f"the step ran inside {len(levels)} nested vmap levels of randomness {', '.join(levels)} "
                        f"(innermost first); the replay runs one, with randomness={levels[0]!r} (a likely cause of "
                        "any difference)")
    return _Vmap(in_dims, state, out_dims, levels[0], size)


def _out_dims(step: Step, doc: Any, dims: dict[str, list[int]], resolve: Callable[[str], Any]) -> Any:
    """``vmap``'s ``out_dims`` for a step's recorded output document: its structure (tuples, lists, dicts,
    named tuples, OrderedDicts) with each tensor's batch dimension, and None for each part that holds no
    batched tensor (vmap gives it back as it is)."""
    if not any(isinstance(d, dict) and d.get("$tensor") in dims for d in jsonval.walk(doc)):
        return None
    if isinstance(doc, list):
        return [_out_dims(step, d, dims, resolve) for d in doc]
    if not any(isinstance(k, str) and k.startswith("$") for k in doc):
        return {k: _out_dims(step, v, dims, resolve) for k, v in doc.items()}
    tag, body = next(iter(doc.items())) if len(doc) == 1 else ("$object", None)
    what = f"step {step.index} ({step.name}) ran under torch.func.vmap and returned a {tag[1:]}"
    if tag == "$tensor":
        return dims[body][0]
    if tag == "$tuple" and isinstance(body, list):
        return tuple(_out_dims(step, d, dims, resolve) for d in body)
    if tag in ("$namedtuple", "$mapping") and isinstance(body, dict):
        what = f"step {step.index} ({step.name}) ran under torch.func.vmap and returned a {body.get('type')}"
        try:
            cls = resolve(str(body.get("type")))
        except ReplayError as exc:
            raise ReplayError(f"{what} holding batched tensors, whose class a replay needs to give vmap the shape of "
                              f"the outputs, and cannot load ({exc}); it cannot be replayed under vmap") from None
        fields, items = body.get("fields"), body.get("items")
        if tag == "$namedtuple" and isinstance(fields, dict) and isinstance(cls, type) and issubclass(cls, tuple):
            return cls(**{k: _out_dims(step, v, dims, resolve) for k, v in fields.items()})
        if cls is collections.OrderedDict and isinstance(items, list):
            return cls((k, _out_dims(step, v, dims, resolve)) for k, v in items)
    raise ReplayError(f"{what} holding batched tensors, which a replay cannot give vmap as the shape of its "
                      "outputs (it gives tuples, lists, dicts, named tuples and OrderedDicts); it cannot be replayed "
                      "under vmap")


def _materialize(step: Step, rec: TensorRecord, notes: list[str] | None = None) -> torch.Tensor:
    """A recorded tensor as it was: its strides and device (CPU stand-in where the device is missing).
    ``notes``: where a layout is not rebuilt (a sparse view of a large tensor), a warning saying so. A sparse
    tensor is made again from its parts (1.19), each as it was, on its device."""
    parts = None if rec.has_payload else step.sparse_parts(rec)
    if parts is not None:
        return step.rec.rank.sparse_tensor(rec, parts, {p: _materialize(step, r, notes)
                                                        for p, r in parts.records.items()})
    value = step.rec.rank.tensor(rec)
    if rec.stride and tuple(rec.stride) != tuple(value.stride()) and value.numel() != 1:
        value = _with_strides(value, tuple(rec.stride))
        shape, stride = tuple(value.shape), tuple(rec.stride)
        missed = all(s >= 0 for s in stride) and any(n > 1 and s != 0 and s != t for n, s, t in
                                                      zip(shape, stride, value.stride()))
        if missed and notes is not None:
            span = (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * value.element_size()
            note = (f"{rec.role} {rec.name}: its recorded layout (strides {list(stride)}, a view spanning "
                    f"{span / 2 ** 20:.0f} MiB for {value.numel() * value.element_size() / 2 ** 20:.1f} MiB of values) "
                    "was not rebuilt (a view spanning more than 64 MiB and 8 times its values is not): it is "
                    "replayed contiguous, and a reduction over it may differ in its last bits")
            if note not in notes:
                notes.append(note)
    device = torch.device(rec.device)
    if device.type != "cpu":
        if device.type == "cuda" and not torch.cuda.is_available():
            raise NotOnThisMachine(f"step {rec.step} was recorded on {rec.device}, and this machine has no GPU; replay "
                                   "it on a machine with one")
        value = value.to(device)
    at = placing.misaligned(step, rec)
    if at:  # (1.25) a view that began there (xs[t]): kernels pick their code, and round, by the address
        why = placing.unplaceable(rec, at, value.element_size())
        if why is None:
            value = placing.placed(value, at)
        elif notes is not None and why not in notes:
            notes.append(why)
    return value


def _with_strides(value: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``value`` laid out with the recorded strides: a kernel's order of summation, and so the last
    bits of a reduction, follow the layout. A permuted dense layout (a transpose, channels_last), one
    with gaps (``x[::2]``, ``x.chunk(2, -1)[0]``), an expanded one (stride 0) and overlapping windows
    (``unfold``) are rebuilt; negative strides cannot be, and stay as given."""
    shape = tuple(value.shape)
    if len(stride) != len(shape) or any(s < 0 for s in stride):
        return value
    if any(s == 0 for s, n in zip(stride, shape) if n > 1):  # expanded: rebuild from the unexpanded base
        index = tuple(slice(0, 1) if s == 0 else slice(None) for s in stride)
        return _with_strides(value[index].contiguous(), tuple(s or 1 for s in stride)).expand(shape)
    size = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    if size > 8 * value.numel() and size * value.element_size() > 64 << 20:  # a sparse view of a large tensor:
        return value  # its storage is not made again whole for it
    if overlaps_itself(shape, stride):  # windows over one storage: every element written where it lies
        flat = torch.zeros(size, dtype=value.dtype, device=value.device)
        at = torch.zeros((), dtype=torch.long, device=value.device)
        for d, (n, s) in enumerate(zip(shape, stride)):
            at = at.unsqueeze(-1) + torch.arange(n, device=value.device).mul_(s).view(*([1] * d), n)
        flat[at.reshape(-1)] = value.reshape(-1)
        return flat.as_strided(shape, stride)
    out = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)  # (its gaps are never read)
    out.copy_(value)
    return out


def _aliases(step: Step, tensors: dict[str, TensorRecord], warnings: list[str]) -> dict[str, dict[str, int]]:
    """The arguments that were views of one storage when recorded (the step's extra ``aliases``:
    record name -> [storage, offset]): record name -> its storage's {member: offset}. Those that
    cannot be views of one storage again (of several dtypes or devices, a payload missing) are left
    out, and a warning names them as a likely cause of a difference."""
    recorded = step.extra.get("aliases")
    if not isinstance(recorded, dict):
        return {}
    groups: dict[Any, dict[str, int]] = {}
    for name, place in recorded.items():
        if isinstance(place, list) and len(place) == 2 and name in tensors:
            groups.setdefault(place[0], {})[name] = int(place[1])
    found: dict[str, dict[str, int]] = {}
    for members in groups.values():
        records = [tensors[n] for n in members]
        if len({(r.dtype, r.device) for r in records}) == 1 and all(r.has_payload and r.stride for r in records):
            found.update(dict.fromkeys(members, members))
        else:
            warnings.append(f"{', '.join(members)} shared memory when recorded (views of one tensor), and the replay "
                            "cannot give them one storage again (of several dtypes or devices, or not recorded in "
                            "full): an in-place change the step makes to one does not reach the others (a likely "
                            "cause of any difference)")
    return found


def _no_gradient_wanted(grads: tuple[torch.Tensor | None, ...]) -> None:
    """A replay's tap on a parameter given as an argument: its gradient is taken by autograd.grad."""


def _stand_in(leaf: torch.Tensor) -> torch.Tensor:
    """What a step is given for an input leaf that requires grad: a copy in its layout (``clone``
    makes a layout with gaps contiguous) and at its address modulo ``layout.ALIGNMENT`` (a misaligned
    view's, placing), or the leaf itself where its elements overlap (an expanded tensor: torch refuses
    in-place changes to it anyway); of a sparse one, a copy of its parts."""
    if leaf.layout != torch.strided:
        return leaf.clone()
    shape, stride = tuple(leaf.shape), leaf.stride()
    if overlaps_itself(shape, stride):
        return leaf
    out = placing.empty_at(shape, stride, leaf.dtype, leaf.device, leaf.data_ptr() % layout.ALIGNMENT)
    return out.copy_(leaf)


def _compare_one(step: Step, rec: TensorRecord, value: Any) -> Diff:
    return compare_record(step.rec.rank, rec, value, "recorded a gradient, the replay produced none")


def _compare_all(step: Step, records: list[TensorRecord], values: dict[str, torch.Tensor]) -> list[Diff]:
    diffs = [_compare_one(step, r, values.get(r.name)) if r.name in values else
             Diff(r.name, r.role, False, reason="recorded, but the replay did not produce it",
                  recorded=stats_dict(r.stats), is_complex=r.dtype.startswith("complex")) for r in records]
    recorded = {r.name for r in records}
    for name in values:
        if name not in recorded:
            value = values[name]
            diffs.append(Diff(name, "output", False, reason="produced by the replay, not in the recording",
                              replayed=compare.statistics(value),
                              is_complex=isinstance(value, torch.Tensor) and value.is_complex()))
    return diffs


# Calls at a step's module path looked through for the module object's next call (buffers after).
_NEXT_CALLS = 64


def next_call(rec: Recording, step: Step) -> Step | None:
    """The module's next recorded forward call after ``step``, by the same module object: what it found in the
    buffers is what ``step`` left in them (a BatchNorm's running statistics). A bundle carries it for that."""
    table = rec.steps
    later = np.flatnonzero((table.column("phase") == 0) & (table.column("module_path") == step.module_path)
                           & (table.column("name") == step.name))
    later = later[later > step.index]
    mine = (step._doc("module") or {}).get("instance")  # (1.11) the module object, among those at its path
    return next((s for s in map(rec.step, later[:_NEXT_CALLS].tolist())
                 if mine is None or (s._doc("module") or {}).get("instance") == mine), None)
# What stops a process from outside a step, at whatever line it ran: not the step's outcome.
_STOPPED_FROM_OUTSIDE = frozenset({"builtins:KeyboardInterrupt", "builtins:SystemExit"})
# What the recorder itself raises to stop training (on_anomaly="stop", "pdb"): not the step's outcome.
_RECORDER_STOPS = frozenset({"recorder.monitors:NonFiniteError", "recorder.monitors:BreakpointStop"})


def _stopped(result: ReplayResult) -> bool:
    """Whether the recording stopped training inside the step (its recorded exception is the recorder's own
    stop) and the replay ran it through: the step has no output to compare, the steps inside it do."""
    recorded = result.step.extra.get("exception")
    return isinstance(recorded, dict) and recorded.get("type") in _RECORDER_STOPS and result.exception is None


def _changed_parameters(step: Step, module: torch.nn.Module | None, changed: set[str]) -> dict[str, torch.Tensor]:
    """The module's own parameters whose "after:<parameter>" records are among ``changed`` (the recorded call
    changed them in place: a router's load-balancing bias, a frozen weight merged in forward), as the replayed
    call left them, by those records' names."""
    if module is None:
        return {}
    now = dict(module.named_parameters())
    return {f"{layout.AFTER_PREFIX}{r.name}": now[r.name] for r in step.records
            if r.role == "param" and r.name in now and f"{layout.AFTER_PREFIX}{r.name}" in changed}


def _exception_result(result: ReplayResult, raised: BaseException | None, recorded: Any) -> ReplayResult:
    recorded_type = recorded.get("type") if isinstance(recorded, dict) else None
    if recorded_type in _RECORDER_STOPS and raised is None:
        # The recording stopped training inside this step (a step within it went non-finite): the
        # step never returned, so there is no recorded output to compare; the replay ran it through.
        result.match = True
        result.warnings.append(f"the recording stopped training inside this step ({exception_line(recorded)}); it "
                               "returned no output to compare")
        return result
    if raised is not None:
        result.exception = f"{type(raised).__name__}: {raised}"
    if recorded_type and raised is not None:
        same = jsonval.type_ref(type(raised)) == recorded_type
        result.match = same
        result.outputs = [Diff("exception", "output", same, reason=f"recorded {recorded_type}, replay raised "
                               f"{jsonval.type_ref(type(raised))}")]
    elif recorded_type:
        result.match = False
        result.outputs = [Diff("exception", "output", False, reason=f"recorded {recorded_type}; the replay "
                               "returned normally")]
    else:
        result.match = False
        result.outputs = [Diff("exception", "output", False, reason=f"the replay raised {result.exception}; the "
                               "recorded call returned normally")]
    return result


def replay(rec: Recording | str | os.PathLike[str], step: int | str | Step | None = None, *, threads: int | None = None,
           script: str | os.PathLike[str] | None = None, nested: bool = True, swap: dict[str, Any] | None = None,
           edit: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
           seed: int | None = None, use_bundled_source: bool = False) -> ReplayResult:
    """Replay one recorded step and compare it with the recording.

    Args:
        rec: a Recording (``replayer.open``) or its path.
        step: an index, a selector (``"Eq. 2@iter=17#3"``, ``"h.1.mlp@iter=5:backward"``) or a Step;
            None for a bundle's main step.
        threads: force this intra-op thread count instead of the recorded one.
        script: where the training script that ran as ``__main__`` is now, if it moved.
        nested: also compare every step the replayed step encloses (for a backward step: their
            backward steps, from the gradients that pass through them during the replay).
        swap: ``{module path, step name or label: replacement}``; a replacement is an import reference
            (``"mypkg.layers:StableSmoothReLU"``), a class (built from the original's constructor
            arguments or skeleton, given its parameters where names match) or a callable
            ``original -> new``; for a function step an import reference names the new function.
        edit: ``{[STEP/]TENSOR: change}`` for inputs, parameters, buffers and grad outputs (of the step,
            or of a step inside it: ``"smooth_relu#0/args.0"``); a change is an expression in ``x``
            (``"x.clamp(-50, 50)"``: x, torch's operations, tensor methods and math only), a callable or a tensor.
        settings: override recorded settings (``{"deterministic": True}``, ``{"num_threads": 1}``).
        seed: seed torch, numpy and random with this instead of the recorded generator states.
        use_bundled_source: a bundle: replay with the code it carries (runs that code) instead of the
            code installed here.

    Raises ReplayError (with a one-line reason) when the step cannot be replayed, StepNotFoundError
    when ``step`` names nothing, InterventionError for a swap or edit that cannot be applied.
    """
    rec = opened(rec)
    if step is None:
        step = rec.main_step
        if step is None:
            raise ReplayError("give the step to replay: an index or a selector (only a bundle has a main step)")
    return Replayer(rec, script=script, use_bundled_source=use_bundled_source).replay(
        step, threads=threads, nested=nested, swap=swap, edit=edit, settings=settings, seed=seed)


__all__ = ["ReplayResult", "Replayer", "replay"]


def _write_view(storage: torch.Tensor, value: torch.Tensor, offset: int) -> None:
    """Write ``value`` into ``storage`` where a view in its strides at ``offset`` lies. A view that
    reaches one element from several places (``expand()``'s stride 0, an overlapping ``as_strided``)
    cannot be copied into (torch refuses); its places that share an element held one value when
    recorded, so each element is written once, by its flat offset."""
    view = storage.as_strided(value.shape, value.stride(), offset)
    if torch._debug_has_internal_overlap(view) == 0:
        view.copy_(value)
        return
    places = torch.arange(storage.numel(), device=storage.device).as_strided(value.shape, value.stride(), offset)
    storage[places.reshape(-1)] = value.reshape(-1)
