"""Operation-level bisection: replay one step with every aten operation checked, and name the first
that turned finite inputs into NaN or Inf, with the user's source line. Where the step's result holds
NaN, an operation that made Inf by writing a constant (masked_fill(mask, -inf), torch.full(..., -inf):
a mask, which later operations absorb) is passed over: the first that made NaN is named (the softmax
of a row that is all -inf), saying which operation wrote the Inf it made NaN of, unless an operation
computed an Inf (an overflow, a division by zero) before it.

A forward step runs under a ``TorchDispatchMode`` that checks each operation's outputs; the source
line is the innermost frame of the Python stack that is the user's code (not torch's, not
PaperDebugger's, not the standard library's). A higher-order operator (flex_attention) is looked
inside: its operations are checked as its kernel runs them, the user's ``score_mod`` among them.
A ``TorchFunctionMode`` alongside says which torch-level call (``torch.logdet``, a Tensor method) each
operation belongs to: an operation of a call's implementation that takes no tensor and writes a NaN/Inf
constant (the NaN ``torch.logdet`` gives for a negative determinant, written by ``aten::scalar_tensor``)
is no origin of its own; the call is, where that constant reaches its result from finite inputs.
A backward step's forward runs with autograd's anomaly mode (NaN checks off), which keeps the forward
stack on every graph node; during the gradient computation each operation is attributed to the node
running it and that node's forward line, except in the backward of a custom ``torch.autograd.Function``:
that is the user's code, running on the live stack, whose line is named (the forward line that made the
node is kept as context).
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import re
import sys
import sysconfig
import traceback
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import recorder
from recorder import payload
from recorder import stats as stats_mod
from recorder.errors import ReplayError

from .bisect import ANOMALY, layout_results
from .compare import stats_dict
from .recording import Recording, Step

_SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (torch, recorder)) + (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep)
_TORCH_NN = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "nn") + os.sep
_REPLAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay.py")  # where _Call.run calls the step
_BACKWARD_APPLY = BackwardCFunction.apply.__code__  # what calls a custom Function's backward (or vjp)
_ENGINE_RUN = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)  # runs a pass
_CHECKPOINT = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "utils", "checkpoint.py")
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
    # its tensor arguments, integer ones too (``_inputs``: {"name", "shape", "dtype", "stats", and "values" where
    # small}), and its integer-list arguments ({"name", "dtype": "int[]", "values"})
    inputs: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[dict[str, Any]] = field(default_factory=list)
    # None: it made NaN/Inf from finite inputs. "outside": it made a tensor of data holding NaN that code outside
    # torch's operators computed (torch.from_numpy of numpy's result), which no operation made. "inf": it made
    # NaN of Inf (inf - inf, 0 * inf), an Inf that came into the step or, with inf_from, that an earlier
    # operation made. "forward": in a backward step none did, and this operation of its forward made the NaN
    # (masked there: torch.where(x > 0, x.sqrt(), 0)) that the backward then carried into the gradient.
    made: str | None = None
    of_inf: bool = False  # it made NaN of Inf, not of finite values
    inf_from: OpReport | None = None  # the operation of the step (or its forward) that made that Inf, if one did
    # backward of a custom autograd.Function: file, line, function and code are in its backward, and this
    # is {"file", "line", "function", "code"} of the forward line that made the node (None elsewhere)
    forward: dict[str, Any] | None = None
    # backward: a hook of the user's that the pass ran made it (a tensor's register_hook, a module's backward
    # hook): file, line, function and code are in the hook, and node is the node it ran for
    hook: bool = False
    # made "passed": the step passed on a mask's Inf it took, and this is the first operation whose output held it
    # where, at the earlier call of the step that kept it out of its results ({"step", "iteration", "call"}), the
    # same operation's output was finite (None: no such call was replayed; the first operation whose output held it)
    finite_at: dict[str, Any] | None = None
    # the higher-order operator or the torch.library operator of the user's it ran inside
    # ("higher_order::flex_attention", "mylib::rms_norm")
    within: str | None = None
    # A torch-level call named as the operation ("torch.logdet"): the operation of its implementation that
    # wrote the NaN/Inf as a constant ("aten::scalar_tensor": the value it gives where it is undefined)
    constant: str | None = None
    # made "inf" with no inf_from: the recorded step whose output brought the Inf in ("step 0 (log_mel)"), where
    # bisect found it (``Origin.source``)
    came_from: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc = self._json()
        doc["inf_from"] = self.inf_from._json() if self.inf_from is not None else None
        return doc

    def _json(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "line": self.line, "code": self.code,
                "function": self.function, "overload": self.overload, "phase": self.phase, "node": self.node,
                "index": self.index, "inputs": self.inputs, "outputs": self.outputs, "made": self.made,
                "forward": self.forward, "finite_at": self.finite_at, "within": self.within,
                "constant": self.constant, "hook": self.hook}

    def how(self) -> str | None:
        """How this operation made the step's first NaN/Inf, when not from finite inputs (``made``), or
        from finite inputs by a constant of its implementation (``constant``)."""
        if self.made == "constant":
            return (f"no operation computed it: the NaN/Inf is a constant written in the code, which {self.name} "
                    "wrote (a number argument: float('nan'), float('-inf'); torch.full(..., float('nan')))")
        if self.constant is not None:
            return (f"{self.name} made it from finite inputs: its implementation writes the NaN/Inf as a constant "
                    f"({self.constant}), the value it gives for inputs outside its domain (as torch.logdet does for a "
                    "matrix with a negative determinant)")
        if self.made == "inf" and self.inf_from is None:
            came = f"it came in, from the output of {self.came_from}" if self.came_from else "it came in"
            return (f"no operation inside the step made the Inf ({came}); {self.name} made NaN of it "
                    "(inf - inf, 0 * inf)")
        if self.made == "inf":
            by = "the step's forward" if self.inf_from.phase != self.phase else "an earlier operation of the step"
            return f"{self.name} made NaN of an Inf (inf - inf, 0 * inf) that {by} made: {self.inf_from.where()}"
        if self.made == "passed" and self.finite_at is not None:
            at = self.finite_at
            return (f"no operation made an Inf from finite values: {self.name} passed on the mask's Inf the step took, "
                    f"its output holding Inf where that of the same operation was finite at step {at['step']} "
                    f"(iteration {at['iteration']}, call {at['call']}), which kept the Inf out of its results")
        if self.made == "passed":
            return (f"no operation made an Inf from finite values: {self.name} is the first whose output held the "
                    "mask's Inf the step took")
        if self.made == "outside":
            return ("no operation of torch's made the NaN: it came into them from outside, in data that code outside "
                    "torch's operators (numpy code in the step) computed, made a tensor at this line; torch's "
                    "operations after it only carried it")
        if self.made == "forward":
            of = " of an Inf (inf - inf, 0 * inf)" if self.of_inf else ""
            source = "" if self.inf_from is None else \
                f"; the forward's {self.inf_from.name} made that Inf: {self.inf_from.where()}"
            return (f"no operation of the backward made NaN from finite values: the forward's {self.name} made "
                    f"it{of}, where the forward's output did not keep it (masked: torch.where, masked_fill, a product "
                    f"with 0), and its backward carried it into the gradient{source}")
        return None

    def where(self) -> str:
        at = f"{self.file}:{self.line}" if self.file else "no user source line found"
        node = f" in {self.node}" if self.node else ""
        if self.node and self.forward is not None:
            node = f" in {self.node} (the custom Function's backward)"
        elif self.node and self.hook:
            node = f" in a hook run for {self.node}"
        within = f" inside {self.within}" if self.within else ""
        code = f": {self.code}" if self.code else ""
        return f"{self.name}{within}{node} at {at}{code}"


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


def _function_backward_frames(node: Any) -> list[tuple[str, int, str, str]] | None:
    """The live frames of a custom ``autograd.Function``'s backward (or vjp) that ``node`` is running,
    outermost first: the user's code, below the innermost call torch makes of it; None for a node of
    torch's own (its backward formula is C++: only its forward line names user code)."""
    if getattr(node, "_forward_cls", None) is None:
        return None
    frame, chain = sys._getframe(1), []
    while frame is not None and frame.f_code is not _BACKWARD_APPLY:
        chain.append(frame)
        frame = frame.f_back
    if frame is None:
        return None
    return [(f.f_code.co_filename, f.f_lineno or 0, f.f_code.co_name,
             linecache.getline(f.f_code.co_filename, f.f_lineno or 0).strip()) for f in reversed(chain)]


def _hook_frames() -> list[tuple[str, int, str, str]] | None:
    """The live frames of a hook of the user's that the backward pass running now called (a tensor's
    ``register_hook``, a module's backward hook), outermost first, below the engine's run of the pass: the
    operation running now is the hook's, not the backward formula's of the node it runs for, whose forward line
    names other code. None where no code of the user's is there (a formula of torch's), or where it is a
    checkpoint's recomputation of the forward."""
    frame, chain = sys._getframe(1), []
    while frame is not None and frame.f_code is not _ENGINE_RUN:
        chain.append(frame)
        frame = frame.f_back
    if frame is None or _ENGINE_RUN is None:
        return None
    files = [os.path.abspath(f.f_code.co_filename) for f in chain]
    if _CHECKPOINT in files or not any(not f.startswith("<") and not f.startswith(_SKIP_DIRS) for f in files):
        return None
    return [(f.f_code.co_filename, f.f_lineno or 0, f.f_code.co_name,
             linecache.getline(f.f_code.co_filename, f.f_lineno or 0).strip()) for f in reversed(chain)]


def _live_frames() -> list[tuple[str, int, str, str]]:
    """The Python stack now, outermost first, as ``_user_frame`` takes it (the source line read only where asked)."""
    frame, chain = sys._getframe(1), []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    return [(f.f_code.co_filename, f.f_lineno or 0, f.f_code.co_name, "") for f in reversed(chain)]


def _where_now() -> tuple[str, int] | None:
    """The user's line the operation running now belongs to, as ``_Finder._report`` names it: in a backward, the
    forward line that made the autograd node running it (a custom Function's backward: its own line)."""
    node = torch._C._current_autograd_node()
    frames = None
    if node is not None:
        own = _function_backward_frames(node) or _hook_frames()
        stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
        frames = own or ([(m["file"], int(m["line"]), m["func"].strip(), m["code"].strip())
                          for m in _FRAME.finditer("".join(stack))] if stack else None)
    at = _user_frame(frames if frames else _live_frames())
    return (at[0], at[1]) if at is not None else None


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


@contextlib.contextmanager
def _warnings_at_user_line() -> Iterator[None]:
    """While the step replays under the checking modes, a warning that torch raises from an operation (a C++
    warning: std_mean's "degrees of freedom is <= 0") names the user's line, as it did in the recorded run, not
    the mode's own (it is raised at the innermost Python frame, which is the mode's). Only the showing of such a
    warning is changed (``warnings.showwarning``, put back after, unless replaced meanwhile): not the filters,
    which other threads (the TUI's) share."""
    previous = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if os.path.abspath(filename).startswith(_PACKAGE):
            try:
                at = _where_now()
            except Exception:  # noqa: BLE001 - the warning is shown in any case, where it was raised
                at = None
            if at is not None:
                filename, lineno, line = at[0], at[1], None
        previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = previous


def _tensor_info(t: torch.Tensor) -> dict[str, Any]:
    info: dict[str, Any] = {"shape": list(t.shape), "dtype": payload.dtype_name(t.dtype)}
    t = payload.materialized(t)  # (a ZeroTensor has no memory to read: its statistics are those of zeros)
    try:
        info["stats"] = stats_dict(stats_mod.host_stats(t.detach().cpu()))
    except (RuntimeError, TypeError, NotImplementedError):
        info["stats"] = None
    return info


SMALL_VALUES = 16  # an integer or boolean input of at most this many elements is shown by its values


def _inputs(func: Any, args: Any, kwargs: Any) -> list[dict[str, Any]]:
    """What a report shows of an operation's inputs, in the order it takes them: its tensors (``_tensor_info``),
    integer and boolean ones too, with their values where they are small (a CTC loss's input and target
    lengths, the indices of a gather: what decides whether it is finite), and its integer-list arguments, each
    named by the operation's schema where it has one."""
    schema = getattr(func, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    lists = {a.name for a in schema.arguments if "List[int]" in str(a.type)} if schema is not None else set()
    named = [(names[i] if i < len(names) else None, a) for i, a in enumerate(args)] + list(kwargs.items())
    shown: list[dict[str, Any]] = []
    for name, value in named:
        if name in lists and isinstance(value, (list, tuple)) and value and \
                all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            shown.append({"name": name, "dtype": "int[]", "values": [int(v) for v in value]})
            continue
        tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.layout == torch.strided
                   and t.device.type != "meta"]
        for i, t in enumerate(tensors):
            info = _tensor_info(t)
            if name is not None:
                info["name"] = name if isinstance(value, torch.Tensor) else f"{name}.{i}"
            if not (t.is_floating_point() or t.is_complex()) and t.numel() <= SMALL_VALUES:
                info["values"] = t.detach().cpu().reshape(-1).tolist()
            shown.append(info)
    return shown


def _checked(value: Any) -> list[torch.Tensor]:
    """The tensors of ``value`` whose values are looked at: floating-point and complex ones with memory. A
    ZeroTensor (the zeros a double backward passes on, ``aten::_efficientzerotensor``: a MAML inner loop's or a
    gradient penalty's second-order pass through ``abs``) has none, holds zeros alone, and torch's own
    reductions of it under a dispatch mode end the process (a segmentation fault): it is left out."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.layout == torch.strided
            and t.device.type != "meta" and (t.is_floating_point() or t.is_complex()) and not t._is_zerotensor()]


def _results(func: Any, args: Any, kwargs: Any, out: Any) -> list[torch.Tensor]:
    """The tensors an operation made or changed: what it returned and the arguments its schema says it
    writes (an in-place foreach operation, ``_foreach_addcdiv_``, returns nothing and writes its list)."""
    outs = _checked(out)
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return outs
    written = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    return outs + [t for t in _checked(written) if not any(t is o for o in outs)]


def _nonfinite(t: torch.Tensor) -> bool:
    return t.numel() > 0 and not bool(torch.isfinite(t).all())


def _takes_tensors(args: Any, kwargs: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in tree_leaves((args, kwargs)))


def _op_name(func: Any) -> str:
    """"aten::exp" of an aten operation, "higher_order::flex_attention" of a higher-order operator,
    "torch.logdet" of a torch-level call."""
    if isinstance(func, HigherOrderOperator):
        return f"{func.namespace}::{func.name()}"
    if isinstance(func, torch._ops.OpOverload):
        overload = str(func)
        return "aten::" + overload.split(".")[1] if overload.startswith("aten.") else overload
    try:
        name = resolve_name(func)
    except Exception:  # noqa: BLE001 - torch's table of overridable functions cannot say: its own name
        name = None
    return name or str(getattr(func, "__qualname__", None) or func)


def _kernel_below(func: HigherOrderOperator, args: Any, kwargs: Any) -> Any:
    """The Python kernel a higher-order operator's dispatch runs next for these tensors (below
    the Python key this mode is at: flex_attention's dense implementation on a CPU or CUDA tensor),
    or None where it has none (or torch cannot say)."""
    try:
        keys = torch._ops._compute_keyset(args, kwargs, func.non_fallthrough_keys)
        below = keys & torch._C._dispatch_keyset_full_after(DispatchKey.Python)
        kernel = func.py_kernels.get(torch._ops.resolve_key(func, below.highestPriorityTypeId()))
    except (AttributeError, NotImplementedError, RuntimeError, TypeError):
        return None
    return kernel if callable(kernel) and not isinstance(kernel, DispatchKey) else None


_OPERATOR_KEYS = ("CompositeExplicitAutograd", "CPU", "CUDA", "XPU", "MPS", "PrivateUse1")


def _python_operator(func: Any, args: Any, kwargs: Any) -> Any:
    """For an operator of the user's defined in Python with ``torch.library`` (``custom_op``, a
    ``Library("ns", "DEF")`` with a Python ``impl``), which dispatch runs as one operation: a call of its
    kernel for these tensors, below the Python key this mode is at, so that the operations its Python code
    runs are checked with the mode on (the one that made NaN named at its line in the operator's code, not
    the operator as a whole at the line that called it). None for torch's own operators and for operators
    without a Python kernel registered (a C++ extension's: judged as one operation)."""
    registered = getattr(torch.library, "_impls", None)
    if not isinstance(func, torch._ops.OpOverload) or not isinstance(registered, set) or \
            func.namespace in ("aten", "prims"):
        return None
    base, overload = func._schema.name.split("::")[-1], func._overloadname
    names = (base, f"{base}.{overload}") if overload == "default" else (f"{base}.{overload}",)
    if not any(f"{func.namespace}/{n}/{k}" in registered for n in names for k in _OPERATOR_KEYS):
        return None
    try:
        keys = torch._C._dispatch_keyset_full_after(DispatchKey.Python)
        given = torch._C.DispatchKeySet(DispatchKey.CPU)  # (a call without tensors: a CPU factory)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors:
            given = torch._C._dispatch_keys(tensors[0])
            for t in tensors[1:]:
                given = given | torch._C._dispatch_keys(t)
        below = given & keys
    except (AttributeError, RuntimeError, TypeError):
        return None
    return lambda: func.redispatch(below, *args, **kwargs)


def _made(func: Any, outs: list[torch.Tensor], given: list[Any], bad: Any) -> bool:
    """Whether an operation made values that are ``bad`` (``torch.isnan``, or ``_not_finite``) in its
    outputs: none of its inputs held any (``given``: for each input that did, where its values were
    not, as it was before the operation; None for an operation that is not pointwise), or it is
    pointwise and an output is bad where every input (broadcast) was not (``exp`` of scores that
    overflow, next to the -inf of a mask: the mask's -inf gives 0, the overflow Inf)."""
    if not any(bool(bad(out).any()) for out in outs):
        return False
    if not given:
        return True
    if torch.Tag.pointwise not in getattr(func, "tags", ()):
        return False  # its bad inputs can reach any of its outputs
    for out in outs:
        new = bad(out)
        try:
            for ok in given:
                new &= ok.broadcast_to(out.shape)
        except RuntimeError:  # an input that does not broadcast to this output (another of its outputs)
            continue
        if bool(new.any()):
            return True
    return False


def _not_finite(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t)


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without storage (a subclass's)
        return None


@dataclass
class _Given:
    """A non-finite input of an operation, as it was before the operation (which may write into it)."""

    tensor: torch.Tensor
    nan: bool  # it held NaN
    finite: torch.Tensor | None  # where it was finite (only for a pointwise operation, the only one that asks)
    not_nan: torch.Tensor | None  # where it was not NaN (the same)


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


@dataclass
class _Call:
    """A torch-level call of the code the step runs (``torch.logdet(w)``), while it runs."""

    func: Any
    args: Any
    kwargs: Any
    tensors: bool  # it took a tensor: its implementation's operations that take none are constants of it
    constant: tuple[str, int] | None = None  # the first such operation that wrote a NaN/Inf, and its index
    start: int = 0  # how many operations the step ran before it


class _Calls(TorchFunctionMode):
    """Tells the finder which torch-level call (``torch.logdet``, ``F.softmax``, a Tensor method) the
    operations it checks belong to: the outermost only, as torch's own calls inside one run with this
    mode off."""

    def __init__(self, finder: _Finder) -> None:
        super().__init__()
        self.finder = finder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        finder = self.finder
        if finder.call is not None or not finder.looking:
            return func(*args, **kwargs)
        call = _Call(func, args, kwargs, _takes_tensors(args, kwargs), start=finder.count)
        finder.call = call
        try:
            out = func(*args, **kwargs)
        finally:
            finder.call = None
        if call.constant is not None and finder.looking:
            finder.settle(call, out)
        return out


class _Finder(TorchDispatchMode):
    """``nan``: the step's result holds NaN, so the first operation that made NaN is looked for too,
    past one that made only Inf, and where each Inf came from (a tensor's storage to the operation that
    made its Inf from finite values), to say what that operation made its NaN of. ``whole``: go on to
    the end (a backward step's forward, whose Inf the backward may take from saved tensors).
    ``earlier``: the forward's finder of a backward step, which knows where the forward's Inf came from."""

    supports_higher_order_operators = True  # (flex_attention: looked inside, else judged as one operation)

    def __init__(self, phase: str, *, nan: bool = False, whole: bool = False, earlier: _Finder | None = None,
                 passed: bool = False, baseline: list[tuple[str, bool]] | None = None) -> None:
        super().__init__()
        self.phase, self.nan, self.whole, self.earlier = phase, nan, whole, earlier
        # ``passed``: the step passed on a mask's Inf; look for the first operation whose output held non-finite
        # values where that of the same operation (by position and overload) in ``baseline`` (``_Trace``: an
        # earlier call that kept the Inf out of its results) did not, or any where there is no baseline to judge by
        self.passed, self.baseline = passed, baseline
        self.carried: OpReport | None = None
        self.found: OpReport | None = None  # the first that made NaN/Inf from finite inputs
        self.computed: OpReport | None = None  # the first that did so, not by writing an Inf of the code (a mask)
        self.first_nan: OpReport | None = None  # the first that made NaN: of finite values, or of Inf (made "inf")
        self.infs: dict[int, tuple[weakref.ref[torch.Tensor], OpReport]] = {}  # nan: storage -> who made its Inf
        self.count = 0
        self.literals: list[torch.Tensor] = []  # NaN/Inf written in the code (y[m] = float("nan")), lifted to tensors
        # The first tensor made of data holding NaN that no operation of torch's made (torch.from_numpy of what
        # numpy code computed), where the step's NaN may have come from
        self.outside: OpReport | None = None
        self.within: str | None = None  # the higher-order operator whose operations run now
        self.call: _Call | None = None  # the torch-level call running now (a forward's, told by _Calls)

    @property
    def looking(self) -> bool:
        return self.found is None or (self.nan and ((self.first_nan is None and self.computed is None) or self.whole)) \
            or (self.passed and self.carried is None)

    @property
    def named(self) -> OpReport | None:
        """The operation to name where the step's result holds NaN: the first that made NaN, or that
        computed an Inf before it; None when neither did."""
        made = [op for op in (self.computed, self.first_nan) if op is not None]
        return min(made, key=lambda op: op.index) if made else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        looking = self.looking
        inside = _python_operator(func, args, kwargs) if looking else None
        if inside is not None:  # (its operations are checked as its Python code runs them)
            outer = self.within
            self.within = outer or f"{func.namespace}::{func._schema.name.split('::')[-1]}"
            try:
                with self:
                    return inside()
            finally:
                self.within = outer
        # An operation that writes into its input (y[1, 3:] = nan: fill_ of a view) is judged by its
        # inputs as they were before it wrote.
        before, infos = None, None
        if looking and func._schema.is_mutable:
            before = self._given(func, args, kwargs)
            infos = _inputs(func, args, kwargs)  # (reported as they were)
        out = func(*args, **kwargs)
        if looking and func in _LIFTS:  # a constant of the code: what it is written into is the origin
            for t in _checked(out):
                if not _nonfinite(t):
                    continue
                if t.numel() > 1 and bool(t.isnan().any()):  # data made outside torch's operators (numpy): no
                    if self.outside is None:  # constant, and the operations that carry its NaN did not make it
                        self.outside = self._report(func, args, kwargs, [t], [])
                        self.outside.made = "outside"
                else:
                    self.literals.append(t)
        elif looking:
            outs = _results(func, args, kwargs, out)
            if any(_nonfinite(t) for t in outs):
                call = self.call
                if call is not None and call.tensors and not _takes_tensors(args, kwargs):
                    self._constant(call, func, args, kwargs, outs)  # (the call it belongs to is judged after it)
                else:
                    self._judge(func, args, kwargs, outs,
                                before if before is not None else self._given(func, args, kwargs), infos)
                    if self.passed and self.carried is None and self._new_here(func):
                        self.carried = self._report(func, args, kwargs, outs, infos)
                        self.carried.made = "passed"
            self.count += 1
        return out

    def _new_here(self, func: Any) -> bool:
        """Whether the operation now run (non-finite output) was finite in ``baseline``, or the calls parted: from
        the first operation that differs in overload, no position compares."""
        if self.baseline is None:
            return True
        at = self.baseline[self.count] if self.count < len(self.baseline) else None
        if at is None or at[0] != str(func):
            self.baseline = None  # (the calls took other paths: the rest of the step is judged without it)
            return True
        return not at[1]

    def _higher_order(self, func: HigherOrderOperator, args: Any, kwargs: Any) -> Any:
        """A higher-order operator (flex_attention, cond) is looked inside: its kernel for these
        tensors runs with this mode on, so that its operations are checked (the user's score_mod
        among them, with its line); one with no Python kernel here is checked as one operation."""
        kernel = _kernel_below(func, args, kwargs)
        if kernel is not None:
            outer = self.within
            self.within = outer or _op_name(func)
            try:
                with self:
                    return kernel(*args, **kwargs)
            finally:
                self.within = outer
        looking = self.looking
        out = func(*args, **kwargs)
        if looking:
            outs = _results(func, args, kwargs, out)
            if any(_nonfinite(t) for t in outs):
                self._judge(func, args, kwargs, outs, self._given(func, args, kwargs), None)
            self.count += 1
        return out

    def _constant(self, call: _Call, func: Any, args: Any, kwargs: Any, outs: list[torch.Tensor]) -> None:
        """An operation that takes no tensor and writes a NaN/Inf, inside a torch-level call that took
        tensors: a constant of that call's implementation (``torch.logdet``'s NaN for a negative
        determinant, which it writes at every call and keeps only where the determinant is negative). It is
        no origin of its own: the call is judged when it returns (``settle``). Where its Inf came from is
        kept, for an operation that makes NaN of it."""
        if call.constant is None:
            call.constant = (_op_name(func), self.count)
        if self.nan:
            source = self._report(func, args, kwargs, outs, [])
            for t in outs:
                key = _storage(t) if _nonfinite(t) else None
                if key is not None:
                    self.infs[key] = (weakref.ref(t, self._forget(key)), source)

    def settle(self, call: _Call, out: Any) -> None:
        """A torch-level call whose implementation wrote a NaN/Inf constant, judged as one operation by
        its inputs and its result, where no operation inside it was named: the call made NaN/Inf from
        finite inputs where that constant reached its result (named as the call: "torch.logdet")."""
        outs = _checked(out)
        if not any(_nonfinite(t) for t in outs) or any(
                op is not None and op.index >= call.start for op in (self.found, self.computed, self.first_nan)):
            return
        outputs = {id(t) for t in outs}  # (a call that wrote into its input: judged by the others)
        given = [g for g in self._given(call.func, call.args, call.kwargs) if id(g.tensor) not in outputs]
        name, index = call.constant or ("", self.count)
        count, self.count = self.count, index  # (placed where its constant was written, among the operations)
        try:
            self._judge(call.func, call.args, call.kwargs, outs, given, None, constant=name)
        finally:
            self.count = count

    def _judge(self, func: Any, args: Any, kwargs: Any, outs: list[torch.Tensor], given: list[_Given],
               infos: list[dict[str, Any]] | None, *, constant: str | None = None) -> None:
        report: OpReport | None = None

        def reported() -> OpReport:
            nonlocal report
            if report is None:
                report = self._report(func, args, kwargs, outs, infos)
                if self._writes_constant(args, kwargs):
                    report.made = "constant"
                elif constant:
                    report.constant = constant
            return report

        made = _made(func, outs, [g.finite for g in given], _not_finite)
        if made and self.found is None:
            self.found = reported()
        if made and self.computed is None and not self._writes_inf(args, kwargs):
            self.computed = reported()
        if self.first_nan is None and _made(func, outs, [g.not_nan for g in given if g.nan], torch.isnan):
            self.first_nan = reported()
            if not _made(func, outs, [g.finite for g in given], torch.isnan):  # no NaN where all was finite
                self.first_nan.of_inf = True
                self.first_nan.made = "inf"
                self.first_nan.inf_from = self._inf_of(given)
        elif self.nan:  # where the Inf of its outputs came from: this operation, or where its inputs' came from
            source = reported() if made else self._inf_of(given)
            if source is not None:
                for t in outs:
                    key = _storage(t) if _nonfinite(t) else None
                    if key is not None:
                        self.infs[key] = (weakref.ref(t, self._forget(key)), source)

    def _writes_inf(self, args: Any, kwargs: Any) -> bool:
        """Whether an operation writes an Inf written in the code (a scalar -inf argument, a literal
        lifted to a tensor), as one building a mask does, rather than computing it."""
        return any((isinstance(x, float) and math.isinf(x)) or
                   (isinstance(x, torch.Tensor) and any(x is c for c in self.literals) and _nonfinite(x))
                   for x in tree_leaves((args, kwargs)))

    def _writes_constant(self, args: Any, kwargs: Any) -> bool:
        """Whether the NaN/Inf an operation (or a torch-level call) made is a constant written in the code:
        it takes no tensor (``torch.full(..., nan)``), or a number argument that is NaN or Inf
        (``masked_fill(m, nan)``), or such a number lifted to a tensor (``y[m] = float("nan")``)."""
        leaves = tree_leaves((args, kwargs))
        return not any(isinstance(x, torch.Tensor) for x in leaves) or any(
            (isinstance(x, float) and not math.isfinite(x)) or
            (isinstance(x, torch.Tensor) and any(x is c for c in self.literals) and _nonfinite(x)) for x in leaves)

    def _forget(self, key: int) -> Any:
        def forget(ref: weakref.ref[torch.Tensor]) -> None:  # (its memory may hold another tensor next)
            if self.infs.get(key, (None,))[0] is ref:
                del self.infs[key]
        return forget

    def _inf_of(self, given: list[_Given]) -> OpReport | None:
        """The operation that made the Inf of the first of these inputs whose Inf an operation made."""
        for g in given:
            key = _storage(g.tensor)
            for finder in (self, self.earlier):
                entry = finder.infs.get(key) if finder is not None and key is not None else None
                if entry is not None and entry[0]() is not None:
                    return entry[1]
        return None

    def _given(self, func: Any, args: Any, kwargs: Any) -> list[_Given]:
        """An operation's non-finite inputs, but for the constants written in the code."""
        masks = torch.Tag.pointwise in getattr(func, "tags", ())
        return [_Given(t, bool(t.isnan().any()), torch.isfinite(t) if masks else None,
                       ~torch.isnan(t) if masks else None)
                for t in _checked((args, kwargs)) if _nonfinite(t) and not any(t is c for c in self.literals)]

    def _report(self, func: Any, args: Any, kwargs: Any, outs: list[torch.Tensor],
                inputs: list[dict[str, Any]] | None = None) -> OpReport:
        name = _op_name(func)
        overload = str(func) if isinstance(func, torch._ops.OpOverload) else name
        node_name, frames, forward, user, hook = None, None, None, None, False
        if self.phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                node_name = node.name()
                stack = node.metadata.get("traceback_") if hasattr(node, "metadata") else None
                if stack:
                    frames = [(m["file"], int(m["line"]), m["func"].strip(), m["code"].strip())
                              for m in _FRAME.finditer("".join(stack))]
                own = _function_backward_frames(node)
                if own:  # the user's backward made it: its line; the forward line that made the node as context
                    at = _user_frame(frames) if frames else None
                    forward = dict(zip(("file", "line", "function", "code"), at or (None,) * 4, strict=True))
                    user = _user_frame(own) or (os.path.abspath(own[0][0]), *own[0][1:])
                else:  # a hook of the user's made it: its line (the node's forward line names other code)
                    hooked = _hook_frames()
                    user = _user_frame(hooked) if hooked else None
                    hook = user is not None
        if user is None:
            if frames is None:
                frames = [(f.filename, f.lineno or 0, f.name, (f.line or "").strip())
                          for f in traceback.extract_stack()]
            user = _user_frame(frames)
        file, line, function, code = user if user else (None, None, None, None)
        if inputs is None:
            inputs = _inputs(func, args, kwargs)
        return OpReport(name, overload, self.phase, file, line, code, function, node_name, self.count, inputs,
                        [_tensor_info(t) for t in outs], forward=forward, within=self.within, hook=hook)


class _Trace(TorchDispatchMode):
    """Per operation a step runs (but the lifts of constants, as ``_Finder`` counts them): its overload and whether
    its output held non-finite values."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inside = _python_operator(func, args, kwargs)
        if inside is not None:  # (counted as _Finder counts them: the operations its Python code runs)
            with self:
                return inside()
        out = func(*args, **kwargs)
        if func not in _LIFTS:
            self.ops.append((str(func), any(_nonfinite(t) for t in _results(func, args, kwargs, out))))
        return out


def _traced(rec: Recording, step: Step, *, threads: int | None, use_bundled_source: bool,
            script: str | os.PathLike[str] | None) -> list[tuple[str, bool]] | None:
    """``_Trace`` of a replay of ``step`` (its own phase), or None where it cannot be replayed."""
    from .replay import Replayer

    traces: list[_Trace] = []

    @contextlib.contextmanager
    def around(stage: str) -> Iterator[None]:
        if stage != step.phase:
            yield
            return
        with _Trace() as trace:
            traces.append(trace)
            yield

    try:
        with _warnings_at_user_line():
            Replayer(rec, script=script, use_bundled_source=use_bundled_source).replay(
                step, threads=threads, nested=False, around=around)
    except ReplayError:
        return None
    return traces[0].ops if traces else None


def bisect_ops(rec: Recording, step: Step, *, threads: int | None = None, use_bundled_source: bool = False,
               notes: list[str] | None = None, script: str | os.PathLike[str] | None = None,
               replayed: list[Any] | None = None, passed: bool = False, kept: Step | None = None
               ) -> OpReport | None:
    """Replay ``step`` operation by operation; the first that made NaN/Inf from finite inputs, or
    None when none did (the values then came from outside the step's operations); where the step's
    result holds NaN, the first that made NaN (of an Inf: ``made``, ``inf_from``) unless one computed
    an Inf before it, passing over those that wrote an Inf of the code (a mask's -inf). ``notes``
    receives the replay's warnings that its code is not the recorded code (edited since); ``replayed``,
    the replay's ``ReplayResult``: where its results are not the recorded ones, the operation found is
    the replay's, not necessarily one the recorded call ran.
    ``script``: where the training script is now, if it moved (as ``replayer.replay``'s).
    ``passed``: the step passed on a mask's Inf it took, its results holding Inf and no NaN (``first_nonfinite``'s
    harm origin); where no operation made an Inf from finite values, the first whose output held it where, at
    ``kept`` (an earlier call of the step that kept it out of its results, replayed too), the same one's was finite
    is named (``made`` "passed")."""
    from .replay import Replayer

    finders: dict[str, _Finder] = {}
    results = layout_results(step.phase)
    # a backward that anomaly mode stopped where a node returned NaN, before the step's results held it
    stopped = step.phase == "backward" and step.status == "exception" and \
        ANOMALY.search(str((step.extra.get("exception") or {}).get("message", ""))) is not None
    nan = stopped or any(r.stats["nan"] for r in step.records if r.role in results)
    passed = passed and not nan
    baseline = _traced(rec, kept, threads=threads, use_bundled_source=use_bundled_source, script=script) \
        if passed and kept is not None else None

    @contextlib.contextmanager
    def around(stage: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_warnings_at_user_line())
            # (what torch.compile compiles runs eagerly, its operations checked: eager flex_attention compiles
            # its operator with fullgraph=True, which refuses to run in a dispatch mode otherwise)
            stance = getattr(torch.compiler, "set_stance", None)
            if stance is not None:
                stack.enter_context(stance("force_eager"))
            if step.phase == "backward" and stage == "forward":
                # (set_detect_anomaly, not detect_anomaly: the same mode, restored after, without the
                # warning detect_anomaly gives, which only warnings.catch_warnings() would hide, and that
                # swaps the whole process's filters, from a TUI worker's thread too)
                stack.enter_context(torch.autograd.set_detect_anomaly(True, check_nan=False))
            earlier = finders.get("forward") if stage != "forward" else None
            own = stage == step.phase
            finders[stage] = stack.enter_context(_Finder(stage, nan=nan, whole=not own, earlier=earlier,
                                                         passed=passed and own, baseline=baseline if own else None))
            if stage == "forward":  # (a backward's operations belong to autograd's nodes, named instead)
                stack.enter_context(_Calls(finders[stage]))
            yield

    result = Replayer(rec, script=script, use_bundled_source=use_bundled_source).replay(
        step, threads=threads, nested=False, around=around, stopped=stopped)
    if notes is not None:
        notes += [w for w in result.warnings if "changed since" in w]
    if replayed is not None:
        replayed.append(result)
    finder = finders.get(step.phase)
    if finder is None:
        return None
    forward = finders.get("forward") if step.phase == "backward" else None
    if nan and finder.named is not None:
        return _first(finder.named, finder.outside)
    if nan and forward is not None and forward.named is not None:
        forward.named.made = "forward"  # a NaN the forward made and hid, which the backward carried
        return forward.named
    if passed and finder.found is None and finder.carried is not None:
        if kept is not None and baseline is not None and finder.baseline is not None:
            finder.carried.finite_at = {"step": kept.index, "iteration": kept.iteration, "call": kept.call}
        return _first(finder.carried, finder.outside)
    if finder.found is None and forward is not None and forward.found is not None:
        forward.found.made = "forward"
        return forward.found
    return _first(finder.found or finder.first_nan, finder.outside)


def _first(op: OpReport | None, outside: OpReport | None) -> OpReport | None:
    """The operation found, unless NaN came into torch's operators from outside them (numpy code) before it."""
    return outside if outside is not None and (op is None or outside.index <= op.index) else op
