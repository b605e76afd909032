"""The TUI on a million steps: how soon ``PdbgApp`` shows its first screen, and how fast the cursor moves.

Acceptance point: "opening a 1,000,000-step recording shows the first screen in < 1 s, and moving
the cursor one step or one page responds in < 50 ms (measured with the Pilot)".

The recordings are built as ``bench/bisect_scale.py`` builds them (a real ``recorder.record`` run of
its 25-block model, the writer items replayed at new indices into a real ``StoreWriter`` + ``Pipeline``,
a NaN planted at 90 % of the run): 1,000,000 steps, and 100 steps (one clean iteration) for
comparison. Each run is a fresh Python process (textual, torch, ``replayer`` and ``tui.app`` imported
before the clock starts) driving the app headless with Textual's Pilot at 120 x 40:

- **first screen**: ``t0``; ``rec = replayer.open(path); app = PdbgApp(rec)``; ``async with
  app.run_test(size=(120, 40)) as pilot: await pilot.pause()``; ``t1``. Then checked: the cursor is
  on step 0, the timeline's top row is step 0, the step pane's title is step 0's.
- **cursor**: each ``await pilot.press(key); await pilot.pause()`` timed alone (right/left: one step,
  pagedown/pageup: one page), at the start of the run and from step 500,000 (``app.timeline.go_to``);
  per press also when the first and the last frame after the key were done (key -> screen complete:
  the target's figure; the Pilot's own waiting puts a floor of ~60 ms under every round trip, shown
  with a key that has no binding), CPU time, time in ``show_step`` and in the garbage collector. Every
  press is checked to move the cursor by exactly one step / one page and the step pane to show it.
- One more process on the big recording with ``gc.freeze()`` after the first screen (what if), and,
  where a target is missed, a cProfile of that part in one more.

Headless, Textual computes every frame but does not encode it for a terminal; here each frame is
encoded too (``render_segments``; ``_display`` wrapped on that app instance), so the figures include
that, but not the write itself.

Usage:
  python bench/tui_scale.py                       # 1,000,000 + 100 steps, 3 fresh processes each (~9 min)
  python bench/tui_scale.py --write-docs          # also add/replace the section in docs/PERFORMANCE.md
  python bench/tui_scale.py --steps 100000 --repeat 1      # quick look
  python bench/tui_scale.py --keep DIR            # build the stores in DIR once, reuse them later
  python bench/tui_scale.py --profile first|right|pagedown|left|pageup    # cProfile of that part
  python bench/tui_scale.py --measure PATH [--part PART] [--gc-freeze]   # (child) JSON on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import hashlib
import io
import json
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bisect_scale  # noqa: E402 (bench/ is the script's directory): the model and the store builder
import textual
from docs_section import write_section

import replayer
from recorder.store import reader as reader_mod
from tui import views
from tui.app import PdbgApp, StepPane

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## TUI on a million steps"
SIZE = (120, 40)
FIRST_TARGET_S = 1.0
MOVE_TARGET_S = 0.050
MIDDLE = 500_000
KEYS = {"right": 50, "left": 50, "pagedown": 20, "pageup": 20}  # presses per key at each position
SIGN = {"right": 1, "left": -1, "pagedown": 1, "pageup": -1}
STEP_KEYS = ("right", "left")
PROJECT_DIRS = ("tui", "replayer", "recorder")
MIN_FRAME_CHARS = 32  # a frame that only moves the terminal cursor is ~10 characters
# event-loop and message plumbing: in every cumulative list, saying nothing about what is slow
PLUMBING = ("/asyncio/", "selectors.py", "threading.py", "concurrent/", "textual/_callback.py",
            "textual/message_pump.py", "textual/timer.py", "textual/app.py", "textual/pilot.py", "textual/_wait.py",
            "contextvars", "tui_scale.py", "epoll", "functools.py", "<built-in method builtins.exec>",
            "~:0 <method 'run'")
IDLE_KEY, IDLE_PRESSES = "f12", 20  # no binding: what the Pilot's round trip costs by itself


# -- the stores ---------------------------------------------------------------------------------------
@dataclass
class Store:
    name: str  # "1,000,000 steps"
    path: str
    steps: int
    iterations: int
    nan_iteration: int | None
    disk_bytes: int
    built_s: float


def build_stores(where: Path, steps: int) -> tuple[list[Store], dict[str, Any]]:
    """The big recording (NaN at 90 %) and a 100-step one, built as bench/bisect_scale.py builds them;
    reused from ``where`` when a previous run left them there (``stores.json``)."""
    index = where / "stores.json"
    if index.exists():
        saved = json.loads(index.read_text())
        stores = [Store(**s) for s in saved["stores"]]
        if saved["requested"] == steps and all(_complete(s) for s in stores):
            print(f"reusing the stores in {where}", flush=True)
            return stores, saved["sample"]
    where.mkdir(parents=True, exist_ok=True)
    iterations = bisect_scale.SAMPLE_ITERATIONS
    nan_sample = int(iterations * bisect_scale.NAN_AT)
    print(f"recording {iterations} iterations with recorder.record in {where} ...", flush=True)
    shutil.rmtree(where / "real.zarr", ignore_errors=True)
    sample = bisect_scale.record_real(where / "real.zarr", iterations, nan_sample)
    tpl = bisect_scale.templates(sample)
    small = bisect_scale.build(where / "check.zarr", tpl, iterations, nan_sample)
    diffs = bisect_scale.check(sample, small)
    if diffs:
        raise RuntimeError("the fast path's store differs from the real recording:\n  " + "\n  ".join(diffs))
    print(f"  check: a fast-path store of {small.steps} steps equals the real recording", flush=True)
    info = {"iterations": iterations, "steps": len(sample.items), "us_per_step": sample.us_per_step,
            "check_steps": small.steps}
    per = tpl.steps_per_iteration
    big_iterations = max(4, steps // per)
    stores = []
    big_nan = int(big_iterations * bisect_scale.NAN_AT)
    for name, its, nan in ((f"{big_iterations * per:,} steps", big_iterations, big_nan), (f"{per:,} steps", 1, None)):
        path = where / f"tui-{its}.zarr"
        shutil.rmtree(path, ignore_errors=True)
        print(f"building {its * per:,} steps ...", flush=True)
        built = bisect_scale.build(path, tpl, its, nan)
        print(f"  {built.steps:,} steps, {built.disk_bytes / 1e6:.1f} MB, {built.seconds:.0f} s", flush=True)
        stores.append(Store(name, str(path), built.steps, its, nan, built.disk_bytes, built.seconds))
    for tmp in ("real.zarr", "check.zarr"):
        shutil.rmtree(where / tmp, ignore_errors=True)
    index.write_text(json.dumps({"requested": steps, "sample": info, "stores": [asdict(s) for s in stores]}))
    return stores, info


def _complete(store: Store) -> bool:
    try:
        rec = replayer.open(store.path)
    except Exception:  # noqa: BLE001 (a missing or broken store is rebuilt)
        return False
    return rec.status == "complete" and len(rec) == store.steps


# -- the child: one fresh process driving the app -----------------------------------------------------
class Probe:
    """Encodes every frame the app computes, as a terminal driver would (``render_segments``), and
    notes when each was done; times ``show_step`` (the step pane's contents) and the garbage
    collector's pauses too. The wrappers are attributes of this app instance and the collector
    callback is removed again on exit."""

    def __init__(self, app: PdbgApp) -> None:
        self.app = app
        self.display = app._display
        self.show_step = app.show_step
        self.done: list[tuple[float, int]] = []  # (perf_counter at the end, characters) per frame
        self.encode_s = 0.0
        self.show_s = 0.0
        self.gc_s = 0.0
        self.gc_full = 0
        self._gc_start = 0.0

    def _gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start
            self.gc_full += info["generation"] == 2

    def __enter__(self) -> Probe:
        def display(screen: Any, renderable: Any) -> None:
            if renderable is not None and hasattr(renderable, "render_segments"):
                t = time.perf_counter()
                text = renderable.render_segments(self.app.console)
                done = time.perf_counter()
                self.encode_s += done - t
                if len(text) > MIN_FRAME_CHARS:
                    self.done.append((done, len(text)))
            self.display(screen, renderable)

        def show_step() -> None:
            t = time.perf_counter()
            self.show_step()
            self.show_s += time.perf_counter() - t

        self.app._display = display  # type: ignore[method-assign]
        self.app.show_step = show_step  # type: ignore[method-assign]
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._gc)
        for name in ("_display", "show_step"):
            self.app.__dict__.pop(name, None)

    def since(self, t: float) -> list[tuple[float, int]]:
        return [(done - t, chars) for done, chars in self.done if done > t]


def screen_lines(app: PdbgApp) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


def expected_title(rec: replayer.Recording, index: int) -> str:
    return views.step_view(rec.step(index)).title


def pane_title(app: PdbgApp) -> str:
    return app.query_one(StepPane).title.plain


def check_shown(app: PdbgApp, rec: replayer.Recording, index: int) -> list[str]:
    """What is wrong with the screen for the cursor on step ``index`` (nothing: []). ``rec``: a second
    Recording of the same store, so that the check reads nothing through the app's own reader (a step's
    tensor records read there would count towards the reader's whole-column reads)."""
    timeline = app.timeline
    out = []
    if timeline.step_index != index:
        out.append(f"cursor on step {timeline.step_index}, expected {index}")
    title = expected_title(rec, index)
    if title not in pane_title(app):
        out.append(f"step pane title {pane_title(app)!r}, expected {title!r}")
    row = timeline.cursor - timeline.scroll_offset.y
    if not 0 <= row < timeline.size.height:
        out.append(f"cursor row {row} is off the timeline (height {timeline.size.height})")
    elif f"{index:>6} " not in timeline.render_line(row).text:
        out.append(f"timeline row {row} does not show step {index}: {timeline.render_line(row).text!r}")
    return out


def whole_columns(app: PdbgApp) -> set[str]:
    """The columns the app's store reader holds whole (``RankReader._columns``; none where it has no such cache)."""
    return set(getattr(app.rec.rank, "_columns", {}))


async def timed_press(pilot: Any, frames: Probe, key: str, prof: cProfile.Profile | None) -> dict[str, Any]:
    """One ``await pilot.press(key); await pilot.pause()``: its wall and CPU time, when the first and
    the last frame after the key were encoded, and the time in ``show_step``."""
    at = pilot.app.timeline.step_index
    columns = whole_columns(pilot.app)
    show, enc, gc_s, gc_full = frames.show_s, frames.encode_s, frames.gc_s, frames.gc_full
    if prof is not None:
        prof.enable()
    c = time.process_time()
    t = time.perf_counter()
    await pilot.press(key)
    await pilot.pause()
    rt = time.perf_counter() - t
    cpu = time.process_time() - c
    if prof is not None:
        prof.disable()
    new = frames.since(t)
    return {"at": at, "rt": rt, "cpu": cpu, "first": new[0][0] if new else None, "last": new[-1][0] if new else None,
            "frames": len(new), "show": frames.show_s - show, "encode": frames.encode_s - enc,
            "gc": frames.gc_s - gc_s, "gc_full": frames.gc_full - gc_full,
            "whole": sorted(whole_columns(pilot.app) - columns)}


async def drive(path: Path, part: str, prof: cProfile.Profile | None, size: tuple[int, int],
                freeze: bool = False) -> dict[str, Any]:
    """Open the app and move the cursor; with ``prof``, only ``part`` runs under the profiler; with
    ``freeze``, ``gc.freeze()`` after the first screen (what if: the collector skips what startup made)."""
    out: dict[str, Any] = {}
    profile_first = prof is not None and part == "first"
    if profile_first:
        prof.enable()
    t0 = time.perf_counter()
    rec = replayer.open(path)
    app = PdbgApp(rec)
    t_app = time.perf_counter()
    with Probe(app) as frames:
        async with app.run_test(size=size) as pilot:
            t_ready = time.perf_counter()
            await pilot.pause()
            t1 = time.perf_counter()
            if profile_first:
                prof.disable()
            await pilot.wait_for_scheduled_animations()
            t2 = time.perf_counter()
            check_rec = replayer.open(path)
            lines = screen_lines(app)
            first_row = "".join(text for text, _ in app.model.row(0))[:40]
            problems = check_shown(app, check_rec, 0)
            if app.timeline.scroll_offset.y != 0:
                problems.append(f"timeline scrolled to {app.timeline.scroll_offset.y}")
            if not any(first_row in line for line in lines):
                problems.append(f"no screen line shows step 0's row {first_row!r}")
            if not any(f"{len(rec)} steps" in line for line in lines):
                problems.append("the header does not show the number of steps")
            shown = frames.since(t0)
            before_t1 = [d for d, _ in shown if d <= t1 - t0]
            out["first"] = {"open_app": t_app - t0, "run_test": t_ready - t_app, "pause": t1 - t_ready,
                            "total": t1 - t0, "first_frame": shown[0][0] if shown else None,
                            "last_frame": before_t1[-1] if before_t1 else None, "settled": t2 - t0,
                            "frames": len(shown), "show": frames.show_s, "encode": frames.encode_s,
                            "gc": frames.gc_s, "gc_full": frames.gc_full,
                            "problems": problems, "title": pane_title(app), "top_line": first_row,
                            "screen": lines}
            page = max(1, app.timeline.size.height - 1)
            out["page"] = page
            if freeze:
                gc.freeze()
            idle = [await timed_press(pilot, frames, IDLE_KEY, None) for _ in range(IDLE_PRESSES)]
            out["idle"] = {k: [r[k] for r in idle] for k in idle[0]}
            if app.timeline.step_index != 0:
                problems.append(f"{IDLE_KEY} moved the cursor to {app.timeline.step_index}")
            out["moves"] = {}
            for where, start in (("start", 0), ("middle", MIDDLE)):
                if start >= len(rec):
                    continue
                if start:
                    app.timeline.go_to(start)
                    await pilot.pause()
                problems = check_shown(app, check_rec, start)
                moves: dict[str, Any] = {}
                for key, presses in KEYS.items():
                    delta = SIGN[key] * (1 if key in STEP_KEYS else page)
                    samples = []
                    for _ in range(presses):
                        before = app.timeline.step_index
                        assert before is not None
                        samples.append(await timed_press(pilot, frames, key, prof if part == key else None))
                        target = max(0, min(len(rec) - 1, before + delta))
                        samples[-1]["moved"] = target != before  # at an end of the run a press cannot move
                        if app.timeline.step_index != target:
                            problems.append(f"{key} at step {before}: cursor on {app.timeline.step_index}, "
                                            f"expected {target}")
                        problems += [f"{key} to {target}: {p}" for p in check_shown(app, check_rec, target)]
                    moves[key] = {k: [r[k] for r in samples] for k in samples[0]}
                out["moves"][where] = {"from": start, "keys": moves, "problems": problems[:10],
                                       "problem_count": len(problems)}
            t = time.perf_counter()
            gc.collect()
            out["full_gc"] = {"s": time.perf_counter() - t, "objects": len(gc.get_objects())}
            if freeze:
                gc.unfreeze()
    out["steps"] = len(rec)
    return out


def child(path: Path, part: str, size: tuple[int, int], freeze: bool) -> None:
    """One fresh process: time the first screen and the cursor keys; JSON on stdout. With a
    ``part`` other than "time", that part runs under cProfile and its statistics go to stderr."""
    prof = cProfile.Profile() if part != "time" else None
    result = asyncio.run(drive(path, part, prof, size, freeze))
    if prof is not None:
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(35)
        stats.sort_stats("tottime").print_stats(20)
        print(text.getvalue(), file=sys.stderr)
        result["profile"] = top_functions(stats)
    print(json.dumps(result))


def top_functions(stats: pstats.Stats, n: int = 12) -> list[dict[str, Any]]:
    """The project's functions (tui/, replayer/, recorder/) by cumulative time, and the heaviest by own time."""
    rows = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rel = os.path.relpath(file, ROOT) if file.startswith(str(ROOT)) else file
        rel = rel.split("site-packages/", 1)[-1]
        if "/lib/python3" in rel:  # the standard library
            rel = "python3" + rel.split("/lib/python3", 1)[1]
        rows.append({"where": f"{rel}:{line} {func}", "calls": calls, "own": tottime, "cum": cumtime,
                     "project": rel.split(os.sep)[0] in PROJECT_DIRS})
    total = max((r["cum"] for r in rows), default=0.0)
    project = sorted((r for r in rows if r["project"]), key=lambda r: -r["cum"])[:n]
    library = sorted((r for r in rows if not r["project"] and not any(p in r["where"] for p in PLUMBING)),
                     key=lambda r: -r["cum"])[:n]
    own = sorted((r for r in rows if "epoll" not in r["where"]), key=lambda r: -r["own"])[:n]
    return [{**r, "total": total, "kind": "cumulative"} for r in project] + \
           [{**r, "total": total, "kind": "library"} for r in library] + \
           [{**r, "total": total, "kind": "own"} for r in own]


def fresh(path: str, size: tuple[int, int], part: str = "time", freeze: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", path, "--part", part,
           "--size", f"{size[0]}x{size[1]}"] + (["--gc-freeze"] if freeze else [])
    busy, own, t = machine_busy(), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
    if part != "time":
        print(out.stderr)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child_cpu = after.ru_utime + after.ru_stime - own.ru_utime - own.ru_stime
    result["others_cores"] = max(0.0, (machine_busy() - busy - child_cpu) / wall)
    return result


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (``/proc/stat``), 0 where there is none."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# -- report -----------------------------------------------------------------------------------------
def ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x >= 0.0995 else f"{x * 1e3:.1f}"


def p95(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(0.95 * len(s)) - 1))]


def _vals(xs: list[float | None]) -> list[float]:
    return [x for x in xs if x is not None]


def first_table(results: list[tuple[Store, list[dict[str, Any]]]]) -> str:
    lines = ["| recording | first screen: median ms | max ms | open + `PdbgApp(rec)` | `run_test` until ready | "
             "first `pause()` | `show_step` (in `on_mount`) | first frame encoded at | last frame before `t1` | "
             "settled | frames | checks |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for store, runs in results:
        f = [r["first"] for r in runs]

        def med(key: str, f: list[dict[str, Any]] = f) -> str:
            vals = _vals([x[key] for x in f])
            return ms(statistics.median(vals)) if vals else "—"

        problems = sum(len(x["problems"]) for x in f)
        lines.append(f"| {store.name} | **{med('total')}** | {ms(max(x['total'] for x in f))} | {med('open_app')} | "
                     f"{med('run_test')} | {med('pause')} | {med('show')} | {med('first_frame')} | "
                     f"{med('last_frame')} | {med('settled')} | {statistics.median(x['frames'] for x in f):.0f} | "
                     f"{'ok' if not problems else f'{problems} problems'} |")
    return "\n".join(lines)


def _med(xs: list[float], unit: float = 1e-3) -> str:
    if not xs:
        return "—"
    return ms(statistics.median(xs)) if unit < 1 else f"{statistics.median(xs):.0f}"


def _mm(xs: list[float]) -> str:
    return f"{ms(statistics.median(xs))} / {ms(max(xs))}" if xs else "—"


def _stats(xs: list[float]) -> str:
    return f"{ms(statistics.median(xs))} / {ms(p95(xs))} / {ms(max(xs))}" if xs else "—"


def moves_table(results: list[tuple[Store, list[dict[str, Any]]]]) -> str:
    lines = ["| recording | cursor at | key | presses | moved by | key → screen complete: median / p95 / max ms | "
             "key → first frame: median / max ms | Pilot round trip: median / p95 / max ms | CPU: median ms | "
             "`show_step`: median ms | frames | checks |", "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for store, runs in results:
        idle_rt = [t for r in runs for t in r["idle"]["rt"]]
        idle_cpu = [t for r in runs for t in r["idle"]["cpu"]]
        idle_frames = sum(n for r in runs for n in r["idle"]["frames"])
        lines.append(f"| {store.name} | start | {IDLE_KEY} (no binding) | {len(idle_rt)} | 0 | "
                     f"{'no frame' if not idle_frames else f'{idle_frames} frames'} | — | {_stats(idle_rt)} | "
                     f"{ms(statistics.median(idle_cpu))} | — | {idle_frames} | — |")
        page = runs[0]["page"]
        for where in runs[0]["moves"]:
            problems = sum(r["moves"][where]["problem_count"] for r in runs)
            for key in KEYS:
                per_run = [r["moves"][where]["keys"][key] for r in runs]

                def col(name: str, per_run: list[dict[str, Any]] = per_run) -> list[Any]:
                    return [x for m in per_run for x, moved in zip(m[name], m["moved"]) if moved]

                last, first = _vals(col("last")), _vals(col("first"))
                missing = len(col("last")) - len(last)
                edge = sum(len(m["moved"]) for m in per_run) - len(col("rt"))
                presses = f"{len(col('rt'))}" + (f" (+{edge} at an end: no move)" if edge else "")
                by = ("+" if SIGN[key] > 0 else "−") + ("1" if key in STEP_KEYS else f"{page} (a page)")
                start = runs[0]["moves"][where]["from"]
                check = "ok" if not problems else f"{problems} problems"
                if missing:
                    check += f", {missing} presses without a frame"
                lines.append(f"| {store.name} | {where} (step {start:,}) | {key} | {presses} | {by} | "
                             f"**{_stats(last)}** | {_mm(first)} | {_stats(col('rt'))} | {_med(col('cpu'))} | "
                             f"{_med(col('show'))} | {_med(col('frames'), 1.0)} | {check} |")
    return "\n".join(lines)


def _keys(run: dict[str, Any], keys: tuple[str, ...], name: str) -> list[float]:
    return _vals([x for w in run["moves"].values() for k in keys
                  for x, moved in zip(w["keys"][k][name], w["keys"][k]["moved"]) if moved])


PAGE_KEYS = tuple(k for k in KEYS if k not in STEP_KEYS)


def per_run_table(results: list[tuple[Store, list[dict[str, Any]]]]) -> str:
    lines = ["| recording | process | first screen ms | step keys → screen complete: median / max ms | "
             "page keys → screen complete: median / max ms | Pilot round trip, step keys: median / max ms | "
             "page keys: median / max ms | other processes' CPU meanwhile |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for store, runs in results:
        for i, r in enumerate(runs, 1):
            cells = []
            for name in ("last", "rt"):
                for keys in (STEP_KEYS, PAGE_KEYS):
                    xs = _keys(r, keys, name)
                    cells.append(_mm(xs))
            lines.append(f"| {store.name} | {i} | {ms(r['first']['total'])} | {' | '.join(cells)} | "
                         f"{r.get('others_cores', 0):.2f} cores |")
    return "\n".join(lines)


def targets(results: list[tuple[Store, list[dict[str, Any]]]]) -> tuple[list[str], list[str]]:
    """The target lines, and the parts that missed (for profiling)."""
    store, runs = results[0]
    first = max(r["first"]["total"] for r in runs)
    lines = [f"- first screen of {store.steps:,} steps < {FIRST_TARGET_S:.0f} s (slowest of {len(runs)} fresh "
             f"processes): {first:.3f} s — {'**met**' if first < FIRST_TARGET_S else '**not met**'}"]
    missed = [] if first < FIRST_TARGET_S else ["first"]
    for kind, keys in (("one step", STEP_KEYS), ("one page", PAGE_KEYS)):
        last = {k: [x for r in runs for x in _keys(r, (k,), "last")] for k in keys}
        rt = [x for r in runs for x in _keys(r, keys, "rt")]
        worst = max(max(v) for v in last.values())
        worst_p95 = max(p95(v) for v in last.values())
        median = statistics.median([x for v in last.values() for x in v])
        n = sum(len(v) for v in last.values())
        met = worst < MOVE_TARGET_S
        lines.append(f"- moving the cursor {kind} ({' / '.join(keys)}) < {MOVE_TARGET_S * 1e3:.0f} ms, key → screen "
                     f"complete: median {ms(median)} ms, p95 {ms(worst_p95)} ms (the worst key's), slowest of {n} "
                     f"presses "
                     f"{ms(worst)} ms — {'**met**' if met else '**not met**'}; the Pilot round trip "
                     f"(`press` + `pause`): median {ms(statistics.median(rt))} ms, slowest {ms(max(rt))} ms "
                     f"— {'**met**' if max(rt) < MOVE_TARGET_S else '**not met**'}")
        if not met:
            missed.append(max(keys, key=lambda k: max(last[k])))
    problems = sum(len(r["first"]["problems"]) + sum(w["problem_count"] for w in r["moves"].values())
                   for _, rs in results for r in rs)
    lines.append(f"- every screen checked (cursor, timeline row, step pane title): "
                 f"{'no problems' if not problems else f'**{problems} problems**'}")
    return lines, missed


def slowest_table(results: list[tuple[Store, list[dict[str, Any]]]], n: int = 8) -> str:
    """The slowest presses of the big recording (key → screen complete), with what they spent."""
    store, runs = results[0]
    rows = []
    for i, r in enumerate(runs, 1):
        for where, w in r["moves"].items():
            for key, m in w["keys"].items():
                for j in range(len(m["rt"])):
                    if m["moved"][j]:
                        rows.append((m["last"][j] or m["rt"][j], i, where, key, {k: v[j] for k, v in m.items()}))
    rows.sort(key=lambda row: -row[0])
    lines = ["| process | key | at step | key → screen complete ms | Pilot round trip ms | CPU ms | `show_step` ms | "
             "garbage collector ms (full collections) | whole columns read |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for last, i, _where, key, m in rows[:n]:
        whole = f"{len(m['whole'])} (`{m['whole'][0]}`, …)" if m["whole"] else "—"
        lines.append(f"| {i} | {key} | {m['at']:,} | {ms(last)} | {ms(m['rt'])} | {ms(m['cpu'])} | {ms(m['show'])} | "
                     f"{ms(m['gc'])} ({m['gc_full']}) | {whole} |")
    full = [r["full_gc"] for r in runs]
    fulls = sum(m["gc_full"][j] for r in runs for w in r["moves"].values() for m in w["keys"].values()
                for j in range(len(m["rt"])))
    presses = sum(len(m["rt"]) for r in runs for w in r["moves"].values() for m in w["keys"].values())
    gc_total = sum(x for r in runs for w in r["moves"].values() for m in w["keys"].values() for x in m["gc"])
    lines += ["", f"{fulls} full (generation 2) collections during {presses} presses of the {store.name} recording, "
              f"{gc_total * 1e3:.0f} ms in the collector in all; a `gc.collect()` of the process after the run: "
              f"{ms(statistics.median(f['s'] for f in full))} ms ({statistics.median(f['objects'] for f in full):,.0f} "
              f"objects tracked; the 100-step recording's process: "
              f"{ms(statistics.median(r['full_gc']['s'] for r in results[-1][1]))} ms)."]
    return "\n".join(lines)


def findings(results: list[tuple[Store, list[dict[str, Any]]]], frozen: dict[str, Any], slices: int | None) -> str:
    """A few sentences computed from the results: what moves fast, what does not, and why (``slices``: the
    reader's slices before a whole-column read when measured, None where it had no such constant)."""
    (big, runs), (small, small_runs) = results[0], results[-1]

    def all_of(rs: list[dict[str, Any]], name: str) -> list[float]:
        return [x for r in rs for x in _keys(r, STEP_KEYS + PAGE_KEYS, name)]

    def others(rs: list[dict[str, Any]]) -> float:
        return statistics.median(r.get("others_cores", 0.0) for r in rs)

    first = all_of(runs, "first")
    last, last_small = all_of(runs, "last"), all_of(small_runs, "last")
    cpu, show, gc_s = all_of(runs, "cpu"), all_of(runs, "show"), all_of(runs, "gc")
    frames = all_of(runs, "frames")
    fulls, presses, seconds = _gc_summary(runs)
    f_fulls, f_presses, f_seconds = _gc_summary([frozen])
    f_last = all_of([frozen], "last")
    pressed = [(m["show"][j], m["cpu"][j], m["last"][j] or m["rt"][j], m["whole"][j], m["at"][j])
               for r in runs for w in r["moves"].values() for m in w["keys"].values()
               for j in range(len(m["rt"])) if m["moved"][j]]
    whole = [p for p in pressed if p[3]]
    waited = [p for p in pressed if p[2] > 0.5 and p[1] < p[2] / 4]
    part = {k: statistics.median(r["first"][k] for r in runs) for k in ("open_app", "run_test", "pause", "show")}
    small_first = statistics.median(r["first"]["total"] for r in small_runs)
    full_s = statistics.median(r["full_gc"]["s"] for r in runs)
    ratio = statistics.median(last) / statistics.median(last_small)
    grows = "does not grow" if ratio < 1.5 else f"grows ({ratio:.1f} ×)"
    out = [f"- The timeline itself keeps up: the first frame after a key (the cursor row moved, the timeline "
           f"scrolled where it had to) is done after median {ms(statistics.median(first))} ms on {big.name}.",
           f"- The screen is complete when the step pane shows the new step: median {ms(statistics.median(last))} ms "
           f"on {big.name}, {ms(statistics.median(last_small))} ms on {small.name} — the cost of a move "
           f"{grows} with the recording (other processes used {others(runs):.1f} / {others(small_runs):.1f} cores "
           f"meanwhile). A press costs median {ms(statistics.median(cpu))} ms of CPU, of which "
           f"`show_step` (reading the step, `step_view`, `_drift`, filling the widgets) "
           f"{ms(statistics.median(show))} ms; the rest is Textual drawing what changed, in median "
           f"{statistics.median(frames):g} frame(s) per press.",
           f"- The garbage collector: {fulls} full collections in {presses} presses, {seconds * 1e3:.0f} ms "
           f"(median {ms(statistics.median(gc_s))} ms a press, a full one ~{ms(full_s)} ms: "
           f"the process holds ~{statistics.median(r['full_gc']['objects'] for r in runs) / 1e3:.0f}k tracked objects "
           f"from its imports, whatever the recording). After `gc.freeze()`: {f_fulls} full collections in "
           f"{f_presses} presses, {f_seconds * 1e3:.0f} ms; key → screen complete median / p95 "
           f"{ms(statistics.median(f_last))} / {ms(p95(f_last))} ms (without: {ms(statistics.median(last))} / "
           f"{ms(p95(last))} ms).",
           f"- The first screen of {big.name}: median {ms(statistics.median(r['first']['total'] for r in runs))} ms "
           f"({small.name}: {ms(small_first)} ms): `replayer.open` + `PdbgApp(rec)` {ms(part['open_app'])} ms, "
           f"`run_test` until ready {ms(part['run_test'])} ms (of which `show_step` for step 0 "
           f"{ms(part['show'])} ms), the first `pause()` {ms(part['pause'])} ms."]
    if whole:
        columns = sorted({c for p in whole for c in p[3]})
        out.append(f"- {len(whole)} press(es) made the app's store reader read whole columns ({len(columns)}: "
                   f"{', '.join(f'`{c}`' for c in columns[:4])}{', …' if len(columns) > 4 else ''}), at step(s) "
                   f"{', '.join(f'{p[4]:,}' for p in whole[:6])}: `show_step` "
                   f"{', '.join(f'{p[0]:.2f} s' for p in whole[:6])}"
                   + (f". The reader slices a column per step until it has been sliced {slices} times "
                      f"(`recorder/store/reader.py`, `RankReader.rows`), then reads it whole: {big.name} make that "
                      f"millions of tensor records" if slices else "") + ".")
    if waited:
        out.append(f"- {len(waited)} press(es) took over 0.5 s with under a quarter of that in CPU time (e.g. "
                   f"{ms(waited[0][2])} ms with {ms(waited[0][1])} ms of CPU): the process waited, for the CPU or "
                   f"the disk; other processes used {others(runs):.1f} of {os.cpu_count()} CPUs meanwhile (median).")
    return "\n".join(out)


def _gc_summary(runs: list[dict[str, Any]]) -> tuple[int, int, float]:
    """Full collections, moved presses and seconds in the collector during the presses of ``runs``."""
    fulls = presses = 0
    seconds = 0.0
    for r in runs:
        for w in r["moves"].values():
            for m in w["keys"].values():
                for j, moved in enumerate(m["moved"]):
                    if moved:
                        fulls += m["gc_full"][j]
                        presses += 1
                        seconds += m["gc"][j]
    return fulls, presses, seconds


def freeze_text(store: Store, runs: list[dict[str, Any]], frozen: dict[str, Any]) -> str:
    """What if the app froze its startup objects (``gc.freeze()``): one more process, cursor keys only."""
    lines = ["What if the garbage collector left alone what startup made: one more process on the "
             f"{store.name} recording, the same presses after `gc.freeze()` (right after the first screen; "
             "a diagnostic, not part of the target):", "",
             "| run | step keys → screen complete: median / p95 / max ms | page keys: median / p95 / max ms | "
             "full collections / presses | ms in the collector | `gc.collect()` after the run |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, rs in (("as measured above", runs), ("`gc.freeze()` after the first screen", [frozen])):
        fulls, presses, seconds = _gc_summary(rs)
        step = [x for r in rs for x in _keys(r, STEP_KEYS, "last")]
        page = [x for r in rs for x in _keys(r, PAGE_KEYS, "last")]
        full = statistics.median(r["full_gc"]["s"] for r in rs)
        lines.append(f"| {name} | {_stats(step)} | {_stats(page)} | {fulls} / {presses} | {seconds * 1e3:.0f} | "
                     f"{ms(full)} ms |")
    return "\n".join(lines)


def profile_text(profiles: dict[str, dict[str, Any]]) -> str:
    if not profiles:
        return ""
    out = ["### Where the time goes", ""]
    for part, result in profiles.items():
        rows = result["profile"]
        total = rows[0]["total"] if rows else 0.0
        what = ("the first screen" if part == "first"
                else f"{sum(KEYS[part] for _ in result['moves'])} presses of {part} (both positions)")
        out += [f"cProfile of {what} (one more fresh process, {total:.2f} s under the profiler; "
                f"`python bench/tui_scale.py --profile {part}`):", "",
                "| function (project files, by cumulative time) | calls | cumulative s | own s |",
                "|---|---:|---:|---:|"]
        out += [f"| `{r['where']}` | {r['calls']:,} | {r['cum']:.3f} | {r['own']:.3f} |"
                for r in rows if r["kind"] == "cumulative"]
        out += ["", "| library functions by cumulative time (event-loop plumbing left out) | calls | cumulative s | "
                "own s |", "|---|---:|---:|---:|"]
        out += [f"| `{r['where']}` | {r['calls']:,} | {r['cum']:.3f} | {r['own']:.3f} |"
                for r in rows if r["kind"] == "library"]
        out += ["", "| heaviest functions by own time (waiting in `epoll` left out) | calls | own s |",
                "|---|---:|---:|"]
        out += [f"| `{r['where']}` | {r['calls']:,} | {r['own']:.3f} |" for r in rows if r["kind"] == "own"]
        out.append("")
    return "\n".join(out)


def section(saved: dict[str, Any]) -> str:
    stores = [Store(**s) for s in saved["stores"]]
    results = list(zip(stores, saved["runs"]))
    sample, frozen, profiles = saved["sample"], saved["frozen"], saved["profiles"]
    repeat, size, command = saved["repeat"], tuple(saved["size"]), saved["command"]
    target_lines, _ = targets(results)
    sizes = "\n".join(["| recording | steps | iterations | NaN planted in iteration | on disk | built in |",
                       "|---|---:|---:|---:|---:|---:|"] +
                      [f"| {s.name} | {s.steps:,} | {s.iterations:,} | "
                       f"{'—' if s.nan_iteration is None else f'{s.nan_iteration:,}'} | {s.disk_bytes / 1e6:.1f} MB | "
                       f"{s.built_s:.0f} s |" for s in stores])
    page = results[0][1][0]["page"]
    idle = [t for r in results[0][1] for t in r["idle"]["rt"]]
    return f"""{SECTION}

Measured on {saved["when"]} by `{command}`. Acceptance point: opening a
1,000,000-step recording shows the first screen in < {FIRST_TARGET_S:.0f} s, and moving the cursor one step or one
page responds in < {MOVE_TARGET_S * 1e3:.0f} ms (measured with the Pilot).

### What was measured

Each run is a new Python process (textual, torch, `replayer` and `tui.app` imported before the clock
starts) driving `tui.app.PdbgApp` headless with Textual's Pilot in a {size[0]} × {size[1]} terminal (under
{PdbgApp.WIDE} columns the step pane sits below the timeline: the timeline shows {page + 1} rows);
{repeat} processes per recording, alternating between the recordings.

- **first screen**: from `t0 = perf_counter()`: `rec = replayer.open(path); app = PdbgApp(rec)`, then
  `async with app.run_test(size={size}) as pilot: await pilot.pause()`, `t1`. By then the app is
  composed and mounted, `on_mount` has run (the step pane filled for step 0) and `pause()` has forced the
  screen's update (layout, every widget's lines). Its parts: `replayer.open` + `PdbgApp(rec)` (the
  timeline's view model), `run_test` until the app is ready, that first `pause()`; "first frame
  encoded at" / "last frame before `t1`": when the first / last frame of the first screen had been
  turned into terminal output; "settled": after a further `pilot.wait_for_scheduled_animations()`.
  Checked after `t1`: the cursor is on step 0, the timeline's top row on the screen is step 0's, the
  step pane's title is step 0's, the header shows the number of steps.
- **cursor**: {", ".join(f"{n} × {k}" for k, n in KEYS.items())} (right/left one step, pagedown/pageup one page:
  the timeline's height less one, {page} rows), each press timed alone, first with the cursor at the
  start of the run (after the first screen), then after `app.timeline.go_to({MIDDLE:,}); await pilot.pause()`
  (there every move scrolls the timeline). Checked after every press: the cursor moved by exactly one
  step / one page, the step pane shows the step at the cursor, the timeline shows it on the cursor row
  (checked through a second `Recording` of the store, so the app's reader sees only the app's reads).
  Per press:
  - **Pilot round trip**: `await pilot.press(key); await pilot.pause()`. Its floor is the Pilot's own
    waiting: `press` waits twice and `pause` once for the process to be idle (`textual._wait.wait_for_idle`:
    sleeps of 20 ms until one passes with < 1 ms of CPU), so no round trip is shorter than ~60 ms: a key
    with no binding ({IDLE_KEY}, {IDLE_PRESSES} presses a process) takes median {ms(statistics.median(idle))} ms.
  - **key → first frame** / **key → screen complete**: from the `press` call to the end of the first /
    the last frame (with content) encoded during that round trip; the app runs meanwhile as it would in
    a terminal (its screen updates on its own timer, at most 60 a second). The first frame is the
    timeline with the cursor moved; the screen is complete when the step pane shows the new step. The
    target is judged on **key → screen complete**.
  - CPU: process time during the round trip; `show_step`: time in `PdbgApp.show_step` (the step
    pane's contents: the step's records, `views.step_view`, `_drift`, filling the widgets; Textual's
    layout and drawing of them come after); garbage collector: time in `gc` collections
    (`gc.callbacks`).
- Headless, Textual computes every frame but writes nothing; here each frame is also encoded as a
  terminal driver would (`render_segments` on the app's console; `PdbgApp._display` and `show_step`
  are wrapped on the app instance to note times), so the figures include that, not the write itself.
- The recordings are built as `bench/bisect_scale.py` builds them (see "NaN origin on a million steps"):
  {sample['iterations']} iterations of its 25-block model recorded with `recorder.record(mode="stats")`, the writer
  items replayed at new indices into a real `StoreWriter` + `Pipeline` (a store of {sample['check_steps']:,} steps
  made that way checked equal to the real recording first); 100 steps an iteration, 3 tensor records
  a step, a NaN planted at 90 % of the big run. The 100-step recording (one clean iteration) is the
  comparison: what the TUI costs whatever the recording's size.

Machine: {bisect_scale.machine()}, textual {textual.__version__}.
Sources: {saved["sources"]}.

{sizes}

### Results

{first_table(results)}

{moves_table(results)}

Per process:

{per_run_table(results)}

The slowest presses ({results[0][0].name}):

{slowest_table(results)}

{freeze_text(stores[0], results[0][1], frozen)}

### Reading the results

{findings(results, frozen, saved.get("slices_before_whole"))}

{profile_text(profiles)}
### Target

{chr(10).join(target_lines)}
"""


def report(saved: dict[str, Any], write_docs: bool) -> None:
    """Print the tables of one measuring run (``saved``: what ``main`` collected); write the docs section."""
    stores = [Store(**s) for s in saved["stores"]]
    results = list(zip(stores, saved["runs"]))
    frozen, profiles = saved["frozen"], saved["profiles"]
    for text in (first_table(results), moves_table(results), per_run_table(results), slowest_table(results),
                 freeze_text(stores[0], results[0][1], frozen),
                 findings(results, frozen, saved.get("slices_before_whole")), profile_text(profiles)):
        print()
        print(text)
    print("\n".join(targets(results)[0]))
    if write_docs:
        write_section(SECTION, section(saved))


def _size(text: str) -> tuple[int, int]:
    width, _, height = text.partition("x")
    return int(width), int(height)


def sources() -> str:
    """The commit, and a hash of the TUI's and replayer's sources as measured (others may be editing them)."""
    files = sorted([*ROOT.glob("tui/*.py"), *ROOT.glob("replayer/*.py"), *ROOT.glob("recorder/**/*.py")])
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "tui", "replayer", "recorder"], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.strip()
    return (f"commit {head.stdout.strip() or '?'}{' (tui/, replayer/ or recorder/ modified)' if dirty else ''}, "
            f"sha256 {digest} of tui/*.py, replayer/*.py, recorder/**/*.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="steps of the big recording (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per recording (default 3)")
    parser.add_argument("--write-docs", action="store_true", help=f"add/replace {SECTION!r} in docs/PERFORMANCE.md")
    parser.add_argument("--size", type=_size, default=SIZE, help="terminal size, WxH (default 120x40)")
    parser.add_argument("--keep", type=Path, help="build the stores here and keep them (reused when present)")
    parser.add_argument("--profile", choices=("first", *KEYS), help="cProfile that part (big recording) instead")
    parser.add_argument("--json", type=Path, help="also save the raw results here (JSON)")
    parser.add_argument("--report", type=Path, help="no measuring: the tables (and --write-docs) from a --json file")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=("time", "first", *KEYS), default="time", help=argparse.SUPPRESS)
    parser.add_argument("--gc-freeze", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        child(args.measure, args.part, args.size, args.gc_freeze)
        return
    if args.report:
        report(json.loads(args.report.read_text()), args.write_docs)
        return
    where = args.keep or Path(tempfile.mkdtemp(prefix="pdbg-tui-scale-"))
    try:
        stores, sample = build_stores(where, args.steps)
        if args.profile:
            fresh(stores[0].path, args.size, args.profile)
            return
        when, measured_sources = time.strftime("%Y-%m-%d %H:%M"), sources()
        results: list[tuple[Store, list[dict[str, Any]]]] = [(s, []) for s in stores]
        for i in range(args.repeat):
            for store, runs in results:
                r = fresh(store.path, args.size)
                runs.append(r)
                print(f"  {store.name}, process {i + 1}: first screen {ms(r['first']['total'])} ms", flush=True)
        print("what if: gc.freeze() after the first screen ...", flush=True)
        frozen = fresh(stores[0].path, args.size, freeze=True)
        _, missed = targets(results)
        profiles = {}
        for part in missed:
            print(f"target missed: profiling {part} ...", flush=True)
            profiles[part] = fresh(stores[0].path, args.size, part)
        saved = {"when": when, "sources": measured_sources, "repeat": args.repeat,
                 "slices_before_whole": getattr(reader_mod, "_SLICES_BEFORE_WHOLE", None),
                 "size": args.size, "command": ("python bench/tui_scale.py " + " ".join(sys.argv[1:])).strip(),
                 "sample": sample, "stores": [asdict(s) for s in stores], "runs": [runs for _, runs in results],
                 "frozen": frozen, "profiles": profiles}
        if args.json:
            args.json.write_text(json.dumps(saved))
        report(saved, args.write_docs)
    finally:
        if args.keep is None:
            shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
