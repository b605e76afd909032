"""The live side of a recording: what happens on every call of a paper step, forward and backward.

Everything here runs on the training thread (or autograd's), so it only snapshots: statistics, and
copies of tensor bytes (of parameters and buffers only when new, found by their hash). Encoding and
writing happen on the writer thread (pipeline.py). Any failure in here is caught, reported once, and
recording degrades; the user's call always proceeds.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import itertools
import math
import os
import sys
import threading
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.autograd import Variable
from torch.nn.utils import parametrize as _parametrize

from . import autohooks, compiled, flight, jsonval, modstack, monitors, skeleton, snapshot, taps, transforms
from . import payload as payload_mod
from . import stats as stats_mod
from .items import ForgetIterations, PayloadItem, RingWritten, StepItem, TensorItem, copy_buffer, log_ring_write
from .quiet import quiet
from .store import layout

if TYPE_CHECKING:
    from .pipeline import Pipeline

ACTIVE: Session | None = None  # the recording in progress, if any (set by recorder.record)

ROLE = {name: i for i, name in enumerate(layout.ROLES)}
# Roles whose CPU bytes are addressed by content when captured (hashed on the training thread): a
# parameter or buffer often holds the same bytes at many records (a module called several times per
# iteration, frozen weights at every iteration), which are then copied and held once. The other
# roles' bytes (activations, gradients) are new at almost every record: they are copied under a
# token and hashed by the writer thread, only if they are written (see _cpu_payload).
_BY_CONTENT = frozenset({"param", "buffer"})
# Roles whose sparse tensors keep their parts (indices, values) as component records where the step keeps
# payloads, so that a replay makes them again and compares them bit for bit: a forward step's own (1.19), and a
# backward step's sparse gradients (1.24: nn.Embedding(sparse=True)'s weight grad; before, statistics only).
_SPARSE_PARTS_KEPT = frozenset({"input", "output", "param", "buffer", "grad_output", *layout.GRAD_ROLES})
# Roles whose tensors a replay gives the call again: where one did not begin at a multiple of layout.ALIGNMENT
# bytes (a view xs[t]), its address modulo that is noted in the step's extra "misaligned" (1.25), for a replay to
# give it memory there again (see Session._note_misaligned).
_PLACED = frozenset({ROLE[r] for r in ("input", "param", "buffer", "grad_output")})
_SEEN_LIMIT = 1 << 20  # content keys remembered on the training thread to skip copies
_MODULE_DOCS_LIMIT = 4096  # module documents remembered (modules made anew at every step would grow it)
_UNINITIALIZED = torch.nn.parameter.UninitializedTensorMixin
_SUBCLASS_ATTRS = 64  # a tensor subclass instance's attributes recorded at most (see Session._note_subclass)


def _is_dtensor(t: torch.Tensor) -> bool:
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # (loaded where one exists)
    return dtensor is not None and isinstance(t, dtensor)


def _held_values(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding the values of a wrapper subclass ``t`` that holds no memory of its own, where the
    recorder knows which: a DTensor's local shard (this rank's part; nothing is communicated), an
    AsyncCollectiveTensor's result (waited for: any use of it waits, and the values are the same). None
    for any other tensor (recorded as itself; a wrapper of another kind as metadata: ``payload.wrapper``)."""
    if _is_dtensor(t):
        return t._local_tensor
    funcol = sys.modules.get("torch.distributed._functional_collectives")
    waiting = getattr(funcol, "AsyncCollectiveTensor", None)
    if waiting is not None and isinstance(t, waiting):
        return t.trigger_wait() if not t.completed else t.elem
    return None
_UNGRADED_KEPT = 256  # calls without grad inside activation checkpointing remembered per step and module

# -1 on a thread where autograd's engine is not running a backward pass. Where torch lacks it,
# recomputations by activation checkpointing are recorded as calls.
_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_checkpoint_code: dict[Any, bool] = {}  # code object -> it belongs to activation checkpointing


def in_checkpointing(depth: int = 2) -> bool:
    """Whether activation checkpointing is on this thread's call stack: ``torch.utils.checkpoint``
    (and what wraps it), DeepSpeed's ``checkpointing.py``, FairScale's ``checkpoint_activations.py``,
    Megatron's ``CheckpointFunction``. The code objects' answers are remembered."""
    frame: Any = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        try:
            hit = _checkpoint_code.get(code)
        except TypeError:  # code torch.compile rewrote can hold unhashable constants (dicts): not remembered
            hit = _is_checkpoint_code(code)
        if hit is None:
            if len(_checkpoint_code) > 65536:
                _checkpoint_code.clear()
            hit = _checkpoint_code[code] = _is_checkpoint_code(code)
        if hit:
            return True
        frame = frame.f_back
    return False


def _is_checkpoint_code(code: Any) -> bool:
    return "checkpoint" in os.path.basename(code.co_filename) or "Checkpoint" in code.co_qualname


_top_saved_hooks: Callable[[bool], Any] = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks",
                                                  lambda tracing: None)
_pop_saved_hooks: Callable[[], Any] | None = getattr(torch._C._autograd, "_pop_saved_tensors_default_hooks", None)
_push_saved_hooks: Callable[..., Any] | None = getattr(torch._C._autograd, "_push_saved_tensors_default_hooks", None)


def _saved_tensors_hooks(checkpointed: bool = False) -> dict[str, Any] | None:
    """The saved-tensor hooks set now (``torch.autograd.graph.saved_tensors_hooks``, the innermost pair: a
    loop packing the activations its forward saves to bfloat16), as a step's extra keeps them: ``pack``
    and ``unpack``, each ``{"ref": "module:QualName", "file": its source file}`` (a callable that is no
    function: its class's reference, ``"function": false``). None where none are set.

    Where the innermost pair is activation checkpointing's (torch's, DeepSpeed's), what the call saves is
    recomputed, but the checkpoint saved the arguments it recomputes from through the pair set outside it,
    and its backward reads what they made of them: that pair, with ``"checkpoint": true``, which a replay
    cannot apply as the checkpoint did. ``checkpointed``: the call runs inside a reentrant checkpoint's
    forward, without grad, where the pair set now is the one its arguments were saved through."""
    try:
        hooks = _top_saved_hooks(False)
    except Exception:  # noqa: BLE001 - (hooks disabled, or a torch that tells otherwise): none known
        return None
    if not isinstance(hooks, tuple) or len(hooks) != 2:
        return None
    if any(_checkpointing_hook(h) for h in hooks):
        hooks, checkpointed = _saved_hooks_below(hooks), True
        if hooks is None or any(_checkpointing_hook(h) for h in hooks):
            return None
    if checkpointed and all(_hook_ref(h)["ref"].startswith(_SAVE_ON_CPU) for h in hooks):
        return None  # (lossless: the checkpoint recomputes from the very values)
    doc = {"pack": _hook_ref(hooks[0]), "unpack": _hook_ref(hooks[1])}
    return {**doc, "checkpoint": True} if checkpointed else doc


_SAVE_ON_CPU = "torch.autograd.graph:save_on_cpu."  # torch's offloading hooks' references begin so


def _any_saved_hooks() -> bool:
    try:
        return _top_saved_hooks(False) is not None
    except Exception:  # noqa: BLE001 - (hooks disabled): none known
        return False


def _saved_hooks_below(top: tuple[Any, Any]) -> tuple[Any, Any] | None:
    """The saved-tensor hooks set outside the innermost pair ``top``: torch tells only the innermost, so it is
    taken off for the look and put back as it was."""
    if _pop_saved_hooks is None or _push_saved_hooks is None:
        return None
    try:
        _pop_saved_hooks()
    except Exception:  # noqa: BLE001 - (a torch that keeps them otherwise): none known
        return None
    try:
        below = _top_saved_hooks(False)
    except Exception:  # noqa: BLE001
        below = None
    finally:
        _push_saved_hooks(*top)
    return below if isinstance(below, tuple) and len(below) == 2 else None


def _checkpointing_hook(fn: Any) -> bool:
    """Whether a saved-tensor hook is activation checkpointing's: code of torch's or an installed library's
    (not the training code's own, whatever its file is called) that ``in_checkpointing`` takes for it."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    if code is None or not _is_checkpoint_code(code):
        return False
    module = getattr(fn, "__module__", None)
    return (isinstance(module, str) and module.partition(".")[0] == "torch") or any(
        f"{os.sep}{where}{os.sep}" in code.co_filename for where in _INSTALLED)


def _hook_ref(fn: Any) -> dict[str, Any]:
    """A saved-tensor hook as ``_saved_tensors_hooks`` keeps it."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if isinstance(fn, types.FunctionType):
        return {"ref": f"{module}:{name}", "file": fn.__code__.co_filename}
    ref = f"{module}:{name}" if isinstance(module, str) and isinstance(name, str) else jsonval.type_ref(fn)
    return {"ref": ref, "function": False}  # (a bound method, a partial, an object with __call__)


class RecorderWarning(UserWarning):
    """The recorder hit a problem and degraded; training goes on."""


def warn(message: str, stacklevel: int = 2) -> None:
    """``warnings.warn(message, RecorderWarning)``, which never raises into the user's code: where the
    warning filters make it an exception (``python -W error``), the message goes to stderr instead,
    and what the recorder was doing (degrading, closing) goes on."""
    try:
        warnings.warn(message, RecorderWarning, stacklevel=stacklevel + 1)
    except Warning:
        print(f"RecorderWarning: {message}", file=sys.stderr, flush=True)


_INSTALLED = ("site-packages", "dist-packages")  # the directories installed packages live in


def _outside_recorder(installed: bool = False) -> int:
    """``warn``'s stacklevel for the first frame, from its caller's caller out, of code that is not the
    recorder's own (nor torch's or the standard library's hooks it ran through). ``installed``: nor an
    installed library's either (transformers' model that called the layer, Lightning's or the Trainer's
    loop that called the training step): the user's own line, where the stack holds one."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level, first = sys._getframe(2), 2, None
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith((here, "<")) or os.sep + "torch" + os.sep in name):
            first = level if first is None else first
            if not installed or not any(f"{os.sep}{where}{os.sep}" in name for where in _INSTALLED):
                return level
        frame, level = frame.f_back, level + 1
    return first if first is not None else 2


def _positional_names(module: torch.nn.Module | None) -> list[str]:
    """The names of ``module.forward``'s positional parameters, to name an argument in a message."""
    import inspect

    try:
        parameters = inspect.signature(module.forward).parameters.values()  # type: ignore[union-attr]
    except (TypeError, ValueError, AttributeError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _parameter_names(fn: Any) -> list[str]:
    """The names of a function step's positional parameters, to name an argument in a message."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@functools.cache
def _is_cache_type(cls: type) -> bool:
    return any(c.__name__.endswith("Cache") for c in cls.__mro__)


class WriterStopped(Exception):
    """The writer thread failed or was given up on: nothing more can be recorded. Not a RuntimeError,
    which capture takes for a tensor it cannot copy."""


@dataclass(eq=False)
class Frame:
    """One step in progress (forward call or backward of a call)."""

    index: int
    phase: int
    defn: Any
    module: torch.nn.Module | None
    path: str
    call: int
    parent: int
    iteration: int
    t_start: float
    payloads: bool
    forward: int = layout.NO_REF
    # The outermost step enclosing it when it began, itself where none did (a backward: its forward's): the
    # calls of a step in one such pass are siblings (one expert an MoE layer's top-2 loop calls twice)
    root: int = layout.NO_REF
    rng: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] | None = None
    args_doc: Any = None
    output_doc: Any = None
    tensors: list[TensorItem] = field(default_factory=list)
    expectations: list[dict[str, Any]] = field(default_factory=list)
    exception: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    t_end: float = 0.0
    alerts: list[dict[str, Any]] = field(default_factory=list)  # from checks and breakpoints
    pending: Any = None  # a monitor's stop or pdb action, carried out once the step is submitted
    checked: bool = False  # nonfinite below has been looked for
    anomaly: tuple[int, str] | None = None  # (index, message) of what nonfinite (or an earlier call) shows
    dropped: int = 0  # payloads not recorded: the store could not keep up (when_slow="drop_payloads")
    nonfinite: TensorItem | None = None  # the first result tensor holding NaN or Inf
    collectives: list[dict[str, Any]] = field(default_factory=list)  # torch.distributed calls made inside
    vmap: dict[str, list[int]] | None = None  # under torch.func: record name -> vmap batch dims (transforms)
    vmap_randomness: list[str] | None = None  # under vmap: each level's randomness, innermost first (transforms)
    module_doc: dict[str, Any] | None = None  # the module's skeleton when the call began (a backward: its forward's)
    definition: dict[str, Any] | None = None  # its definition document when the call began (a backward: its forward's)
    # The input tensors outside autograd's graph with their version counters when the call began, and
    # the module's own parameters with theirs: those the call changes in place (an EMA update, a parameter
    # update under no_grad, a router's load-balancing bias, a LoRA base weight merged in forward) are
    # recorded again as it leaves them ("after:<input>", "after:<parameter>", role output). Cleared when
    # the call ends.
    # An inference tensor (made under torch.inference_mode: a KV cache) has no version counter (None): its kept
    # bits alone tell (a CPU one up to layout.KEPT_INPUT_BYTES).
    versions: list[tuple[str, torch.Tensor, int | None, torch.Tensor | None]] | None = None
    own_grads: list[str] = field(default_factory=list)  # a backward's parameter grads that are the call's own
    # A forward's arguments that share memory ("aliases") or are its module's parameters ("parameter_args"), the
    # records given to a call that began at an address not aligned ("misaligned"), as the step's extra names them
    arguments: dict[str, Any] | None = None
    link: Any = None  # a forward's BackwardLink, when it has one
    duals: list[str] = field(default_factory=list)  # record names of forward-AD dual tensors (taps.dual)
    # A backward through a graph of gradients: the backward step before it in its pass whose call took those
    # gradients itself, where one did (see Session._gradient_user_of)
    gradient_user: Frame | None = None


# Writes through ``.data`` (an EMA or Polyak update, ``b_t.data.copy_(b.data)``) do not bump the
# tensor's version counter. Small CPU tensors are therefore also kept as bits, and compared: a step's
# inputs outside autograd's graph until the call ends, a module's buffers until its next call.
_KEPT_INPUT_BYTES = layout.KEPT_INPUT_BYTES  # (layout.data_writes_seen: what readers take of it)
_KEPT_BUFFER_BYTES = 1 << 16
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _buffers_of(module: torch.nn.Module, transformed: bool) -> list[tuple[str, torch.Tensor]]:
    """A module's buffers by name; ``transformed`` (a call under torch.func): the tensors behind the
    transforms' wrappers, which outlive the call (a wrapper is made anew at each)."""
    return [(n, transforms.plain(b)[0] if transformed else b) for n, b in module.named_buffers()]


_NAMED_WALK = (torch.nn.Module.named_parameters, torch.nn.Module._named_members, torch.nn.Module.named_modules)


def _parameter_places(module: torch.nn.Module) -> list[tuple[str, weakref.ref[torch.nn.Module], str]] | bool:
    """Where ``module.named_parameters()`` finds each parameter: (its name, the module that holds it,
    weakly, its key in that module's ``_parameters``), in its order (Session._parameters_of). False
    where that walk is not torch's own (a class of the tree that overrides it, tables that are not
    dicts: a TorchScript module's) or its result is not the one found so: named_parameters is then
    called at every call."""
    cls = type(module)
    if (cls.named_parameters, cls._named_members) != _NAMED_WALK[:2]:
        return False
    places: list[tuple[str, weakref.ref[torch.nn.Module], str]] = []
    memo: set[int] = set()
    for prefix, m in module.named_modules():
        if type(m).named_modules is not _NAMED_WALK[2] or type(m._parameters) is not dict:
            return False
        for key, p in m._parameters.items():
            if p is None or id(p) in memo:
                continue
            memo.add(id(p))
            places.append((f"{prefix}.{key}" if prefix else key, weakref.ref(m), key))
    found = [(name, owner()._parameters[key]) for name, owner, key in places]
    if [(n, id(p)) for n, p in module.named_parameters()] != [(n, id(p)) for n, p in found]:
        return False
    return places


def _kept(t: torch.Tensor, limit: int) -> torch.Tensor | None:
    try:  # (a subclass, a quantized tensor: its version counter alone tells; a byte view of one may crash;
        # so may a read of a tensor larger than its storage)
        if (type(t) not in _PLAIN_TENSORS or t.is_quantized or t.is_nested or t.device.type != "cpu"
                or t.layout != torch.strided or t.numel() * t.element_size() > limit or not payload_mod.backed(t)):
            return None
        return t.detach().clone()
    except Exception:  # noqa: BLE001
        return None


def _same_bits(kept: torch.Tensor | None, t: torch.Tensor) -> bool:
    """Whether ``t`` holds the bits ``kept`` does (True when nothing was kept to tell)."""
    if kept is None:
        return True
    try:
        if kept.shape != t.shape or kept.dtype != t.dtype or not payload_mod.backed(t):  # (bytes gone: changed)
            return False
        return torch.equal(kept.reshape(-1).view(torch.uint8), t.detach().reshape(-1).view(torch.uint8))
    except RuntimeError:  # (a dtype without a byte view: the version counter alone tells)
        return True


@dataclass
class BackwardLink:
    """Ties a forward call to its backward: names of the tapped tensors and the open backward frame."""

    fwd: Frame
    input_names: list[str | None] = field(default_factory=list)  # None: a grad input not recorded
    output_names: list[str | None] = field(default_factory=list)  # None: a tap that went unused
    handles: list[Any] = field(default_factory=list)
    frame: Frame | None = None
    hooked: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # parameters with a hook (handles)
    # Every output autograd reaches is tapped: through them, this call's backward begins at an
    # output's tap, before its parameters' gradients come (see Session._on_param_grad).
    complete: bool = False
    graphed: bool = False  # its gradients were taken with create_graph=True (a gradient penalty's first pass)
    # Those gradients were taken while the call itself ran (``gradient_penalty(d_out, interp)`` calling
    # torch.autograd.grad): the second-order terms a later pass sends through them are its code's
    took: bool = False
    # The module's parameters that require grad, and autograd's sequence number when the call began:
    # at its end, the nodes of its graph that use them are found (taps.parameter_uses).
    params: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    since: int = -1
    until: int = -1  # the sequence number when its graph was walked (the call's nodes are since..until)
    outer: BackwardLink | None = None  # the link of the call this one ran inside, if any
    reused: bool = False  # its graph and another call's share nodes: its parameter grads are totals over them
    finished: bool = False  # its backward reached its inputs' tap (in the pass under way)
    # Parameter -> its uses in this call's graph, whose contributions are recorded as this call's own
    # parameter grad (hooks on those nodes); the others are hooked as totals (``hooked``).
    own: dict[str, int] = field(default_factory=dict)
    # In the backward pass under way: parameter -> (uses whose contribution came, their sum so far).
    sums: dict[str, tuple[int, torch.Tensor | None]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)  # in the pass under way: parameters whose own grad is recorded
    aside: int = -1  # the graph task of a pass found not to go through the call's graph (Session._went_through)
    # The items of the arguments' lists, dicts and dataclasses that hold tapped tensors while the call
    # runs, put back when it returns (taps.restore)
    undo: taps.Undo = field(default_factory=list)
    # The top-level leaf arguments that require grad (record name, tensor), which no tap takes (see
    # taps.leaves_apart): their grad inputs are the sums of their uses' contributions in the call's graph,
    # found with the parameters' (_hook_params); record name -> those uses, and in the pass under way as
    # ``sums`` and ``done`` are for parameters
    leaf_args: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    arg_uses: dict[str, int] = field(default_factory=dict)
    arg_sums: dict[str, tuple[int, torch.Tensor | None]] = field(default_factory=dict)
    arg_done: set[str] = field(default_factory=set)  # in the pass under way: those its backward reached
    arg_hooked: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # leaf arguments with a hook (handles)
    # (1.31) the leaf arguments that are parameters of the networks it was given: recorded as network_grad
    networks: frozenset[str] = frozenset()
    # A leaf passed in several places that torch gives the call through its module's backward hooks' node
    # (taps.split_places): that node's edge k -> the record name of its place, whose grad input it is
    split_leaves: dict[int, str] = field(default_factory=dict)
    # The tapped arguments with their taps' aliases, looked at when the call returns; those it changed in
    # place through their aliases, rebased then, until its outputs are tapped (taps.rebase_changed)
    watched: taps.Watched = field(default_factory=list)
    rebased: taps.Rebased = field(default_factory=dict)
    # Its input taps' nodes with their aliases, until its graph is walked when it returns: those with several
    # uses pass each use's gradient on apart (taps.pass_apart)
    tap_nodes: taps.TapNodes = field(default_factory=list)


def _inner_first(frames: list[Frame]) -> list[Frame]:
    """A backward pass's steps (in index order) with every step after the steps nested in it, as a
    forward's finish: each step's subtree follows it in index order, so the last index of that subtree,
    then the deeper step first, orders them. The monitor's first stop then falls on the innermost step
    of the first that went non-finite, the step bisect names. A step through a graph of gradients
    (layout.SECOND_ORDER_NOTE: a critic's backward inside a gradient penalty's) comes after the step it runs
    inside: the terms it passes on were made in that step's code, which bisect names where its inputs were
    recorded finite (bisect._innermost)."""
    by_index = {f.index: f for f in frames}
    last = {f.index: f.index for f in frames}
    depth = dict.fromkeys(last, 0)
    for f in frames:
        if layout.SECOND_ORDER_NOTE in f.notes:
            continue
        up = by_index.get(f.parent)
        while up is not None:
            last[up.index] = max(last[up.index], f.index)
            depth[f.index] += 1
            up = by_index.get(up.parent)
    return sorted(frames, key=lambda f: (last[f.index], -depth[f.index]))


class Session:
    """State of one active recording."""

    def __init__(self, pipeline: Pipeline, *, mode: str, every: int, model: torch.nn.Module | None,
                 t0: float, modules: Any = None, on_anomaly: str = "record", keep: int = 2,
                 max_ring_bytes: int = 4 << 30, start_iteration: int = 0) -> None:
        self.pipeline, self.mode, self.every, self.t0 = pipeline, mode, every, t0
        self.lock = threading.RLock()
        self.local = threading.local()
        compiled.keep_dynamo_out()
        self.modules = modstack.ModuleStack(model)
        self.start_iteration = start_iteration  # the first iteration's number (a resumed run's checkpoint step)
        self.iteration = start_iteration
        self.next_index = 0
        # Forward calls of each step in this iteration: per name, paper label and code (two classes
        # named Attention, Eq. 3 and Eq. 5, count their own calls; the instances of one class share,
        # as do the functions one definition makes). The code objects are kept alive by their steps.
        self.calls: dict[tuple[str, str, int], int] = {}
        self.seen: set[tuple[int, int, int]] = set()  # content keys whose bytes went to the writer
        # id(parameter or buffer) -> captures since its bytes were last found held (see _by_content)
        self._new_bytes: dict[int, int] = {}
        self.enabled = True
        self.closed = False  # set by close(): callbacks of graphs that outlive the recording do nothing
        self.failure: str | None = None
        self._slow_warned = False  # the warning that payloads are being dropped was given
        self._unread_warned = False  # the warning that a tensor could not be captured was given
        self._modules_met = False  # whether a step was ever given a network (_argument_module): _encode looks then
        self._cache_warned = False  # the warning that a step was given a cache object that is not data was given
        self._unrecorded_warned: set[int] = set()  # steps (id of their definition) warned of an argument not data
        self._rebuild_warned = False  # the warning that a recorded module cannot be rebuilt by a replay was given
        self._lazy_warned: set[Any] = set()  # the steps warned of for returning a generator (_warn_if_lazy)
        self._defs_met: set[Any] = set()  # the step definitions met so far (StepDef.unfound looked at)
        # Names of payloads sent before they are hashed; next() is atomic under the GIL.
        self._tokens = itertools.count(1)
        self._links: list[BackwardLink] = []  # forward calls whose backward may still come
        # Those of them with parameter grads of their own, by the sequence number their call began at
        # (see _reused_nodes): ``_span_starts[i]`` is ``_spans[i].since``.
        self._span_starts: list[int] = []
        self._spans: list[BackwardLink] = []
        self._instances: dict[int, tuple[Any, int]] = {}  # id(module) -> (weak module, its number: _module_doc)
        self._instance_numbers = itertools.count(1)
        self._reached: dict[int, BackwardLink] = {}  # nodes made outside every call -> the first call reaching it
        self._pass: list[BackwardLink] = []  # backward frames open in the current backward pass
        # The same, by their forward's index, and how many of them each module has (a recurrent cell
        # opens thousands in one pass: looked up, not searched).
        self._pass_frames: dict[int, Frame] = {}
        self._gradient_user: Frame | None = None  # in the pass under way, the last such step (Frame.gradient_user)
        self._ended: dict[int, Frame] = {}  # a finished backward pass's steps by index, while they are monitored
        # id(parameter) -> (the last of its gradient hooks' keys looked at, the user's among them)
        self._hook_scan: dict[int, tuple[int, dict[int, Any]]] = {}
        self._pass_modules: collections.Counter[int] = collections.Counter()
        self._callback_queued = False
        # The backward passes under way, outermost first: the thread that began each and the nodes it begins
        # at (None: not told), given by run._BackwardCalls (see _went_through)
        self._roots: list[tuple[int, tuple[Any, ...] | None]] = []
        self._in_order: dict[int, Callable[[], None]] = {}  # id(a pass's roots entry) -> what undoes its hooks
        # id(module) -> (weak reference, state key, document, the generator objects it holds: _module_entry):
        # weak, so that modules made anew at every call (and their parameters) are not kept alive by the recording.
        # The last: [where its parameters are found (_parameters_of), once asked for], for as long as the key holds.
        self._module_docs: dict[int, tuple[weakref.ref[torch.nn.Module], tuple[Any, ...], dict[str, Any],
                                           tuple[tuple[str, Any, Any], ...], list[Any]]] = {}
        # id(module) -> (weak reference, {buffer name: (weak buffer, its version counter)}) as its last
        # recorded call left them (see _buffers_written)
        self._left_buffers: dict[int, tuple[weakref.ref[torch.nn.Module], dict[str, tuple[Any, int]]]] = {}
        self._known_settings: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.rng = snapshot.RngReader()
        stats_mod.prepare()  # the one-pass statistics kernel: compiled or loaded once per process
        self.monitor = monitors.Monitor(on_anomaly)
        self.ring = flight.FlightRing(keep, max_ring_bytes) if mode == "flight" else None
        self.dumps: list[dict[str, Any]] = []  # flight mode: when and why the ring was written (see _log_dump)
        self._direct_iteration = -1  # flight mode: after an anomaly its iteration's bytes go straight out
        self._ring_iteration = -1  # flight mode: the iteration the ring last made room for
        self._ring_noted = -1  # flight mode: the iteration _ring_note listed last (once per iteration, not per payload)
        self.shared: Any = None  # flight mode: the ring's bytes in shared memory (share_ring)
        self._unshared_warned = False
        self.selector = autohooks.ModuleSelector(modules)
        self.autocapture = autohooks.GlobalCapture(self, self.selector) if self.selector else None
        self._collective_seq = -1  # torch.distributed collectives recorded so far, in call order
        self.pauses = 0  # while above 0 no step starts (Run.pause: a framework's evaluation)
        self.guard: Callable[[], bool] | None = None  # when set, a step starts only if it says so (Run.only_while)
        self.on_nonfinite: Callable[[int, str], Any] | None = None  # told of the first NaN/Inf step (once)
        # Mixed precision: the iteration's loss went through GradScaler.scale, so Inf/NaN in its
        # gradients may be an overflow the scaler handles; the anomaly action of a backward step
        # waits for GradScaler.step (run._GradScaling).
        self.loss_scaled = False
        self.deferred: monitors.Pending | None = None
        self.stopped_by: BaseException | None = None  # the stop an anomaly action or breakpoint raised
        # Activation checkpointing: (step name, id(module)) -> calls of this iteration that ran without
        # grad inside checkpointing, latest last; their recomputation in backward builds their graph.
        self._ungraded: dict[tuple[str, int], list[Frame]] = {}
        self._unreported: list[Frame] = []  # steps with device statistics: on_nonfinite looks once per iteration
        # Inf (no NaN) in a step's results is meant when its calls make it every time (an additive -inf
        # mask), as first_nonfinite judges it: per step (name, module path, phase: each expert of an MoE its
        # own) and call number in the iteration, whether its last call held Inf; a step's first call's Inf
        # waits for the next call with its number. Where no call had its number before (a run that never
        # marks its iterations), the step's last call stands for it, of another pass (Frame.root) where that
        # one held Inf: a sibling's Inf is no habit. Inf on part of a result an earlier call of the step held
        # Inf on part of too is a mask's, whatever the calls in between held (a batch without padding makes
        # none).
        self._tied: tuple[Any, dict[int, tuple[str, ...]]] | None = None  # (weak root, Session._tied_params)
        self._inf_last: dict[tuple[Any, ...], bool] = {}  # (name, path, phase, call) -> last call's
        # (name, path, phase) -> (its last call's pass, that call's, the last call's of an earlier pass or None)
        self._inf_step: dict[tuple[Any, ...], tuple[int, bool, bool | None]] = {}
        self._inf_first: dict[tuple[Any, ...], tuple[int, str, bool]] = {}  # -> (index, message, on part only)
        self._inf_parts: dict[tuple[Any, ...], set[tuple[int, str]]] = {}  # (name, path, phase) -> (role, name)
        # Python's recursion limit before a recursion of steps raised it (_recursion_room), and what it was raised to
        self._recursion_limit: int | None = None
        self._raised_limit = 0

    # -- bookkeeping -----------------------------------------------------------------------------
    def _stack(self) -> list[Frame]:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def _innermost(self) -> Frame | None:
        """The step running on this thread, innermost where steps nest."""
        stack = self._stack()
        return stack[-1] if stack else None

    def in_step(self) -> bool:
        """Whether a step runs on this thread now, with capture on (``collective`` keeps its call)."""
        return self.enabled and not getattr(self.local, "busy", False) and self._innermost() is not None

    def _warn_of_cache(self, frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A step given a cache object (a ``DynamicCache``: ``generate()``, a Hugging Face forward with
        ``use_cache``) that is not recorded as data is recorded but cannot be replayed: say so once,
        naming the argument, where it happens rather than guessing from a config (``generate()``
        passes its cache whatever ``config.use_cache`` says)."""
        # (at every step until it warns: the types first, the forward's signature only for a cache found)
        given: list[tuple[Any, Any, Any]] = [(i, v, d) for i, (v, d) in enumerate(zip(args, frame.args_doc.get(
            "args", ()))) if v is not None and _is_cache_type(type(v))]
        given += [(k, v, frame.args_doc.get("kwargs", {}).get(k)) for k, v in kwargs.items()
                  if v is not None and _is_cache_type(type(v))]
        for key, value, doc in given:
            if skeleton.opaque_in(doc) is None:
                continue
            names = _positional_names(frame.module) if isinstance(key, int) else []
            name = key if isinstance(key, str) else names[key] if key < len(names) else f"argument {key}"
            self._cache_warned = True
            where = f"{frame.defn.name}{f' at {frame.path}' if frame.path else ''}"
            warn(f"PaperDebugger: {where} was given {name}, a {type(value).__name__} that is not recorded as data, "
                 "so its steps called with a cache are recorded but cannot be replayed (generate() always passes one, "
                 "also inside a training step); steps called without one replay: to replay training's forward, "
                 "call it with use_cache=False (or set model.config.use_cache = False)",
                 stacklevel=_outside_recorder(installed=True))
            return

    def _warn_of_unrecorded(self, frame: Frame, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A step given an argument that is not data (a lambda, a function defined inside another, an
        object the encoder does not take apart; a cache is warned of apart) is recorded, but its replay
        is refused: say so once per step, naming the argument and the value, when recording."""
        found = jsonval.first_opaque(frame.args_doc)
        if found is None:
            return
        path, opaque = found
        where, _, rest = path.partition(".")
        key, _, inner = rest.partition(".")
        given = args[int(key)] if where == "args" and key.isdigit() and int(key) < len(args) else kwargs.get(key)
        if given is not None and _is_cache_type(type(given)):
            return
        self._unrecorded_warned.add(id(frame.defn))
        name = key if where == "kwargs" else None
        if name is None:
            names = _positional_names(frame.module) if frame.module is not None else _parameter_names(frame.defn.target)
            name = names[int(key)] if key.isdigit() and int(key) < len(names) else f"argument {key}"
        name = f"{name}.{inner}" if inner else name
        what = jsonval.function_words(opaque) or jsonval.opaque_reason(opaque) or (
            f"a {opaque.type}, which could not be recorded as data (the recorder takes apart containers, "
            "dataclasses and plain objects: pass its tensors as arguments instead)")
        at = f"{frame.defn.name}{f' at {frame.path}' if frame.path else ''}"
        warn(f"PaperDebugger: {at} was given {name}, {what}; its calls given it are recorded but a replay of them is "
             "refused", stacklevel=_outside_recorder(installed=True))

    def _warn_if_not_rebuilt(self, module: torch.nn.Module, doc: dict[str, Any], at: str) -> None:
        """A recorded module holding an attribute that is not data, with no constructor arguments to
        make it again (a lambda kept as an attribute, with no ``pdbg record`` to note the arguments): its steps are
        recorded, but a replay rebuilds it without that attribute, and a step whose code uses it fails.
        Say so once, when recording, not first at the replay."""
        found = skeleton.not_rebuilt(module, doc)
        if found is None:
            return
        self._rebuild_warned = True
        path, key, kind = found
        where = f"{type(module).__name__}{f' at {at}' if at else ''}"
        inner = f" (its {path})" if path else ""
        try:  # a function by its qualified name (torch.optim.swa_utils:get_ema_multi_avg_fn.<locals>.ema_update)
            shown = jsonval.function_label((module.get_submodule(path) if path else module).__dict__.get(key))
        except AttributeError:
            shown = None
        warn(f"PaperDebugger: {where}{inner} holds {key}, {shown or f'a {kind}'} that is not recorded as data and that "
             "a replay cannot make again (its constructor arguments are not known): a replay rebuilds it without it, "
             "and its recorded steps fail to replay where their code uses it; to replay those, record modules that do "
             "not hold it (modules globs for their parts)",
             stacklevel=_outside_recorder(installed=True))

    def _warn_if_lazy(self, frame: Frame, out: Any) -> None:
        """A step that returned a generator, a coroutine or another lazy iterator did its work after the
        call had returned, as its caller iterated or awaited it, outside the step: the recording holds none
        of it, and a replay of the call would compare only the generator's type (replayer.replay refuses
        it). Say so once per step, when recording."""
        kind = jsonval.lazy_kind(out)
        if kind is None or frame.defn in self._lazy_warned:
            return
        self._lazy_warned.add(frame.defn)
        label = f" ({frame.defn.label})" if frame.defn.label else ""
        where = f"{frame.defn.name}{label}{f' at {frame.path}' if frame.path else ''}"
        warn(f"PaperDebugger: step {where} returned {kind}, whose work runs after the call has "
             "returned (as the caller iterates or awaits it), outside the step: the recording holds none of that "
             "work, and a replay of the step is refused; make the step compute its values and return them (a "
             "tensor, a list)", stacklevel=_outside_recorder(installed=True))

    def _new_index(self) -> int:
        with self.lock:
            index = self.next_index
            self.next_index += 1
            return index

    def fail(self, where: str, exc: BaseException) -> None:
        """Stop capturing after an internal error or a failed writer; warn once. Training is never
        interrupted; the run will be ``incomplete``."""
        self.enabled = False
        if self.failure is None:
            if isinstance(exc, WriterStopped):  # its message names the problem and what to do
                self.failure = f"writer: {exc}"
                message = f"PaperDebugger stopped recording: {exc}. Training continues"
            else:
                self.failure = f"{where}: {type(exc).__name__}: {exc}"
                message = f"PaperDebugger stopped recording ({self.failure}); training continues"
            level = _outside_recorder()  # the user's line that called into the recording, not the recorder's
            kept = self._write_ring_before_failure() if self.ring is not None and \
                not isinstance(exc, WriterStopped) else ""
            if isinstance(exc, WriterStopped) and self.pipeline.store_gone():
                warn(message, stacklevel=level)
            else:
                warn(f"{message} and the steps committed so far stay readable{kept}; the run is marked incomplete "
                     "(crashed where not even that can be written)", stacklevel=level)

    def disown(self) -> None:
        """In a forked child (a DataLoader worker): record nothing. The writer thread, the store and
        the flight ring are the parent's; the locks may have been held by a thread that is not here."""
        self.enabled = False
        self.closed = True
        self.lock = threading.RLock()
        self.local = threading.local()

    def next_iteration(self) -> None:
        self._end_of_backward(aborted=True)  # normally nothing is open here
        self._report_unreported()
        with self.lock:
            self.iteration += 1
            self.calls.clear()
            self._ungraded.clear()
            self.loss_scaled = False
            # Backward hooks of calls whose backward never ran (evaluation, a discarded graph).
            stale = [link for link in self._links if link.frame is None]
            self._links = [link for link in self._links if link.frame is not None]
            self._prune_spans()
        for link in stale:
            for handle in link.handles:
                handle.remove()

    def _payloads_now(self) -> bool:
        if self.mode == "flight":
            return True
        return self.mode == "full" and self.iteration % self.every == 0

    # -- flight mode -------------------------------------------------------------------------------
    def dump_ring(self, reason: str, current: bool = False) -> None:
        """Write out the payloads held in the flight ring (an anomaly, an exception, a signal, the end).
        ``current``: an anomaly's, whose iteration is listed as written even where the ring holds none
        of its bytes, for the rest of it goes straight out (``_direct_iteration``)."""
        if self.ring is None or not self.enabled:
            return
        try:
            with self.lock:
                if current:
                    self._ring_note()
                iterations, items = self.ring.take_all()
                self._ring_noted = -1  # (taken: listed again if more of it goes into the ring)
                if iterations:  # listed before its bytes go: a commit in between cannot leave it out
                    dump = {"reason": reason, "iterations": iterations, "bytes": sum(i.nbytes for i in items)}
                    self._log_dump(dump)
                    self._send(RingWritten(dict(dump)), 0)
                for item in items:
                    self._send(item, item.nbytes)
                    if item.key is not None:
                        self._mark_sent(item.key)
                if iterations:
                    # Records whose bytes the ring did not keep (over max_bytes) would wait for them
                    # in the writer forever: it drops them, after attaching the bytes just sent.
                    self._send(ForgetIterations(iterations), 0)
        except Exception as exc:
            self.fail("writing the flight ring", exc)

    def _write_ring_before_failure(self) -> str:
        """Flight mode, recording stopped by a failure of its own: write out the iterations the ring
        holds that were complete before it (the failure's own is not: the step it failed in, and
        those after, are missing from it), so that the tensors already kept are not lost with the
        rest of the recording. Returns what to add to the warning."""
        if self.pipeline.error is not None:  # (no writer to write them)
            return ""
        try:
            with self.lock:
                iterations, items = self.ring.take_before(self.iteration)  # type: ignore[union-attr]
                if not iterations:
                    return ""
                dump = {"reason": "failure", "iterations": iterations, "bytes": sum(i.nbytes for i in items)}
                self._log_dump(dump)
                self._send(RingWritten(dict(dump)), 0)
                for item in items:
                    self._send(item, item.nbytes)
                self._send(ForgetIterations(iterations), 0)  # (as dump_ring: records over max_bytes)
        except Exception as exc:  # noqa: BLE001 - said in the one warning
            return (f", but the flight ring's tensors could not be written out ({type(exc).__name__}: {exc}): its "
                    "iterations keep their statistics only")
        shown = ", ".join(str(i) for i in iterations)
        return (f", and the flight ring's tensors of iteration{'s' if len(iterations) > 1 else ''} {shown} (complete "
                "before the failure) are written out")

    def share_ring(self, shared: Any) -> None:
        """Flight mode: hold the ring's payload bytes in ``shared`` (a recorder.shmring.SharedRing)
        instead of this process's memory, with a journal of what waits for them, so that the parent
        process of ``pdbg record`` writes them out if this one dies hard. Call before any capture."""
        if self.ring is not None:
            self.shared = shared
            self.pipeline.pool = shared
            self.pipeline.journal = shared

    def _no_room_shared(self) -> None:
        if not self._unshared_warned:
            self._unshared_warned = True
            warn("the flight ring's shared memory is full: payloads beyond it are held in this process's "
                 "memory and are lost if it dies hard (a segfault, abort or the OOM killer); lower "
                 "max_ring_bytes or keep", stacklevel=4)

    def _log_dump(self, dump: dict[str, Any]) -> None:
        """List a ring write for the run's final metadata (items.log_ring_write)."""
        log_ring_write(self.dumps, dump)

    def _mark_sent(self, key: tuple[int, int, int]) -> None:
        """Remember contents on their way to the store, so they are not copied again. Only a cache
        (the writer deduplicates by content too), so bounded: in flight mode every anomaly adds the
        keys of an iteration, and a run that stays non-finite adds them at every iteration."""
        if len(self.seen) >= _SEEN_LIMIT:
            self.seen.clear()
        self.seen.add(key)

    def _reuse(self, items: list[PayloadItem]) -> None:
        for item in items:
            if item.buffer is not None:
                self.pipeline.pool.give(item.buffer)

    def _send_payload(self, item: PayloadItem, ref: Any) -> None:
        if self.ring is None or self.iteration == self._direct_iteration:
            if item.key is not None:
                self._mark_sent(item.key)
            self._send(item, item.nbytes)
            return
        self._ring_room()
        changed = self.ring.add(self.iteration, ref, item)
        if changed is not None:  # a full ring drops iterations too
            self._forget(*changed)

    def _ring_room(self) -> None:
        """Flight mode: the first payload of an iteration makes room for it in the ring."""
        assert self.ring is not None
        if self.iteration != self._ring_iteration:
            self._ring_iteration = self.iteration
            self._forget(*self.ring.start_iteration(self.iteration))

    def _ring_note(self) -> None:
        """Flight mode: the ring lists this iteration as its own though it holds no bytes of it: those
        are in the store already (``seen``, written out by an earlier anomaly), or the iteration's are
        written out now. Writing the ring out then names it among the iterations whose tensors were
        kept, even where none of its payloads was new (NaN after NaN, bytes that repeat; under ``pdbg
        record`` every payload is taken by content)."""
        assert self.ring is not None
        if self._ring_noted == self.iteration:  # (a frozen weight repeats at every call: a lock each time)
            return
        with self.ring.lock:
            self._ring_room()
            self.ring.note(self.iteration)
            self._ring_noted = self.iteration

    def _forget(self, dropped: list[int], freed: list[PayloadItem]) -> None:
        """Iterations left the ring unwritten: reuse their buffers, and tell the writer, which holds
        their records (waiting for bytes) until then."""
        self._reuse(freed)
        if dropped:
            if self._ring_noted in dropped:
                self._ring_noted = -1
            if self.shared is not None:  # before the writer hears of it: a crash in between forgets them too
                self.shared.held_from(max(dropped) + 1)
            self._send(ForgetIterations(dropped), 0)

    def _first_nonfinite(self, frame: Frame) -> TensorItem | None:
        """The first result tensor of a finished step holding NaN or Inf that is an anomaly, looked
        for once per step (monitors and the flight recorder both ask). Device statistics of results
        come to the host here, once, and stay on the item as plain floats for the writer.

        NaN always is. Inf without NaN is not where the step's previous call with the same number in
        its iteration held Inf too (an additive -inf attention mask, made or passed through at every
        call), or, at the first call with that number, the step's previous call did; nor where it is on
        part of results an earlier call of the step held Inf on part of (a padding mask, which a batch
        without padding does not need: whether the Inf will be kept from going further is not known
        yet). At the step's very first call it waits for the next call with its number, which reports
        it if it holds none, unless it was on part of the results only. A result that is a single value
        and Inf (a 0-d loss) is no mask's, whatever the calls before held: reported at once. Sets
        ``frame.anomaly``, what is told of it."""
        if not frame.checked:
            frame.checked = True
            results = layout.RESULT_ROLES[frame.phase]
            found, nan, lone, parts = None, False, False, set()
            for t in frame.tensors:
                if t.role in results:
                    if isinstance(t.stats, torch.Tensor):
                        t.stats = tuple(float(v) for v in t.stats.cpu().tolist())
                    if t.stats[6] or t.stats[7]:
                        found = found or t
                        nan = nan or bool(t.stats[6])
                        # (the statistics of the finite values are NaN where there is none)
                        parts.add((t.role, t.name) if not math.isnan(t.stats[0]) else (-1, ""))
                        lone = lone or (t.stats[7] == 1 and math.isnan(t.stats[0]))  # one value, and Inf
            step = (frame.defn.name, frame.path, frame.phase)
            key = (*step, frame.call)
            inf_only = found is not None and not nan
            habit = inf_only and not lone  # Inf that may be a mask's (a loss of +inf at every call is none)
            here = frame.root if frame.root >= 0 else frame.index
            prior = self._inf_step.get(step)
            if prior is None or prior[0] != here:
                stands = None if prior is None else prior[1]
                self._inf_step[step] = (here, habit, stands)
            else:  # a sibling's Inf is no habit, its finite result no mask's: as first_nonfinite judges them
                stands = prior[2] if prior[1] else False
                self._inf_step[step] = (here, habit, prior[2])
            last = self._inf_last.get(key, stands)
            self._inf_last[key] = habit
            partial = habit and (-1, "") not in parts
            seen = self._inf_parts.get(step)
            if partial:
                self._inf_parts.setdefault(step, set()).update(parts)
            if partial and seen is not None and parts <= seen:  # a mask's, seen before: meant
                self._inf_first.pop(key, None)
                found = None
            elif habit and last is None:  # the first call: a mask, if the next call makes Inf again
                self._inf_first[key] = (frame.index, monitors.nonfinite_message(self._context(frame, None), found,
                                                                                    frame.tensors), partial)
                found = None
            elif habit and last:  # made at every call so far: meant
                self._inf_first.pop(key, None)
                found = None
            elif not habit and self._inf_first:
                first = self._inf_first.pop(key, None)
                if first is not None and found is None and not first[2]:  # that first call's Inf was no habit
                    frame.anomaly = (first[0], f"{first[1]} (its next call, step {frame.index}, made none: not a mask)")
            frame.nonfinite = found
            if found is not None:
                second = layout.SECOND_ORDER_NOTE in frame.notes
                frame.anomaly = (frame.index, monitors.nonfinite_message(
                    self._context(frame, None), found, frame.tensors, second_order=second,
                    within=self._enclosing_backward(frame) if second else None,
                    user=self._gradient_user_of(frame) if second else None))
            elif frame.anomaly is None and frame.output_doc is not None:
                self._nonfinite_values(frame)
        return frame.nonfinite

    def _enclosing_backward(self, frame: Frame) -> str | None:
        """The backward step of this pass that ``frame`` (a backward step) runs inside, described; None where none."""
        outer = self._ended.get(frame.parent)
        return None if outer is None else self._context(outer, None).describe()

    def _gradient_user_of(self, frame: Frame) -> str | None:
        """For a backward step through a graph of gradients that runs inside none: the backward step of this
        pass before it whose forward took those gradients itself (``gradient_penalty(d_out, interp)``), described;
        None where none did (the loop took them). As bisect's ``_gradient_user`` finds it in a recording."""
        user = frame.gradient_user
        return None if user is None else self._context(user, None).describe()

    def _nonfinite_values(self, frame: Frame) -> None:
        """A step whose result holds no non-finite tensor but NaN in a number that is none (a numpy array, a
        float), as recorded: the anomaly is there, where it was made (the writer flags it so). Inf alone is
        not told here: a step may return ``math.inf`` at every call as a bound (bisect judges it so too)."""
        made = [m for m in jsonval.nonfinite(frame.output_doc, "output") if m.nan]
        if made:
            given = jsonval.nonfinite(frame.args_doc) if frame.args_doc is not None else []
            text = f"{self._context(frame, None).describe()}: {made[0].path} ({made[0].kind}) has {made[0].counts()}"
            if given:
                text += f"; it came in: its argument {given[0].text()} already held it when the call began"
            frame.anomaly = (frame.index, text)

    def _anomaly(self, frame: Frame) -> tuple[int, str] | None:
        """(index, message) of the anomaly this finished step shows, if any: its own NaN or Inf, or
        an earlier call's Inf it showed to be no mask (found once per step)."""
        self._first_nonfinite(frame)
        return frame.anomaly

    def _after_step(self, frame: Frame) -> None:
        """A step finished (and was handed to the writer): the first NaN/Inf is reported to the
        ``on_nonfinite`` listener, and flight mode writes its ring on an anomaly."""
        if self.on_nonfinite is not None and self.enabled:
            if self.ring is None and not self.monitor.active() and self._on_device(frame):
                # Nothing else needs its statistics on the host now: one host sync per iteration
                # (_report_unreported, at its end), not one per step.
                with self.lock:
                    self._unreported.append(frame)
            else:
                self._report_nonfinite(frame)
        self._after_flight_step(frame)

    @staticmethod
    def _on_device(frame: Frame) -> bool:
        results = layout.RESULT_ROLES[frame.phase]
        return any(isinstance(t.stats, torch.Tensor) for t in frame.tensors if t.role in results)

    def _report_unreported(self) -> None:
        """Tell ``on_nonfinite`` of the first of the steps whose check waited for the iteration's end."""
        with self.lock:
            frames, self._unreported = self._unreported, []
        for frame in frames:
            if self.on_nonfinite is None or not self.enabled:
                return
            self._report_nonfinite(frame)

    def _report_nonfinite(self, frame: Frame) -> None:
        try:
            anomaly = self._anomaly(frame)
            if anomaly is not None:
                listener, self.on_nonfinite = self.on_nonfinite, None  # the first one only
                if listener is not None:
                    listener(*anomaly)
        except Exception as exc:  # telling the user must never stop training
            warn(f"PaperDebugger could not report a non-finite step ({type(exc).__name__}: {exc})", stacklevel=2)

    def _after_flight_step(self, frame: Frame) -> None:
        """Flight mode: an anomaly writes the ring, and the rest of its iteration goes straight out."""
        if self.ring is None or self.iteration == self._direct_iteration or not self.enabled:
            return
        try:
            anomaly = frame.exception is not None or self._anomaly(frame) is not None
        except Exception as exc:
            self.fail("checking a step for the flight recorder", exc)
            return
        if anomaly:
            self._direct_iteration = self.iteration
            self.dump_ring("exception" if frame.exception is not None else "nonfinite", current=True)

    # -- forward ---------------------------------------------------------------------------------
    def call(self, defn: Any, fn: Callable[..., Any], module: torch.nn.Module | None,
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one step call with capture around it."""
        def invoke(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return fn(module, *args, **kwargs) if module is not None else fn(*args, **kwargs)

        if compiled.tracing():  # called from code Dynamo traces: recorded outside the graph, eagerly
            if compiled.whole_graph(f"paper step {defn.name!r}"):
                return invoke(args, kwargs)
            return compiled.eagerly(self._call_from_compiled, defn, fn, module, args, kwargs)

        started = self.begin(defn, module, args, kwargs)
        if started is None:
            return invoke(args, kwargs)
        frame, args, kwargs, link = started
        try:
            out = invoke(args, kwargs)
        except BaseException as exc:
            self.end_with_exception(frame, exc, link)
            raise
        return self.end(frame, out, link)

    def _recursion_room(self, depth: int) -> None:
        """Raise Python's recursion limit by the frames the recorder adds to ``depth`` nested step
        calls (its wrapper, ``call``, ``invoke``, and what capturing the innermost one takes): a step
        that recurses 400 deep unrecorded does when recorded. Put back when the recording closes."""
        needed = (self._recursion_limit or sys.getrecursionlimit()) + _FRAMES_PER_STEP * depth + _CAPTURE_FRAMES
        if sys.getrecursionlimit() < needed:
            with self.lock:
                if self._recursion_limit is None:
                    self._recursion_limit = sys.getrecursionlimit()
                self._raised_limit = max(needed, sys.getrecursionlimit())
                sys.setrecursionlimit(self._raised_limit)

    def _call_from_compiled(self, defn: Any, fn: Callable[..., Any], module: torch.nn.Module | None,
                            args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``call`` for a step called from compiled code. The module hooks did not run in the compiled
        code around it, so paths are taken relative to the outermost module called outside it (or
        the recording's model)."""
        root = self.modules.root()
        if root is None:
            return self.call(defn, fn, module, args, kwargs)
        with self.modules.rooted(root):
            return self.call(defn, fn, module, args, kwargs)

    def begin(self, defn: Any, module: torch.nn.Module | None, args: tuple[Any, ...], kwargs: dict[str, Any],
              recomputation: bool | None = None,
              ) -> tuple[Frame | None, tuple[Any, ...], dict[str, Any], BackwardLink | None] | None:
        """Start a step: capture its inputs and push it as the running step. Returns the frame, the
        (tapped) arguments to call with and the backward link; None when nothing is captured. The
        frame is None for a recomputation whose gradients are the original call's (see
        ``_begin_recomputation``; ``recomputation`` is ``recomputing()`` when the caller knows it)."""
        if not self.enabled or self.pauses or getattr(self.local, "busy", False):
            return None
        if self.guard is not None and not self.guard():
            return None
        if self.recomputing() if recomputation is None else recomputation:
            return self._begin_recomputation(defn, module, args, kwargs)
        try:
            with quiet():
                frame, args, kwargs, link = self._enter(defn, module, args, kwargs)
        except Exception as exc:
            self.fail("capturing a step's inputs", exc)
            return None
        stack = self._stack()
        stack.append(frame)
        if len(stack) >= _DEEP:  # a recursion of steps: the frames the recorder adds to each must not end it
            self._recursion_room(len(stack))
        return frame, args, kwargs, link

    def end(self, frame: Frame | None, out: Any, link: BackwardLink | None) -> Any:
        """Finish a step begun with ``begin``: capture its outputs; returns the (tapped) output. The
        arguments' containers get their own tensors back (the tapped ones were theirs while it ran)."""
        if link is not None and link.watched:
            try:
                self._rebase_changed(link)
            except RuntimeError as exc:  # autograd's refusal of the change: the call's own error
                self.end_with_exception(frame, exc, link)
                raise
            except Exception as exc:  # noqa: BLE001 - training goes on
                self.fail("following an argument the step changed in place", exc)
        try:
            return self._end(frame, out, link)
        finally:
            if link is not None and link.undo:
                taps.restore(link.undo)

    def _rebase_changed(self, link: BackwardLink) -> None:
        """Give the caller's tensors that the call changed in place through their taps the history of
        that change (taps.rebase_changed), detach those it detached in place through them
        (taps.detached_in_place), and keep the gradient of those it asked to (taps.retained_in_call):
        training goes on as unrecorded. Raises what autograd raised
        (a view of a leaf changed in place): the call's change raises it unrecorded. Their nodes are
        made after the call's, as its outputs' taps are (``until``)."""
        with quiet():
            detached, retained = taps.detached_in_place(link.watched), taps.retained_in_call(link.watched)
            changed = taps.changed_in_place(link.watched)
            if changed:
                link.until = taps.sequence_now()
                link.rebased = taps.rebase_changed(changed)
            for t in detached:  # (a view refuses, as the call's own detach_ of it does unrecorded)
                t.detach_()
            for t in retained:
                t.retain_grad()

    def _end(self, frame: Frame | None, out: Any, link: BackwardLink | None) -> Any:
        if frame is None:
            return self._end_recomputation(out, link)
        self._pop(frame)
        try:
            with transforms.outside_if(frame.vmap is not None):
                out = self._exit(frame, out, link)
            with quiet():  # (inside a transform, as the call ran: the tensors behind its wrappers are kept)
                self._buffers_left(frame.module)
        except Exception as exc:
            self.fail("capturing a step's outputs", exc)
            return out
        self._after_step(frame)
        if frame.pending is not None:
            self.perform(frame.pending, lambda: self.pipeline.flush(60.0))  # may raise, on purpose
        return out

    def perform(self, pending: monitors.Pending, flush: Callable[[], Any]) -> None:
        """``monitors.perform``, remembering the stop it raises (``stopped_by``): a recording closed
        later without being told the exception (at exit, under a framework with no exception hook)
        still says what ended it."""
        try:
            monitors.perform(pending, flush)
        except (monitors.NonFiniteError, monitors.BreakpointStop) as exc:
            self.stopped_by = exc
            raise

    def end_with_exception(self, frame: Frame | None, exc: BaseException, link: BackwardLink | None = None) -> None:
        """Finish a step begun with ``begin`` whose call raised ``exc``; ``link``: its backward link,
        whose parameter hooks go (a later backward pass through those parameters is another call's:
        a caught exception, the "skip a bad batch" pattern, must not leave a backward step behind)."""
        if link is not None:
            taps.restore(link.undo)
            for handle in link.handles:
                handle.remove()
            link.handles.clear()
            if link.watched:  # (a caller that catches the exception goes on with its tensors as changed)
                try:
                    self._rebase_changed(link)
                except Exception as err:  # noqa: BLE001 - the call's own exception is the one raised
                    self.fail("following an argument the step changed in place", err)
        if frame is None:  # a recomputation that did not finish: its graph is never used
            return
        self._pop(frame)
        self._exit_exception(frame, exc)
        self._after_step(frame)

    # -- activation checkpointing -----------------------------------------------------------------
    # torch.utils.checkpoint runs a checkpointed forward again during backward. That is not a new
    # call of its steps: nothing of it is recorded as a step. Non-reentrant checkpointing (the
    # original call ran with grad) takes the gradients through the original call's graph, whose
    # backward is recorded as usual. Reentrant checkpointing ran the original call without grad and
    # takes the gradients through the recomputation's graph: its backward is recorded as the
    # original call's, tapped here.
    @staticmethod
    def recomputing() -> bool:
        """Whether a forward call made now is a recomputation by activation checkpointing: autograd
        is running a backward pass on this thread, called through checkpointing code."""
        return _graph_task_id() != -1 and in_checkpointing(3)

    def _remember_ungraded(self, frame: Frame) -> None:
        """Remember a call made without grad inside activation checkpointing (reentrant: its
        recomputation in backward will have the graph)."""
        if not in_checkpointing(4):
            return
        stub = Frame(index=frame.index, phase=0, defn=frame.defn, module=frame.module, path=frame.path,
                     call=frame.call, parent=frame.parent, iteration=frame.iteration, t_start=frame.t_start,
                     payloads=False, root=frame.root)
        stub.args_doc = frame.args_doc  # which places were one tensor (see _not_own_records)
        with self.lock:
            calls = self._ungraded.setdefault((frame.defn.name, id(frame.module)), [])
            calls.append(stub)
            del calls[:-_UNGRADED_KEPT]

    def _begin_recomputation(self, defn: Any, module: torch.nn.Module | None, args: tuple[Any, ...],
                             kwargs: dict[str, Any],
                             ) -> tuple[None, tuple[Any, ...], dict[str, Any], BackwardLink] | None:
        """A step called again by activation checkpointing during backward: no step is recorded. If
        it is the recomputation of a call made without grad (the latest such call of this step and
        module not yet recomputed), its inputs are tapped for that call's backward."""
        with self.lock:
            calls = self._ungraded.get((defn.name, id(module)))
            original = calls.pop() if calls else None
        if original is None or not torch.is_grad_enabled():
            return None
        try:
            with quiet():
                link = BackwardLink(original)
                link.since = taps.sequence_now()  # the recomputation's graph: its parameters' uses are the call's own
                skip = _nested_tensors({"args": list(args), "kwargs": kwargs}, _argument_paths(args, kwargs))
                skip |= _not_own_records(original.args_doc, args, kwargs)
                slots, leaves = taps.leaves_apart(taps.apart(taps.argument_slots(args, kwargs))[0])
                link.leaf_args = [(n, t) for n, t in taps.first_places(leaves) if id(t) not in skip]
                if self._modules_met and original.args_doc is not None:  # (1.31) the networks it was given
                    networks = jsonval.given_networks(original.args_doc, args, kwargs)
                    if networks:
                        self._network_leaves(link, module, networks)
                args, kwargs = self._tap_inputs(link, args, kwargs, skip, slots=slots)
        except Exception as exc:
            self.fail("tapping a recomputed step's inputs", exc)
            return None
        return None, args, kwargs, link

    def _end_recomputation(self, out: Any, link: BackwardLink | None) -> Any:
        """Tap a recomputed call's outputs and parameters for the original call's backward."""
        if link is None:
            return out
        try:
            with quiet():
                module = link.fwd.module
                slots, reached, _ = taps.output_places(out)
                if module is not None:
                    link.params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
                    mine = {id(p) for _, p in link.params}
                    link.leaf_args = [(n, t) for n, t in link.leaf_args if id(t) not in mine]
                if link.params or link.leaf_args or link.tap_nodes:
                    if link.until < 0:
                        link.until = taps.sequence_now()
                    self._hook_params(link.fwd, link, [t for _, t in slots], notes=False)
                out = self._tap_outputs(link, out, _nested_tensors(out, reached), slots=slots)
        except Exception as exc:
            self.fail("tapping a recomputed step's outputs", exc)
        return out

    def _pop(self, frame: Frame) -> None:
        stack = self._stack()
        frame.link = None  # (only the calls inside it look it up: no cycle with the link left behind)
        for i in range(len(stack) - 1, -1, -1):  # normally the top; frames are compared by identity
            if stack[i] is frame:
                del stack[i:]
                return

    def _enter(self, defn: Any, module: torch.nn.Module | None, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> tuple[Frame, tuple[Any, ...], dict[str, Any], BackwardLink | None]:
        self.local.busy = True
        try:
            stack = self._stack()
            path = self.modules.path_of(module) if module is not None else self.modules.enclosing_path()
            with self.lock:  # "Eq. 2@iter=17#3": the fourth call of that step in the iteration, wherever it ran
                # (a function decorated anew at each use, in a factory, has one code object)
                key = (defn.name, defn.label, id(getattr(defn.target, "__code__", defn.target)))
                call = self.calls.get(key, 0)
                self.calls[key] = call + 1
            frame = Frame(index=self._new_index(), phase=0, defn=defn, module=module, path=path, call=call,
                          parent=stack[-1].index if stack else layout.NO_REF, iteration=self.iteration,
                          t_start=time.perf_counter() - self.t0, payloads=self._payloads_now())
            frame.root = stack[0].index if stack else frame.index
            cached = _cached_parametrizations(module) if module is not None else None
            if cached:
                frame.notes.append(f"{_one_line(cached)}: {layout.CACHED_PARAMETRIZATION_NOTE}")
        finally:
            self.local.busy = False
        try:
            if transforms.active():  # under torch.func: forward only, outside the transforms
                frame.vmap = {}
                frame.vmap_randomness = transforms.randomness() or None  # (read before outside() clears them)
                frame.notes.append(transforms.NOTE)
                with transforms.outside():
                    return self._capture_inputs(frame, module, args, kwargs)
            return self._capture_inputs(frame, module, args, kwargs)
        except Exception as exc:
            # Every index must reach the writer, or the steps after it could never be committed.
            frame.notes.append(f"{layout.CAPTURE_FAILED_NOTE}: {type(exc).__name__}: {exc}")
            frame.t_end = frame.t_start
            self._submit(frame)
            raise

    def _capture_inputs(self, frame: Frame, module: torch.nn.Module | None, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[Frame, tuple[Any, ...], dict[str, Any], BackwardLink | None]:
        self.local.busy = True
        try:
            frame.rng = self.rng.parts()
            frame.definition = frame.defn.doc_now()  # (the classes its module-level names are bound to now)
            if frame.defn not in self._defs_met:
                self._defs_met.add(frame.defn)
                unfound = frame.defn.unfound() if frame.defn.kind == "function" else None
                if unfound is not None:  # (a replay would refuse its every call)
                    warn(unfound, stacklevel=_outside_recorder(installed=True))
                unheld = snapshot.unheld_rngs(frame.defn.target)
                if unheld:  # (pdbg verify, replaying in order, would match where a replay alone does not)
                    warn(f"PaperDebugger: step {frame.defn.name} reads the generator{'s' if len(unheld) > 1 else ''} "
                         f"{', '.join(unheld[:4])}{' ...' if len(unheld) > 4 else ''}, held where the recorder does "
                         "not record its state: a replay of a later call alone will draw other numbers; pass it as "
                         "an argument, or hold it as a module-level name, a dict's item, or the step's module's "
                         "attribute", stacklevel=_outside_recorder(installed=True))
            found = frame.defn.rngs
            if found is None:
                found = frame.defn.rngs = snapshot.find_global_rngs(frame.defn.target)
            if found:  # generator objects the step's code reads (a CFG label dropout's own numpy Generator)
                frame.rng = {**frame.rng, **snapshot.global_rng_parts(found)}
            frame.settings = self._settings()
            hooks = skeleton.global_hooks()
            if hooks:  # the user's hooks on every module's calls: a replay runs without them
                frame.notes.append(f"{_one_line(hooks)}: {layout.GLOBAL_HOOK_NOTE}")
            if module is not None:  # its skeleton, as the call finds it (a schedule may change it)
                frame.module_doc, held = self._module_entry(module, frame.path)
                if held:  # generators the module holds (a noise layer's own torch.Generator), as the call finds them
                    frame.rng = {**frame.rng, **snapshot.module_rng_parts(held)}
            # (inference mode makes no graph, with grad mode on too: torch.enable_grad() inside inference_mode())
            inference = torch.is_inference_mode_enabled()
            tapping = torch.is_grad_enabled() and not inference and frame.vmap is None
            packing = _saved_tensors_hooks() if tapping else None
            if packing is None and not torch.is_grad_enabled() and not inference and _any_saved_hooks() \
                    and in_checkpointing(3):  # (a reentrant checkpoint's forward saves its arguments under them)
                packing = _saved_tensors_hooks(checkpointed=True)
            if packing is not None:  # what the call's backward reads is what they made of what its forward saved
                frame.arguments = {**(frame.arguments or {}), "saved_tensors_hooks": packing}
            found, reached = taps.argument_places(args, kwargs) if tapping else ([], frozenset())
            slots, shared = taps.apart(found) if found else ([], [])
            slots, leaves = taps.leaves_apart(slots) if slots else (slots, [])
            tapped = frozenset(id(t) for _, t in slots)
            split = taps.split_places(module, args) if found else frozenset()
            if split:  # (tapped or followed, and given as positional arguments alone: all through the hooks' node)
                split = (split & tapped.union(id(t) for _, t in leaves)).difference(
                    id(t) for keys, t in found if len(keys) > 2 or keys[0] != "args")
            given = tapped.union(id(t) for _, t in (*shared, *leaves)) if shared or leaves else tapped
            nested: set[int] = set()
            unfollowed: list[str] | None = [] if tapping else None
            places: dict[str, str] = {}
            grads: list[tuple[str, torch.Tensor]] = []
            frame.versions = [] if frame.vmap is None else None
            defaults = frame.defn.defaults
            if defaults is None:
                defaults = frame.defn.defaults = snapshot.step_defaults(frame.defn.target)
            taken = snapshot.defaults_taken(defaults, args, kwargs) if defaults else None
            given_args, recorded = list(args), kwargs
            if taken:  # (a tensor or torch.Generator recorded as passed: a replay passes it)
                appended, passed, parts = snapshot.defaults_apart(defaults, taken)
                given_args += appended
                recorded = {**kwargs, **passed} if passed else kwargs
                if parts:
                    frame.rng = {**frame.rng, **parts}
            frame.args_doc = self._encode(frame, {"args": given_args, "kwargs": recorded}, "input", "", tapped,
                                          reached, nested, unfollowed=unfollowed, versions=frame.versions,
                                          places=places, grads=grads, split=split, modules=True)
            # (1.31) the parameters of the networks it was given, if any
            networks = self.local.__dict__.pop("networks", None) if self._modules_met else None
            if unfollowed:  # (in objects no tap passes a tapped tensor through: their gradients are not recorded)
                frame.notes.append(f"{_one_line(unfollowed)} {layout.UNFOLLOWED_NOTE}")
            if not self._cache_warned:
                self._warn_of_cache(frame, args, kwargs)
            if id(frame.defn) not in self._unrecorded_warned:
                self._warn_of_unrecorded(frame, args, kwargs)
            # arguments that need no tap may share memory too (views of a buffer, no_grad); apart checked the others
            others = _top_tensors(args, kwargs) if frame.vmap is None else []
            if shared or grads or len(others) > 1 and not given.issuperset(id(t) for _, t in others):
                self._aliased_arguments(frame, others, shared, grads, places)
            link = BackwardLink(frame) if tapping else None
            if link is not None:
                frame.link = link
                link.outer = next((f.link for f in reversed(self._stack()) if f.link is not None), None)
                link.since = taps.sequence_now()
                if leaves:  # (a module's own parameter given as an argument: its gradient is in the parameter's)
                    mine = {id(p) for p in module.parameters()} if module is not None else set()
                    link.leaf_args = [(places.get(n, n), t) for n, t in taps.first_places(leaves) if id(t) not in mine]
                    if split:
                        self._split_leaves(link, args, split, mine, places)
                if networks:  # their grads are the call's network_grad records, found as a leaf argument's
                    self._network_leaves(link, module, networks)
            if link is None and frame.vmap is None and not inference:
                self._remember_ungraded(frame)
            if module is not None:
                for name, p in self._parameters_of(module):
                    self._capture(frame, "param", name, p)
                    if frame.versions is not None and not p.is_inference():  # (its version counter alone tells)
                        frame.versions.append((name, p, p._version, None))
                    if id(p) in given:  # (given as an argument too: a tied projection's weight)
                        self._parameter_argument(frame, name, p, [*slots, *shared, *leaves], places)
                    if link is not None and p.requires_grad:
                        if p._backward_hooks:  # the user's gradient hooks (pruning masks): the recorded grad is theirs
                            self._note_param_hooks(frame, name, p)
                        link.params.append((name, p))
                buffers = list(module.named_buffers())
                written = self._buffers_written(module, buffers if frame.vmap is None else _buffers_of(module, True))
                if written:
                    frame.notes.append(f"{_one_line(written)}: {layout.BUFFERS_WRITTEN_NOTE}")
                for name, b in buffers:
                    self._capture(frame, "buffer", name, b)
            if link is not None:
                args, kwargs = self._tap_inputs(link, args, kwargs, tapped & nested, frame, slots, split)
            return frame, args, kwargs, link
        finally:
            self.local.busy = False

    @staticmethod
    def _network_leaves(link: BackwardLink, module: torch.nn.Module | None,
                        networks: list[tuple[str, torch.Tensor]]) -> None:
        """Follow the parameters of the networks a call was given (a distillation loss's teacher, an ensemble's
        members, an actor-critic's critic) as leaf arguments: their grad inputs, named by their records
        (``args.1.0.weight``), are what the call's graph sent them, as a module step's own parameter grads are.
        Its own module's parameters (a network it also holds) are its parameter grads already."""
        known = {id(t) for _, t in link.leaf_args}
        if module is not None:
            known.update(id(p) for p in module.parameters())
        added = [(n, p) for n, p in networks if id(p) not in known]
        link.leaf_args += added
        link.networks = frozenset(n for n, _ in added)

    @staticmethod
    def _split_leaves(link: BackwardLink, args: tuple[Any, ...], split: frozenset[int], mine: set[int],
                      places: dict[str, str]) -> None:
        """Follow a leaf passed in several places (taps.split_places) per place: its k-th tensor among the
        positional arguments is the k-th edge of the node of the module's backward hooks, whose contribution
        is that place's grad input (``BackwardLink.split_leaves``)."""
        named = {n for n, _ in link.leaf_args}
        tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        for k, (i, t) in enumerate(tensors):
            if id(t) in split and t.is_leaf and t.requires_grad and id(t) not in mine:
                name = places.get(f"args.{i}", f"args.{i}")
                link.split_leaves[k] = name
                if name not in named:
                    named.add(name)
                    link.leaf_args.append((name, t))

    def _aliased_arguments(self, frame: Frame, others: list[tuple[tuple[Any, ...], torch.Tensor]],
                           shared: list[tuple[tuple[Any, ...], torch.Tensor]], grads: list[tuple[str, torch.Tensor]],
                           records: dict[str, str]) -> None:
        """Find the arguments that share memory: those left untapped for it (``shared``: taps.apart),
        else among the top-level tensors (``others``: views of a buffer, arguments under no_grad). Where
        the call was given a leaf whose ``.grad`` is recorded (``grads``: its record name, the tensor),
        that ``.grad`` among them too, and the tensors outside autograd's graph in any place
        (``Frame.versions``): an update step given ``(p, p.grad)``, or lists of both, which changes the
        gradient in place. ``records``: an argument's path -> its record's name."""
        found = [(_record_at(records, key), t) for key, t in shared]
        if frame.vmap is None and (grads or not shared):
            named: list[tuple[Any, torch.Tensor]] = self._with_grads(frame, others, records) if grads else others
            try:
                overlapping = taps.overlapping([t for _, t in named])
            except Exception:  # noqa: BLE001 - a tensor without a storage to place: replayed apart, as before
                overlapping = set()
            if grads:  # (one object in two records: the gradient given as an argument too)
                counted = collections.Counter(id(t) for _, t in named)
                overlapping |= {i for i, n in counted.items() if n > 1}
            known = {name for name, _ in found}
            for key, t in named:
                name = key if grads else _record_at(records, key)
                if id(t) in overlapping and name not in known:
                    known.add(name)
                    found.append((name, t))
        if found:
            self._shared_arguments(frame, found, [_record_at(records, key) for key, _ in shared])

    @staticmethod
    def _with_grads(frame: Frame, others: list[tuple[tuple[Any, ...], torch.Tensor]], records: dict[str, str]
                    ) -> list[tuple[str, torch.Tensor]]:
        """The top-level tensor arguments and the tensors outside autograd's graph in any place of the
        arguments, leaves' recorded ``.grad`` among them, by record name (each record once)."""
        by_name = {_record_at(records, key): t for key, t in others}
        for name, t, _, _ in frame.versions or ():
            if t.layout == torch.strided and not t.is_nested:
                by_name.setdefault(name, t)
        return list(by_name.items())

    @staticmethod
    def _shared_arguments(frame: Frame, shared: list[tuple[str, torch.Tensor]], noted: list[str]) -> None:
        """Name the arguments left untapped for sharing memory with another (taps.apart: ``noted``) in a
        note, and where each argument of ``shared`` (record name, tensor) lies in its storage, so that a
        replay gives them one storage again."""
        places: dict[str, list[int]] = {}
        groups: dict[tuple[str, int], int] = {}
        for name, t in shared:
            if name in places:
                continue
            group = groups.setdefault((str(t.device), t.untyped_storage().data_ptr()), len(groups))
            places[name] = [group, t.storage_offset()]
        if noted:
            frame.notes.append(f"{_one_line(list(dict.fromkeys(noted)))}: {layout.SHARED_ARGUMENTS_NOTE}")
        frame.arguments = {**(frame.arguments or {}), "aliases": places}

    @staticmethod
    def _parameter_argument(frame: Frame, name: str, p: torch.Tensor, slots: list[tuple[tuple[Any, ...], Any]],
                            records: dict[str, str]) -> None:
        """Name the argument that is the call's module's own parameter ``name``: a replay passes the
        rebuilt parameter there, whose gradient then holds what came through the argument too."""
        key = next(key for key, t in slots if t is p)
        passed = (frame.arguments or {}).get("parameter_args", {})
        passed.setdefault(_record_at(records, key), name)
        frame.arguments = {**(frame.arguments or {}), "parameter_args": passed}

    def _exit(self, frame: Frame, out: Any, link: BackwardLink | None) -> Any:
        self.local.busy = True
        try:
            frame.t_end = time.perf_counter() - self.t0
            try:
                with quiet():  # (not the monitors below: the user's checks)
                    out = self._capture_outputs(frame, out, link)
            except Exception as exc:
                frame.notes.append(f"{layout.CAPTURE_FAILED_NOTE}: {type(exc).__name__}: {exc}")
                raise
            finally:
                self._monitor(frame, out)
                self._submit(frame)  # always: a missing index would hold back every later step
            return out
        finally:
            self.local.busy = False

    def _capture_outputs(self, frame: Frame, out: Any, link: BackwardLink | None) -> Any:
        """Capture a finished call's outputs and tap them for its backward; returns the (tapped) output."""
        self._warn_if_lazy(frame, out)
        slots, reached, leaves = taps.output_places(out) if link is not None else ([], frozenset(), [])
        tapped = frozenset(id(t) for _, t in slots)
        nested: set[int] = set()
        unfollowed: list[str] | None = [] if link is not None else None
        frame.output_doc = self._encode(frame, out, "output", "output", tapped, reached, nested,
                                        per_object=False, unfollowed=unfollowed)
        self._changed_inputs(frame, link)
        if unfollowed:
            shared = {f"output.{path}" if path else "output" for path in taps.shared_outputs(out)}
            for names, note in (([n for n in unfollowed if n not in shared], layout.UNFOLLOWED_NOTE),
                                ([n for n in unfollowed if n in shared], layout.SHARED_OUTPUTS_NOTE)):
                if names:
                    frame.notes.append(f"{_one_line(names)} {note}")
        if link is not None:
            if link.until < 0:  # (set where arguments were rebased)
                link.until = taps.sequence_now()
            if link.params or link.leaf_args or link.tap_nodes:
                self._hook_params(frame, link, [t for _, t in slots])
        if leaves and frame.module is not None:
            self._note_returned_parameters(frame, leaves, link.own if link is not None else {},
                                           {n for n, _ in link.hooked} if link is not None else set())
        if link is not None:
            out = self._tap_outputs(link, out, tapped & nested, frame, slots)
        return out

    @staticmethod
    def _per_place(link: BackwardLink, name: str, edges: list[tuple[Any, int]]
                   ) -> list[tuple[str, list[tuple[Any, int]]]]:
        """A leaf argument's uses found by the walk, per record name: those of a leaf passed in several
        places by the node of its module's backward hooks, by their places (``BackwardLink.split_leaves``)."""
        if not link.split_leaves:
            return [(name, edges)]
        by_name: dict[str, list[tuple[Any, int]]] = {}
        for node, k in edges:
            place = link.split_leaves.get(k) if taps.module_hooks_node(node) else None
            by_name.setdefault(place or name, []).append((node, k))
        return list(by_name.items())

    def _tied_params(self) -> dict[int, tuple[str, ...]]:
        """``id(parameter) -> its paths`` for the parameters registered in more than one place under
        the module paths' root (weight tying: ``lm_head.weight = embed.weight``), cached per root."""
        root = self.modules.root()
        if root is None:
            return {}
        cached = self._tied
        if cached is None or cached[0]() is not root:
            names: dict[int, list[str]] = {}
            for name, p in root.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(compiled.path_without_wrappers(name))
            cached = self._tied = (weakref.ref(root), {k: tuple(v) for k, v in names.items() if len(v) > 1})
        return cached[1]

    def _hook_params(self, frame: Frame, link: BackwardLink, outputs: list[torch.Tensor], notes: bool = True) -> None:
        """Hook the parameter grads of a call, once its graph is made (``outputs``: the tensors its
        output taps take). A parameter that nodes of the call's graph use gets a hook on each such
        node, and its recorded grad is this call's own: the sum of those uses' contributions, added
        in the order autograd adds them, which is the parameter grad a replay of the call's backward
        computes. Without the call's own, the parameter's gradient hook records the total autograd
        accumulates over the pass (every call of the module, a weight decay term in the loss, a tied
        module's use). The others (no node found: a graph made on several threads, a walk that gave
        up) are hooked as totals. The call's leaf arguments (``link.leaf_args``) are found by the same
        walk: their grad inputs are the sums of their uses' contributions (``_on_arg_grad``), what a tap
        on them would have had. So are the uses of the call's tapped arguments (``link.tap_nodes``), which their
        taps then pass on apart (taps.pass_apart). For reentrant checkpointing this runs on the graph the
        recomputation makes during the backward (``notes``: False, its forward step being written)."""
        keys: dict[int, Any] = {id(p): name for name, p in link.params}
        for name, t in link.leaf_args:
            keys.setdefault(id(t), (_ARGUMENT, name))
        tapped = taps.uses_of(link.tap_nodes) if link.tap_nodes else None
        link.tap_nodes = []
        walked = taps.parameter_uses(outputs, keys, link.since, tapped) if outputs and link.since >= 0 else None
        if tapped and walked is not None:
            taps.pass_apart(tapped)
        if not (link.params or link.leaf_args):
            return
        uses, reused, whole = walked if walked is not None else ({}, [], False)
        if reused and link.params:  # (a function's own leaf arguments: found as a tap on them would find them)
            self._reused_nodes(link, reused)
        by_node: dict[Any, list[tuple[int, str]]] = {}
        by_arg_node: dict[Any, list[tuple[int, str]]] = {}
        for key, edges in uses.items():
            argument = type(key) is tuple  # (_ARGUMENT, record name)
            for name, its in (self._per_place(link, key[1], edges) if argument else ((key, edges),)):
                (link.arg_uses if argument else link.own)[name] = len(its)
                for node, k in its:
                    (by_arg_node if argument else by_node).setdefault(node, []).append((k, name))
        for node, places in by_node.items():  # they go with the graph: a retained graph's next pass fires them too
            taps.hook_use(node, _backward_callback(self._on_own_grad, link, tuple(places)))
        for node, places in by_arg_node.items():
            taps.hook_use(node, _backward_callback(self._on_arg_grad, link, tuple(places)))
        for name, t in link.leaf_args:
            if name in link.arg_uses:
                self._hook_arg(link, name, t)
        if link.leaf_args and outputs and walked is None and notes:
            frame.notes.append(f"{_one_line([n for n, _ in link.leaf_args])} {layout.LEAF_UNFOLLOWED_NOTE}")
        if link.own:
            with self.lock:
                i = bisect.bisect_right(self._span_starts, link.since)
                self._span_starts.insert(i, link.since)
                self._spans.insert(i, link)
        tied = self._tied_params() if frame.path else {}
        shared: list[tuple[str, list[str]]] = []
        # A parameter the walk did not find in the call's graph, where the walk saw the whole of it (no node
        # made before the call reached, no custom autograd.Function's backward): the call sends it no
        # gradient. What reaches it comes from uses outside the call (a PINN's boundary term through the same
        # network); recorded here as the call's, it would be a gradient no replay of the call makes, and
        # counted twice where that use is a step too.
        unreached = whole and not reused
        for name, p in link.params:
            if unreached and name not in link.own:
                continue
            # Every parameter's own gradient hook too: once it runs every use has sent its contribution,
            # and a pass that reached the parameter only by other paths (an auxiliary loss the module
            # keeps) records the total, as for the others (_on_param_grad).
            self._hook_param(link, name, p)
            if name not in link.own and id(p) in tied:  # tied weights: a use outside the step adds to its grad
                outside = [o for o in tied[id(p)] if not o.startswith(f"{frame.path}.")]
                if outside:
                    shared.append((name, outside))
        if shared and notes:  # (not for a recomputation: its forward step is written already)
            frame.notes.append(f"{_one_line([n for n, _ in shared])}: {layout.SHARED_PARAM_NOTE} (also "
                               f"{_one_line([o for _, others in shared for o in others])})")

    def _note_param_hooks(self, frame: Frame, name: str, p: torch.Tensor) -> None:
        """Note the user's gradient hooks on a parameter (pruning masks). Its hooks hold the
        recorder's too, one for each call of the module in the pass so far (thousands in a recurrent
        loop): only the hooks added since the last look are looked at (their keys, a handle counter
        of torch's, grow), and the user's found before are kept while they stay."""
        hooks = p._backward_hooks
        if len(self._hook_scan) > _SEEN_LIMIT:
            self._hook_scan.clear()
        last, theirs = self._hook_scan.get(id(p), (-1, {}))
        for key in reversed(hooks):
            if key <= last:
                break
            hook = hooks[key]
            if not (isinstance(hook, functools.partial) and hook.func is _called_back):
                theirs[key] = hook
        theirs = {k: h for k, h in theirs.items() if k in hooks}
        self._hook_scan[id(p)] = (max(last, next(reversed(hooks), last)), theirs)
        if theirs:
            what = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in list(theirs.values())[:3])
            frame.notes.append(f"{name}: {layout.PARAM_HOOK_NOTE} ({what})")

    def _reused_nodes(self, caller: BackwardLink, reused: list[int]) -> None:
        """A call's graph (``caller``'s) reached nodes made before it, other than through its inputs'
        taps (``reused``: their sequence numbers). One made during an earlier call (a weight it made
        and cached for later calls) sends that call's parameters the gradients of every call using
        it: that call's parameter grads are recorded as totals, not as its own. Calls nest, so the
        calls whose nodes a number falls among are the last to begin at or before it, or those it
        ran inside. One made outside every call and reached by two calls (a weight cached before
        them) is theirs alike; one that only this call reaches (a tensor its module's own pre-hook
        made for it) is its own. Calls that share nodes so record their parameters' totals with a
        note (REUSED_NOTE): totals through shared nodes, which no replay of one call computes."""
        with self.lock:
            for seq in reused:
                i = bisect.bisect_right(self._span_starts, seq) - 1
                link = self._spans[i] if i >= 0 else None
                while link is not None and link.until >= 0 and not link.since <= seq < link.until:
                    link = link.outer
                if link is not None and link.until >= 0:
                    caller.reused = True
                while link is not None and link.until >= 0:  # it and the calls it ran inside
                    link.own.clear()
                    link.reused = True
                    link = link.outer
                other = self._reached.setdefault(seq, caller)
                if other is not caller:
                    other.reused = caller.reused = True

    def _prune_spans(self) -> None:
        """Forget the calls whose backward is over (under the lock)."""
        live = {id(lk) for lk in self._links}
        self._spans = [lk for lk in self._spans if id(lk) in live]
        self._span_starts = [lk.since for lk in self._spans]
        self._reached = {seq: lk for seq, lk in self._reached.items() if id(lk) in live}

    @staticmethod
    def _note_returned_parameters(frame: Frame, leaves: list[torch.Tensor], own: dict[str, int],
                                  hooked: set[str]) -> None:
        """A module step returning one of its own parameters as it is (learned queries, a position
        table): a leaf, which no tap follows; the gradient the caller's use sends it goes straight
        into the parameter's, which then holds more than this call's backward computes from its
        outputs. Noted, so that a replay does not compare that parameter's gradient, where it is
        recorded as a total (``hooked``); not for one whose grad is recorded as the call's own
        (``own``), which leaves the caller's use out, nor for one the call's graph does not use, whose
        gradient the step does not record (``_hook_params``)."""
        mine = {id(p): name for name, p in frame.module.named_parameters()}
        names = [mine[id(t)] for t in leaves if id(t) in mine and mine[id(t)] not in own and mine[id(t)] in hooked]
        if names:
            frame.notes.append(f"{_one_line(names)}: {layout.RETURNED_PARAM_NOTE}")

    def _exit_exception(self, frame: Frame, exc: BaseException) -> None:
        frame.versions = None
        try:
            frame.t_end = time.perf_counter() - self.t0
            frame.exception = exception_doc(exc)
            self._submit(frame)
            with quiet():
                self._buffers_left(frame.module)
        except Exception as err:
            self.fail("recording an exception", err)

    def add_kwargs(self, frame: Frame, kwargs: dict[str, Any]) -> None:
        """Record keyword arguments of a running step that were not known when it began."""
        self.local.busy = True
        try:
            with quiet():
                doc = self._encode(frame, kwargs, "input", "kwargs")
            if isinstance(frame.args_doc, dict):
                frame.args_doc["kwargs"] = doc
            frame.notes.append(f"{_one_line(list(kwargs))}: {layout.LATE_KWARGS_NOTE}")
        except Exception as exc:
            frame.notes.append(f"keyword arguments not captured: {type(exc).__name__}: {exc}")
        finally:
            self.local.busy = False

    def watch(self, tensor: Any, name: str, expect: dict[str, Any]) -> None:
        """Attach a watched tensor and its expectations to the innermost running step."""
        if not self.enabled:
            return
        if compiled.tracing():
            if not compiled.whole_graph(f"watch({name!r})"):
                compiled.eagerly(self.watch, tensor, name, expect)
            return
        try:
            frame = self._innermost()
            if frame is None:
                return
            if isinstance(tensor, (np.ndarray, np.generic)) and tensor.dtype.kind in "biufc":
                # a numpy intermediate is watched (kept, checked) as a copy of it as a tensor; a dtype torch has
                # not (uint32 before 2.3) is not
                with contextlib.suppress(TypeError, ValueError, RuntimeError):
                    tensor = torch.tensor(np.asarray(tensor))
            if not isinstance(tensor, torch.Tensor):
                frame.notes.append(f"watch({name!r}) got a {type(tensor).__name__}, not a tensor")
                warn(f"PaperDebugger: recorder.watch({name!r}) got a {type(tensor).__name__}, which it cannot check: "
                     "pass a tensor or a numeric numpy array", stacklevel=3)
                return
            shape = expect.get("expected_shape")
            actual = _shape_of(tensor)
            if shape is not None and (len(shape) != tensor.dim() or any(
                    e is not None and e != s for e, s in zip(shape, actual))):
                expect["shape_alert"] = {"watch": name, "check": "shape", "expected": shape,
                                         "actual": list(actual), "reference": expect.get("reference")}
            with transforms.outside_if(frame.vmap is not None), quiet():
                self._capture(frame, "watch", name, tensor)
            frame.expectations.append(expect)
        except Exception as exc:
            self.fail("recording a watched tensor", exc)

    def collective(self, op: str, doc: dict[str, Any], results: list[tuple[str, torch.Tensor]]) -> None:
        """Attach what a torch.distributed collective returned to the innermost running step (see
        recorder.collectives); outside every step nothing is kept."""
        if not self.enabled or getattr(self.local, "busy", False):
            return
        try:
            frame = self._innermost()
            if frame is None:
                return
            with self.lock:
                self._collective_seq += 1
                seq = self._collective_seq
            base = f"{op}.{len(frame.collectives)}"
            self.local.busy = True
            try:
                with quiet():
                    names = [self._capture(frame, "collective", base + suffix, t) for suffix, t in results]
            finally:
                self.local.busy = False
            frame.collectives.append({**doc, "name": base, "seq": seq, "results": names})
        except Exception as exc:
            self.fail("recording a collective's results", exc)

    # -- tensors ---------------------------------------------------------------------------------
    def _encode(self, frame: Frame, value: Any, role: str, prefix: str, tapped: frozenset[int] = frozenset(),
                top: frozenset[str] = frozenset(), nested: set[int] | None = None, per_object: bool = True,
                unfollowed: list[str] | None = None,
                versions: list[tuple[str, torch.Tensor, int | None, torch.Tensor | None]] | None = None,
                places: dict[str, str] | None = None, grads: list[tuple[str, torch.Tensor]] | None = None,
                split: frozenset[int] = frozenset(), modules: bool = False) -> Any:
        """Encode a value as tagged JSON, capturing each tensor in it under its path: once per object
        the step sees. ``tapped``: ids of the tensors a tap replaces where they stand in a place it
        reaches (``top``: the paths of those places: an argument's top level, an output's containers),
        a tensor the step gets there is not the one it gets elsewhere (inside a list argument: see
        taps.tap_arguments). ``nested`` collects the ids of tapped tensors found in other places.
        ``per_object`` False: a record per place (outputs: a replay compares what each place returns).
        ``unfollowed`` collects the record names of tensors autograd computed in places outside
        ``top`` (an output's or an argument's that no tap reaches: their gradients are not recorded).
        ``versions`` collects (record name, tensor, version counter) of the tensors outside autograd's
        graph (not computed from a tensor that requires grad), each once (see ``Frame.versions``).
        ``places`` collects each tensor's path -> its record's name, ``grads`` the record names and
        tensors of the leaves' ``.grad`` recorded with them (``versions``' too). ``split``: ids of the
        tensors recorded once per place of ``top`` (tapped per place: taps.split_places). ``modules``: a module
        in the value (a soft update's target network) is recorded as data (``$module``: its skeleton, and its
        parameters and buffers as tensors at its path), so that a replay rebuilds it; the parameters of those
        modules that require grad, each once, with their record names (``args.0.0.weight``), are left in
        ``self.local.networks`` for ``_capture_inputs`` (schema 1.31: their gradients are followed)."""
        errors: list[Exception] = []
        named: dict[Any, str | None] = {}

        def name(t: torch.Tensor, path: str) -> str | None:
            key: Any = id(t) if per_object else path
            if id(t) in tapped:  # (most calls tap nothing: no more work)
                at_top = path in top
                if nested is not None and not at_top:
                    nested.add(id(t))
                if per_object:
                    key = (key, at_top)
            if split and id(t) in split and path in top:
                key = (id(t), path)
            if key in named:  # the same tensor again (self-attention's query, key and value)
                if places is not None and named[key] is not None:
                    places[path] = named[key]  # type: ignore[assignment]
                return named[key]
            full = f"{prefix}.{path}" if prefix and path else (prefix or path)
            if unfollowed is not None and path not in top and t.grad_fn is not None:
                unfollowed.append(full)
            try:
                named[key] = self._capture(frame, role, full, t)
                if places is not None:
                    places[path] = named[key]  # type: ignore[assignment]
                if versions is not None and t.grad_fn is None and named[key] == full and t.is_inference():
                    kept = _kept(t, _KEPT_INPUT_BYTES)  # (no version counter: the bits alone tell)
                    if kept is not None:
                        versions.append((full, t, None, kept))
                elif versions is not None and t.grad_fn is None and named[key] == full:
                    versions.append((full, t, t._version, _kept(t, _KEPT_INPUT_BYTES)))
                    grad = t.grad if t.requires_grad else None  # (a leaf: a parameter an update step is given)
                    if grad is not None and not grad.is_inference():
                        self._capture(frame, role, f"{full}{layout.GRAD_SUFFIX}", grad)
                        versions.append((f"{full}{layout.GRAD_SUFFIX}", grad, grad._version,
                                         _kept(grad, _KEPT_INPUT_BYTES)))
                        if grads is not None:
                            grads.append((f"{full}{layout.GRAD_SUFFIX}", grad))
            except Exception as exc:  # jsonval would hide it as an opaque value: surface it
                errors.append(exc)
                named[key] = None
            return named[key]

        try:
            doc = jsonval.encode(value, tensor_name=name, bounded=True,  # (at every call: bounded)
                                 module_doc=self._argument_module if modules else None)
        finally:
            # (a run that never gives a step a network pays one attribute read here)
            met = self.local.__dict__.pop("modules", None) if self._modules_met else None
        if errors:
            raise errors[0]
        if met:
            self.local.networks = _module_parameters(met, named)
        return doc

    def _changed_inputs(self, frame: Frame, link: BackwardLink | None = None) -> None:
        """Record again, as the call leaves them, the inputs and the module's own parameters it changed in
        place (``Frame.versions``): a step whose work is an in-place update is compared by a replay, and a
        NaN it writes is its own result (``first_nonfinite`` names it, rather than the next step that reads
        it). A parameter's change through ``.data`` leaves its version counter as it was, and is not seen.
        So are the arguments autograd computed that the call changed through their taps (``link.rebased``:
        ``h.mul_(s)`` on an activation), which ``Frame.versions`` leaves out."""
        versions, frame.versions = frame.versions, None
        for name, t, version, kept in versions or ():
            if (version is not None and t._version != version) or not _same_bits(kept, t):
                self._capture(frame, "output", f"{layout.AFTER_PREFIX}{name}", t)
        if link is not None:
            for i, t, _ in link.rebased.values():
                name = link.input_names[i] if i < len(link.input_names) else None
                if name is not None:
                    self._capture(frame, "output", f"{layout.AFTER_PREFIX}{name}", t)

    def _capture(self, frame: Frame, role: str, name: str, t: torch.Tensor) -> str:
        """Snapshot one tensor into the frame; returns its record name (for the arguments document).
        A tensor that cannot be read as the recorder expects (a tensor subclass or layout it does not
        know) gets a record with what could be read and a note saying why: one odd tensor must not
        stop the recording of every step after it."""
        try:
            return self._capture_tensor(frame, role, name, t)
        except WriterStopped:
            raise
        except Exception as exc:  # (its record is appended last: none was)
            frame.tensors.append(TensorItem(role=ROLE[role], name=name, dtype=_dtype_text(t), device=_device_text(t),
                                            requires_grad=bool(getattr(t, "requires_grad", False)),
                                            shape=_shape_of(t), stride=(), stats=stats_mod.EMPTY, payload=None,
                                            held=self.iteration))
            message = " ".join(str(exc).split())[:300]
            frame.notes.append(f"{name}: {type(t).__name__} that could not be captured ({type(exc).__name__}: "
                               f"{message}): {layout.METADATA_NOTE}, without statistics")
            if not self._unread_warned:
                self._unread_warned = True
                warn(f"PaperDebugger could not capture {name} of {frame.defn.name} ({type(t).__name__}; "
                     f"{type(exc).__name__}: {message}): its record keeps what could be read and a note, and "
                     "recording goes on (once; the step's notes name each such tensor)", stacklevel=_outside_recorder())
            return name

    def _capture_tensor(self, frame: Frame, role: str, name: str, t: torch.Tensor) -> str:
        requires_grad = t.requires_grad
        if isinstance(t, _UNINITIALIZED):  # a lazy module's, before the call that gives it its shape
            frame.tensors.append(TensorItem(role=ROLE[role], name=name, dtype=payload_mod.dtype_name(t.dtype),
                                            device=str(t.device), requires_grad=requires_grad, shape=(), stride=(),
                                            stats=stats_mod.EMPTY, payload=None, held=self.iteration))
            frame.notes.append(f"{name}: {layout.UNINITIALIZED_NOTE}")
            return name
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and frame.vmap is None and \
                not t.is_nested:  # (a jagged nested tensor is torch's subclass: statistics only, not replayed)
            inner = _held_values(t)  # (a wrapper subclass holds no memory of its own: the tensor it wraps)
            if inner is None:
                self._note_subclass(frame, name, t)
            else:
                if _is_dtensor(t):  # this rank's shard: its placement noted (its class too, for a 1.30 reader)
                    self._note_subclass(frame, name, t)
                    self._note_dtensor(frame, name, t)
                t = inner
        owner = id(t) if role in _BY_CONTENT else 0  # (before detach: the parameter's identity counts)
        by_content = bool(owner) and frame.payloads and self._by_content(owner)
        alias = False  # a plain tensor outside autograd, no dual: detach() would only make another of it
        if frame.vmap is not None:
            t, bdims = transforms.plain(t)
            if bdims:
                frame.vmap[name] = bdims
        elif taps.dual(t):  # (its primal values are recorded: detach() leaves the tangent out)
            frame.duals.append(name)
        else:
            alias = not requires_grad and type(t) is torch.Tensor
        t = payload_mod.materialized(t if alias else t.detach())
        # (is_cpu, not t.device: each read of that makes a device object, and its text another string)
        on_cpu = t.is_cpu
        device = "cpu" if on_cpu else str(t.device)
        meta_only = t.is_nested or t.layout != torch.strided or not on_cpu and t.is_meta
        if not meta_only and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and \
                payload_mod.wrapper(t):  # (to _capture's record and note)
            raise RuntimeError("a tensor subclass that wraps other tensors holds no memory of its own to read (its "
                               "values are what its __torch_dispatch__ computes)")
        if not meta_only and type(t) is torch.Tensor and not payload_mod.backed(t):  # (to _capture's record and note)
            raise RuntimeError(f"its storage of {t.untyped_storage().nbytes()} bytes is smaller than its shape "
                               f"{list(t.shape)} and strides {list(t.stride())} need (freed or resized in place); "
                               "a read of it would crash the process")
        item = TensorItem(role=ROLE[role], name=name, dtype=payload_mod.dtype_name(t.dtype), device=device,
                          requires_grad=requires_grad, shape=_shape_of(t),
                          stride=() if meta_only else tuple(t.stride()), stats=stats_mod.EMPTY, payload=None,
                          held=self.iteration)
        if t.is_nested:  # (torch.nested, jagged or strided): ragged dimensions have no size, and no strides
            parts = t.unbind()
            frame.notes.append(f"{name}: nested tensor ({_layout_text(t)} layout) of {_nested_sizes(parts)} on "
                               f"{device}: {layout.METADATA_NOTE}; statistics over all its values, its ragged "
                               f"dimensions {layout.RAGGED_DIM} in its shape")
            if parts:
                item.stats = self._stats(frame, name, torch.cat([p.reshape(-1) for p in parts]), on_cpu)
        elif meta_only:
            values = stats_mod.stored_values(t)
            if values is None:
                frame.notes.append(f"{name}: {t.layout} tensor on {device}: {layout.METADATA_NOTE}")
            else:  # a sparse gradient (nn.Embedding(sparse=True)), adjacency: NaN in it is still found
                count = values.numel()
                frame.notes.append(f"{name}: {t.layout} tensor on {device}: {layout.METADATA_NOTE}; statistics "
                                   f"of its {count} stored value{'s' if count != 1 else ''} {layout.STORED_NOTE}")
                item.stats = self._stats(frame, name, values, on_cpu)
                self._note_sparse(frame, name, t, count)
                if frame.payloads and role in _SPARSE_PARTS_KEPT and frame.vmap is None:
                    frame.tensors.append(item)  # (before its parts: a reader meets the sparse record first)
                    self._capture_parts(frame, name, t)
                    return name
        else:
            stats = None  # from the payload's copy, when the statistics kernel made it
            if frame.payloads:
                try:
                    if on_cpu:
                        item.payload, stats = self._cpu_payload(t, by_content, owner)
                    else:
                        item.payload = self._device_payload(t)
                    if item.payload is None:  # dropped: the store cannot keep up
                        frame.dropped += 1
                except (payload_mod.UnsupportedDtype, NotImplementedError, RuntimeError) as exc:
                    frame.notes.append(f"{name}: {t.dtype} kept as metadata only ({type(exc).__name__}: {exc})")
            item.stats = self._stats(frame, name, t, on_cpu) if stats is None else stats
            if item.role in _PLACED and (type(t) is torch.Tensor or torch._C._has_storage(t)):
                at = t.data_ptr() % layout.ALIGNMENT  # (the address alone: most are aligned, and add nothing)
                if at:
                    self._note_misaligned(frame, name, at)
        frame.tensors.append(item)
        return name

    @staticmethod
    def _note_misaligned(frame: Frame, name: str, at: int) -> None:
        """Note that the tensor of record ``name`` began ``at`` bytes past a multiple of layout.ALIGNMENT,
        in the step's extra ``misaligned`` (record name -> bytes): a view ``xs[t]`` of a time-major batch
        whose rows are not a multiple of it long. CPU kernels (oneDNN, MKL) pick their code by the
        address, and ``F.linear(xs[1], w, b)`` rounds otherwise than the same values in fresh memory,
        which a replay gives unless told where they lay."""
        misaligned = (frame.arguments or {}).get("misaligned", {})
        misaligned.setdefault(name, at)
        frame.arguments = {**(frame.arguments or {}), "misaligned": misaligned}

    @staticmethod
    def _note_dtensor(frame: Frame, name: str, t: torch.Tensor) -> None:
        """Say in the step's extra ``dtensors`` (record name -> ``{"placements", "mesh", "mesh_dims",
        "coordinate", "shape"}``) that the record holds this rank's local shard of a DTensor: how it was
        laid out over which device mesh, where this rank sits in it, and the whole tensor's shape. Read
        from the DTensor's own attributes: nothing is communicated."""
        mesh = t.device_mesh
        names = mesh.mesh_dim_names
        coordinate = mesh.get_coordinate()
        doc = {"placements": [repr(p) for p in t.placements], "mesh": [int(n) for n in mesh.shape],
               "mesh_dims": list(names) if names else None,
               "coordinate": [int(c) for c in coordinate] if coordinate is not None else None,
               "shape": [int(n) for n in t.shape]}
        dtensors = (frame.arguments or {}).get("dtensors", {})
        dtensors.setdefault(name, doc)
        frame.arguments = {**(frame.arguments or {}), "dtensors": dtensors}

    @staticmethod
    def _note_subclass(frame: Frame, name: str, t: torch.Tensor) -> None:
        """Name a tensor subclass's class, and the attributes its instance holds, in the step's extra
        ``subclasses`` (record name -> ``{"type", "attrs"}``): a replay gives the step an instance of
        that class again (a fixed-point tensor whose ``__torch_function__`` rounds every result
        computes other values as a plain tensor). The record holds its values as a plain tensor's."""
        doc: dict[str, Any] = {"type": jsonval.type_ref(t)}
        state = getattr(t, "__dict__", None)
        if isinstance(state, dict) and state:
            doc["attrs"] = jsonval.encode({k: v for k, v in list(state.items())[:_SUBCLASS_ATTRS] if type(k) is str})
        subclasses = (frame.arguments or {}).get("subclasses", {})
        subclasses.setdefault(name, doc)
        frame.arguments = {**(frame.arguments or {}), "subclasses": subclasses}

    @staticmethod
    def _note_sparse(frame: Frame, name: str, t: torch.Tensor, count: int) -> None:
        """Name a sparse record's layout and how many values it stores in the step's extra ``sparse``
        (record name -> ``{"layout", "values"}``): its statistics are of those values, and a replay
        compares a sparse result by them, a count of NaN says how many of them."""
        sparse = (frame.arguments or {}).get("sparse", {})
        sparse.setdefault(name, {"layout": _layout_text(t), "values": count})
        frame.arguments = {**(frame.arguments or {}), "sparse": sparse}

    def _capture_parts(self, frame: Frame, name: str, t: torch.Tensor) -> None:
        """Record the tensors a sparse tensor is made of (its indices and values, as it holds them) as
        component records of their own, ``<name>:<part>``, with their bytes, and name them in the step's
        extra ``sparse`` (``parts``; ``coalesced``, a COO tensor's flag), so that a replay makes it again
        exactly (1.19). A part that cannot be captured gets its record and note as any tensor does, and a
        reader keeps to the sparse record's statistics."""
        parts = payload_mod.sparse_parts(t)
        if not parts:
            return
        entry = frame.arguments["sparse"][name]  # (_note_sparse made it)
        entry["parts"] = {part: self._capture(frame, "component", f"{name}{layout.PART_SEPARATOR}{part}", value)
                          for part, value in parts.items()}
        if t.layout == torch.sparse_coo:
            entry["coalesced"] = bool(t.is_coalesced())

    def _by_content(self, owner: int) -> bool:
        """Whether to hash a parameter's or buffer's bytes (``owner``: its id) before copying them,
        so that bytes held already are not copied again (a frozen weight, a module called twice in
        an iteration). A tensor whose bytes were new at its last two captures and since (a trained
        weight, new after every optimizer step) is copied under a token instead, and hashed by the
        writer only if written (see ``_cpu_payload``); at every eighth capture it is hashed again,
        and bytes found held go back to hashing. Only a guess: either way the same bytes are
        recorded."""
        if len(self._new_bytes) > _SEEN_LIMIT:  # ids of tensors gone: only a guess, so bounded
            self._new_bytes.clear()
        new = self._new_bytes.get(owner, 0)
        self._new_bytes[owner] = new + 1
        return new < 2 or new % 8 == 0

    @staticmethod
    def _stats(frame: Frame, name: str, t: torch.Tensor, on_cpu: bool) -> Any:
        # Dtypes torch can store but not compute with (bits16, float4, float8_e8m0) have no statistics.
        try:
            return stats_mod.host_stats(t) if on_cpu else stats_mod.device_stats(t)
        except (NotImplementedError, RuntimeError, TypeError) as exc:
            frame.notes.append(f"{name}: no statistics for {t.dtype} ({type(exc).__name__}: {exc})")
            return stats_mod.EMPTY

    def _cpu_payload(self, t: torch.Tensor, by_content: bool, owner: int = 0,
                     ) -> tuple[tuple[int, int, int] | int | None, tuple[float, ...] | None]:
        """Copy and send a CPU tensor's bytes. Returns their reference (a content key or a token),
        or None when they were dropped (the store cannot keep up: see ``_room``), and the tensor's
        statistics when the copy computed them (stats.copy_stats), else None.

        ``by_content``: the bytes are hashed first and copied only when new (parameters and buffers,
        as ``_by_content`` decides). Otherwise they are copied under a token, as a device tensor's
        are, and the writer hashes them when it writes them: in flight mode most never are, and a
        copy costs the training thread less than a hash (it reads the bytes for their statistics
        anyway; a cold 2 MB array is copied and summarised in ~250 us, hashed in ~120 us and
        summarised in ~180 us). Bytes that repeat (one step's output, the next one's input) are
        then copied twice and stored once: the writer deduplicates by content. A shared ring
        (share_ring) journals content keys, so it takes every payload by content. ``owner``: the
        id of the parameter or buffer ``t`` was detached from (0 for the others), whose count
        ``_by_content`` resets when its bytes are found held."""
        units, unit, aliases = payload_mod.as_units(t)
        if not by_content and self.shared is None:
            return self._copy_payload(t, PayloadItem(key=None, unit=unit, data=units, token=next(self._tokens)),
                                      units, aliases)
        key = payload_mod.content_key(units, unit)
        held = key in self.seen  # on its way to the store already
        if held:
            if self.ring is not None and self.iteration != self._direct_iteration:
                self._ring_note()
        elif self.ring is not None:
            with self.ring.lock:  # found and held again at once: no other thread drops it in between
                if self.iteration != self._direct_iteration:
                    # Room first: the first payload of an iteration drops the oldest one, which may be
                    # the only one holding these bytes (a batch evaluated every ``keep`` iterations).
                    # Found there and held again after, their buffer went back for reuse meanwhile.
                    self._ring_room()
                found = self.ring.find(key)
                if found is not None:  # the same bytes wait in the ring: hold them for this iteration too
                    self._send_payload(found, key)
                    held = True
        if held:
            self._new_bytes.pop(owner, None)  # back to hashing first (see _by_content)
            return key, None
        return self._copy_payload(t, PayloadItem(key=key, unit=unit, data=units), units, aliases)

    def _copy_payload(self, t: torch.Tensor, item: PayloadItem, units: np.ndarray, aliases: bool
                      ) -> tuple[tuple[int, int, int] | int | None, tuple[float, ...] | None]:
        """Copy ``units`` (``t``'s bytes) into ``item`` when ``t`` may change after this step, and
        send it under its key, or its token when it has none (see ``_cpu_payload``)."""
        ref = item.token if item.key is None else item.key
        shared = self.shared is not None and units.nbytes > 0  # a shared ring holds every payload's bytes
        if aliases or shared:  # the tensor may change after this step: copy it, into a reused buffer if large
            item.buffer = self.pipeline.pool.take(units.nbytes)
            if shared and item.buffer is None:
                self._no_room_shared()
        if not self._room(item.nbytes, item.buffer):  # before the copy: a dropped payload costs none
            return None, None
        stats = None
        try:
            if item.buffer is not None:
                item.data = item.buffer[:units.nbytes].view(units.dtype)
                stats = stats_mod.copy_stats(t, item.data, units)
                if self.shared is not None:
                    self.shared.publish(item.buffer, item.key)
            elif aliases:
                item.data = copy_buffer(units.nbytes).view(units.dtype)
                stats = stats_mod.copy_stats(t, item.data, units)
            self._send_payload(item, ref)
        except BaseException:
            self._unroom(item.nbytes)
            raise
        return ref, stats

    def _device_payload(self, t: torch.Tensor) -> int | None:
        unit = payload_mod.unit_of(t.dtype)
        flat = payload_mod.flat(t)
        nbytes = flat.numel() * t.element_size()
        if not self._room(nbytes):  # dropped (the store cannot keep up): no staging, no copy
            return None
        try:
            # Page-locked staging lets the copy run asynchronously; the writer waits on the event.
            pinned = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=t.device.type == "cuda")
            if nbytes:
                pinned.copy_(flat.view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event() if t.device.type == "cuda" else None
            if event is not None:
                event.record()
            token = next(self._tokens)
            self._send_payload(PayloadItem(key=None, unit=unit, pinned=pinned, event=event, token=token), token)
        except BaseException:
            self._unroom(nbytes)
            raise
        return token

    def _room(self, nbytes: int, buffer: np.ndarray | None = None) -> bool:
        """Full mode: take room in the writer queue for a payload, before it is copied. False when
        the store cannot keep up and the payload is dropped (``when_slow="drop_payloads"``; warned
        once), ``buffer`` going back to the pool. Flight mode's bytes are bounded by its ring."""
        if self.ring is not None or self.pipeline.reserve(nbytes):
            return True
        if buffer is not None:
            self.pipeline.pool.give(buffer)
        if self.pipeline.error is not None:
            raise WriterStopped(self.pipeline.problem())
        if not self._slow_warned:
            self._slow_warned = True
            warn(f"PaperDebugger is dropping tensor payloads: {self.pipeline.where()} cannot keep up with "
                 f"training (its queue of max_queue_bytes={self.pipeline.max_queue_bytes} stayed full longer "
                 "than training may wait); every step and statistic is still recorded, the tensors whose "
                 "bytes were dropped have statistics only; record to a faster disk, record less "
                 "(mode='stats', every=k), raise max_queue_bytes, or pass when_slow='wait' to hold "
                 "training instead", stacklevel=2)
        return False

    def _unroom(self, nbytes: int) -> None:
        """Give back the room ``_room`` took for a payload that was not handed over."""
        if self.ring is None:
            self.pipeline.unreserve(nbytes)

    def _send(self, item: Any, nbytes: int) -> None:
        # Full mode's payloads took their room before they were copied (_room); the others wait for it.
        reserved = self.ring is None and isinstance(item, PayloadItem)
        if not self.pipeline.submit(item, nbytes, reserved=reserved):
            raise WriterStopped(self.pipeline.problem())

    def _submit(self, frame: Frame) -> None:
        if frame.dropped:  # says why these records have statistics only
            frame.notes.append(f"{frame.dropped} {layout.DROPPED_NOTE} (when_slow='drop_payloads')")
            frame.dropped = 0
        if frame.duals:
            frame.notes.append(f"{_one_line(frame.duals)}: {layout.DUAL_NOTE}")
            frame.duals = []
        docs = {"name": frame.defn.name, "definition": frame.definition or frame.defn.doc(), "module_path": frame.path,
                "module": frame.module_doc if frame.module_doc is not None else self._module_doc(frame.module),
                "settings": frame.settings,
                "args": frame.args_doc, "output": frame.output_doc}
        row = {"phase": frame.phase, "iteration": frame.iteration, "call": frame.call, "parent": frame.parent,
               "forward": frame.forward, "t_start": frame.t_start, "t_end": frame.t_end}
        self._send(StepItem(index=frame.index, row=row, docs=docs, rng=frame.rng, tensors=frame.tensors,
                            exception=frame.exception, expectations=frame.expectations, notes=frame.notes,
                            alerts=frame.alerts, collectives=frame.collectives, vmap=frame.vmap or None,
                            vmap_randomness=frame.vmap_randomness,
                            own_grads=frame.own_grads, arguments=frame.arguments), 0)

    def _monitor(self, frame: Frame, out: Any = None) -> None:
        """Run checks, breakpoints and the anomaly action on a finished step (before it is submitted)."""
        if not self.monitor.active():
            return
        try:
            ctx = self._context(frame, out)
            anomaly = self._anomaly(frame)
            alerts, frame.pending = self.monitor.evaluate(ctx, None if anomaly is None else anomaly[1])
            frame.alerts.extend(alerts)
        except Exception as exc:
            frame.notes.append(f"monitors failed: {type(exc).__name__}: {exc}")

    def _context(self, frame: Frame, out: Any) -> monitors.StepContext:
        stats: dict[str, dict[str, float]] = {}
        roles: dict[str, str] = {}
        for t in frame.tensors:
            role = layout.ROLES[t.role]
            key = t.name if t.name not in stats else f"{role}:{t.name}"
            stats[key], roles[key] = monitors.stats_dict(t.stats), role
        return monitors.StepContext(index=frame.index, name=frame.defn.name, paper=frame.defn.paper,
                                    phase=layout.PHASES[frame.phase], iteration=frame.iteration, call=frame.call,
                                    module_path=frame.path, stats=stats, roles=roles,
                                    output=out if frame.phase == 0 else None, module=frame.defn.kind == "module")

    def _settings(self) -> dict[str, Any]:
        """The settings now; the previous snapshot object itself when nothing changed, so the writer
        recognises it by identity instead of encoding the same document at every step."""
        key = snapshot.settings_values()
        known = self._known_settings.get(key)
        if known is None:
            if len(self._known_settings) >= 1024:  # settings that keep changing: stop remembering
                self._known_settings.clear()
            known = self._known_settings[key] = snapshot.settings_of(key)
        return known

    def _argument_module(self, module: torch.nn.Module) -> dict[str, Any]:
        """The skeleton of a module given as an argument (cached as a step's module's is). Its parameters and
        buffers are inputs: a network given to every act() call of an iteration is stored once all the same
        (the writer keeps each payload once by content). Each module met is noted for ``_encode``'s ``given``."""
        self._modules_met = True
        self.local.__dict__.setdefault("modules", []).append(module)
        return self._module_entry(module)[0]

    def _module_doc(self, module: torch.nn.Module | None) -> dict[str, Any] | None:
        return self._module_entry(module)[0] if module is not None else None

    def _module_entry(self, module: torch.nn.Module,
                      path: str = "") -> tuple[dict[str, Any], tuple[tuple[str, Any, Any], ...]]:
        """(the module's skeleton, the generator objects it holds: ``snapshot.find_module_rngs``). Both are
        made again only when the tree's attributes changed (skeleton.state_key: a temperature schedule,
        a counter, a child put in eval mode, a generator replaced); the writer stores each distinct
        skeleton once."""
        entry = self._module_docs.get(id(module))
        key = skeleton.state_key(module)
        if entry is None or entry[0]() is not module or entry[1] != key:  # (an id can be reused)
            if len(self._module_docs) >= _MODULE_DOCS_LIMIT:  # entries of modules gone: only a cache
                self._module_docs.clear()
            # "instance": the module object's number in the recording, from 1 in the order first
            # called, so that two modules at one path (a student and its EMA teacher) are told apart
            number = self._instances.get(id(module))
            if number is None or number[0]() is not module:
                if len(self._instances) >= _MODULE_DOCS_LIMIT:  # modules made anew each call: forget those gone
                    self._instances = {k: v for k, v in self._instances.items() if v[0]() is not None}
                number = self._instances[id(module)] = (weakref.ref(module), next(self._instance_numbers))
            doc = {**skeleton.build(module), "instance": number[1]}
            if not self._rebuild_warned:
                self._warn_if_not_rebuilt(module, doc, path)
            entry = self._module_docs[id(module)] = (weakref.ref(module), key, doc, snapshot.find_module_rngs(module),
                                                     [None])
        return entry[2], entry[3]

    def _parameters_of(self, module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """``list(module.named_parameters())`` for a step's module whose ``_module_entry`` the call has just
        found or made (so its ``skeleton.state_key`` is the entry's): which module holds each parameter under
        which name is kept with the entry, found by named_parameters once, and the tensors held there now are
        read. The key holds every module of the tree by identity, each one's parameter names, which are None
        and which are one tensor (named_parameters lists a tensor held twice once): with it unchanged, so is
        that list but for the tensors in it (a parameter replaced by another, ``functional_call``'s swaps);
        with it changed (a parameter added, tied, set to None; a child replaced) the entry is made again."""
        entry = self._module_docs.get(id(module))
        if entry is None or entry[0]() is not module:
            return list(module.named_parameters())
        places = entry[4][0]
        if places is None:
            places = entry[4][0] = _parameter_places(module)
        if not places:  # (none to look up; or a tree whose parameters named_parameters finds otherwise)
            return list(module.named_parameters()) if places is False else []
        return [(name, owner()._parameters[key]) for name, owner, key in places]

    def _buffers_left(self, module: torch.nn.Module | None) -> None:
        """Remember each buffer of a module whose call just ended, and its version counter: what
        the module's next recorded call should find, unless other code writes or replaces it."""
        if module is None:
            return
        transformed = transforms.active()  # (a stack_module_state ensemble's: the stacked tensor behind each)
        with transforms.outside_if(transformed):
            left = {name: (weakref.ref(b), b._version, _kept(b, _KEPT_BUFFER_BYTES))
                    for name, b in _buffers_of(module, transformed) if not b.is_inference()}
        if not left:
            self._left_buffers.pop(id(module), None)
            return
        if len(self._left_buffers) >= _MODULE_DOCS_LIMIT:  # modules made anew each call: forget those gone
            self._left_buffers = {k: v for k, v in self._left_buffers.items() if v[0]() is not None}
        self._left_buffers[id(module)] = (weakref.ref(module), left)

    def _buffers_written(self, module: torch.nn.Module, buffers: list[tuple[str, torch.Tensor]]) -> list[str]:
        """The buffers that code outside the module's calls wrote in place or replaced since its last
        recorded call (a checkpoint's load_state_dict, ``model.to(torch.float64)``, a reset, an EMA
        copy through ``.data``): a replay of that call must not take what this one finds for the
        call's own result. (In-place writes bump a buffer's version counter, but for those through
        ``.data``, seen by the bits of small CPU buffers; a replacement is another tensor.)"""
        entry = self._left_buffers.get(id(module))
        if entry is None or entry[0]() is not module:
            return []
        written = []
        for name, b in buffers:
            was = entry[1].get(name)
            if was is not None and (was[0]() is not b or b._version != was[1]  # (a tracked one is not inference)
                                    or not _same_bits(was[2], b)):
                written.append(name)
        return written

    # -- backward --------------------------------------------------------------------------------
    def _guard(self, where: str, fn: Callable[[], None]) -> None:
        if not self.enabled or self.closed:
            return
        try:
            with self.lock, quiet():
                fn()
        except Exception as exc:
            self.fail(where, exc)

    def _tap_inputs(self, link: BackwardLink, args: tuple[Any, ...], kwargs: dict[str, Any], skip: frozenset[int],
                    frame: Frame | None = None, slots: list[Any] | None = None, split: frozenset[int] = frozenset(),
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Pass a call's tensor arguments (``slots``, when known: taps.argument_slots) through a tap
        that reports their grads to ``link``; not those in ``skip`` (also inside a list: see
        taps.tap_arguments), noted on ``frame``; those in ``split`` per place (taps.split_places)."""
        args, kwargs, names = taps.tap_arguments(args, kwargs, _backward_callback(self._on_grad_input, link), skip,
                                                 slots, undo=link.undo, watched=link.watched, nodes=link.tap_nodes,
                                                 split=split)
        link.input_names = list(names)
        if skip and frame is not None:
            frame.notes.append(_UNTAPPED_NOTE)
        return args, kwargs

    @staticmethod
    def _changed_not_returned(link: BackwardLink, frame: Frame | None) -> None:
        """Leave out the grad inputs of the arguments the call changed in place and did not return
        (taps.rebase_changed): the caller's later uses of one send their gradients through the call's
        in-place operations to its tap, where a replay of the call's backward, from its outputs' grads
        alone, does not. Those it returned are its outputs: their gradients are its grad outputs."""
        rebased, link.rebased = link.rebased, {}
        names = []
        for i, _, cell in rebased.values():
            if cell[0] is None:
                names.append(link.input_names[i])
                link.input_names[i] = None
        if names and frame is not None:
            frame.notes.append(f"{_one_line(names)}: {layout.CHANGED_ARGUMENT_NOTE}")

    def _hook_param(self, link: BackwardLink, name: str, p: torch.Tensor, again: bool = False) -> None:
        """Hook a parameter's gradient for ``link`` (``again``: one of ``link.hooked``, for a
        second backward through its graph)."""
        if not again:
            link.hooked.append((name, p))
        link.handles.append(p.register_hook(_backward_callback(self._on_param_grad, link, name)))

    def _tap_outputs(self, link: BackwardLink, out: Any, skip: frozenset[int], frame: Frame | None = None,
                     slots: list[Any] | None = None) -> Any:
        """Pass a call's outputs (``slots``, when known) through a tap that reports their grads to
        ``link`` (not those in ``skip``, see _tap_inputs); the link then waits for its backward (or
        the iteration's end)."""
        out, link.output_names, left = taps.tap_output(out, _backward_callback(self._on_grad_output, link), skip,
                                                       slots, link.rebased)
        if link.rebased:
            self._changed_not_returned(link, frame)
        link.complete = not (skip or left) and any(link.output_names)
        if frame is not None:
            if skip:
                frame.notes.append(_UNTAPPED_NOTE)
            if left:
                frame.notes.append(f"{_one_line(left)}: {layout.UNCOPIED_NOTE}")
        if any(link.output_names) or link.handles:
            with self.lock:
                self._links.append(link)
        return out

    def _on_grad_output(self, link: BackwardLink, grads: tuple[torch.Tensor | None, ...], first: int = 0) -> None:
        """The grads of the outputs ``link.output_names[first:]`` (one, from taps.tap_each, or all)."""
        if _batched_backward(link, grads):
            return
        def run() -> None:
            frame = self._open_backward(link)
            for name, g in zip(link.output_names[first:first + len(grads)], grads):
                if g is not None and name is not None:
                    self._capture(frame, "grad_output", name, g)
        self._guard("capturing grad outputs", run)

    def _on_grad_input(self, link: BackwardLink, grads: tuple[torch.Tensor | None, ...], first: int = 0) -> None:
        """The grads of the inputs ``link.input_names[first:]`` (as _on_grad_output)."""
        if _batched_backward(link, grads):
            return
        def run() -> None:
            frame = self._open_backward(link)
            for name, g in zip(link.input_names[first:first + len(grads)], grads):
                if g is not None and name is not None:
                    self._capture(frame, "grad_input", name, g)
            frame.t_end = time.perf_counter() - self.t0
            link.finished = True
        self._guard("capturing grad inputs", run)

    def _on_param_grad(self, link: BackwardLink, name: str, grad: torch.Tensor) -> None:
        """A parameter's gradient, summed over the pass. A hook is per tensor, not per graph: one that
        fires before its call's backward began at an output's tap, while another call of the same
        module has begun its backward in this pass, is that call's graph's (two graphs built before
        either backward), not this call's. Without that other call, it is this call's, through a
        path other than its outputs (an auxiliary loss kept on the module), where the pass goes through a
        node made while the call ran; a pass that reaches the parameter only by uses made after the call (an
        L2 penalty of the weight alone, a jvp of the module) never went through its graph, and the call, whose
        output got no gradient (a metric taken in grad mode), has no backward step in it."""
        if grad is None or _batched_backward(link, (grad,)):  # (None: a node ran with no gradient to send)
            return
        if name in link.done and name in link.own and name not in link.sums:  # (recorded from its uses: most)
            return
        def run() -> None:
            if name in link.own:  # its uses in the call's graph have all run by now
                if name in link.sums:  # some sent no gradient: the sum of those that did is the call's own
                    _, total = link.sums.pop(name)
                    if total is not None:
                        self._own_grad(link, name, total)
                if name in link.done:
                    return
            if link.frame is None and link.complete and self._pass_modules[id(link.fwd.module)]:  # (all begun)
                return
            if link.frame is None and name in link.own and not self._went_through(link):
                return
            frame = self._open_backward(link)
            self._capture(frame, "param_grad", name, grad)
            # (not the step's end: a total comes once the pass has reached every call, at its end)
        self._guard("capturing parameter grads", run)

    def pass_began(self, roots: Any) -> tuple[int, tuple[Any, ...] | None]:
        """A backward pass begins at ``roots``, what autograd's engine was given (run._BackwardCalls);
        returns what ``pass_ended`` is given when it is over."""
        began = (threading.get_ident(), taps.root_nodes(roots))
        undo = None
        if began[1] and self.enabled and not self.closed:
            try:
                with quiet():
                    undo = taps.order_uses(began[1])
            except Exception as exc:
                self.fail("ordering the uses of tapped tensors", exc)
        with self.lock:
            self._roots.append(began)
            if undo is not None:
                self._in_order[id(began)] = undo
        return began

    def pass_ended(self, began: tuple[int, tuple[Any, ...] | None]) -> None:
        """The backward pass ``pass_began`` returned ``began`` for is over (or raised)."""
        with self.lock:
            self._roots = [r for r in self._roots if r is not began]
            undo = self._in_order.pop(id(began), None)
        if undo is not None:
            undo()

    def _went_through(self, link: BackwardLink) -> bool:
        """Whether the backward pass under way, which reached one of ``link``'s parameters while no output tap
        or parameter use of the call's graph sent it anything, goes through a node made while the call ran
        (taps.goes_through). True where that cannot be told: no pass begun through torch.autograd, passes
        begun on several threads at once, a walk longer than its limit."""
        task = _graph_task_id()
        if task == -1 or link.until < link.since:
            return True
        if link.aside == task:
            return False
        with self.lock:
            roots = list(self._roots)
        if not roots or roots[-1][1] is None or len({thread for thread, _ in roots}) > 1:
            return True
        if taps.goes_through(roots[-1][1], link.since, link.until) is False:
            link.aside = task
            return False
        return True

    def _on_own_grad(self, link: BackwardLink, places: tuple[tuple[int, str], ...],
                     grads: tuple[torch.Tensor | None, ...], _outputs: Any) -> None:
        """A node of a call's graph that uses its parameters ran (``places``: where their gradients
        are among ``grads``): add each one's contribution to the call's own parameter grad; once
        every use has sent one, it is recorded (what never came, a use with no gradient to send,
        at the pass's end: ``_finish_own``)."""
        if _batched_backward(link, grads):
            return
        def run() -> None:
            for k, name in places:
                if name not in link.own:  # a later call reused its nodes: recorded as a total (_reused_nodes)
                    continue
                total = _add_use(link.sums, name, grads[k], link.own[name])
                if total is not None:
                    self._own_grad(link, name, total)
        self._guard("capturing parameter grads", run)

    def _on_arg_grad(self, link: BackwardLink, places: tuple[tuple[int, str], ...],
                     grads: tuple[torch.Tensor | None, ...], _outputs: Any) -> None:
        """A node of a call's graph that uses its leaf arguments ran: as ``_on_own_grad``, for their grad
        inputs (once every use has sent its contribution; the rest at the pass's end: ``_finish_own``)."""
        if _batched_backward(link, grads):
            return
        def run() -> None:
            if any(grads[k] is not None for k, _ in places):  # (in the pass's steps now: _finish_own sees its sums)
                self._open_backward(link)
            for k, name in places:
                total = _add_use(link.arg_sums, name, grads[k], link.arg_uses[name])
                if total is not None:
                    self._arg_grad(link, name, total)
        self._guard("capturing grad inputs", run)

    def _arg_grad(self, link: BackwardLink, name: str, grad: torch.Tensor) -> None:
        frame = self._open_backward(link)
        self._capture(frame, "network_grad" if name in link.networks else "grad_input", name, grad)
        frame.t_end = max(frame.t_end, time.perf_counter() - self.t0)

    def _hook_arg(self, link: BackwardLink, name: str, t: torch.Tensor, again: bool = False) -> None:
        """Hook a leaf argument's gradient for ``link`` (``again``: one of ``link.arg_hooked``, for a
        second backward through its graph): it runs once every use has sent its contribution and the
        nodes that sent them have passed autograd's checks (anomaly mode raises after a node's hooks ran),
        as an input tap's backward would: then the call's backward has reached its input."""
        if not again:
            link.arg_hooked.append((name, t))
        link.handles.append(t.register_hook(_backward_callback(self._on_arg_reached, link, name)))

    def _on_arg_reached(self, link: BackwardLink, name: str, grad: torch.Tensor) -> None:
        """A leaf argument's gradient, summed over the pass: the call's own grad input for it is recorded
        by now, but where some of its uses sent no gradient (the sum of those that did, recorded here)."""
        if grad is None or _batched_backward(link, (grad,)):
            return
        def run() -> None:
            if link.frame is None:  # another graph's pass: this call's backward has not begun in it
                return
            if name in link.arg_sums:
                _, total = link.arg_sums.pop(name)
                if total is not None:
                    self._arg_grad(link, name, total)
            link.arg_done.add(name)
            self._finished_without_taps(link)
        self._guard("capturing grad inputs", run)

    @staticmethod
    def _finished_without_taps(link: BackwardLink) -> None:
        """A call whose inputs no tap took: its backward is over once its own parameter grads and its leaf
        arguments' grad inputs are all recorded."""
        if not link.input_names and len(link.done) == len(link.own) and len(link.arg_done) == len(link.arg_uses):
            link.finished = True

    def _own_grad(self, link: BackwardLink, name: str, grad: torch.Tensor) -> None:
        link.done.add(name)
        self._finished_without_taps(link)  # (no input tap to end it: this does)
        frame = self._open_backward(link)
        frame.own_grads.append(name)
        self._capture(frame, "param_grad", name, grad)
        frame.t_end = max(frame.t_end, time.perf_counter() - self.t0)

    def _finish_own(self, links: list[BackwardLink]) -> None:
        """A pass is over: record the parameter grads of uses that did not all send one."""
        for link in links:
            sums, link.sums = link.sums, {}
            for name, (_, total) in sums.items():
                if total is not None and link.frame is not None:
                    self._guard("capturing parameter grads", functools.partial(self._own_grad, link, name, total))
            sums, link.arg_sums = link.arg_sums, {}
            for name, (_, total) in sums.items():
                if total is not None and link.frame is not None:
                    self._guard("capturing grad inputs", functools.partial(self._arg_grad, link, name, total))
            link.done.clear()
            link.arg_done.clear()

    def _open_backward(self, link: BackwardLink) -> Frame:
        if link.frame is not None:
            return link.frame
        fwd = link.fwd
        parent = self._pass_frames[fwd.parent].index if fwd.parent in self._pass_frames else -1
        now = time.perf_counter() - self.t0
        frame = Frame(index=self._new_index(), phase=1, defn=fwd.defn, module=fwd.module, path=fwd.path,
                      call=fwd.call, parent=parent, iteration=self.iteration, t_start=now,
                      payloads=self._payloads_now(), forward=fwd.index, t_end=now, root=fwd.root)
        frame.rng = self.rng.parts()
        frame.settings = self._settings()
        frame.module_doc = fwd.module_doc
        frame.definition = fwd.definition
        if link.graphed:  # a later pass, through the graph of gradients an earlier one made
            frame.notes.append(layout.SECOND_ORDER_NOTE)
            frame.gradient_user = self._gradient_user
            if link.took:
                self._gradient_user = frame
        if link.reused and len(link.own) < len(link.params):
            frame.notes.append(layout.REUSED_NOTE)
        elif torch.is_grad_enabled():  # autograd runs a backward with grad mode = create_graph
            link.graphed = True
            link.took = any(f is fwd for f in self._stack())
        link.frame = frame
        self._pass.append(link)
        self._pass_frames[fwd.index] = frame
        self._pass_modules[id(fwd.module)] += 1
        if (link.hooked or link.arg_hooked) and not link.handles:  # a second backward through its graph: hooked again
            for name, p in link.hooked:
                self._hook_param(link, name, p, again=True)
            for name, t in link.arg_hooked:
                self._hook_arg(link, name, t, again=True)
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(_backward_callback(self._end_of_backward))
            self._callback_queued = True
        return frame

    def backward_running(self) -> bool:
        """Whether a recorded step's backward is under way in the pass in progress (begun, not finished)."""
        with self.lock:
            return any(lk.frame is not None and not lk.finished for lk in self._pass)

    def _end_of_backward(self, aborted: bool = False, exception: BaseException | None = None) -> None:
        """Autograd calls this when a backward pass is over: the open backward steps are complete.
        Also called with ``aborted=True`` at iteration ends and on close, for a backward pass that
        raised (autograd then never calls back): its steps are written with what they captured, and
        ``exception``, the one that ended the recording (anomaly mode's "returned nan values", a
        Ctrl-C), goes to the steps whose backward was under way: those that had not finished (no
        grad input came), the one it stopped in and those around it, each marked ``exception`` as a
        forward's are. Only those are noted as stopped: a step whose grad inputs and own parameter
        grads all came before the pass stopped is whole."""
        cut: set[int] = set()  # links whose step the pass stopped in (before _finish_own marks partial sums done)
        if aborted:
            cut = {id(lk) for lk in self._pass if not lk.finished or any(n not in lk.done for n in lk.own)
                   or any(n not in lk.arg_done for n in lk.arg_uses)}
        self._finish_own(list(self._pass))
        with self.lock:
            if aborted and not self._pass:
                return
            done, self._pass, self._callback_queued = self._pass, [], False
            self._pass_frames.clear()
            self._pass_modules.clear()
            self._gradient_user = None
            if aborted:
                for link in done:
                    if link.frame is not None and id(link) in cut:
                        link.frame.notes.append(layout.STOPPED_PASS_NOTE)
                running = [lk.frame for lk in done if lk.frame is not None and not lk.finished]
                if exception is not None and running:  # each step the pass was inside raised it, as in a forward
                    doc = exception_doc(exception)
                    for frame in running:
                        frame.exception = doc
            frames = [link.frame for link in done]
            for link in done:
                for handle in link.handles:
                    handle.remove()
                link.handles.clear()
                link.frame = None  # a second backward through the same graph is a new step
                link.finished = False
            ids = {id(lk) for lk in done}
            self._links = [lk for lk in self._links if id(lk) not in ids]
            self._prune_spans()
        if not self.enabled or self.closed:
            return
        pending = None
        try:
            ordered = sorted((f for f in frames if f is not None), key=lambda f: f.index)
            self._ended = {f.index: f for f in ordered}
            try:
                for frame in _inner_first(ordered):  # a stop names the innermost step, as in the forward
                    self._monitor(frame)
                    pending = pending or frame.pending
            finally:
                self._ended = {}
            for frame in ordered:
                self._submit(frame)
                self._after_step(frame)
        except Exception as exc:
            self.fail("finishing a backward pass", exc)
            return
        if pending is not None and not aborted:
            if self.loss_scaled and pending.error is monitors.NonFiniteError:
                self.deferred = pending  # GradScaler decides: see run._GradScaling
                return
            self.perform(pending, lambda: self.pipeline.flush(60.0))  # raises out of backward()

    def close(self, exception: BaseException | None = None) -> None:
        """Write out steps still open and remove every hook this session added. ``exception``: what
        ended the recording, if anything did (a backward pass it stopped is recorded with it)."""
        if self.autocapture is not None:
            self.autocapture.close()
        self._end_of_backward(aborted=True, exception=exception)
        self._report_unreported()
        # An exception raised between steps (the loop's own, the data loader's) wrote nothing yet: its
        # write-out says so, for "end" reads as a run that ended normally.
        self.dump_ring("end" if exception is None else "exception")
        self.closed = True
        if self._recursion_limit is not None and sys.getrecursionlimit() == self._raised_limit:
            sys.setrecursionlimit(self._recursion_limit)  # (unless the program set its own since)
        self.modules.close()
        with self.lock:
            links, self._links = self._links, []
            # What refers to the calls, their modules or tensors: a closed recording keeps none alive.
            self._spans, self._span_starts, self._reached, self._hook_scan = [], [], {}, {}
            self._tied = None
        for link in links:
            for handle in link.handles:
                handle.remove()


def exception_doc(exc: BaseException, limit: int | None = 50) -> dict[str, str]:
    """An exception as the store keeps it: its type reference, message and traceback (the last
    ``limit`` frames), cut to bounded lengths."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=limit))
    return {"type": jsonval.type_ref(type(exc)), "message": str(exc)[:10000], "traceback": tb[-20000:]}


def _shape_of(t: Any) -> tuple[int, ...]:
    """A tensor's shape as plain ints: a dimension without one size (a nested tensor's ragged one, the
    symbolic ``j1`` of the jagged layout) is ``layout.RAGGED_DIM``, and a tensor whose dimensions cannot
    be read at all has shape ()."""
    try:
        if not t.is_nested:
            shape = tuple(t.shape)
            for d in shape:  # (a loop, not all() over a generator: a tensor record reads its shape here)
                if type(d) is not int:
                    return tuple(d if type(d) is int else layout.RAGGED_DIM for d in shape)  # (a symbolic size)
            return shape
        sizes = [tuple(p.shape) for p in t.unbind()]
        inner = [s[0] if len(set(s)) == 1 else layout.RAGGED_DIM for s in zip(*sizes)] if sizes else \
            [layout.RAGGED_DIM] * (t.dim() - 1)
        return (len(sizes), *(int(d) for d in inner))
    except Exception:  # noqa: BLE001 - (what a record without shape says instead: its note)
        return ()


def _nested_sizes(parts: tuple[torch.Tensor, ...], shown: int = 8) -> str:
    """The sizes of a nested tensor's tensors, for its note: "2 tensors of sizes (3, 4), (5, 4)"."""
    sizes = ", ".join(str(tuple(p.shape)).replace(",)", ")") for p in parts[:shown])
    more = f", ... ({len(parts) - shown} more)" if len(parts) > shown else ""
    return f"{len(parts)} tensor{'' if len(parts) == 1 else 's'}" + (f" of sizes {sizes}{more}" if parts else "")


def _layout_text(t: torch.Tensor) -> str:
    return str(t.layout).removeprefix("torch.")


def _dtype_text(t: Any) -> str:
    try:
        return payload_mod.dtype_name(t.dtype)
    except Exception:  # noqa: BLE001
        return str(getattr(t, "dtype", "unknown")).removeprefix("torch.")


def _device_text(t: Any) -> str:
    try:
        return str(t.device)
    except Exception:  # noqa: BLE001
        return "unknown"


def _batched_backward(link: BackwardLink, grads: tuple[Any, ...]) -> bool:
    """Whether these gradients come from a batched backward pass of a call made outside vmap
    (``autograd.grad(..., is_grads_batched=True)``, a vectorized ``autograd.functional.jacobian``):
    many backward passes at once, which is no backward step of the call (and whose batched gradients
    can be neither detached nor copied); not recorded."""
    return link.fwd.vmap is None and any(isinstance(g, torch.Tensor) and _LEGACY_BATCHED(g) for g in grads)


_LEGACY_BATCHED = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)  # (autograd's batching)


_DEEP = 32  # nested step calls from which each call makes sure of the recursion limit (_recursion_room)
# the frames a recorded step call adds (paper_step's wrapper, Session.call, invoke), not one more: a
# recursion that never ends must still reach the limit, at about the depth it would unrecorded
_FRAMES_PER_STEP = 3
_CAPTURE_FRAMES = 200  # what capturing a call's inputs and outputs may take (encoding nested arguments)

_ARGUMENT = "argument"  # (_ARGUMENT, record name): a leaf argument's key among the parameters' (_hook_params)

_UNTAPPED_NOTE = ("a tensor both in a place a tap follows and in one it does not (inside another object; for an "
                  "argument, a leaf inside a container too) has no gradient recorded: following it through the call "
                  "would change the order in which autograd sums its gradients")


def _add_use(sums: dict[str, tuple[int, Any]], name: str, g: torch.Tensor | None, uses: int) -> torch.Tensor | None:
    """Add one use's contribution ``g`` to a call's gradient of ``name`` (``sums``: name -> (uses that have
    sent theirs, their sum), as autograd adds them: commutes bitwise); the sum once all ``uses`` have sent
    theirs (None until then, or where none sent a gradient)."""
    came, total = sums.get(name, (0, None))
    if g is not None:
        total = g if total is None else total + g
    if came + 1 < uses:
        sums[name] = (came + 1, total)
        return None
    sums.pop(name, None)
    return total


def _cached_parametrizations(module: torch.nn.Module) -> list[str]:
    """The parametrized tensors of ``module`` and its submodules (``sn.weight``) that a call begun now takes from
    the cache of ``parametrize.cached()``, made there by an earlier call: a replay of this one computes them
    anew, and a parametrization with state of its own (spectral norm's power iteration) then gives another
    weight. Nothing is walked outside such a cache (one read of a module global)."""
    cache = getattr(_parametrize, "_cache", None)
    if not getattr(_parametrize, "_cache_enabled", 0) or not cache:
        return []
    return [f"{path}.{name}" if path else name for path, sub in module.named_modules()
            if _parametrize.is_parametrized(sub) for name in sub.parametrizations if (id(sub), name) in cache]


def _module_parameters(modules: list[torch.nn.Module], named: dict[Any, str | None]) -> list[tuple[str, torch.Tensor]]:
    """The parameters that require grad of the ``modules`` a call was given, each once, with the name of its
    record (``named``: ``_encode``'s keys, a tensor's id first, -> record names), in the order they were met."""
    params = {id(p): p for m in modules for p in m.parameters()
              if p.requires_grad and p.grad_fn is None and not p.is_inference()}
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for key, record in named.items():
        at = key if type(key) is int else key[0] if type(key) is tuple else None
        if at in params and record is not None and at not in out:
            out[at] = (record, params[at])
    return list(out.values())


def _one_line(names: list[str]) -> str:
    """Record names for a note, on one line (a dict key may hold a newline)."""
    return ", ".join(n.encode("unicode_escape").decode() for n in names)


def _top_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[tuple[str, Any], torch.Tensor]]:
    """A call's top-level tensor arguments, keyed as argument_slots keys them (plain CPU or device tensors
    with strided memory: a nested or sparse one has no byte range to share)."""
    found = [(("args", i), a) for i, a in enumerate(args) if type(a) in _PLAIN_TENSORS]
    found += [(("kwargs", k), v) for k, v in kwargs.items() if type(v) in _PLAIN_TENSORS]
    return [(k, t) for k, t in found if t.layout == torch.strided and not t.is_nested]


def _record_at(records: dict[str, str], key: tuple[Any, ...]) -> str:
    """The record name of the argument at ``key`` (``("args", 0)``, ``("args", 1, "data")``), given its
    arguments document's record names by path (``Session._encode``'s ``places``): its own path, or the
    first place of a tensor given in several."""
    path = ".".join(map(str, key))
    return records.get(path, path)


def _argument_paths(args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[str]:
    """The paths of a call's top-level arguments in its arguments document (a kwarg's name may hold dots)."""
    return frozenset([f"args.{i}" for i in range(len(args))] + [f"kwargs.{k}" for k in kwargs])


def _nested_tensors(value: Any, top: frozenset[str]) -> frozenset[int]:
    """Ids of the tensors in ``value`` below its top level (``top``: the paths of that level)."""
    found: set[int] = set()

    def seen(t: torch.Tensor, path: str) -> None:
        if path not in top:
            found.add(id(t))

    jsonval.encode(value, tensor_name=seen, bounded=True)  # (as the call's document is)
    return frozenset(found)


def _not_own_records(doc: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> frozenset[int]:
    """Ids of a recomputation's tensor arguments whose place was not a record of its own in the
    original call (which ran without grad and saw one tensor there and in another place): a tap on
    them would report gradients under names that call has no records for, or part of one."""
    doc = doc if isinstance(doc, dict) else {}
    uses = collections.Counter(v["$tensor"] for v in jsonval.walk(doc)
                               if isinstance(v, dict) and len(v) == 1 and isinstance(v.get("$tensor"), str))
    places = [(f"args.{i}", a, d) for i, (a, d) in enumerate(zip(args, doc.get("args") or []))]
    places += [(f"kwargs.{k}", kwargs[k], d) for k, d in (doc.get("kwargs") or {}).items() if k in kwargs]
    # (one record in several places: each place is its own tensor here, and none has the record's whole gradient)
    return frozenset(id(t) for path, t, d in places if isinstance(t, torch.Tensor)
                     and (d != {"$tensor": path} or uses.get(path, 0) > 1))


def _forget_in_child() -> None:
    """After a fork, in the child: the recording stays the parent's (Session.disown); steps called
    here (a DataLoader worker's augmentation) are plain calls."""
    global ACTIVE
    session, ACTIVE = ACTIVE, None
    if session is not None:
        session.disown()


os.register_at_fork(after_in_child=_forget_in_child)


# -- torch.compile (see recorder.compiled) -----------------------------------------------------------
def _backward_callback(method: Callable[..., Any], *bound: Any) -> Callable[..., Any]:
    """``method`` with its first arguments bound, for autograd to call back in backward. Called
    while Dynamo traces (compiled autograd), it goes through ``compiled.eagerly``, so that Dynamo
    does not try to compile the recorder's code; otherwise it is a plain call (``eagerly`` costs
    ~10 us a call, and transformers or Lightning load torch._dynamo whether or not anything is
    compiled)."""
    return functools.partial(_called_back, method, *bound)


def _called_back(method: Callable[..., Any], *args: Any) -> Any:
    if compiled.tracing():
        return compiled.eagerly(method, *args)
    return method(*args)
