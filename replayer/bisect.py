"""Where a NaN was born, where two runs part, and conditional time travel over a recording.

    origin = replayer.first_nonfinite(rec)          # from the statistics: milliseconds, no replay
    origin.step, origin.cause, origin.spread
    replayer.first_nonfinite(rec, ops=True).op      # the aten operation and the user's source line
    replayer.first_divergence(rec_a, rec_b)         # the root cause, not the steps that only followed
    replayer.find(rec, "Eq. 2", "output.absmax > 1e3", start=origin.step, backward=True)

A step *produced* a non-finite value when one of its results (forward: outputs; backward: grad
inputs and parameter grads) holds NaN or Inf while everything it computed from was finite (forward:
its inputs, parameters and buffers; backward: its grad outputs and its forward call's inputs and
parameters), or NaN of Inf it takes as a mask's (a -inf mask). The origin is the first such step in
execution order, the innermost one where steps nest. NaN or Inf that came into a step from outside
every recorded step (the data, an optimizer update, a gradient penalty computed in the loop whose NaN
reaches a backward step through the graph of gradients) is where it *entered*, even where that step
turns an Inf into NaN. Inf on part of a tensor that nothing non-finite came of (no later step of its
iteration went non-finite: a padding mask, which a batch without padding does not need) is a mask's
(``_Kinds.masks``). Inf at every call (of a call number) is a mask's only where it covers part of its
tensor, or, filling one, where the step's first call held it too (a -inf initial maximum) and, where its
bytes were kept, no +Inf (a sampler's first reverse step dividing by sqrt(alpha_bar) = 0 at every
evaluation fills its output with Inf of both signs: the origin, whatever follows it): a
division by 0 outside the steps that fills the input of an eval loop's call at each iteration the
loop runs came in, however often it runs; a single value that is Inf (a 0-d loss, +inf at every call
where the loop skips the batches whose loss is not finite) never is (``_Kinds.shaped``). A mask's Inf is
harmless only while nothing non-finite comes of it: a step that kept it out of its results at earlier calls
and passes it on at a later one (``_Kinds.harmed``), or whose results go non-finite from a recorded step's
output holding it (NaN of a mask's Inf it takes at every call too), is the origin there, with the step that
made the Inf (``Origin.source``).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import operator
import os
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from recorder import autohooks, jsonval, names, snapshot, transforms
from recorder.errors import PdbgError, RecordingError, ReplayError
from recorder.store import layout
from recorder.store.reader import TensorRecord

from .arguments import data_writes_unseen, type_words, unrecorded_arguments
from .compare import Diff, compare
from .recording import Recording, Step, opened, paper_of, paper_reference, printable, skeleton_modules

_RESULT, _INPUT = layout.NONFINITE_RESULT, layout.NONFINITE_INPUT
SPREAD = 10  # steps listed after the origin


def _column(rec: Recording, name: str) -> np.ndarray:
    return np.asarray(rec.rank.column(f"steps/{name}"))


def step_flags(rec: Recording) -> np.ndarray:
    """Per step: the ``steps/flags`` bits (layout.NONFINITE_RESULT, ...). Recordings before schema 1.2
    (and the first 1.2 recordings) have no flags column: its NaN/Inf bits are computed from the tensor
    statistics then. A recording whose schema has the column and lacks it is damaged, and says so."""
    rank = rec.rank
    if rank.holds("steps/flags"):
        return _column(rec, "flags")
    n = len(rec)
    flags = np.zeros(n, dtype=np.int8)
    if not n or not rank.lengths.get("tensors"):
        return flags
    steps = np.asarray(rank.column("tensors/step"))
    roles = np.asarray(rank.column("tensors/role"))
    stats = np.asarray(rank.column("tensors/stats"))
    bad, nan = (stats[:, 6] + stats[:, 7]) > 0, stats[:, 6] > 0
    phase = _column(rec, "phase")[steps]
    for ph in (0, 1):
        here = phase == ph
        result = bad & here & np.isin(roles, list(layout.RESULT_ROLES[ph]))
        given = bad & here & np.isin(roles, list(layout.INPUT_ROLES[ph]))
        flags[np.unique(steps[result])] |= _RESULT
        flags[np.unique(steps[given])] |= _INPUT
        flags[np.unique(steps[result & nan])] |= layout.NAN_RESULT
        flags[np.unique(steps[given & nan])] |= layout.NAN_INPUT
    return flags


def with_alerts(rec: Recording) -> np.ndarray:
    """Per step: whether it holds alerts (a broken ``watch()`` expectation, a check's or breakpoint's
    message): status ``alert``, or another status with alerts kept beside it (a ``nonfinite`` step
    whose watch broke too; flagged from schema 1.8 on)."""
    alert = _column(rec, "status") == layout.STATUSES.index("alert")
    if not rec.rank.holds("steps/flags"):  # (before 1.2)
        return alert
    return alert | ((_column(rec, "flags") & layout.ALERTS) != 0)


def subtree(rec: Recording, index: int) -> list[int]:
    """The steps nested inside a step (they follow it directly in execution order)."""
    parents = _column(rec, "parent")
    inside, found = {index}, []
    for k in range(index + 1, len(parents)):
        if int(parents[k]) not in inside:
            break
        inside.add(k)
        found.append(k)
    return found


def describe(step: Step) -> str:
    """A step in paper terms: "Algorithm 1, step 5 · MultiScaleFusion · forward · iteration 17 · call 3" (and
    "object 2 of 2" after the module path where several module objects ran as the step: Step.module_object)."""
    ref = paper_reference(step.paper)  # (names as printed: their control characters escaped, names.shown)
    parts = [p for p in (names.shown(ref), names.shown(step.name), names.shown(step.module_path), step.object_text,
                         step.phase_text, f"iteration {step.iteration}", f"call {step.call}") if p]
    return f"step {step.index}: " + " · ".join(parts)


def _counts(rec: Recording, r: TensorRecord) -> str:
    """How many of a record's values are NaN and Inf: "1020 NaN, 4 Inf of 1024"; of a sparse tensor's,
    of the values it stores (its statistics are of those): "3 Inf of 27 stored values"."""
    counts = ", ".join(f"{int(r.stats[k])} {'NaN' if k == 'nan' else 'Inf'}" for k in ("nan", "inf") if r.stats[k])
    sparse = rec.rank.sparse_of(r)
    if sparse is not None:
        return f"{counts} of {sparse[1]} stored values" if sparse[1] is not None else f"{counts} of its stored values"
    if any(d < 0 for d in r.shape):  # a nested tensor's ragged dimension: no count from the shape
        return counts
    return f"{counts} of {int(np.prod(r.shape))}"


def _nonfinite_text(step: Step, roles: frozenset[int] | set[str]) -> list[str]:
    out = []
    for r in step.records:
        if r.role in roles and r.nonfinite:
            written = _written_parameter(step, r)
            label = f"parameter {written} in place" if written else \
                r.name if r.name.startswith(r.role) else f"{r.role} {r.name}"
            out.append(f"{label} ({_counts(step.rec, r)})")
    if "output" in roles and step.phase == "forward":
        out += [f.text() for f in _values(step, "output")]
    return out


def _written_parameter(step: Step, record: TensorRecord) -> str | None:
    """The name of the module's own parameter an "after:<parameter>" output record holds as the call left it
    (the call changed it in place: a router's load-balancing bias), else None (an input's: "after:args.0")."""
    if record.role != "output" or not record.name.startswith(layout.AFTER_PREFIX):
        return None
    name = record.name[len(layout.AFTER_PREFIX):]
    roles = {r.role for r in step.records if r.name == name}
    return name if "param" in roles and "input" not in roles else None


def _values(step: Step, where: str) -> list[jsonval.NonFinite]:
    """NaN/Inf in a forward step's recorded numbers that are no tensors (numpy arrays, floats): in its
    ``"output"`` or its ``"args"`` (``args.5``, ``kwargs.w``)."""
    if step.phase != "forward":
        return []
    try:
        return jsonval.nonfinite(step.output_structure, "output") if where == "output" else \
            jsonval.nonfinite(step.arguments)
    except Exception:  # noqa: BLE001 - a damaged document: only the tensors are judged
        return []


# -- the origin of a NaN --------------------------------------------------------------------------
def find_op(origin: Origin, step: Step, *, use_bundled_source: bool = False,
            script: str | os.PathLike[str] | None = None) -> None:
    """``ops=True``: the operation inside ``step`` that made the first NaN/Inf, into ``origin.op``;
    where there is none, or the step cannot be replayed, ``origin.op_note`` says so (the step-level
    answer stands either way). ``use_bundled_source``: a bundle's step replays with the code it carries;
    ``script``: where the training script is now, if it moved."""
    _find_step_op(origin, step, use_bundled_source=use_bundled_source, script=script)
    if origin.source is not None and origin.step is step:
        _find_source_op(origin, use_bundled_source=use_bundled_source, script=script)


def _find_source_op(origin: Origin, *, use_bundled_source: bool, script: str | os.PathLike[str] | None) -> None:
    """``find_op`` of a harm origin: the operation inside ``origin.source`` that made the mask's Inf the origin
    passed on, into ``origin.source_op``; where the source step cannot be replayed, ``op_note`` says so."""
    from .ops import bisect_ops

    source = origin.source
    assert source is not None
    try:
        origin.source_op = bisect_ops(source.rec, source, use_bundled_source=use_bundled_source, script=script)
    except ReplayError as exc:
        why = f"the operation of step {source.index} that made the Inf the origin passed on is not named: {exc}"
        origin.op_note = f"{origin.op_note}; {why}" if origin.op_note else why


def _find_step_op(origin: Origin, step: Step, *, use_bundled_source: bool,
                  script: str | os.PathLike[str] | None) -> None:
    from .ops import bisect_ops

    notes: list[str] = []
    replayed: list[Any] = []
    harm = origin.step is step and (origin.kept is not None or origin.source is not None)
    try:
        origin.op = bisect_ops(step.rec, step, use_bundled_source=use_bundled_source, notes=notes, script=script,
                               replayed=replayed, passed=harm, kept=origin.kept if harm else None)
    except ReplayError as exc:
        origin.op_note = f"operation-level bisection needs a replay, and this step cannot be replayed: {exc}"
        return
    if origin.op is not None and harm and origin.source is not None:
        origin.op.came_from = f"step {origin.source.index} ({origin.source.name})"
    unlike = _unreproduced(replayed[0], notes) if replayed else None
    if unlike is not None:  # what the replay ran is not what the recorded call ran: its operation may not be either
        differs, why = unlike
        found = ("no single operation inside the step turned finite values into NaN/Inf during it" if origin.op is None
                 else "the operation and line named are the replay's, not necessarily ones the recorded call ran")
        how = f"; {origin.op.how()}" if origin.op is not None and origin.op.how() else ""
        origin.op_note = f"the replay did not reproduce the recorded step ({differs}): {found}{how}; {why}"
        return
    drift = f" ({'; '.join(notes)}: what the replay ran may not be the recorded code)" if notes else ""
    if origin.op is None and not any(r.nonfinite for r in step.records if r.role == "output") and \
            _values(step, "output"):
        origin.op_note = ("no operation of torch's is named: the NaN/Inf is in a result that is no tensor "
                          f"({_values(step, 'output')[0].text()}), made by code outside torch's operators (numpy "
                          f"code in the step){drift}")
    elif origin.op is None and replayed and replayed[0].compared and replayed[0].match:
        exactly = "by the statistics it kept" if replayed[0].by_statistics else "bit for bit"
        origin.op_note = (f"the replay reproduced the step {exactly}, and no single operation of torch's inside it "
                          "turned finite values into NaN/Inf: code outside torch's operators (numpy code writing into "
                          f"a tensor's memory) may have made them{drift}")
    elif origin.op is None:
        origin.op_note = ("no single operation of torch's inside the step turned finite values into NaN/Inf when it "
                          f"was replayed{drift}")
    elif origin.op.how():
        origin.op_note = f"{origin.op.how()}{drift}"
    elif notes:
        origin.op_note = f"the operation and line are those of the code the replay ran{drift}"


def _unreproduced(result: Any, drift: list[str]) -> tuple[str, str] | None:
    """Where the replay of ``find_op`` did not give the recorded results: (what differs, the likely
    causes the replay names: code changed since, module-level values it reads, the environment; else
    what to suspect); None where it matched (or had nothing to compare)."""
    if result.match or not result.compared:
        return None
    differs = "; ".join(d.summary() for d in result.outputs if not d.match)
    causes = [f"{'; '.join(drift)}: the replay ran the code as it is now"] if drift else []
    causes += [w for w in result.warnings if "likely cause" in w and w not in drift]
    if result.environment_differences:
        causes.append(f"the environment differs from the recording's ({'; '.join(result.environment_differences)}: "
                      "a likely cause of a difference of a few ULP)")
    return differs, "; ".join(causes) if causes else (
        "the code the step runs, or a value it reads besides its inputs (a module-level value, an environment "
        "variable), may not be the recorded run's")


@dataclass
class Origin:
    """The answer of :func:`first_nonfinite`."""

    step: Step | None  # the step that produced the first non-finite value, if a recorded step did
    cause: str  # one sentence: what happened, or why no recorded step is to blame
    spread: list[Step] = field(default_factory=list)  # the next steps that went non-finite
    entered: Step | None = None  # when no recorded step produced it: the first step that received it
    op: Any = None  # with ops=True: replayer.ops.OpReport, the operation inside the step
    op_note: str | None = None  # with ops=True and no op: why (the step cannot be replayed, or no operation did it)
    others: dict[int, Origin] = field(default_factory=dict)  # ranks=True: what each other rank saw first
    followed: int | None = None  # how many steps went non-finite after it in all (``spread`` lists the first)
    # Where no recorded step holds NaN/Inf but the run ended by an exception that speaks of one (a loss
    # guard raising FloatingPointError before backward): that exception, made outside the recorded steps.
    ended_by: str | None = None
    # Where the origin passed on a mask's Inf (one its earlier calls, ``kept`` the last, kept out of their results,
    # or that it took from a recorded step's output): the step that made that Inf, if found (``_mask_source``), and
    # with ops=True the operation inside it that did (``source_op``, replayer.ops.OpReport)
    source: Step | None = None
    kept: Step | None = None
    source_op: Any = None
    # Where a grad output came in non-finite: the later step whose backward may have sent it, through an
    # argument whose gradient was not recorded; where a parameter, buffer or input came in non-finite: a recorded
    # step given that very tensor (its values) that may have written it through .data, unseen (the cause names it)
    suspect: Step | None = None
    # Where no recorded step holds NaN/Inf but a step raised an exception that speaks of one (a NaN check inside
    # the step, raising FloatingPointError before it returned): the innermost step it came out of. The NaN/Inf was
    # made inside it; ``find_op`` replays it operation by operation.
    raised_in: Step | None = None
    # Where nothing else is found: a backward pass's exception that speaks of NaN/Inf, raised outside every
    # recorded step's backward and caught by the training code (``final.backward_raised``), in one line
    raised_outside: str | None = None

    @property
    def found(self) -> bool:
        return self.step is not None or self.entered is not None

    @property
    def source_what(self) -> str:
        """What the Inf ``source`` made is to the origin, in words: "the Inf it made NaN of" where the origin's
        results hold NaN, else "the Inf it passed on"."""
        results = layout_results(self.step.phase) if self.step is not None else set()
        nan = self.step is not None and any(r.stats.get("nan") for r in self.step.records if r.role in results)
        return "the Inf it made NaN of" if nan else "the Inf it passed on"

    @property
    def clean(self) -> bool:
        """Nothing to report: no step made or received NaN/Inf, nor did the run end by one made outside them, nor
        did a step raise an exception that speaks of one."""
        return not self.found and self.ended_by is None and self.raised_in is None and self.raised_outside is None

    @property
    def rank(self) -> int | None:
        """The rank of the origin (or of the first step that received the value)."""
        first = self.step or self.entered
        return None if first is None else first.rec.rank.rank

    def to_json(self) -> dict[str, Any]:
        """``pdbg bisect --json``: {"origin", "cause", "op", "source", "source_op", "spread", "entered",
        "ended_by", "raised_in", "rank", "other_ranks"}."""
        return {"origin": self.step.to_json() if self.step else None, "cause": self.cause,
                "op": self.op.to_json() if self.op is not None else None,
                "source": self.source.to_json() if self.source is not None else None,
                "source_op": self.source_op.to_json() if self.source_op is not None else None,
                "spread": [s.to_json() for s in self.spread],
                "entered": self.entered.to_json() if self.entered else None, "ended_by": self.ended_by,
                "raised_in": self.raised_in.to_json() if self.raised_in is not None else None,
                "raised_outside": self.raised_outside,
                "rank": self.rank,
                "other_ranks": {str(r): {"origin": o.step.to_json() if o.step else None,
                                         "entered": o.entered.to_json() if o.entered else None, "cause": o.cause}
                                for r, o in self.others.items()}}

    def __repr__(self) -> str:
        op = f"; operation {self.op.where()}" if self.op is not None else f"; {self.op_note}" if self.op_note else ""
        count = self.followed if self.followed is not None else len(self.spread)
        shown = "" if self.followed is not None or len(self.spread) < SPREAD else "at least "
        spread = f"; {shown}{count} step{'s' if count != 1 else ''} went non-finite after it" if count else ""
        return printable(f"<Origin: {self.cause}{op}{spread}>")

    def _repr_html_(self) -> str:
        from . import notebook

        return notebook.origin(self)


def _stopped_early(rec: Recording) -> str:
    """What a clean answer must add where recording stopped while training went on (a full disk, a store
    deleted or gone: the run ``incomplete``): the steps after it were never looked at, so "no non-finite
    values recorded" alone would read as a clean run where the NaN came after the recording stopped."""
    if rec.rank.torn:  # steps committed, then lost with the last writes (a power cut): not looked at either
        return f"; {rec.rank.torn}: a NaN/Inf in the steps after those was not looked at"
    if rec.rank.status == "recording":  # a live run: what it records after this read was not looked at
        return (f"; the run is still being recorded ({len(rec)} step{'s' if len(rec) != 1 else ''} committed when "
                "read): the steps it records after were not looked at (bisect it again)")
    final = rec.rank.final
    if rec.rank.status == "crashed" and (not final or final.get("died")):  # killed: its last second never committed
        return ("; the process died without closing the recording: the steps it recorded after its last commit "
                "(at most flush_interval, 1 s, before the death) were lost, and a NaN/Inf in them was not looked at")
    if rec.rank.status != "incomplete":  # (this rank's: another rank's full disk is its own)
        return ""
    why = (rec.ended_by or "recording failed").rstrip(".")
    if not len(rec):
        return f"; recording stopped before any step was committed ({why}), and training went on unrecorded"
    return (f"; recording stopped early, after iteration {int(_column(rec, 'iteration').max())} ({why}), and "
            "training went on unrecorded: a NaN/Inf made after that was not looked at")


def _across_ranks(rec: Recording, *, ops: bool, spread: int, scaler_skips: bool) -> Origin:
    """``first_nonfinite(all_ranks=True)``: the origin is the first step of any rank (by iteration,
    then wall clock) that produced a non-finite value from finite inputs; what the other ranks saw
    first (often a collective that received it) is in ``others``."""
    recs = {r: rec.of_rank(r) for r in rec.ranks}
    found = {r: first_nonfinite(recs[r], spread=spread, scaler_skips=scaler_skips) for r in rec.ranks}

    def when(o: Origin) -> tuple[int, bool, float]:
        """First by iteration; within one, a rank that made it from what it had before one that made
        it from what a collective brought from another rank (Inf turned NaN); then by wall clock."""
        first = o.step or o.entered
        assert first is not None
        brought = bool(_received(first)) if o.step is not None else _from_another_rank(first.rec, first)
        return first.iteration, brought, first.started_unix

    produced = [o for o in found.values() if o.step is not None]
    pool = produced or [o for o in found.values() if o.found]
    if not pool:
        # made outside the steps, a rank died of it; else a step's own NaN check raised (caught)
        ended = [o for o in found.values() if o.ended_by is not None] or \
            [o for o in found.values() if o.raised_in is not None]
        if ended:
            if len(rec.ranks) > 1 and ended[0].raised_in is not None:
                ended[0].cause = f"rank {ended[0].raised_in.rec.rank.rank}: {ended[0].cause}"
            return ended[0]
        stopped = "".join(f"; rank {r}: {note.removeprefix('; ')}" for r in rec.ranks
                          for note in [_stopped_early(recs[r])] if note)
        return Origin(None, f"no non-finite values recorded on any of the {len(found)} ranks{stopped}")
    origin = min(pool, key=when)
    origin.others = {r: o for r, o in found.items() if o is not origin and o.found}
    for r, other in origin.others.items():
        _unseen_communication(recs[r], other, origin)
    origin.cause = f"rank {origin.rank}: {origin.cause}"
    if ops and origin.step is not None:
        find_op(origin, origin.step)
    return origin


def _unseen_communication(rec: Recording, other: Origin, origin: Origin) -> None:
    """Where no recorded step of another rank made its first NaN/Inf, and no collective of its steps brought
    it, yet the origin's rank had one as early: the likely way over is communication outside the steps
    (DistributedDataParallel all-reduces the gradients in its own hooks during backward), which no cause
    on that rank alone can name; add it to that rank's cause."""
    first, made = other.entered, origin.step or origin.entered
    if other.step is not None or first is None or made is None or first.iteration < made.iteration or \
            _from_another_rank(rec, first):
        return
    other.cause += (f"; rank {origin.rank}'s came first (iteration {made.iteration}), and ranks also exchange "
                    "tensors outside every recorded step (DistributedDataParallel's all-reduce of the gradients "
                    "in backward, a collective called outside the steps), which is likely how it got here")


def first_nonfinite(rec: Recording | str | os.PathLike[str], *, ops: bool = False, spread: int = SPREAD,
                    all_ranks: bool = False, scaler_skips: bool = False) -> Origin:
    """The origin step of the first NaN/Inf in the recording, from the recorded statistics (what
    counts as an origin: ``_first_on_rank``; Inf a step holds as a mask's does not).

    Args:
        rec: a recording (``replayer.open``) or its path.
        ops: also replay the origin step operation by operation and name the first aten operation
            that made a non-finite value (from finite inputs, or, for a pointwise one, where its
            inputs were finite: beside a mask's -inf), with the user's source line.
        spread: how many of the steps that went non-finite afterwards to list.
        all_ranks: look at every rank of a distributed run, not only ``rec``'s; ``Origin.rank``
            names the rank of the origin, ``Origin.others`` what each other rank saw first.
        scaler_skips: also look at the backward steps of the iterations whose optimizer step mixed
            precision's GradScaler skipped at a loss scale above 1 (its overflows, which it handles
            by lowering the scale), passed over by default.
    """
    rec = opened(rec)
    several = all_ranks and len(rec.ranks) > 1
    origin = _across_ranks(rec, ops=ops, spread=spread, scaler_skips=scaler_skips) if several else \
        _first_on_rank(rec, ops=ops, spread=spread, scaler_skips=scaler_skips)
    if not several and not origin.found:
        origin.cause += _stopped_early(rec)
    if ops and origin.step is None and origin.raised_in is not None and origin.op is None:  # where a NaN check
        find_op(origin, origin.raised_in)  # raised: the operation inside that step
    if not several:
        rec.known_origin = origin  # a summary of the recording (its notebook repr) shows it without searching
    return origin


def _through_collectives(rec: Recording, given: np.ndarray, nan_given: np.ndarray) -> None:
    """Correct the steps' "took NaN/Inf" flags for the collectives they called: a collective's
    result counts as an input (it came from the other ranks), unless the step sent the NaN or Inf
    into it itself (recorded since schema 1.12: ``sent``), when the step made it; a step that
    received it from another rank through a collective of a step inside it took it too."""
    rank = rec.rank
    if int(rank.dist.get("world_size") or 1) < 2 or not rank.lengths.get("tensors"):
        return
    roles = np.asarray(rank.column("tensors/role"))
    talk = np.flatnonzero(roles == layout.ROLES.index("collective"))
    if not len(talk):
        return
    stats = np.asarray(rank.column("tensors/stats"))[talk]
    steps = np.unique(np.asarray(rank.column("tensors/step"))[talk][(stats[:, 6] + stats[:, 7]) > 0])
    parent = _column(rec, "parent")
    for index in steps.tolist():
        step = rec.step(int(index))
        sent = _sent(step)
        received = nan_received = False
        for r in step.records:
            if r.role != "collective" or not r.nonfinite or _call_of(r.name) in sent:  # (what it sent came back)
                continue
            received = True
            nan_received |= bool(r.stats.get("nan"))
        others = [r for r in step.records if r.role in ("input", "param", "buffer", "grad_output") and r.nonfinite]
        given[index] = received or bool(others)
        nan_given[index] = nan_received or any(r.stats.get("nan") for r in others)
        if received:  # the steps around it took it from another rank too
            up = int(parent[index])
            while 0 <= up < len(given):
                given[up] = True
                nan_given[up] |= nan_received
                up = int(parent[up])


def _call_of(record_name: str) -> str:
    """The collective call a result record belongs to: ``<op>.<k>[.<i>]`` -> ``<op>.<k>``."""
    return ".".join(record_name.split(".")[:2])


def _sent(step: Step) -> list[str]:
    """The collectives of ``step`` this rank sent NaN or Inf into (schema 1.12; none before)."""
    return [str(d.get("name")) for d in step.extra.get("collectives") or []
            if isinstance(d.get("sent"), dict) and (d["sent"].get("nan", 0) + d["sent"].get("inf", 0)) > 0]


def _received(step: Step) -> list[str]:
    """The results of collectives of ``step`` that brought NaN or Inf this rank did not send."""
    if not step.extra.get("collectives"):
        return []
    sent = _sent(step)
    return [r.name for r in step.records if r.role == "collective" and r.nonfinite and _call_of(r.name) not in sent]


@dataclass
class _Kinds:
    """Per step, where NaN and Inf were (from the steps' flags): ``result``/``nan_result`` (its
    results), ``given``/``nan_given`` (its own inputs and, for a backward step, its forward's);
    ``whole_result``/``whole_given``: one of those tensors was Inf in every value (from the tensor
    statistics), which an additive -inf mask is not, and a division by 0 or an overflow often is;
    ``lone_result``/``lone_given``: one of them was a single value, and Inf (a loss)."""

    rec: Recording
    result: np.ndarray
    nan_result: np.ndarray
    given: np.ndarray
    nan_given: np.ndarray
    whole_result: np.ndarray
    whole_given: np.ndarray
    lone_result: np.ndarray
    lone_given: np.ndarray
    _groups: dict[bool, np.ndarray] | None = None
    _absorbed_cache: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    _iterations: np.ndarray | None = None  # per step, the number of its iteration among the recording's
    _passes: np.ndarray | None = None  # per step, the row of the outermost step enclosing it (``passes``)
    _harmed: np.ndarray | None = None  # (``harmed``, once flags no longer change: after GradScaler's are set aside)

    @classmethod
    def of(cls, rec: Recording) -> _Kinds:
        flags = step_flags(rec)
        result, given = (flags & _RESULT) != 0, (flags & _INPUT) != 0
        if _kinds_recorded(rec):
            nan_result, nan_given = (flags & layout.NAN_RESULT) != 0, (flags & layout.NAN_INPUT) != 0
        else:  # before schema 1.8 NaN and Inf were one flag: every non-finite value counts as NaN
            nan_result, nan_given = result, given
        n = len(rec)
        phase, forward = _column(rec, "phase"), _column(rec, "forward")
        given, nan_given = given.copy(), nan_given.copy()
        _through_collectives(rec, given, nan_given)
        back = np.flatnonzero((phase == 1) & (forward >= 0) & (forward < n))
        given[back] |= given[forward[back]]
        nan_given[back] |= nan_given[forward[back]]
        # Whether Inf fills a tensor matters only to the steps that hold Inf without NaN (a mask's, or an
        # overflow): where none does (a clean run; a run whose every non-finite value is NaN), the tensor
        # statistics are not read (2,990,000 records of a million-step recording: ~190 MB)
        if _inf_alone(result, nan_result, given, nan_given):
            whole_result, whole_given, lone_result, lone_given = _all_inf(rec, phase)
            whole_given[back] |= whole_given[forward[back]]
            lone_given[back] |= lone_given[forward[back]]
        else:
            whole_result, whole_given, lone_result, lone_given = (np.zeros(n, dtype=bool) for _ in range(4))
        return cls(rec, result, nan_result, given, nan_given, whole_result, whole_given, lone_result, lone_given)

    def groups(self, by_call: bool = True) -> np.ndarray:
        """Per step, a number shared by the calls of the same step: name, module path, phase and
        (``by_call``) call number within the iteration."""
        if self._groups is None:
            self._groups = {}
        if by_call not in self._groups:
            rec = self.rec
            columns = ("name", "module_path", "phase", "call") if by_call else ("name", "module_path", "phase")
            keys = [_column(rec, c).astype(np.int64) for c in columns]
            keys = [k - k.min() for k in keys]
            sizes = [int(k.max()) + 1 for k in keys]
            if float(np.prod(sizes, dtype=np.float64)) < 2.0 ** 62:  # one number per key: a fast 1-D unique
                flat = keys[0]
                for k, size in zip(keys[1:], sizes[1:], strict=True):
                    flat = flat * size + k
                self._groups[by_call] = np.unique(flat, return_inverse=True)[1].reshape(-1)
            else:
                self._groups[by_call] = np.unique(np.stack(keys, 1), axis=0, return_inverse=True)[1].reshape(-1)
        return self._groups[by_call]

    def habitual(self, mask: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
        """Per step: ``mask`` held at every call of the same step (two or more) ``among`` the calls
        where that holds (all by default): Inf that is there at every call (an additive -inf attention
        mask, a -inf initial maximum) is what the model means, not a value that went bad. A call alone
        with its call number (a run that never marks its iterations numbers every call anew) is
        judged with all the step's calls, whatever their number, as the recorder judges it while
        recording, where they ran in two or more passes (``passes``): the calls one call of an enclosing
        step makes (an MoE layer's top-2 loop calling one expert twice, in a run that died in its first
        iteration) are no habit, whatever they held."""
        def every_call(group: np.ndarray, counted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            calls = np.bincount(group, weights=counted.astype(np.float64))
            held = np.bincount(group, weights=(mask & counted).astype(np.float64))
            return calls, (calls >= 2) & (held == calls)

        group, step = self.groups(), self.groups(by_call=False)
        passes = self.passes()

        def every_pass(counted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Per step group: in how many passes it ran ``counted``, and whether that is two or more with
            ``mask`` held at every such call."""
            calls, held_all = every_call(step, counted)
            pairs = np.unique(step[counted].astype(np.int64) * len(step) + passes[counted])
            ran = np.bincount(pairs // max(len(step), 1), minlength=len(calls)).astype(np.float64)
            return ran, held_all & (ran >= 2)

        everywhere = np.ones(len(mask), dtype=bool)
        calls, by_call = every_call(group, everywhere)
        _, by_step = every_pass(everywhere)
        alone = calls[group] == 1  # a run without iterations: its calls judged together, whatever their number
        judged = by_call[group] | (alone & by_step[step])
        if among is None:
            return judged
        # Among the calls where ``among`` holds, where there are two or more of them to judge by; else
        # among all (an overflow at both calls of the first iteration, NaN after it, is no mask)
        counted_calls, counted_by_call = every_call(group, among)
        counted_passes, counted_by_step = every_pass(among)
        enough = np.where(alone, counted_passes[step] >= 2, counted_calls[group] >= 2)
        return np.where(enough, counted_by_call[group] | (alone & counted_by_step[step]), judged)

    def passes(self) -> np.ndarray:
        """Per step, the pass it ran in: the row of its outermost enclosing step (the ``parent`` chain; a
        step that none encloses is its own), of its forward's for a backward step (its forward's calls
        were one pass). Calls of a step in one pass are siblings (an expert that an MoE layer's top-2 loop
        calls twice, one layer's mask made for two attentions), not the same call made again."""
        if self._passes is None:
            n = len(self.result)
            parent = _column(self.rec, "parent").astype(np.int64)
            roots, up = np.arange(n, dtype=np.int64), parent.copy()
            for _ in range(n):  # the steps enclosing a step began before it: one round per level of nesting
                inside = (up >= 0) & (up < n)
                if not inside.any():
                    break
                roots = np.where(inside, up, roots)
                up = np.where(inside, parent[np.where(inside, up, 0)], -1)
            forward = _column(self.rec, "forward").astype(np.int64)
            back = np.flatnonzero((_column(self.rec, "phase") == 1) & (forward >= 0) & (forward < n))
            roots[back] = roots[forward[back]]
            self._passes = roots
        return self._passes

    def shaped(self, held: np.ndarray, whole: np.ndarray, lone: np.ndarray, results: bool) -> np.ndarray:
        """Per step: whether the Inf ``held`` at its calls (with the same call number) can be a mask's:
        on part of a tensor at each of them, or, where some call held a tensor Inf in every value
        (``whole``: a -inf initial maximum), there from the start, at the step's first call too, and of one
        sign where its bytes were kept (``_plus_inf``). Inf that fills a tensor at a later call
        number (an eval loop's, past a division by 0 outside every step) came in, however often the loop
        runs; Inf of both signs filling a tensor (a sampler dividing by sqrt(alpha_bar) = 0 at its first reverse
        step, at every evaluation) is a division by 0, which no mask is: such a call is none, and the step's calls
        that held Inf on part of the tensor still can be (sqrt's backward at 0, absorbed by a ReLU's backward at
        every call, until the call whose input was all zeros fills its gradient). A single value that is Inf
        (``lone``: a 0-d loss, +inf at every call where the loop skips the batches whose loss is not finite)
        is no mask's at all: a mask is Inf beside finite values, or, filling its tensor, over rows (the
        statistics, of the finite values, do not tell +inf from -inf; how many values are Inf they do: a
        step recorded without its bytes keeps the benefit of the doubt). ``results``: ``held`` is of the
        steps' results, else of their inputs."""
        group, step = self.groups(), self.groups(by_call=False)
        if not len(group):
            return np.ones(0, dtype=bool)
        first = np.full(int(step.max()) + 1, len(step), dtype=np.int64)
        np.minimum.at(first, step, np.arange(len(step)))
        filled = np.bincount(group, weights=(whole & held).astype(np.float64)) > 0
        start = held[first[step]]
        signed = np.zeros(len(group), dtype=bool)
        if (filled[group] & start).any():
            signed = self._plus_inf(whole & held & start & filled[group], group, results)[group] & whole & held
        return (~filled[group] | start) & ~signed & ~(lone & held)

    def _plus_inf(self, candidates: np.ndarray, group: np.ndarray, results: bool) -> np.ndarray:
        """Per step group (call number): whether the first of its ``candidates`` (calls holding a tensor Inf in
        every value) kept the bytes of such a tensor among its results (``results``) or inputs, and they hold
        Inf of both signs: a signed tensor divided by 0. A mask, or an initial maximum or minimum, fills its
        tensor with one sign (an exp that overflows at every call, too: the habit judges it). Only that first
        call's records are read: a mask is the same kind of Inf at every call."""
        plus = np.zeros(int(group.max()) + 1, dtype=bool)
        seen: set[int] = set()
        for index in np.flatnonzero(candidates).tolist():
            if int(group[index]) in seen:
                continue
            seen.add(int(group[index]))
            step = self.rec.step(index)
            phase = layout.PHASES.index(step.phase)
            roles = {layout.ROLES[i] for i in (layout.RESULT_ROLES[phase] if results else layout.INPUT_ROLES[phase])}
            for r in step.records:
                if r.role not in roles or not r.has_payload or not r.stats["inf"] or r.stats["nan"] or \
                        r.stats["inf"] != math.prod(r.shape):
                    continue
                try:
                    values = self.rec.rank.tensor(r)
                except PdbgError:  # (damaged bytes: judged by the statistics alone)
                    continue
                values = values.real if values.is_complex() else values
                if bool(values.gt(0).any()) and bool(values.lt(0).any()):
                    plus[group[index]] = True
                    break
        return plus

    def habit_masks(self) -> np.ndarray:
        """Per step: Inf (only) made from finite inputs, at every call with finite inputs (an additive
        -inf mask), judged among those calls where there are two or more (training goes on past a
        NaN, and the mask's later calls take it), and shaped as a mask's (``shaped``)."""
        inf_made = self.result & ~self.nan_result & ~self.given
        if not inf_made.any():  # (then the steps' names, paths and calls are not read)
            return inf_made
        return inf_made & self.habitual(inf_made, among=~self.given) & \
            self.shaped(inf_made, self.whole_result, self.lone_result, True)

    def habit_takes(self) -> np.ndarray:
        """Per step: Inf taken at every call (``habitual``), shaped as a mask's (``shaped``): meant. What
        it says matters only where a step took Inf and no NaN (a step that took NaN is judged by that)."""
        if not (self.given & ~self.nan_given).any():
            return np.zeros(len(self.given), dtype=bool)
        return self.habitual(self.given) & self.shaped(self.given, self.whole_given, self.lone_given, False)

    def takes_mask(self) -> np.ndarray:
        """Per step: Inf taken that is a mask's: at every call (``habit_takes``), or on part of a tensor and
        absorbed at this call or at an earlier one of the step (``_absorbed``)."""
        return self.habit_takes() | self._absorbed()[1]

    def nan_made(self) -> np.ndarray:
        """Per step: NaN in its results where its inputs held none, nor Inf other than a mask's."""
        return self.nan_result & ~self.nan_given & (~self.given | self.takes_mask())

    def masks(self) -> np.ndarray:
        """Per step: Inf (only) made from finite inputs that is a mask's: at every call (``habit_masks``), or
        on part of a tensor and absorbed (``_absorbed``: nothing non-finite came of it). Inf that the same step
        made at an earlier call and that was absorbed there (a padding mask, and a batch without padding in
        between makes none) is a mask's where a step that took Inf makes NaN later in the iteration, as a
        softmax over keys all masked does: that step is the origin. Where no such step does (nothing there
        takes Inf as a mask's), the step that made the Inf stays the origin: an overflow absorbed once and not
        the next time. Past a step that held NaN (training goes on) it is a mask's too: its takers take NaN."""
        made_here, made_before = self._absorbed()[0], self._absorbed()[2]
        out = self.habit_masks() | made_here
        pending = made_before & ~out
        if pending.any():
            after_nan = np.cumsum(self.nan_result) - self.nan_result > 0
            out |= pending & (self._later_in_iteration(self.nan_made() & self.given) | after_nan)
        return out

    def meant(self) -> np.ndarray:
        """Per step: its results hold Inf and no NaN that the model means (``meant_inf``)."""
        if not self.result.any():
            return np.zeros(len(self.result), dtype=bool)
        passed = self.result & ~self.nan_result & self.given & ~self.nan_given
        return self.masks() | (passed & self.takes_mask() & ~self.harmed())

    def harmed(self) -> np.ndarray:
        """Per step: Inf (no NaN) in its results from Inf it took as a mask's (``takes_mask``), at a call where an
        earlier call of the step (its call number) took Inf and kept its results finite, and that nothing after
        it kept from going further (``_absorbed``). A mask's Inf is harmless only while nothing non-finite comes
        of it: this is where something first did (a GCN's deg^-1/2, Inf at the isolated nodes of every batch,
        that an edge leaving such a node carries into the aggregation), an origin, no Inf the model means. (Where
        it makes NaN of it, ``nan_made`` holds.)"""
        if self._harmed is None:
            passed = self.result & ~self.nan_result & self.given & ~self.nan_given
            if passed.any():
                passed &= self.takes_mask()
            if passed.any():
                passed &= self._earlier(self.given & ~self.result) & ~self._absorbed()[3]
            self._harmed = passed
        return self._harmed

    def kept_before(self, index: int) -> int | None:
        """The last earlier call of step ``index`` (its call number; any, where a call is alone with its number)
        that took Inf and kept its results finite (``harmed``)."""
        group, step = self.groups(), self.groups(by_call=False)
        g = step if int(np.count_nonzero(group == group[index])) == 1 else group
        held = np.flatnonzero((g[:index] == g[index]) & self.given[:index] & ~self.result[:index])
        return int(held[-1]) if len(held) else None

    def _later_in_iteration(self, held: np.ndarray) -> np.ndarray:
        """Per step: ``held`` holds at a later step of its iteration."""
        n = len(held)
        if self._iterations is None:
            self._iterations = np.unique(_column(self.rec, "iteration"), return_inverse=True)[1].reshape(-1)
        where = self._iterations
        last = np.full(int(where.max()) + 1 if n else 0, -1, dtype=np.int64)
        np.maximum.at(last, where[held], np.flatnonzero(held))
        return last[where] > np.arange(n)

    def _earlier(self, held: np.ndarray) -> np.ndarray:
        """Per step: ``held`` held at an earlier call of the same step with the same call number (a call
        alone with its number, in a run that never marks its iterations: at any earlier call of the step)."""
        group, step = self.groups(), self.groups(by_call=False)
        n = len(held)
        index = np.arange(n)

        def before(g: np.ndarray) -> np.ndarray:
            first = np.full(int(g.max()) + 1, n, dtype=np.int64)
            np.minimum.at(first, g[held], index[held])
            return first[g] < index

        alone = np.bincount(group)[group] == 1
        return np.where(alone, before(step), before(group))

    def _absorbed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(made, taken, made before, kept), per step: Inf without NaN on part of a tensor (a -inf padding mask) made
        from finite inputs by a forward step, or taken, and absorbed: a step kept such Inf out of its results
        (it, a later step of its iteration, or a step enclosing it), and nothing non-finite came of it: no later
        step of its iteration nor a step enclosing it held NaN or other non-finite results (Inf on part of a
        forward step's results is another mask; Inf meant at every call is meant), and no backward step of
        that iteration did. ``taken`` holds where it took such Inf at a call where it was absorbed or at an
        earlier call of the step where it was; ``made before``: Inf made so where the step's Inf was absorbed
        at an earlier call (``masks`` says when that is a mask's); ``kept``: whatever Inf the step held was
        absorbed so (``harmed`` asks it of Inf passed on). Computed once, after ``_first_on_rank`` sets aside
        what GradScaler handled."""
        if self._absorbed_cache is not None:
            return self._absorbed_cache
        n = len(self.result)
        none = np.zeros(n, dtype=bool)
        if not n or not _inf_alone(self.result, self.nan_result, self.given, self.nan_given):
            self._absorbed_cache = (none, none, none, none)
            return self._absorbed_cache
        rec = self.rec
        phase, parent = _column(rec, "phase"), _column(rec, "parent").astype(np.int64)
        passed = self.result & ~self.nan_result & self.given & ~self.nan_given
        meant = self.habit_masks() | (passed & self.habit_takes())
        part = self.result & ~self.nan_result & ~self.whole_result
        bad = self.result & ~((phase == 0) & part) & ~meant
        took = self.given & ~self.nan_given & ~self.whole_given
        keeps = took & ~self.result  # took Inf and kept it out of its results
        clean = ~self._later_in_iteration(bad) & ~bad
        kept = keeps | self._later_in_iteration(keeps)
        up = parent
        while True:  # the steps enclosing a step end after it
            inside = (up >= 0) & (up < n)
            if not inside.any():
                break
            at = np.where(inside, up, 0)
            clean &= ~(inside & bad[at])
            kept |= inside & ~self.result[at]
            up = np.where(inside, parent[at], -1)
        clean &= kept  # (Inf in the last step of a recording came to nothing as far as it shows: no evidence)
        made = part & ~self.given & (phase == 0)
        made_here, took_here = made & clean, took & clean & ~self.nan_result & ~self.whole_result
        self._absorbed_cache = (made_here, took_here | (took & self._earlier(took_here)),
                                made & self._earlier(made_here), clean)
        return self._absorbed_cache


def _inf_alone(result: np.ndarray, nan_result: np.ndarray, given: np.ndarray, nan_given: np.ndarray) -> bool:
    """Whether some step holds Inf without NaN in its results or its inputs: only there can a mask
    judgement (which tensors Inf fills, the calls of each step, what absorbed an Inf) change an answer."""
    return bool(((result & ~nan_result) | (given & ~nan_given)).any())


def meant_inf(rec: Recording) -> np.ndarray:
    """Per step: its results hold Inf and no NaN that the model means, as ``first_nonfinite`` judges
    them: made from finite inputs as an additive -inf mask is (at every call, or on part of a tensor
    where nothing non-finite came of it: ``_Kinds.masks``), or taken as a mask's and passed on
    (``_Kinds.takes_mask``). Such a step is ``nonfinite`` in the recording but no anomaly to stop at."""
    if not len(rec):
        return np.zeros(0, dtype=bool)
    return _Kinds.of(rec).meant()


def _all_inf(rec: Recording, phase: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per step: whether one of its results, and one of its inputs (``layout.INPUT_ROLES``, and the
    results of its collectives), held Inf in every value: Inf and no finite value (the statistics of
    the finite values are NaN), no NaN; then whether one of its results, and one of its inputs, was
    a single value that is Inf (a 0-d loss): Inf in every value, and one Inf."""
    n = len(rec)
    out = tuple(np.zeros(n, dtype=bool) for _ in range(4))
    rank = rec.rank
    if not n or not rank.lengths.get("tensors"):
        return out
    stats = np.asarray(rank.column("tensors/stats"))
    whole = (stats[:, 7] > 0) & (stats[:, 6] == 0) & np.isnan(stats[:, 0])
    if not whole.any():
        return out
    lone = stats[whole, 7] == 1
    steps = np.asarray(rank.column("tensors/step"))[whole]
    roles = np.asarray(rank.column("tensors/role"))[whole]
    ph = phase[steps]
    result, given, lone_result, lone_given = out
    for p in (0, 1):
        here = ph == p
        results = here & np.isin(roles, list(layout.RESULT_ROLES[p]))
        inputs = here & np.isin(roles, list(layout.INPUT_ROLES[p]) + [layout.ROLES.index("collective")])
        result[steps[results]] = True
        given[steps[inputs]] = True
        lone_result[steps[results & lone]] = True
        lone_given[steps[inputs & lone]] = True
    return out


def _kinds_recorded(rec: Recording) -> bool:
    """Whether the steps' flags tell NaN from Inf (schema 1.8 on)."""
    try:
        return layout.parse_version(rec.rank.run.schema_version) >= layout.KINDS_SINCE
    except ValueError:  # (refused when the recording was opened)
        return False


def _innermost(rec: Recording, index: int, mask: np.ndarray) -> int:
    """``index``, or the first step nested inside it where ``mask`` holds too (innermost), but not one whose
    gradients coming in were not recorded (``_unrecorded_grads``) inside one whose were: what came into it is
    not known, and the outer step's own code may have made it (a gradient penalty's sqrt at a zero norm, whose
    NaN the critic's second-order backward inside it passes on: the penalty's backward replays, the critic's
    does not)."""
    while True:
        inner = [k for k in subtree(rec, index) if mask[k]]
        if not inner or _unrecorded_grads(rec.step(inner[0])) and not _unrecorded_grads(rec.step(index)):
            return index
        index = inner[0]


def _during(rec: Recording, index: int, mask: np.ndarray) -> int:
    """``index``, or, for a forward step, the first step where ``mask`` holds too that began while its call ran
    without being nested in it (innermost): a backward step of a pass the call ran itself (torch.autograd.grad
    in a gradient penalty, through a critic and a custom Function whose backward made the NaN). Its index comes
    after the call's, as it opened later, but the NaN the call returned came of it."""
    if _column(rec, "phase")[index] != 0:
        return index
    start, end, phase = _column(rec, "t_start"), _column(rec, "t_end"), _column(rec, "phase")
    for k in (np.flatnonzero(mask[index + 1:index + 1 + _SOURCE_SEARCH]) + index + 1).tolist():
        if start[k] > end[index]:
            break
        if phase[k] == 1 and start[k] >= start[index]:
            return _innermost(rec, k, mask)
    return index


def _scaler_handled(rec: Recording) -> tuple[np.ndarray, list[int]]:
    """Per step: a backward step of an iteration whose optimizer step GradScaler skipped at a loss
    scale above 1 (or at a scale not recorded, before schema 1.12) and whose backward steps held Inf:
    an overflow of the scaled loss. Also the skipped iterations whose backward held NaN and no Inf: a
    scaled value that overflows becomes Inf first, so NaN with no Inf beside it (0/0, the gradient of
    sqrt at 0, a loss already NaN) is no overflow, whatever the scaler did about it."""
    doc = rec.scaler_skips
    handled = np.zeros(len(rec), dtype=bool)
    if doc is None:
        return handled, []
    scales = doc.get("scales") if isinstance(doc.get("scales"), list) else [None] * len(doc["iterations"])
    iterations = [int(i) for i, scale in zip(doc["iterations"], scales)
                  if isinstance(i, int) and (not isinstance(scale, (int, float)) or scale > 1.0)]
    if not iterations:
        return handled, []
    iteration = _column(rec, "iteration")
    handled = (_column(rec, "phase") == 1) & np.isin(iteration, iterations)
    if not handled.any() or not rec.rank.lengths.get("tensors"):
        return handled, []
    steps = np.asarray(rec.rank.column("tensors/step"))
    stats = np.asarray(rec.rank.column("tensors/stats"))
    mine = handled[steps]
    with_inf = set(iteration[steps[mine & (stats[:, 7] > 0)]].tolist())
    with_nan = set(iteration[steps[mine & (stats[:, 6] > 0)]].tolist())
    return handled & np.isin(iteration, sorted(with_inf)), sorted(with_nan - with_inf)


def _overflows_text(rec: Recording, overflowed: list[int]) -> str:
    """What bisect says of the overflows it passed over: which iterations, and the longest run of them
    in a row (an overflow stops once the scale is low enough; a streak to the end of the run may be no
    overflow at all)."""
    s = "s" if len(overflowed) != 1 else ""
    text = (f"no non-finite values recorded outside the backward passes of the {len(overflowed)} iteration{s} whose "
            f"optimizer step GradScaler skipped ({_names([str(i) for i in overflowed])}) and whose gradients held "
            "Inf, as an overflow of the scaled loss does (mixed precision handles it by lowering the scale)")
    streaks: list[list[int]] = []
    for i in overflowed:
        if streaks and i == streaks[-1][-1] + 1:
            streaks[-1].append(i)
        else:
            streaks.append([i])
    streak = max(streaks, key=len)
    if len(streak) > 1:
        doc = rec.scaler_skips or {}
        scale = dict(zip(doc.get("iterations") or [], doc.get("scales") or []))
        scales = (f", loss scale {scale[streak[0]]:g} down to {scale[streak[-1]]:g}"
                  if isinstance(scale.get(streak[0]), (int, float)) and isinstance(scale.get(streak[-1]), (int, float))
                  else "")
        last = int(_column(rec, "iteration").max())
        text += (f"; it skipped {len(streak)} iterations in a row ({streak[0]} to {streak[-1]}{scales})"
                 + (", and was still skipping when the recording ended" if streak[-1] == last else "")
                 + ": an overflow stops once the scale is low enough, a NaN or Inf made otherwise does not")
    return text + "; pdbg bisect --scaler-skips (scaler_skips=True) shows where their NaN/Inf came from"


def _not_overflow_note(step: Step, not_overflows: list[int]) -> str:
    """Said of an origin in an iteration GradScaler skipped that was no overflow (``_scaler_handled``)."""
    if step.iteration not in not_overflows:
        return ""
    return (f" (GradScaler skipped the optimizer step of iteration {step.iteration}, but no gradient recorded in it "
            "held Inf: NaN without Inf is no overflow of the scaled loss)")


def _first_on_rank(rec: Recording, *, ops: bool, spread: int, scaler_skips: bool = False) -> Origin:
    """The first step that made NaN or Inf: its results hold NaN while its inputs held none (even if
    they held Inf it takes as a mask's: an additive -inf mask is meant, a softmax that overflows
    beside it is not), or Inf while its inputs were finite, unless that Inf is a mask's (``_Kinds.masks``:
    made at every call, or on part of a tensor with nothing non-finite coming of it). A value that came
    non-finite from outside every step (the data, an optimizer update, or, into a backward step through a
    graph of gradients, a gradient penalty computed in the loop) is ``entered``, even where that step turns
    its Inf into NaN; Inf that only passes through the steps that take it (a mask) is no origin at all, until
    one passes it on where its earlier calls kept it out (``_Kinds.harmed``), or the first step it came into
    took it from a recorded step's output (``_producer``): a mask's Inf that did harm there."""
    n = len(rec)
    if not n:
        return _nothing_recorded(rec)
    k = _Kinds.of(rec)
    handled, not_overflows = (np.zeros(n, dtype=bool), []) if scaler_skips else _scaler_handled(rec)
    overflowed = sorted(set(_column(rec, "iteration")[handled & (k.result | k.given)].tolist()))
    if overflowed:  # passed over: what the scaler did about them is what mixed precision expects
        for mask in (k.result, k.nan_result, k.given, k.nan_given):
            np.logical_and(mask, ~handled, out=mask)
    habit = k.takes_mask()  # Inf taken as a mask's: at every call, or kept from going further
    made = k.nan_made()
    inf_made = k.result & ~k.nan_result & ~k.given  # Inf (only) from finite inputs
    if inf_made.any():
        made |= inf_made & ~k.masks()
    stopped = _stopped_at(rec, k.result)  # the recorder stopped the run there: nothing could come of its Inf
    if stopped is not None and inf_made[stopped]:
        made[stopped] = True
    harmed = k.harmed()  # a mask's Inf passed on where the step's earlier calls kept it out
    made |= harmed
    through = _through_gradients(rec, made)  # came in by a graph of gradients: where it entered
    made &= ~through
    wrote = _buffer_writers(rec, k, habit)  # NaN/Inf a call wrote into its module's buffers: its next call's
    made[list(wrote)] = True
    if made.any():  # after NaN/Inf came into a step and went on, one made only as far as recorded is no origin
        made &= ~_unseen_after_entry(rec, made, (k.result & ((k.given & ~habit) | k.nan_given)) | through)
        made &= ~_state_came_inside(rec, k, made)
    went = k.result & ~k.meant()  # (a mask's Inf in the iterations after it is no spread of it)
    if made.any():
        index = _during(rec, _innermost(rec, int(np.flatnonzero(made)[0]), made), made)
        step = rec.step(index)
        what = _nonfinite_text(step, layout_results(step.phase)) + [
            f"buffer {r.name} in place ({_counts(rec, r)}, as the module's next call, step {nxt.index}, found it)"
            for nxt, r in wrote.get(index, [])] or ["non-finite results"]
        nan = bool(k.nan_result[index]) or any(r.stats["nan"] for _, r in wrote.get(index, []))
        sent, received = _sent(step), _received(step)
        given = [r.name + (" from another rank" if r.name in received else "") for r in _own_inputs(step)
                 if r.nonfinite and _call_of(r.name) not in sent]
        given += [f.text() for f in _values(_own_nonfinite(rec, step)[0], "args")]
        kept = k.kept_before(index) if harmed[index] else None
        how = ("at every call, as a -inf mask does" if k.habit_takes()[index] else
               "on part of a tensor, as a -inf mask does, that its earlier calls kept out of their results"
               if kept is None else "on part of a tensor, as a -inf mask does")
        source = (f"from inputs holding Inf {how}, but no NaN ({', '.join(given[:3])})" if given
                  else _finite_inputs(step, "NaN" if nan else "Inf"))
        if sent:
            source += f", and sent them to the other ranks through its {', '.join(sent)}"
        maker = None
        if kept is not None:
            earlier = rec.step(kept)
            maker = _mask_source(rec, k, step)
            source += (f", which its earlier calls kept out of their results (the last: step {kept}, iteration "
                       f"{earlier.iteration}): the first result that mask's Inf made non-finite"
                       + _source_text(k, maker))
        elif given and k.given[index]:  # NaN of a mask's Inf: the step that made that Inf, whatever the run's length
            maker = _mask_source(rec, k, step)
            source += _source_text(k, maker)
        if index == stopped:
            source += _STOPPED_NOTE
        origin = Origin(step, f"{describe(step)} produced {'; '.join(what)} {source}"
                        + _not_overflow_note(step, not_overflows), _after(rec, index, went, spread),
                        followed=int(went[index + 1:].sum()), source=maker,
                        kept=rec.step(kept) if kept is not None else None)
        if ops:
            find_op(origin, step)
        return origin
    if k.nan_result.any():  # NaN that came in, or Inf that came in (no mask) and became NaN
        came = k.nan_given | (k.result & k.given & ~habit) | through
    elif k.result.any():
        came = (k.result & k.given & ~habit) | through
        if stopped is not None:
            came[stopped] = True
        if not came.any():
            first = rec.step(int(np.flatnonzero(k.result)[0]))
            return Origin(None, "no NaN recorded; Inf appears only in steps that hold it at every call or, on part "
                                "of a tensor, with nothing non-finite coming of it (first "
                                f"{describe(first)}), as a -inf attention mask does")
    else:
        raised = _anomaly_raised(rec)
        if raised is not None:
            if ops and raised.step is not None:
                find_op(raised, raised.step)
            return raised
        contained = int(k.given.sum())
        if overflowed and not contained:
            return Origin(None, _overflows_text(rec, overflowed))
        if not contained:
            return _ended_outside(rec) or _raised_caught(rec) or _backward_raised(rec) or \
                Origin(None, "no non-finite values recorded")
        stopped_on = _raised_on_given(rec, k.given)
        if stopped_on is not None:
            return stopped_on
        first = rec.step(int(np.flatnonzero(k.given)[0]))
        phase = layout.PHASES.index(first.phase)
        held = _nonfinite_text(first, {layout.ROLES[i] for i in layout.INPUT_ROLES[phase]})
        return Origin(None, f"no step's results held NaN or Inf; {contained} step{'s' if contained > 1 else ''} took "
                            "Inf or NaN inputs and kept them out of their results (as an additive -inf attention mask "
                            f"is); first {describe(first)}" + (f", given {'; '.join(held)}" if held else ""))
    index = int(np.flatnonzero(came)[0])
    step = rec.step(index)
    taken = _producer(rec, step, k.result) if not through[index] and not k.nan_given[index] and \
        _took_in_inputs(rec, step) else None
    if taken is not None:  # a mask's Inf that a recorded step's output held: it did harm here, it did not come in
        record, producer = taken
        maker = _mask_source(rec, k, step)
        what = _nonfinite_text(step, layout_results(step.phase)) or ["non-finite results"]
        origin = Origin(step, f"{describe(step)} produced {'; '.join(what)} from its input {record.name} "
                              f"({_counts(rec, record)}), the output of {describe(producer)}, which holds it as a "
                              "mask's Inf: the first result that Inf made non-finite" + _source_text(k, maker, producer)
                        + _not_overflow_note(step, not_overflows), _after(rec, index, went, spread),
                        followed=int(went[index + 1:].sum()), source=maker)
        if ops:
            find_op(origin, step)
        return origin
    bad = _own_nonfinite(rec, step)[1]
    senders = _unrecorded_senders(rec, step) if bad and bad[0].role == "grad_output" else []
    writers = _unseen_writers(rec, step) if bad and bad[0].role != "grad_output" else []
    origin = Origin(None, _entered_cause(rec, step, senders, writers) + _not_overflow_note(step, not_overflows),
                    _after(rec, index, went, spread, inclusive=True), entered=step,
                    followed=int(went[index + 1:].sum()),
                    suspect=(_backward_of(rec, senders[0][0], index) or senders[0][0]) if senders else
                    writers[0][0] if writers else _gradient_user(rec, step) if not bad and _second_order(step)
                    else None)
    if ops:
        origin.op_note = entered_op_note(origin)
    return origin


_SOURCE_SEARCH = 1000  # steps searched back for the one whose output a step's non-finite input is
_WRITERS_LOOKED_AT = 1000  # calls that found a buffer non-finite looked at, at most (``_buffer_writers``)


def _buffer_writers(rec: Recording, k: _Kinds, habit: np.ndarray) -> dict[int, list[tuple[Step, TensorRecord]]]:
    """The forward calls that wrote NaN or Inf into their own module's buffers in place (a BatchNorm given one
    value per channel in train mode: its unbiased running variance divides by 0), their results finite
    maybe: {call: [(the module's next recorded call, the buffer's record there)]}. A buffer has no record of
    its own of what a call left in it: the module's next recorded call (of the same module object) found it so,
    where the call found it finite, and code between the two did not write or replace it (the next call's
    ``BUFFERS_WRITTEN_NOTE``), nor convert it. The call's own inputs, parameters and buffers were finite (a call
    that took NaN passed it on); Inf alone counts where the next call did not take it as a mask's (``habit``)
    and its results went non-finite, as Inf coming in there otherwise would. Looked for at the calls whose
    inputs held NaN/Inf and whose module's previous call's did not, ``_WRITERS_LOOKED_AT`` at most."""
    phase = _column(rec, "phase")
    calls = np.flatnonzero(phase == 0)
    if not k.given[calls].any():
        return {}
    group = k.groups(by_call=False)[calls].astype(np.int64)  # each module object's calls apart
    key = group * (int(rec._object_numbers.max()) + 1) + rec._object_numbers[calls]
    order = np.lexsort((calls, key))
    same = key[order][1:] == key[order][:-1]
    later, earlier = calls[order][1:][same], calls[order][:-1][same]  # a call, and its module's previous one
    found = k.given[later] & ~k.given[earlier]
    wrote: dict[int, list[tuple[Step, TensorRecord]]] = {}
    for nxt_index, index in zip(later[found][:_WRITERS_LOOKED_AT].tolist(), earlier[found].tolist()):
        nxt = rec.step(nxt_index)
        bad = [r for r in nxt.records if r.role == "buffer" and r.nonfinite]
        if not bad:
            continue
        written = nxt.noted(layout.BUFFERS_WRITTEN_NOTE)  # (escaped, as the recorder wrote them)
        before = {r.name: r for r in rec.step(index).records if r.role == "buffer"}
        for r in bad:
            was = before.get(r.name)
            if was is None or was.nonfinite or (was.dtype, tuple(was.shape)) != (r.dtype, tuple(r.shape)) \
                    or r.name.encode("unicode_escape").decode() in written:
                continue
            if r.stats["nan"] or (k.result[nxt_index] and not habit[nxt_index]):
                wrote.setdefault(index, []).append((nxt, r))
    return wrote


def _producer(rec: Recording, step: Step, result: np.ndarray,
              among: list[TensorRecord] | None = None) -> tuple[TensorRecord, Step] | None:
    """The first non-finite input of a forward step (of a backward step's forward) that is the output of an
    earlier forward step of its iteration (``result``: steps whose results held NaN or Inf), and that step:
    one that finished before the call began (none enclosing it), whose output record has the same dtype and
    shape, and the same bytes where both kept them (payloads are stored once per content: the same row),
    else the same statistics. Searched back from the step, ``_SOURCE_SEARCH`` steps at most; ``among``: of
    those inputs only."""
    source = step if step.phase == "forward" else rec.step(step.forward) if step.forward is not None else None
    wanted = [r for r in source.records if r.role == "input" and r.nonfinite] if source is not None else []
    if among is not None:
        wanted = [r for r in wanted if any(r.row == a.row for a in among)]
    if source is None or not wanted:
        return None
    iteration, parent = _column(rec, "iteration"), _column(rec, "parent")
    enclosing, up = set(), int(parent[source.index])
    while 0 <= up < len(parent):
        enclosing.add(up)
        up = int(parent[up])
    for k in range(source.index - 1, max(source.index - _SOURCE_SEARCH, 0) - 1, -1):
        if iteration[k] != iteration[source.index]:
            break
        if not result[k] or k in enclosing:
            continue
        candidate = rec.step(k)
        if candidate.phase != "forward":
            continue
        for out in candidate.records:
            if out.role == "output" and out.nonfinite:
                for r in wanted:
                    if _same_tensor(r, out):
                        return r, candidate
    return None


def _took_in_inputs(rec: Recording, step: Step) -> bool:
    """Whether the NaN/Inf a step took was in its (its forward's) input records alone: no parameter or buffer
    (the optimizer's), grad output (the loss's) or collective result (another rank's) held any."""
    source = step if step.phase == "forward" else rec.step(step.forward) if step.forward is not None else step
    roles = ("param", "buffer", "collective", "grad_output")
    return not any(r.role in roles and r.nonfinite for s in {source.index: source, step.index: step}.values()
                   for r in s.records)


def _same_tensor(a: TensorRecord, b: TensorRecord) -> bool:
    """Whether two records hold the same values, as far as recorded (``_producer``)."""
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    if a.has_payload and b.has_payload:
        return a.payload == b.payload
    return all(x == y or (x != x and y != y) for x, y in zip(a.stats.values(), b.stats.values(), strict=True))


def _mask_source(rec: Recording, k: _Kinds, step: Step) -> Step | None:
    """The step that made the mask's Inf ``step`` took: the step whose output its input was, or, where that
    step only passed it on (it took Inf too), the one whose output that step's input was, and so on."""
    found = _producer(rec, step, k.result)
    for _ in range(10):  # (a chain of steps passing a mask on is short)
        if found is None or not k.given[found[1].index]:
            break
        further = _producer(rec, found[1], k.result)
        if further is None:
            break
        found = further
    return found[1] if found is not None else None


def _source_text(k: _Kinds, maker: Step | None, producer: Step | None = None) -> str:
    """What a harm origin's cause says of the step that made the mask's Inf it took (``_mask_source``)."""
    if maker is None or (producer is not None and maker.index == producer.index):
        return ""
    how = ("holds Inf at every call" if k.habit_masks()[maker.index] else "made it from finite inputs"
           if not k.given[maker.index] else "passed it on")
    return f"; the Inf came from the output of {describe(maker)}, which {how}"


def _finite_inputs(step: Step, made: str) -> str:
    """How an origin's inputs are described where none recorded held NaN/Inf: "from finite inputs", unless
    an argument could not be recorded as data (a KV cache object), whose values no one saw, or, for a
    backward step, gradients came to its forward's outputs that were not recorded (``_unrecorded_grads``)."""
    unrecorded = unrecorded_arguments(step)
    grads = _unrecorded_grads(step)
    if step.extra.get("dtensors") and not unrecorded and not grads:  # (a backward's: its gradients' DTensors)
        return (f"from inputs that were finite on this rank, but it computed on DTensors, whose operations take in "
                f"the other ranks' shards through collectives the recording does not hold: the {made} may have "
                "come from another rank")
    if not unrecorded and not grads:
        return "from finite inputs"
    if grads:
        return (f"from inputs that were finite as far as recorded: {grads}, so whether the {made} came in through "
                "them is not known")
    s, them = ("s", "them") if len(unrecorded) > 1 else ("", "it")
    return (f"from inputs that were finite as far as recorded: its argument{s} "
            f"{', '.join(u.text() for u in unrecorded)} could not be recorded, so whether the {made} came in "
            f"through {them} is not known")


# A forward step's notes on outputs whose gradients are not recorded: "<record names>[:] " + one of these (as
# the replay of a backward step reads them)
_GRADS_UNRECORDED = (layout.UNFOLLOWED_NOTE, layout.UNCOPIED_NOTE, layout.DUAL_NOTE, layout.SHARED_OUTPUTS_NOTE)


def _unrecorded_grads(step: Step) -> str:
    """For a backward step, the gradients that came to its forward's outputs and were not recorded, in
    words ("" where none): outputs the recorder did not follow (a tensor in a plain object), or, with no
    grad output recorded at all, an output holding no tensor it follows (a generator, whose values are
    computed after the step returned). Its grad inputs were computed from them too, unseen."""
    if step.phase != "backward" or step.forward is None:
        return ""
    fwd = step.rec.step(step.forward)
    names = []
    for note in fwd.extra.get("notes") or []:
        for text in _GRADS_UNRECORDED:
            if isinstance(note, str) and text in note:
                names += [n for n in note.split(text)[0].rstrip(": ").split(", ") if n.startswith("output")]
    if names:
        return (f"the gradients that came to {', '.join(dict.fromkeys(names))} of its forward (step {fwd.index}) were "
                "not recorded (not followed for gradients)")
    if any(r.role == "grad_output" for r in step.records):
        return ""
    doc = fwd.output_structure
    tag = next(iter(doc), None) if isinstance(doc, dict) and len(doc) == 1 else None
    ref = doc[tag].get("type") if tag in ("$opaque", "$object") and isinstance(doc[tag], dict) else None
    what = f"returned {type_words(ref)}, which holds" if isinstance(ref, str) else "returned"
    return (f"its grad outputs were not recorded (its forward, step {fwd.index}, {what} no tensor the recorder "
            "follows for gradients)")


def _unseen_after_entry(rec: Recording, made: np.ndarray, entered: np.ndarray) -> np.ndarray:
    """Per step: among ``made``, those before the first other one whose inputs were finite only as far as
    recorded (an argument not recorded as data; a backward step's gradients not recorded: ``_finite_inputs``)
    and that ran after a step NaN/Inf came into and went on from (``entered``). That NaN/Inf came in first,
    from outside every recorded step, and may have reached them through what was not recorded: they made
    none that anyone saw, and the step it came into is the answer."""
    unseen = np.zeros(len(made), dtype=bool)
    if not entered.any():
        return unseen
    first = int(np.flatnonzero(entered)[0])
    for index in np.flatnonzero(made).tolist():
        if index < first:
            break
        step = rec.step(index)
        if not unrecorded_arguments(step) and not _unrecorded_grads(step):
            break
        unseen[index] = True
    return unseen


def _state_came_inside(rec: Recording, k: _Kinds, made: np.ndarray) -> np.ndarray:
    """Per step: among ``made``, up to the first that stays, those enclosing a forward step that found its module's
    parameters or buffers non-finite when it began (a teacher called by a no-grad wrapper step given the batch
    alone): the NaN/Inf came in with state that the wrapper's records do not hold, and the step it came into is
    the answer, which names the wrapper as one that may have written it (``_caller_text``)."""
    inside = np.zeros(len(made), dtype=bool)
    phase = _column(rec, "phase")
    for index in np.flatnonzero(made).tolist():
        if not any(k.given[j] and phase[j] == 0 and _state_nonfinite(rec.step(j)) for j in subtree(rec, index)):
            break
        inside[index] = True
    return inside


def _state_nonfinite(step: Step) -> bool:
    """Whether a step's module's parameters or buffers held NaN or Inf when the call began."""
    return any(r.role in ("param", "buffer") and r.nonfinite for r in step.records)


_MODULE_TYPES = ("torch.nn.", "torch.optim.")  # unrecorded arguments of these modules' types may hold parameters


def _module_classes(step: Step) -> frozenset[str]:
    """The classes (type references) of a module step's module and every module below it, from its skeleton."""
    try:
        return frozenset(str(doc.get("class")) for _, doc in skeleton_modules(step._doc("module")))
    except Exception:  # noqa: BLE001 - a damaged or missing skeleton: no class is known
        return frozenset()


def _opaque_writers_text(rec: Recording, source: Step, earlier: Step | None) -> str:
    """Where a module step found its state non-finite: the recorded forward steps since the last call that saw it
    finite (``earlier``) that were given an argument they could not record that may hold that state, a module of
    the classes of ``source``'s skeleton or one of torch's modules or optimizers (an EMA update given the target
    module, ``ema_update(target, online, m)``; not a Hugging Face block given its ``DynamicCache``), whose writes
    to it no record holds, said before "... wrote it" as ones that may have written it ("" for none). Not the
    steps enclosing ``source``: ``_caller_text`` names its caller."""
    lo = max(earlier.index if earlier is not None else -1, source.index - _WRITERS_LOOKED_AT)
    phase, parent = _column(rec, "phase"), _column(rec, "parent")
    enclosing, up = set(), source.parent
    while up is not None and 0 <= up < source.index and up not in enclosing:
        enclosing.add(up)
        up = int(parent[up])
    holders = _module_classes(source)
    found: list[tuple[Step, str]] = []
    for index in (np.flatnonzero(phase[lo + 1:source.index] == 0) + lo + 1).tolist():
        if index in enclosing:
            continue
        step = rec.step(index)
        opaque = [u for u in unrecorded_arguments(step) if u.type in holders or u.type.startswith(_MODULE_TYPES)]
        if opaque:
            found.append((step, opaque[0].text()))
    if not found:
        return ""
    (first, what), others = found[0], [f"step {s.index} ({s.name})" for s, _ in found[1:4]]
    more = f" (or {', '.join(others)}{f' and {len(found) - 4} more' if len(found) > 4 else ''}, also given one)" \
        if others else ""
    return f"{describe(first)}, given {what}, which it could not record, may have written it{more}, or "


def _caller_text(rec: Recording, source: Step) -> str:
    """Where a module step found its state non-finite: the step that called it, whose code may have written that
    state before the call (its records do not hold it, as the wrapper's of a teacher given the batch alone), said
    before "... wrote it" ("" where no step encloses it)."""
    if source.parent is None:
        return ""
    return f"{describe(rec.step(source.parent))}, which called it, or "


def _second_order(step: Step) -> bool:
    """Whether a backward step ran through a graph of gradients an earlier pass took with create_graph=True."""
    return step.phase == "backward" and layout.SECOND_ORDER_NOTE in (step.extra.get("notes") or [])


def _gradient_user(rec: Recording, step: Step) -> Step | None:
    """For a backward step through a graph of gradients (``_second_order``), the recorded step whose own code
    used those gradients, where one did: a backward step of its pass before it, through such a graph too, whose
    forward took gradients with create_graph=True itself (a backward step of that call began while it ran: a
    ``gradient_penalty(d_out, interp)`` calling torch.autograd.grad). Its backward made the second-order terms,
    which none of its records holds (the gradients went from it to the critic's parameters straight). None where
    no step did (the loop took them: outside every recorded step)."""
    phase, forward, iteration = _column(rec, "phase"), _column(rec, "forward"), _column(rec, "iteration")
    start, end = _column(rec, "t_start"), _column(rec, "t_end")
    for index in range(step.index - 1, max(step.index - _SOURCE_SEARCH, 0) - 1, -1):
        if iteration[index] != iteration[step.index]:
            break
        fwd = int(forward[index])
        if phase[index] != 1 or fwd < 0 or not _second_order(rec.step(index)):
            continue
        inner = np.flatnonzero((phase[fwd + 1:index] == 1) & (forward[fwd + 1:index] == fwd)) + fwd + 1
        if any(start[k] <= end[fwd] for k in inner.tolist()):
            return rec.step(index)
    return None


def _through_gradients(rec: Recording, made: np.ndarray) -> np.ndarray:
    """Per step: among ``made``, the backward steps before the first other one that ran through a graph of
    gradients (a gradient penalty's): their results hold second-order terms their recorded inputs do not
    show, so NaN from finite recorded inputs came in that way, made where those gradients were computed
    (outside every recorded step, where no step before it made it), not by the step."""
    through = np.zeros(len(made), dtype=bool)
    phase = _column(rec, "phase")
    for index in np.flatnonzero(made).tolist():
        if phase[index] != 1 or not _second_order(rec.step(index)):
            break
        through[index] = True
    return through


def entered_op_note(origin: Origin) -> str:
    """``ops=True`` where no recorded step made the NaN/Inf: why no operation is named."""
    bad = _own_nonfinite(origin.entered.rec, origin.entered)[1] if origin.entered is not None else []
    if origin.suspect is not None and bad and bad[0].role != "grad_output":  # (a writer: _unseen_writers)
        return (f"no operation is named: the NaN/Inf came into step {origin.entered.index} in a tensor that step "
                f"{origin.suspect.index} was given and may have written through .data, unseen by the recording "
                f"(above), so no recorded result holds it to replay operation by operation; a replay of step "
                f"{origin.suspect.index} says whether it changes it")
    if origin.entered is not None and origin.suspect is not None:
        return (f"no operation is named: the NaN/Inf came into step {origin.entered.index} through a gradient "
                f"that was not recorded, which step {origin.suspect.index} may have made (above), so there is no "
                "recorded result to replay operation by operation")
    if origin.entered is not None:
        return (f"no operation is named: no recorded step made the NaN/Inf, it came into step {origin.entered.index} "
                "from outside them (above), so there is no step to replay operation by operation")
    if origin.ended_by is not None:
        return "no operation is named: no recorded step made or received the NaN/Inf (above)"
    return "no operation is named: no recorded step made or received NaN/Inf"


# An exception whose type or message speaks of NaN or Inf (a loss guard's FloatingPointError, "loss is nan").
_SPEAKS_NONFINITE = re.compile(r"\b(nan|inf|infinity|infinite|non-?finite|overflow(s|ed)?)\b", re.IGNORECASE)
# torch refusing a Python number too large for the tensor's dtype (an optimizer given lr=1e39): it speaks of an
# overflow that it kept from happening, so no tensor was made NaN or Inf.
_REFUSED_OVERFLOW = re.compile(r"cannot be converted to type \w+ without overflow", re.IGNORECASE)
# Quoted text in a message is the user's data (a file name, a key: "No such file or directory:
# '/ckpt/inf/model.pt'"), not what the exception speaks of (torch quotes a node's name apart from
# "returned nan values").
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")


def _speaks_nonfinite(kind: Any, message: Any) -> bool:
    """Whether an exception (its type reference and message) speaks of a NaN or Inf: a FloatingPointError, or a
    message that says so outside its quoted parts (a loss guard's "loss is nan")."""
    said = _QUOTED.sub("", _REFUSED_OVERFLOW.sub("", str(message or "")))
    return str(kind or "").endswith("FloatingPointError") or bool(_SPEAKS_NONFINITE.search(said))


def exception_line(doc: dict[str, Any]) -> str:
    """A recorded exception (``exception_doc``) in one line: its type's name and the start of its message."""
    return " ".join(f"{str(doc.get('type', '')).split(':')[-1]}: {str(doc.get('message', ''))[:200]}".split())


def _ended_outside(rec: Recording) -> Origin | None:
    """Where no recorded step holds NaN/Inf and the run ended by an exception: which, and after which
    recorded step, or inside which (the innermost it came out of: ``_raised_first``); an exception that
    speaks of NaN/Inf (a loss guard raising before ``backward()``) was about one made outside the recorded
    steps, which is then ``ended_by``."""
    exc = rec.rank.final.get("exception")
    why = rec.ended_by
    if not isinstance(exc, dict) or not exc.get("type") or why is None or not len(rec):
        return None
    parent = _column(rec, "parent")
    index = len(rec) - 1
    while 0 <= int(parent[index]) < index:  # the last step to finish: the outermost of the last ones
        index = int(parent[index])
    last = _raised_first(rec, rec.step(index)) if rec.step(index).status == "exception" else rec.step(index)
    nan = _speaks_nonfinite(exc["type"], why)
    if last.status == "exception":
        where = f"raised inside {describe(last)}, which returned no result"
        made = ", so the NaN/Inf it speaks of was made inside that step, before any result of it was recorded"
    elif rec.rank.final.get("raised_during"):  # (validation: the framework callback does not record it)
        where = f"(after the last recorded step: {describe(last)})"
        made = (f"; the framework callback records training steps only, not {rec.rank.final['raised_during']}, so "
                "the NaN/Inf it speaks of was made there, unrecorded: to find it, record that code itself, e.g. "
                "trainer.validate(...) or trainer.evaluate() inside `with recorder.record(PATH, model=model, "
                "modules=...)`")
    else:
        where = f"after the last recorded step ({describe(last)})"
        made = (", so the NaN/Inf it speaks of was made outside the recorded steps: record the code between them "
                "(the loss) as a paper step, or with pdbg record --modules")
    cause = f"no recorded step made or received NaN/Inf; the run ended by {why.rstrip('.')} {where}"
    if not nan:
        return Origin(None, cause)
    return Origin(None, cause + made, ended_by=why, raised_in=last if last.status == "exception" else None)


def _nothing_recorded(rec: Recording) -> Origin:
    """A rank with no steps: what ended it, where an exception did (a NaN check in Lightning's sanity check,
    before the first training step), which, speaking of NaN/Inf, is a finding: it was made before any step."""
    exc, why = rec.rank.final.get("exception"), rec.ended_by
    if not isinstance(exc, dict) or not exc.get("type") or why is None:
        return Origin(None, "no steps recorded")
    cause = f"no steps recorded; the run ended by {why.rstrip('.')} before any step was recorded"
    return Origin(None, cause, ended_by=why if _speaks_nonfinite(exc["type"], why) else None)


def _raised_caught(rec: Recording) -> Origin | None:
    """Where no recorded step holds NaN/Inf and the run did not end by an exception, but steps raised one that
    speaks of NaN/Inf and the training code caught it (a NaN check inside a step, a loop that skips the batch):
    the first such step, the innermost it came out of (``_raised_first``), in which the NaN/Inf was made."""
    status, parent = _column(rec, "status"), _column(rec, "parent")
    raised = np.flatnonzero(status == layout.STATUSES.index("exception")).tolist()
    docs = {i: rec.step(i).extra.get("exception") or {} for i in raised}
    speaking = [i for i in raised if _speaks_nonfinite(docs[i].get("type"), docs[i].get("message"))]
    if not speaking:
        return None
    inside = set(speaking)
    outermost = [i for i in speaking if not (0 <= int(parent[i]) < i and int(parent[i]) in inside)]
    first = _raised_first(rec, rec.step(outermost[0]))
    said = exception_line(first.extra.get("exception") or {})
    more = f" ({len(outermost)} calls raised one, caught each time)" if len(outermost) > 1 else ""
    return Origin(None, f"no non-finite values recorded; {describe(first)} raised {said}, which the training code "
                        f"caught{more}: the NaN/Inf it speaks of was made inside that step, before any result of it "
                        "was recorded", raised_in=first)


def _raised_on_given(rec: Recording, given: np.ndarray) -> Origin | None:
    """Where no step's results held NaN/Inf but a step given NaN/Inf raised an exception that speaks of it (a NaN
    check in the step: ``assert torch.isfinite(h).all()``, ``torch._assert``): it did not keep them out of its
    results as a mask's taker does, it stopped on them. An enclosing step that raised the same exception from
    finite inputs of its own made them, in its code around the inner call: ``raised_in``, which ``find_op``
    replays; else they came into the step from outside every recorded step (``entered``)."""
    status, parent = _column(rec, "status"), _column(rec, "parent")
    raised = layout.STATUSES.index("exception")
    for index in np.flatnonzero(given & (status == raised)).tolist():
        step = rec.step(index)
        doc = step.extra.get("exception") or {}
        if not _speaks_nonfinite(doc.get("type"), doc.get("message")):
            continue
        said = exception_line(doc)
        took = _nonfinite_text(step, {layout.ROLES[i] for i in layout.INPUT_ROLES[layout.PHASES.index(step.phase)]})
        stopped = f"{describe(step)} was given {'; '.join(took) or 'non-finite inputs'} and raised {said}"
        up, maker = int(parent[index]), None
        while 0 <= up < index and status[up] == raised and \
                (rec.step(up).extra.get("exception") or {}).get("message") == doc.get("message"):
            if not given[up]:
                maker = rec.step(up)
                break
            up = int(parent[up])
        final = rec.rank.final.get("exception")
        ended = rec.ended_by if isinstance(final, dict) and final.get("message") == doc.get("message") else None
        if maker is not None:
            return Origin(None, f"no step's results held NaN or Inf; {stopped}: they were made by the code of "
                                f"{describe(maker)} around that call, from its finite inputs (it raised the same, "
                                "returning no result)", raised_in=maker, ended_by=ended)
        return Origin(None, f"{stopped}: {_entered_cause(rec, step)}", entered=step, ended_by=ended)
    return None


def _backward_raised(rec: Recording) -> Origin | None:
    """Where nothing else is found: backward passes that raised an exception speaking of NaN/Inf where no recorded
    step's backward was under way, which the training code caught (``final.backward_raised``: anomaly mode stopping
    in the loss's backward, a loop that skips the batch). The NaN/Inf was made outside the recorded steps."""
    doc = rec.rank.final.get("backward_raised")
    exc = doc.get("exception") if isinstance(doc, dict) else None
    if not isinstance(exc, dict) or not _speaks_nonfinite(exc.get("type"), exc.get("message")):
        return None
    said = exception_line(exc).rstrip(".")
    count = int(doc.get("count") or 1)
    times = f" ({count} passes raised one, caught each time)" if count > 1 else ""
    found = ANOMALY.search(str(exc.get("message", "")))
    what = f"anomaly mode's {said.partition(':')[0]} ({found.group(1)} returned NaN in its output " \
        f"{found.group(2)})" if found else said
    return Origin(None, f"no non-finite values recorded; a backward pass in iteration {doc.get('iteration')} raised "
                        f"{what} outside every recorded step's backward, which the training code caught{times}: the "
                        "NaN/Inf was made by code outside the recorded steps (the loss): record it as a paper step, or "
                        "with pdbg record --modules", raised_outside=said)


def _raised_first(rec: Recording, step: Step) -> Step:
    """The innermost step an exception that escaped ``step`` came out of: down from it, the last inner step of
    each that raised the same exception (its type and message), as far as one did (a layer deep inside the
    model, not the model)."""
    status, parent = _column(rec, "status"), _column(rec, "parent")
    raised = layout.STATUSES.index("exception")

    def said(s: Step) -> tuple[Any, Any]:
        exc = s.extra.get("exception") or {}
        return exc.get("type"), exc.get("message")

    while True:
        inside = np.flatnonzero((parent[step.index + 1:] == step.index) & (status[step.index + 1:] == raised))
        inner = next((rec.step(step.index + 1 + int(k)) for k in inside[::-1]
                      if said(rec.step(step.index + 1 + int(k))) == said(step)), None)
        if inner is None:
            return step
        step = inner


# What autograd's anomaly mode (torch.autograd.set_detect_anomaly) raises where a backward function
# makes NaN: the pass stops there, before any step records the NaN.
ANOMALY = re.compile(r"Function '(\w+)' returned nan values in its (\d+)(?:st|nd|rd|th) output")


_STOPPED_NOTE = (", where the recorder stopped the run (on_anomaly=\"stop\"), so nothing that would have come of "
                 "it was recorded")


def _stopped_at(rec: Recording, result: np.ndarray) -> int | None:
    """The step whose NaN/Inf made the recorder stop the run (``on_anomaly="stop"``): the run ended by
    its NonFiniteError, whose message begins with the step as the recorder names it (monitors'
    ``StepContext.describe``). Its Inf is no mask's, even where nothing non-finite came of it: the run
    went no further. Searched among the steps whose results held NaN or Inf, the last first."""
    step = _stopper(rec, np.flatnonzero(result))
    return None if step is None else step.index


def stopped_step(rec: Recording) -> Step | None:
    """The step whose NaN/Inf made the recorder stop the run (``on_anomaly="stop"``), or whose breakpoint with
    ``action="stop"`` did, or None where neither ended it. The error is raised as that step returns and unwinds
    through the steps around it, which are marked ``exception`` (the stopping step ``nonfinite``, or, a
    breakpoint's, as it ended): it, not they, is where to look."""
    found = _stopper(rec, np.flatnonzero(_column(rec, "status") == layout.STATUSES.index("nonfinite")))
    if found is None:
        found = _stopper(rec, np.arange(max(len(rec) - _SOURCE_SEARCH, 0), len(rec)), kind="BreakpointStop")
    return found


def _stopper(rec: Recording, among: np.ndarray, kind: str = "NonFiniteError") -> Step | None:
    """Of the steps ``among`` (indices, ascending), searched the last first, the one the ``kind`` error that
    ended the run names, as the recorder describes a step: a NonFiniteError at the start of its message, a
    BreakpointStop at its end ("breakpoint 'name' at <step>")."""
    exc = rec.rank.final.get("exception")
    if not isinstance(exc, dict) or not str(exc.get("type") or "").endswith(f":{kind}"):
        return None
    message = str(exc.get("message") or "")
    for index in among[::-1][:_SOURCE_SEARCH].tolist():
        step = rec.step(int(index))
        label = step.paper.get("label")
        who = f"{label} ({step.name})" if label else step.name
        where = f" at {step.module_path}" if step.module_path else ""
        text = f"{who}{where} {step.phase}, iteration {step.iteration}, call {step.call}"
        if message.startswith(f"{text}: ") if kind == "NonFiniteError" else \
                message.startswith("breakpoint ") and message.endswith(f" at {text}"):
            return step
    return None


def _anomaly_raised(rec: Recording) -> Origin | None:
    """The step whose backward anomaly mode stopped with "returned nan values" (the recorder gives
    the exception that ended the recording to the backward step under way), as the origin."""
    status = _column(rec, "status")
    for index in np.flatnonzero(status == layout.STATUSES.index("exception")).tolist():
        step = rec.step(int(index))
        message = str((step.extra.get("exception") or {}).get("message", ""))
        found = ANOMALY.search(message)
        if found:  # the innermost step the pass stopped in (the steps around it raised the same)
            step = _raised_first(rec, step)
            return Origin(step, f"{describe(step)}: anomaly mode stopped the backward pass inside it, where "
                                f"{found.group(1)} returned NaN in its output {found.group(2)} (the pass stopped "
                                "before any recorded gradient held it)", [])
    found = ANOMALY.search(str(rec.ended_by or ""))
    if found:  # raised where no recorded step's backward was under way
        return Origin(None, f"no non-finite values recorded; the run ended when anomaly mode stopped a backward pass "
                            f"outside every recorded step's backward, where {found.group(1)} returned NaN in its "
                            f"output {found.group(2)}: record the code that made it as a step", ended_by=rec.ended_by)
    return None


def _own_inputs(step: Step) -> list[Any]:
    """A step's input records (``layout.INPUT_ROLES``; a backward step's and its forward's)."""
    def inputs(s: Step) -> list[Any]:
        roles = {layout.ROLES[i] for i in layout.INPUT_ROLES[layout.PHASES.index(s.phase)]}
        return [r for r in s.records if r.role in roles]

    own = inputs(step)
    if step.phase == "backward" and step.forward is not None:
        own += inputs(step.rec.step(step.forward))
    return own


def layout_results(phase: str) -> set[str]:
    return {"output"} if phase == "forward" else set(layout.GRAD_ROLES)


def _after(rec: Recording, index: int, result: np.ndarray, count: int, inclusive: bool = False) -> list[Step]:
    later = np.flatnonzero(result[index if inclusive else index + 1:]) + (index if inclusive else index + 1)
    return [rec.step(int(k)) for k in later[:count]]


def _entered_cause(rec: Recording, step: Step, senders: list[tuple[Step, list[str]]] | None = None,
                   writers: list[tuple[Step, str]] | None = None) -> str:
    """Why no recorded step is to blame: which tensor arrived non-finite, and since when. A step's own
    inputs come first: a rank whose input was non-finite sent it to the others, it did not receive it.
    ``senders``: where a grad output came so, the steps that may have sent it (``_unrecorded_senders``);
    ``writers``: where a parameter, buffer or input did, the steps given it that may have written it unseen
    (``_unseen_writers``)."""
    source, bad = _own_nonfinite(rec, step)
    values = _values(source, "args") if not bad else []
    if values:  # a number that is no tensor (a numpy array, a float) brought it
        return (f"argument {values[0].text()} of {describe(source)} came non-finite from code outside every "
                "recorded step: a value that is no tensor (record the code that made it as a paper step)")
    if not bad:
        received = _received(step)
        if received:
            world = rec.rank.dist["world_size"]
            counted = any(isinstance(d.get("sent"), dict) for d in step.extra.get("collectives") or [])
            other = "another rank" if world > 2 else "the other rank"
            return (f"collective {received[0]} inside {describe(step)} returned non-finite values "
                    + (f"that this rank ({rec.rank.rank} of {world}) did not send: they came from {other}"
                       if counted else f"to this rank ({rec.rank.rank} of {world}), from {other}")
                    + "; look for the origin there (pdbg bisect without --rank looks at every rank)")
        if _second_order(step):
            made = _nonfinite_text(step, layout_results(step.phase))
            text = (f"{describe(step)} received non-finite values ({'; '.join(made[:2])}) through the graph of "
                    "gradients an earlier backward pass took with create_graph=True, not through its grad outputs, "
                    "which were finite: second-order terms, made where those gradients were used")
            user = _gradient_user(rec, step)
            if user is not None:
                return (f"{text}: by {describe(user)}, in this pass before this one; its forward (step "
                        f"{user.forward}) took them with create_graph=True itself, and its backward sent them on to "
                        "the parameters straight, so no record of it holds them. A replay cannot find its operation "
                        "where its arguments are linked by a graph made outside it (a penalty given d_out and "
                        "interp): record it as a module holding the critic, whose backward replays operation by "
                        "operation")
            where = ("pdbg bisect the recording this bundle came from to find where" if rec.bundle_info is not None
                     else "record that code as a step to find where")
            return f"{text} (a gradient penalty) outside the recorded steps; {where}"
        return f"{describe(step)} received non-finite values from outside every recorded step"
    sent = _sent(step)
    found = bad
    bad = sorted(bad, key=lambda r: not r.stats["nan"])  # the NaN that came in first: the Inf beside it may not have
    made, named = _made_inputs_text(rec, step, bad)
    text = _entered_text(rec, source, step, bad[0], senders or [], writers or []) + made + \
        _other_inputs_text(rec, source, [r for r in found if r is not bad[0] and r.name != named])
    return text + f"; this rank sent them to the others through its {', '.join(sent)}" if sent else text


def _made_inputs_text(rec: Recording, step: Step, bad: list[TensorRecord]) -> tuple[str, str | None]:
    """What ``_entered_cause`` says of the other non-finite inputs of a step that are the output of an earlier
    recorded step (``_producer``): a sampler's step given its previous call's Inf and, computed outside every
    step from it, NaN. That Inf did not come from outside; the step that made it is named. With the name of
    the input it names (None where it names none)."""
    if len(bad) < 2 or step.phase != "forward":
        return "", None
    found = _producer(rec, step, step_flags(rec) & _RESULT != 0, [r for r in bad[1:] if r.role == "input"])
    if found is None:
        return "", None
    record, producer = found
    made = not any(r.nonfinite for r in _own_inputs(producer))
    return (f"; its input {record.name} ({_counts(rec, record)}) did not: it is the output of {describe(producer)}, "
            + ("which made it from finite inputs (taken for a mask's Inf: without the tensor's bytes, its "
               "statistics do not tell +Inf from -Inf)" if made else "which passed it on")), record.name


_OTHER_INPUTS_NAMED = 4  # the step's further non-finite inputs named one by one; the rest counted


def _other_inputs_text(rec: Recording, source: Step, others: list[TensorRecord]) -> str:
    """The non-finite inputs of a step beside the one ``_entered_cause`` follows (inputs, parameters, buffers;
    a backward step's grad outputs): each came in non-finite too, and any of them may be where to look, so
    every one is named, the first few with their counts and the rest as a count."""
    if not others:
        return ""

    def words(r: TensorRecord) -> str:
        if r.role == "grad_output":
            return f"grad output {r.name.removeprefix('output.')} ({_counts(rec, r)})"
        full = f"{source.module_path}.{r.name}" if source.module_path and r.role in ("param", "buffer") else r.name
        return f"{'parameter' if r.role == 'param' else r.role} {full} ({_counts(rec, r)})"

    shown = ", ".join(words(r) for r in others[:_OTHER_INPUTS_NAMED])
    more = len(others) - _OTHER_INPUTS_NAMED
    return (f"; the step's other non-finite input{'s' if len(others) > 1 else ''}: {shown}"
            + (f" and {more} more" if more > 0 else ""))


def _own_nonfinite(rec: Recording, step: Step) -> tuple[Step, list[TensorRecord]]:
    """The step whose inputs a step took (a backward step's forward) and those of its own inputs
    (inputs, parameters, buffers; a backward step's grad outputs) that held NaN or Inf."""
    source = step if step.phase == "forward" else rec.step(step.forward) if step.forward is not None else step
    bad = [r for r in source.records if r.role in ("param", "buffer", "input") and r.nonfinite]
    if step.phase == "backward" and not bad:
        bad = [r for r in step.records if r.role == "grad_output" and r.nonfinite]
    return source, bad


def _from_another_rank(rec: Recording, step: Step) -> bool:
    """Whether what entered ``step`` non-finite came only through its collectives, from another rank."""
    return not _own_nonfinite(rec, step)[1] and bool(_received(step))


def _entered_text(rec: Recording, source: Step, step: Step, r: TensorRecord,
                  senders: list[tuple[Step, list[str]]], writers: list[tuple[Step, str]]) -> str:
    """What ``_entered_cause`` says of a step's own input ``r`` that arrived non-finite."""
    full = f"{source.module_path}.{r.name}" if source.module_path and r.role in ("param", "buffer") else r.name
    earlier = _last_finite_step(rec, step if r.role == "grad_output" else source, r.role, r.name)
    last = earlier.iteration if earlier is not None else None
    since = f"; it was last finite in iteration {last}" if last is not None else \
        "; it was never finite in this recording"
    # Inf that came in and that the step made NaN of: the step is not where it went wrong, but say what it did
    became = ""
    if not r.stats["nan"] and not any(x.stats["nan"] for x in _own_inputs(step) if x.nonfinite):
        made = _nonfinite_text(step, layout_results(step.phase))
        if any("NaN" in m for m in made):
            became = f"; the step made NaN of that Inf: {'; '.join(made)}"
    if r.role == "param" and earlier is not None and _forward_only(earlier):
        return (f"parameter {full} was already non-finite when {describe(source)} began ({_counts(rec, r)}); it was "
                f"last finite in {describe(earlier)}, which ran under a torch.func transform and is recorded forward "
                "only: the gradients taken through it (the backward pass after its vmap, or the transform's own) are "
                f"not recorded, and are the likely source, through the optimizer update{became}")
    if r.role in ("param", "buffer"):
        return (f"{'parameter' if r.role == 'param' else 'buffer'} {full} was already non-finite when "
                f"{describe(source)} began ({_counts(rec, r)}): {_writers_text(writers, 'the parameter')}"
                f"{_opaque_writers_text(rec, source, earlier)}{_caller_text(rec, source)}the optimizer update or code "
                f"outside every recorded step wrote it{since}{_finite_gradient_text(rec, source, r, earlier)}{became}")
    if r.role == "grad_output":
        which = "" if r.name == "output" else f" {r.name.removeprefix('output.')}"
        if senders:  # a later step's backward sent gradients toward arguments no tap followed
            sender, names = senders[0]
            back = _backward_of(rec, sender, step.index)
            more = f" (and {len(senders) - 1} more step{'s' if len(senders) > 2 else ''} like it)" \
                if len(senders) > 1 else ""
            return (f"grad output{which} of {describe(step)} came non-finite ({_counts(rec, r)}) from the backward "
                    "of a later step whose gradient for an argument was not recorded: the possible source is "
                    f"{describe(back) if back is not None else describe(sender)}{more}, whose gradient for "
                    f"{_argument_places(sender, names)} is not recorded (not followed for gradients){since}{became}")
        return (f"grad output{which} of {describe(step)} came non-finite ({_counts(rec, r)}) from the backward of "
                f"code outside every recorded step{since}{_hook_before(rec, step)}{became}")
    if writers:
        return (f"input {r.name} of {describe(source)} came non-finite ({_counts(rec, r)}): "
                f"{_writers_text(writers, 'the input')}code outside every recorded step wrote it{since}{became}")
    if earlier is not None and _forward_only(earlier):  # (per-sample gradients: vmap(grad(loss)) over functional_call)
        return (f"input {r.name} of {describe(source)} came non-finite ({_counts(rec, r)}) from code outside every "
                f"recorded step; it was last finite in {describe(earlier)}, which ran under a torch.func transform "
                "and is recorded forward only: where this input is made from what the gradients taken through it "
                "update (parameters given as an argument, as to functional_call), those gradients, not recorded, are "
                f"the likely source, through the optimizer update{became}")
    return (f"input {r.name} of {describe(source)} came non-finite ({_counts(rec, r)}) from code outside every "
            f"recorded step{since}{_hook_before(rec, source)}{became}")


_HOOKS_LOOKED_AT = 10_000  # steps before the one a tensor came into non-finite looked at for the step that ended last


def _hook_before(rec: Recording, step: Step) -> str:
    """Where a tensor came into ``step`` non-finite from code outside every recorded step: the hooks that ran on it
    after the step that made it was recorded and before ``step`` was (a hook is not recorded, and its module document
    names it), each a likely source, said; "" where none. Those are the pre-hooks of ``step``'s own module, which ran
    on what it was given (``_own_pre_hooks``), the user's hooks on every module's calls (``_global_hooks_text``), and
    the forward hooks (``step`` a forward) or backward hooks (a backward) of the module of the step of its phase that
    ended last before it began, in its iteration, which ran on that step's result."""
    own = _own_pre_hooks(rec, step) + _global_hooks_text(step)
    first = max(step.index - _HOOKS_LOOKED_AT, 0)
    phase, iteration = _column(rec, "phase")[first:step.index], _column(rec, "iteration")[first:step.index]
    ends = _column(rec, "t_end")[first:step.index]
    began = float(_column(rec, "t_start")[step.index])
    before = np.flatnonzero((phase == layout.PHASES.index(step.phase)) & (iteration == step.iteration)
                            & (ends <= began))
    if not len(before):
        return own
    last = rec.step(first + int(before[np.argmax(ends[before])]))
    doc = last._doc("module") if last.module_path is not None else None
    kind = "forward hook " if step.phase == "forward" else "backward hook "
    hooks = _hooks_named(doc, kind)
    if not hooks:
        return own
    what = "its output" if step.phase == "forward" else "the gradients it passed on"
    return (f"{own}; {describe(last)} ended last before it, and its module's {kind}{', '.join(hooks)} ran on {what} "
            "after it was recorded: a likely source (a hook's work is not recorded)")


def _hooks_named(doc: Any, kind: str) -> list[str]:
    """The names of the hooks of ``kind`` ("backward hook ") a module document's ``other_hooks`` lists."""
    named = doc.get("other_hooks") if isinstance(doc, dict) else None
    return [h.removeprefix(kind) for h in named or () if isinstance(h, str) and h.startswith(kind)]


def _own_pre_hooks(rec: Recording, step: Step) -> str:
    """Where what came into ``step`` came non-finite: its own module's pre-hooks of its phase, which ran on it before
    the step recorded it, a likely source, said; "" where none. A forward step's module's forward pre-hooks ran on its
    arguments (but for those its note says ran after they were recorded: ``layout.UNRUN_PRE_HOOKS_NOTE``); a
    backward step's module's backward pre-hooks (``register_full_backward_pre_hook``) on its grad outputs. A
    recording before schema 1.29 named the latter "backward hook" as its full backward hooks, which run after the
    step: those are said to be a likely source only if they were pre-hooks."""
    if step.module_path is None:
        return ""
    doc = _module_doc(step)
    told = ""
    if step.phase == "forward":
        unrun = step.noted(layout.UNRUN_PRE_HOOKS_NOTE)
        which = "forward pre-hook"
        hooks = [h for h in _hooks_named(doc, "forward pre-hook ") if h not in unrun]
    elif layout.parse_version(rec.rank.run.schema_version) >= layout.BACKWARD_PRE_HOOKS_SINCE:
        hooks, which = _hooks_named(doc, "backward pre-hook "), "backward pre-hook"
    else:
        hooks, which = _hooks_named(doc, "backward hook "), "backward hook"
        told = ", if it is a pre-hook (a recording before schema 1.29 does not tell a pre-hook from a full backward " \
            "hook),"
    if not hooks:
        return ""
    what = "its arguments" if step.phase == "forward" else "the gradients it was given"
    return (f"; its own module's {which} {', '.join(hooks)}{told} ran on {what} before they were recorded: a likely "
            "source (a hook's work is not recorded)")


def _global_hooks_text(step: Step) -> str:
    """The hooks on every module's calls of ``step``'s phase (``register_module_forward_hook`` and the like) that its
    call's note names: they ran on what every module made or was given, also between the recorded steps, so each is
    a possible source of what came into ``step`` non-finite from outside every step, said; "" where none."""
    hooks = sorted(h for h in _forward_of(step).noted(layout.GLOBAL_HOOK_NOTE)
                   if h.startswith(f"global {step.phase} "))
    if not hooks:
        return ""
    return (f"; the process had {', '.join(hooks)}, which ran on every module's "
            "calls, between the recorded steps too: a possible source (a hook's work is not recorded)")


_WRITERS_LOOKED_AT = 100_000  # steps before the one a tensor came into non-finite looked at for unseen writers, at most


def _unseen_writers(rec: Recording, step: Step) -> list[tuple[Step, str]]:
    """Where a parameter, buffer or input came into ``step`` non-finite: the recorded forward steps between the last
    call of the step that saw it finite and ``step`` that were given that very tensor (finite, its values as that call
    recorded them: the same bytes, or the same statistics where either record kept statistics only; its shape, dtype
    and device), and hold no record of a change to it (``after:``), where a write through ``.data`` goes unseen (a
    tensor over 1 MiB, or not on the CPU: ``data_writes_unseen``): each may have written it. With the name of the
    argument each was given it as; those that changed other arguments in place (an update step, which writes its
    state) first."""
    source, bad = _own_nonfinite(rec, step)
    r = bad[0] if bad else None
    if r is None or r.role not in ("param", "buffer", "input"):
        return []
    earlier = _last_finite_step(rec, source, r.role, r.name)
    last = next((x for x in earlier.records if x.role == r.role and x.name == r.name and not x.nonfinite),
                None) if earlier is not None else None
    if last is None or not data_writes_unseen(dataclasses.replace(last, role="input")):
        return []
    rank = rec.rank
    lo = max(earlier.index, source.index - _WRITERS_LOOKED_AT)  # (type: earlier is not None here)
    steps = rank.column("tensors/step")
    rows = np.flatnonzero((steps > lo) & (steps < source.index)
                          & (rank.column("tensors/role") == layout.ROLES.index("input")))
    if not len(rows):
        return []
    stats = np.asarray(rank.column("tensors/stats")[rows], dtype=np.float64)
    finite = (stats[:, layout.STAT_NAMES.index("nan")] == 0) & (stats[:, layout.STAT_NAMES.index("inf")] == 0)
    payloads = rank.payload_column()[rows]
    wanted = np.array([last.stats[k] for k in layout.STAT_NAMES], dtype=np.float64)
    alike = ((stats == wanted) | (np.isnan(stats) & np.isnan(wanted))).all(axis=1)
    same = (payloads == last.payload) if last.has_payload else np.zeros(len(rows), dtype=bool)
    if last.has_payload:  # (bytes kept on both sides: the same bytes; statistics where one kept only those)
        same |= (payloads == layout.NO_REF) & alike
    else:
        same = alike
    found: list[tuple[Step, str]] = []
    for row in rows[finite & same][:1000].tolist():
        x = rank.tensor_record(int(row))
        if (x.dtype, x.shape, x.device) != (last.dtype, last.shape, last.device) or \
                any(s.index == x.step for s, _ in found):
            continue
        given = rec.step(x.step)
        if given.phase == "forward" and not any(o.role == "output" and o.name == f"{layout.AFTER_PREFIX}{x.name}"
                                                for o in given.records):
            found.append((given, x.name))
    return sorted(found, key=lambda f: not any(o.role == "output" and o.name.startswith(layout.AFTER_PREFIX)
                                              for o in f[0].records))  # (stable: in their order otherwise)


def _writers_text(writers: list[tuple[Step, str]], what: str) -> str:
    """The steps ``_unseen_writers`` found, as the cause names them before "... wrote it" ("" for none)."""
    if not writers:
        return ""
    first, name = writers[0]
    others = [f"step {s.index} ({s.name})" for s, _ in writers[1:4]] + \
        ([f"{len(writers) - 4} more"] if len(writers) > 4 else [])
    more = f" (or {', '.join(others)}, also given it)" if others else ""
    return (f"{describe(first)} may have written it{more}: it was given that tensor as {name} (finite, holding the "
            f"values {what} held when last seen), and a change through .data to a tensor over "
            f"{layout.KEPT_INPUT_BYTES >> 20} MiB, or not on the CPU, goes unseen by the recording (a replay of step "
            f"{first.index} says whether it changes it); else ")


# A forward step's notes on arguments whose gradients are not recorded: "<record names>[:] " + one of these
_ARGUMENT_GRADS_UNRECORDED = (layout.UNFOLLOWED_NOTE, layout.SHARED_ARGUMENTS_NOTE, layout.DUAL_NOTE,
                              layout.LEAF_UNFOLLOWED_NOTE, layout.CHANGED_ARGUMENT_NOTE)
_SENDERS_LOOKED_AT = 100_000  # forward steps between a call and its backward looked at, at most


def _unrecorded_senders(rec: Recording, step: Step) -> list[tuple[Step, list[str]]]:
    """For a backward step whose grad output came non-finite: the forward steps that ran after its forward
    (and outside it) in the iteration, before it in the backward pass, with arguments whose gradients were
    not recorded (a tensor in an object no tap passes a tapped tensor through), and those arguments' record
    names. Their backward sent gradients toward those arguments unseen: one of them may have made the
    NaN/Inf. Those given the same values as one of the step's forward's outputs come first."""
    if step.phase != "backward" or step.forward is None:
        return []
    fwd = step.rec.step(step.forward)
    inside = subtree(rec, fwd.index)
    start = (inside[-1] if inside else fwd.index) + 1
    stop = min(step.index, start + _SENDERS_LOOKED_AT)
    if stop <= start:
        return []
    phase, iteration = _column(rec, "phase")[start:stop], _column(rec, "iteration")[start:stop]
    extra = _column(rec, "extra")[start:stop]
    found: list[tuple[Step, list[str]]] = []
    named: dict[int, list[str]] = {}  # extra document -> the names its notes give (steps share documents)
    for k in np.flatnonzero((phase == 0) & (iteration == fwd.iteration) & (extra != layout.NO_REF)).tolist():
        sender = rec.step(start + k)
        names = named.get(int(extra[k]))
        if names is None:
            names = named[int(extra[k])] = list(dict.fromkeys(
                n for note in sender.extra.get("notes") or [] for text in _ARGUMENT_GRADS_UNRECORDED
                if isinstance(note, str) and text in note
                for n in note.split(text)[0].rstrip(": ").split(", ") if n.startswith(("args.", "kwargs."))))
        if names:
            found.append((sender, names))
    outputs = [(tuple(r.shape), r.dtype, tuple(r.stats.values())) for r in fwd.records if r.role == "output"]

    def given_its_output(entry: tuple[Step, list[str]]) -> bool:
        sender, names = entry
        return any((tuple(r.shape), r.dtype, tuple(r.stats.values())) in outputs for r in sender.records
                   if r.role == "input" and r.name in names)

    return sorted(found, key=lambda entry: not given_its_output(entry))


def _backward_of(rec: Recording, fwd: Step, before: int) -> Step | None:
    """The backward step of forward step ``fwd`` recorded before step ``before``, if any (the last)."""
    hits = np.flatnonzero(_column(rec, "forward")[fwd.index + 1:before] == fwd.index)
    return rec.step(fwd.index + 1 + int(hits[-1])) if len(hits) else None


def _argument_places(step: Step, names: list[str], shown: int = 3) -> str:
    """Arguments of a forward step by record name, each with the object it was in ("args.0.h (in a Box)")."""
    def place(name: str) -> str:
        doc: Any = step.arguments or {}
        for part in name.split(".")[:-1]:
            doc = _item_doc(doc, part)
        tag, body = next(iter(doc.items())) if isinstance(doc, dict) and len(doc) == 1 else (None, None)
        kind = body.get("type") if tag in _TYPED and isinstance(body, dict) else None
        if not isinstance(kind, str):
            return name
        return f"{name} (in {type_words(kind.partition(':')[2] if kind.startswith('__main__:') else kind)})"

    listed = ", ".join(place(n) for n in names[:shown])
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


_TYPED = ("$object", "$dataclass", "$namedtuple", "$mapping")  # tags of the objects a document names the type of


def _item_doc(doc: Any, key: str) -> Any:
    """The item at ``key`` (a part of a record's path) of a container in a tagged JSON document; None where
    it holds none."""
    if isinstance(doc, dict) and len(doc) == 1:
        tag, body = next(iter(doc.items()))
        if tag in ("$object", "$dataclass", "$namedtuple") and isinstance(body, dict):
            doc = body.get("fields")
        elif tag == "$tuple":
            doc = body
        elif tag in ("$mapping", "$dict"):
            pairs = body.get("items") if tag == "$mapping" and isinstance(body, dict) else body
            doc = {k: v for k, v in pairs if isinstance(k, str)} if isinstance(pairs, list) and all(
                isinstance(p, list) and len(p) == 2 for p in pairs) else None
    if isinstance(doc, list):
        return doc[int(key)] if key.isdigit() and int(key) < len(doc) else None
    return doc.get(key) if isinstance(doc, dict) else None


def _forward_only(step: Step) -> bool:
    """Whether a forward step ran under a torch.func transform with grad enabled: gradients were likely
    taken through it (by the transform, or by a backward pass after a vmap), and the recorder, which
    records such a step forward only, holds none of them."""
    return step.phase == "forward" and step.settings.get("grad_enabled") is not False and \
        any(transforms.NOTE in n for n in step.extra.get("notes", []) if isinstance(n, str))


def _finite_gradient_text(rec: Recording, source: Step, r: TensorRecord, earlier: Step | None) -> str:
    """Of a parameter that came non-finite into ``source`` and was finite at ``earlier``: where the backward
    calls of the step in between recorded its gradient, all finite, say so. The update did not pass on a
    non-finite gradient then: it made the NaN/Inf itself (a learning rate, eps = 0 with a zero gradient), or
    code between the backward and the update changed the gradient (clipping by a norm that another parameter's
    gradient made NaN): the user looks there, not at the backward pass."""
    if r.role != "param" or earlier is None:
        return ""
    table = rec.steps
    index = table.column("index")
    same = np.flatnonzero((table.column("name") == source.name) & (table.column("module_path") == source.module_path)
                          & (table.column("phase") == layout.PHASES.index("backward"))
                          & (index > earlier.index) & (index < source.index)
                          & (rec._object_numbers == rec._object_numbers[source.index]))
    grads = [(back, g) for back in (rec.step(int(k)) for k in same[-100:]) for g in back.records
             if g.role == "param_grad" and g.name == r.name]
    if not grads or any(g.nonfinite for _, g in grads):
        return ""
    return (f"; its gradient was finite as {describe(grads[-1][0])} left it: the {'NaN' if r.stats['nan'] else 'Inf'} "
            "was made after that backward, by the update itself (its learning rate, eps = 0 on a zero gradient), by "
            "code that changed the gradient (clipping by a norm another gradient made non-finite) or by code that "
            "wrote the parameter")


def _last_finite_step(rec: Recording, step: Step, role: str, name: str) -> Step | None:
    """The last earlier call of the same step (name, module path, module object: not a student's call for its EMA
    teacher's tensor) that saw that tensor finite. The steps searched are
    those that hold such a record: backward steps for grad outputs, grad inputs and parameter grads
    (a forward step never holds one), forward steps for the rest. An input or a grad output is each
    call's own: another call of the same iteration saw another tensor, so only earlier iterations count;
    a parameter or buffer is the same tensor at every call, and an earlier call of the iteration counts."""
    phase = "backward" if role in ("grad_output", *layout.GRAD_ROLES) else "forward"
    table = rec.steps
    before = (table.column("iteration") < step.iteration if role in ("input", "grad_output")
              else table.column("index") < step.index)
    same = np.flatnonzero((table.column("name") == step.name) & (table.column("module_path") == step.module_path)
                          & (table.column("phase") == layout.PHASES.index(phase)) & before
                          & (rec._object_numbers == rec._object_numbers[step.index]))
    for k in same[::-1][:1000]:
        earlier = rec.step(int(k))
        for r in earlier.records:
            if r.role == role and r.name == name and not r.nonfinite:
                return earlier
    return None


# -- conditions over statistics ---------------------------------------------------------------------
_OPS: dict[str, Callable[[Any, Any], Any]] = {">": operator.gt, ">=": operator.ge, "<": operator.lt,
                                              "<=": operator.le, "==": operator.eq, "!=": operator.ne}
# (a word's colons: record names such as after:args.0 and args.0:grad)
_TOKEN = re.compile(r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan))(?![\w.])"
                    r"|(?P<op>>=|<=|==|!=|>|<)|(?P<paren>[()])|(?P<word>[A-Za-z_][\w.:]*))")


class ConditionError(PdbgError, ValueError):
    """A --when condition that does not parse."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ConditionError(f"cannot read the condition {text!r} at {text[pos:]!r}; write e.g. "
                                 "'output.absmax > 1e3 and grad_input.0.nan == 0'")
        kind = m.lastgroup or ""
        value = m.group(kind)
        if kind == "word" and value in ("and", "or", "not"):
            kind = value
        out.append((kind, value))
        pos = m.end()
    return out


class Condition:
    """A condition over a step's tensor statistics, evaluated for every step at once.

    Grammar: ``atom (and|or) atom``, ``not atom``, parentheses; an atom is ``OPERAND OP NUMBER``
    where OPERAND is ``ROLE[.NAME].STAT`` (``output.absmax``, ``output.0.max``, ``grad_input.0.nan``,
    ``param.fc.weight.norm``) or ``NAME.STAT`` for a record name in any role (``attention_weights.max``).
    ROLE is one of input, output, param, buffer, grad_output, grad_input, param_grad, network_grad, watch; NAME a
    record name (``after:args.0``, ``args.0:grad``: the colon is part of the name) or, for roles other than
    output, the position among that role's records; STAT one of min, max, mean, std, absmax, norm, nan, inf (a
    complex tensor's: of its magnitudes |z|, as recorded). An atom holds for a step when any tensor it names
    does; ``output[.NAME].nan`` and ``.inf`` also hold by the numbers a step returned that are no tensors
    (``_TensorView.numbers``).
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self._tokens = _tokens(text)
        self._pos = 0
        self.tree = self._or()
        if self._pos != len(self._tokens):
            raise ConditionError(f"unexpected {self._tokens[self._pos][1]!r} in the condition {text!r}")

    # recursive descent: or -> and -> not -> atom
    def _peek(self) -> str | None:
        return self._tokens[self._pos][0] if self._pos < len(self._tokens) else None

    def _take(self, kind: str) -> str:
        if self._peek() != kind:
            got = repr(self._tokens[self._pos][1]) if self._pos < len(self._tokens) else "the end"
            wanted = {"num": "a number", "op": "a comparison (> >= < <= == !=)", "word": "ROLE[.NAME].STAT",
                      "paren": "a parenthesis"}[kind]
            raise ConditionError(f"expected {wanted} but found {got} in the condition {self.text!r}")
        value = self._tokens[self._pos][1]
        self._pos += 1
        return value

    def _or(self) -> Any:
        node = self._and()
        while self._peek() == "or":
            self._pos += 1
            node = ("or", node, self._and())
        return node

    def _and(self) -> Any:
        node = self._not()
        while self._peek() == "and":
            self._pos += 1
            node = ("and", node, self._not())
        return node

    def _not(self) -> Any:
        if self._peek() == "not":
            self._pos += 1
            return ("not", self._not())
        if self._peek() == "paren" and self._tokens[self._pos][1] == "(":
            self._pos += 1
            node = self._or()
            if self._take("paren") != ")":
                raise ConditionError(f"unbalanced parentheses in the condition {self.text!r}")
            return node
        operand = self._take("word")
        op = self._take("op")
        number = float(self._take("num"))
        return ("atom", *_operand(operand, self.text), op, number)

    def evaluate(self, rec: Recording) -> np.ndarray:
        """One boolean per step. A ConditionError where an operand names a tensor no step of the recording
        has: a misspelt name would otherwise read as a search that found nothing."""
        view = _TensorView(rec)
        self._check_names(self.tree, view)
        return self._eval(self.tree, view)

    def _check_names(self, node: Any, view: _TensorView) -> None:
        if node[0] in ("and", "or", "not"):
            for child in node[1:]:
                self._check_names(child, view)
            return
        _, role, name, stat, _, _ = node
        if name is None or len(view.rows(role, name)):
            return
        if role == "output" and stat in ("nan", "inf") and {name, f"output.{name}"} & set(view.numbers()[1]):
            return
        known = sorted(set(view.names[view.roles == layout.ROLES.index(role)] if role else view.names))
        listed = ", ".join(known[:12]) + (f", ... ({len(known) - 12} more)" if len(known) > 12 else "")
        what = f"{role} tensor {name!r}" if role else f"tensor {name!r}"
        raise ConditionError(f"the condition {self.text!r} names the {what}, which no step of {view.rec.path} "
                             f"has; {'names there: ' + listed if listed else 'it has none'} (ROLE[.NAME].STAT, "
                             "e.g. output.absmax)")

    def _eval(self, node: Any, view: _TensorView) -> np.ndarray:
        kind = node[0]
        if kind == "and":
            return self._eval(node[1], view) & self._eval(node[2], view)
        if kind == "or":
            return self._eval(node[1], view) | self._eval(node[2], view)
        if kind == "not":
            return ~self._eval(node[1], view)
        _, role, name, stat, op, number = node
        rows = view.rows(role, name)
        values = view.stats[rows, layout.STAT_NAMES.index(stat)]
        with np.errstate(invalid="ignore"):
            hit = _OPS[op](values, number)
        out = np.zeros(view.n, dtype=bool)
        out[view.steps[rows[hit]]] = True
        if role == "output" and stat in ("nan", "inf"):  # and the numbers it returned that are no tensors
            steps, names, counts = view.numbers()
            picked = np.ones(len(names), dtype=bool) if name is None else (names == name) | (names == f"output.{name}")
            hit = _OPS[op](counts[:, 1 if stat == "inf" else 0], number) & picked
            out[steps[hit]] = True
        return out


def _operand(text: str, condition: str) -> tuple[str | None, str | None, str]:
    parts = text.split(".")
    stat = parts[-1]
    if stat not in layout.STAT_NAMES or len(parts) < 2:
        raise ConditionError(f"{text!r} in {condition!r} must end in a statistic: one of "
                             f"{', '.join(layout.STAT_NAMES)}")
    head = parts[:-1]
    if head[0] in layout.ROLES:
        return head[0], ".".join(head[1:]) or None, stat
    return None, ".".join(head), stat


class _TensorView:
    """The tensor table's step, role, name and statistics columns, for conditions."""

    def __init__(self, rec: Recording) -> None:
        rank = rec.rank
        self.n = len(rec)
        empty = not rank.lengths.get("tensors")
        self.steps = np.zeros(0, np.int64) if empty else np.asarray(rank.column("tensors/step"))
        self.roles = np.zeros(0, np.int8) if empty else np.asarray(rank.column("tensors/role"))
        self.stats = np.zeros((0, 8)) if empty else np.asarray(rank.column("tensors/stats"))
        ids = np.zeros(0, np.int64) if empty else np.asarray(rank.column("tensors/name"))
        uniq, inverse = np.unique(ids, return_inverse=True)
        self.names = np.array([rank.doc(int(i)) for i in uniq], dtype=object)[inverse.reshape(-1)] \
            if len(ids) else np.zeros(0, dtype=object)
        self.rec = rec
        self._numbers: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def numbers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The numbers forward steps returned that are no tensors and hold NaN/Inf (the float a learning-rate
        schedule returns, a numpy array), which the tensor index has no row of: per value its step, its path
        ("output", "output.1") and its NaN and Inf counts. Looked up for the steps whose flags say a result went
        non-finite (or NaN) where their result tensors hold none, from those steps' output documents: a column read
        and ~0.1 s of array work on a million steps, ~30 us a step looked up."""
        if self._numbers is None:
            steps, names, counts = [], [], []
            flags = step_flags(self.rec)
            # (a result role of either phase: a backward step, whose results are gradients, has no such numbers)
            result = np.isin(self.roles, list(layout.RESULT_ROLES[0] | layout.RESULT_ROLES[1]))
            seen = np.zeros(self.n, dtype=bool)
            seen[self.steps[result & ((self.stats[:, 6] + self.stats[:, 7]) > 0)]] = True
            nan_seen = np.zeros(self.n, dtype=bool)
            nan_seen[self.steps[result & (self.stats[:, 6] > 0)]] = True
            flagged = (((flags & _RESULT) != 0) & ~seen) | (((flags & layout.NAN_RESULT) != 0) & ~nan_seen)
            for index in np.flatnonzero(flagged):
                for value in _values(self.rec.step(int(index)), "output"):
                    steps.append(int(index))
                    names.append(value.path)
                    counts.append((value.nan, value.inf))
            self._numbers = (np.asarray(steps, dtype=np.int64), np.asarray(names, dtype=object),
                             np.asarray(counts, dtype=np.float64).reshape(-1, 2))
        return self._numbers

    def rows(self, role: str | None, name: str | None) -> np.ndarray:
        if role is None:
            return np.flatnonzero(self.names == name)
        mask = self.roles == layout.ROLES.index(role)
        if name is None:
            return np.flatnonzero(mask)
        exact = mask & ((self.names == name) | ((self.names == f"output.{name}") if role == "output" else False))
        if exact.any() or not name.isdigit():
            return np.flatnonzero(exact)
        idx = np.flatnonzero(mask)  # NAME as a position among the step's records of that role
        steps = self.steps[idx]
        starts = np.r_[0, np.flatnonzero(np.diff(steps)) + 1] if len(idx) else np.zeros(0, np.int64)
        ordinal = np.arange(len(idx)) - np.repeat(starts, np.diff(np.r_[starts, len(idx)]))
        return idx[ordinal == int(name)]


def find(rec: Recording | str | os.PathLike[str], where: str | None, when: str | None, start: int | Step | None = None,
         backward: bool = False) -> Step | None:
    """The next (or, with ``backward``, the previous) step after ``start`` that matches the selector
    ``where`` (None: any) and the condition ``when`` over its statistics (None: any), from the index
    alone. ``start`` None: from the beginning (from the end with ``backward``); there a selector alone
    finds the step it names, as ``rec.step``, ``replay`` and the TUI's ``:`` take it (of backward steps,
    the backward of the first call, though a later call's runs first), and with a condition the first
    matching step in the order the steps began. A selector that names no step of the recording raises
    StepNotFoundError (saying what it has), as ``rec.step`` does; so does a ``start`` that is no step of
    ``rec``. ``rec``: a Recording or its path."""
    rec = opened(rec)
    first = rec.step(start).index if start is not None else None
    n = len(rec)
    mask = np.ones(n, dtype=bool)
    if where is not None:  # an empty selector or condition is refused, not taken for "any"
        mask[:] = False
        found = rec.steps.select(where)
        # an index ("0"), or a selector that names no step (misspelt, an iteration it lacks): rec.step raises for
        # the latter, saying what the recording or that step has
        named = rec.step(where) if not len(found) else None
        if when is None and start is None and not backward:
            return named if named is not None else rec._picked(found)
        mask[found.rows if named is None else named.index] = True
    if when is not None:
        mask &= Condition(when).evaluate(rec)
    if backward:
        hits = np.flatnonzero(mask[:first] if first is not None else mask)
        return rec.step(int(hits[-1])) if len(hits) else None
    offset = first + 1 if first is not None else 0
    hits = np.flatnonzero(mask[offset:])
    return rec.step(int(hits[0]) + offset) if len(hits) else None


# -- two runs ---------------------------------------------------------------------------------------
@dataclass
class Divergence:
    """The answer of :func:`first_divergence`."""

    step: Step | None  # in run A: the root cause (same inputs, different results), innermost
    other: Step | None  # the same step in run B (of the root cause; where there is none, of first_difference)
    cause: str
    first_difference: Step | None = None  # the first aligned step whose results differ at all
    followed: list[Step] = field(default_factory=list)  # the first SPREAD steps after it that differ only
    # because their inputs or parameters did
    compared: int = 0
    # Where the runs first differ by a step one ran and the other did not (an expert called in one only): that
    # step, of run B where unpaired_other (first_difference is then run A's step after the place it ran at)
    unpaired: Step | None = None
    unpaired_other: bool = False
    # Where every pair matched: how many of them only by statistics (either run kept none of a tensor's bytes)
    by_statistics: int = 0
    # How far the results of the step named (the root cause, else first_difference) are from the other run's, this
    # run's taken as the reference: those both runs kept the bytes of, of one dtype and shape, with no NaN or Inf
    # that differ (the cause names those)
    distances: list[Diff] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """``pdbg bisect --against --json``: {"divergence", "cause", "other", "first_difference",
        "followed", "compared", "by_statistics", "unpaired", "distances"} (README, "Command line")."""
        unpaired = None if self.unpaired is None else \
            {**self.unpaired.to_json(), "run": "other" if self.unpaired_other else "this"}
        return {"divergence": self.step.to_json() if self.step else None, "cause": self.cause,
                "other": self.other.to_json() if self.other else None,
                "first_difference": self.first_difference.to_json() if self.first_difference else None,
                "followed": [s.to_json() for s in self.followed[:SPREAD]], "compared": self.compared,
                "by_statistics": self.by_statistics, "unpaired": unpaired,
                "distances": [{k: d.to_json()[k] for k in ("name", "role", "mismatched", "max_abs_diff",
                                                            "max_rel_diff", "max_ulp")} for d in self.distances]}

    def __repr__(self) -> str:
        return printable(f"<Divergence: {self.cause}>")

    def _repr_html_(self) -> str:
        from . import notebook

        return notebook.divergence(self)


_COMPONENT = layout.ROLES.index("component")
# Those whose sparse tensors keep their parts (1.19; the gradients since 1.24)
_SPARSE_ROLES = ("input", "output", "param", "buffer", "grad_output", *layout.GRAD_ROLES)


class _Print:
    """A tensor record's fingerprint: its dtype and shape, its payload's hash when its bytes were
    kept (of a sparse tensor whose parts were kept, its layout, whether coalesced and its parts' hashes),
    and a hash of its statistics (always). Two are equal when their dtypes and shapes are, and then by
    their payloads when both have one, else by statistics: a run recorded in stats mode, or in flight mode
    outside its ring, against one that kept bytes (``exact_with`` says which)."""

    __slots__ = ("content", "stats", "kind")

    def __init__(self, content: tuple[Any, ...] | None, stats: tuple[int, int], kind: tuple[str, tuple[int, ...]]
                 ) -> None:
        self.content, self.stats, self.kind = content, stats, kind

    def exact_with(self, other: _Print) -> bool:
        """Whether a comparison with ``other`` is by bytes, not by statistics."""
        return self.content is not None and other.content is not None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Print):
            return NotImplemented
        if self.kind != other.kind:
            return False
        if self.exact_with(other):
            return self.content == other.content
        return self.stats == other.stats

    __hash__ = None  # type: ignore[assignment]  # (equal ones need not hash alike)


class _Prints:
    """Per tensor record of one run: its fingerprint (``_Print``)."""

    def __init__(self, rec: Recording) -> None:
        rank = rec.rank
        self.rec = rec
        self.start = _column(rec, "tensor_start")
        self.count = _column(rec, "tensor_count")
        empty = not rank.lengths.get("tensors")
        self.view = _TensorView(rec)
        self._data: dict[int, str] = {}  # per output document: its text as compared (``data``)
        if empty:
            self.content = self.stats = np.zeros((0, 2), dtype=np.uint64)
            self.exact = np.zeros(0, dtype=bool)
            return
        payload = rank.payload_column()
        self.exact = payload >= 0
        self.content = np.zeros((len(payload), 2), dtype=np.uint64)
        if rank.lengths.get("payloads"):
            hashes = np.asarray(rank.column("payloads/hash"))
            self.content[self.exact] = hashes[payload[self.exact]]
        stats = np.ascontiguousarray(self.view.stats).view(np.uint64)
        primes = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5,
                           0x94D049BB133111EB, 0xBF58476D1CE4E5B9, 0xD6E8FEB86659FD93, 0xA0761D6478BD642F],
                          dtype=np.uint64)
        self.stats = np.zeros((len(payload), 2), dtype=np.uint64)
        with np.errstate(over="ignore"):
            self.stats[:, 0] = np.bitwise_xor.reduce(stats * primes, axis=1)
            self.stats[:, 1] = np.bitwise_xor.reduce(stats * primes[::-1], axis=1)

    def by_statistics(self) -> np.ndarray:
        """Per step, whether a tensor record of it kept statistics only (stats mode, flight mode outside its
        ring, a payload dropped when the recorder fell behind): a comparison of it is by those statistics, which
        cannot tell a reordered batch apart, not by bytes."""
        n = len(self.start)
        steps = np.asarray(self.view.steps, np.int64)
        if len(steps) != len(self.exact):
            return np.zeros(n, bool)
        loose = steps[~self.exact]
        return np.bincount(loose[(loose >= 0) & (loose < n)], minlength=n)[:n] > 0

    def of(self, index: int) -> dict[tuple[str, str], _Print]:
        a, b = int(self.start[index]), int(self.start[index]) + int(self.count[index])
        records = self.rec.rank.tensor_records(index) if b > a else []
        prints = {(layout.role_name(int(r)), str(nm)): _Print((int(c[0]), int(c[1])) if exact else None,
                                                          (int(p[0]), int(p[1])), (rec.dtype, rec.shape))
                  for r, nm, c, p, exact, rec in zip(self.view.roles[a:b], self.view.names[a:b], self.content[a:b],
                                                     self.stats[a:b], self.exact[a:b], records)}
        if (self.view.roles[a:b] == _COMPONENT).any():  # (1.19) a sparse tensor whose parts were kept: by their bytes
            for r in records:
                parts = self.rec.rank.sparse_parts(r) if r.role in _SPARSE_ROLES else None
                if parts is not None:
                    prints[(r.role, r.name)].content = (parts.layout, parts.coalesced, *(
                        prints[("component", p.name)].content for p in parts.records.values()))
        return prints

    def data(self, step: Step) -> str:
        """A forward step's output document as compared between runs: its non-tensor values (a numpy
        array, a float a step returns), which no tensor record holds, with tensors by record name
        (compared as records); an address in the repr of a value not recorded as data masked (a default
        repr differs between runs of the same code)."""
        return self._data_text(int(step._col("output")))

    def _data_text(self, doc_id: int) -> str:
        if doc_id not in self._data:
            text = json.dumps(self.rec.rank.doc(doc_id), sort_keys=True)
            if '"$opaque"' in text:
                text = json.dumps(_masked(self.rec.rank.doc(doc_id)), sort_keys=True)
            self._data[doc_id] = text
        return self._data[doc_id]

    def result_keys(self, codes: dict[Any, int]) -> tuple[np.ndarray, np.ndarray]:
        """Per step, a key of what ``_parts`` compares as its results, from whole columns: steps whose keys are
        equal have equal results (their tensor records' role, name, dtype, shape, statistics and, where kept,
        payload hash, in order, and a forward step's output document), so only steps whose keys differ need
        their records read one by one. Steps with a sparse tensor's parts (compared by the parts' bytes) get a
        key of their own, never equal to another's. ``codes`` numbers texts alike for both runs.
        Returns (per step two uint64 words, per step whether it holds sparse parts)."""
        rec, n = self.rec, len(self.start)
        keys = np.zeros((n, 2), np.uint64)
        sparse = np.zeros(n, bool)
        phase = _column(rec, "phase").astype(np.int64)
        forward = np.flatnonzero(phase == 0)
        if len(forward):
            ids = _column(rec, "output")[forward].astype(np.int64)
            uniq, inverse = np.unique(ids, return_inverse=True)
            texts = np.array([codes.setdefault(("data", self._data_text(int(i))), len(codes)) for i in uniq],
                             dtype=np.uint64)
            keys[forward, 0] = texts[inverse.reshape(-1)]
        roles = self.view.roles.astype(np.int64)
        if not len(roles) or not n:
            return keys, sparse
        rank = rec.rank
        steps = self.view.steps.astype(np.int64)
        sparse[steps[roles == _COMPONENT]] = True
        result_roles = [np.isin(roles, [layout.ROLES.index(r) for r in _RESULTS[p]]) for p in layout.PHASES]
        row_phase = np.where((steps >= 0) & (steps < n), phase[np.clip(steps, 0, max(n - 1, 0))], -1)
        result = np.zeros(len(roles), bool)
        for number, mask in enumerate(result_roles):
            result |= mask & (row_phase == number)
        rows = np.flatnonzero(result)
        if not len(rows):
            return keys, sparse

        def coded(column: str, kind: str) -> np.ndarray:
            ids = np.asarray(rank.column(f"tensors/{column}"))[rows].astype(np.int64)
            uniq, inverse = np.unique(ids, return_inverse=True)
            out = np.array([codes.setdefault((kind, str(rank.doc(int(i)))), len(codes)) for i in uniq], np.uint64)
            return out[inverse.reshape(-1)]

        ndim = np.asarray(rank.column("tensors/ndim"))[rows].astype(np.int64)
        first = np.asarray(rank.column("tensors/dims_start"))[rows].astype(np.int64)
        shape = ndim.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        if ndim.sum():
            dims = np.asarray(rank.column("dims/values")).astype(np.int64)
            owner = np.repeat(np.arange(len(rows)), ndim)
            at = np.arange(len(owner)) - np.repeat(np.cumsum(ndim) - ndim, ndim)
            with np.errstate(over="ignore"):
                np.add.at(shape, owner, dims[first[owner] + at].astype(np.uint64) * _powers(at + 1))
        content = np.where(self.exact[rows, None], self.content[rows], np.uint64(0))
        words = np.stack([roles[rows].astype(np.uint64), coded("name", "name"), coded("dtype", "dtype"), shape,
                          self.stats[rows, 0], self.stats[rows, 1], content[:, 0], content[:, 1]], axis=1)
        place = rows - self.start[steps[rows]].astype(np.int64)  # (its place among its step's records)
        with np.errstate(over="ignore"):
            for word in range(2):
                mixed = np.bitwise_xor.reduce(words * _MIX[word], axis=1) * _powers(place + 2 + word)
                np.add.at(keys[:, word], steps[rows], mixed)
            counts = np.bincount(steps[rows], minlength=n).astype(np.uint64)
            keys[:, 1] ^= counts * np.uint64(0xD6E8FEB86659FD93)
        return keys, sparse


_MIX = (np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5,
                  0x94D049BB133111EB, 0xBF58476D1CE4E5B9, 0xD6E8FEB86659FD93, 0xA0761D6478BD642F], dtype=np.uint64),
        np.array([0xA0761D6478BD642F, 0xE7037ED1A0B428DB, 0x8EBC6AF09C88C6E3, 0x589965CC75374CC3,
                  0x1D8E4E27C47D124F, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x2545F4914F6CDD1D], dtype=np.uint64))


def _powers(exponents: np.ndarray) -> np.ndarray:
    """An odd multiplier per position (a different one for each), so that records in another order key otherwise."""
    with np.errstate(over="ignore"):
        return (exponents.astype(np.uint64) * np.uint64(0x9FB21C651E98DF25)) | np.uint64(1)


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def _masked(doc: Any) -> Any:
    """A tagged JSON document with the addresses in its ``$opaque`` reprs masked."""
    if isinstance(doc, dict):
        opaque = doc.get("$opaque")
        if isinstance(opaque, dict) and isinstance(opaque.get("repr"), str):
            return {**doc, "$opaque": {**opaque, "repr": _ADDRESS.sub("0x", opaque["repr"])}}
        return {k: _masked(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_masked(v) for v in doc]
    return doc


_ARGS = {"forward": ("input",), "backward": ("grad_output",)}
_PARAMS = ("param", "buffer")
_RESULTS = {"forward": ("output",), "backward": layout.GRAD_ROLES}


def _parts(p: _Prints, step: Step) -> tuple[dict[Any, Any], dict[Any, Any], dict[Any, Any]]:
    mine = p.of(step.index)
    args = {k: v for k, v in mine.items() if k[0] in _ARGS[step.phase]}
    params: dict[Any, Any] = {}
    if step.phase == "backward" and step.forward is not None:
        fwd = p.of(step.forward)
        args.update({("forward " + k[0], k[1]): v for k, v in fwd.items() if k[0] == "input"})
        params = {k: v for k, v in fwd.items() if k[0] in _PARAMS}
    else:
        params = {k: v for k, v in mine.items() if k[0] in _PARAMS}
    results = {k: v for k, v in mine.items() if k[0] in _RESULTS[step.phase]}
    if step.phase == "forward":
        results[_DATA] = p.data(step)
    return args, params, results


_DATA = ("output", "non-tensor output")  # a forward step's result that its output document alone holds (_Prints.data)


def _dense(values: np.ndarray) -> np.ndarray:
    return np.unique(values, return_inverse=True)[1].reshape(-1).astype(np.int64)


def _combined(keys: np.ndarray) -> np.ndarray:
    """Per row of ``keys`` (int64 columns), one number: the same for equal rows, another for other rows (the
    columns as digits of one number, renumbered densely where it would overflow; np.unique(axis=0) sorts
    rows several times slower)."""
    out = np.zeros(len(keys), np.int64)
    if not len(keys):
        return out
    bound = 1
    for column in np.ascontiguousarray(keys.T):
        digits = column - column.min()
        span = int(digits.max()) + 1
        if bound * span >= 1 << 62:
            out = _dense(out)
            bound = int(out.max()) + 1
            if bound * span >= 1 << 62:
                digits = _dense(column)
                span = int(digits.max()) + 1
        out = out * span + digits
        bound *= span
    return out


def _ranks(keys: np.ndarray) -> np.ndarray:
    """Per row of ``keys``, how many rows before it are the same."""
    group = _combined(keys)
    order = np.argsort(group, kind="stable")
    ordered = group[order]
    first = np.ones(len(group), bool)
    first[1:] = ordered[1:] != ordered[:-1]
    at = np.arange(len(group))
    out = np.empty(len(group), np.int64)
    out[order] = at - np.maximum.accumulate(np.where(first, at, 0))
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else str(value)


def _coded(rec: Recording, column: str, codes: dict[Any, int], value: Callable[[Any], Any]) -> np.ndarray:
    """Per step, a number for ``value`` of its document in ``column``, the same for the same value in
    either run (``codes`` is both runs'), from one document read per distinct one."""
    ids = np.asarray(rec.rank.column(f"steps/{column}"), dtype=np.int64)
    uniq, inverse = np.unique(ids, return_inverse=True)
    numbers = np.array([codes.setdefault(value(rec.rank.doc(int(i))), len(codes)) for i in uniq], dtype=np.int64)
    return numbers[inverse.reshape(-1)]


def _label_and_kind(definition: Any) -> tuple[Any, bool]:
    return paper_of(definition).get("label"), isinstance(definition, dict) and definition.get("kind") == "module"


# The columns of an alignment key (``_keys``); _LABEL numbers the paper label and whether the step is a module's.
_ITERATION, _PATH, _PHASE, _COUNT, _NAME, _LABEL, _OBJECT, _SEEN = range(8)
_PLACE = [_ITERATION, _PATH, _PHASE, _NAME, _LABEL, _OBJECT]  # a step's calls in an iteration: the key less its count
_KIND = _PLACE[1:]  # what a step is, in whatever iteration


def _keys(rec: Recording, codes: dict[str, dict[Any, int]], by_path: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per step, what aligns it with the other run's (a row: iteration, module path, phase, count, name,
    paper label with the step's kind, module object, and how many steps before it had all these), and
    whether it is a module's step. A module step counts the calls of its module path in the iteration (of
    its module object, where several ran there), a backward step its forward call's: the k-th call of one
    expert pairs with the other run's k-th whichever other experts ran (a call number counts the calls of
    every module of the step's name). A function step counts by its call number. Two steps of one name,
    each its own paper step, count their own calls, and the backward steps of one call from several passes
    (retain_graph, torch.autograd.grad then backward, a gradient penalty) align in their order, the k-th
    with the k-th. ``by_path`` False: module steps count by their call numbers too (a recording whose steps
    lack calls its recorder counted, whose calls at a module path cannot be counted from its steps)."""
    n = len(rec)
    keys = np.zeros((n, _SEEN + 1), np.int64)
    if not n:
        return keys, np.zeros(0, bool)
    keys[:, _ITERATION] = _column(rec, "iteration")
    keys[:, _PHASE] = _column(rec, "phase")
    keys[:, _PATH] = _coded(rec, "module_path", codes["path"], _text)
    keys[:, _NAME] = _coded(rec, "name", codes["name"], _text)
    keys[:, _LABEL] = _coded(rec, "definition", codes["definition"], _label_and_kind)
    kinds = np.zeros(len(codes["definition"]), bool)
    for (_, module_kind), number in codes["definition"].items():
        kinds[number] = module_kind
    module = kinds[keys[:, _LABEL]]
    keys[:, _OBJECT] = rec._object_numbers
    call = _column(rec, "call").astype(np.int64)
    keys[:, _COUNT] = call
    if by_path:
        count = np.full(n, -1, np.int64)
        forward = np.flatnonzero(module & (keys[:, _PHASE] == 0))
        count[forward] = _ranks(keys[forward][:, [_ITERATION, _PATH, _NAME, _LABEL, _OBJECT]])
        back = np.flatnonzero(module & (keys[:, _PHASE] == 1))
        source = _column(rec, "forward")[back].astype(np.int64)
        counted = count[np.where((source >= 0) & (source < n), source, 0)]
        keys[back, _COUNT] = np.where((source >= 0) & (source < n) & (counted >= 0), counted, -1 - call[back])
        keys[forward, _COUNT] = count[forward]
    keys[:, _SEEN] = _ranks(keys[:, :_SEEN])
    return keys, module


@dataclass
class _Aligned:
    """Two runs' steps paired by their keys (``_keys``): per step of each run, its step in the other, or -1."""

    rec_a: Recording
    rec_b: Recording
    keys_a: np.ndarray
    keys_b: np.ndarray
    module_a: np.ndarray
    module_b: np.ndarray
    a: np.ndarray  # per step of run A: its step in run B, or -1
    b: np.ndarray  # per step of run B: its step in run A, or -1
    maybe: np.ndarray | None = None  # per step of run A: whether its results may differ from its pair's (_may_differ)

    def side(self, other: bool) -> tuple[Recording, np.ndarray, np.ndarray, np.ndarray]:
        """Run A's (``other`` False) or run B's recording, keys, module flags and pairs."""
        return (self.rec_b, self.keys_b, self.module_b, self.b) if other else \
            (self.rec_a, self.keys_a, self.module_a, self.a)


def _may_differ(al: _Aligned, pa: _Prints, pb: _Prints) -> np.ndarray:
    """Per step of run A: whether its results may differ from those of its step in run B (False where it has
    none), from both runs' whole columns (``_Prints.result_keys``): the pairs whose results ``_parts`` would
    find equal are passed over without reading their records, which on a long run that agrees for most of its
    length is nearly every step."""
    if al.maybe is None:
        codes: dict[Any, int] = {}
        (keys_a, sparse_a), (keys_b, sparse_b) = pa.result_keys(codes), pb.result_keys(codes)
        maybe = np.zeros(len(al.a), bool)
        paired = np.flatnonzero(al.a >= 0)
        other = al.a[paired]
        maybe[paired] = (keys_a[paired] != keys_b[other]).any(axis=1) | sparse_a[paired] | sparse_b[other]
        al.maybe = maybe
    return al.maybe


def _one_step(rec: Recording) -> bool:
    """Whether a recording is a bundle of one step and those inside it, not of its whole iteration."""
    info = rec.bundle_info
    return info is not None and not info.get("iteration")


def _aligned(rec_a: Recording, rec_b: Recording) -> _Aligned:
    """Both runs' steps paired (``_keys``). Module steps count their calls at their module path where both
    runs' steps hold every call of their iterations: not in a recording before 1.10 that lacks calls its
    recorder counted, nor in a bundle of one step (its call 5 of a module is the only one it holds)."""
    codes: dict[str, dict[Any, int]] = {"path": {}, "name": {}, "definition": {}}
    by_path = not any(rec.rank.old_calls is not None or _one_step(rec) for rec in (rec_a, rec_b))
    (keys_a, module_a), (keys_b, module_b) = _keys(rec_a, codes, by_path), _keys(rec_b, codes, by_path)
    pairs_a, pairs_b = np.full(len(keys_a), -1, np.int64), np.full(len(keys_b), -1, np.int64)
    if len(keys_a) and len(keys_b):  # (a key is one run's once: its last column counts those before it)
        ids = _combined(np.concatenate([keys_a, keys_b]))
        ids_a, ids_b = ids[:len(keys_a)], ids[len(keys_a):]
        order = np.argsort(ids_b)
        at = np.minimum(np.searchsorted(ids_b[order], ids_a), len(ids_b) - 1)
        found = ids_b[order][at] == ids_a
        pairs_a[found] = order[at][found]
        pairs_b[pairs_a[found]] = np.flatnonzero(found)
    return _Aligned(rec_a, rec_b, keys_a, keys_b, module_a, module_b, pairs_a, pairs_b)


def first_divergence(rec_a: Recording | str | os.PathLike[str], rec_b: Recording | str | os.PathLike[str]
                     ) -> Divergence:
    """The first step where run B parts from run A for a reason of its own.

    Steps are aligned by (iteration, module path, phase, call, name, paper label), a module step's call
    counted at its module path (the k-th call of one expert pairs with the k-th, whichever other experts
    ran), the backward steps of one call from several passes in their order, and compared by payload hash
    (by statistics where either run kept only those). A step whose inputs were identical in both runs but
    whose results differ is a *root cause* (its parameters differ, or it computed differently); a
    later step that only received different inputs, or different parameters (the optimizer stepped
    after it), *followed*. The root cause reported is the first in run A's execution order, the
    innermost where steps nest. Where the first step whose results differ got different inputs, they
    came from outside every recorded step (the data, code between steps), and there is no root cause
    among the steps: later ones whose parameters differ only follow it (the optimizer stepped with
    other gradients). Where one run starts at a later iteration (a segment resumed from a checkpoint), the
    other run's steps before it say nothing of where those inputs came from: the cause says which of the
    step's inputs differ instead (``_started_later``). A step one run ran and the other did not
    (an expert called in one run only), before all these and among the steps both runs recorded, is
    where they first differ (``Divergence.unpaired``). Each run is a Recording or its path.
    """
    rec_a, rec_b = opened(rec_a), opened(rec_b)
    al = _aligned(rec_a, rec_b)
    common = int(np.count_nonzero(al.a >= 0))
    counted = _counted_otherwise(rec_a, rec_b) if common < max(len(al.a), len(al.b)) else ""
    if not common:
        raise RecordingError(_nothing_in_common(al.keys_a, al.keys_b, counted))
    pa, pb = _Prints(rec_a), _Prints(rec_b)
    root: dict[int, str] = {}
    result = Divergence(None, None, "", compared=common)
    paired = np.flatnonzero(al.a >= 0)
    at: tuple[int, int] | None = None  # the first pair whose results differ
    parts: tuple[Any, ...] = ()
    for k in np.flatnonzero(_may_differ(al, pa, pb)[paired]).tolist():  # (k: the pair's place among the pairs)
        i = int(paired[k])
        j = int(al.a[i])
        parts = (_parts(pa, rec_a.step(i)), _parts(pb, rec_b.step(j)))
        if parts[0][2] != parts[1][2]:
            at = (i, j)
            break
    else:
        k = len(paired)
    last = (int(paired[k - 1]), int(al.a[paired[k - 1]])) if k else (-1, -1)  # the last pair before ``at``
    inputs_differ = at is not None and parts[0][0] != parts[1][0]
    unseen: list[str] = []  # sparse inputs the same by their statistics, where the results first differ
    alone = _first_unpaired(al, at, last if inputs_differ else None)
    if alone is not None:
        return _ran_alone(al, result, alone, at, pa, pb, counted)
    outside = ""
    if at is not None:
        sa, sb = rec_a.step(at[0]), rec_b.step(at[1])
        result.first_difference, result.other = sa, sb
        if inputs_differ:
            # The first difference came in from outside every recorded step (a batch, code between
            # steps), or from steps one run has and the other lacks: later steps whose parameters
            # differ only follow it (the optimizer stepped with other gradients).
            outside = _unaligned(al, last, at) or _offset(al.keys_a, al.keys_b, at, pa, pb) or \
                _started_later(al, last, at, parts)
        else:
            # (sparse inputs the same by statistics, and the same parameters: not a root cause, what differs may
            # be their indices, which were not recorded)
            unseen = _sparse_by_statistics(sa, parts[0], parts[1]) if parts[0][1] == parts[1][1] else []
            if not unseen:
                result.step, result.other = sa, sb
                root[at[0]] = _why(sa, sb, parts[0], parts[1], first=True, al=al)
    if result.step is None:
        if result.first_difference is None:
            only_a, only_b = len(al.a) - common, len(al.b) - common
            apart = "; ".join(f"{n} step{'s' if n != 1 else ''} only in {which}"
                              for n, which in ((only_a, "this run"), (only_b, "the other")) if n)
            result.cause = (f"no divergence: the {common} step{'s' if common != 1 else ''} the runs have in common "
                            f"match" + (f" ({apart}: {_why_apart(rec_a, rec_b)})" if apart else "")
                            + _loosely(al, pa, pb, result) + _live(rec_a, rec_b) + counted)
        else:
            result.cause = _sparse_cause(result.first_difference, unseen) + counted if unseen else (
                f"the results first differ at {describe(result.first_difference)}, but its inputs differ too: "
                f"{outside or 'they came from outside every recorded step' + _params_too(parts)}"
                + _told(sa, sb, _differing(parts[0][0], parts[1][0]) | _differing(parts[0][1], parts[1][1]))
                + counted)
            result.followed = _followers(al, result.first_difference.index, pa, pb)
            result.distances = _distances(result.first_difference, result.other)
        return result
    index = result.step.index
    descended = True
    while descended:  # the innermost root cause: the first one inside it, and so on down
        descended = False
        for k in subtree(rec_a, index):
            j = int(al.a[k])
            if j < 0:
                continue
            sa, sb = rec_a.step(k), rec_b.step(j)
            args_a, params_a, res_a = _parts(pa, sa)
            args_b, params_b, res_b = _parts(pb, sb)
            if res_a != res_b and args_a == args_b and not _not_its_own(al, sa, sb) and (
                    params_a != params_b or not _sparse_by_statistics(sa, (args_a, params_a), (args_b, params_b))):
                result.step, result.other = sa, sb
                root[k] = _why(sa, sb, (args_a, params_a, res_a), (args_b, params_b, res_b), first=True,
                             al=al)
                index, descended = k, True
                break
    result.cause = f"{describe(result.step)}: {root[index]}{_inside(al, result.step, result.other)}"
    result.followed = _followers(al, result.first_difference.index, pa, pb)
    result.distances = _distances(result.step, result.other)
    return result


def _distances(sa: Step, sb: Step | None) -> list[Diff]:
    """How far each result of run B's step ``sb`` is from run A's ``sa`` (``Divergence.distances``): of those both
    runs kept the bytes of, alike in dtype and shape and in NaN and Inf, that differ. Where a payload cannot be read
    (damaged) that result is left out: the distances add to the answer, which the bytes of no other step decide."""
    if sb is None:
        return []
    out = []
    for ra in sa.records:
        rb = _record_of(sb, (ra.role, ra.name)) if ra.role in _RESULTS[sa.phase] else None
        if rb is None or not (ra.has_payload and rb.has_payload) or (ra.dtype, ra.shape) != (rb.dtype, rb.shape) \
                or (ra.stats["nan"], ra.stats["inf"]) != (rb.stats["nan"], rb.stats["inf"]):
            continue
        try:
            ta, tb = sa.rec.rank.tensor(ra), sb.rec.rank.tensor(rb)
        except (RecordingError, OSError, ValueError):
            continue
        if not isinstance(ta, torch.Tensor) or not isinstance(tb, torch.Tensor) or ta.is_sparse or tb.is_sparse:
            continue
        d = compare(_label((ra.role, ra.name)), ra.role, ta, tb)
        if d.measured and not d.match:
            out.append(d)
    return out


def _why_apart(rec_a: Recording, rec_b: Recording) -> str:
    """Why steps of a run that matched the other's have no pair there: a bundle of one step holds no more."""
    if _one_step(rec_a) or _one_step(rec_b):
        return f"{'this run' if _one_step(rec_a) else 'the other'} is a bundle of one step, which holds no other"
    return "a run longer than the other, or steps recorded in one only"


def _live(rec_a: Recording, rec_b: Recording) -> str:
    """Where a run was still being recorded when read: which, and that its later steps were not compared (a "no
    divergence" then holds so far only); "" where neither was."""
    live = [(which, rec) for which, rec in (("this run", rec_a), ("the other run", rec_b)) if rec.status == "recording"]
    return "".join(f"; {which} was still being recorded ({len(rec)} step{'s' if len(rec) != 1 else ''} when read): "
                   "the steps it records after were not compared" for which, rec in live)


def _loosely(al: _Aligned, pa: _Prints, pb: _Prints, result: Divergence) -> str:
    """Where every pair matched: how many of them matched by statistics only (either run kept no bytes of a
    tensor of the step), set as ``result.by_statistics``, and which run kept statistics only: said, or a
    "match" reads as bit for bit where tensors in another order match as well; "" where all matched by bytes."""
    paired = np.flatnonzero(al.a >= 0)
    loose_a, loose_b = pa.by_statistics()[paired], pb.by_statistics()[al.a[paired]]
    count = int(np.count_nonzero(loose_a | loose_b))
    result.by_statistics = count
    if not count:
        return ""
    who = "neither run kept" if loose_a.any() and loose_b.any() else \
        "this run did not keep" if loose_a.any() else "the other run did not keep"
    share = f"all {count}" if count == len(paired) else f"{count} of them"
    return (f"; {share} by statistics only: {who} the bytes of some of their tensors, and statistics cannot tell a "
            "reordered batch apart")


def _not_its_own(al: _Aligned, sa: Step, sb: Step) -> bool:
    """Whether two runs' steps paired inside a root cause cannot part for a reason of their own: their
    callers do not pair (a recursion of another shape in each run pairs its calls by number, a leaf with a
    subtree), or they got other non-tensor arguments from callers that got other ones too (what the
    caller derived from its own)."""
    if sa.parent is None or sb.parent is None:
        return False
    if int(al.a[sa.parent]) != sb.parent:
        return True
    return sa.arguments != sb.arguments and sa.rec.step(sa.parent).arguments != sb.rec.step(sb.parent).arguments


def _inside(al: _Aligned, sa: Step, sb: Step | None) -> str:
    """The steps inside a root cause that ran in one run only (the experts its router chose), named: its
    results differ by them too."""
    parts = []
    for rec, pairs, step, which in ((al.rec_a, al.a, sa, "this run"), (al.rec_b, al.b, sb, "the other")):
        if step is None:
            continue
        alone = [k for k in subtree(rec, step.index) if pairs[k] < 0]
        names = list(dict.fromkeys(rec.step(k).module_path or rec.step(k).name for k in alone))
        if alone:
            parts.append(f"{len(alone)} step{'s' if len(alone) != 1 else ''} ran in {which} only ({_names(names)})")
    return f"; inside it, {' and '.join(parts)}" if parts else ""


def _compared(al: _Aligned, other: bool) -> np.ndarray:
    """The steps of a run (``other``: run B's) that ran there only, among those both runs recorded: from the
    first iteration with a step of both to the run's last step that pairs. Those before (a run resumed
    from a checkpoint) and after it (a run longer than the other) are not; nor, against a bundle of one
    step and those inside it, any (it lacks the rest of its iteration); nor those of a step the other run
    never recorded at all, in any iteration (a module only one run's ``modules=`` chose: recorded in one
    only, which says nothing of what ran)."""
    _, keys, _, pairs = al.side(other)
    paired = np.flatnonzero(pairs >= 0)
    if _one_step(al.side(not other)[0]) or not len(paired):
        return np.zeros(0, np.int64)
    stop = int(paired[-1])
    steps = np.flatnonzero((pairs[:stop] < 0) & (keys[:stop, _ITERATION] >= keys[paired[0], _ITERATION]))
    steps = steps[~_before_start(al, other, steps)]
    return steps[_recorded_there(al, other, steps)]


def _before_start(al: _Aligned, other: bool, steps: np.ndarray) -> np.ndarray:
    """Per step of one run (``other``: run B's), whether it ran before the other run began, where that run
    starts at a later iteration (a segment resumed from a checkpoint, which never ran them where it was
    recorded): those of the iterations before its first, and those of its first iteration before the step
    its first step pairs with, where the segment begins its next iteration with steps of their kinds in that
    order (``_leads_next``), or, a segment of one iteration (its next ends before a step of its first step's
    kind: the update after its last optimizer step), where this run begins its iteration after the segment's
    first so. Work after the optimizer step (an EMA update) is numbered with the next iteration, so that
    of the checkpointed step is in the segment's first iteration, although it ran before the checkpoint was
    saved."""
    keys = al.side(other)[1]
    _, theirs, _, their_pairs = al.side(not other)
    start = _span(theirs)[0]
    before = keys[steps, _ITERATION] < start
    if start > _span(keys)[0] and len(their_pairs) and their_pairs[0] >= 0:
        lead = np.flatnonzero(keys[:int(their_pairs[0]), _ITERATION] == start)
        first = theirs[0, _KIND]
        leads = _leads_next(theirs, keys[lead], first) if len(lead) else False
        if leads is None:  # the segment ends before it says how it begins an iteration
            leads = _leads_next(keys[int(lead[0]):], keys[lead], first)
        if leads:
            before |= np.isin(steps, lead)
    return before


def _leads_next(keys: np.ndarray, lead: np.ndarray, first: np.ndarray) -> bool | None:
    """Whether a run (its alignment keys from a resumed segment's first iteration on: the segment's, or the
    uninterrupted run's) begins the iteration after it with steps of the kinds of ``lead`` (the uninterrupted
    run's keys), in their order, and then a step of the kind ``first`` (the segment's first step's): the
    steps that the segment lacks at its start only, which run at the start of every iteration. A run that
    ends after steps of those kinds only (the update after its last optimizer step) begins it so too; None
    where it ends before saying (no step of that iteration, or others than those)."""
    following = np.flatnonzero(keys[:, _ITERATION] == keys[0, _ITERATION] + 1)
    kinds = keys[following][:, _KIND]
    at = np.flatnonzero((kinds == first).all(axis=1))
    end = int(at[0]) if len(at) else len(kinds)
    if end != len(lead) or not (kinds[:end] == lead[:, _KIND]).all():
        return False if len(at) else None
    return True


def _recorded_there(al: _Aligned, other: bool, steps: np.ndarray) -> np.ndarray:
    """Per step of one run (``other``: run B's), whether the other run would have recorded it had it run
    there: a paper step's, or a module step at a path the other run's ``modules`` globs select. For a
    recording that does not list its globs (before 2026-12-06), whether the other run recorded a step of
    its name and paper label at all (the other run's experts, not a class only this run chose)."""
    rec, keys, module, _ = al.side(other)
    there = al.side(not other)[0]
    globs = there.run_info.get("modules")
    if isinstance(globs, list) and all(isinstance(g, str) for g in globs):
        try:
            patterns = autohooks.parse_globs(globs)
        except RecordingError:
            patterns = None
        if patterns is not None:
            labels = _column(rec, "definition")
            out = np.ones(len(steps), bool)
            chosen: dict[str, bool] = {}
            for n, k in enumerate(steps.tolist()):
                if not module[k] or paper_of(rec.rank.doc(int(labels[k]))).get("label") is not None:
                    continue  # a paper step is recorded wherever it runs
                path = rec.step(k).module_path
                if path not in chosen:
                    chosen[path] = any(autohooks.glob_matches(p, path) for p in patterns)
                out[n] = chosen[path]
            return out
    theirs = al.side(not other)[1]
    where = [_NAME, _LABEL]
    ids = _combined(np.concatenate([keys[steps][:, where], theirs[:, where]]))
    return np.isin(ids[:len(steps)], ids[len(steps):])


def _first_unpaired(al: _Aligned, at: tuple[int, int] | None, named: tuple[int, int] | None
                    ) -> tuple[bool, int, int] | None:
    """The first step one run ran and the other did not (``_compared``), before the first pair whose
    results differ (``at``; None: every pair matched), but not one the cause of ``at`` names (``named``:
    where its inputs differ, those after the last pair that matched): (whether it is run B's, its index,
    the step of run A at or after which it ran)."""
    found = []
    for other in (False, True):
        steps = _compared(al, other)
        if at is not None:
            steps = steps[steps < at[other]]
        if named is not None:
            steps = steps[steps < named[other]]
        if not len(steps):
            continue
        if not other:
            found.append((float(steps[0]), False, int(steps[0]), int(steps[0])))
            continue
        seen = np.maximum.accumulate(np.where(al.b >= 0, np.arange(len(al.b)), -1))[steps]  # the pair before
        after = np.where(seen >= 0, al.b[np.maximum(seen, 0)], -1)  # its step in run A, which it followed
        k = int(np.argmin(after))
        found.append((after[k] + 0.5, True, int(steps[k]), min(int(after[k]) + 1, len(al.a) - 1)))
    if not found:
        return None
    _, other, index, place = min(found)
    return other, index, place


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _ran_alone(al: _Aligned, result: Divergence, alone: tuple[bool, int, int], at: tuple[int, int] | None,
               pa: _Prints, pb: _Prints, counted: str) -> Divergence:
    """The answer where the runs first differ by a step one ran and the other did not: which, how often
    either ran it there, how many others ran in one run only, and the first aligned step whose results differ."""
    other, index, place = alone
    rec, keys, module, _ = al.side(other)
    step = rec.step(index)
    which, whose = ("the other run", "the other run's ") if other else ("this run", "")
    what = (step.module_path or step.name) + (f" ({step.object_text})" if step.object_text else "") \
        if module[index] else step.name + (f" (in {step.module_path})" if step.module_path else "")
    what = f"the backward of {what}" if step.phase == "backward" else what
    place_key = keys[index, _PLACE]
    mine = int(np.count_nonzero((keys[:, _PLACE] == place_key).all(axis=1)))
    theirs_keys = al.side(not other)[1]
    theirs = int(np.count_nonzero((theirs_keys[:, _PLACE] == place_key).all(axis=1)))
    iteration = int(keys[index, _ITERATION])
    if not theirs:
        ran = f"{what} ran in {which} only, in iteration {iteration}"
    elif mine != theirs:
        ran = (f"{what} ran {_times(mine)} in iteration {iteration} in {which}, {_times(theirs)} in "
               f"{'this run' if other else 'the other run'}")
    else:
        ran = f"{what} ran as call {step.call} of iteration {iteration} in {which} only"
    before = f", before this run's step {place}" if other else ""
    result.first_difference, result.unpaired, result.unpaired_other = al.rec_a.step(place), step, other
    paired = int(al.a[place]) if 0 <= place < len(al.a) else -1
    result.other = al.rec_b.step(paired) if paired >= 0 else None
    more = len(_compared(al, False)) + len(_compared(al, True)) - 1
    also = (f"; {more} more step{'s' if more != 1 else ''} of those both runs recorded ran in one only"
            if more > 0 else "")
    then = f"; of the steps both ran, the results first differ at {describe(al.rec_a.step(at[0]))}" if at else ""
    result.cause = (f"the runs first differ by a step that ran in one of them only: {ran} ({whose}{describe(step)}"
                    f"{before}){_held_nonfinite(step)}{also}{then}" + counted)
    result.followed = _followers(al, place, pa, pb)
    return result


def _held_nonfinite(step: Step) -> str:
    """"; its output held NaN/Inf: output (3 NaN of 3)" for a step one run alone ran whose results held NaN or Inf
    (a branch taken in one run only, its result a loss term or a log line): the first thing to look at; "" else."""
    held = _nonfinite_text(step, set(_RESULTS[step.phase]))
    if not held:
        return ""
    what = "output" if step.phase == "forward" else "gradients"
    return f"; its {what} held NaN/Inf: {', '.join(held[:3])}{' ...' if len(held) > 3 else ''}"


def _span(keys: np.ndarray) -> tuple[int, int]:
    """The first and last iteration of a recording's steps (from their alignment keys), as numbers."""
    return int(keys[:, _ITERATION].min()), int(keys[:, _ITERATION].max())


def _nothing_in_common(keys_a: np.ndarray, keys_b: np.ndarray, counted: str) -> str:
    """Why no step pairs: two recordings of iterations that do not overlap (two segments of one run, or one
    resumed run numbered from 0), or of different models."""
    (a0, a1), (b0, b1) = (_span(keys_a), _span(keys_b)) if len(keys_a) and len(keys_b) else ((0, 0), (0, 0))
    if a1 < b0 or b1 < a0:
        def span(lo: int, hi: int) -> str:
            return f"iteration {lo}" if lo == hi else f"iterations {lo}–{hi}"

        text = (f"the two recordings cover disjoint iterations (this run: {span(a0, a1)}; the other run: "
                f"{span(b0, b1)}), so no step is in both")
        rest = _combined(np.concatenate([keys_a[:, 1:], keys_b[:, 1:]]))
        if len(np.intersect1d(rest[:len(keys_a)], rest[len(keys_a):])):  # the same steps, at other iteration numbers
            return (text + "; compare runs that recorded the same iterations, or, where one was resumed from a "
                    "checkpoint and numbered its iterations from 0, record it with start_iteration set to the "
                    "checkpoint's step (pdbg record --start-iteration N) so that both number them alike")
        return text + "; nor do they share a step name: compare two runs of the same model"
    return ("the two recordings have no steps in common (same iteration, module path, phase, call and name)"
            f"{counted}; compare two runs of the same model")


_OFFSET_CANDIDATES = 4096  # steps of the other run whose inputs are compared with those of the first that differs


def _row(keys: np.ndarray, key: np.ndarray) -> int | None:
    """The step whose alignment key is ``key``, or None."""
    found = np.flatnonzero((keys == key).all(axis=1))
    return int(found[0]) if len(found) else None


def _offset(keys_a: np.ndarray, keys_b: np.ndarray, at: tuple[int, int], pa: _Prints, pb: _Prints) -> str:
    """Where the first step whose results differ got the inputs of the same step at a later iteration of
    the other run, and of no other iteration (an input that never changes says nothing), and so did the
    same step one iteration on: the runs number the same iterations differently (a run resumed from a
    checkpoint, recorded from iteration 0). What aligns them; "" when that is not it. Its parameters
    too: a resumed run whose batch order restarted gets the other run's earlier batches again, later
    in its own numbering, but trains on them from another state (and is numbered right)."""
    def inputs(p: _Prints, index: int) -> tuple[dict[Any, Any], dict[Any, Any]]:
        args, params, _ = _parts(p, p.rec.step(index))
        return args, params

    def shifted(key: np.ndarray, by: int) -> np.ndarray:
        out = key.copy()
        out[_ITERATION] += by
        return out

    sides = ((keys_a, pa, keys_b, pb, at[0], "this run", "the other run"),
             (keys_b, pb, keys_a, pa, at[1], "the other run", "this run"))
    for mine, p_mine, theirs, p_theirs, index, who, other in sides:
        key, wanted = mine[index], inputs(p_mine, index)
        iteration = int(key[_ITERATION])
        same = np.flatnonzero((theirs[:, 1:] == key[1:]).all(axis=1))[:_OFFSET_CANDIDATES]
        matches = [int(theirs[k, _ITERATION]) for k in same.tolist() if inputs(p_theirs, k) == wanted]
        if len(matches) != 1 or matches[0] <= iteration:
            continue
        found = matches[0]
        ahead = _row(mine, shifted(key, 1))
        later = _row(theirs, shifted(key, found - iteration + 1))
        if ahead is not None and (later is None or inputs(p_mine, ahead) != inputs(p_theirs, later)):
            continue  # one iteration alike by chance (a batch drawn twice), not a numbering
        first = _span(mine)[0]
        start = first + found - iteration
        return (f"{who}'s iteration {iteration} had the inputs of {other}'s iteration {found}: {who} numbers the same "
                f"iterations {found - iteration} lower (resumed from a checkpoint and recorded from iteration "
                f"{first}?); record it with start_iteration={start} (pdbg record --start-iteration {start}) to align "
                "them")
    return ""


def _counted_otherwise(rec_a: Recording, rec_b: Recording) -> str:
    """Why steps may not pair, where a run's call numbers count otherwise than the other's: a recording
    before 1.10 whose calls could not be counted anew (``RankReader.old_calls``); "" where they count alike."""
    olds = [rec_a.rank.old_calls, rec_b.rank.old_calls]
    if olds[0] is not None and olds[1] is not None and olds[0].split(" (")[0] == olds[1].split(" (")[0]:
        return ""
    for old, which in zip(olds, ("this run", "the other run")):
        if old is not None:
            return (f"; {which} numbers the calls of a step {old}, and its steps do not hold every call its "
                    "recorder counted, so they cannot be numbered anew: calls of one step in several places do not "
                    "pair; record it again with this version to compare them")
    return ""


def _followers(al: _Aligned, after: int, pa: _Prints, pb: _Prints) -> list[Step]:
    """The first SPREAD steps after ``after`` whose results differ because their inputs or parameters did
    (the first forward given the same batch after the optimizer stepped with other values: its parameters
    differ, its arguments do not)."""
    found: list[Step] = []
    for i in np.flatnonzero(_may_differ(al, pa, pb)).tolist():
        if i <= after:
            continue
        sa, sb = al.rec_a.step(i), al.rec_b.step(int(al.a[i]))
        args_a, params_a, res_a = _parts(pa, sa)
        args_b, params_b, res_b = _parts(pb, sb)
        if res_a != res_b and (args_a != args_b or params_a != params_b):
            found.append(sa)
            if len(found) == SPREAD:
                break
    return found


def _differing(a: dict[Any, Any], b: dict[Any, Any]) -> set[Any]:
    """The keys of two runs' fingerprints (``_parts``) whose records differ, or that one run lacks."""
    return {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def _params_too(parts: tuple[tuple[dict[Any, Any], ...], tuple[dict[Any, Any], ...]]) -> str:
    """Where a first difference's inputs differ: its parameters and buffers that differ as well (a learning rate
    changed between the runs, an optimizer update outside every step), "" for none."""
    (_, params_a, _), (_, params_b, _) = parts
    changed = _differing(params_a, params_b)
    said = []
    for role in _PARAMS:
        names = sorted({name for r, name in changed if r == role})
        if names:
            word = "parameter" if role == "param" else role
            said.append(f"{word}{'s' if len(names) > 1 else ''} {_names(names)}")
    if not said:
        return ""
    return f"; its {' and '.join(said)} differ{'s' if len(changed) == 1 else ''} too"


def _names(names: list[str], shown: int = 5) -> str:
    """The first names of a list, and how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _lacked(al: _Aligned, last: tuple[int, int], at: tuple[int, int], other: bool, before_start: bool) -> list[int]:
    """The steps of one run (``other``: run B's) between the aligned steps ``last`` and ``at`` that the
    other run lacks: those that ran before the other run began (``before_start``: a run resumed from a
    checkpoint, which never ran them where it was recorded: ``_before_start``) or the others."""
    pairs = al.side(other)[3]
    steps = np.flatnonzero(pairs[last[other] + 1: at[other]] < 0) + last[other] + 1
    return steps[_before_start(al, other, steps) == before_start].tolist()


def _unaligned(al: _Aligned, last: tuple[int, int], at: tuple[int, int]) -> str:
    """The steps one run has and the other lacks between the aligned steps ``last`` and ``at``
    (a step added to one run, or called once more): where inputs that differ may have come from. Not
    those of iterations before the other run's first: a resumed run lacks them by design
    (``_started_later``)."""
    only_a, only_b = _lacked(al, last, at, False, False), _lacked(al, last, at, True, False)
    parts = []
    for steps, rec, which, before, other in ((only_a, al.rec_a, "this run", "it", "the other run"),
                                             (only_b, al.rec_b, "the other run", f"its step {at[1]} (the same step)",
                                              "this run")):
        if steps:
            shown = "; ".join(describe(rec.step(k)) + _held_nonfinite(rec.step(k)).replace(";", ",", 1)
                              for k in steps[:3]) + (" ..." if len(steps) > 3 else "")
            parts.append(f"{which} has {len(steps)} step{'s' if len(steps) != 1 else ''} right before {before} that "
                         f"{other} lacks ({which}'s {shown})")
    return " and ".join(parts) + (", which may have made them" if parts else "")


def _started_later(al: _Aligned, last: tuple[int, int], at: tuple[int, int], parts: tuple[Any, ...]) -> str:
    """Where the first step whose results differ got other inputs in a run that starts at a later
    iteration than the other (resumed from a checkpoint), and the other run's steps before it are of
    its earlier iterations only: those are not missing, and say nothing. What of the step's inputs
    differs (its arguments, parameters, buffers, RNG state) and what is the same; "" where neither run
    starts later."""
    for other in (False, True):  # the run that starts earlier: whose steps the later one lacks
        lacked = _lacked(al, last, at, other, True)
        if lacked:
            break
    else:
        return ""
    sa, sb = al.rec_a.step(at[0]), al.rec_b.step(at[1])
    (args_a, params_a, _), (args_b, params_b, _) = parts
    late, early = ("this run", "the other run's") if other else ("the other run", "this run's")
    start = _span(al.side(not other)[1])[0]
    differ: list[str] = []
    same: list[str] = []

    def differs(what: str, names: list[str]) -> str:
        return f"its {what}{'s' if len(names) > 1 else ''} {_names(names)} differ{'s' if len(names) == 1 else ''}"

    names = sorted(_input_name(sa, k) for k in _differing(args_a, args_b))
    if names:
        differ.append(differs("argument", names))
    if sa.arguments != sb.arguments:
        differ.append("its non-tensor arguments differ")
    data = len(differ)  # (what differs so far is the data it was given; the rest, the state it resumed from)
    for role, what in (("param", "parameter"), ("buffer", "buffer")):
        keys = {k for k in set(params_a) | set(params_b) if k[0] == role}
        changed = sorted(k[1] for k in keys if params_a.get(k) != params_b.get(k))
        if changed:
            differ.append(differs(what, changed))
        elif keys:
            exact = all(k in params_a and k in params_b and params_a[k].exact_with(params_b[k]) for k in keys)
            same.append(f"{what}s {'bit-identical' if exact else 'the same by their statistics'}")
    rng_a, rng_b = _rng_bytes(sa), _rng_bytes(sb)
    generators = sorted(k for k in set(rng_a) | set(rng_b) if rng_a.get(k) != rng_b.get(k))
    if generators:
        differ.append(f"its RNG state at entry differs ({_names(generators)})")
    elif rng_a:
        same.append("RNG state at entry the same")
    why = ("it was given other data there (the resumed run's batch order restarted with its epoch, or a data "
           "loader state that was not restored?)" if len(differ) == data else
           "the state it resumed from is not the other's at that iteration (a checkpoint of another step, or one not "
           "fully restored?)")
    kept = f" ({', '.join(same)})" if same else ""
    what = ", ".join(differ) or "what differs in its inputs is not in the records compared"
    return (f"{what}{kept}: {late} resumed at iteration {start} "
            f"and lacks {early} {len(lacked)} step{'s' if len(lacked) != 1 else ''} before it by design, not by "
            f"skipping them; {why}")


def _input_name(step: Step, key: tuple[str, str]) -> str:
    """A step's tensor input as the call was written (``x``, ``kwargs['mask']``), from its record's
    (role, name): ``args.0`` of a module's forward is the parameter after self; a backward's grad outputs
    and its forward's arguments say so."""
    role, name = key
    path = tuple(int(p) if p.isdigit() else p for p in name.split("."))
    shown = _argument_name(step if role == "input" else _forward_of(step), path) or name
    return {"grad_output": f"grad_output {name}", "forward input": f"the forward's {shown}"}.get(role, shown)


def _label(key: tuple[str, str]) -> str:
    """A compared record as the cause names it: a gradient says whose."""
    role, name = key
    return f"the grad of {name}" if role in layout.GRAD_ROLES else name


def _sparse_by_statistics(step: Step, parts_a: tuple[dict[Any, Any], ...], parts_b: tuple[dict[Any, Any], ...],
                          ) -> list[str]:
    """The inputs, parameters and buffers of two runs' same step (``parts_*``: their fingerprints) that
    compared equal by the statistics of a sparse tensor's stored values alone, all the recorder keeps of
    one: their indices (a graph's edges, their direction) may differ unseen. Named as a cause names them."""
    fwd = step.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else None
    records: dict[tuple[str, str], TensorRecord] = {}
    for r in fwd.records if fwd is not None else ():
        records[(r.role, r.name)] = records[("forward " + r.role, r.name)] = r
    records.update({(r.role, r.name): r for r in step.records})
    found = []
    for ours, theirs in ((parts_a[0], parts_b[0]), (parts_a[1], parts_b[1])):
        for key, a in ours.items():
            b, r = theirs.get(key), records.get(key)
            if b is not None and r is not None and a == b and not a.exact_with(b) and step.rec.rank.sparse_of(r):
                what = {"input": "argument", "forward input": "forward's argument"}.get(key[0], key[0])
                found.append(f"{what} {key[1]}")
    return found


def _sparse_cause(step: Step, unseen: list[str]) -> str:
    """What ``first_divergence`` says of the first step whose results differ where the inputs that seem
    the same include sparse ones (``_sparse_by_statistics``)."""
    many = len(unseen) > 1
    return (f"the results first differ at {describe(step)}, whose sparse {_names(unseen)} "
            f"{'are' if many else 'is'} the same in both runs by the statistics of {'their' if many else 'its'} "
            f"stored values only (a sparse tensor's indices are not recorded): the difference likely came in "
            f"through {'them' if many else 'it'} (other indices: a transposed adjacency, edges in another "
            "direction), not from the step's own code; compare how each run builds it")


_LAID_OUT = ("input", "param", "buffer", "grad_output")  # a step's inputs, whose layout may steer its kernels


def _layouts_differ(sa: Step, sb: Step) -> list[str]:
    """The inputs, parameters, buffers and grad outputs of two runs' same step that have the same shape
    but other strides."""
    theirs = {(r.role, r.name): r for r in sb.records if r.role in _LAID_OUT}
    return sorted(r.name for r in sa.records if r.role in _LAID_OUT and (o := theirs.get((r.role, r.name))) is not None
                  and o.shape == r.shape and o.stride != r.stride)


_LOOK_BACK = 4096  # steps before a root cause whose parameters differ looked through for one given other arguments


def _given_other_arguments(al: _Aligned, sa: Step) -> str:
    """Where a root cause's parameters differ though no recorded step before it differed in its results: the first
    paired step since the module object's previous call (at most ``_LOOK_BACK`` steps back) whose non-tensor
    arguments differ between the runs, named as the likely cause. A soft target update ``soft_update(target,
    online, tau)`` given another tau returns nothing and takes its modules as objects that are not data: its
    results match, but the parameters it wrote do not, and the optimizer is not to blame. "" where none is."""
    rec_a, rec_b = al.rec_a, al.rec_b
    found: tuple[Step, Step] | None = None
    try:
        same = (sa.name, sa.module_path, sa.module_object)
        for k in range(sa.index - 1, max(-1, sa.index - 1 - _LOOK_BACK), -1):
            step = rec_a.step(k)
            if step.phase != "forward":
                continue
            if (step.name, step.module_path, step.module_object) == same:
                break  # (its previous call: the parameters were written after it)
            j = int(al.a[k])
            if j >= 0 and step.arguments != (other := rec_b.step(j)).arguments:
                found = (step, other)
    except (RecordingError, OSError, ValueError):  # (a damaged document: the answer is the cause without it)
        return ""
    if found is None:
        return ""
    step, other = found
    where, a, b = _first_difference(step.arguments, other.arguments)
    name = _argument_name(step, where)
    opaque = sorted({str(d["type"]) for d in _opaque_docs(step.arguments)})
    objects = (f" and {'objects' if len(opaque) > 1 else 'an object'} not recorded as data "
               f"({', '.join('a ' + t for t in opaque[:3])}), which it may have changed in place" if opaque else "")
    return (f"{describe(step)} was given another non-tensor argument{f' {name}' if name else ''} ({_short(a)} vs "
            f"{_short(b)}){objects}: the likely cause (what it returned matched; what it changed in place "
            "was not recorded)")


def _opaque_docs(doc: Any, depth: int = 0) -> list[dict[str, Any]]:
    """The placeholders (``$opaque``) of values not recorded as data inside an arguments document."""
    if depth > 16:
        return []
    if isinstance(doc, dict):
        if isinstance(doc.get("$opaque"), dict):
            return [doc["$opaque"]]
        return [o for v in doc.values() for o in _opaque_docs(v, depth + 1)]
    if isinstance(doc, list):
        return [o for v in doc for o in _opaque_docs(v, depth + 1)]
    return []


def _why(sa: Step, sb: Step, parts_a: tuple[dict[Any, Any], ...], parts_b: tuple[dict[Any, Any], ...],
         first: bool = False, al: _Aligned | None = None) -> str:
    """Why step ``sa`` of run A and ``sb`` of run B give different results from the same inputs:
    ``parts_*`` their (inputs, parameters, results) fingerprints; ``first``: no recorded step before
    them differed (``al``, the runs' pairing: where its parameters differ, an earlier step given other
    arguments is looked for)."""
    (args_a, params_a, res_a), (args_b, params_b, res_b) = parts_a, parts_b
    differ = sorted(_label(k) for k in _differing(res_a, res_b))
    changed = sorted(k[1] for k in _differing(params_a, params_b))
    results = f"{_names(differ)} differ{'s' if len(differ) == 1 else ''}"
    pairs = [(a, b) for ours, theirs in ((args_a, args_b), (params_a, params_b))
             for k, a in ours.items() if (b := theirs.get(k)) is not None]
    by_stats = any(not a.exact_with(b) for a, b in pairs)
    both = by_stats and any(a.content is None and b.content is None for a, b in pairs)
    sparse = _sparse_by_statistics(sa, parts_a, parts_b) if by_stats else []
    same = (f"inputs with the same statistics (sparse {_names(sparse)}: of {'their' if len(sparse) > 1 else 'its'} "
            "stored values only, the indices not recorded)" if sparse else "inputs with the same statistics ("
            f"{'both runs' if both else 'one run'} kept statistics only: they cannot tell a reordered batch apart)"
            if by_stats else "same inputs")
    if changed:
        given = _given_other_arguments(al, sa) if first and al is not None else ""
        ranks = (", or by what the other ranks sent: the gradients DistributedDataParallel or FSDP reduce across "
                 "ranks outside every step" if len(sa.rec.ranks) > 1 else "")
        where = (f": every recorded step before it matched in its results, but {given}" if given else
                 ": every recorded step before it matched, so they were changed outside the recorded steps (by the "
                 f"optimizer or its settings, such as the learning rate, or at initialisation{ranks})" if first
                 else "")
        told = _told(sa, sb, _differing(params_a, params_b) | _differing(res_a, res_b))
        return f"{same}, but {_names(changed)} differ{'s' if len(changed) == 1 else ''}, so {results}{where}{told}"
    reasons = []
    alone = sorted(_label(k) for k in set(res_a) ^ set(res_b))
    if alone:  # a gradient one run computed and the other did not
        which = sa if set(res_a) - set(res_b) else sb
        reasons.append(f"{_names(alone)} {'is' if len(alone) == 1 else 'are'} recorded in {which.rec.reader.label} "
                       "only (an input that required grad in one run and not in the other)")
    if sa.arguments != sb.arguments:
        where, a, b = _first_difference(sa.arguments, sb.arguments)
        generators = _generator_difference(sa.arguments, sb.arguments, where)
        if generators is not None:
            name = _argument_name(sa, where[:where.index("$generator")])
            reasons.append(f"its torch.Generator argument{f' {name}' if name else ''} is in another state "
                           f"({generators})")
        elif (rng := _rng_difference(sa.arguments, sb.arguments, where)) is not None:
            name = _argument_name(sa, where[:where.index("$rng")])
            kind, how = rng
            reasons.append(f"its {kind} argument{f' {name}' if name else ''} is in another state ({how})"
                           if kind is not None else f"its generator argument{f' {name}' if name else ''} is of "
                           f"another kind ({how})")
        else:
            name = _argument_name(sa, where)
            reasons.append(f"its non-tensor argument{f' {name} differs' if name else 's differ'} ({_short(a)} vs "
                           f"{_short(b)})")
        reasons[-1] += ", passed from outside every recorded step" if sa.parent is None else ""
    layouts = _layouts_differ(sa, sb)
    if layouts:
        reasons.append(f"{_names(layouts)} {'has' if len(layouts) == 1 else 'have'} another memory layout (strides) "
                       "in each run: the same values laid out otherwise (channels_last, a transposed or sliced view) "
                       "can be summed by the kernels in another order")
    if sa.definition.get("source_sha256") != sb.definition.get("source_sha256"):
        reasons.append("its code differs between the runs")
    reasons += _submodule_code_differences(sa, sb)
    reasons += _module_differences(sa, sb)
    if sa.settings != sb.settings:  # (not a setting one run's recorder did not record yet: no difference seen)
        keys = sorted(k for k in set(sa.settings) & set(sb.settings) if sa.settings.get(k) != sb.settings.get(k))
        if keys:
            reasons.append(f"settings differ ({', '.join(keys[:5])})")
    machines = _machines_differ(sa, sb)
    if machines:
        reasons.append(f"the runs were recorded with different software or hardware ({'; '.join(machines)})")
    rng_a, rng_b = _rng_bytes(sa), _rng_bytes(sb)  # (the states themselves: their documents' places say nothing)
    generators = sorted(k for k in set(rng_a) | set(rng_b) if rng_a.get(k) != rng_b.get(k))
    torch_ones = [k for k in generators if k.startswith(("torch", "cuda"))]
    if torch_ones:
        reasons.append(f"its RNG state at entry differs ({', '.join(torch_ones)})")
    own = [k.removeprefix(snapshot.GLOBAL_PREFIX) for k in generators if k.startswith(snapshot.GLOBAL_PREFIX)]
    if own:  # (found in its code: it draws from them)
        reasons.append(f"the state of the module-level RNG {', '.join(own)} its code draws from differs at entry")
    held = [k.removeprefix(snapshot.MODULE_PREFIX) for k in generators if k.startswith(snapshot.MODULE_PREFIX)]
    if held:  # (a generator a module holds is there to be drawn from)
        reasons.append(f"the state of the generator {', '.join(held)} its module holds differs at entry")
    taken = [k.removeprefix(snapshot.DEFAULT_PREFIX) for k in generators if k.startswith(snapshot.DEFAULT_PREFIX)]
    if taken:  # (a parameter's default the call took: it draws from it)
        reasons.append(f"the state of the generator its parameter {', '.join(taken)} defaults to differs at entry")
    why = "; ".join(reasons) or ("nothing recorded explains it: inputs that differ in a way their statistics do not "
                                 "show, or nondeterministic kernels" if by_stats
                                 else "nothing recorded explains it (nondeterministic kernels, or something the step "
                                 "reads besides its inputs: a global, an environment variable?)")
    if sa.extra.get("dtensors") and not reasons:  # (its collectives brought in the other ranks' shards)
        why += ("; or it took it from another rank: it computed on DTensors, whose operations take in the other "
                "ranks' shards through collectives the recording does not hold (--rank K compares another rank)")
    others = [k for k in generators if k not in torch_ones and not k.startswith((snapshot.GLOBAL_PREFIX,
                                                                                 snapshot.MODULE_PREFIX,
                                                                                 snapshot.DEFAULT_PREFIX))]
    if others and not reasons:
        why += f"; its {' and '.join(others)} RNG states differ too, which matters only if it draws from them"
    return f"{same} and parameters, but {results}: {why}{_told(sa, sb, _differing(res_a, res_b))}"


def _told(sa: Step, sb: Step, keys: set[Any], shown: int = 3) -> str:
    """Of the records ``keys`` of two runs' same step that differ, those whose dtypes or shapes differ (bfloat16
    in one run) or whose NaN or Inf counts do (a NaN in one run's batch or weight), as a cause adds them: what a
    reader asks first of two runs that part, and which neither a name nor "differs" tells; "" for none."""
    said = []
    order = ("input", "forward input", "grad_output", *_PARAMS)  # (what the step got first, then what it made)
    for key in sorted(keys, key=lambda k: (order.index(k[0]) if k[0] in order else len(order), str(k[1]))):
        ra, rb = _record_of(sa, key), _record_of(sb, key)
        if ra is None or rb is None:
            continue
        label = _input_name(sa, key) if key[0] in ("input", "grad_output", "forward input") else _label(key)
        if ra.dtype != rb.dtype:
            said.append(f"{label} is {ra.dtype} in this run, {rb.dtype} in the other")
        if ra.shape != rb.shape:
            said.append(f"{label} is of shape {tuple(ra.shape)} in this run, {tuple(rb.shape)} in the other")
        for stat, what in (("nan", "NaN"), ("inf", "Inf")):
            na, nb = int(ra.stats[stat]), int(rb.stats[stat])
            if na != nb:
                said.append(f"{label} holds {na or 'no'} {what} in this run, {nb or 'none'} in the other")
    more = f"; and {len(said) - shown} more such" if len(said) > shown else ""
    return "".join(f"; {s}" for s in said[:shown]) + more


def _record_of(step: Step, key: tuple[str, str]) -> TensorRecord | None:
    """The tensor record a fingerprint's key (``_parts``) names: a backward step's forward inputs and parameters
    are its forward call's; None for what no tensor record holds (a forward's non-tensor output)."""
    role, name = key
    if role.startswith("forward ") or (role in _PARAMS and step.phase == "backward"):
        step, role = _forward_of(step), role.removeprefix("forward ")
    return next((r for r in step.records if r.role == role and r.name == name), None)


_ABSENT = object()
# What else of a module skeleton (docs/FORMAT.md) changes what a call computes, as a cause names it.
_SKELETON_PARTS = {"class": "class", "init": "constructor arguments", "params": "parameters", "buffers": "buffers",
                   "unrecorded": "attributes without a data form", "parametrized": "parametrizations",
                   "hooks": "hooks", "other_hooks": "hooks", "tied": "tied parameters",
                   "shared_modules": "shared submodules"}


def _forward_of(step: Step) -> Step:
    """A backward step's forward call (where its module's state is recorded); a forward step itself."""
    return step.rec.step(step.forward) if step.phase == "backward" and step.forward is not None else step


def _module_doc(step: Step) -> dict[str, Any]:
    """The skeleton of a step's module as the call found it (a backward step's: its forward's); empty for
    a function step."""
    doc = step._doc("module")
    if not isinstance(doc, dict) and step.phase == "backward" and step.forward is not None:
        doc = step.rec.step(step.forward)._doc("module")
    return doc if isinstance(doc, dict) else {}


def _submodule_code_differences(sa: Step, sb: Step) -> list[str]:
    """The classes of the training code's own among the submodules of two aligned module steps whose recorded
    code differs between the runs (schema 1.17: a recording before it holds none to compare)."""
    from .code import submodule_entries, submodule_label

    theirs = {ref: entry for ref, entry, _ in submodule_entries(_module_doc(sb), sb.module_path)}
    return [f"the code of {submodule_label(ref, sa.name, paths)} differs between the runs"
            for ref, entry, paths in submodule_entries(_module_doc(sa), sa.module_path)
            if ref in theirs and theirs[ref]["source_sha256"] != entry["source_sha256"]]


def _module_differences(sa: Step, sb: Step) -> list[str]:
    """What of the module two aligned steps called differs between the runs, from their recorded skeletons:
    training or eval mode (a model.eval() with no model.train() after it), attributes (a temperature, a
    scale set by the loop), and the rest of the skeleton, its own and its submodules'."""
    modes: dict[tuple[bool, bool], list[str]] = {}
    attrs: list[tuple[str, Any, Any]] = []
    parts: dict[str, list[str]] = {}
    # (since 1.17 a torch.Generator attribute's state in the skeleton is the one it was built with, and the
    # call's is in its RNG parts, compared there)
    held = any(k.startswith(snapshot.MODULE_PREFIX) for s in (sa, sb) for k in _forward_of(s).rng)

    def walk(a: dict[str, Any], b: dict[str, Any], path: str) -> None:
        if isinstance(a.get("training"), bool) and isinstance(b.get("training"), bool) \
                and a["training"] != b["training"]:
            modes.setdefault((a["training"], b["training"]), []).append(path)
        attrs_a = a.get("attrs") if isinstance(a.get("attrs"), dict) else {}
        attrs_b = b.get("attrs") if isinstance(b.get("attrs"), dict) else {}
        for k in sorted(set(attrs_a) | set(attrs_b), key=str):
            va, vb = attrs_a.get(k, _ABSENT), attrs_b.get(k, _ABSENT)
            if held and isinstance(va, dict) and isinstance(vb, dict) and "$generator" in va and "$generator" in vb:
                continue
            if va != vb:
                attrs.append((f"{path}.{k}" if path else str(k), va, vb))
        for key, what in _SKELETON_PARTS.items():
            if a.get(key) != b.get(key) and path not in parts.get(what, []):
                parts.setdefault(what, []).append(path)
        kids_a = a.get("children") if isinstance(a.get("children"), dict) else {}
        kids_b = b.get("children") if isinstance(b.get("children"), dict) else {}
        if set(kids_a) != set(kids_b):
            parts.setdefault("submodules", []).append(path)
        for name in sorted(set(kids_a) & set(kids_b), key=str):
            if isinstance(kids_a[name], dict) and isinstance(kids_b[name], dict):
                walk(kids_a[name], kids_b[name], f"{path}.{name}" if path else str(name))

    walk(_module_doc(sa), _module_doc(sb), "")
    out = []
    for (mode_a, mode_b), paths in modes.items():
        subs = [p for p in paths if p]
        who = (("its module" + (f" and {len(subs)} of its submodules" if subs else "")) if "" in paths
               else f"its submodule{'s' if len(subs) != 1 else ''} {_names(subs)}")
        verb = "was" if len(paths) == 1 else "were"
        out.append(f"{who} {verb} in {'training' if mode_a else 'eval'} mode in this run and in "
                   f"{'training' if mode_b else 'eval'} mode in the other (a model.eval() with no model.train() "
                   "after it?)")

    def value(v: Any) -> str:
        return "not set" if v is _ABSENT else _short(v)

    out += [f"attribute {name}: {value(a)} in this run, {value(b)} in the other" for name, a, b in attrs[:3]]
    if len(attrs) > 3:
        out.append(f"{len(attrs) - 3} more of its module's attributes differ ({_names([n for n, _, _ in attrs[3:]])})")
    for what, paths in parts.items():
        where = _names([p or "its own" for p in paths])
        out.append(f"its module's {what} differ{'s' if what == 'class' else ''} ({where})")
    return out


def _machines_differ(sa: Step, sb: Step) -> list[str]:
    """What of the software and hardware two runs were recorded with differs, as it changes numerics:
    versions, the CPU's vector units, the GPUs, the devices the step's tensors were on."""
    from .state import machine_facts

    ia, ib = sa.rec.run_info, sb.rec.run_info
    out = [f"{what} {a} vs {b}" for (what, a), (_, b) in zip(machine_facts(ia), machine_facts(ib), strict=True)
           if a is not None and b is not None and a != b]

    def gpus(info: dict[str, Any]) -> str:
        found = [g.get("name") for g in info.get("cuda") or [] if isinstance(g, dict)] \
            if isinstance(info.get("cuda"), list) else []
        return ", ".join(str(n) for n in found) or "none"

    if gpus(ia) != gpus(ib):
        out.append(f"GPUs {gpus(ia)} vs {gpus(ib)}")
    devices_a = sorted({r.device for r in sa.records})
    devices_b = sorted({r.device for r in sb.records})
    if devices_a != devices_b:
        out.append(f"tensors on {', '.join(devices_a)} vs {', '.join(devices_b)}")
    return out


def _first_difference(a: Any, b: Any, path: tuple[Any, ...] = ()) -> tuple[tuple[Any, ...], Any, Any]:
    """Where two documents first differ (the keys and indices down to it) and their values there: what a
    message shows, not two prefixes that agree."""
    if isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b):
        key = next((k for k in a if a[k] != b[k]), None)
        return (path, a, b) if key is None else _first_difference(a[key], b[key], (*path, key))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        return (path, a, b) if i is None else _first_difference(a[i], b[i], (*path, i))
    return path, a, b


def _argument_name(step: Step, path: tuple[Any, ...]) -> str | None:
    """A path into a step's arguments document as the call was written: ``mu`` (a positional argument,
    named from the source of a function step), ``args[1]``, ``cfg['lr']`` (tags' own keys left out)."""
    parts = [k for k in path if not (isinstance(k, str) and k.startswith("$"))]
    if len(parts) < 2 or parts[0] not in ("args", "kwargs"):
        return None
    name = str(parts[1])
    if parts[0] == "args":
        names = _positional_names(step)
        name = names[parts[1]] if isinstance(parts[1], int) and parts[1] < len(names) else f"args[{parts[1]}]"
    return name + "".join(f"[{k!r}]" for k in parts[2:])


def _positional_names(step: Step) -> list[str]:
    """The positional parameters of a step's call, from its recorded source: a function's, a module's
    forward's after self ([] where neither is found)."""
    import ast

    defn = step.definition
    if defn.get("kind") not in ("function", "module") or not isinstance(defn.get("source"), str):
        return []
    try:
        tree = ast.parse(textwrap.dedent(defn["source"]))
    except SyntaxError:
        return []
    top = next((n for n in tree.body if getattr(n, "name", None) == defn.get("name")), None)
    if isinstance(top, ast.ClassDef) and defn.get("kind") == "module":
        fn = next((n for n in top.body if isinstance(n, ast.FunctionDef) and n.name == "forward"), None)
        return [] if fn is None else [a.arg for a in [*fn.args.posonlyargs, *fn.args.args]][1:]
    if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) and defn.get("kind") == "function":
        return [a.arg for a in [*top.args.posonlyargs, *top.args.args]]
    return []


def _tagged(a: Any, b: Any, where: tuple[Any, ...], tag: str) -> list[dict[str, Any]] | None:
    """The payloads of the ``tag`` value two arguments documents hold on the path ``where`` (their first
    difference) leads through, each ``{}`` where it is no dict; None where that path goes through no such value."""
    if tag not in where:
        return None
    docs = []
    for whole in (a, b):
        doc = whole
        for key in where[:where.index(tag) + 1]:
            doc = doc[key]
        docs.append(doc if isinstance(doc, dict) else {})
    return docs


def _generator_difference(a: Any, b: Any, where: tuple[Any, ...]) -> str | None:
    """Where two arguments documents first differ inside a torch.Generator's (``$generator``: its device and
    state, base64), how the two generators differ in words: "seed 1234 vs 99" (the seed a CPU generator's state
    holds, ``initial_seed``), or, the seeds alike or not read, the states' short digests; None elsewhere."""
    docs = _tagged(a, b, where, "$generator")
    if docs is None:
        return None
    seeds, digests = [], []
    for doc in docs:
        try:
            state = base64.b64decode(str(doc.get("state")), validate=True)
        except (ValueError, TypeError):
            state = b""
        digests.append(hashlib.sha256(state).hexdigest()[:12])
        seeds.append(_generator_seed(str(doc.get("device")), state))
    if docs[0].get("device") != docs[1].get("device"):
        return f"on device {docs[0].get('device')} vs {docs[1].get('device')}"
    if None not in seeds and seeds[0] != seeds[1]:
        return f"seed {seeds[0]} vs {seeds[1]}"
    seeded = f"both seeded {seeds[0]}, drawn from otherwise before the call: " if None not in seeds else ""
    return f"{seeded}state {digests[0]}… vs {digests[1]}… (sha256)"


def _rng_difference(a: Any, b: Any, where: tuple[Any, ...]) -> tuple[str | None, str] | None:
    """Where two arguments documents first differ inside a numpy or Python generator's (``$rng``, 1.23: its kind
    and state), (its kind, how the two differ in words): a numpy one's bit generators ("bit generator PCG64 vs
    MT19937"), else the first field of the states that differs, both values where short ("state['state']['key'][0] 1
    vs 2": MT19937's seed), their short digests where not; (None, both kinds) where the kinds differ; None elsewhere."""
    docs = _tagged(a, b, where, "$rng")
    if docs is None:
        return None
    kind, other = (str(d.get("kind")) for d in docs)
    if kind != other:
        return None, f"a {kind:.60} in this run, a {other:.60} in the other"
    states = []
    for doc in docs:
        try:
            states.append(snapshot.argument_rng_state(doc)[2])
        except Exception:  # noqa: BLE001 - damaged, or of a kind this version cannot read: its document's fields
            states.append(None)
    if isinstance(states[0], dict) and isinstance(states[1], dict):  # numpy's: its bit generator's state
        bits, theirs = states[0].get("bit_generator"), states[1].get("bit_generator")
        if bits != theirs:
            return kind, f"bit generator {bits!s:.40} vs {theirs!s:.40}"
        path, va, vb = _first_difference(_listed(states[0]), _listed(states[1]))
        field = "".join(f"[{k!r}]" for k in path)
        return kind, f"bit generator {bits!s:.40}, state{field} {_two_values(va, vb)}"
    path, va, vb = _first_difference({k: v for k, v in docs[0].items() if k != "kind"},
                                     {k: v for k, v in docs[1].items() if k != "kind"})
    field = {"bytes": "state"}.get(str(path[0]), str(path[0])) if path else "state"  # (Python's: its 625 words)
    return kind, f"{field} {_two_values(va, vb)}"


def _listed(value: Any) -> Any:
    """A decoded generator state with its arrays as lists (compared, and walked down to an item, as JSON is)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _listed(v) for k, v in value.items()}
    return value


def _two_values(a: Any, b: Any) -> str:
    """Two values of a field that differs between the runs, as they are where short, as short digests where not
    (a 128-bit PCG64 state, 625 words of Python's, an array)."""
    shown = [json.dumps(v, default=str) for v in (a, b)]
    if max(map(len, shown)) <= 20:
        return f"{shown[0]} vs {shown[1]}"
    digests = [hashlib.sha256(text.encode()).hexdigest()[:12] for text in shown]
    return f"{digests[0]}… vs {digests[1]}… (sha256)"


def _generator_seed(device: str, state: bytes) -> int | None:
    """The seed a CPU torch.Generator's recorded state was seeded with (``initial_seed`` of a generator given
    that state); None for another device's (no accelerator is touched to read one) or a state not read."""
    if device != "cpu" or not state:
        return None
    try:
        made = torch.Generator()
        made.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        return int(made.initial_seed())
    except (RuntimeError, ValueError, TypeError):
        return None


def _short(doc: Any) -> str:
    text = json.dumps(doc, sort_keys=True)
    return text if len(text) <= 80 else text[:79] + "…"


def _rng_bytes(step: Step) -> dict[str, Any]:
    """A step's generator states, by generator, as comparable values."""
    def canon(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.numpy().tobytes()
        if isinstance(v, np.ndarray):
            return v.tobytes()
        if isinstance(v, (list, tuple)):
            return tuple(canon(x) for x in v)
        if isinstance(v, dict):
            return tuple(sorted((str(k), canon(x)) for k, x in v.items()))
        return v

    return {str(k): canon(v) for k, v in step.rng.items()}

