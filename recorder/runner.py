"""Record an unmodified script: run it as ``__main__`` with a recording around it (``pdbg record``).

The script sees what ``python script.py ARGS`` would give it: ``sys.argv`` is ``[script, *ARGS]``,
``sys.path[0]`` is the script's directory, ``__name__`` is ``"__main__"``. Iterations advance on the
steps of the first optimizer that steps, or of one that replaces it (global optimizer hooks). The
recording is closed before this returns: ``complete`` when the script ends normally (or exits with
status 0), ``crashed`` when it raises or exits with another status; the exception is recorded on the
innermost step it escaped.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import shutil
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import collectives, skeleton
from .errors import AlreadyRecording, RecordingError
from .store import backend


@dataclass
class ScriptResult:
    """How a recorded script ended."""

    exit_code: int
    status: str  # the recording's status: "complete", "crashed" or "incomplete" (recording stopped early)
    steps: int  # steps started
    exception: BaseException | None = None  # the exception that escaped the script, if any
    traceback_text: str = ""  # printed as Python would print it (frames of the runner left out)
    exception_name: str | None = None  # its type's name (also when it escaped in a child process)
    died: str | None = None  # the script's process ended without closing the recording: why ("signal SIGABRT")
    ring_recovered: dict[str, Any] | None = None  # flight mode: what the parent wrote out of the shared ring
    failure: str | None = None  # why recording stopped early (status "incomplete"): a full disk, a failed writer
    modules_called: int | None = None  # distinct module paths the script called (None: not known)
    steps_defined: tuple[str, ...] = ()  # the paper steps the script's top level defines (functions, classes)


def check_output(out: str | os.PathLike[str]) -> Path:
    """Refuse an output path that exists with contents, or whose parent cannot be written. The ranks
    of a distributed run (torchrun's RANK and WORLD_SIZE) share one path: each needs its own group free."""
    from .run import EMPTY_PATH, check_free

    if not os.fspath(out):
        raise RecordingError(EMPTY_PATH)
    path = Path(out)
    check_free(path, collectives.identity())
    parent = path.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise RecordingError(f"cannot create {path}: {parent} is a file, not a directory; choose another output path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RecordingError(f"cannot create {path}: {parent} is not writable; choose another output path")
    return path


def script_target(script: str | os.PathLike[str], args: list[str]) -> tuple[Path, str | None, list[str]]:
    """What to run: the script's file, the module it runs as (``-m MODULE``: ``script`` "-m", the
    module the first of ``args``, found as ``python -m`` would; else None) and its arguments."""
    if os.fspath(script) == "-m":
        return module_target(args)
    return check_script(script), None, args


def check_script(script: str | os.PathLike[str]) -> Path:
    path = Path(script)
    if not path.exists():
        raise RecordingError(f"{script}: no such file; give the path of the Python script to record")
    if not path.is_file():
        raise RecordingError(f"{script} is not a file; give the path of the Python script to record")
    return path


def module_target(args: list[str]) -> tuple[Path, str, list[str]]:
    """``-m MODULE ARGS...``: the module's file, its name and its arguments; a RecordingError when
    there is no such module, or it cannot be run (a package without ``__main__``, a built-in)."""
    import importlib.util

    if not args or not args[0] or args[0].startswith("-"):
        raise RecordingError("-m needs a module name, e.g. pdbg record -o run.zarr -- -m mypkg.train")
    name = args[0]
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())  # as python -m: the working directory first
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError) as exc:
        raise RecordingError(f"-m {name}: {type(exc).__name__}: {exc}") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    if spec is None or not isinstance(spec.origin, str) or not os.path.isfile(spec.origin):
        raise RecordingError(f"-m {name}: no module named {name} that can be run (from {os.getcwd()}, its "
                             "installed packages and PYTHONPATH); check the name, or set PYTHONPATH (src/ layout)")
    return Path(spec.origin), name, args[1:]


def run_script(script: str | os.PathLike[str], args: list[str], out: str | os.PathLike[str], *,
               mode: str = "full", modules: list[str] | None = None, every: int = 1, shared_ring: Any = None,
               on_signal_end: Callable[[int], Any] | None = None, **options: Any) -> ScriptResult:
    """Run ``script`` with ``args`` as ``__main__`` while recording into ``out``, in this process
    (``recorder.supervise.run_script_in_child`` runs this in a child process).

    Args:
        script: the training script.
        args: its command-line arguments.
        out: the new recording's directory.
        mode, modules, every, options: as for ``recorder.record``.
        shared_ring: flight mode: a recorder.shmring.SharedRing to hold the ring's bytes in.
        on_signal_end: called with the signal's number where a signal that ends the process (SIGTERM,
            SIGHUP) closed the recording, just before the process ends of it: this function does not return then.

    Raises RecordingError (before anything runs or is created) for a missing script, an existing or
    unwritable output, or bad options.
    """
    from .run import Run, wait_for_program_threads

    script_path, module, args = script_target(script, args)  # (-m MODULE: run as that module, in its package)
    remote = backend.is_url(out)  # s3://...: checked when the run opens it (credentials, bucket)
    out_path: Any = out if remote else check_output(out)
    # Left behind when nothing could be recorded, unless other ranks of the run may be writing there.
    created = not remote and not out_path.exists() and collectives.identity()["world_size"] == 1
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    script_dir = os.getcwd() if module else str(script_path.resolve().parent)  # sys.path[0], as python sets it

    def restore() -> None:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0

    sys.argv = [str(script_path), *args]  # before the run starts, so its metadata holds the script's argv
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    try:
        run = Run(out_path, optimizer="auto", mode=mode, every=every, modules=modules,
                  script=str(script_path.resolve()), main_module=module, **options)
    except BaseException:
        restore()
        if created and Path(out_path).exists():
            shutil.rmtree(out_path, ignore_errors=True)  # nothing recorded: leave nothing behind
        raise
    run.on_signal_end = on_signal_end
    if shared_ring is not None:
        run.session.share_ring(shared_ring)
    code, error, exited, defined = 0, None, None, {}
    constructors = skeleton.InitCapture()  # every module class the script defines: its constructor arguments
    try:
        if module is not None:
            defined = runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            defined = runpy.run_path(str(script_path), run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
        exited = exc if code != 0 else None  # the recording says why it is crashed: SystemExit(3)
        defined = _top_level_globals(exc)
    except BaseException as exc:  # KeyboardInterrupt included: recorded, then reported as Python does
        code, error = (130 if isinstance(exc, KeyboardInterrupt) else 1), exc
        defined = _top_level_globals(exc)
    finally:
        try:  # the process ends when its last thread does, not the script's main code: a thread it left training
            if not isinstance(error, KeyboardInterrupt):
                wait_for_program_threads()
        except KeyboardInterrupt as exc:
            code, error = 130, exc
        status = "complete" if code == 0 and error is None else "crashed"
        try:
            run.close(status, error or exited)
        finally:
            constructors.close()
            restore()
    if isinstance(error, AlreadyRecording) and not run.steps and created:  # the script records itself
        shutil.rmtree(out_path, ignore_errors=True)  # nothing recorded: leave nothing behind
        raise RecordingError(f"{script_path} records itself (it calls recorder.record, a second recording in the "
                             "process pdbg record runs it in): run it with python, or take its record() out to "
                             "record it with pdbg record") from None
    text = _script_traceback(error, script_path) if error is not None else ""
    return ScriptResult(code, run.status or status, run.steps, error, text,
                        type(error).__name__ if error is not None else None, failure=run.failure,
                        modules_called=len(run.session.selector.paths) if run.session.autocapture is not None
                        else None, steps_defined=_paper_steps(defined))


def _top_level_globals(exc: BaseException) -> dict[str, Any]:
    """The globals of the script's top level that ``exc`` went through: runpy returns them only when the
    script ends normally, and one interrupted before its first step (a Ctrl-C while its data loads) was
    then said to mark no paper step."""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return dict(frame.f_globals)
        tb = tb.tb_next
    return {}


def _paper_steps(space: dict[str, Any]) -> tuple[str, ...]:
    """The names in a script's globals that are paper steps: a decorated function, or a class whose
    ``forward`` is one (so that a run which called none can say it marks some, only not here)."""
    names = []
    for name, value in space.items():
        try:
            marked = getattr(getattr(value, "forward", None) if isinstance(value, type) else value, "__pdbg_step__",
                             None) is not None
        except Exception:  # noqa: BLE001 - a global whose attribute lookup raises (a lazy proxy) is no step
            marked = False
        if marked:
            names.append(name)
    return tuple(names)


@contextlib.contextmanager
def warnings_as_lines() -> Iterator[None]:
    """Show RecorderWarnings as one ``pdbg: warning: ...`` line on stderr each (other warnings as
    Python would); restored on exit."""
    from .capture import RecorderWarning

    shown = warnings.showwarning

    def show(message: Any, category: type[Warning], *rest: Any, **kw: Any) -> None:
        if issubclass(category, RecorderWarning):
            print(f"pdbg: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, *rest, **kw)

    warnings.showwarning = show
    try:
        yield
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = shown


def _exit_code(code: Any) -> int:
    """The process exit status ``sys.exit(code)`` gives: None is 0, an int itself, anything else 1."""
    from .run import exit_status

    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    return exit_status(code)


def _script_traceback(exc: BaseException, script: Path) -> str:
    """The traceback Python would print for ``exc``, starting at the script's own frames. Where none of
    them is in it (the script does not compile: a SyntaxError), the frames of this runner and of runpy are
    left out too, as Python prints that error, so that it does not read as a failure of pdbg."""
    tb = exc.__traceback__
    target = str(script.resolve())
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    if tb is None:
        tb = exc.__traceback__
        while tb is not None and _runner_frame(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _runner_frame(filename: str) -> bool:
    """A frame of the machinery that runs the script: this module, runpy, importlib's bootstrap."""
    return filename in (__file__, runpy.__file__) or filename.startswith("<frozen ")
