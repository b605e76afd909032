"""pdbg bisect RUN [--against OTHER] [--ops] [--scaler-skips] [--json],
pdbg find RUN WHERE --when EXPR [--from STEP] [--backward]

bisect: the origin of the first NaN/Inf (the first step, innermost where steps nest, whose results
went non-finite while everything it computed from was finite), from the recorded statistics; with
--ops, the operation inside it and the line of your code; with --against OTHER, the first step
where the two runs part for a reason of their own. Exit 1 when something was found (a step that made
the NaN/Inf, the step it came into, or a run that ended by an exception speaking of a NaN/Inf made
outside the recorded steps), 0 when clean.

find: the next step after --from (or the first) that matches WHERE (a step selector; "*" for any)
and the condition over its statistics, e.g. --when "output.absmax > 1e3"; --backward searches
towards the start (reverse-continue). Exit 0 when a step was found, 1 when none matches (like grep),
2 when WHERE names no step of the recording or --when a tensor no step has (a misspelt name).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from recorder.errors import PdbgError
from recorder.names import shown

from . import output
from .cmd_replay import STEP_HELP, _num, _open, _step_text, rank_option


def add_parsers(sub: Any) -> None:
    doc = (__doc__ or "").split("\n\n")
    p = sub.add_parser("bisect", help="find where the first NaN/Inf was born, or where two runs part",
                       description=doc[1])
    p.add_argument("run", metavar="RUN", help="the recording")
    p.add_argument("--against", metavar="OTHER", help="another recording of the same model: find the first divergence")
    p.add_argument("--ops", action="store_true", help="replay the origin step and name the first operation that made "
                   "a NaN/Inf from finite inputs, with its source line")
    p.add_argument("--use-bundled-source", action="store_true", help="a bundle, with --ops: replay with the code it "
                   "carries instead of the code installed here (runs that code)")
    p.add_argument("--script", metavar="PATH", help="with --ops: the training script's path now, if it moved since "
                   "recording")
    p.add_argument("--rank", type=int, metavar="K", help="look at rank K only (default: every rank of a run of "
                   "several processes, naming the rank of the origin)")
    p.add_argument("--scaler-skips", action="store_true", help="also look at the backward steps of iterations whose "
                   "optimizer step GradScaler skipped (overflows of the scaled loss, passed over by default)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=bisect)

    p = sub.add_parser("find", help="the next (or previous) step matching a condition", description=doc[2])
    p.add_argument("run", metavar="RUN", help="the recording")
    p.add_argument("where", metavar="WHERE", help="a step selector, or '*' for any step")
    p.add_argument("--when", metavar="EXPR", help="a condition over statistics: ROLE[.NAME].STAT OP NUMBER, joined "
                   "with and/or/not (NAME: a record name, output.after:args.0 and input.args.0:grad included; STAT: "
                   "min max mean std absmax norm nan inf; a complex tensor's are of its magnitudes |z|; output nan "
                   "and inf count the NaN/Inf of numbers returned that are no tensors too)")
    p.add_argument("--from", dest="start", metavar="STEP", help="start after (or before, with --backward) this step: "
                   + STEP_HELP)
    p.add_argument("--backward", action="store_true", help="search towards the start of the run")
    rank_option(p)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=find)


def bisect(args: argparse.Namespace) -> int:
    import replayer

    rec = _open(args.run, args.rank or 0)
    if args.against is not None and not args.against.strip():
        raise PdbgError("--against needs the path of the other recording (it was given empty)")
    if args.script is not None and not args.ops:
        raise PdbgError("--script says where the training script is for --ops (the replay of the origin step); "
                        "add --ops, or leave --script out")
    if args.use_bundled_source and not args.ops:
        raise PdbgError("--use-bundled-source says which code the replay of the origin step runs, for --ops; "
                        "add --ops, or leave --use-bundled-source out")
    if args.use_bundled_source and rec.bundle_info is None:
        raise PdbgError(f"{args.run} is not a bundle: there is no bundled source to use (--use-bundled-source "
                        "applies to a failure bundle, made by pdbg bundle)")
    if args.against:
        if args.ops or args.scaler_skips:
            raise PdbgError(f"{'--ops' if args.ops else '--scaler-skips'} applies to the origin of a NaN, not to "
                            "--against; use one or the other")
        div = replayer.first_divergence(rec, _open(args.against, args.rank or 0))
        if args.json:
            output.emit_json(json.dumps(div.to_json()))
        else:
            print(div.cause if div.step is None else f"root cause: {div.cause}")
            if div.followed:
                from replayer.bisect import SPREAD

                more = " ..." if len(div.followed) == SPREAD else ""
                print(f"steps after it that only followed (different inputs or parameters): "
                      f"{', '.join(str(s.index) for s in div.followed)}{more}; first "
                      f"{_step_text(div.followed[0].to_json())}")
            if div.distances:
                print("how far the other run's results are from this run's: "
                      + "; ".join(d.summary() for d in div.distances))
        return 1 if div.first_difference is not None else 0
    origin = replayer.first_nonfinite(rec, all_ranks=args.rank is None, scaler_skips=args.scaler_skips)
    op_note = None
    if args.ops:
        from replayer.bisect import entered_op_note, find_op

        if origin.step is not None or origin.raised_in is not None:  # (a step that raised: the NaN was made in it)
            find_op(origin, origin.step or origin.raised_in, use_bundled_source=args.use_bundled_source,
                    script=args.script)
        else:  # no step to replay: say why no operation is named
            origin.op_note = entered_op_note(origin)
        op_note = origin.op_note
    if args.json:
        doc = origin.to_json()
        if op_note:
            doc["op_note"] = op_note
        output.emit_json(json.dumps(doc))
        return 0 if origin.clean else 1
    if not origin.found:
        print(origin.cause)
        if origin.op is not None:
            _print_op(origin.op)
        if op_note and not origin.clean:
            print(op_note)
        return 0 if origin.clean else 1
    several = len(rec.ranks) > 1
    if origin.step is not None:
        print("origin: " + (f"rank {origin.rank} · " if several else "") + _paper_line(origin.step))
    print(origin.cause)
    for rank, other in sorted(origin.others.items()):
        first = other.step or other.entered
        if first is not None:
            print(f"rank {rank}: first non-finite at step {first.index} (iteration {first.iteration}): {other.cause}")
    if origin.op is not None:
        _print_op(origin.op)
    if op_note:  # why no operation is named, or that the code named is not the recorded code
        print(op_note)
    if origin.source_op is not None and origin.source is not None:  # where the mask's Inf it passed on was made
        src = origin.source_op
        print(f"{origin.source_what}: {src.name} in step {origin.source.index} ({shown(origin.source.name)})")
        if src.file:
            print(f"  {src.file}:{src.line}" + (f" in {src.function}" if src.function else ""))
            print(f"    {src.code}")
    if origin.spread:
        print("then: " + "; ".join(f"step {s.index} {shown(s.name)}"
                                   + (f" at {shown(s.module_path)}" if s.module_path else "") + " ("
                                   + ", ".join(p for p in (s.object_text, s.phase, f"iteration {s.iteration}") if p)
                                   + ")" for s in origin.spread))
    return 1


def _print_op(op: Any) -> None:
    """The operation ``--ops`` named (replayer.ops.OpReport): its name and node, the line of the user's code,
    its forward's line for a custom Function's backward, and its inputs."""
    ahead = op.forward is not None  # a custom Function's backward: its own line, then its forward's
    node = f" (in {op.node}, the custom Function's backward)" if ahead else \
        f" (in a hook of yours the backward ran for {op.node})" if op.hook else \
        f" (in {op.node}, the backward of the forward line below)" if op.file else f" (in {op.node})"
    print(f"operation: {op.name}" + (f" inside {op.within}" if op.within else "") + (node if op.node else ""))
    if op.file:
        print(f"  {op.file}:{op.line}" + (f" in {op.function}" if op.function else ""))
        print(f"    {op.code}")
    if ahead and op.forward.get("file"):
        fwd = op.forward
        print(f"  made by the forward at {fwd['file']}:{fwd['line']}"
              + (f" in {fwd['function']}" if fwd.get("function") else ""))
        print(f"    {fwd['code']}")
    for i, t in enumerate(op.inputs):
        print(f"  {op.name}'s input {i}{_input_words(t)}")


def _input_words(t: dict[str, Any]) -> str:
    """' (input_lengths): int64[2] values [6, 6]' of one of an operation's inputs (OpReport.inputs): its
    argument name (but self), dtype and shape, then its values (a small integer tensor, an integer list),
    or its statistics."""
    name = f" ({t['name']})" if t.get("name") and t["name"] != "self" else ""
    if "shape" not in t:  # an integer-list argument
        return f"{name}: {t['dtype']} {t.get('values')}"
    if "values" in t:
        return f"{name}: {t['dtype']}{t['shape']} values {t['values']}"
    st = t.get("stats") or {}
    if not (str(t["dtype"]).startswith(("float", "complex", "bfloat"))):  # integers, booleans: no NaN or Inf
        return f"{name}: {t['dtype']}{t['shape']} min {_num(st.get('min'))} max {_num(st.get('max'))}"
    of = " of |z|" if str(t["dtype"]).startswith("complex") else ""  # (as a complex tensor's statistics are)
    return (f"{name}: {t['dtype']}{t['shape']}{of} min {_num(st.get('min'))} max {_num(st.get('max'))} "
            f"nan {_num(st.get('nan'))} inf {_num(st.get('inf'))}")


def _paper_line(step: Any) -> str:
    from replayer.bisect import describe

    return describe(step).split(": ", 1)[1]


def find(args: argparse.Namespace) -> int:
    import replayer

    rec = _open(args.run, args.rank)
    start = rec.step(args.start) if args.start is not None else None
    where = None if args.where == "*" else args.where
    found = replayer.find(rec, where, args.when, start=start, backward=args.backward)
    if args.json:
        output.emit_json(json.dumps({"step": found.to_json() if found else None}))
    elif found is None:
        live = "" if rec.rank.status != "recording" or args.backward else \
            f" (of the {len(rec)} steps committed when read: the run is still being recorded; search it again later)"
        print("no step matches" + (f" before {start.index}" if args.backward and start else
                                   f" after {start.index}" if start else "") + live)
    else:
        print(_step_text(found.to_json()))
    return 0 if found is not None else 1
