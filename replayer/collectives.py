"""Collectives during a replay: given back from the recording, never communicated.

A step of rank k that called ``dist.all_reduce(x)`` is replayed in one process, with no process
group: each collective the replayed code calls receives, in call order, the results the recording
holds for that call (``recorder.collectives`` recorded them with the innermost step), written into
its output tensors as the real collective would have. ``get_rank``, ``get_world_size``,
``get_backend`` and ``is_initialized`` answer as they did for that rank. A call the recording does
not have, a different collective, or results of another shape stop the replay with a ReplayError
naming the call: the replayed code no longer talks to the other ranks as it did.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from recorder import collectives as recorded
from recorder.errors import ReplayError
from recorder.store import layout
from recorder.store.reader import TensorRecord

from .nested import descendants
from .recording import Step

_ROLE = layout.ROLES.index("collective")


@dataclass
class _Call:
    step: Step
    doc: dict[str, Any]
    records: list[TensorRecord]


@dataclass
class Replayed:
    """What the replay's collectives did: calls given their recorded results, and those left over."""

    calls: list[_Call]
    used: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def left(self) -> list[_Call]:
        return self.calls[self.used:]


class _Done:
    """Stands for the Work handle of an asynchronous collective: already complete."""

    def wait(self, *_: Any, **__: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def calls_of(steps: list[Step]) -> list[_Call]:
    """The collectives recorded in these steps (a step and the steps inside it), in call order."""
    calls = []
    for step in steps:
        docs = step.extra.get("collectives") or []
        if not docs:
            continue
        by_name = {r.name: r for r in step.records if r.role == "collective"}
        for doc in docs:
            names = doc.get("results") or []
            missing = [n for n in names if n not in by_name]
            if missing:
                raise ReplayError(f"step {step.index}: the results of collective {doc.get('name')} are not in the "
                                  "recording; the recording is damaged")
            calls.append(_Call(step, doc, [by_name[n] for n in names]))
    calls.sort(key=lambda c: int(c.doc.get("seq", 0)))
    return calls


def _name(call: _Call) -> str:
    return f"{call.doc.get('name')} ({call.doc.get('op')}) of step {call.step.index}"


def _any_recorded(step: Step) -> bool:
    """Whether the step's rank recorded any collective (one read of the role column)."""
    rank = step.rec.rank
    return bool(rank.lengths.get("tensors")) and bool(np.any(np.asarray(rank.column("tensors/role")) == _ROLE))


@contextmanager
def replayed(step: Step, inner: list[Step] | None = None) -> Iterator[Replayed]:
    """Give the collectives called inside the block the results recorded in ``step`` and the steps
    inside it (``inner``, when the caller has them already). For a single-process run without
    collectives, torch.distributed is left alone."""
    dist = step.rec.rank.dist
    many = dist["world_size"] > 1
    if many or _any_recorded(step):
        state = Replayed(calls_of([step, *(descendants(step) if inner is None else inner)]))
    else:
        state = Replayed([])
    if not state.calls and not many:
        yield state
        return

    def make(op: str, original: Callable[..., Any], sig: inspect.Signature) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            try:
                arguments = sig.bind(*args, **kwargs).arguments
            except TypeError as exc:
                raise ReplayError(f"the replay called {op} with arguments it does not take ({exc})") from None
            if state.used >= len(state.calls):
                raise ReplayError(f"the replay called {op} after the {len(state.calls)} collective(s) the recording "
                                  "holds for this step: the code no longer communicates as it did when recorded")
            call = state.calls[state.used]
            if call.doc.get("op") != op:
                raise ReplayError(f"the replay called {op} where the recording has {_name(call)}: the code no "
                                  "longer communicates as it did when recorded")
            targets = recorded.results_of(op, arguments)
            if len(targets) != len(call.records):
                raise ReplayError(f"the replay's {op} writes {len(targets)} tensor(s), the recorded {_name(call)} "
                                  f"{len(call.records)}")
            for (_, target), record in zip(targets, call.records):
                if not record.has_payload:
                    raise ReplayError(f"{_name(call)}: the recording kept statistics only for its result "
                                      f"{record.name} (mode stats, every=k or flight); it cannot be replayed")
                if tuple(target.shape) != record.shape or str(target.dtype).removeprefix("torch.") != record.dtype:
                    raise ReplayError(f"{_name(call)}: the replay's {record.name} is {target.dtype} "
                                      f"{tuple(target.shape)}, the recording's {record.dtype} {record.shape}")
                # Out of sight of the replay's own dispatch modes (the operation finder of bisect --ops):
                # reading and copying the result stand for the other ranks' work, not for the step's.
                with torch.no_grad(), _disable_current_modes():
                    target.copy_(call.step.rec.rank.tensor(record).to(target.device))
            state.used += 1
            return _Done() if arguments.get("async_op") else None

        return collective

    with recorded.patched(make, _as_recorded(dist)):
        yield state
    if state.left:
        state.warnings.append(f"the replay made {state.used} of the {len(state.calls)} recorded collectives; "
                              f"{_name(state.left[0])} was not called")


@contextmanager
def refused_in_backward(step: Step) -> Iterator[None]:
    """Around a backward step's replay in a run of several processes: a collective its backward
    calls (``SyncBatchNorm``'s backward all-reduces its gradient statistics) is refused in one line,
    since the recorder keeps only those called inside a step's forward call. Elsewhere, nothing."""
    dist = step.rec.rank.dist
    if dist["world_size"] <= 1:
        yield
        return

    def make(op: str, original: Callable[..., Any], sig: inspect.Signature) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            raise ReplayError(f"backward step {step.selector} calls torch.distributed's {op} (as SyncBatchNorm's "
                              "backward does): collectives called during a backward pass are not recorded, so this "
                              "backward step cannot be replayed alone (its forward step can)")

        return collective

    with recorded.patched(make, _as_recorded(dist)):
        yield


def _as_recorded(dist: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """torch.distributed's questions about the process group, answered as the recorded rank."""
    rank, world, backend = dist["rank"], dist["world_size"], dist["backend"] or "gloo"
    return {"is_initialized": lambda: True, "get_rank": lambda group=None: rank,
            "get_world_size": lambda group=None: world, "get_backend": lambda group=None: backend}
