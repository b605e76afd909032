"""``pdbg record --mode flight``: the script runs in a child process; this parent outlives it.

The flight ring holds the payloads of the last ``keep`` iterations in memory until something worth
keeping happens. A hard crash (a segfault or ``abort()`` in native code, the OOM killer's SIGKILL)
gives no chance to write them, and in one process the ring dies with it. So the parent makes the
ring's memory (recorder.shmring), runs ``recorder.runner.run_script`` in a child that holds the ring
there, forwards SIGINT, SIGTERM and SIGHUP to it (each once: see ``_forwarding``), and waits. A
child that dies without closing its recording leaves the ring readable to the parent, which writes
out what committed records wait for and closes the run ``crashed`` (recorder.recover). The child
gets its options as JSON in an environment variable and answers with one JSON line on a pipe: no
pickle either way.

Exit status: the child's; a child killed by signal N gives 128 + N, as a shell does.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import collectives, recover, runner, shmring
from .capture import warn
from .errors import PdbgError, RecordingError
from .store import backend

CHILD_ENV = "PDBG_RECORD_CHILD"  # the child's options (JSON); removed from its environment at once
_FORWARDED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


def available(out: Any) -> bool:
    """Whether a recording to ``out`` can run in a child with a shared ring (a local directory, POSIX)."""
    return os.name == "posix" and isinstance(out, (str, os.PathLike)) and not backend.is_url(out)


def run_script_in_child(script: str | os.PathLike[str], args: list[str], out: str | os.PathLike[str],
                        **options: Any) -> runner.ScriptResult:
    """``runner.run_script(script, args, out, mode="flight", **options)`` in a child process whose
    flight ring lives in shared memory; after a hard crash of the child, the ring is written out.

    Args:
        script, args, out: as for ``runner.run_script``.
        options: ``recorder.record``'s options as plain JSON values (``keep``, ``max_ring_bytes``,
            ``modules``, ``on_anomaly``...).

    Falls back to ``runner.run_script`` in this process, with one warning, when no shared memory can
    be had. Raises RecordingError for a missing script, an unusable output or options the recording
    refuses, before or without recording anything."""
    runner.script_target(script, args)
    runner.check_output(out)
    try:
        ring = shmring.create(options.get("max_ring_bytes", 4 << 30))
    except (OSError, ValueError) as exc:
        warn(f"no shared memory for the flight ring ({type(exc).__name__}: {exc}); it stays in the "
             "recording process's memory, and a hard crash (segfault, abort, the OOM killer) loses its "
             "payloads", stacklevel=2)
        return runner.run_script(script, args, out, mode="flight", **options)
    try:
        return _supervise(script, args, out, options, ring)
    finally:
        ring.close()  # the memory goes with the last descriptor: it has no name anywhere


def _supervise(script: Any, args: list[str], out: Any, options: dict[str, Any],
               ring: shmring.RingFile) -> runner.ScriptResult:
    read_end, write_end = os.pipe()
    wake_read, wake_write = _wakeup_pipe()
    try:
        spec = {"script": os.fspath(script), "args": list(args), "out": os.fspath(out),
                "options": {**options, "mode": "flight"}, "ring_fd": ring.fd, "result_fd": write_end,
                "wakeup_fd": wake_write, "pythonpath": os.environ.get("PYTHONPATH")}
        try:
            encoded = json.dumps(spec, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise RecordingError(f"cannot pass the recording options to the recording process ({exc}); give "
                                 "plain values") from None
        with _forwarding(wake_read) as started:
            fds = (ring.fd, write_end) if wake_write is None else (ring.fd, write_end, wake_write)
            proc = subprocess.Popen(_child_command(), env=_child_env(encoded), pass_fds=fds)
            os.close(write_end)
            write_end = -1
            if wake_write is not None:
                os.close(wake_write)
                wake_write = None
            started(proc)
            code = proc.wait()
        report = _read_report(read_end)
    finally:
        os.close(read_end)
        for fd in (write_end if write_end >= 0 else None, wake_read, wake_write):
            if fd is not None:
                os.close(fd)
    if "error" in report:  # the child refused the options: nothing was recorded
        raise RecordingError(str(report["error"]))
    return _outcome(out, code, report, ring)


def _outcome(out: Any, code: int, report: dict[str, Any], ring: shmring.RingFile) -> runner.ScriptResult:
    """The child's result; after a death without closing the recording, the ring written out first."""
    died = f"signal {signal.Signals(-code).name}" if code < 0 else None
    exit_code = 128 - code if code < 0 else code
    rank = collectives.identity()["rank"]  # the child's too: it inherited the launcher's environment
    manifest = recover.committed(out, rank) or {}
    status = manifest.get("status", "recording") if manifest else None
    recovered = None
    failure = report.get("failure") if isinstance(report.get("failure"), str) else None
    ended = "status" in report  # the child ran to its end and said how: it did not die
    if status == "recording":
        why = died or (f"the recording could not be closed: {failure}" if ended and failure else
                       f"exit status {code} before the recording was closed")
        try:
            recovered = recover.recover(out, ring, why, rank)
            status = "crashed"
        except Exception as exc:  # the committed steps stay readable; the run reads as crashed anyway
            when = "the script ended" if ended else "the script's process died"
            warn(f"could not write out the flight ring after {when} ({why}): "
                 f"{type(exc).__name__}: {exc}; the steps it committed are readable without it", stacklevel=3)
        died = None if ended else why
    steps = report.get("steps")
    if not isinstance(steps, int):  # died: the steps it committed
        lengths = (recover.committed(out, rank) or {}).get("ranks", {}).get(str(rank), {})
        steps = lengths.get("steps", 0) if isinstance(lengths, dict) else 0
    return runner.ScriptResult(exit_code, str(report.get("status") or status or "crashed"), steps,
                               exception_name=report.get("exception"), died=died, ring_recovered=recovered,
                               failure=failure, modules_called=report.get("modules_called")
                               if isinstance(report.get("modules_called"), int) else None,
                               steps_defined=_names(report.get("steps_defined")))


def _names(value: Any) -> tuple[str, ...]:
    """The child's list of paper step names, or none where the report holds something else."""
    return tuple(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else ()


def _child_command() -> list[str]:
    # The interpreter's own flags (-X, -W, -O...) carry over, as multiprocessing does for its children.
    flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    return [sys.executable, *flags, "-m", "recorder.supervise"]


def _child_env(encoded: str) -> dict[str, str]:
    """This environment, plus the child's options and a path to this package (taken out again by the
    child, so the script sees the environment it would have seen)."""
    env = dict(os.environ)
    env[CHILD_ENV] = encoded
    package_root = str(Path(__file__).resolve().parents[1])
    if not package_root.endswith(("site-packages", "dist-packages")):  # installed: found there anyway
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), package_root) if p)
    return env


def _read_report(fd: int) -> dict[str, Any]:
    """The child's JSON line, or {} when it died before writing it. Not blocking: processes the
    script forked may still hold the pipe open."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            data += chunk
    try:
        report = json.loads(data.decode()) if data else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return report if isinstance(report, dict) else {}


def _wakeup_pipe() -> tuple[int | None, int | None]:
    """A pipe whose write end (non-blocking) becomes the child's wakeup fd; (None, None) without one."""
    try:
        read_end, write_end = os.pipe()
    except OSError:
        return None, None
    os.set_blocking(write_end, False)
    return read_end, write_end


@contextlib.contextmanager
def _forwarding(wakeup: int | None = None) -> Iterator[Any]:
    """SIGINT, SIGTERM and SIGHUP go to the child (once started) instead of ending this process, except one
    that is ignored (the child inherits that); the previous handlers come back on exit. A signal the child
    got itself as well is not sent a second time (a script's handler may count them: a second SIGTERM is
    often "exit now, no checkpoint"): a Ctrl-C at the terminal (it is in the terminal's foreground
    process group with us), and any signal to the
    process group (a scheduler's cancel or time limit), which the child reports on ``wakeup``, the
    read end of its wakeup fd (``_ChildSignals``). Without it, or once the script has made another fd
    its wakeup fd (asyncio does), each signal is forwarded."""
    box: list[Any] = [None]
    pending: list[int] = []
    queue: list[int] = []  # signals being handled: one that comes meanwhile waits for the one under way
    child: _ChildSignals | None = None

    def handle(signum: int) -> None:
        proc = box[0]
        if signum == signal.SIGINT and _terminal_group_signalled():
            return
        if child is not None and child.got_it_too(signum):
            return
        if child is not None:
            child.forwarding(signum)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    def forward(signum: int, frame: Any) -> None:
        if box[0] is None:
            pending.append(signum)
            return
        queue.append(signum)
        if len(queue) > 1:  # (this handler interrupted itself: the outer call handles it next)
            return
        while queue:
            try:
                handle(queue[0])
            finally:
                queue.pop(0)

    def started(proc: Any) -> None:
        box[0] = proc
        for signum in pending:
            forward(signum, None)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield started
        return
    if wakeup is not None:
        with contextlib.suppress(OSError, RuntimeError):  # (no pipe or thread to be had: forward each one)
            child = _ChildSignals(wakeup)
    # A signal ignored when pdbg started (SIGHUP under nohup, SIGINT in a shell script's background job) stays
    # ignored here and so in the child, which inherits it through exec only as ignored: forwarding it, or
    # starting the child with a handler set in its place, ended a run that `python script.py` trains on through.
    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        yield started
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child is not None:
            child.close()


class _ChildSignals:
    """The signals the child received, read from its wakeup fd: the child makes the write end of our
    pipe its ``signal.set_wakeup_fd``, and CPython writes there the number of each signal it receives
    for which a Python handler is installed (flight mode's recording installs them), whatever that
    handler is, from its C-level handler, at once. A thread here reads them as they come, and when
    this process gets a signal, ``got_it_too`` tells whether the child got the same one at about
    the same time, apart from the copies this process forwarded (``forwarding``)."""

    WINDOW = 1.0  # seconds: a signal the child got longer ago than this was another one
    WAIT = 0.2  # seconds to wait for the child's report of a signal sent to the group, when it has not come yet

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._stop_read, self._stop_write = os.pipe()
        self._cond = threading.Condition(threading.RLock())
        self._came: list[tuple[float, int]] = []  # (when read, signal number), not yet matched
        self._sent: list[tuple[float, int]] = []  # (when sent, signal number): forwarded, its report not yet read
        self._thread = threading.Thread(target=self._read, name="pdbg-child-signals", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        poll = select.poll()
        poll.register(self._fd, select.POLLIN)
        poll.register(self._stop_read, select.POLLIN)
        while True:
            ready = [fd for fd, _ in poll.poll()]
            if self._stop_read in ready:
                return
            try:
                data = os.read(self._fd, 512)
            except OSError:
                return
            if not data:  # every write end closed: the child and what it forked are gone
                return
            now = time.monotonic()
            with self._cond:  # (only those forwarded, and only recent ones: a script's SIGALRM may come often)
                self._came = [(t, s) for t, s in self._came if now - t <= self.WINDOW]
                self._came.extend((now, signum) for signum in data if signum in _FORWARDED)
                self._cond.notify_all()

    def forwarding(self, signum: int) -> None:
        """This process is about to send the child ``signum``: its report is not a signal of the child's own."""
        with self._cond:
            self._sent.append((time.monotonic(), signum))

    def got_it_too(self, signum: int) -> bool:
        """Whether the child got ``signum`` itself (sent to the whole process group), waiting up to
        ``WAIT`` seconds for its report; each report answers once."""
        deadline = time.monotonic() + self.WAIT
        with self._cond:
            while True:
                now = time.monotonic()
                self._match(now)
                for k, (_, got) in enumerate(self._came):
                    if got == signum:
                        del self._came[k]
                        return True
                if now >= deadline:
                    return False
                self._cond.wait(deadline - now)

    def _match(self, now: float) -> None:
        """Forget reports and forwarded copies older than ``WINDOW``; take out the reports of the copies
        this process forwarded."""
        self._came = [(t, s) for t, s in self._came if now - t <= self.WINDOW]
        sent, self._sent = self._sent, []
        for when, signum in sent:
            echo = next((k for k, (t, s) in enumerate(self._came) if s == signum and t >= when), None)
            if echo is not None:
                del self._came[echo]
            elif now - when <= self.WINDOW:  # not reported yet (or never: no Python handler for it then)
                self._sent.append((when, signum))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_write, b"x")
        self._thread.join()
        os.close(self._stop_read)
        os.close(self._stop_write)


def _terminal_group_signalled() -> bool:
    """Whether this process is in its terminal's foreground process group (so a SIGINT is most likely
    the terminal's, sent to the child as well)."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
    return False


# -- the child ------------------------------------------------------------------------------------------
def child_main() -> int:
    """Run the script as ``runner.run_script`` does, the ring in the parent's shared memory; report
    to the parent on the result pipe."""
    spec = json.loads(os.environ.pop(CHILD_ENV))
    if spec.get("pythonpath") is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = spec["pythonpath"]
    result_fd = int(spec["result_fd"])
    os.set_inheritable(result_fd, False)
    _report_signals(spec.get("wakeup_fd"))
    with runner.warnings_as_lines():
        shared = _map_ring(int(spec["ring_fd"]))
        try:
            result = runner.run_script(spec["script"], spec["args"], spec["out"], shared_ring=shared,
                                       **spec["options"])
        except PdbgError as exc:
            _report(result_fd, {"error": str(exc)})
            return exc.exit_code
    sys.stdout.flush()
    if result.traceback_text:
        sys.stderr.write(result.traceback_text)
    _report(result_fd, {"exit_code": result.exit_code, "status": result.status, "steps": result.steps,
                        "exception": result.exception_name, "failure": result.failure,
                        "modules_called": result.modules_called, "steps_defined": list(result.steps_defined)})
    return result.exit_code


def _report_signals(fd: Any) -> None:
    """Make ``fd`` this process's wakeup fd: the parent reads there which signals this process got,
    so as not to send a second copy of one sent to the whole process group (see ``_forwarding``)."""
    if not isinstance(fd, int):
        return
    try:
        os.set_inheritable(fd, False)  # (a forked DataLoader worker keeps it, and reports there too)
        signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    except (OSError, ValueError):  # the parent forwards every signal, as without it
        with contextlib.suppress(OSError):
            os.close(fd)


def _map_ring(fd: int) -> shmring.SharedRing | None:
    try:
        return shmring.SharedRing(fd)
    except (OSError, ValueError) as exc:
        warn(f"could not map the flight ring's shared memory ({type(exc).__name__}: {exc}); it stays in "
             "this process's memory, and a hard crash loses its payloads", stacklevel=2)
        return None
    finally:
        os.close(fd)  # the mapping stays; the script's own children need not hold the memory


def _report(fd: int, report: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, json.dumps(report).encode())
        os.close(fd)


if __name__ == "__main__":
    sys.exit(child_main())
