"""``recorder.record``: the context manager that turns recording on around a block of training."""

from __future__ import annotations

import atexit
import contextlib
import difflib
import functools
import inspect
import multiprocessing
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
from torch.amp.grad_scaler import GradScaler
from torch.optim import optimizer as optimizer_mod

from . import autohooks, capture, collectives, compiled, jsonval, monitors, snapshot
from .errors import AlreadyRecording, RecordingError
from .items import ScalerSkip
from .pipeline import WHEN_SLOW, Pipeline
from .store import backend, layout
from .store import codecs as codecs_api
from .store.writer import StoreWriter

MODES = ("full", "stats", "flight")

_STARTING = threading.Lock()  # guards _starting
_starting: list[Any] = []  # the paths of recordings whose Run is being made (none, or one)


def _one_start_at_a_time(init: Callable[..., None]) -> Callable[..., None]:
    """``Run.__init__`` refusing a second recording while another thread's is being made: "one recording at
    a time" is checked on ``capture.ACTIVE``, which is set only at the end of ``__init__`` (after the store is
    made), so two threads that start their own recordings at once both passed the check and both recorded,
    every step in the second (one model's and the other's) and none in the first. The second is refused as
    a later one is, at once; ``__init__`` itself is not held under a lock (a remote store may take seconds)."""

    @functools.wraps(init)
    def start(self: Run, path: Any, *args: Any, **kwargs: Any) -> None:
        with _STARTING:
            if _starting:
                raise AlreadyRecording(f"a recording is being started in this process on another thread ("
                                       f"{backend.describe(_starting[0])}); one recording is active at a time: "
                                       "close it before starting another")
            _starting.append(path)
        try:
            init(self, path, *args, **kwargs)
        finally:
            with _STARTING:
                _starting.clear()

    return start


def _forget_starting_in_child() -> None:
    """A child forked while another thread made a recording holds none of it (see capture's fork hook)."""
    _starting.clear()
    _STARTING.release()


# (A fork waits for the lock, so that the child's copy is not held by a thread it does not have.)
os.register_at_fork(before=_STARTING.acquire, after_in_parent=_STARTING.release,
                    after_in_child=_forget_starting_in_child)


class Run:
    """A recording in progress. Use as a context manager (``with recorder.record(...) as run``) or
    call ``close()`` yourself."""

    def __repr__(self) -> str:
        state = getattr(self, "status", None) or ("closed" if getattr(self, "closed", False) else "recording")
        return f"<Run {backend.describe(self.path)}: {state}, mode {self.mode}>"

    @_one_start_at_a_time
    def __init__(self, path: backend.StoreTarget, *, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, mode: str = "full", every: int = 1,
                 compressor: Any = None, max_queue_bytes: int = 512 << 20, flush_interval: float = 1.0,
                 when_slow: str = "drop_payloads",
                 modules: str | list[str] | None = None, on_anomaly: str = "record", keep: int | None = None,
                 max_ring_bytes: int | None = None, script: str | None = None, main_module: str | None = None,
                 storage_options: dict[str, Any] | None = None, start_iteration: int = 0) -> None:
        if mode not in MODES:
            raise RecordingError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
        if not isinstance(every, int) or every < 1:
            raise RecordingError(f"every must be a positive integer (payloads every k-th iteration), not {every!r}")
        if isinstance(start_iteration, bool) or not isinstance(start_iteration, int) or start_iteration < 0:
            raise RecordingError(f"start_iteration must be an integer >= 0 (the first iteration's number: for a "
                                 f"resumed run, the step its checkpoint was saved at), not {start_iteration!r}")
        if every != 1 and mode != "full":
            raise RecordingError(f"every={every} applies to mode='full' (payloads every k-th iteration); mode="
                                 f"{mode!r} " + ("keeps no payload" if mode == "stats" else "keeps the payloads of the "
                                 "last keep iterations") + ": leave every out, or record in mode='full'")
        flight_only = [f"{k}={v!r}" for k, v in (("keep", keep), ("max_ring_bytes", max_ring_bytes)) if v is not None]
        if flight_only and mode != "flight":
            raise RecordingError(f"{' and '.join(flight_only)} appl{'ies' if len(flight_only) == 1 else 'y'} to "
                                 f"mode='flight' (the iterations its ring holds in memory); mode={mode!r} has no "
                                 "ring: leave it out, or record in mode='flight'")
        keep = 2 if keep is None else keep
        max_ring_bytes = 4 << 30 if max_ring_bytes is None else max_ring_bytes
        if capture.ACTIVE is not None:
            where = getattr(getattr(capture.ACTIVE, "pipeline", None), "where", lambda: "another recording")()
            raise AlreadyRecording(f"a recording is already active in this process ({where}); close it before "
                                   "starting another: run.close() on the Run that recorder.record returned (a `with` "
                                   "block closes it at its end), or recorder.close() where that Run is out of reach")
        if not isinstance(path, (str, os.PathLike)) and not hasattr(path, "set"):
            raise RecordingError(f"path must be a directory path or a zarr store, not {type(path).__name__}")
        if isinstance(path, (str, os.PathLike)) and not os.fspath(path):
            raise RecordingError(EMPTY_PATH)
        remote = backend.is_url(path)
        local = None if remote or not isinstance(path, (str, os.PathLike)) else Path(backend.local_path(path))
        self.dist = collectives.identity()  # each rank of a distributed run records its own group
        rank = self.dist["rank"]
        if local is not None:
            check_free(local, self.dist)
        if storage_options is not None and not remote:
            raise RecordingError(f"storage_options apply to URLs (s3://bucket/run.zarr), not to {path!r}; leave "
                                 "them out")
        if optimizer is not None and optimizer != "auto" and not isinstance(optimizer, torch.optim.Optimizer):
            raise RecordingError(f"optimizer must be a torch.optim.Optimizer, 'auto' or None, not "
                                 f"{type(optimizer).__name__}")
        autohooks.parse_globs(modules)  # a bad glob is refused before anything is created
        if not isinstance(keep, int) or keep < 1:
            raise RecordingError(f"keep must be a positive integer (iterations held by the flight recorder), not "
                                 f"{keep!r}")
        if not isinstance(max_ring_bytes, int) or max_ring_bytes < 1:
            raise RecordingError(f"max_ring_bytes must be a positive integer, not {max_ring_bytes!r}")
        monitors.check_action(on_anomaly, "on_anomaly")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise RecordingError(f"model must be the torch.nn.Module being trained, not a {type(model).__name__} "
                                 "(torch.compile of a compiled module returns a function: give the module itself)")
        if when_slow not in WHEN_SLOW:
            raise RecordingError(f"unknown when_slow {when_slow!r}: use 'drop_payloads' (the default: a store too "
                                 "slow for training loses payloads, never steps) or 'wait' (training waits for it)")
        self.path, self.mode, self.every = path, mode, every
        compression = codecs_api.parse(compressor)
        self.t0 = time.perf_counter()
        self.started = time.time()
        try:
            store = backend.open_store(path, mode="w", storage_options=storage_options)  # a URL: checked here
            attrs = {**run_metadata(self.started, mode, every, script, main_module, start_iteration), **self.dist,
                     # its module globs (a diff tells a module the other run did not select from one that did not run)
                     "modules": [modules] if isinstance(modules, str) else list(modules or [])}
            writer = StoreWriter(store, run_attrs=attrs, compression=compression, rank=rank,
                                 world_size=self.dist["world_size"])
        except OSError as exc:
            if remote:
                raise RecordingError(f"cannot create the recording {path}: {backend.remote_problem(exc)}") from None
            raise RecordingError(f"cannot create the recording {path}: {exc.strerror or exc}; choose a path in a "
                                 "writable directory") from None
        self.pipeline = Pipeline(writer, max_queue_bytes=max_queue_bytes, flush_interval=flush_interval,
                                 when_slow=when_slow)
        self.session = capture.Session(self.pipeline, mode=mode, every=every, model=model, t0=self.t0,
                                       modules=modules, on_anomaly=on_anomaly, keep=keep,
                                       max_ring_bytes=max_ring_bytes, start_iteration=start_iteration)
        self._unmatched_said: set[str] = set()  # modules globs already reported as matching nothing
        self._whole_graphs_at_start = compiled.unrecorded_traces()
        self._hooks: list[Any] = []
        self._stepped: int | None = None  # id of the optimizer whose step hook ran last (see _GradScaling)
        self._optimizers = _OptimizerSteps(self, optimizer) if optimizer is not None else None
        if self._optimizers is not None:
            self._hooks.append(self._optimizers)
        self._uncounted = _UncountedSteps(self.session) if optimizer is None else None
        if self._uncounted is not None:
            self._hooks.append(self._uncounted)
        self._hooks.append(_GradScaling(self))
        self._backward = _BackwardCalls(self.session)
        self._hooks.append(self._backward)
        self.closed = False
        self._entered = False  # inside its `with` block (see __enter__)
        self._pid = os.getpid()  # a forked child has the recording's objects, not the recording
        self.status: str | None = None
        self._blosc_threads = _single_threaded_blosc()
        self._writer = writer
        self._rank_warned = False
        # Ranked by torchrun's environment: the process group, and its backend, may come later.
        self._backend_later = self.dist["source"] == "environment"
        self._collectives = collectives.Recording(self.session.collective, self.session.in_step)
        self._collectives.install()
        self._ended_by: str | None = None  # the signal that closed the recording ("SIGTERM"), if one did
        # Called with the signal's number once a signal that ends the process has closed the recording, before
        # the process ends of it (pdbg record, recording in its own process, prints its last line there).
        self.on_signal_end: Callable[[int], Any] | None = None
        self._cells = _Cells.of(self)  # in a Jupyter kernel: which cell's exception ended the recording
        # Last: a signal from here on finds everything its handler uses.
        self._signals = self._catch_signals()
        self._replaced = dict(self._signals)  # what a handler put back after close() passes signals to
        capture.ACTIVE = self.session
        _LEFT_OPEN[id(self)] = self
        _hook_exit()
        _EXITS.watch()

    # -- while recording ---------------------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self.session.iteration

    @property
    def steps(self) -> int:
        """Steps started so far."""
        return self.session.next_index

    def next_iteration(self) -> None:
        """Start the next iteration (done for you on ``optimizer.step()`` when an optimizer is given). The
        steps of an optimizer that counts nothing before it are then numbered (see ``_warn_uncounted``)."""
        self.session.next_iteration()
        if self._optimizers is not None:
            self._optimizers.others_since = 0
        if self._backend_later and self._writer.dist["backend"] is None:
            self._learn_backend()

    def _learn_backend(self) -> None:
        """The process group may be made after the recording started (``pdbg record`` under torchrun):
        its backend goes into the next commit; a rank other than the one recorded under is warned of."""
        try:
            found = collectives.backend_now()
            if found is None:
                return
            self._writer.dist["backend"] = found
            now = collectives.identity()
            if now["rank"] != self.dist["rank"] and not self._rank_warned:
                self._rank_warned = True
                capture.warn(f"this process records as rank {self.dist['rank']} (from "
                             f"{self.dist['source'] or 'no launcher environment'}), but torch.distributed says "
                             f"it is rank {now['rank']}: ranks may overwrite each other's recording; start the "
                             "recording after init_process_group, or launch with torchrun (it sets RANK and "
                             "WORLD_SIZE)", stacklevel=3)
        except Exception:  # never let a query of the process group disturb training
            return

    def _skipped_step(self, optimizer: torch.optim.Optimizer, scale: float | None = None,
                      began: int | None = None) -> None:
        """GradScaler skipped ``optimizer.step()`` (Inf or NaN in the scaled gradients) at loss scale
        ``scale``: the iteration ends as if it had stepped, and is listed in the run's ``grad_scaler_skipped``
        (see _GradScaling). ``began``: the iteration ``scaler.step`` began in, where the optimizer's own
        step ran and skipped its update (a fused one): its hooks have ended the iteration already."""
        before = self.session.iteration if began is None else began
        if self._optimizers is None:
            return
        if began is None:
            self._optimizers.stepped(optimizer, hooked=False)
        if self.session.iteration != before:  # the writer keeps the list (the manifest's info, then final)
            self.pipeline.submit(ScalerSkip(before, scale))

    # -- pausing, paths and anomalies (what framework callbacks build on: recorder.framework) --------
    def pause(self) -> None:
        """Start no new step until ``resume()``: a framework's evaluation, checkpointing or logging
        between training steps. Steps already running finish and are recorded; iterations, the
        flight ring, signals and ``close()`` work as usual. Pauses nest: each needs its ``resume()``."""
        self.session.pauses += 1

    def resume(self) -> None:
        """Undo one ``pause()``; a RecordingError when the recording is not paused."""
        if not self.session.pauses:
            raise RecordingError("resume() without pause(): this recording is not paused")
        self.session.pauses -= 1

    def only_while(self, running: Callable[[], bool] | None) -> None:
        """Start a step only while ``running()`` is true (None: always). It is called on the thread
        about to start the step, before anything is captured. A framework callback whose framework
        reports no exception (Hugging Face) passes "the training step I opened is still running",
        so that after ``train()`` raised, nothing run outside training is recorded as its steps."""
        self.session.guard = running

    @property
    def is_paused(self) -> bool:
        """Whether a ``pause()`` (or a ``paused()`` block) is in force."""
        return bool(self.session.pauses)

    @contextlib.contextmanager
    def paused(self) -> Iterator[Run]:
        """``with run.paused(): evaluate(model)``: no step inside the block is recorded. However the
        block ends, the recording is left paused exactly as often as before it."""
        before = self.session.pauses
        self.session.pauses = before + 1
        try:
            yield self
        finally:
            self.session.pauses = before

    @contextlib.contextmanager
    def paths_relative_to(self, module: torch.nn.Module) -> Iterator[Run]:
        """Inside the block, module paths recorded on this thread are relative to ``module`` whatever
        the training code calls first: a wrapper around it (DistributedDataParallel) or one of its
        children (a LightningModule's ``self.net(x)``). ``module`` is the outermost module meanwhile."""
        with self.session.modules.rooted(module):
            yield self

    def notify_nonfinite(self, callback: Callable[[int, str], Any]) -> None:
        """Call ``callback(index, message)`` once, as soon as the first step whose results hold NaN or
        Inf is recorded (the step flight mode writes its ring for). ``message`` names the step as
        NonFiniteError does: "Eq. 2 (smooth_relu) forward, iteration 17, call 3: output has 12 NaN".
        In stats and full mode with statistics on an accelerator, and no monitor asking for them at
        once, the steps are looked at when their iteration ends (one host sync per iteration).

        Args:
            callback: called on the thread that finished the step (autograd's, for a backward step);
                an exception it raises is reported as a RecorderWarning, never raised into training.
        """
        self.session.on_nonfinite = callback

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Commit everything recorded so far; returns False if the writer failed (or in a forked
        child, which has no writer)."""
        if self._forked():
            return False
        return self.pipeline.flush(timeout)

    def _forked(self) -> bool:
        """Whether this is a forked child of the recording process (see capture.Session.disown)."""
        return os.getpid() != self._pid

    @property
    def failure(self) -> str | None:
        """Why recording stopped early, if it did (the run will be ``incomplete``)."""
        if self.session.failure is None and self.pipeline.error is not None:
            return f"writer: {self.pipeline.problem()}"
        return self.session.failure

    def _writer_failed(self) -> None:
        """A writer failure the training side has not met yet (no hand-over since) is warned here, once."""
        if self.pipeline.error is not None:
            self.session.fail("writing the recording", capture.WriterStopped(self.pipeline.problem()))

    # -- ending --------------------------------------------------------------------------------------
    def close(self, status: str = "complete", exception: BaseException | None = None, *,
              raised_during: str | None = None) -> None:
        """Stop recording, write everything out and mark the run ``complete`` (or ``crashed``); a run
        whose recording stopped early (a failed writer, a capture error) is ``incomplete``, which
        wins over both (``exception`` still goes into its final information). ``raised_during``: what
        of the training, not recorded, raised ``exception`` ("validation": a framework callback's
        recording pauses there), in a few words; ``pdbg`` says so instead of sending the user to
        record the code between the recorded steps (``final.raised_during``)."""
        if self.closed:
            return
        with self._signals_held() as came:
            self._close(status, exception, raised_during)
        for signum in dict.fromkeys(came):  # Ctrl-C or SIGTERM while closing: the recording is whole, then
            _pass_signal(signal.getsignal(signum), signum, None)  # they do what they would have done

    def _close(self, status: str, exception: BaseException | None, raised_during: str | None = None) -> None:
        self.closed = True
        _LEFT_OPEN.pop(id(self), None)
        if not _LEFT_OPEN:
            _EXITS.unwatch()
        if self._cells is not None:
            self._cells.unregister()
        if capture.ACTIVE is self.session:
            capture.ACTIVE = None
        self._collectives.remove()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._restore_signals()
        self.session.close(exception)
        if self._forked():  # the parent closes the recording; this process only took its hooks out
            return
        if self._backend_later and self._writer.dist["backend"] is None:
            self._learn_backend()
        self._warn_unmatched()
        self._warn_uncounted()
        self._writer_failed()
        pipe = self.pipeline  # its counters are final: nothing more is handed over
        begun = self.session.iteration - self.session.start_iteration + 1  # (docs/FORMAT.md: final.iterations)
        info: dict[str, Any] = {"ended_unix": time.time(), "iterations": begun,
                                "steps_started": self.session.next_index,
                                "peak_queue_bytes": pipe.peak_queue_bytes, "peak_record_bytes": pipe.peak_record_bytes,
                                "when_slow": pipe.when_slow, "dropped_payloads": pipe.dropped_payloads,
                                "dropped_payload_bytes": pipe.dropped_bytes, "queue_wait_s": round(pipe.waited_s, 3)}
        if self._optimizers is not None and self._optimizers.takeovers:
            info["optimizer_replaced"] = self._optimizers.takeovers_doc()
        if self._backward.raised_outside is not None:
            info["backward_raised"] = self._backward.raised_outside
        ring = self.session.ring
        if ring is not None:
            info["flight"] = {"keep": ring.keep, "max_ring_bytes": ring.max_bytes, "peak_ring_bytes": ring.peak_bytes,
                              "overflowed_payloads": ring.overflowed, "dumps": self.session.dumps}
        if exception is None and status != "complete":  # closed later (at exit): the stop it raised
            exception = self.session.stopped_by
        if exception is not None:
            info["exception"] = jsonval.encode(capture.exception_doc(exception, limit=None))
            if raised_during:
                info["raised_during"] = str(raised_during)[:200]
        if self._ended_by is not None:
            info["signal"] = self._ended_by
        unrecorded = compiled.unrecorded_doc(self._whole_graphs_at_start)
        if unrecorded is not None:  # steps that ran inside fullgraph=True code: a run of no steps says why
            info["compiled_unrecorded"] = unrecorded
        if self.failure:
            info["recorder_failure"] = self.failure
        try:
            self.pipeline.close("incomplete" if self.session.failure is not None else status, info)
        finally:
            _restore_blosc(self._blosc_threads)
        self._writer_failed()  # failed while closing
        self.status = "incomplete" if self.session.failure is not None else status

    def _catch_signals(self) -> dict[int, Any]:
        """SIGTERM and SIGHUP (a closed terminal or ssh session), and SIGINT when it would kill the
        process, first commit what is recorded (flight mode: write the ring), then do what they would
        have done: a signal that would end the process closes the recording first, ``crashed`` with
        the signal's name. Every mode: a preempted job's last second of steps is not lost. Only the
        main thread may set handlers."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in _ENDING:
            found = signal.getsignal(sig)
            if sig == getattr(signal, "SIGHUP", None) and found in (signal.SIG_IGN, None):
                continue  # under nohup a hangup ends nothing
            handler = _before_closed_runs(found, sig)
            if handler is not found:  # a closed recording's, put back by code that had saved it: let it go
                signal.signal(sig, handler)
            if sig == signal.SIGINT and handler is signal.default_int_handler:
                continue  # KeyboardInterrupt unwinds through the steps and close(): the ring is written then
            previous[sig] = handler
            signal.signal(sig, self._on_signal)
        return previous

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.closed:  # put back after close() by code that had saved it (Lightning's teardown)
            _pass_signal(self._replaced.get(signum, signal.SIG_DFL), signum, frame)
            return
        if self._forked():  # a DataLoader worker terminated with its job: the parent writes the ring
            _pass_signal(self._signals.get(signum, signal.SIG_DFL), signum, frame)
            return
        handler = self._signals.get(signum, signal.SIG_DFL)
        # Called by a handler set after ours, which took ours in as the program's own (Lightning's, set when
        # fit begins, runs "existing" handlers beside its own): where ours stands for no handler at all, that
        # one decides (Lightning finishes the batch and ends the fit by an exception); ending the process here
        # would do what it would not have done without the recording.
        passed_on = not callable(handler) and signal.getsignal(signum) != self._on_signal
        # Copies that come meanwhile (a signal to the whole process group, and pdbg's forward of it)
        # wait for this one; and the signal may have come while training held the queue's lock
        # (handing an item over): the writer thread must have it while the ring is written.
        with self._signals_held() as came, self.pipeline.released():
            self.session.dump_ring(signal.Signals(signum).name)
            if callable(handler) or handler == signal.SIG_IGN or passed_on:  # the program's own handler decides;
                self.flush()                                                  # recording goes on if it does
            else:  # the signal would have ended the process: close the recording, then let it
                self._ended_by = signal.Signals(signum).name
                self.close("crashed")
                if self.on_signal_end is not None:
                    with contextlib.suppress(Exception):  # (what it says must not keep the process alive)
                        self.on_signal_end(signum)
        if not passed_on:
            _pass_signal(handler, signum, frame)
        for again in dict.fromkeys(came):  # (where the first ended the process, none of these is reached)
            _pass_signal(signal.getsignal(again), again, frame)

    @contextlib.contextmanager
    def _signals_held(self) -> Iterator[list[int]]:
        """While a signal is handled or the recording closes, on the main thread, the signals that end a
        process (a second Ctrl-C, a signal to the process group after pdbg forwarded its own copy) are
        held, so that they cannot cut the ring's write or the close in half; yields those that came.
        After, each handler is as it was, but this recording's, once it is closed: the program's own."""
        came: list[int] = []
        if threading.current_thread() is not threading.main_thread():
            yield came
            return

        def hold(signum: int, frame: Any) -> None:
            came.append(signum)

        before = {sig: signal.getsignal(sig) for sig in _ENDING}
        for sig, handler in before.items():
            if handler is not None:  # (None: set outside Python, left alone)
                signal.signal(sig, hold)
        try:
            yield came
        finally:
            for sig, handler in before.items():
                if handler is not None and signal.getsignal(sig) is hold:
                    ours = handler == self._on_signal and self.closed
                    signal.signal(sig, self._replaced.get(sig, signal.SIG_DFL) if ours else handler)

    def _restore_signals(self) -> None:
        for sig, handler in self._signals.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, handler)
        self._signals = {}

    def _warn_unmatched(self, so_far: str = "") -> None:
        selector = self.session.selector
        missed = [g for g in selector.unmatched() if g not in self._unmatched_said]
        if not missed or not selector.paths:
            return
        self._unmatched_said.update(missed)
        paths = sorted(selector.paths)
        shown = ", ".join(repr(p) if p else "'' (the root)" for p in paths[:40])
        more = f" and {len(paths) - 40} more" if len(paths) > 40 else ""
        brackets = ("; in a glob, [...] is a set of characters (x[0] is x0): write [[] for a literal [ (x[[]0]), or "
                    "the module path whole, as called, which selects it" if any("[" in g for g in missed) else "")
        unseen = ("; calls inside code compiled with fullgraph=True are not recorded (said when compiled), nor their "
                  "paths seen" if compiled.unrecorded_traces() != self._whole_graphs_at_start else "")
        capture.warn(f"module glob(s) {', '.join(map(repr, missed))} matched no module{so_far}; the module paths "
                     f"called were: {shown}{more}{brackets}{unseen}", stacklevel=capture._outside_recorder())

    def _warn_uncounted(self) -> None:
        """Backward passes ran, yet the iterations never advanced: a hand-written update (no torch.optim
        optimizer) under ``optimizer="auto"``, an optimizer given that never stepped, or no optimizer
        given while one stepped; said once, at the end, as every step of the run is then in its first
        iteration."""
        counter = self._optimizers
        passes = self._backward.passes
        if counter is not None and counter.steps and counter.others_since > max(2, counter.steps):
            capture.warn(f"iteration {self.session.iteration} holds the last {counter.others_since} steps of "
                         f"{counter.other_name}, which numbers no iteration: iterations follow the first optimizer "
                         f"that stepped ({counter.counting}, {counter.steps} steps), which stopped stepping; "
                         "give the one whose steps should number them to recorder.record(optimizer=...), or, for "
                         "one made after the recording began (an adapters' optimizer once the base was frozen), "
                         "call run.next_iteration() after each of its steps (README, \"How iterations are "
                         "counted\")", stacklevel=3)
        first = self.session.start_iteration
        seen = self._uncounted
        if seen is not None and seen.steps and self.session.iteration == first and \
                self.session.next_index > seen.steps_before:
            capture.warn(f"every step is in iteration {first}: {seen.name}.step() ran {seen.steps} "
                         f"time{'s' if seen.steps != 1 else ''}, but record() was given no optimizer, so none ended "
                         "an iteration; pass optimizer=your_optimizer (or optimizer=\"auto\") to recorder.record, or "
                         "call run.next_iteration() after each update (README, \"How iterations are counted\")",
                         stacklevel=3)
            return
        if counter is None or counter.steps or self.session.iteration != first or passes < 2 or \
                not self.session.next_index:
            return  # (a run that recorded no step is told what to name instead)
        why = ("no torch.optim optimizer stepped" if not counter.any_step else
               f"the {counter.counting} given to record() never stepped")
        capture.warn(f"every step is in iteration {first}: {passes} backward passes ran and {why} (iterations advance "
                     "on optimizer.step()); to number the iterations of a hand-written update, record in code "
                     "with recorder.record and call run.next_iteration() after each update (README, \"How "
                     "iterations are counted\")", stacklevel=3)

    def warn_if_nothing_selected(self) -> None:
        """When no ``modules`` glob has matched a module yet (nothing of them is recorded), say so now
        rather than when the recording closes (a framework callback asks after the first step)."""
        selector = self.session.selector
        if selector.globs and len(selector.unmatched()) == len(selector.globs):
            self._warn_unmatched(" in the first training step: none of them is being recorded")

    @property
    def unmatched_globs(self) -> list[str]:
        """The ``modules`` globs that selected no module (so far)."""
        return self.session.selector.unmatched()

    def __enter__(self) -> Run:
        """Refuses a recording closed already (a notebook cell's `with run:` run again) and one whose `with`
        block is running (the inner block's end would close it): either way the block would train unrecorded
        and nothing would say so."""
        where = backend.describe(self.path)
        if self.closed:
            raise RecordingError(f"the recording {where} is closed ({self.status or 'closed'}); a recording is "
                                 "entered once: start a new one, recorder.record(NEW_PATH, ...)")
        if self._entered:
            raise RecordingError(f"the recording {where} is in its `with` block already; enter it once (the inner "
                                 "block's end would close it)")
        self._entered = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, SystemExit) and exit_status(exc.code) == 0:  # sys.exit(0): the program ended well
            exc = None
        self.close("crashed" if exc is not None else "complete", exc)


_LEFT_OPEN: dict[int, Run] = {}  # recordings not closed yet, closed when the process ends if still so


def _close_left_open() -> None:
    """Close the recordings the program left open (``run = recorder.record(...)`` with no ``with`` and no
    ``close()``, as a notebook's cells do) when its main thread ends: ``complete``, or ``crashed`` with the
    uncaught exception that ends the process (the interpreter has set ``sys.last_value`` by then), or with
    the stop the recording raised (``on_anomaly="stop"``, caught by the program). Left to
    the writer's daemon thread, the steps of the last second (a short script's all) and a flight ring
    would die with the process, and the run would read as killed. A forked child's copy is not its own.
    A framework callback's recording is closed first, by its own hook (recorder.framework), registered
    after this one and so run before it."""
    left = [run for run in _LEFT_OPEN.values() if not run._forked()]
    interrupted = None
    try:
        if left:
            wait_for_program_threads()
    except KeyboardInterrupt as exc:  # a Ctrl-C while a thread trains on ends the process, as it would have
        interrupted = exc
    for run in left:
        _close_ended(run, interrupted or ending_exception(run) or _EXITS.ending(run))
    if interrupted is not None:
        raise interrupted


class _ExitCalls:
    """``sys.exit`` of the main thread, watched while a recording is open: at the end of the main thread, where
    the recordings left open are closed, nothing tells how the process ends (CPython clears a ``SystemExit``
    before its exit hooks run, and sets no ``sys.last_value`` for one), so a script that ended with
    ``sys.exit(1)`` read ``complete``. The wrapper notes the code and the step count when it was called (a call
    whose ``SystemExit`` the program caught and went on recording from is not how it ended) and raises as
    ``sys.exit`` does; it is put back when the last open recording closes (a ``raise SystemExit(1)`` of the
    program's own is not seen)."""

    def __init__(self) -> None:
        self.original: Any = None  # sys.exit as the program had it when the first recording opened
        self.watching = False
        self.code: Any = None
        self.steps = 0  # the active recording's next step index when sys.exit was called

    def watch(self) -> None:
        if self.watching or not callable(getattr(sys, "exit", None)):
            return
        self.original, self.code, self.watching = sys.exit, None, True
        sys.exit = self._exit

    def unwatch(self) -> None:
        if self.watching and sys.exit == self._exit:  # (one the program set since stays its own)
            sys.exit = self.original
        self.watching = False

    def _exit(self, status: Any = None, /) -> Any:
        if self.watching and threading.current_thread() is threading.main_thread():
            session = capture.ACTIVE
            self.code, self.steps = status, session.next_index if session is not None else 0
        return self.original(status)

    def ending(self, run: Run) -> BaseException | None:
        """The failing ``sys.exit`` that ends the process ``run`` records in, if one does (not in an IPython
        session, which catches a cell's SystemExit and goes on: there the cells tell, ``ending_exception``)."""
        if getattr(run, "_cells", None) is not None or self.code is None or exit_status(self.code) == 0 or \
                run.session.next_index > self.steps:
            return None
        return SystemExit(self.code)


_EXITS = _ExitCalls()


def wait_for_program_threads() -> None:
    """Wait for the threads that keep the process alive (not daemons) before the recordings left open are closed
    at the end of the main thread: CPython runs its threading exit hooks, where those are closed, before it waits
    for these threads, so a training thread the main thread never joined (a script that starts it and ends) went
    on unrecorded, and its run read ``complete`` without its steps. Threads that wait for an exit hook run after
    this one are not waited for, which would never end: a thread pool's workers and a process pool's manager,
    whose module was imported before the recording began (threading's exit hooks run last registered first;
    concurrent.futures is the standard library's only user of them, and a thread waiting for an ``atexit``
    function would hang the process anyway, since CPython joins every such thread before those run). Nor are
    the recorder's threads."""
    pools = [*getattr(sys.modules.get("concurrent.futures.thread"), "_threads_queues", {}),
             *getattr(sys.modules.get("concurrent.futures.process"), "_threads_wakeups", {})]
    while True:
        alive = [thread for thread in threading.enumerate() if thread is not threading.current_thread()
                 and not thread.daemon and thread not in pools and not thread.name.startswith("pdbg-")]
        if not alive:
            return
        for thread in alive:
            thread.join()


def _close_ended(run: Run, exception: BaseException | None) -> None:
    """Close ``run``, which its program left open: ``crashed`` with ``exception``, or with the stop it raised
    (``on_anomaly="stop"``, caught by the program); ``complete`` where neither ended it."""
    stopped = exception is not None or run.session.stopped_by is not None
    run.close("crashed" if stopped else "complete", exception)


def ending_exception(run: Run) -> BaseException | None:
    """The exception that ends ``run``'s process, if one does: the uncaught one (``sys.last_value``). In an
    IPython session (a Jupyter kernel) no cell's exception ends the process, and ``sys.last_value`` is the last
    one any cell raised, a typo's before the recording as well: there it is the exception of the last cell that
    recorded steps of ``run``, None where that cell finished."""
    cells = getattr(run, "_cells", None)
    if cells is not None and cells.ended:
        return cells.exception
    return getattr(sys, "last_value", None)  # (a script run by IPython: no cell ended, its traceback the last)


def ipython_shell() -> Any:
    """The IPython shell this process runs (a Jupyter kernel's, a terminal's), or None: asked only where
    IPython is imported already, never importing it here."""
    return getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()


class _Cells:
    """What the cells of an IPython session (a Jupyter kernel) did with one recording: the exception of the
    last cell that recorded steps of it, told by IPython's ``pre_run_cell`` and ``post_run_cell`` events."""

    def __init__(self, run: Run, shell: Any) -> None:
        self.session, self.shell = run.session, shell
        self.start: int | None = None  # the session's next step index when the cell began (None: the cell
        self.exception: BaseException | None = None  # that made the recording, which recorded it)
        self.ended = False  # a cell ended since the recording began (not so in a script `ipython train.py` runs)

    @classmethod
    def of(cls, run: Run) -> _Cells | None:
        """Follow ``run``'s cells where this process runs IPython's (imported already, never here)."""
        try:
            shell = ipython_shell()
            if shell is None:
                return None
            cells = cls(run, shell)
            shell.events.register("pre_run_cell", cells.begins)
            shell.events.register("post_run_cell", cells.ends)
            return cells
        except Exception:  # following the cells must never stop a recording: sys.last_value, as in a script
            return None

    def begins(self, info: Any = None) -> None:
        self.start = self.session.next_index

    def ends(self, result: Any = None) -> None:
        self.ended = True
        if self.start is None or self.session.next_index > self.start:
            self.exception = getattr(result, "error_in_exec", None)

    def unregister(self) -> None:
        """The recording is closed: its cells are no longer followed."""
        for event, callback in (("pre_run_cell", self.begins), ("post_run_cell", self.ends)):
            with contextlib.suppress(Exception):
                self.shell.events.unregister(event, callback)


def active_run() -> Run | None:
    """The recording this process is making now, if any (a forked child's copy is not its own)."""
    for run in list(_LEFT_OPEN.values()):
        if run.session is capture.ACTIVE and not run._forked():
            return run
    return None


def close_active() -> bool:
    """Close the active recording, as the end of the process would (see ``recorder.close``). False when this
    process has none."""
    run = active_run()
    if run is not None:
        _close_ended(run, run._cells.exception if run._cells is not None else None)
    return run is not None


@functools.cache
def _hook_exit() -> None:
    """Run ``_close_left_open`` at the end of the main thread, not in ``atexit``, by when the thread pools
    that zarr writes through are shut down (see recorder.framework._hook_exit)."""
    try:
        threading._register_atexit(_close_left_open)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # not in this Python, or the process is ending already
        atexit.register(_close_left_open)


def exit_status(code: Any) -> int:
    """The process exit status ``sys.exit(code)`` gives: None is 0, an int itself, anything else 1."""
    if code is None:
        return 0
    return code & 0xFF if isinstance(code, int) else 1


def _before_closed_runs(handler: Any, sig: int) -> Any:
    """``handler``, or when it is a closed recording's (put back after its close() by code that had
    saved it, as Lightning's teardown does after a crashed fit), the one that recording replaced:
    a new recording passes a signal on to the program's handler, not to a recording that is over."""
    for _ in range(64):  # (a chain of closed recordings, each put back in turn)
        owner = getattr(handler, "__self__", None)
        if not (isinstance(owner, Run) and getattr(handler, "__func__", None) is Run._on_signal and owner.closed):
            break
        handler = owner._replaced.get(sig, signal.SIG_DFL)
    return handler


# The signals that end a process by default that a flight recording writes its ring on, first.
_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


def _pass_signal(handler: Any, signum: int, frame: Any) -> None:
    """Do what ``handler`` (a signal's handler before a recording replaced it) would have done."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


EMPTY_PATH = "the recording's path is empty; give the path of a new directory for it (runs/run.zarr)"


def check_free(path: Path, dist: dict[str, Any]) -> None:
    """Refuse a local path that holds what this process would write: anything at all, for a single
    process; for one rank of several (which share the path), its own group, and for rank 0 the root."""
    if dist["world_size"] > 1 and path.is_dir():
        mine = path / layout.rank_group(dist["rank"])
        if (mine.exists() and any(mine.iterdir())) or (dist["rank"] == 0 and (path / "zarr.json").exists()):
            raise RecordingError(f"{path} already holds a recording of rank {dist['rank']}; choose a new path or "
                                 "delete it")
    elif path.exists() and not path.is_dir():
        raise RecordingError(f"{path} is a file; give the path of a new directory for the recording")
    elif path.exists() and any(path.iterdir()):
        several = multiprocessing.current_process().name != "MainProcess"  # mp.spawn's workers, a Pool's
        raise RecordingError(f"{path} already exists and is not empty; choose a new path (a job resumed from a "
                             "checkpoint: one per attempt, README \"Preempted and resumed runs\"), or delete it if "
                             "its recording is not needed" + (
            " (processes that record one run together: start recording after init_process_group, so that each "
            "knows its rank and writes its own part of the path)" if several else ""))


def record(path: backend.StoreTarget, model: torch.nn.Module | None = None,
           optimizer: torch.optim.Optimizer | None = None, mode: str = "full", every: int = 1,
           compressor: Any = None, **options: Any) -> Run:
    """Record the paper steps run inside the ``with`` block into a Zarr store.

    Args:
        path: a new directory (``run.zarr``), a URL (``s3://bucket/run.zarr``, any fsspec URL; s3 needs
            ``pip install paperdebugger[s3]``) or a zarr Store (``zarr.storage.MemoryStore()``).
        model: the model being trained; module paths are relative to it.
        optimizer: iterations advance after each of its ``step()`` calls; ``"auto"``: after each
            ``step()`` of the first optimizer that steps, whichever it is (global optimizer hooks).
            Either way an optimizer that steps parameters the counted one stepped has replaced it (a
            resumed or re-created optimizer), and counts from its first step (see _OptimizerSteps).
        mode: "full" (payloads of every tensor), "stats" (statistics only, tiny) or "flight"
            (statistics, and the payloads of the last ``keep`` iterations, held in memory and written
            on a NaN/Inf, an exception, SIGTERM/SIGINT or the end; see recorder.flight).
        every: with mode="full", keep payloads every k-th iteration and statistics for the rest.
        compressor: None (Blosc lz4 + bit shuffle), "lz4", "zstd", "none", or a dict with
            ``cname``, ``clevel`` and ``shuffle``.
        options: ``max_queue_bytes`` (payload bytes the writer queue may hold, default 512 MiB),
            ``when_slow`` (when the store is slower than training: "drop_payloads", the default, drops
            the payloads that find no room after a short wait, never steps or statistics; "wait" holds
            training instead; see docs/RELIABILITY.md, "A slow store"),
            ``flush_interval`` (seconds between commits, default 1.0) and ``modules``: module-path
            globs (``"blocks.*"``, ``"**.attn"``) whose modules are recorded too, decorated or not
            (see recorder.autohooks), and ``on_anomaly``: what a step with NaN or Inf results does:
            "record" (mark it ``nonfinite``, the default), "stop" (flush, raise NonFiniteError from
            the step) or "pdb" (flush, open the debugger in the calling code); flight mode's ``keep``
            (iterations, default 2) and ``max_ring_bytes`` (default 4 GiB); ``storage_options``: a
            URL's fsspec options, e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url":
            "http://127.0.0.1:9000"}}`` (default: ``$PDBG_STORAGE_OPTIONS``, else s3fs's own
            environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...);
            ``start_iteration``: the first iteration's number (default 0); a run resumed from the
            checkpoint of step N gives N, so that its iterations (selectors, the flight ring, ``every``,
            ``bisect --against``) are the run's own (README, "Preempted and resumed runs").

    Returns:
        The Run; leaving the ``with`` block closes it (``complete``, also on ``sys.exit(0)``, or
        ``crashed`` on an exception; ``incomplete`` when recording stopped early, as on a full disk).
        SIGTERM or SIGHUP that would end the process closes it ``crashed`` first (its ``ended_by``
        says which); under a handler of the program's own, what is recorded is committed and the
        handler decides.
    """
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(_OPTIONS), n=1)
        raise RecordingError(f"record() has no option {unknown[0]!r}" + (f" (did you mean {near[0]!r}?)" if near else
                             f"; its options are {', '.join(sorted(_OPTIONS))}"))
    return Run(path, model=model, optimizer=optimizer, mode=mode, every=every, compressor=compressor, **options)


# record()'s keyword options beyond its named parameters: the rest of Run's.
_OPTIONS = frozenset(inspect.signature(Run.__init__).parameters) - {
    "self", "path", "model", "optimizer", "mode", "every", "compressor", "main_module"}


def _single_threaded_blosc() -> Any:
    """Make numcodecs' Blosc compress on the calling thread only, returning the previous setting.

    In its default mode numcodecs runs Blosc on an internal pool of one thread per core whenever it is
    used in the main process, so the writer thread's compression would take the core training runs
    on (measured: a matmul loop 2x slower). Contextual mode compresses on the writer thread alone,
    without the GIL. Restored when the recording closes.
    """
    from numcodecs import blosc

    previous = blosc.use_threads
    blosc.use_threads = False
    return previous


def _restore_blosc(previous: Any) -> None:
    from numcodecs import blosc

    blosc.use_threads = previous


def run_metadata(started: float, mode: str, every: int, script: str | None = None,
                 main_module: str | None = None, start_iteration: int = 0) -> dict[str, Any]:
    """What a reader needs to know about where and how the run was recorded (plain JSON).

    ``script``: the user's script when it is not ``__main__``'s file (``pdbg record`` runs it);
    ``main_module``: the module it is when run as ``python -m pkg.train`` (``pdbg record -- -m``);
    ``start_iteration``: the first iteration's number (a resumed run's, from its checkpoint)."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [{"name": torch.cuda.get_device_name(i),
                 "sm_count": torch.cuda.get_device_properties(i).multi_processor_count}
                for i in range(torch.cuda.device_count())]
    if script is None:
        main = sys.modules.get("__main__")
        script = getattr(main, "__file__", None)
        spec = getattr(main, "__spec__", None)  # python -m pkg.train: a module of a package
        if main_module is None and isinstance(getattr(spec, "name", None), str) and getattr(spec, "parent", None):
            main_module = spec.name
    return {
        "started": datetime.fromtimestamp(started, UTC).isoformat(), "started_unix": started,
        "mode": mode, "every": every, "argv": list(sys.argv), "cwd": os.getcwd(),
        "script": os.path.abspath(script) if script else None,
        "python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
        "platform": platform.platform(), "machine": platform.machine(), "hostname": socket.gethostname(),
        "pid": os.getpid(), "cuda": cuda, "torch_cuda": torch.version.cuda,
        "cpu_capability": snapshot.settings()["cpu_capability"], "git": _git_commit(script),
        "main_module": main_module, "start_iteration": start_iteration, "notebook": _notebook(),
    }


def _notebook() -> str | None:
    """The notebook this process runs, when it is a Jupyter kernel: its path as the kernel knows it (Jupyter's
    ``JPY_SESSION_NAME``, which ipykernel passes on as ``__session__``; VS Code's ``__vsc_ipynb_file__``), ""
    for a kernel that does not say, None outside one. Its ``argv`` is only ipykernel's launcher and the kernel's
    connection file, which tell a reader of the recording nothing."""
    try:
        shell = ipython_shell()
        if shell is None or getattr(shell, "kernel", None) is None:  # (a terminal IPython has no kernel)
            return None
        names = getattr(shell, "user_ns", None) or {}
        for found in (names.get("__vsc_ipynb_file__"), names.get("__session__"), os.environ.get("JPY_SESSION_NAME")):
            if isinstance(found, str) and found:
                return found
        return ""
    except Exception:  # telling the notebook must never stop a recording
        return None


def _git_commit(script: str | None) -> dict[str, Any] | None:
    """Commit and dirtiness of the repository holding the user's script (or the cwd), if any."""
    return _git_commit_in(os.path.dirname(os.path.abspath(script)) if script else os.getcwd())


@functools.lru_cache(maxsize=4)
def _git_commit_in(where: str) -> dict[str, Any] | None:
    # Cached: one process records from one checkout, and each git call costs a process start.
    return git_state(where)


def git_state(where: str) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git repository holding directory ``where`` (tracked files
    changed and not committed: dirty), or None outside one (or without git)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=where, capture_output=True,
                              text=True, timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], check=False, cwd=where,
                               capture_output=True, text=True, timeout=5)
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


class _BackwardCalls:
    """A backward pass that raises (anomaly mode's "returned nan values", an autograd Function's own
    error), caught by the training loop, which goes on within the same iteration (it skips the batch):
    autograd never calls back at the end of such a pass, so its steps would stay open, and the next
    pass's gradients would go into them. Autograd's entry into its engine (behind ``Tensor.backward``,
    ``torch.autograd.backward`` and ``torch.autograd.grad``) is wrapped while recording: an exception
    leaving its outermost call on a thread ends the open pass there, its steps written with what they
    captured and the exception given to the step whose backward was under way. Each pass's roots go to
    the session (Session.pass_began), which tells by them whether a pass went through a call's graph.
    ``remove()`` (at close, with the other hooks) puts the original back. ``passes`` counts the
    outermost calls (see Run._warn_uncounted)."""

    def __init__(self, session: capture.Session) -> None:
        self.passes = 0
        # a pass that raised where no recorded step's backward was under way (anomaly mode stopping in the
        # loss's backward, the loop catching it): the run's ``final.backward_raised`` (docs/FORMAT.md)
        self.raised_outside: dict[str, Any] | None = None
        names = ("_engine_run_backward",) if hasattr(torch.autograd, "_engine_run_backward") else ("backward", "grad")
        self._originals = {name: getattr(torch.autograd, name) for name in names}
        self._wrappers = {name: self._wrap(session, fn) for name, fn in self._originals.items()}
        for name, wrapper in self._wrappers.items():
            setattr(torch.autograd, name, wrapper)

    def _wrap(self, session: capture.Session, original: Callable[..., Any]) -> Callable[..., Any]:
        depth = threading.local()  # a pass inside a pass (reentrant checkpointing) is the outer one's

        @functools.wraps(original)
        def run_backward(*args: Any, **kwargs: Any) -> Any:
            depth.n = getattr(depth, "n", 0) + 1
            if depth.n == 1:
                self.passes += 1
            began = session.pass_began(args[0] if args else _roots_given(kwargs))
            try:
                return original(*args, **kwargs)
            except BaseException as exc:
                if depth.n == 1 and session.enabled and not session.closed:
                    try:
                        if isinstance(exc, Exception) and not session.backward_running():
                            self._outside(session, exc)
                        session._end_of_backward(aborted=True, exception=exc)
                    except Exception as failure:  # the training's own exception goes on, whatever happened here
                        session.fail("ending a backward pass that raised", failure)
                raise
            finally:
                session.pass_ended(began)
                depth.n -= 1
        return run_backward

    def _outside(self, session: capture.Session, exc: Exception) -> None:
        if self.raised_outside is None:
            self.raised_outside = {"count": 0, "iteration": session.iteration,
                                   "exception": jsonval.encode(capture.exception_doc(exc))}
        self.raised_outside["count"] += 1

    def remove(self) -> None:
        for name, original in self._originals.items():
            if getattr(torch.autograd, name) is self._wrappers[name]:  # else wrapped again since: leave it
                setattr(torch.autograd, name, original)


def _roots_given(kwargs: dict[str, Any]) -> Any:
    """The tensors a backward pass begins at, given by keyword (``torch.autograd.backward(tensors=...)``)."""
    return next((kwargs[k] for k in ("t_outputs", "tensors", "outputs") if k in kwargs), None)


class _UncountedSteps:
    """Without an optimizer given to ``record()`` nothing ends an iteration: the ``torch.optim`` steps
    that ran anyway (counted by a global step hook), for the warning at close that every step is in
    one iteration (``Run._warn_uncounted``)."""

    def __init__(self, session: capture.Session) -> None:
        self._session = session
        self.steps = 0
        self.name = ""  # the class of the first optimizer that stepped
        self.steps_before = 0  # steps started before its first step: those are in the right iteration
        self._handle = optimizer_mod.register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if compiled.tracing():  # a compiled optimizer step (recorder.compiled)
            compiled.eagerly(self._stepped, optimizer)
            return
        if not self.steps:
            self.name, self.steps_before = type(optimizer).__name__, self._session.next_index
        self.steps += 1

    def remove(self) -> None:
        self._handle.remove()


class _OptimizerSteps:
    """Which optimizer's ``step()`` ends an iteration, while recording: global optimizer step hooks,
    which ``remove()`` takes out at close with the other hooks.

    The optimizer given to ``record()`` counts, or with ``"auto"`` the first one that steps. Another
    optimizer's step ends no iteration (a GAN's second optimizer, over other parameters), unless it
    steps parameters the counted one stepped: then it has replaced it (a checkpoint loaded into a new
    optimizer, one made again after a NaN or after unfreezing layers; the old one never steps
    again), and counts from its first step on; ``takeovers`` lists where, for the run's final
    metadata. Parameters are known by weak references, which an address reused by a new tensor
    cannot match. No step replaces the counted one that runs inside another optimizer's step (the
    base optimizer of SAM or ZeroRedundancyOptimizer) or that ran the counted one's step inside its
    own (their wrapper). When the replaced optimizer steps again right after its replacement's
    first step, the two step shared parameters together rather than one after the other: the first
    counts again, no replacement is followed any more, and a RecorderWarning says that the
    replacement's first step started an extra iteration."""

    def __init__(self, run: Run, optimizer: torch.optim.Optimizer | str) -> None:
        self._run = run
        self._counted: weakref.ref[torch.optim.Optimizer] | None = None
        self._params: dict[int, weakref.ref[torch.Tensor]] = {}  # the counted one's, as of its last step
        self._n_params = -1
        self._previous: weakref.ref[torch.optim.Optimizer] | None = None  # the one the counted one replaced
        self._since_takeover = 0  # the counted one's steps since it replaced _previous
        self._follow = True
        self._began: dict[int, int] = {}  # id of an optimizer whose step is running: counted steps before it
        self.steps = 0  # steps that ended an iteration
        self.any_step = False
        self.counting = ""  # the class of the one that counts (the one given, or the first to step)
        self.takeovers: list[tuple[int, str]] = []  # (the iteration its first step ended, class), the first 64
        self.takeover_count = 0
        self.others_since = 0  # steps of optimizers that count nothing since the counted one's last step
        self.other_name = ""
        if optimizer != "auto":
            self._take(optimizer)  # type: ignore[arg-type]
        self._handles = [optimizer_mod.register_optimizer_step_pre_hook(self._step_begins),
                         optimizer_mod.register_optimizer_step_post_hook(self._step_ended)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _take(self, optimizer: torch.optim.Optimizer) -> None:
        self._counted = weakref.ref(optimizer)
        self.counting = type(optimizer).__name__
        self._n_params = -1
        self._know_params(optimizer)

    def _know_params(self, optimizer: torch.optim.Optimizer) -> None:
        """The counted optimizer's parameters, again when their number changed (``add_param_group``)."""
        n = sum(len(group["params"]) for group in optimizer.param_groups)
        if n != self._n_params:
            self._n_params = n
            self._params = {id(p): weakref.ref(p) for group in optimizer.param_groups for p in group["params"]}

    def _shares_params(self, optimizer: torch.optim.Optimizer) -> bool:
        known = self._params
        for group in optimizer.param_groups:
            for p in group["params"]:
                ref = known.get(id(p))
                if ref is not None and ref() is p:
                    return True
        return False

    def _step_begins(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if compiled.tracing():  # a compiled optimizer step (recorder.compiled)
            compiled.eagerly(self._step_begins, optimizer)
            return
        self._began[id(optimizer)] = self.steps

    def _step_ended(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._run._stepped = id(optimizer)
        if compiled.tracing():
            compiled.eagerly(self._step_ended, optimizer)
            return
        self.stepped(optimizer, wrapped=self._began.pop(id(optimizer), self.steps) != self.steps)

    def stepped(self, optimizer: torch.optim.Optimizer, *, hooked: bool = True, wrapped: bool = False) -> None:
        """``optimizer`` stepped (``hooked``), or GradScaler skipped its step; ``wrapped``: the counted
        optimizer stepped inside its step."""
        self.any_step = True
        counted = self._counted() if self._counted is not None else None
        if optimizer is not counted:
            if self._counted is None:  # "auto": the first one to step counts
                self._take(optimizer)
            elif not self._replaces(optimizer, hooked, wrapped):
                self.others_since += 1
                self.other_name = type(optimizer).__name__
                return
        else:
            self._know_params(optimizer)
            self._since_takeover += 1
        self.steps += 1
        self.others_since = 0
        self._run.next_iteration()

    def _replaces(self, optimizer: torch.optim.Optimizer, hooked: bool, wrapped: bool) -> bool:
        """Whether ``optimizer``, not the counted one, takes over counting (see the class)."""
        inside = _inside_another_step() if hooked else any(k != id(optimizer) for k in self._began)
        if not self._follow or wrapped or inside or not self._shares_params(optimizer):
            return False  # (a skip GradScaler made inside the counted optimizer's step: accelerate's wrapper)
        previous = self._previous() if self._previous is not None else None
        counted = self._counted() if self._counted is not None else None
        if optimizer is previous and self._since_takeover == 1 and counted is not None:
            self._follow = False
            self.takeover_count -= 1
            ended = self.takeovers.pop()[0] if len(self.takeovers) > self.takeover_count else None
            self._take(optimizer)
            ours, theirs = type(optimizer).__name__, type(counted).__name__
            both = f"two {ours} optimizers" if ours == theirs else f"{ours} and {theirs}"
            at = f"iteration {ended}" if ended is not None else "an iteration"
            capture.warn(f"{both} step parameters they share: iterations follow the steps of the one that stepped "
                         f"first only; the other's first step, taken for a new optimizer replacing it (a resumed "
                         f"optimizer), ended {at} early, and later iterations are numbered one higher",
                         stacklevel=capture._outside_recorder())
            return True
        self._previous = self._counted
        self._since_takeover = 1  # its first step, which it is taking
        self._take(optimizer)
        if len(self.takeovers) < 64:
            self.takeovers.append((self._run.session.iteration, type(optimizer).__name__))
        self.takeover_count += 1
        return True

    def takeovers_doc(self) -> dict[str, Any]:
        """The run's ``final.optimizer_replaced`` (docs/FORMAT.md)."""
        return {"count": self.takeover_count, "iterations": [it for it, _ in self.takeovers],
                "optimizers": [name for _, name in self.takeovers]}


def _step_code() -> Any:
    """The code of the wrapper torch runs each optimizer's ``step()`` in (its hooks' caller), or None."""
    try:
        return optimizer_mod.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__
    except Exception:  # noqa: BLE001 - another torch: no step is then taken for an inner one
        return None


_STEP_CODE = _step_code()


def _inside_another_step() -> bool:
    """Whether the optimizer step whose post hook runs now was called inside another optimizer's step."""
    frame, seen = sys._getframe(1), 0
    while frame is not None:
        if frame.f_code is _STEP_CODE:
            seen += 1
            if seen == 2:
                return True
        frame = frame.f_back
    return False


def _skipped_inside(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s own step, just run by ``scaler.step``, skipped its update: an optimizer that
    handles loss scaling itself (``_step_supports_amp_scaling``: every ``fused=True`` one) is called even
    when the scaler found Inf or NaN, is given that finding, and skips the update in its kernel, its step
    hooks running as for a step taken."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False) or not scaler.is_enabled():
        return False
    try:
        found = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device") or {}
        return any(bool(t.item()) for t in found.values())
    except Exception:  # noqa: BLE001 - another torch's GradScaler: taken for a step taken, as before
        return False


class _GradScaling:
    """Mixed precision's loss scaling (``torch.amp.GradScaler``), while recording.

    ``scale(loss)`` marks the iteration's loss as scaled: Inf or NaN in its gradients may be an
    overflow of the scaled loss, which ``step(optimizer)`` handles by skipping ``optimizer.step()``
    and ``update()`` by lowering the scale. So the ``stop``/``pdb`` action of a non-finite backward
    step waits for ``step``: an overflow the scaler skips at a scale above 1 is no anomaly (the step
    stays ``nonfinite`` in the recording, and flight mode has written its ring); at a scale of 1 or
    less the gradients are non-finite unamplified, and the action is taken there, in
    ``scaler.step``. A skipped ``optimizer.step()`` runs no optimizer hook, yet ends the iteration:
    ``Run._skipped_step`` ends it and lists it. ``remove()`` (at close, with the other hooks) puts
    the originals back."""

    def __init__(self, run: Run) -> None:
        self._originals = {"scale": GradScaler.scale, "step": GradScaler.step}
        scale_loss, step_optimizer = GradScaler.scale, GradScaler.step

        @functools.wraps(scale_loss)
        def scale(scaler: GradScaler, outputs: Any) -> Any:
            if scaler.is_enabled():
                run.session.loss_scaled = True
            return scale_loss(scaler, outputs)

        @functools.wraps(step_optimizer)
        def step(scaler: GradScaler, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            run._stepped = None
            began = run.session.iteration
            result = step_optimizer(scaler, optimizer, *args, **kwargs)
            inside = run._stepped is not None and _skipped_inside(scaler, optimizer)
            skipped = (run._stepped is None or inside) and scaler.is_enabled()
            deferred, run.session.deferred = run.session.deferred, None
            if skipped and not run.closed:
                try:
                    run._skipped_step(optimizer, float(scaler.get_scale()), began if inside else None)
                except Exception as exc:
                    run.session.fail("counting an optimizer step that GradScaler skipped", exc)
            if deferred is not None:
                at = float(scaler.get_scale())
                if skipped and at > 1.0:
                    run.session.monitor.rearm()  # an overflow the scaler handled: the next one may stop
                else:
                    run.session.perform(monitors.Pending(deferred.action, f"{deferred.message} (GradScaler "
                                                      f"{'skipped' if skipped else 'took'} the optimizer step at "
                                                      f"loss scale {at:g})", deferred.error), run.flush)
            return result

        self._wrappers = {"scale": scale, "step": step}
        GradScaler.scale, GradScaler.step = scale, step  # type: ignore[method-assign]

    def remove(self) -> None:
        for name, original in self._originals.items():
            if getattr(GradScaler, name) is self._wrappers[name]:  # else wrapped again since: leave it
                setattr(GradScaler, name, original)

