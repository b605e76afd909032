"""What the framework callbacks share: ``recorder.lightning`` and ``recorder.huggingface`` are thin
adapters that turn their framework's training events into calls on ``FrameworkCallback``.

- **Opening.** The recording opens when training starts (``_begin``, given the model the framework
  trains) and is paused at once: steps are recorded only inside a training step of the framework
  (``_step_start`` .. ``_step_end``), so sanity checks, evaluation, checkpointing and logging,
  which the frameworks run between training steps, are not recorded as training steps. Nor are
  the calls of other callbacks' events (``_events``): a callback that generates in its batch-end
  event, before or after this one in the list, is not recorded, whatever the order.
- **Paths.** Inside a training step, module paths are relative to that model, whatever the
  framework or the user's code calls first (a DistributedDataParallel wrapper, ``self.net(x)``).
- **Modules.** ``modules=None`` records what ``auto_modules`` picks: the model's own paper steps
  when it has any, else the elements of its outermost ``nn.ModuleList``/``nn.Sequential`` (its
  layers), else its direct children.
- **Iterations** follow the framework's optimizer steps: the iteration of a training step is the
  framework's global step when it starts, so the micro-batches of gradient accumulation share an
  iteration (their calls are numbered #0, #1, ...). The optimizer's own hooks count nothing.
- **Anomalies.** The first step whose results hold NaN or Inf is reported once, as a
  ``RecorderWarning`` that says what went non-finite, where the recording is and the ``pdbg``
  command that opens it at that step.
- **Closing.** ``_end`` closes the run ``complete``; ``_crash`` (an exception the framework reports)
  ``crashed`` with that exception. A run that no event closed (Hugging Face has no exception event)
  is closed ``crashed`` by the next ``_begin`` of the same callback, by ``close()``, or at exit;
  meanwhile it records nothing (``_step_start``'s ``loop``), and it is named by its own path.

No framework is imported here.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shlex
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch

from . import capture, compiled, jsonval, skeleton
from .capture import warn
from .errors import RecordingError, brief

if TYPE_CHECKING:
    from .run import Run

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)
_OPEN: dict[int, FrameworkCallback] = {}  # callbacks whose recording is open, closed at exit if still so


def _close_open_at_exit() -> None:
    from .run import ending_exception, wait_for_program_threads

    if _OPEN:  # (a trainer fitting on a thread the main thread did not join records to the end of its fit)
        wait_for_program_threads()
    for callback in list(_OPEN.values()):
        # The uncaught exception that ends the process, if one does (in a Jupyter kernel: a training cell's)
        callback.close(None if callback.run is None else ending_exception(callback.run))


@functools.cache
def _hook_exit() -> None:
    """Close the recordings left open when the process ends: at the end of the main thread, not in
    ``atexit``, by when the thread pools that zarr writes through are shut down ("cannot schedule new
    futures after shutdown"). threading's exit hooks run before those, in the reverse order of
    registration, and concurrent.futures registers its own when it is imported (zarr imports it)."""
    try:
        threading._register_atexit(_close_open_at_exit)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # not in this Python, or the process is ending already
        atexit.register(_close_open_at_exit)


def auto_modules(model: torch.nn.Module) -> list[str] | None:
    """The ``modules`` globs a callback records with ``modules=None``, relative to ``model``.

    None (only the paper steps) when the model has decorated or annotated modules; else one
    ``PATH.*`` per outermost ``nn.ModuleList``/``nn.Sequential`` of two or more modules (a
    transformer's layers: ``transformer.h.*``, ``model.layers.*``); else ``*``, its direct
    children (``**``, the model itself, when it has none).
    """
    from .autohooks import _marked

    if any(_marked(m) for m in model.modules()):
        return None
    if isinstance(model, _CONTAINERS) and len(model) >= 2:
        return ["*"]
    lists = _outermost_lists(model, "")
    if lists:  # as the recorder names paths: without torch.compile's _orig_mod (a compiled submodule)
        return list(dict.fromkeys(f"{compiled.path_without_wrappers(path)}.*" for path in lists))
    return ["*"] if any(True for _ in model.children()) else ["**"]


def _outermost_lists(module: torch.nn.Module, prefix: str) -> list[str]:
    found = []
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _CONTAINERS) and len(child) >= 2:
            found.append(path)
        else:
            found += _outermost_lists(child, path)
    return found


def pdbg_program() -> str:
    """How to run ``pdbg`` from the shell the user is in: ``pdbg`` where it is on the PATH, else
    the one installed beside this Python (``.venv/bin/pdbg``, the virtual environment not
    activated: ``make demo``, a script run with ``.venv/bin/python``)."""
    import shutil
    from pathlib import Path

    if shutil.which("pdbg"):
        return "pdbg"
    beside = Path(sys.executable).parent / "pdbg"
    if not beside.exists():
        return "pdbg"
    relative = os.path.relpath(beside)
    return shlex.quote(relative if not relative.startswith("..") else str(beside))


def open_command(path: Any, index: int | None, rank: int = 0) -> str | None:
    """``pdbg PATH --at INDEX`` (with ``--rank K`` for a rank other than 0), as ``pdbg record`` prints
    it; None for a recording ``pdbg`` cannot be pointed at (a zarr store object)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    words = [pdbg_program(), shlex.quote(os.fspath(path))]
    if index is not None:
        words += ["--at", str(index)]
    if rank:
        words += ["--rank", str(rank)]
    return " ".join(words)


class FrameworkCallback:
    """Records the training a framework runs: the state and logic of both framework callbacks.

    Args:
        path: a new directory for the recording (or a URL or zarr store, as for ``recorder.record``);
            an existing non-empty one is refused when training starts. A second training with the
            same callback needs a new one: set ``callback.path`` before it.
        mode: "flight" (the default: statistics of every recorded step, the tensors of the last
            ``keep`` iterations held in memory and written on a NaN/Inf, an exception, SIGTERM or
            SIGINT, or at the end), "stats" or "full", as for ``recorder.record``.
        keep: flight mode: iterations whose tensors are held (default 2).
        modules: module-path globs to record, relative to the model the framework trains; None
            (the default) picks them with ``auto_modules``.
        on_anomaly: "record" (the default), "stop" or "pdb", as for ``recorder.record``.
        record_options: the other options of ``recorder.record`` (``max_ring_bytes``,
            ``compressor``, ``flush_interval``, ``storage_options``...).
    """

    def __init__(self, path: Any, mode: str = "flight", keep: int | None = None,
                 modules: str | list[str] | None = None, on_anomaly: str = "record", **record_options: Any) -> None:
        from . import autohooks, monitors
        from .run import MODES

        if mode not in MODES:
            raise RecordingError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        autohooks.parse_globs(modules)
        monitors.check_action(on_anomaly, "on_anomaly")
        if keep is not None and mode != "flight":
            raise RecordingError(f"keep={keep!r} applies to mode='flight' (the iterations its ring holds in memory); "
                                 f"mode={mode!r} has no ring: leave it out")
        taken = sorted({"model", "optimizer", "start_iteration"} & set(record_options))
        if taken:
            raise RecordingError(f"the callback records the model the framework trains and numbers the iterations by "
                                 f"its global step itself (a resumed training's too): leave out {', '.join(taken)}")
        super().__init__()
        self.path = path
        self.options: dict[str, Any] = {"mode": mode, "modules": modules, "on_anomaly": on_anomaly, **record_options}
        if keep is not None:  # (flight mode's: record() refuses it in another)
            self.options["keep"] = keep
        self.run: Run | None = None  # the recording of the training in progress (or of the last one)
        self._run_path: Any = None  # where it records (``path`` when it opened: the user may set a new one since)
        self._model: torch.nn.Module | None = None
        self._window: contextlib.ExitStack | None = None  # open during a training step
        # The framework's frame running the training step, where its framework reports no exception:
        # (thread, id of the frame, its code); steps start only while it is on that thread's stack.
        self._loop: tuple[int, int, Any] | None = None
        self._first_nonfinite: int | None = None  # index of the step reported
        self._globs_checked = False  # whether the modules globs were checked after the first step
        self._recorded: list[Any] = []  # paths this callback recorded into

    # -- framework events (the adapters call these) -----------------------------------------------
    def _begin(self, model: Any) -> None:
        """Training starts: open the recording of ``model``, paused until the first training step."""
        from . import record

        if not isinstance(model, torch.nn.Module):
            raise RecordingError(f"PaperDebuggerCallback needs the model being trained (an nn.Module), not "
                                 f"{type(model).__name__}")
        self.close()  # a recording an exception left open (Hugging Face reports none): crashed
        for other in list(_OPEN.values()):  # another callback's, left so (a notebook cell run again with a
            if other is not self:           # new Trainer and callback): a new training means it is over
                other.close()
        options = dict(self.options)
        if options["modules"] is None:
            options["modules"] = auto_modules(model)
        try:
            run = record(self.path, model=model, optimizer=None, **options)
        except RecordingError as exc:
            if any(p is self.path or p == self.path for p in self._recorded):
                raise RecordingError(f"{exc} (an earlier training with this callback recorded there: set "
                                     "callback.path to a new path before the next one)") from None
            raise
        self.run, self._run_path, self._model, self._first_nonfinite = run, self.path, model, None
        self._globs_checked = False
        _warn_of_checkpointing(model)
        run.pause()
        run.notify_nonfinite(self._nonfinite)
        run.only_while(self._in_step)
        _OPEN[id(self)] = self
        _hook_exit()

    def _step_start(self, global_step: int, loop: Any = None) -> None:
        """A training step (or one micro-batch of it) starts: its iteration is ``global_step``.
        ``loop``: the framework's frame that runs the step, for a framework that reports no
        exception (Hugging Face): once it is off the stack (the step raised out of ``train()``), the
        step is over, and what runs next (``trainer.evaluate()``, the user's own calls) is not
        recorded as its steps."""
        self._step_end()  # one left open (a batch the framework skipped the end of) ends here
        run = self.run
        if run is None or run.closed:
            return
        assert self._model is not None
        while run.iteration < global_step:
            run.next_iteration()
        window = contextlib.ExitStack()
        run.resume()
        window.callback(run.pause)
        window.enter_context(run.paths_relative_to(self._model))
        self._window = window
        if loop is not None:  # (its id and code, not the frame: a frame holds the whole loop's locals)
            self._loop = (threading.get_ident(), id(loop), loop.f_code)

    def _step_end(self) -> None:
        """The training step is over: pause until the next one (after the first, a word if the
        ``modules`` globs matched nothing in it: a long training would record nothing)."""
        self._loop = None
        if self._window is not None:
            window, self._window = self._window, None
            window.close()
            if self.run is not None and not self._globs_checked:
                self._globs_checked = True
                self.run.warn_if_nothing_selected()

    # The code of the framework's functions that call the callbacks' events (and the model's own event
    # hooks), set by the adapters: a step called from inside one is an event's (a user's callback that
    # generates at the end of a batch), not the training step's, whichever callback comes first.
    _events: frozenset[Any] = frozenset()

    def _is_event(self, frame: Any) -> bool:
        """Whether ``frame``, running one of ``_events``, calls an event (not the training step)."""
        return True

    def _in_step(self) -> bool:
        """Whether a step may start now (``Run.only_while``): not from inside the framework's call of
        an event (``_events``: the window is open from one event to another, and other callbacks'
        events run in between), and not once the frame running the training step is gone from its
        thread's stack; the window then closes. Other threads (``nn.DataParallel``'s replicas) are
        judged by the events only."""
        loop, events = self._loop, self._events
        mine = loop is not None and threading.get_ident() == loop[0]
        if not mine and not events:
            return True
        frame: Any = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if mine and id(frame) == loop[1] and code is loop[2]:  # type: ignore[index]
                return True
            if code in events and self._is_event(frame):
                return False
            frame = frame.f_back
        if not mine:
            return True
        self._step_end()
        return False

    def _end(self) -> None:
        """Training ended normally: close the recording ``complete``."""
        self._finish("complete", None)

    def _crash(self, exception: BaseException | None, during: str | None = None) -> None:
        """Training raised ``exception``: close the recording ``crashed``. ``during``: what of the
        training, not recorded, raised it (validation), where the adapter knows; else
        ``_raised_during`` looks at the exception."""
        if during is None and exception is not None:
            during = self._raised_during(exception)
        self._finish("crashed", exception, during)

    def _raised_during(self, exception: BaseException) -> str | None:
        """What of the training the callback does not record raised ``exception`` (evaluation), in a
        few words for ``final.raised_during``; None for a training step, or where it cannot tell."""
        return None

    def close(self, exception: BaseException | None = None) -> str | None:
        """Close a recording that training left open, as ``crashed`` (``exception``, if given, goes
        into its final information): after ``trainer.train()`` raised, for one. Does nothing when
        no recording is open. Returns the status of the callback's last recording, if any."""
        if self.run is not None and not self.run.closed:
            self._crash(exception)
        return None if self.run is None else self.run.status

    # -- inside --------------------------------------------------------------------------------------
    def _finish(self, status: str, exception: BaseException | None, during: str | None = None) -> None:
        run = self.run
        if run is None or run.closed:
            return
        self._step_end()
        _OPEN.pop(id(self), None)
        run.close(status, exception, raised_during=during)
        self._recorded.append(self._run_path)
        if status == "crashed":
            self._warn_crashed(run, exception, during)

    def _where(self, index: int | None, status: str | None = None) -> str:
        """Where the recording is, and the command that opens it (at step ``index``)."""
        assert self.run is not None
        command = open_command(self._run_path, index, self.run.dist["rank"])
        where = f"the recording{f' ({status})' if status else ''} is in {self._run_path}"
        return f"{where}; open it there: {command}" if command else where

    def _nonfinite(self, index: int, message: str) -> None:
        self._first_nonfinite = index
        warn(f"PaperDebugger: {message} (the first NaN/Inf of this run); {self._where(index)}",
             stacklevel=capture._outside_recorder(installed=True))

    def _warn_crashed(self, run: Run, exception: BaseException | None, during: str | None = None) -> None:
        what = "training stopped"
        if exception is not None:
            what += f" with {brief(exception)[:240]}"
        if during:  # (nothing of it is recorded: say so before the user looks for it in the recording)
            what += f", raised during {during}, which this callback does not record"
        at = "" if self._first_nonfinite is None else " (at its first NaN/Inf)"
        warn(f"PaperDebugger: {what}; {self._where(self._first_nonfinite, run.status)}{at}",
             stacklevel=capture._outside_recorder(installed=True))


def _warn_of_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face's gradient checkpointing gives each layer the checkpoint function as an attribute:
    ``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=...)`` is recorded (and the
    layers replay), but not another function (``offload=True``'s, one of the user's) or options that
    are not data. Training itself is recorded as usual: say so, and how to replay them."""
    for name, module in model.named_modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if type(module).__module__.startswith("transformers.") and getattr(module, "gradient_checkpointing", False) \
                is True and func is not None and skeleton.opaque_in(jsonval.encode(func)) is not None:
            what = getattr(func, "__qualname__", None) or f"{func!r:.80}"
            warn(f"PaperDebugger: gradient checkpointing is on ({name or 'the model'}) with a checkpoint function "
                 f"({what}) that is not recorded as data, so the layers' recorded steps cannot be "
                 "replayed; training is recorded as usual: to replay them, record with torch's checkpoint "
                 "(gradient_checkpointing_kwargs of plain values, no offload) or without gradient_checkpointing",
                 stacklevel=4)
            return
