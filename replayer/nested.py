"""Inner steps during a replay: which recorded steps a step encloses, and a stand-in for the
recorder that sees them run again so that each can be compared with its recording.

Module steps are seen through forward hooks on the rebuilt module's submodules at the recorded
paths; function steps (``paper_step`` functions) through the decorator's hook point
(``recorder.capture.ACTIVE``), with the path of the innermost module running around them. Replayed
calls are matched to recorded ones by (name, module path) and their order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from recorder import jsonval
from recorder.store import layout

from .compare import Diff, compare, stats_dict
from .recording import Step


@dataclass
class InnerStep:
    """How one step inside the replayed step compares with its recording."""

    step: Step
    match: bool
    diffs: list[Diff] = field(default_factory=list)
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step.to_json(), "match": self.match, "reason": self.reason,
                "outputs": [d.to_json() for d in self.diffs]}


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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else (prefix or name)


class InnerTap:
    """Installed as ``recorder.capture.ACTIVE`` during a replay; records the replayed inner calls."""

    enabled = True

    def __init__(self, root: torch.nn.Module | None, root_path: str, inner: list[Step]) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str, dict[str, torch.Tensor] | None]] = []  # (key kind:name, path, outputs)
        self._stack: list[str] = [root_path]
        self._handles: list[Any] = []
        self._modules_wanted = {s.module_path for s in inner if s.definition.get("kind") == "module"}
        if root is not None:
            for rel, sub in root.named_modules():
                if not rel:
                    continue
                path = _join(root_path, rel)
                self._handles.append(sub.register_forward_pre_hook(lambda m, a, p=path: self._enter(p)))
                self._handles.append(sub.register_forward_hook(lambda m, a, o, p=path: self._exit(p, o),
                                                               always_call=True))

    def _enter(self, path: str) -> None:
        self._stack.append(path)
        if path in self._modules_wanted:
            self.calls.append(("module", path, None))

    def _exit(self, path: str, output: Any) -> None:
        if self._stack and self._stack[-1] == path:
            self._stack.pop()
        if path in self._modules_wanted:
            for i in range(len(self.calls) - 1, -1, -1):
                kind, p, outs = self.calls[i]
                if kind == "module" and p == path and outs is None:
                    self.calls[i] = (kind, p, _snapshot(output))
                    break

    def call(self, defn: Any, fn: Any, module: torch.nn.Module | None, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        if module is not None:  # module steps are seen by the hooks
            return fn(module, *args, **kwargs)
        slot = len(self.calls)
        self.calls.append((f"function:{defn.name}", self._stack[-1], None))
        out = fn(*args, **kwargs)
        self.calls[slot] = (self.calls[slot][0], self.calls[slot][1], _snapshot(out))
        return out

    def watch(self, tensor: Any, name: str, expect: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def compare(self) -> list[InnerStep]:
        """Pair recorded inner steps with replayed calls (by key and order) and compare outputs."""
        queues: dict[tuple[str, str], list[dict[str, torch.Tensor] | None]] = {}
        for kind, path, outs in self.calls:
            queues.setdefault((kind, path), []).append(outs)
        results = []
        for step in self.inner:
            kind = "module" if step.definition.get("kind") == "module" else f"function:{step.name}"
            queue = queues.get((kind, step.module_path))
            if not queue:
                results.append(InnerStep(step, False, reason="recorded, but not called during the replay"))
                continue
            outs = queue.pop(0)
            if outs is None:
                results.append(InnerStep(step, False, reason="raised during the replay"))
                continue
            diffs = []
            for r in step.records:
                if r.role != "output":
                    continue
                value = outs.get(r.name)
                if value is None:
                    diffs.append(Diff(r.name, r.role, False, reason="not produced during the replay",
                                      recorded=stats_dict(r.stats)))
                elif r.has_payload:
                    diffs.append(compare(r.name, r.role, step.rec.rank.tensor(r), value, r.stats))
                else:
                    diffs.append(Diff(r.name, r.role, stats_dict(r.stats) == stats_dict(_stats(value)),
                                      reason="compared by statistics only", recorded=stats_dict(r.stats),
                                      replayed=stats_dict(_stats(value))))
            results.append(InnerStep(step, all(d.match for d in diffs), diffs))
        return results


def _stats(value: torch.Tensor) -> tuple[float, ...]:
    from recorder import stats as stats_mod

    return stats_mod.host_stats(value.detach().cpu())


def _snapshot(output: Any) -> dict[str, torch.Tensor]:
    """The output's tensors by record name, copied (later in-place changes must not show)."""
    found: dict[str, torch.Tensor] = {}

    def name(t: torch.Tensor, path: str) -> str:
        full = f"output.{path}" if path else "output"
        found[full] = t.detach().clone()
        return full

    jsonval.encode(output, tensor_name=name)
    return found
