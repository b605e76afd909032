"""pdbg bundle RUN STEP -o failure.pdbg [--iteration] [--verify] [--repro] [--script PATH] [--force] [--rank K] [--json]

Write one file that replays STEP on another machine: the step (a backward step with its forward
call), the steps inside it, their RNG, settings, module skeletons and payloads, the environment,
the source of the code involved and the recording's recipes, as a zip of a finished recording.
--iteration bundles the step's whole iteration; --verify replays the bundle before sealing it and
records the outcome; --repro also writes repro.py next to it; --script PATH says where the training
script is now, if it moved since recording. Elsewhere: `pdbg replay BUNDLE`.
"""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from . import output
from .cmd_replay import STEP_HELP, _open, _size, _step_text, rank_option


def add_parsers(sub: Any) -> None:
    doc = __doc__ or ""
    p = sub.add_parser("bundle", help="write a file that replays one step on another machine",
                       description=doc.split("\n\n", 1)[1], usage=doc.split("\n\n")[0])
    p.add_argument("run", metavar="RUN", help="the recording")
    p.add_argument("step", metavar="STEP", help=STEP_HELP)
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="the bundle to write (failure.pdbg)")
    p.add_argument("--iteration", action="store_true", help="bundle the step's whole iteration")
    p.add_argument("--verify", action="store_true", help="replay it once before sealing; record the outcome")
    p.add_argument("--repro", action="store_true", help="also write repro.py next to the bundle")
    p.add_argument("--script", metavar="PATH", help="the training script's path now, if it moved since recording "
                   "(a .py file; --script followed by anything else is --repro, as it was before)")
    p.add_argument("--force", action="store_true", help="replace FILE (and repro.py, with --repro) if it exists")
    rank_option(p)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=run)


def legacy_script_flag(argv: list[str]) -> list[str]:
    """``pdbg bundle ... --script`` not followed by a ``.py`` path: the flag that wrote repro.py before
    ``--repro`` (``--script run.zarr STEP -o f.pdbg``, ``... -o f.pdbg --script``), made ``--repro``."""
    out = list(argv)
    for i, word in enumerate(out):
        if word == "--script" and not (i + 1 < len(out) and out[i + 1].endswith(".py")):
            out[i] = "--repro"
    return out


def run(args: argparse.Namespace) -> int:
    import replayer

    rec = _open(args.run, args.rank)
    step = rec.step(args.step)
    info = replayer.bundle(rec, step, args.out, iteration=args.iteration, verify=args.verify,
                           script=args.script or False, repro=args.repro, overwrite=args.force)
    if args.json:
        output.emit_json(json.dumps(info.to_json()))
    else:
        print(f"{info.path}: {_size(info.bytes)}, {info.steps} step{'s' if info.steps != 1 else ''}; main "
              f"{_step_text(step.to_json())} (step {info.main_step} in the bundle)")
        print("source carried: " + (", ".join(_shown(f) for f in info.sources) if info.sources else
                                     "none (the steps' code is in the recording; a replay imports it)"))
        unseen = f"; not recorded as data, not compared: {', '.join(info.not_compared)}" if info.not_compared else ""
        if info.unseen_writes:  # (changed through .data by the replay, where the recording could not see it)
            unseen += (f"; not compared: {', '.join(info.unseen_writes)} as the call left "
                       f"{'them' if len(info.unseen_writes) > 1 else 'it'} (changed through .data, which the "
                       "recording does not see in a tensor over 1 MiB or not on the CPU)")
        if info.verified is not None:
            print("verified: " + (f"the bundle replays, a {info.verdict}{unseen}" if info.by_statistics else
                                  f"the bundle replays bit for bit{', in what was compared' + unseen if unseen else ''}"
                                  if info.verified else "MISMATCH when replayed from the bundle (see pdbg replay)"))
            if info.verified_with is not None:  # recorded in the bundle, for whoever replays it elsewhere
                from replayer.bundles import environment_text

                print(f"verified with: {environment_text(info.verified_with, rec.run_info)}")
        elif info.not_verified:
            print(f"not verified: it cannot be replayed here ({info.not_verified})")
        elif args.verify:
            print("not verified: " + (f"the step's output was not recorded as data ({', '.join(info.not_compared)})"
                                      if info.not_compared else "the step returned no tensor")
                  + ", so its replay had nothing to compare")
        for note in info.code_notes:
            print(f"warning: {note}")
        if info.unreplayable:
            print(f"warning: a replay of it will be refused: {info.unreplayable}")
        if info.script:
            print(f"repro script: {info.script} (python {shlex.quote(info.script.name)}: exit 0 on a match, 1 on a "
                  "mismatch)")
        print(f"elsewhere: pdbg replay {shlex.quote(info.path.name)}")
    return 0 if info.verified is not False else 1


def _shown(path: str) -> str:
    """A carried file's path, relative to the working directory when it is inside it."""
    import os

    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path
