"""The TUI on a million steps: how soon ``PdbgApp`` shows its first screen, and how fast the cursor moves.

Acceptance point: "opening a 1,000,000-step recording shows the first screen in < 1 s, and moving
the cursor one step or one page responds in < 50 ms (measured with the Pilot)".

The recordings are built as ``bench/bisect_scale.py`` builds them (a real ``recorder.record`` run of
a 25-block model, its writer items replayed at new indices into a real ``StoreWriter`` + ``Pipeline``;
a NaN planted at 90 % of the run): 1,000,000 steps, and 100 steps (one clean iteration) for
comparison. Each measurement is a fresh Python process (textual, torch, ``replayer`` and ``tui.app``
imported before the clock starts) driving the app headless with Textual's Pilot at 120 x 40:

- **first screen**: ``t0``; ``rec = replayer.open(path); app = PdbgApp(rec)``; ``async with
  app.run_test(size=(120, 40)) as pilot: await pilot.pause()``; ``t1``. Then checked: the cursor is
  on step 0, the timeline's top row is step 0, the step pane's title is step 0's.
- **cursor**: ``await pilot.press(key); await pilot.pause()`` timed per key press, for right/left
  (one step) and pagedown/pageup (one page), at the start of the run and around step 500,000
  (``app.timeline.go_to(500_000)`` first); every press checked to move the cursor by exactly one
  step / one page and the step pane to show the step at the cursor.

Headless, Textual computes every frame (layout, each widget's lines, the screen update) but does not
encode it for a terminal; this benchmark makes the app encode each frame too (its ``_display`` wrapped
on that app instance to call ``render_segments``), so the figures include what a terminal would add
but the write itself.

Usage:
  python bench/tui_scale.py                       # 1,000,000 + 100 steps, 3 fresh processes each (~3 min)
  python bench/tui_scale.py --write-docs          # also add/replace the section in docs/PERFORMANCE.md
  python bench/tui_scale.py --steps 100000 --repeat 1      # quick look
  python bench/tui_scale.py --keep DIR            # build the stores in DIR once, reuse them later
  python bench/tui_scale.py --profile first|right|pagedown|left|pageup    # cProfile of that part
  python bench/tui_scale.py --measure PATH [--part PART]   # (child) JSON on stdout
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
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
from tui import views
from tui.app import PdbgApp

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
    for name, its, nan in ((f"{big_iterations * per:,} steps", big_iterations, int(big_iterations * bisect_scale.NAN_AT)),
                           (f"{per:,} steps", 1, None)):
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
class Frames:
    """Encodes every frame the app computes, as a terminal driver would (``render_segments``), and
    notes when each was done; times ``show_step`` (the step pane's contents) too. Both wrappers are
    attributes of this app instance, removed on exit."""

    def __init__(self, app: PdbgApp) -> None:
        self.app = app
        self.display = app._display
        self.show_step = app.show_step
        self.done: list[tuple[float, int]] = []  # (perf_counter at the end, characters) per frame
        self.encode_s = 0.0
        self.show_s = 0.0

    def __enter__(self) -> Frames:
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
        return self

    def __exit__(self, *exc: object) -> None:
        for name in ("_display", "show_step"):
            self.app.__dict__.pop(name, None)

    def since(self, t: float) -> list[tuple[float, int]]:
        return [(done - t, chars) for done, chars in self.done if done > t]


def screen_lines(app: PdbgApp) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


def expected_title(rec: replayer.Recording, index: int) -> str:
    return views.step_view(rec.step(index)).title


def pane_title(app: PdbgApp) -> str:
    return str(app.query_one("#step-title").render())


def check_shown(app: PdbgApp, rec: replayer.Recording, index: int) -> list[str]:
    """What is wrong with the screen for the cursor on step ``index`` (nothing: [])."""
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


async def timed_press(pilot: Any, frames: Frames, key: str, prof: cProfile.Profile | None) -> dict[str, Any]:
    """One ``await pilot.press(key); await pilot.pause()``: its wall and CPU time, when the first and
    the last frame after the key were encoded, and the time in ``show_step``."""
    show, enc = frames.show_s, frames.encode_s
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
    return {"rt": rt, "cpu": cpu, "first": new[0][0] if new else None, "last": new[-1][0] if new else None,
            "frames": len(new), "show": frames.show_s - show, "encode": frames.encode_s - enc}


async def drive(path: Path, part: str, prof: cProfile.Profile | None) -> dict[str, Any]:
    """Open the app and move the cursor; with ``prof``, only ``part`` runs under the profiler."""
    out: dict[str, Any] = {}
    profile_first = prof is not None and part == "first"
    if profile_first:
        prof.enable()
    t0 = time.perf_counter()
    rec = replayer.open(path)
    app = PdbgApp(rec)
    t_app = time.perf_counter()
    with Frames(app) as frames:
        async with app.run_test(size=SIZE) as pilot:
            t_ready = time.perf_counter()
            await pilot.pause()
            t1 = time.perf_counter()
            if profile_first:
                prof.disable()
            await pilot.wait_for_scheduled_animations()
            t2 = time.perf_counter()
            lines = screen_lines(app)
            first_row = "".join(text for text, _ in app.model.row(0))[:40]
            problems = check_shown(app, rec, 0)
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
                            "problems": problems, "title": pane_title(app), "top_line": first_row,
                            "screen": lines}
            page = max(1, app.timeline.size.height - 1)
            out["page"] = page
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
                problems = check_shown(app, rec, start)
                moves: dict[str, Any] = {}
                for key, presses in KEYS.items():
                    delta = SIGN[key] * (1 if key in STEP_KEYS else page)
                    samples = []
                    for _ in range(presses):
                        before = app.timeline.step_index
                        assert before is not None
                        samples.append(await timed_press(pilot, frames, key, prof if part == key else None))
                        target = max(0, min(len(rec) - 1, before + delta))
                        if app.timeline.step_index != target:
                            problems.append(f"{key} at step {before}: cursor on {app.timeline.step_index}, "
                                            f"expected {target}")
                        problems += [f"{key} to {target}: {p}" for p in check_shown(app, rec, target)]
                    moves[key] = {k: [r[k] for r in samples] for k in samples[0]}
                out["moves"][where] = {"from": start, "keys": moves, "problems": problems[:10],
                                       "problem_count": len(problems)}
    out["steps"] = len(rec)
    return out


def child(path: Path, part: str) -> None:
    """One fresh process: time the first screen and the cursor keys; JSON on stdout. With a
    ``part`` other than "time", that part runs under cProfile and its statistics go to stderr."""
    prof = cProfile.Profile() if part != "time" else None
    result = asyncio.run(drive(path, part, prof))
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
        rows.append({"where": f"{rel}:{line} {func}", "calls": calls, "own": tottime, "cum": cumtime,
                     "project": rel.split(os.sep)[0] in PROJECT_DIRS})
    total = max((r["cum"] for r in rows), default=0.0)
    project = sorted((r for r in rows if r["project"]), key=lambda r: -r["cum"])[:n]
    own = sorted(rows, key=lambda r: -r["own"])[:n]
    return [{**r, "total": total, "kind": "cumulative"} for r in project] + \
           [{**r, "total": total, "kind": "own"} for r in own]


def fresh(path: str, part: str = "time") -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", path, "--part", part]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-4000:]}")
    if part != "time":
        print(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
             "first `pause()` | of which `show_step` | first frame encoded at | last frame before `t1` | settled | "
             "frames | checks |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
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
                    return [x for m in per_run for x in m[name]]

                last, first = _vals(col("last")), _vals(col("first"))
                missing = len(col("last")) - len(last)
                by = ("+" if SIGN[key] > 0 else "−") + ("1" if key in STEP_KEYS else f"{page} (a page)")
                start = runs[0]["moves"][where]["from"]
                check = "ok" if not problems else f"{problems} problems"
                if missing:
                    check += f", {missing} presses without a frame"
                lines.append(f"| {store.name} | {where} (step {start:,}) | {key} | {len(col('rt'))} | {by} | "
                             f"**{_stats(last)}** | {ms(statistics.median(first))} / {ms(max(first))} | "
                             f"{_stats(col('rt'))} | {ms(statistics.median(col('cpu')))} | "
                             f"{ms(statistics.median(col('show')))} | {statistics.median(col('frames')):.0f} | {check} |")
    return "\n".join(lines)


def _keys(run: dict[str, Any], keys: tuple[str, ...], name: str) -> list[float]:
    return _vals([x for w in run["moves"].values() for k in keys for x in w["keys"][k][name]])


PAGE_KEYS = tuple(k for k in KEYS if k not in STEP_KEYS)


def per_run_table(results: list[tuple[Store, list[dict[str, Any]]]]) -> str:
    lines = ["| recording | process | first screen ms | step keys → screen complete: median / max ms | "
             "page keys → screen complete: median / max ms | Pilot round trip, step keys: median / max ms | "
             "page keys: median / max ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for store, runs in results:
        for i, r in enumerate(runs, 1):
            cells = []
            for name in ("last", "rt"):
                for keys in (STEP_KEYS, PAGE_KEYS):
                    xs = _keys(r, keys, name)
                    cells.append(f"{ms(statistics.median(xs))} / {ms(max(xs))}")
            lines.append(f"| {store.name} | {i} | {ms(r['first']['total'])} | {' | '.join(cells)} |")
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
                     f"complete: median {ms(median)} ms, p95 {ms(worst_p95)} ms, slowest of {n} presses "
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


def profile_text(profiles: dict[str, dict[str, Any]]) -> str:
    if not profiles:
        return ""
    out = ["### Where the time goes", ""]
    for part, result in profiles.items():
        rows = result["profile"]
        total = rows[0]["total"] if rows else 0.0
        what = "the first screen" if part == "first" else f"{sum(KEYS[part] for _ in result['moves'])} presses of {part}"
        out += [f"cProfile of {what} (one fresh process, {total:.2f} s under the profiler; "
                f"`python bench/tui_scale.py --profile {part}`):", "",
                "| function (project files, by cumulative time) | calls | cumulative s | own s |", "|---|---:|---:|---:|"]
        out += [f"| `{r['where']}` | {r['calls']:,} | {r['cum']:.3f} | {r['own']:.3f} |"
                for r in rows if r["kind"] == "cumulative"]
        out += ["", "| heaviest functions by own time | calls | own s |", "|---|---:|---:|"]
        out += [f"| `{r['where']}` | {r['calls']:,} | {r['own']:.3f} |" for r in rows if r["kind"] == "own"]
        out.append("")
    return "\n".join(out)


def section(stores: list[Store], sample: dict[str, Any], results: list[tuple[Store, list[dict[str, Any]]]],
            profiles: dict[str, dict[str, Any]], repeat: int, command: str) -> str:
    big = stores[0]
    target_lines, _ = targets(results)
    sizes = "\n".join([f"| recording | steps | iterations | NaN planted in iteration | on disk | built in |",
                       "|---|---:|---:|---:|---:|---:|"] +
                      [f"| {s.name} | {s.steps:,} | {s.iterations:,} | "
                       f"{'—' if s.nan_iteration is None else f'{s.nan_iteration:,}'} | {s.disk_bytes / 1e6:.1f} MB | "
                       f"{s.built_s:.0f} s |" for s in stores])
    page = results[0][1][0]["page"]
    return f"""{SECTION}

Measured on {time.strftime("%Y-%m-%d %H:%M")} by `{command}`. Acceptance point: opening a
1,000,000-step recording shows the first screen in < {FIRST_TARGET_S:.0f} s, and moving the cursor one step or one page
responds in < {MOVE_TARGET_S * 1e3:.0f} ms (measured with the Pilot).

### What was measured

Each figure comes from a new Python process (textual, torch, `replayer` and `tui.app` imported before the
clock starts) driving `tui.app.PdbgApp` headless with Textual's Pilot, {SIZE[0]} × {SIZE[1]} cells; {repeat}
processes per recording.

- **first screen**: from `t0 = perf_counter()`: `rec = replayer.open(path); app = PdbgApp(rec)`, then
  `async with app.run_test(size={SIZE}) as pilot: await pilot.pause()` (the app composed and mounted,
  `on_mount` run — the timeline model built, the step pane filled for step 0 — and the screen laid out
  and rendered: `pause()` forces the screen's update), `t1`. Shown as its parts: opening + the view
  model, `run_test` until the app is ready, that first `pause()`. "first frame encoded at": when the
  first frame had been turned into terminal output; "settled": after a further
  `pilot.wait_for_scheduled_animations()` (nothing more to draw). Checked after `t1`: the cursor is on
  step 0, the timeline's top row on the screen is step 0's, the step pane's title is step 0's
  (`views.step_view(rec.step(0)).title`), the header shows the number of steps.
- **cursor**: each `await pilot.press(key); await pilot.pause()` timed alone: right, left (one step),
  pagedown, pageup (one page: the timeline's height less one, {page} rows), {", ".join(f"{n} × {k}" for k, n in KEYS.items())},
  with the cursor at the start of the run (after the first screen) and after
  `app.timeline.go_to({MIDDLE:,}); await pilot.pause()` (the middle of the run: every move scrolls the
  timeline, so every row is redrawn). Checked after every press: the cursor moved by exactly one step /
  one page, the step pane shows the step at the cursor, the timeline shows it on the cursor row.
- Headless, Textual computes every frame (layout, the lines of every widget that changed, the screen
  update) but writes nothing; here each frame is also encoded as a terminal driver would
  (`render_segments` on the app's console, `PdbgApp._display` wrapped on that instance), so the
  figures include that too ("of which encoding frames"), but not the write to a terminal. `pause()`
  draws at once; a real terminal app draws on a timer of at most 60 frames a second, which can add
  up to ~17 ms before a frame appears.
- The recordings are built as `bench/bisect_scale.py` builds them (see "NaN origin on a million
  steps"): {sample['iterations']} iterations of its 25-block model recorded with `recorder.record(mode="stats")`
  ({sample['us_per_step']:.0f} µs a step), the writer items replayed at new indices into a real
  `StoreWriter` + `Pipeline` (a store of {sample['check_steps']:,} steps made that way checked equal to the real
  recording first); 100 steps an iteration, 3 tensor records a step, a NaN planted at 90 % of the big
  run (its later steps show as non-finite). The 100-step recording (one clean iteration) is for comparison.

Machine: {bisect_scale.machine()}, textual {textual.__version__}.

{sizes}

### Results

{first_table(results)}

{moves_table(results)}

Per process:

{per_run_table(results)}

{profile_text(profiles)}
### Target

{chr(10).join(target_lines)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000, help="steps of the big recording (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per recording (default 3)")
    parser.add_argument("--write-docs", action="store_true", help=f"add/replace {SECTION!r} in docs/PERFORMANCE.md")
    parser.add_argument("--keep", type=Path, help="build the stores here and keep them (reused when present)")
    parser.add_argument("--profile", choices=("first", *KEYS), help="cProfile that part (big recording) instead")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--part", choices=("time", "first", *KEYS), default="time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        child(args.measure, args.part)
        return
    where = args.keep or Path(tempfile.mkdtemp(prefix="pdbg-tui-scale-"))
    try:
        stores, sample = build_stores(where, args.steps)
        if args.profile:
            fresh(stores[0].path, args.profile)
            return
        results: list[tuple[Store, list[dict[str, Any]]]] = [(s, []) for s in stores]
        for i in range(args.repeat):
            for store, runs in results:
                r = fresh(store.path)
                runs.append(r)
                print(f"  {store.name}, process {i + 1}: first screen {ms(r['first']['total'])} ms", flush=True)
        _, missed = targets(results)
        profiles = {}
        for part in missed:
            print(f"target missed: profiling {part} ...", flush=True)
            profiles[part] = fresh(stores[0].path, part)
        print()
        print(first_table(results))
        print()
        print(moves_table(results))
        print()
        print(per_run_table(results))
        print()
        print(profile_text(profiles))
        print("\n".join(targets(results)[0]))
        if args.write_docs:
            command = ("python bench/tui_scale.py " + " ".join(sys.argv[1:])).strip()
            write_section(SECTION, section(stores, sample, results, profiles, args.repeat, command))
    finally:
        if args.keep is None:
            shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
