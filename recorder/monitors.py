"""Monitors that watch steps as they are recorded: anomaly actions, user checks, semantic breakpoints.

- A step whose results hold NaN or Inf (forward: outputs; backward: grad inputs and parameter
  grads) is ``nonfinite``; this is read off the statistics the recorder computes anyway. With
  ``on_anomaly="stop"`` the recording is flushed and ``NonFiniteError`` raised from the step, naming
  it in the paper's terms; with ``"pdb"`` the debugger opens in the code that called the step.
- ``register_check(name)`` decorates ``fn(step) -> bool | str | None``, run on every step's results:
  False or a message makes the step an ``alert``.
- ``breakpoint(where, when, action)``: at steps matching the selector ``where`` for which
  ``when(step)`` holds, ``record`` an alert, ``stop`` (flush, raise ``BreakpointStop``) or open ``pdb``.

The ``step`` these functions receive is a ``StepContext``: where the step is, its tensors'
statistics by record name (``step.stats["output"]["absmax"]``) and, for forward steps, its output.
"""

from __future__ import annotations

import difflib
import pdb
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import names
from .autohooks import glob_matches, parse_globs
from .errors import RecordingError
from .items import TensorItem
from .store import layout

ACTIONS = ("record", "stop", "pdb")


def check_action(action: Any, what: str) -> str:
    """``action`` if it is one of ACTIONS, else a one-line RecordingError naming ``what``."""
    if action not in ACTIONS:
        raise RecordingError(f"unknown {what} {action!r}: use one of {', '.join(ACTIONS)}")
    return str(action)
_HERE = str(Path(__file__).resolve().parent)
_TORCH = str(Path(torch.__file__).resolve().parent)


class NonFiniteError(FloatingPointError):
    """A recorded step produced NaN or Inf and the recording was asked to stop there."""


class BreakpointStop(RuntimeError):
    """A breakpoint with ``action="stop"`` fired."""


@dataclass
class StepContext:
    """What a check or a breakpoint condition sees of one step."""

    index: int
    name: str
    paper: dict[str, Any]
    phase: str  # "forward" or "backward"
    iteration: int
    call: int
    module_path: str
    stats: dict[str, dict[str, float]]  # record name -> {"min", "max", ..., "nan", "inf"} (complex: of |z|)
    roles: dict[str, str]  # record name -> role
    output: Any = None  # the step's output (forward steps)
    module: bool = True  # a module's step (else a function's)

    def describe(self) -> str:
        """The step in the paper's terms: 'Eq. 2 (smooth_relu) forward, iteration 17, call 3'."""
        label = self.paper.get("label")
        who = f"{label} ({self.name})" if label else self.name
        where = f" at {self.module_path}" if self.module_path else ""
        return f"{who}{where} {self.phase}, iteration {self.iteration}, call {self.call}"


@dataclass
class Breakpoint:
    """A registered breakpoint; ``remove()`` unregisters it."""

    where: str
    when: Callable[[StepContext], Any] | None
    action: str
    name: str
    hits: int = 0
    _match: Callable[[StepContext], bool] = field(default=lambda ctx: True, repr=False)

    def remove(self) -> None:
        with _LOCK:
            if self in _BREAKPOINTS:
                _BREAKPOINTS.remove(self)


@dataclass
class Check:
    name: str
    fn: Callable[[StepContext], Any]

    def remove(self) -> None:
        with _LOCK:
            _CHECKS.pop(self.name, None)


_LOCK = threading.Lock()
_CHECKS: dict[str, Check] = {}
_BREAKPOINTS: list[Breakpoint] = []


def register_check(name: str) -> Callable[[Callable[[StepContext], Any]], Callable[[StepContext], Any]]:
    """Decorator: run ``fn(step)`` on every recorded step; False or a message string marks it ``alert``.

    Args:
        name: the check's name, shown with its alerts; registering a name again replaces the check.

    The decorated function is returned unchanged; ``unregister_check(name)`` removes it.
    """
    if not isinstance(name, str) or not name:
        raise RecordingError(f"register_check needs a non-empty name, not {name!r}")

    def decorate(fn: Callable[[StepContext], Any]) -> Callable[[StepContext], Any]:
        if not callable(fn):
            raise RecordingError(f"register_check({name!r}) decorates a function, not {type(fn).__name__}")
        with _LOCK:
            _CHECKS[name] = Check(name, fn)
        return fn

    return decorate


def unregister_check(name: str) -> None:
    """Remove a check registered with ``register_check``."""
    with _LOCK:
        _CHECKS.pop(name, None)


def breakpoint(where: str, when: Callable[[StepContext], Any] | None = None,  # noqa: A001 (the API's name)
               action: str = "record", *, name: str | None = None) -> Breakpoint:
    """Break at steps matching ``where`` when ``when(step)`` holds.

    Args:
        where: a step selector: ``NAME[@iter=K][#CALL][:backward]`` where NAME is a step name, a paper
            label ("Algorithm 1") or a module-path glob (``blocks.1``, ``blocks.*``, ``.`` for the root).
        when: ``callable(step) -> bool`` on the step's ``StepContext``; None: always.
        action: "record" (mark the step ``alert``), "stop" (flush, raise BreakpointStop) or "pdb".
        name: shown in alerts; defaults to ``where``.

    Returns the Breakpoint; its ``remove()`` unregisters it, ``hits`` counts its firings.
    """
    check_action(action, "breakpoint action")
    if when is not None and not callable(when):
        raise RecordingError(f"breakpoint 'when' must be a callable on the step, not {type(when).__name__}")
    bp = Breakpoint(where, when, action, name or where, _match=selector_matcher(where))
    with _LOCK:
        _BREAKPOINTS.append(bp)
    return bp


_SELECTOR = re.compile(r"^(?P<name>[^@#:].*?)(?:@iter=(?P<iter>\d+))?(?:#(?P<call>\d+))?"
                       r"(?::(?P<phase>forward|backward))?$", re.DOTALL)  # (a module path may hold a newline)


@dataclass(frozen=True)
class Selector:
    """A parsed step selector ``NAME[@iter=K][#CALL][:backward]`` (README, "Stopping at the first NaN")."""

    name: str  # a step name, a paper label or a module-path glob; "." is the root module
    iteration: int | None
    call: int | None
    phase: str  # "forward" unless ":backward" was given

    def matches_name(self, name: str, label: str | None, module_path: str, module: bool = True) -> bool:
        """Does a step with this name, paper label and module path match the NAME part? ``module``:
        whether the step is a module's (a function step called outside any module has the path "" too)."""
        if self.name == ".":
            return module_path == "" and module
        if names.same(self.name, label) or names.glob(name, self.name):
            return True
        pattern = parse_globs(self.name)[0] if all(self.name.split(".")) else None
        return pattern is not None and bool(module_path) and glob_matches(pattern, module_path)


def parse_selector(where: str) -> Selector:
    """Parse ``NAME[@iter=K][#CALL][:backward]``; raises RecordingError naming the syntax."""
    m = _SELECTOR.match(where) if isinstance(where, str) else None
    if m is None or not m["name"].strip() or _malformed(m["name"]):
        raise RecordingError(f"invalid step selector {where!r}: use NAME[@iter=K][#CALL][:backward], e.g. "
                             "'smooth_relu@iter=17#3' or 'blocks.1:backward'")
    return Selector(m["name"], int(m["iter"]) if m["iter"] is not None else None,
                    int(m["call"]) if m["call"] is not None else None, m["phase"] or "forward")


def _malformed(name: str) -> bool:
    """A NAME part that holds a suffix of the selector's syntax that did not parse: ``@iter=`` not
    followed by a number, ``#`` by a call number, ``:`` by forward or backward (``@iter=abc``,
    ``#x``, ``:backwards``); taken for a step name, it would match nothing, silently."""
    if "@iter" in name:
        return True
    tail = re.search(r"(#|:)([^\s#:]*)$", name)
    return tail is not None and (tail[1] == "#" or difflib.get_close_matches(tail[2], ("forward", "backward"),
                                                                             cutoff=0.6) != [] or tail[2] == "")


def selector_matcher(where: str) -> Callable[[StepContext], bool]:
    """A predicate on StepContext for a selector ``NAME[@iter=K][#CALL][:backward]``."""
    sel = parse_selector(where)

    def matches(ctx: StepContext) -> bool:
        if ctx.phase != sel.phase or (sel.iteration is not None and ctx.iteration != sel.iteration) or \
                (sel.call is not None and ctx.call != sel.call):
            return False
        return sel.matches_name(ctx.name, ctx.paper.get("label"), ctx.module_path, ctx.module)

    return matches


@dataclass
class Pending:
    """What to do once a step has been handed to the writer."""

    action: str  # "stop" or "pdb"
    message: str
    error: type[BaseException]


class Monitor:
    """Evaluates a session's steps: anomalies, checks, breakpoints. Cheap when nothing is registered
    and ``on_anomaly`` is "record" (then the session never calls it)."""

    def __init__(self, on_anomaly: str = "record") -> None:
        self.on_anomaly = check_action(on_anomaly, "on_anomaly")
        self._stopped = False

    def active(self) -> bool:
        return self.on_anomaly != "record" or bool(_CHECKS) or bool(_BREAKPOINTS)

    def rearm(self) -> None:
        """A stop that was not carried out (an overflow GradScaler handled): the next anomaly stops."""
        self._stopped = False

    def evaluate(self, ctx: StepContext, nonfinite: str | None) -> tuple[list[dict[str, Any]], Pending | None]:
        """Alerts for the step and the first action it calls for (None: go on). ``nonfinite``: what
        the session found non-finite at this step (``nonfinite_message``), or None."""
        alerts: list[dict[str, Any]] = []
        pending: Pending | None = None
        with _LOCK:
            checks, breakpoints = list(_CHECKS.values()), list(_BREAKPOINTS)
        for check in checks:
            alert = _run_check(check, ctx)
            if alert is not None:
                alerts.append(alert)
        for bp in breakpoints:
            fired, alert = _run_breakpoint(bp, ctx)
            if alert is not None:
                alerts.append(alert)
            if fired and bp.action != "record" and pending is None:
                pending = Pending(bp.action, f"breakpoint {bp.name!r} at {ctx.describe()}", BreakpointStop)
        if self.on_anomaly != "record" and pending is None and not self._stopped and nonfinite is not None:
            pending = Pending(self.on_anomaly, nonfinite, NonFiniteError)
        if pending is not None and pending.action == "stop":
            self._stopped = True  # one stop: the steps the exception unwinds through are not stopped again
        return alerts, pending


_GIVEN = {"input": "input", "param": "parameter", "buffer": "buffer", "grad_output": "grad output"}


def nonfinite_message(ctx: StepContext, tensor: TensorItem, tensors: list[TensorItem] | tuple[()] = (),
                      second_order: bool = False, within: str | None = None, user: str | None = None) -> str:
    """'Eq. 2 (smooth_relu) forward, iteration 17, call 3: output has 12 NaN'. A gradient is named as
    one ("the gradient of bias has 4 NaN", not the finite parameter); where the step's own inputs among
    ``tensors`` (the step's records) already held NaN or Inf, a grad output the loss made NaN, a
    parameter the optimizer wrote, the message says it came in, not made there. ``second_order``: a
    backward step through a graph of gradients (layout.SECOND_ORDER_NOTE), whose gradients hold terms
    its finite grad outputs do not show: the message says it came in that way, and, where it runs inside
    another backward step (``within``: that step described; a gradient penalty recorded as a step, whose
    own code used those gradients), that the terms were made there; where it does not, but a backward step
    before it in its pass is of a call that took those gradients itself (``user``: that step described; a
    penalty given the critic's output and its input), that they were made by it."""
    role = layout.role_name(tensor.role)
    label = f"the gradient of {tensor.name}" if role in layout.GRAD_ROLES else tensor.name
    text = f"{ctx.describe()}: {label} has {_counts(tensor.stats)}"
    phase = layout.PHASES.index(ctx.phase)
    given, nan = [], False
    for t in tensors:
        kind = _GIVEN.get(layout.role_name(t.role))
        if kind is not None and t.role in layout.INPUT_ROLES[phase]:
            stats = t.stats.cpu().tolist() if isinstance(t.stats, torch.Tensor) else t.stats
            if stats[6] or stats[7]:
                name = "" if kind == "grad output" and t.name == "output" else f" {t.name}"
                given.append(f"its {kind}{name} already held {_counts(stats)}")
                nan = nan or bool(stats[6])
    if given:  # (Inf alone may be a -inf mask the step takes at every call: said, not judged)
        more = f" (and {len(given) - 1} more of its inputs)" if len(given) > 1 else ""
        text += (f"; {'it came in: ' if nan else ''}{given[0]}{more} when the "
                 f"{'call' if ctx.phase == 'forward' else 'backward step'} began")
    elif second_order:
        if within:
            where = f"in {within}, whose backward this one runs inside (pdbg bisect names the operation)"
        elif user:
            where = (f"by {user}, whose forward took them with create_graph=True itself; record it as a module holding "
                     "the critic to have its operation named")
        else:
            where = "a gradient penalty outside every recorded step?"
        text += ("; it came in through the graph of gradients an earlier backward pass took with create_graph=True "
                 f"(second-order terms, made where those gradients were used: {where}), not through its finite grad "
                 "outputs")
    return text


def _counts(stats: Any) -> str:
    """'12 NaN', '1020 NaN and 4 Inf' of a record's statistics."""
    nan, inf = stats[6], stats[7]
    return " and ".join(f"{int(n)} {label}" for n, label in ((nan, "NaN"), (inf, "Inf")) if n)


def _run_check(check: Check, ctx: StepContext) -> dict[str, Any] | None:
    try:
        verdict = check.fn(ctx)
    except Exception as exc:  # the user's check is at fault, not the step: say so on the step
        return {"check": check.name, "kind": "check", "message": f"the check raised {type(exc).__name__}: {exc}"}
    if verdict is False or isinstance(verdict, str):
        return {"check": check.name, "kind": "check",
                "message": verdict if isinstance(verdict, str) else f"check {check.name!r} failed"}
    return None


def _run_breakpoint(bp: Breakpoint, ctx: StepContext) -> tuple[bool, dict[str, Any] | None]:
    if not bp._match(ctx):
        return False, None
    try:
        fired = True if bp.when is None else bool(bp.when(ctx))
    except Exception as exc:
        return False, {"check": bp.name, "kind": "breakpoint",
                       "message": f"the breakpoint condition raised {type(exc).__name__}: {exc}"}
    if not fired:
        return False, None
    bp.hits += 1
    return True, {"check": bp.name, "kind": "breakpoint", "action": bp.action,
                  "message": f"breakpoint {bp.name!r} fired"}


def perform(pending: Pending, flush: Callable[[], Any]) -> None:
    """Carry out a stop or pdb action after the step was handed to the writer."""
    flush()
    if pending.action == "stop":
        raise pending.error(pending.message)
    frame = _user_frame()
    print(f"pdbg: {pending.message}; opening pdb in the calling code (c continues)", file=sys.stderr, flush=True)
    pdb.Pdb().set_trace(frame)


def _user_frame() -> Any:
    """The innermost frame outside PaperDebugger and torch: the code that called the step."""
    frame = sys._getframe(1)
    while frame is not None:
        path = str(Path(frame.f_code.co_filename).resolve()) if not frame.f_code.co_filename.startswith("<") else ""
        if path and not path.startswith((_HERE, _TORCH)):
            return frame
        frame = frame.f_back
    return sys._getframe(1)


def stats_dict(stats: Any) -> dict[str, float]:
    if isinstance(stats, torch.Tensor):
        stats = stats.cpu().tolist()
    return dict(zip(layout.STAT_NAMES, (float(v) for v in stats)))
