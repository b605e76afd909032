"""Operation-level bisection: replay one step with every aten operation checked, and name the first
that turned finite inputs into NaN or Inf, with the user's source line.

A forward step runs under a ``TorchDispatchMode`` that checks each operation's outputs; the source
line is the innermost frame of the Python stack that is the user's code (not torch's, not
PaperDebugger's, not the standard library's). A backward step's forward runs with autograd's anomaly
mode (NaN checks off), which keeps the forward stack on every graph node; during the gradient
computation each operation is attributed to the node running it and that node's forward line.
"""

from __future__ import annotations

import contextlib
import os
import re
import sysconfig
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import recorder
from recorder import stats as stats_mod

from .compare import stats_dict
from .recording import Recording, Step

_SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (torch, recorder)) + (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep)
_TORCH_NN = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "nn") + os.sep
_REPLAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay.py")  # where _Call.run calls the step
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n(?P<code>[^\n]*)')


@dataclass
class OpReport:
    """The first operation that produced a non-finite value from finite inputs."""

    name: str  # "aten::exp"
    overload: str  # "aten.exp.default"
    phase: str  # "forward" or "backward"
    file: str | None
    line: int | None
    code: str | None
    function: str | None = None
    node: str | None = None  # backward: the autograd node running it ("SqrtBackward0")
    index: int = 0  # how many operations the step ran before it, from 0
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    # None: it made NaN/Inf from finite inputs. "inf": no operation of the step did (the Inf came in),
    # and this one made NaN of Inf (inf - inf, 0 * inf). "forward": in a backward step none did, and this
    # operation of its forward made the NaN (masked there: torch.where(x > 0, x.sqrt(), 0)) that the
    # backward then carried into the gradient.
    made: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "line": self.line, "code": self.code,
                "function": self.function, "overload": self.overload, "phase": self.phase, "node": self.node,
                "index": self.index, "inputs": self.inputs, "outputs": self.outputs, "made": self.made}

    def how(self) -> str | None:
        """How this operation made the step's first NaN/Inf, when not from finite inputs (``made``)."""
        if self.made == "inf":
            return (f"no operation inside the step made the Inf (it came in); {self.name} made NaN of it "
                    "(inf - inf, 0 * inf)")
        if self.made == "forward":
            return (f"no operation of the backward made NaN from finite values: the forward's {self.name} made it, "
                    "where the forward's output did not keep it (masked: torch.where, a product with 0), and its "
                    "backward carried it into the gradient")
        return None

    def where(self) -> str:
        at = f"{self.file}:{self.line}" if self.file else "no user source line found"
        node = f" in {self.node}" if self.node else ""
        code = f": {self.code}" if self.code else ""
        return f"{self.name}{node} at {at}{code}"


def _user_frame(frames: list[tuple[str, int, str, str]]) -> tuple[str, int, str, str] | None:
    """The innermost frame of the user's code inside the replayed step: below the replay's call of it
    (the frames above are what called the replay: pdbg's command line, a notebook)."""
    calls = [i for i, (file, _, func, _) in enumerate(frames) if func == "run" and os.path.abspath(file) == _REPLAY]
    inside = frames[calls[-1] + 1:] if calls else frames
    for file, line, func, code in reversed(inside):
        path = os.path.abspath(file)
        if file.startswith("<") or path.startswith(_SKIP_DIRS):
            continue
        return path, line, func, code
    for file, line, func, code in reversed(inside):  # none: torch's own layers made it (an nn.Linear's forward)
        path = os.path.abspath(file)
        if path.startswith(_TORCH_NN):
            return path, line, func, code
    return None


def _tensor_info(t: torch.Tensor) -> dict[str, Any]:
    info: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    try:
        info["stats"] = stats_dict(stats_mod.host_stats(t.detach().cpu()))
    except (RuntimeError, TypeError, NotImplementedError):
        info["stats"] = None
    return info


def _checked(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.layout == torch.strided
            and t.device.type != "meta" and (t.is_floating_point() or t.is_complex())]


def _nonfinite(t: torch.Tensor) -> bool:
    return t.numel() > 0 and not bool(torch.isfinite(t).all())


def _made_nonfinite(func: Any, outs: list[torch.Tensor], given: list[torch.Tensor]) -> bool:
    """Whether an operation whose outputs hold NaN/Inf made some: its inputs were all finite (none in
    ``given``, the non-finite ones), or it is pointwise and an output is non-finite where every input
    (broadcast) was finite (``exp`` of scores that overflow, next to the -inf of a mask: the mask's
    -inf gives 0, the overflow Inf)."""
    if not given:
        return True
    if torch.Tag.pointwise not in getattr(func, "tags", ()):
        return False  # its non-finite inputs can reach any of its outputs
    for out in outs:
        new = ~torch.isfinite(out)
        try:
            for t in given:
                new &= torch.isfinite(t).broadcast_to(out.shape)
        except RuntimeError:  # an input that does not broadcast to this output (another of its outputs)
            continue
        if bool(new.any()):
            return True
    return False


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


class _Finder(TorchDispatchMode):
    def __init__(self, phase: str) -> None:
        super().__init__()
        self.phase = phase
        self.found: OpReport | None = None
        self.nan_of_inf: OpReport | None = None  # the first that made NaN where its inputs held Inf, no NaN
        self.count = 0
        self.literals: list[torch.Tensor] = []  # NaN/Inf written in the code (y[m] = float("nan")), lifted to tensors

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # An operation that writes into its input (y[1, 3:] = nan: fill_ of a view) is judged by its
        # inputs as they were before it wrote.
        before, infos = None, None
        if self.found is None and func._schema.is_mutable:
            before = self._given(args, kwargs)
            infos = [_tensor_info(t) for t in _checked((args, kwargs))]  # (reported as they were)
        out = func(*args, **kwargs)
        if self.found is None and func in _LIFTS:  # a constant of the code: what it is written into is the origin
            self.literals += [t for t in _checked(out) if _nonfinite(t)]
        elif self.found is None:
            outs = _checked(out)
            if any(_nonfinite(t) for t in outs):
                given = before if before is not None else self._given(args, kwargs)
                if _made_nonfinite(func, outs, given):
                    self.found = self._report(func, args, kwargs, outs, infos)
                elif self.nan_of_inf is None and any(bool(t.isnan().any()) for t in outs) and \
                        not any(bool(t.isnan().any()) for t in given):
                    self.nan_of_inf = self._report(func, args, kwargs, outs, infos)
                    self.nan_of_inf.made = "inf"
            self.count += 1
        return out

    def _given(self, args: Any, kwargs: Any) -> list[torch.Tensor]:
        """An operation's non-finite inputs, but for the constants written in the code."""
        return [t for t in _checked((args, kwargs)) if _nonfinite(t) and not any(t is c for c in self.literals)]

    def _report(self, func: Any, args: Any, kwargs: Any, outs: list[torch.Tensor],
                inputs: list[dict[str, Any]] | None = None) -> OpReport:
        overload = str(func)
        name = "aten::" + overload.split(".")[1] if overload.startswith("aten.") else overload
        node_name, frames = None, None
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                node_name = node.name()
                stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
                if stack:
                    frames = [(m["file"], int(m["line"]), m["func"].strip(), m["code"].strip())
                              for m in _FRAME.finditer("".join(stack))]
        if frames is None:
            frames = [(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in traceback.extract_stack()]
        user = _user_frame(frames)
        file, line, function, code = user if user else (None, None, None, None)
        if inputs is None:
            inputs = [_tensor_info(t) for t in _checked((args, kwargs))]
        return OpReport(name, overload, self.phase, file, line, code, function, node_name, self.count, inputs,
                        [_tensor_info(t) for t in outs])


def bisect_ops(rec: Recording, step: Step, *, threads: int | None = None, use_bundled_source: bool = False,
               notes: list[str] | None = None, script: str | os.PathLike[str] | None = None) -> OpReport | None:
    """Replay ``step`` operation by operation; the first that made NaN/Inf from finite inputs, or
    None when none did (the values then came from outside the step's operations). ``notes``
    receives the replay's warnings that its code is not the recorded code (edited since).
    ``script``: where the training script is now, if it moved (as ``replayer.replay``'s)."""
    from .replay import Replayer

    finders: dict[str, _Finder] = {}

    @contextlib.contextmanager
    def around(stage: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if step.phase == "backward" and stage == "forward":
                # (set_detect_anomaly, not detect_anomaly: the same mode, restored after, without the
                # warning detect_anomaly gives, which only warnings.catch_warnings() would hide, and that
                # swaps the whole process's filters, from a TUI worker's thread too)
                stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
            finders[stage] = stack.enter_context(_Finder(stage))
            yield

    result = Replayer(rec, script=script, use_bundled_source=use_bundled_source).replay(
        step, threads=threads, nested=False, around=around)
    if notes is not None:
        notes += [w for w in result.warnings if "changed since" in w]
    finder = finders.get(step.phase)
    if finder is None:
        return None
    if finder.found is None and step.phase == "backward" and "forward" in finders:
        masked = finders["forward"].found  # a NaN the forward made and hid, which the backward carried
        if masked is not None:
            masked.made = "forward"
            return masked
    return finder.found or finder.nan_of_inf
