"""pdbg record -o RUN [--mode M] [--keep N] [--modules GLOB ...] [--every K] [--on-anomaly A]
                   [--start-iteration N] -- script.py|-m MODULE [args]

Run an unmodified training script as `python script.py args` (or `python -m MODULE args`) would,
recording it (modes: full, stats,
flight; --keep N iterations in flight mode; --on-anomaly record, stop or pdb): decorated paper
steps, plus every module whose path matches a --modules glob (`blocks.*` is each block, `**.attn`
every attn, `**` every module). Iterations advance on the steps of the first optimizer that steps, or
of a new one over its parameters that replaces it (a resumed optimizer); the first is numbered 0, or
--start-iteration N (a run resumed from a checkpoint saved at step N: its iterations keep the run's numbers).
The script's stdout is left alone; pdbg's own lines go to stderr. Exits with the script's exit code.

In flight mode the script runs in a child process and the ring's bytes in shared memory, so that a
hard crash of the script (a segfault, abort(), the OOM killer) still writes them out: pdbg waits for
the child, forwards SIGINT, SIGTERM and SIGHUP to it (not a Ctrl-C or a signal to the process group, which
the script gets itself, nor one ignored when pdbg starts, SIGHUP under nohup, which stays ignored), and
when it dies without closing the recording, adds the payloads the ring held for the steps committed
before and marks the run crashed. A script killed by signal N exits 128+N, as in a shell. The other modes
run the script in pdbg's own process: a signal that ends it (SIGTERM, SIGHUP) closes the recording, pdbg
prints its last line, and the process dies of the signal.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from recorder.errors import RecordingError
from recorder.names import shown


def add_parser(sub: Any) -> None:
    doc = __doc__ or ""
    p = sub.add_parser("record", help="record an unmodified training script",
                       description=doc.split("\n\n", 1)[1], usage=doc.split("\n\n")[0])
    p.add_argument("-o", "--out", required=True, metavar="RUN", help="new directory for the recording")
    p.add_argument("--mode", choices=("full", "stats", "flight"), default="full",
                   help="full: every tensor's bytes (default); stats: statistics only; flight: statistics, and "
                        "the bytes of the last --keep iterations when a NaN, an exception or a signal comes")
    p.add_argument("--keep", type=int, default=None, metavar="N", help="flight mode: iterations held in memory (2)")
    p.add_argument("--modules", nargs="+", action="extend", default=[], metavar="GLOB",
                   help="also record the modules whose paths match (segment globs: * one, ** any)")
    p.add_argument("--every", type=int, default=None, metavar="K", help="full mode: bytes every K-th iteration")
    p.add_argument("--on-anomaly", choices=("record", "stop", "pdb"), default="record",
                   help="a step with NaN/Inf results: record it (default), stop (raise NonFiniteError), or pdb")
    p.add_argument("--start-iteration", type=int, default=0, metavar="N",
                   help="the first iteration's number (default 0): a resumed run's step from its checkpoint")
    p.add_argument("script", help="the training script (or -m, then the module to run as python -m does)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from recorder import supervise
    from recorder.runner import run_script

    if args.every is not None and args.every < 1:
        raise RecordingError(f"--every must be a positive integer, not {args.every}")
    if args.keep is not None and args.keep < 1:
        raise RecordingError(f"--keep must be a positive integer (iterations held in flight mode), not {args.keep}")
    if args.keep is not None and args.mode != "flight":
        raise RecordingError(f"--keep applies to --mode flight (the iterations its ring holds in memory); --mode "
                             f"{args.mode} has no ring: leave --keep out, or add --mode flight")
    if args.every not in (None, 1) and args.mode != "full":
        raise RecordingError(f"--every applies to --mode full (bytes every K-th iteration); --mode {args.mode} "
                             + ("keeps no bytes" if args.mode == "stats" else "keeps the bytes of the last --keep "
                                "iterations") + ": leave --every out, or use --mode full")
    if args.start_iteration < 0:
        raise RecordingError(f"--start-iteration must be an integer >= 0 (the first iteration's number: for a resumed "
                             f"run, the step its checkpoint was saved at), not {args.start_iteration}")
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    options: dict[str, Any] = {"modules": args.modules or None, "every": args.every or 1,
                               "on_anomaly": args.on_anomaly, "start_iteration": args.start_iteration}
    if args.keep is not None:
        options["keep"] = args.keep
    # (its warnings are pdbg: warning: lines, as every command's: tui.cli.main)
    if args.mode == "flight" and supervise.available(args.out):  # a child process; the ring outlives it
        result = supervise.run_script_in_child(args.script, script_args, args.out, **options)
    else:
        result = run_script(args.script, script_args, args.out, mode=args.mode,
                            on_signal_end=lambda signum: _said_dying(args.out, args.modules, signum), **options)
    sys.stdout.flush()
    if result.traceback_text:
        sys.stderr.write(result.traceback_text)
    print(f"pdbg: {_summary(args.out, result, args.modules)}", file=sys.stderr)
    return result.exit_code


def _said_dying(out: str, modules: list[str] | None, signum: int) -> None:
    """The last line of a script recorded in pdbg's own process that a signal ends (SIGTERM, a scheduler's
    cancel): said as the recording has closed, since the process then dies of the signal, as flight mode's
    parent says it of its child."""
    import signal

    from recorder.runner import ScriptResult

    sys.stdout.flush()
    ended = ScriptResult(128 + signum, "crashed", 0, died=f"signal {signal.Signals(signum).name}")
    print(f"pdbg: {_summary(out, ended, modules)}", file=sys.stderr, flush=True)


def _unwritten(on_disk: str) -> str:
    """Where the status the recording was closed with could not be written (a disk with no room left even for
    the manifest), its manifest still says ``recording`` with this process as its writer: it reads as
    ``crashed`` once pdbg has exited, as ``pdbg info`` will then say."""
    return "; that status could not be written: it reads as crashed once pdbg exits" if on_disk == "recording" else ""


def _summary(out: str, result: Any, modules: list[str] | None = None) -> str:
    """Where the recording is, and the step an exception escaped from (or why none was recorded)."""
    from recorder import collectives

    who = collectives.identity()  # under torchrun every rank prints this line: say whose it is
    rank = f"rank {who['rank']} of {who['world_size']}: " if who["world_size"] > 1 else ""
    steps, status, unwritten = result.steps, result.status, ""
    if result.status != "complete":  # what is on disk, not what was started (a full disk, a store deleted)
        try:
            from recorder.store.reader import RunReader

            part = RunReader(out).rank(who["rank"])
            steps, unwritten = len(part), _unwritten(part.status)
            status = part.status if not unwritten else status
        except Exception:  # noqa: BLE001 - gone, or unreadable: say so rather than a count
            why = (f"recording stopped: {result.failure}" if result.failure else
                   "it was deleted or damaged while recording")
            return f"{rank}no readable recording in {out} ({result.status}; {why})"
    text = f"{rank}recording in {out} ({status}, {steps} step{'s' if steps != 1 else ''}{unwritten})"
    died = result.died
    if result.failure:  # said in a warning when it happened, maybe thousands of lines above
        text += f"; recording stopped: {result.failure}"
    elif steps == 0 and isinstance(died, str) and died.startswith("signal ") and not result.modules_called:
        # (preempted while loading, say: naming modules would not have recorded anything either)
        text += f"; no step was recorded: the script was ended by {died.split()[1]} before it recorded anything"
        died = None
    elif steps == 0 and result.exception_name in ("SyntaxError", "IndentationError", "TabError"):
        # (whatever it marks or --modules names: it never got to run them)
        text += f"; no step was recorded: the script raised {result.exception_name} (above) before any step ran"
    elif steps == 0 and result.modules_called == 0 and result.exception_name is not None:
        text += f"; no step was recorded: the script raised {result.exception_name} before it called any module"
    elif steps == 0 and result.modules_called == 0:
        text += "; no step was recorded: the script called no module"
    elif steps == 0 and not modules and result.steps_defined and result.exception_name is not None:
        marked = ", ".join(result.steps_defined[:3]) + (", ..." if len(result.steps_defined) > 3 else "")
        text += (f"; no step was recorded: the script raised {result.exception_name} before it called its paper "
                 f"steps ({marked})")
    elif steps == 0 and not modules and result.steps_defined:
        marked = ", ".join(result.steps_defined[:3]) + (", ..." if len(result.steps_defined) > 3 else "")
        text += (f"; no step was recorded: the script marks paper steps ({marked}) but called none in this process; "
                 "where its training runs in processes it starts (torch.multiprocessing.spawn, a multiprocessing "
                 "Process), which pdbg record does not reach, record in each with recorder.record(PATH) (every rank "
                 "into the same path), or start the ranks with torchrun --no-python pdbg record")
    elif steps == 0:  # nothing marked, nothing named: what to record
        text += ("; no step was recorded: --modules matched no module (the warning above lists the paths called)"
                 if modules else "; no step was recorded: the script marks no paper step; name its modules with "
                 "--modules (module paths from the outermost module called: 'blocks.*', or '**' for every one)")
    if died is not None or result.ring_recovered is not None:
        return text + _death(result, died)
    if result.exception_name is None:
        return text
    try:
        import replayer
        from recorder.framework import open_command
        from replayer.bisect import stopped_step

        rec = replayer.open(out)
        failed = rec.steps.filter(status="exception")
        stopped = stopped_step(rec)  # raised as the step with the NaN (or the breakpoint) returns, not "exception"
    except Exception:  # the summary must not hide the script's own outcome
        return text
    if stopped is None and not len(failed):
        return text
    step = stopped or failed[-1]  # steps are numbered on entry: the innermost one that raised is the last
    where = "".join((f" at {shown(step.module_path)}" if step.module_path else "",
                     f", {step.object_text}" if step.object_text else ""))
    what = "stopped the run at" if stopped is not None else "escaped"
    return (f"{text}; {result.exception_name} {what} step {step.index} ({shown(step.name)}{where}, "
            f"iteration {step.iteration}); open it there: {open_command(out, step.index)}")


def _death(result: Any, died: str | None) -> str:
    """How the script's process died (``died``, unless said already), and what of the flight ring its
    parent wrote out (also where the script ended but could not close its recording)."""
    text = f"; the script's process died ({died})" if died is not None else ""
    ring = result.ring_recovered
    if ring is None:
        return text
    if not ring["records"]:
        if result.failure:  # its steps were never committed: the store failed (said above), not the timing
            return text
        if ring.get("uncommitted_records"):
            return (text + "; the flight ring held payloads only of steps not yet committed (steps commit every "
                    "second): record with a larger --keep, so that the ring spans more than a second, to keep the "
                    "last committed iterations")
        return text + "; the flight ring held no payload for the steps committed before"
    its = ring["iterations"]
    span = f"iteration {its[0]}" if len(its) == 1 else f"iterations {its[0]}-{its[-1]}"
    return (f"{text}; the flight ring's payloads of {span} were written out ({ring['records']} tensors, "
            f"{ring['payloads']} payloads)")
