"""torch.distributed while recording: which rank this process is, and what collectives returned.

A step that calls a collective (``dist.all_reduce(x)`` inside a SyncBatchNorm-like paper step)
cannot be replayed alone by calling it again: the other ranks are not there. So while a run records,
the collectives of ``torch.distributed`` are wrapped: a call made inside a recorded step runs as
usual, then its results (the tensors it wrote: ``tensor`` of ``all_reduce``, ``tensor_list`` of
``all_gather``...) are recorded with the innermost running step under the role ``collective``,
named ``<op>.<k>`` (the k-th collective of that step; ``<op>.<k>.<i>`` for list outputs). A replay
gives each call the recorded results in the same order instead (see ``replayer.replay``).

An asynchronous collective (``async_op=True``) is waited for before it returns while recording, so
that its results can be read: what it would have overlapped runs after it instead (the values are
the same). Functional collectives (``torch.distributed._functional_collectives``), object
collectives (``all_gather_object``: pickled objects) and names imported before the recording
started (``from torch.distributed import all_reduce``) are not seen.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Collective -> the arguments it writes its results into (a tensor, or a list of tensors).
RESULTS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor",), "broadcast": ("tensor",), "reduce": ("tensor",),
    "all_gather": ("tensor_list",), "all_gather_into_tensor": ("output_tensor",),
    "reduce_scatter": ("output",), "reduce_scatter_tensor": ("output",),
    "all_to_all_single": ("output",), "all_to_all": ("output_tensor_list",),
    "gather": ("gather_list",), "scatter": ("tensor",), "barrier": (),
}
# Collective -> the arguments holding what this rank sends (for broadcast and scatter, only the source
# rank's): counted for NaN and Inf before the call, so that a step that made them and sent them
# through its own collective is told apart from one that received them.
SENT: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor",), "reduce": ("tensor",), "broadcast": ("tensor",), "all_gather": ("tensor",),
    "all_gather_into_tensor": ("input_tensor",), "reduce_scatter": ("input_list",),
    "reduce_scatter_tensor": ("input",), "all_to_all_single": ("input",), "all_to_all": ("input_tensor_list",),
    "gather": ("tensor",), "scatter": ("scatter_list",),
}
_FROM_SOURCE = ("broadcast", "scatter")
# Plain arguments kept with the call, to tell it apart in a message.
_DESCRIBED = ("op", "src", "dst", "group_src", "group_dst", "async_op")


def _modules() -> list[Any]:
    """The modules whose attributes user code reaches collectives through."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return [dist, distributed_c10d]


def available() -> bool:
    return torch.distributed.is_available()


def identity() -> dict[str, Any]:
    """This process's rank, world size and backend: from an initialized default process group, else
    from the launcher's environment (torchrun sets RANK and WORLD_SIZE before the script runs, so a
    recording started before ``init_process_group`` knows its rank), else a single process."""
    if available() and torch.distributed.is_initialized():
        return {"rank": torch.distributed.get_rank(), "world_size": torch.distributed.get_world_size(),
                "backend": str(torch.distributed.get_backend()), "source": "torch.distributed"}
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return {"rank": 0, "world_size": 1, "backend": None, "source": None}
    if world < 1 or not 0 <= rank < world:
        return {"rank": 0, "world_size": 1, "backend": None, "source": None}
    return {"rank": rank, "world_size": world, "backend": None, "source": "environment"}


def backend_now() -> str | None:
    """The default process group's backend once it exists (a recording may start before it does)."""
    if available() and torch.distributed.is_initialized():
        return str(torch.distributed.get_backend())
    return None


def results_of(op: str, arguments: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors a collective wrote, with their suffixes ("" for a tensor, ".i" for a list's)."""
    out: list[tuple[str, torch.Tensor]] = []
    for arg in RESULTS[op]:
        value = arguments.get(arg)
        if isinstance(value, torch.Tensor):
            out.append(("", value))
        elif isinstance(value, (list, tuple)):
            out += [(f".{i}", t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return out


def sent_nonfinite(op: str, arguments: dict[str, Any]) -> dict[str, int]:
    """How many NaN and Inf this rank sends into a collective (read before the call: an all_reduce
    writes its result over what it sent)."""
    if op in _FROM_SOURCE:
        src, group_src = arguments.get("src"), arguments.get("group_src")
        dist = torch.distributed
        mine = (src is not None and src == dist.get_rank()) or (
            group_src is not None and group_src == dist.get_rank(arguments.get("group")))
        if not mine:
            return {"nan": 0, "inf": 0}
    nan = inf = 0
    for arg in SENT.get(op, ()):
        value = arguments.get(arg)
        for t in [value] if isinstance(value, torch.Tensor) else value if isinstance(value, (list, tuple)) else []:
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
                bad = int(t.numel() - torch.isfinite(t).sum())  # one pass (and one sync) when all is finite
                if bad:
                    nans = int(torch.isnan(t).sum())
                    nan, inf = nan + nans, inf + bad - nans
    return {"nan": nan, "inf": inf}


def describe(op: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The call's plain arguments as JSON (the reduce op by name)."""
    doc: dict[str, Any] = {"op": op}
    for key in _DESCRIBED:
        if key in arguments and arguments[key] is not None:
            value = arguments[key]
            doc["reduce_op" if key == "op" else key] = value if isinstance(value, (bool, int)) else str(value)
    return doc


@contextmanager
def patched(make: Callable[[str, Callable[..., Any], inspect.Signature], Callable[..., Any]],
            extra: dict[str, Callable[..., Any]] | None = None) -> Iterator[None]:
    """Replace every collective of ``RESULTS`` (and the functions in ``extra``) in torch.distributed
    and its c10d module for the duration; restored on exit, whatever happened."""
    if not available():
        yield
        return
    saved: list[tuple[Any, str, Any]] = []
    try:
        for op in RESULTS:
            original = getattr(_modules()[1], op, None)
            if original is None:
                continue
            wrapper = make(op, original, inspect.signature(original))
            for module in _modules():
                if getattr(module, op, None) is original:
                    saved.append((module, op, original))
                    setattr(module, op, wrapper)
        for name, fn in (extra or {}).items():
            for module in _modules():
                if hasattr(module, name):
                    saved.append((module, name, getattr(module, name)))
                    setattr(module, name, fn)
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


class Recording:
    """The recording side: installed by a Run, removed when it closes."""

    def __init__(self, on_result: Callable[[str, dict[str, Any], list[tuple[str, torch.Tensor]]], None],
                 wanted: Callable[[], bool] = lambda: True) -> None:
        """``on_result(op, described, results)`` is called after every collective made while recording
        (it decides whether a step is running); ``wanted()``, before the call, says whether one is
        (what the rank sends is counted only then: ``described["sent"]``)."""
        self.on_result = on_result
        self.wanted = wanted
        self._context: Any = None

    def install(self) -> None:
        self._context = patched(self._wrap)
        self._context.__enter__()

    def remove(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)

    def _wrap(self, op: str, original: Callable[..., Any], sig: inspect.Signature) -> Callable[..., Any]:
        on_result, wanted = self.on_result, self.wanted

        def collective(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return original(*args, **kwargs)  # it accepts what its signature does not say: leave it alone
            bound.apply_defaults()
            arguments = bound.arguments
            sent = None
            if wanted():
                try:
                    sent = sent_nonfinite(op, arguments)
                except Exception:  # noqa: BLE001 - a count is only a hint: never in the way of the call
                    sent = None
            work = original(*args, **kwargs)
            if arguments.get("async_op") and work is not None:
                work.wait()  # its results must be there to be recorded
            doc = describe(op, arguments)
            if sent is not None:
                doc["sent"] = sent
            on_result(op, doc, results_of(op, arguments))
            return work

        collective.__wrapped__ = original  # type: ignore[attr-defined]
        collective.__name__ = getattr(original, "__name__", op)
        collective.__doc__ = original.__doc__
        return collective
