"""pdbg info RUN [--check], pdbg replay RUN STEP, pdbg verify RUN [--sample N]: summarise a recording (and
check every payload's bytes against their checksum), replay one step, replay many.

STEP is an index or a selector ``NAME[@iter=K][#CALL][:backward]`` (NAME: a step name, a paper label
or a module path; ``.`` is the root module): ``smooth_relu@iter=17#3``, ``"Eq. 2@iter=17"``,
``h.1.mlp@iter=5:backward``. Exit codes: 0 fine, 1 a mismatch found, 2 bad usage or bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shlex
import shutil
import sys
import textwrap
from typing import Any

import numpy as np

from recorder.errors import ChecksumError, PdbgError, ReplayError
from recorder.names import shown
from recorder.store import layout

from . import output

STEP_HELP = ("an index, or NAME[@iter=K][#CALL][:backward] where NAME is a step name, paper label or module path "
             "(e.g. 'Eq. 2@iter=17#3', h.1.mlp@iter=5:backward)")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("info", help="summarise a recording", description="Steps, iterations, paper steps with "
                       "their calls and share of the time, alerts, the first non-finite step, size and status.")
    p.add_argument("run", metavar="RUN", help="the recording (directory or bundle)")
    rank_option(p)
    p.add_argument("--check", action="store_true", help="also read every payload (the tensors' bytes) and check it "
                   "against its checksum, listing each one corrupted or unreadable with the steps whose tensors hold "
                   "it; exit 1 when any is")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=info)

    p = sub.add_parser("replay", help="replay one recorded step and compare it bit for bit",
                       description="Rebuild the step's code and module, run it alone under its recorded RNG and "
                       "settings, and compare every output (backward: grad inputs and parameter grads) with the "
                       "recording. Exit 0 when everything matches bitwise, 1 when something differs or nothing could "
                       "be compared (NOTHING COMPARED).")
    p.add_argument("run", metavar="RUN", help="the recording")
    p.add_argument("step", metavar="STEP", nargs="?", help=STEP_HELP + "; a bundle's main step when left out")
    _replay_options(p)
    p.add_argument("--no-inner", action="store_true", help="do not compare the steps inside this one")
    p.add_argument("--swap", action="append", default=[], metavar="KEY=REF",
                   help="replace a module (path, or step name) or function step with an import reference "
                        "(pkg.mod:Name), parted at the last '=' (a KEY may hold one); repeatable")
    p.add_argument("--edit", action="append", default=[], metavar="[STEP/]TENSOR=EXPR",
                   help="change a tensor with an expression in x (x, torch's operations, tensor methods, math), e.g. "
                        "'args.0=x.clamp(-50, 50)'; STEP/ aims at a step inside this one (a STEP holding '=', "
                        "'Eq. 5 (a=1)/args.0=x*0', is taken whole where it names a step); repeatable")
    p.add_argument("--set", action="append", default=[], metavar="SETTING=VALUE",
                   help="override a recorded setting (deterministic=true, num_threads=1); repeatable")
    p.add_argument("--seed", type=int, help="seed the generators with this instead of the recorded states (torch, "
                   "numpy, random, and the torch, numpy and random generators passed to the step)")
    p.add_argument("--save-recipe", metavar="NAME", help="save this intervention in the recording under NAME")
    p.add_argument("--recipe", metavar="NAME", help="apply the recipe saved under NAME (STEP defaults to its step)")
    _bundled_option(p)
    p.set_defaults(handler=replay)

    p = sub.add_parser("verify", help="replay many steps and report determinism",
                       description="Replay every step (or --sample N spread over the run), forward and backward, "
                       "and report the share that match bitwise; list the steps a replay cannot redo, with why. "
                       "Exit 1 when any differs or matched only as replayed in recording order; 2 when any step's "
                       "recorded tensors are corrupted (listed, the others still replayed) or no step could be "
                       "replayed at all.")
    p.add_argument("run", metavar="RUN", help="the recording")
    p.add_argument("--sample", type=int, metavar="N", help="replay N steps spread evenly over the run")
    _replay_options(p)
    _bundled_option(p)
    p.set_defaults(handler=verify)


def _bundled_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--use-bundled-source", action="store_true",
                   help="a bundle: replay with the code it carries instead of the code installed here (runs that code)")


def code_options(p: argparse.ArgumentParser) -> None:
    """Where replays find the steps' code (pdbg tui and serve; replay and verify have them too)."""
    p.add_argument("--script", metavar="PATH", help="the training script's path now, if it moved since recording")
    _bundled_option(p)


def rank_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank", type=int, default=0, metavar="K", help="the rank whose steps to use, in a run of "
                   "several processes (torch.distributed); default 0")


def _replay_options(p: argparse.ArgumentParser) -> None:
    rank_option(p)
    p.add_argument("--threads", type=int, metavar="N", help="force N intra-op threads instead of the recorded count")
    p.add_argument("--script", metavar="PATH", help="the training script's path now, if it moved since recording")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _open(path: str, rank: int = 0) -> Any:
    import replayer

    return replayer.open(path, rank)


def _emit(doc: dict[str, Any]) -> None:
    output.emit_json(json.dumps(doc, allow_nan=False))


# -- info ----------------------------------------------------------------------------------------
def _command_text(run: dict[str, Any]) -> str:
    """What ran the recording: its command line, or the notebook of a Jupyter kernel (whose command line is only
    ipykernel's launcher and a connection file)."""
    notebook = run.get("notebook")
    if notebook is not None:
        return f"notebook {notebook}" if notebook else "a Jupyter kernel (its notebook not named)"
    return shlex.join(str(a) for a in run.get("argv") or [])


def summary(rec: Any) -> dict[str, Any]:
    """The ``pdbg info --json`` object (README, "Command line"), plus each paper step's share of the iteration time."""
    table = rec.steps
    n = len(table)
    iteration = table.column("iteration")
    phase, status = table.column("phase"), table.column("status")
    t0, t1 = table.column("t_start"), table.column("t_end")
    papers = rec._papers
    total_time = 0.0
    for it in np.unique(iteration):
        mask = iteration == it
        total_time += float(t1[mask].max() - t0[mask].min())
    paper_steps = []
    if n:  # per paper step: two classes may share a name (Attention, Eq. 3 and Eq. 5)
        from .views import inside_another_of

        parent = table.column("parent")
        objects = rec._object_numbers
        for (name, _), start, mask in rec.paper_steps():
            outer = mask & ~inside_another_of(mask, parent)  # a recursion's time once, not once per level
            time = float((t1[outer] - t0[outer]).sum())
            paper = dict(papers[start])
            paper_steps.append({"name": str(name), "paper": {k: paper.get(k) for k in
                                                             ("label", "algorithm", "step", "equation", "description")},
                                "forward_calls": int((mask & (phase == 0)).sum()),
                                "backward_calls": int((mask & (phase == 1)).sum()),
                                # several module objects at one module path: a model and its EMA copy
                                "objects": max(1, len(np.unique(objects[mask & (objects > 0)]))),
                                "time_share": time / total_time if total_time > 0 else None})
    from replayer import first_nonfinite
    from replayer.bisect import with_alerts

    origin = first_nonfinite(rec, all_ranks=True) if n or len(rec.ranks) > 1 else None
    first = (origin.step or origin.entered) if origin is not None else None
    return {"status": rec.status, "steps": n, "iterations": int(len(np.unique(iteration))) if n else 0,
            "iteration_range": _iteration_range(iteration), "ranks": len(rec.reader.ranks),
            "rank_details": _ranks(rec), "paper_steps": paper_steps,
            "alerts": int(with_alerts(rec).sum()) if n else 0,
            "exceptions": int((status == layout.STATUSES.index("exception")).sum()),
            "first_nonfinite": first.to_json() if first is not None else None,
            "first_nonfinite_came_in": origin is not None and origin.step is None and first is not None,
            "first_nonfinite_outside": origin.ended_by if origin is not None else None,
            "first_nonfinite_raised_outside": origin.raised_outside if origin is not None else None,
            "first_nonfinite_raised_in": origin.raised_in.to_json()
            if origin is not None and origin.raised_in is not None else None,
            "ended_by": rec.ended_by,
            "bytes": int(rec.reader.nbytes()), "schema_version": rec.reader.schema_version,
            "recipes": list(_recipes(rec).values()), "bundle": _bundle_summary(rec),
            "grad_scaler_skipped": rec.scaler_skips, "tensors_kept": _tensors_kept(rec, _iteration_range(iteration)),
            "optimizer_replaced": rec.rank.final.get("optimizer_replaced"),
            "compiled_unrecorded": rec.rank.final.get("compiled_unrecorded")}


def _iteration_range(iteration: np.ndarray) -> list[int] | None:
    """The first and last iteration holding a step (a resumed run's start at its checkpoint's step), or None."""
    return [int(iteration.min()), int(iteration.max())] if len(iteration) else None


def _iterations_text(count: int, span: list[int] | None) -> str:
    """"25 iterations", and their range where they do not start at 0 (a resumed run's): "25 iterations (15–39)"."""
    text = _count(count, "iteration")
    if span is None or span[0] == 0:
        return text
    return f"{text} ({span[0]})" if span[0] == span[1] else f"{text} ({span[0]}–{span[1]})"


def _tensors_kept(rec: Any, span: list[int] | None = None) -> str | None:
    """Which iterations' tensors a run kept, where its mode keeps some only (what can be replayed)."""
    run = rec.run_info
    mode, every = run.get("mode"), run.get("every")
    if rec.bundle_info is not None:  # its own steps' tensors, whatever its recording's mode kept of the others
        held = sum(any(r.has_payload for r in step.records) for step in rec.steps)
        return f"those of {held} of its {len(rec)} steps (a bundle holds the tensors of the steps it replays)"
    if mode == "stats":
        return "none (stats mode: statistics only; nothing can be replayed)"
    if mode == "full" and isinstance(every, int) and every > 1:
        first = -(-(span[0] if span else 0) // every) * every  # the multiples of every (counted from iteration 0)
        return (f"every {every} iterations (--every {every}: iterations {first}, {first + every}, "
                f"{first + 2 * every}, ...)")
    if mode == "flight":
        written, writes = rec.rank.ring_iterations(), rec.rank.ring_writes()
        if written is None or writes is None:  # still recording: what the ring wrote is known at close
            return "the iterations the flight ring wrote out (known when the recording closes)"
        reasons = sorted({str(d.get("reason")) for d in writes if d.get("reason") not in (None, "died", "failure")})
        if any(d.get("reason") == "failure" for d in writes):  # the recorder stopped: the ring's complete iterations
            reasons.append("the recorder's failure (the iterations complete before it)")
        if any(d.get("reason") == "died" for d in writes):  # written out by pdbg record after a hard crash
            reasons.append("the process's death (by pdbg record)")
        if not written:
            return "none (the flight ring wrote out no iteration)"
        some = ", ".join(str(i) for i in written[:12]) + (", ..." if len(written) > 12 else "")
        cut = rec.rank.ring_write_cut()
        cut = (f"; the process died without closing the recording: its last write-out (iteration"
               f"{'s' if len(cut) != 1 else ''} {', '.join(map(str, cut))}) may have been cut short, some of its "
               "tensors without bytes") if cut else ""
        return f"iterations {some} (the flight ring, written out at: {', '.join(reasons)}{cut})"
    return None


_ALERTS_LISTED = 5  # steps whose alerts pdbg info prints


def _ranks(rec: Any) -> list[dict[str, Any]]:
    """Each rank of the run: its status, steps, process and process group (also those of the world
    that never committed a step: status ``missing``)."""
    out = []
    reader = rec.reader
    for rank in sorted([*reader.ranks, *reader.missing_ranks]):
        if rank in reader.missing_ranks:
            out.append({"rank": rank, "status": "missing", "steps": 0})
            continue
        r = reader.rank(rank)
        iterations = r.column("steps/iteration") if len(r) else np.zeros(0)
        run = r.run_info
        out.append({"rank": rank, "status": r.status, "steps": len(r),
                    "iterations": int(len(np.unique(iterations))), "iteration_range": _iteration_range(iterations),
                    "world_size": r.dist["world_size"],
                    "backend": r.dist["backend"], "hostname": run.get("hostname"), "pid": run.get("pid"),
                    "ended_by": rec.of_rank(rank).ended_by})
    return out


def _bundle_summary(rec: Any) -> dict[str, Any] | None:
    """For a bundle: its main step, where it came from, its verification, and every difference
    between the machine it was made on and this one: environment and code (read, never run)."""
    info = rec.bundle_info
    if info is None:
        return None
    from replayer.bundles import verified_environment
    from replayer.code import (
        CodeLoader,
        carried_drift,
        drift_without_running,
        source_in,
        submodule_entries,
        submodule_place,
    )
    from replayer.state import environment_differences

    main = rec.main_step
    dirs = CodeLoader(rec.run_info).dirs
    sources = info.get("sources") or {}
    code = []
    seen = set()
    for step in rec.steps:
        definition = step.definition
        ref = definition.get("ref")
        if ref and ref not in seen:
            seen.add(ref)
            code.append({"name": definition.get("name"), "ref": ref,
                         "state": drift_without_running(definition, rec.run_info, dirs),
                         "bundled": definition.get("file") in sources})
        # the classes of its module's submodules that are the training code's own (1.17), and their carried copy
        for sub, entry, paths in submodule_entries(step._doc("module"), step.module_path):
            if sub in seen:
                continue
            seen.add(sub)
            carried = sources.get(entry["file"]) if isinstance(entry["file"], str) else None
            copy = source_in(carried, sub.partition(":")[2]) if isinstance(carried, str) else None
            code.append({"name": sub.partition(":")[2], "ref": sub, "submodule": submodule_place(step.name, paths),
                         "state": drift_without_running({**entry, "ref": sub}, rec.run_info, dirs),
                         "bundled": isinstance(carried, str),
                         "bundled_state": None if not isinstance(carried, str) else "not found" if copy is None
                         else "unchanged" if hashlib.sha256(copy.encode()).hexdigest() == entry["source_sha256"]
                         else "changed since recording"})
    dist = rec.rank.dist
    verified_with = verified_environment(info.get("verified"))
    return {"main_step": main.to_json(), "origin": info.get("origin"), "created": info.get("created"),
            "rank": dist["rank"] if dist["world_size"] > 1 else None, "world_size": dist["world_size"],
            "verified": info.get("verified"), "environment_differences": environment_differences(
                rec.run_info, main.settings),
            "verified_environment_differences": None if verified_with is None else environment_differences(
                verified_with, verified=True), "code": code,
            "sources": sorted(str(f) for f in (info.get("sources") or {})),
            "sources_differ": carried_drift(info, rec.run_info, dirs)}


def _recipes(rec: Any) -> dict[str, Any]:
    from replayer import recipes

    return recipes.recipes(rec)


def _size(nbytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000  # type: ignore[assignment]
    return ""


def info(args: argparse.Namespace) -> int:
    rec = _open(args.run, args.rank)
    doc = summary(rec)
    if args.json:
        report = rec.check_payloads(progress=_checking) if args.check else None
        if report is not None:
            doc["payload_check"] = report.to_json()
        _emit(doc)
        return 0 if report is None or report.intact else 1
    run = rec.run_info
    iterations = _iterations_text(doc["iterations"], doc["iteration_range"])
    print(f"{args.run}: {doc['status']}, {_count(doc['steps'], 'step')}, {iterations}, "
          f"{doc['ranks']} rank{'s' if doc['ranks'] != 1 else ''}, {_size(doc['bytes'])} on disk "
          f"(schema {doc['schema_version']})")
    if run:
        command = _command_text(run)
        print(f"recorded {run.get('started', '?')} on {run.get('hostname', '?')}: {command} "
              f"(torch {run.get('torch')}, mode {run.get('mode')})")
        if doc["tensors_kept"]:
            print(f"tensors kept: {doc['tensors_kept']}")
    if doc["ended_by"] and len(doc["rank_details"]) < 2:  # (of several ranks, each rank's line says its own)
        print(f"ended by: {doc['ended_by']}")
    if len(doc["rank_details"]) > 1:
        print()
        for r in doc["rank_details"]:
            if r["status"] == "missing":
                print(f"  rank {r['rank']}: missing (no step committed here: killed before its first commit, never "
                      "started, or recorded to another path; every rank must record to the same one)")
                continue
            print(f"  rank {r['rank']}: {r['status']}, {_count(r['steps'], 'step')}, "
                  f"{_iterations_text(r['iterations'], r['iteration_range'])}, "
                  f"backend {r['backend'] or '?'}, {r['hostname']} pid {r['pid']}")
            if r["ended_by"]:
                print(f"    ended by: {r['ended_by']}")
        print(f"  (paper steps below: rank {rec.rank.rank}; --rank K for another)")
    if doc["paper_steps"]:
        from rich.cells import cell_len

        from replayer.recording import paper_reference

        # (names as printed, their control characters escaped before they are padded: names.shown)
        width = min(40, max(4, *(cell_len(shown(p["name"])) for p in doc["paper_steps"])))  # longer: cut ("…")
        print(f"\n  {'step':<{width}}  {'paper':<28} {'forward':>7} {'backward':>8}  time")
        for p in doc["paper_steps"]:
            share = "" if p["time_share"] is None else f"{100 * p['time_share']:5.1f}%"
            print(f"  {_cell(shown(p['name']), width)}  {_cell(shown(paper_reference(p['paper'])), 28)} "
                  f"{p['forward_calls']:>7} {p['backward_calls']:>8}  {share}")
        print("  (time: the share of the iterations' wall time spent in the step, inner steps included, a "
              "recursion once)")
        for p in doc["paper_steps"]:
            if p["objects"] > 1:
                print(f"  {shown(p['name'])}: {p['objects']} module objects at one module path (a model and its copy, "
                      "such as an EMA teacher, or a module replaced mid-run);\n    each step says which (\"object 1 "
                      "of 2\"); the TUI's filter object:K shows one's calls")
    print(f"\nalerts: {doc['alerts']}   exceptions: {doc['exceptions']}")
    if doc["alerts"]:  # what they say (the first few; the TUI's a lists them all)
        from replayer.bisect import with_alerts

        from .views import alert_text

        flagged = np.flatnonzero(with_alerts(rec))
        for index in flagged[:_ALERTS_LISTED]:
            step = rec.step(int(index))
            for alert in step.extra.get("alerts", []) or []:
                print(f"  step {step.index} ({shown(step.name)}, iteration {step.iteration}): "
                      f"{alert_text(alert, step)}")
        if len(flagged) > _ALERTS_LISTED:
            print(f"  ... and {len(flagged) - _ALERTS_LISTED} more steps (the TUI's a lists every one)")
    skips = doc["grad_scaler_skipped"]
    if skips:
        listed = [str(i) for i in skips.get("iterations") or []]
        some = ", ".join(listed[:8]) + (f" and {skips['count'] - 8} more" if skips["count"] > 8 else "")
        which = f"iteration{'s' if len(listed) != 1 else ''} {some}"
        print(f"GradScaler skipped {_count(skips['count'], 'optimizer step')} ({which}): NaN or Inf in the scaled "
              "gradients; bisect passes over the backward steps of those skipped at a loss scale above 1 whose "
              "gradients held Inf (overflows of the scaled loss; NaN without Inf is none), and --scaler-skips looks "
              "at them too")
    replaced = doc["optimizer_replaced"]
    if replaced:
        at = ", ".join(f"{it} ({name})" for it, name in zip(replaced["iterations"], replaced["optimizers"]))
        more = replaced["count"] - len(replaced["iterations"])
        print(f"optimizer replaced at iteration{'s' if replaced['count'] != 1 else ''} {at}"
              + (f" and {more} more" if more > 0 else "") + ": a new optimizer over the same parameters (resumed "
              "or re-created) counts the iterations from its first step, which ends that iteration")
    from replayer.recording import compiled_unrecorded_note

    unrecorded = compiled_unrecorded_note({"compiled_unrecorded": doc["compiled_unrecorded"]})
    if unrecorded:
        print(unrecorded[0].upper() + unrecorded[1:] + f" ({_count(doc['compiled_unrecorded']['count'], 'trace')})")
    first, raised_in = doc["first_nonfinite"], doc["first_nonfinite_raised_in"]
    if first is None and raised_in is not None:  # a NaN check inside a step raised before it returned
        how = "ended the run" if doc["first_nonfinite_outside"] else "the training code caught"
        print(f"NaN origin: inside {_step_text(raised_in)}, which raised an exception that speaks of NaN/Inf before "
              f"it returned ({how})  (pdbg bisect --ops for the operation)")
    elif first is None and doc.get("first_nonfinite_raised_outside"):
        print(f"NaN origin: outside the recorded steps, which hold no NaN/Inf; a backward pass raised "
              f"{doc['first_nonfinite_raised_outside']}, which the training code caught  (pdbg bisect for why)")
    elif first is None and doc["first_nonfinite_outside"]:
        print(f"NaN origin: outside the recorded steps, which hold no NaN/Inf; the run ended by "
              f"{doc['first_nonfinite_outside']}  (pdbg bisect for why)")
    elif first is None:
        print("NaN origin: none found (pdbg bisect says why)")
    else:
        rank = f"rank {first['rank']} · " if len(doc["rank_details"]) > 1 else ""
        if doc["first_nonfinite_came_in"]:  # no recorded step made it: where it entered is no origin
            print(f"NaN origin: none of the recorded steps; it came in at {rank}{_step_text(first)}  (pdbg bisect "
                  "for why)")
        else:
            print(f"NaN origin: {rank}{_step_text(first)}  (pdbg bisect for why)")
    bundle = doc["bundle"]
    if bundle is not None:
        from replayer.bundles import environment_text, verification_verdict, verified_environment

        origin = bundle.get("origin") or {}
        verified = bundle.get("verified")
        rank = f", rank {bundle['rank']} of {bundle['world_size']}" if bundle["rank"] is not None else ""
        print(f"\nbundle of {origin.get('path')} (step {origin.get('index')} there{rank}), "
              f"made {bundle.get('created')}; "
              + ("verified when made: " + verification_verdict(verified) if verified else "not verified when made"))
        if verified:
            verified_with = verified_environment(verified)
            if verified_with is None:
                print("verified with: not recorded (the bundle was made before bundles recorded what verified them)")
            else:
                print(f"verified with: {environment_text(verified_with, rec.run_info)}")
                here = bundle["verified_environment_differences"]
                print("here: " + ("the same as where it was verified" if not here else
                                  "differs from where it was verified: " + "; ".join(here)))
        print(f"main step: {_step_text(bundle['main_step'])}  (pdbg replay {shlex.quote(args.run)})")
        diffs = bundle["environment_differences"]
        print("environment: " + ("same as where it was recorded" if not diffs else "; ".join(diffs)))
        for c in bundle["code"]:
            extra = " - bundled source available (--use-bundled-source)" if c["bundled"] else ""
            if c.get("bundled_state") == "changed since recording":  # what --use-bundled-source would run
                extra += ", but the bundled copy changed since recording"
            elif c.get("bundled_state") == "not found":
                extra += ", but the bundled copy does not define it"
            where = f", {c['submodule']}" if c.get("submodule") else ""
            print(f"code of {c['name']} ({c['ref']}{where}): {c['state']}{extra}")
        if bundle.get("sources"):
            print(f"source files carried: {', '.join(bundle['sources'])}")
        for d in bundle.get("sources_differ") or ():  # (a helper the step calls can change while its own code did not)
            what = f"module {d['module']}" if d["module"] else "the script"
            print(f"source changed: {d['here']} ({what}) differs from the copy this bundle carries: what the steps "
                  "call in it may compute differently here (--use-bundled-source runs the bundle's copy)")
    if doc["recipes"]:
        from replayer import recipes

        print("\nrecipes (code: applied only when named with pdbg replay --recipe NAME):")
        for recipe in doc["recipes"]:
            print(f"  {recipes.describe(recipe)}")
    if not args.check:
        print("\npayloads: not read (--check reads each one and checks it against its checksum)")
        return 0
    sys.stdout.flush()  # (the summary shows while the payloads are read)
    report = rec.check_payloads(progress=_checking)
    _print_check(report)
    return 0 if report.intact else 1


_USERS_LISTED = 6  # tensor records named per damaged payload; more are counted


def _print_check(report: Any) -> None:
    """``pdbg info --check``'s listing: the payloads read, and each damaged one with the tensor records holding it."""
    read = f"{report.payloads} read ({_size(report.nbytes)})"
    if report.damaged_tables:
        print(f"\ntables: {len(report.damaged_tables)} column{'s' if len(report.damaged_tables) != 1 else ''} "
              "damaged (restore the recording from a copy; replay, verify and bisect refuse it):")
        for _, problem in report.damaged_tables:
            print(f"  {problem}")
    if not report.payloads:
        print("\npayloads: none stored (statistics only), so none to check")
    elif not report.damaged:
        print(f"\npayloads: {read}, every one intact (its bytes match their checksum)")
    if not report.damaged:
        return
    print(f"\npayloads: {read}; {len(report.damaged)} corrupted or unreadable (restore the recording from a copy, or "
          "record again):")
    for damaged in report.damaged:
        users = [f"{shown(record)} of step {index}" + (f" ({shown(name)})" if name is not None else " (not committed)")
                 for index, name, record in damaged.used_by]
        held = ", ".join(users[:_USERS_LISTED]) + (f", ... ({len(users)} records)" if len(users) > _USERS_LISTED
                                                     else "")
        print(f"  {damaged.problem}; " + (f"held by {held}" if users else "held by no tensor record"))


def _checking(done: int, total: int) -> None:
    """``pdbg info --check``'s progress bar, redrawn once per 1/200 of the payloads."""
    if done == total or done % max(1, total // 200) == 0:
        _progress(done, total, "checking payloads")


def _step_text(step: dict[str, Any]) -> str:
    where = (f" at {shown(step['module_path'])}" if step["module_path"] else "") + (
        f", object {step['object']} of {step['objects']}" if step.get("object") else "")
    from replayer.recording import paper_reference

    ref = paper_reference(step["paper"])
    who = f"{shown(ref)} ({shown(step['name'])})" if ref and ref != step["name"] else shown(step["name"])
    phase = step["phase"] + (" (no grad)" if step["phase"] == "forward" and step.get("grad_enabled") is False else "")
    return f"step {step['index']}: {who}{where}, {phase}, iteration {step['iteration']}, call {step['call']}"


# -- replay --------------------------------------------------------------------------------------
def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def split_pair(item: str, flag: str, rec: Any = None) -> tuple[str, str] | None:
    """KEY and VALUE of a --swap, --edit or --set argument KEY=VALUE (the TUI's s and e prompts too), or None
    where no '=' parts them. A key may hold '=' itself: in '@iter=K' (a selector), and in a label ("Eq. 5
    (α=1.5)/args.0"). A swap's value is an import reference (pkg.mod:Name), which holds none: it is parted at
    the last '='. An edit's value is an expression, which may (x.clamp(min=0), x == 0): it is parted at the
    first '=' whose key is STEP/TENSOR with a STEP that names a step of ``rec``, else at the first '='; a
    setting at the first."""
    cuts = [m.start() for m in re.finditer("=", item) if 0 < m.start() < len(item) - 1
            and not item[:m.start()].endswith("@iter")]
    if not cuts:
        return None
    pos = cuts[0]
    if flag == "--swap":
        pos = cuts[-1]
    elif flag == "--edit" and rec is not None and len(cuts) > 1:
        pos = next((c for c in cuts if _names_a_step(rec, item[:c].strip())), pos)
    return item[:pos].strip(), item[pos + 1:].strip()


def _names_a_step(rec: Any, key: str) -> bool:
    """Whether an edit key is STEP/TENSOR with a STEP that selects a step of ``rec``."""
    step, sep, tensor = key.rpartition("/")
    if not (sep and step.strip() and tensor.strip()):
        return False
    try:
        return len(rec.steps.select(step)) > 0
    except PdbgError:
        return False


def _pairs(items: list[str], flag: str, rec: Any = None) -> dict[str, str]:
    """KEY=VALUE arguments, parted as ``split_pair`` says."""
    out = {}
    for item in items:
        pair = split_pair(item, flag, rec)
        if pair is None:
            example = {"--edit": "args.0=x.clamp(-50, 50)", "--set": "deterministic=true"}.get(
                flag, "smooth_relu=mypkg.stable:smooth_relu")
            raise PdbgError(f"{flag} takes KEY=VALUE (e.g. {flag} '{example}'), not {item!r}")
        key, value = pair
        if key in out:
            raise PdbgError(f"{flag} {key} is given twice ({out[key]!r} and {value!r}); give each key once")
        out[key] = value
    return out


def _setting_value(text: str) -> Any:
    if text.lower() in ("true", "false"):  # True as well as true
        return text.lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text  # a plain word: "highest"


def replay(args: argparse.Namespace) -> int:
    from replayer import recipes
    from replayer.replay import Replayer

    _check_threads(args.threads)
    rec = _open(args.run, args.rank)
    swap, edit = _pairs(args.swap, "--swap"), _pairs(args.edit, "--edit", rec)
    settings = {k: _setting_value(v) for k, v in _pairs(args.set, "--set").items()}
    seed = args.seed
    if args.recipe is not None:
        recipe = recipes.get(rec, args.recipe)  # applied only because it was named here
        swap, edit = {**recipe.get("swap", {}), **swap}, {**recipe.get("edit", {}), **edit}
        settings = {**recipe.get("settings", {}), **settings}
        seed = seed if seed is not None else recipe.get("seed")
        if args.step is None:
            args.step = str(recipe["step"]["index"])
    if args.step is None and rec.main_step is not None:
        args.step = str(rec.main_step.index)
    if args.step is None:
        raise PdbgError("give the STEP to replay: " + STEP_HELP)
    step = rec.step(args.step)
    if args.save_recipe is not None:  # before the replay, whose result would be lost
        recipes.check_name(args.save_recipe)
        recipes.check_intervention(args.save_recipe, swap, edit, settings, seed)
        recipes.check_writable(rec)
    replayer_ = Replayer(rec, script=args.script, use_bundled_source=args.use_bundled_source)
    result = replayer_.replay(step, threads=args.threads, nested=not args.no_inner, swap=swap, edit=edit,
                              settings=settings, seed=seed)
    replaced = args.save_recipe is not None and recipes.recipes(rec).get(args.save_recipe)
    if args.save_recipe is not None:
        recipes.save(rec, args.save_recipe, step, swap=swap, edit=edit, settings=settings, seed=seed, result=result)
    if args.json:
        _emit(result.to_json())
        return 0 if result.match else 1
    print(_step_text(step.to_json()))
    if result.intervention:
        print("intervention: " + recipes.describe({"name": args.recipe or "this replay", "step": step.to_json(),
                                                   **result.intervention}).split(": ", 2)[-1])
    ways = sorted(set(result.rebuilt.values()))
    if result.rebuilt:
        by_way = {w: [p or "." for p, v in result.rebuilt.items() if v == w] for w in ways}
        print("rebuilt: " + "; ".join(f"{len(v)} module{'s' if len(v) != 1 else ''} from its "
                                      f"{'skeleton' if w == 'skeleton' else 'constructor'}"
                                      f"{'' if w == 'skeleton' else ' (' + ', '.join(v) + ')'}"
                                      for w, v in by_way.items()))
    if result.outputs:
        _outputs_table(result.outputs)
    extra = result.unrecorded_inner
    if result.inner or extra:
        ok = sum(s.match for s in result.inner)
        first = result.first_divergence
        print(f"\ninner steps: {ok} of {len(result.inner)} match" + (
            "" if first is None else f"; first divergence: {_step_text(first.step.to_json())}"
            + (f" ({first.reason})" if first.reason else "")) + (f"; {extra.text}" if extra else ""))
        if not result.match:
            for s in result.inner:
                if not s.match:
                    obj = f"{s.step.object_text}, " if s.step.object_text else ""
                    print(f"  step {s.step.index} {shown(s.step.name)} at {shown(s.step.module_path) or '.'} "
                          f"({obj}{s.step.phase}): "
                          f"{s.change}" + _nonfinite_change(s))
    if result.bundled_source:  # (what ran is not the code here: a match says nothing of that code)
        print("code: the copy this bundle carries (--use-bundled-source), not the code here: "
              + ", ".join(result.bundled_source))
    for w in result.warnings:
        print(f"warning: {w}")
    if result.environment_differences:
        print("environment differs from the recording: " + "; ".join(result.environment_differences))
    if rec.main_step is not None and step.index == rec.main_step.index:  # a bundle's: what verified it, and here
        from replayer.bundles import verification_note

        note = verification_note(rec)
        if note:
            print(note)
    if args.save_recipe is not None:
        print(f"saved as recipe {args.save_recipe!r} in {args.run} "
              + (f"(replacing the one saved {replaced.get('saved', '')[:19].replace('T', ' ')} for step "
                 f"{replaced.get('step', {}).get('index')}) " if replaced else "")
              + f"(apply it with: pdbg replay {shlex.quote(args.run)} --recipe {shlex.quote(args.save_recipe)})")
    unseen = f"; not compared (not recorded as data): {', '.join(result.not_compared)}" if result.not_compared else ""
    unseen += f"; not compared: {result.unseen_text}" if result.unseen_writes else ""
    if not result.compared:
        print("\nNOTHING COMPARED: " + (
            "the recording stopped training inside this step, so it returned no output, and no step inside it was "
            "compared" + (" (--no-inner)" if args.no_inner else "") if result.stopped else
            f"the step's output was not recorded as data: {', '.join(result.not_compared)}" if result.not_compared
            else "the step returned no tensor"))
    elif result.match and result.intervention:  # the question asked was "would this change anything?"
        print("\nNO CHANGE: the intervention left every output bit for bit as recorded" if not unseen else
              f"\nNO CHANGE in what was compared: the intervention left it bit for bit as recorded{unseen}")
    elif result.match and result.by_statistics:  # (the reason under each says what its statistics leave out)
        names = result.by_statistics
        rest = len(names) < len(result.outputs) + sum(len(s.diffs) for s in result.inner)
        print(f"\nMATCH: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} by statistics only, not bit for "
              "bit" + (", the rest bit for bit" if rest else "") + unseen)
    elif result.match:
        print("\nMATCH: bit for bit" + (f", in what was compared{unseen}" if unseen else ""))
    elif result.intervention and result.exception:
        print(f"\nMISMATCH, as an intervention makes it: the replay raised {result.exception}")
    elif result.intervention:
        tensors = [d for d in result.outputs if d.name != "exception"]
        before = sum((d.recorded.get("nan") or 0) + (d.recorded.get("inf") or 0) for d in tensors)
        after = sum((d.replayed.get("nan") or 0) + (d.replayed.get("inf") or 0) for d in tensors)
        print(f"\nMISMATCH, as an intervention makes it; non-finite output values: {before} recorded, {after} now")
    else:
        print("\nMISMATCH")
    return 0 if result.match else 1


WIDE = 119  # columns of the table with recorded and replayed statistics side by side
NARROW = 81  # columns of the table with replayed statistics under recorded ones


def _outputs_table(diffs: list[Any]) -> None:
    """The replay's outputs, recorded against replayed: side by side where the terminal has room
    (or stdout is not one), else the replayed statistics on a line of their own under a mismatch
    (a match replays the same bits, so the same statistics)."""
    from .views import fit_cells

    columns = shutil.get_terminal_size((10 ** 4, 24)).columns
    wide = columns >= WIDE
    # The names as long as they are, where the terminal has room beyond the table's (a pipe has it all)
    room = columns - (WIDE if wide else NARROW)
    least = 18 if wide else 15
    from rich.cells import cell_len

    # (in terminal columns: a wide character takes two, a combining one none; names as printed: names.shown)
    n = min(max(least, *(cell_len(shown(d.name)) for d in diffs)), least + max(0, room)) if diffs else least
    if wide:
        print(f"\n  {'tensor':<{n}} {'match':<5} {'recorded: min':>14} {'max':>9} {'nan':>5} {'inf':>5}   "
              f"{'replayed: min':>13} {'max':>9} {'nan':>5} {'inf':>5}   {'max abs':>8} {'ULP':>6}")
    else:
        print(f"\n  {'tensor':<{n}} {'match':<5} {'':<8} {'min':>9} {'max':>9} {'nan':>5} {'inf':>5} {'max abs':>8} "
              f"{'ULP':>6}")
    for d in diffs:
        if d.name == "exception" or not d.measured:  # (NaN/Inf or shapes that differ: the reason line says which)
            far = f"{'-':>8} {'-':>6}"
        else:
            ulp = d.max_ulp if wide or d.max_ulp < 10 ** 6 else f"{d.max_ulp:.0e}"  # (the JSON has every digit)
            far = f"{_num(d.max_abs_diff):>8} {ulp:>6}"
        name = fit_cells(shown(d.name), n, keep_end=True)  # (cut at its start: out_proj.weight, .bias differ there)
        if wide:
            print(f"  {name} {'yes' if d.match else 'NO':<5} {_stats_cells(d.recorded)}   "
                  f"{_stats_cells(d.replayed, 13)}   {far}")
        elif d.match:
            print(f"  {name} {'yes':<5} {'':<8} {_stats_cells(d.recorded, 9)} {far}")
        else:
            print(f"  {name} {'NO':<5} {'recorded':<8} {_stats_cells(d.recorded, 9)}")
            print(f"  {'':<{n}} {'':<5} {'replayed':<8} {_stats_cells(d.replayed, 9)} {far}")
        if d.reason and (not d.match or d.by_statistics):  # prose: wrapped to the terminal (a pipe: on one line)
            print(textwrap.fill(d.reason, width=max(40, columns - 1), initial_indent="    ", subsequent_indent="    ",
                                break_on_hyphens=False))
    from replayer.recording import magnitudes_note

    magnitudes = magnitudes_note([d.name for d in diffs if d.is_complex])
    if magnitudes:
        print(f"  ({magnitudes})")


def _stats_cells(st: dict[str, Any], width: int = 14) -> str:
    if not st:
        return f"{'-':>{width}} {'':>9} {'':>5} {'':>5}"
    return f"{_num(st.get('min')):>{width}} {_num(st.get('max')):>9} {_num(st.get('nan')):>5} {_num(st.get('inf')):>5}"


def _nonfinite_change(inner: Any) -> str:
    counts = []
    for d in inner.diffs:
        if d.replayed:
            before = (d.recorded.get("nan") or 0) + (d.recorded.get("inf") or 0)
            after = (d.replayed.get("nan") or 0) + (d.replayed.get("inf") or 0)
            if before or after:
                counts.append(f"{d.name}: {before} -> {after} non-finite")
    return f" ({'; '.join(counts)})" if counts else (f" ({inner.reason})" if inner.reason else "")


def _check_threads(threads: int | None) -> None:
    from replayer.state import MAX_THREADS

    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise PdbgError(f"--threads must be an integer from 1 to {MAX_THREADS}, not {threads}")


# -- verify --------------------------------------------------------------------------------------
def _progress(done: int, total: int, doing: str = "verifying") -> None:
    err = getattr(sys.stderr, "stream", sys.stderr)  # past the escaping of control characters (tui.cli): a \r of ours
    if not err.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    err.write(f"\r{doing} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        err.write("\n")
    err.flush()


# Why a matched step was compared by statistics (Diff.by_statistics), as verify's summary says it
_STATISTICS_WHY = {
    "unkept": ("results recorded as statistics alone (stats mode, or flight mode outside the iterations it kept), "
               "of steps that take no tensor and so replay there"),
    "sparse": "sparse results whose indices were not kept, compared by the statistics of their stored values",
}


def _by_statistics_why(result: Any) -> set[str]:
    """Why a replay's results that matched by statistics did (``_STATISTICS_WHY``'s keys): a sparse result whose
    indices were not kept, or a result recorded without its bytes."""
    diffs = list(result.outputs) + [d for inner in result.inner for d in inner.diffs]
    return {"sparse" if "indices are not recorded" in (d.reason or "") else "unkept"
            for d in diffs if d.match and d.by_statistics}


def _kept(rec: Any) -> tuple[list[int], int]:
    """The steps whose tensors a replay starts from were kept (their inputs, parameters and
    buffers; a backward step's grad outputs and its forward's): flight mode keeps its ring's."""
    rank, n = rec.rank, len(rec)
    if not rank.lengths.get("tensors"):
        return list(range(n)), 0
    roles = rank.column("tensors/role")
    needed = np.isin(roles, [layout.ROLES.index(r) for r in ("input", "param", "buffer", "grad_output")])
    unkept = needed & (rank.payload_column() < 0)
    missing = np.concatenate([[0], np.cumsum(unkept)])
    start = rank.column("steps/tensor_start").astype(np.int64)
    end = start + rank.column("steps/tensor_count")
    own = missing[end] == missing[start]
    # A lazy module's parameters before its first call have no bytes, and a replay needs none
    # (Step.uninitialized): looked at, step by step, where every record missing is a 0-d parameter or buffer.
    lazy_like = np.concatenate([[0], np.cumsum(unkept & (rank.column("tensors/ndim") == 0) & np.isin(
        roles, [layout.ROLES.index("param"), layout.ROLES.index("buffer")]))])
    for i in np.flatnonzero(~own & (lazy_like[end] - lazy_like[start] == missing[end] - missing[start])).tolist():
        step = rec.step(i)
        own[i] = {r.name for r in step.records if r.role in ("param", "buffer") and not r.has_payload} <= \
            step.uninitialized and all(r.has_payload for r in step.records if r.role in ("input", "grad_output"))
    # A step of an iteration whose tensors were kept, whose tensors without bytes are so by their own note
    # (a nested or sparse input, a tensor the recorder could not read): replayed, to be listed as not
    # replayable with that note, not counted with the steps the recording's mode kept statistics of.
    for i in np.flatnonzero(~own & _iterations_kept(rec)).tolist():
        step = rec.step(i)
        unkept = [r for r in step.records if r.role in ("input", "param", "buffer", "grad_output")
                  and not r.has_payload and r.name not in step.uninitialized]
        own[i] = bool(unkept) and all(layout.METADATA_NOTE in step.why_statistics_only(r) for r in unkept)
    forward = rank.column("steps/forward").astype(np.int64)
    backward = (rank.column("steps/phase") == 1) & (forward >= 0)
    kept = own.copy()
    kept[backward] &= own[forward[backward]]
    # (a step that needs none of its own, a second-order backward with no grad output, kept none either)
    counted = np.concatenate([[0], np.cumsum(needed)])
    return np.flatnonzero(kept).tolist(), int((own & ~kept & (counted[end] > counted[start])).sum())


def _forward_gone_why(rec: Any) -> str:
    """Why a backward step kept its tensors and its forward call did not, in this recording's terms: a
    bundle holds the tensors of the steps it replays (a bundled step's inner calls keep their statistics),
    flight mode the iterations its ring wrote out, ``every`` every K-th iteration."""
    mode, every = rec.run_info.get("mode"), rec.run_info.get("every")
    if rec.bundle_info is not None:
        return "a call inside the bundled step, of which the bundle keeps the statistics only"
    if mode == "flight":
        return "from an iteration flight mode had let go"
    if mode == "full" and isinstance(every, int) and every > 1:
        return f"from an iteration --every {every} kept no tensors of"
    return "whose tensors were not kept"


def _iterations_kept(rec: Any) -> np.ndarray:
    """Per step, whether the recording's mode kept the tensors of its iteration: every iteration in
    full mode (every k-th with ``every``), the iterations flight mode's ring wrote out, none in stats mode."""
    iterations = rec.rank.column("steps/iteration").astype(np.int64)
    mode, every = rec.run_info.get("mode"), rec.run_info.get("every")
    if mode == "full":
        return iterations % every == 0 if isinstance(every, int) and every > 1 else np.ones(len(iterations), bool)
    if mode == "flight":
        return np.isin(iterations, rec.rank.ring_iterations() or [])
    return np.zeros(len(iterations), bool)


_ALIKE_LISTED = 3  # steps refused for one reason listed one by one; more are one line


def _replayer_fault(exc: Exception) -> str:
    """Why a step could not be replayed when the replay failed in a way it has no message for (a fault of
    pdbg's, not of the recording): its exception, in one line, and what to do."""
    text = " ".join(str(exc).split())[:300]
    return (f"the replay failed ({type(exc).__name__}{': ' + text if text else ''}), a fault of pdbg's, not of the "
            "recording; replay this step alone with pdbg replay for its traceback, and report it")


def verify(args: argparse.Namespace) -> int:
    from replayer.replay import Replayer

    _check_threads(args.threads)
    if args.sample is not None and args.sample < 1:
        raise PdbgError(f"--sample must be a positive integer, not {args.sample}")
    rec = _open(args.run, args.rank)
    for column in layout.columns():  # the step and tensor tables whole: a damaged column is refused at once,
        table = column.path.split("/")[0]  # whichever steps --sample picks
        if table in ("steps", "tensors") and rec.rank.lengths.get(table) and rec.rank.holds(column.path):
            rec.rank.column(column.path)  # (an older schema's recording lacks the arrays added since)
    kept, forward_gone = _kept(rec)  # (forward_gone: backward steps that kept their tensors, not their forward's)
    skipped = len(rec) - len(kept)
    if not kept and not len(rec):
        why = ": it ended before its first commit" if rec.status == "crashed" else ""
        raise PdbgError(f"{args.run} holds no step ({rec.status}{why}); there is nothing to replay")
    n = len(kept)
    picks = kept if args.sample is None or args.sample >= n else [kept[i] for i in sorted(
        set(np.linspace(0, n - 1, args.sample).round().astype(int).tolist()))]
    replayer = Replayer(rec, script=args.script, use_bundled_source=args.use_bundled_source) if picks else None
    matched, mismatches, refused, by_statistics, partly, unseen = 0, [], [], 0, [], []
    in_order: list[dict[str, Any]] = []  # matched only as replayed in order: generators whose state is not recorded
    statistics_why: set[str] = set()  # why those matched by statistics were (_by_statistics_why), once each
    corrupted: list[dict[str, Any]] = []  # steps whose recorded bytes are not the bytes recorded
    alike: list[str] = []  # per refused step, its reason with its number written "step N" (_alike)
    environment: list[str] = []  # what differs from the machine and software that recorded it (once each)
    for done, index in enumerate(picks, 1):
        step = rec.step(index)
        try:
            result = replayer.replay(step, threads=args.threads, nested=False)
        except ReplayError as exc:  # what a replay cannot do, and says why: not a difference found
            refused.append({"step": step.to_json(), "reason": getattr(exc, "reason", None) or str(exc)})
            alike.append(_alike(refused[-1]["reason"], step))
        except ChecksumError as exc:  # damage, not a difference: said of this step, and the others verified
            corrupted.append({"step": step.to_json(), "reason": exc.reason})
        except PdbgError:  # the recording's or the user's input, said in one line as every command says it
            raise
        except Exception as exc:  # noqa: BLE001 - a fault of the replayer's own on one step: the others verified
            refused.append({"step": step.to_json(), "reason": _replayer_fault(exc)})
            alike.append(_alike(refused[-1]["reason"], step))
        else:
            environment += [d for d in result.environment_differences if d not in environment]
            if not result.compared:  # nothing it could check: not a match
                refused.append({"step": step.to_json(), "reason": result.nothing_compared})
                alike.append(result.nothing_compared)
            elif result.match and result.unrecorded_rngs:  # (no claim that the call replays alone)
                in_order.append({"step": step.to_json(), "generators": result.unrecorded_rngs})
            elif result.match:
                matched += 1
                by_statistics += bool(result.by_statistics)
                statistics_why |= _by_statistics_why(result)
                if result.not_compared:  # matched in what was compared: the rest is said, never called a match
                    partly.append({"step": step.to_json(), "not_compared": result.not_compared})
                if result.unseen_writes:  # changed through .data where the recording could not see it: said too
                    unseen.append({"step": step.to_json(), "unseen_writes": result.unseen_writes})
            else:
                bad = [d.summary() for d in result.outputs if not d.match]
                hint = [w for w in result.warnings if "likely cause" in w or "changed since" in w]
                mismatches.append({"step": step.to_json(), "reason": "; ".join(bad + hint)})
        _progress(done, len(picks))
    replayed = len(picks) - len(refused) - len(corrupted)
    doc = {"replayed": replayed, "matched": matched, "mismatches": mismatches, "not_replayed": refused,
           "environment_differences": environment}
    if corrupted:
        doc["corrupted"] = corrupted
    if by_statistics:
        doc["by_statistics"] = by_statistics
    if partly:
        doc["partly_compared"] = partly
    if unseen:
        doc["unseen_writes"] = unseen
    if in_order:
        doc["matched_in_order_only"] = in_order
    if skipped:
        doc["statistics_only"] = skipped
    if forward_gone:
        doc["forward_not_kept"] = forward_gone
    if len(rec.ranks) > 1:
        doc["rank"] = rec.rank.rank
    live = rec.rank.status == "recording"  # read while it is written: what it records after was not verified
    if live:
        doc["still_recording"] = len(rec)
    if args.json:
        _emit(doc)
    else:
        head = (f"{matched} of {_count(replayed, 'step')} replayed bit for bit ({100.0 * matched / replayed:.1f}%)"
                if replayed else "no step replayed")
        if by_statistics:
            share = f"{100.0 * matched / replayed:.1f}%"
            why = "; ".join(text for key, text in _STATISTICS_WHY.items() if key in statistics_why)
            head = (f"{matched} of {_count(replayed, 'step')} replayed and matched ({share}), "
                    f"{by_statistics} of them by statistics only, not bit for bit: {why}")
        several = len(rec.ranks) > 1  # (a run of several ranks: only the one opened was replayed)
        print(f"{args.run}{f' (rank {rec.rank.rank} of {len(rec.ranks)}; --rank K for another)' if several else ''}: "
              f"{head}" + (f"; {_count(len(refused), 'step')} could not be replayed" if refused else "")
              + (f"; {_count(len(corrupted), 'step')} corrupted" if corrupted else "")
              + (f"; {_count(skipped, 'step')} kept statistics only, not replayable" if skipped else "")
              + (f" ({forward_gone} of them backward steps that kept their own tensors, not those of their forward "
                 f"call, {_forward_gone_why(rec)})" if forward_gone else ""))
        for m in mismatches:
            print(f"  {_step_text(m['step'])}: {m['reason']}")
        if in_order:
            print(f"{_count(len(in_order), 'step')} matched only as replayed here, in recording order, not counted bit "
                  "for bit: each draws from a generator whose state the recording does not hold, and replayed alone "
                  "would draw other numbers:")
            for m in in_order:
                print(f"  {_step_text(m['step'])}: {', '.join(m['generators'])}")
        if partly:
            print(f"{_count(len(partly), 'step')} of those matched in what was compared; not recorded as data, so "
                  "not compared:")
            by_part: dict[str, list[dict[str, Any]]] = {}
            for m in partly:
                by_part.setdefault(", ".join(m["not_compared"]), []).append(m)
            for parts, alike in by_part.items():
                steps = _step_text(alike[0]["step"]) if len(alike) == 1 else \
                    f"{len(alike)} steps ({_step_text(alike[0]['step'])} ... {_step_text(alike[-1]['step'])})"
                print(f"  {steps}: {parts}")
        if unseen:
            print(f"{_count(len(unseen), 'step')} of those matched in what was compared; changed through .data, which "
                  f"the recording does not see in a tensor over {layout.KEPT_INPUT_BYTES >> 20} MiB or not on the CPU, "
                  "so not compared as the call left them:")
            by_input: dict[str, list[dict[str, Any]]] = {}
            for m in unseen:
                by_input.setdefault(", ".join(m["unseen_writes"]), []).append(m)
            for parts, alike in by_input.items():
                print(f"  {_steps_text([m['step'] for m in alike])}: {parts}")
        if refused:
            print("could not be replayed:")
            by_reason: dict[str, list[dict[str, Any]]] = {}
            for m, text in zip(refused, alike):  # one line per reason: code defined in a notebook refuses every
                by_reason.setdefault(text, []).append(m)  # step alike, a method's self every call of it
            for text, steps in by_reason.items():
                reason = steps[0]["reason"]
                if any(m["reason"] != reason for m in steps):  # told apart by their numbers only
                    key = " (step N: each listed step's own number, or its forward's)" if "step N" in text else ""
                    print(f"  {_steps_text([m['step'] for m in steps])}: {text}{key}")
                elif len(steps) <= _ALIKE_LISTED:
                    for m in steps:
                        print(f"  {_step_text(m['step'])}: {reason}")
                else:
                    print(f"  {len(steps)} steps ({_step_text(steps[0]['step'])} ... "
                          f"{_step_text(steps[-1]['step'])}): {reason}")
        if corrupted:
            print("corrupted (a tensor's bytes read are not the bytes recorded):")
            for m in corrupted:
                print(f"  {_step_text(m['step'])}: {m['reason']}")
        if environment:  # a mismatch of a few ULP here is most likely this, not the code
            print("environment differs from the recording: " + "; ".join(environment))
        if live:
            print(f"the run is still being recorded: these are the {_count(len(rec), 'step')} committed when it was "
                  "read; the steps it records after were not verified (verify it again later)")
    if corrupted:  # (the other steps verified, and listed above)
        raise ChecksumError(f"{args.run}: the recorded tensors of {_count(len(corrupted), 'step')} are corrupted "
                            "(payload checksum mismatch, listed above): restore the recording from a copy or "
                            "record again")
    if not replayed:  # nothing was checked at all: not a pass (the listing above says why)
        if not kept:
            if rec.run_info.get("mode") == "full" and rec.run_info.get("every", 1) == 1:
                raise PdbgError(f"{args.run} kept the tensors of no step whole (its store could not keep up, and "
                                "payloads were dropped: see pdbg info); there is nothing to replay")
            raise PdbgError(f"{args.run} kept the tensors of no step (statistics only: mode='stats', or flight "
                            "mode that never wrote its ring): there is nothing to replay; record with mode='full' "
                            "or flight")
        which = "sampled" if len(picks) < n else "that kept their tensors"
        others = len(set(alike)) - 1
        raise PdbgError(f"none of the {_count(len(picks), 'step')} {which} could be replayed, so nothing was verified: "
                        f"{refused[0]['reason']}" + (f" (and {others} other reason{'s' if others > 1 else ''}, "
                                                     "listed above)" if others else ""))
    return 0 if not mismatches and not in_order else 1


def _alike(reason: str, step: Any) -> str:
    """``reason`` with the number of ``step`` and of its forward call written "step N": what a refusal says of
    every step of its kind alike (each call of a method whose self is not data names its own step)."""
    numbers = {step.index, step.forward}
    return re.sub(r"\bstep (\d+)\b", lambda m: "step N" if int(m[1]) in numbers else m[0], reason)


_NUMBERS_LISTED = 10  # runs of step numbers listed for one reason; more are counted


def _steps_text(steps: list[dict[str, Any]]) -> str:
    """The steps one reason applies to, by number ("steps 0-5", "steps 2, 5, 8, 11"), with their paper
    reference and name where they share one."""
    from replayer.recording import paper_reference

    runs: list[list[int]] = []
    for index in sorted(s["index"] for s in steps):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    numbers = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs[:_NUMBERS_LISTED]]
    more = f", ... ({len(steps)} steps)" if len(runs) > _NUMBERS_LISTED else ""
    names = {(shown(s["name"]), shown(paper_reference(s["paper"]))) for s in steps}
    name, ref = next(iter(names))
    who = f" ({ref} ({name}))" if len(names) == 1 and ref and ref != name else f" ({name})" if len(names) == 1 else ""
    return f"steps {', '.join(numbers)}{more}{who}"


def _cell(text: str, width: int) -> str:
    """``text`` in exactly ``width`` terminal columns (wide characters take two): padded, or cut
    with its end replaced by "…"."""
    from rich.cells import cell_len, set_cell_size

    return set_cell_size(text, width) if cell_len(text) <= width else set_cell_size(text, width - 1) + "…"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
