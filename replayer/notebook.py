"""What Jupyter shows for the replayer's objects: the ``_repr_html_`` of a Recording, a Step, a
StepTable, a ReplayResult, an Origin, a Divergence and a BundleInfo.

A recording is untrusted input: every name, path, message and number that comes from one is escaped
(``html.escape``) by the helpers here, and only this module writes markup. The markup is
self-contained (inline styles; no scripts, stylesheets, fonts or images: notebooks are often
offline) and leaves text colour and background to the notebook's theme, so that it reads in light
and dark themes alike; only the status badges carry colours of their own, with white text. A
summary reads metadata, a step's tensor index and documents, never a payload and never a whole
column: the repr of a recording of millions of steps is as quick as that of ten.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from recorder.store import layout

from .code import location
from .recording import alert_text, magnitudes_note, paper_reference

if TYPE_CHECKING:
    from .bisect import Divergence, Origin
    from .bundles import BundleInfo
    from .recording import Recording, Step, StepTable
    from .replay import ReplayResult

ROWS = 20  # steps shown of a step table
TENSORS = 24  # tensor records shown of a step
LISTED = 5  # steps shown of a spread, of the steps that followed a divergence
LINES = 10  # warnings and differences shown

_BLOCK = "font-size: 13px; line-height: 1.45; margin: 2px 0 6px 0; max-width: 100%; overflow-x: auto"
_TITLE = "font-weight: 600; font-size: 14px; margin: 0 0 4px 0"
_TABLE = "border-collapse: collapse; margin: 2px 0 6px 0; font-size: 12px; width: auto; table-layout: auto"
_CELL = ("padding: 2px 12px 2px 0; text-align: left; vertical-align: top; "
         "border-bottom: 1px solid rgba(128, 128, 128, 0.25)")
_HEAD = _CELL.replace("0.25", "0.6") + "; font-weight: 600"
_NUMBER = _CELL + "; text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap"
_KEY = _CELL + "; opacity: 0.75; white-space: nowrap"
_MUTED = "opacity: 0.75"
_CODE = ("font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; "
         "background: rgba(128, 128, 128, 0.16); padding: 0 3px; border-radius: 3px")
_BAD = "background: rgba(220, 38, 38, 0.28); font-weight: 700; padding: 0 3px; border-radius: 3px"
_BADGE = ("display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 11px; font-weight: 600; "
          "line-height: 1.7; color: #ffffff; vertical-align: 1px; background: ")
_GREEN, _RED, _AMBER, _PURPLE, _GREY = "#1a7f37", "#cf222e", "#9a6700", "#8250df", "#6e7781"
_COLOURS = {"ok": _GREEN, "complete": _GREEN, "match": _GREEN, "nonfinite": _RED, "mismatch": _RED, "crashed": _RED,
            "alert": _AMBER, "incomplete": _AMBER, "exception": _PURPLE}


class Html(str):
    """Markup made here: passed through as it is, where any other value is escaped."""


def esc(value: Any) -> Html:
    """A value as HTML text: escaped, unless it is markup made here."""
    return value if isinstance(value, Html) else Html(html.escape(str(value), quote=True))


def tag(name: str, body: Any = "", style: str = "") -> Html:
    return Html(f'<{name} style="{style}">{esc(body)}</{name}>' if style else f"<{name}>{esc(body)}</{name}>")


def join(parts: Iterable[Any], sep: str = "") -> Html:
    return Html(esc(sep).join(esc(p) for p in parts))


def code(text: Any) -> Html:
    return tag("code", text, _CODE)


def muted(text: Any) -> Html:
    return tag("span", text, _MUTED)


def bad(text: Any) -> Html:
    """A value to be seen at once: a non-finite count, a mismatch."""
    return tag("span", text, _BAD)


def badge(word: str, kind: str | None = None) -> Html:
    """A status as a coloured badge: ok, nonfinite, alert, exception, match, mismatch, complete, ..."""
    return tag("span", word, _BADGE + _COLOURS.get(kind or word, _GREY))


def block(title: Any, *parts: Any) -> str:
    """The whole summary: a title line and its parts, on the notebook's own background."""
    return str(tag("div", join([tag("div", title, _TITLE), *(p for p in parts if p)]), _BLOCK))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, numeric: Iterable[int] = (),
          more: int = 0, what: str = "rows") -> Html:
    """A table; columns in ``numeric`` are right-aligned; ``more`` rows left out are counted below it."""
    right = set(numeric)
    head = tag("tr", join(tag("th", h, _HEAD) for h in headers))
    body = join(tag("tr", join(tag("td", "" if v is None else v, _NUMBER if i in right else _CELL)
                                 for i, v in enumerate(row))) for row in rows)
    out = tag("table", join([tag("thead", head), tag("tbody", body)]), _TABLE)
    return join([out, tag("div", f"... {more} more {what}", _MUTED)]) if more > 0 else out


def fields(pairs: Iterable[tuple[str, Any]]) -> Html:
    """A two-column table of what something is; pairs whose value is None or "" are left out."""
    rows = [tag("tr", join([tag("td", k, _KEY), tag("td", v, _CELL)])) for k, v in pairs if v not in (None, "")]
    return tag("table", join(rows), _TABLE)


def listing(title: str, lines: Sequence[Any], limit: int = LINES, what: str = "") -> Html:
    """A titled list of lines, the first ``limit`` shown and the rest counted."""
    if not lines:
        return Html("")
    items = [tag("li", line) for line in lines[:limit]]
    if len(lines) > limit:
        items.append(tag("li", muted(f"... {len(lines) - limit} more {what}".rstrip())))
    return join([tag("div", title, "font-weight: 600; margin-top: 4px"), tag("ul", join(items), "margin: 2px 0 6px 0")])


def hint(*calls: str) -> Html:
    """Where to go on from here, as the Python calls to type."""
    calls_html = (tag("code", c, _CODE + "; white-space: nowrap") for c in calls)
    return tag("div", join([muted("go on: "), join(calls_html, " · ")]), "margin-top: 4px")


def number(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def count(value: Any) -> Html:
    """A NaN or Inf count, highlighted when it is not zero."""
    n = int(value or 0) if not (isinstance(value, float) and math.isnan(value)) else 0
    return bad(n) if n else esc(n)


def step_ref(step: Step | None, status: bool = True) -> Html:
    """A step named as a user would type it, with its index, paper reference and (recorded) status."""
    if step is None:
        return muted("none")
    ref = paper_reference(step.paper)
    return join([code(step.selector), muted(f" step {step.index}" + (f" · {ref}" if ref else "")),
                 *([" ", badge(step.status)] if status else [])])


# -- the summaries --------------------------------------------------------------------------------
def recording(rec: Recording) -> str:
    """Path, status, steps, iterations, ranks, mode, when; the origin when already looked for."""
    info, n = rec.run_info, len(rec)
    mode = info.get("mode")
    if mode and info.get("every", 1) not in (1, None):
        mode = f"{mode}, payloads every {info['every']} iterations"
    known = rec.known_origin
    first: Any = muted("not looked for yet: replayer.first_nonfinite(rec)")
    if known is not None:
        first = step_ref(known.step) if known.step is not None else \
            join(["entered at ", step_ref(known.entered)]) if known.entered is not None else muted(known.cause)
    crash = rec.rank.final.get("exception")
    ranks = rec.ranks
    bundle = rec.bundle_info
    rows = [("steps", f"{n:,}"),
            ("iterations", _iterations(rec)),
            ("ranks", f"{len(ranks)} (showing rank {rec.rank.rank})" if len(ranks) > 1 else None),
            ("mode", mode), ("recorded", _when(info)), ("script", info.get("script")),
            ("torch", info.get("torch")), ("run ended with", _exception(crash)),
            ("bundle", f"main step {bundle['main_step']}" if bundle else None), ("first non-finite", first)]
    return block(join(["Recording ", code(rec.reader.label), " ", badge(rec.status)]), fields(rows),
                 hint("rec.steps", 'rec.step("NAME@iter=K#CALL")', "replayer.first_nonfinite(rec)",
                      "replayer.replay(rec, STEP)"))


def _iterations(rec: Recording) -> str | None:
    """The iterations' range, from the first and last steps only (never a whole column)."""
    n = len(rec)
    if not n:
        return None
    first, last = (int(rec.rank.rows("steps/iteration", i, i + 1)[0]) for i in (0, n - 1))
    return f"{last - first + 1:,} ({first}–{last})" if last > first else f"1 ({first})"


def _when(info: dict[str, Any]) -> str | None:
    started, host = info.get("started"), info.get("hostname")
    try:
        when = datetime.fromisoformat(str(started)).strftime("%Y-%m-%d %H:%M:%S %Z").strip()
    except ValueError:
        when = str(started) if started else ""
    return " on ".join(p for p in (when, str(host) if host else "") if p) or None


def _exception(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return None
    return f"{doc.get('type') or 'exception'}: {doc.get('message') or ''}".rstrip(": ")


def step(s: Step) -> str:
    """Selector, paper reference, where and when, notes, and a table of the step's tensors."""
    paper, extra, defn = s.paper, s.extra, s.definition
    where = location(defn.get("file"), defn.get("line")) if defn.get("file") else defn.get("ref")
    rows = [("paper", paper_reference(paper) or None),
            ("description", paper.get("description")), ("algorithm", paper.get("algorithm")),
            ("name", s.name), ("phase", s.phase), ("iteration", s.iteration), ("call", s.call),
            ("module path", code(s.module_path) if s.module_path else muted("(the outermost module, or none)")),
            ("module object", s.object_text or None),  # only where several ran as the step (an EMA copy)
            ("status", badge(s.status)), ("time", f"{s.duration * 1e3:.3f} ms"),
            ("inside step", s.parent), ("forward call", s.forward), ("code", where),
            ("exception", _exception(extra.get("exception"))),
            ("frozen parameters", _frozen(s)),
            ("not tensors", ", ".join(f"{k} ({what})" for k, what in s.non_tensors().items())
             if s.phase != "backward" else None)]
    notes = [alert_text(a, s) for a in extra.get("alerts") or []] + [str(x) for x in extra.get("notes") or []]
    records = sorted(s.records, key=lambda r: layout.role_value(r.role))
    frozen = set(s.frozen)
    tensors = table(("role", "name", "dtype", "shape", "min", "max", "mean", "std", "NaN", "Inf", "kept"),
                    [_tensor_row(r, r.role == "param" and r.name in frozen,
                                 not r.has_payload and s.sparse_parts(r) is not None) for r in records[:TENSORS]],
                    numeric=range(4, 10),
                    more=len(records) - TENSORS, what="tensors (step.records lists them all)") \
        if records else tag("div", "no tensors", _MUTED)
    title = join([f"Step {s.index} ", code(s.selector), " ", badge(s.status)])
    magnitudes = magnitudes_note([r.name for r in records[:TENSORS] if r.dtype.startswith("complex")])
    return block(title, fields(rows), listing("alerts and notes", notes), tensors,
                 tag("div", magnitudes, _MUTED) if magnitudes else None, _step_hint(s, records))


def _step_hint(s: Step, records: list[Any]) -> Html:
    """The calls that work on this step: a tensor's value where one was kept (else why it was not: a
    stats-mode step's ``tensor`` and ``replay`` would only be refused), and its replay."""
    held = [r for r in records if s.holds_values(r)]
    if records and not held:
        return hint(f"rec.step({s.index}).why_statistics_only({records[0].name!r})")
    first = [f"rec.step({s.index}).tensor({held[0].name!r})"] if held else []
    return hint(*first, f"replayer.replay(rec, {s.index})")


def _frozen(s: Step) -> str | None:
    """The parameters frozen at the call (requires_grad=False), a backward step's at its forward
    call: they get no gradient (``step.frozen``)."""
    frozen = s.frozen
    if not frozen:
        return None
    shown = ", ".join(frozen[:LINES]) + (f" and {len(frozen) - LINES} more" if len(frozen) > LINES else "")
    return f"{shown} (requires_grad=False: no gradient" + (" recorded)" if s.phase == "backward" else ")")


def _tensor_row(r: Any, frozen: bool = False, parts: bool = False) -> list[Any]:
    """One tensor record's row; ``parts``: a sparse record whose parts hold its bytes (1.19)."""
    st = r.stats
    shape = "×".join(str(d) for d in r.shape) or "scalar"
    role = join([muted("frozen "), r.role]) if frozen else r.role
    return [role, code(r.name), r.dtype, shape, *(number(st.get(k)) for k in ("min", "max", "mean", "std")),
            count(st.get("nan")), count(st.get("inf")),
            "bytes" if r.has_payload else "parts" if parts else muted("stats")]


def step_table(t: StepTable) -> str:
    """The first ROWS steps, one row each, read step by step (a table of millions reads 20 rows)."""
    shown = [t[i] for i in range(min(ROWS, len(t)))]
    rows = [[s.index, s.iteration, s.phase, s.call, badge(s.status), paper_reference(s.paper), code(s.name),
             join([code(s.module_path) if s.module_path else "", f" ({s.object_text})" if s.object_text else ""]),
             f"{s.duration * 1e3:.2f}"] for s in shown]
    body = table(("index", "iteration", "phase", "call", "status", "paper", "name", "module path", "ms"), rows,
                 numeric=(0, 1, 3, 8), more=len(t) - len(shown), what="steps")
    return block(f"{len(t):,} steps", body, hint("table[i]", "table[20:40]", 'table.filter(status="nonfinite")',
                                                  'table.column("iteration")'))


def replay_result(res: ReplayResult) -> str:
    """The verdict, each compared tensor, the first divergent inner step, warnings and differences."""
    part = " of what was compared" if res.not_compared or res.unseen_writes else ""  # (the rest: "not compared")
    verdict = (badge("nothing compared", "alert") if not res.compared
               else badge("no change in what was compared" if part else
                          "no change: the intervention left every output as recorded", "alert")
               if res.match and res.intervention else badge(f"match by statistics only{part}", "match")
               if res.match and res.by_statistics else badge(f"bitwise match{part}", "match") if res.match
               else badge("mismatch, as the intervention makes it", "mismatch") if res.intervention
               else badge("mismatch"))
    first = res.first_divergence
    same = sum(s.match for s in res.inner)
    rows = [("step", step_ref(res.step)), ("exception", res.exception),
            ("inner steps", f"{same} of {len(res.inner)} match" if res.inner else None),
            ("first divergent inner step", join([step_ref(first.step), f" ({first.change})"]) if first else None),
            ("inner calls not recorded", res.unrecorded_inner.text if res.unrecorded_inner else None),
            ("rebuilt", ", ".join(f"{p or '(outermost)'}: {how}" for p, how in res.rebuilt.items()) or None),
            ("not compared", "; ".join([*([", ".join(res.not_compared) + ": not recorded as data"]
                                           if res.not_compared else []),
                                         *([res.unseen_text] if res.unseen_text else [])]) or None),
            ("intervention", _short({k: v for k, v in (res.intervention or {}).items() if v not in (None, {}, [])}))]
    outputs = table(("tensor", "role", "bits", "elements differing", "max abs diff", "max rel diff", "max ULP",
                     "NaN / Inf recorded", "NaN / Inf replayed", "note"),
                    [_diff_row(d) for d in res.outputs], numeric=range(3, 9))
    title = join([f"Replay of step {res.step.index} ", code(res.step.selector), " ", verdict])
    return block(title, fields(rows), outputs,
                 listing("warnings", res.warnings), listing("environment differences", res.environment_differences),
                 hint(f"res.diffs[{_first_diff(res)!r}]", "res.values", "res.inner", "res.to_json()"))


def _first_diff(res: Any) -> str:
    """The record to look at first: the first that differs, else the first compared."""
    return next((d.name for d in res.outputs if not d.match), next(iter(res.diffs), "output"))


def _short(doc: dict[str, Any]) -> str | None:
    text = json.dumps(doc, default=str) if doc else ""
    return text if len(text) <= 300 else text[:299] + "…"


def _diff_row(d: Any) -> list[Any]:
    def nonfinite(stats: dict[str, Any]) -> Html:
        return join([count(stats.get("nan")), " / ", count(stats.get("inf"))]) if stats else Html("")

    bits = badge("same statistics", "match") if d.match and d.by_statistics else badge("equal", "match") \
        if d.match else badge("differ", "mismatch")
    far = d.measured  # (NaN/Inf or shapes that differ: no distance, the reason says which)
    ulp, gap, rel = (d.max_ulp, number(d.max_abs_diff), number(d.max_rel_diff)) if far else ("-", "-", "-")
    return [code(d.name), d.role, bits, d.mismatched, gap, rel, ulp,
            nonfinite(d.recorded), nonfinite(d.replayed), d.reason]


def _steps(title: str, steps: Sequence[Step], what: str) -> Html:
    return listing(title, [step_ref(s) for s in steps], LISTED, what)


def origin(o: Origin) -> str:
    """Where the first NaN/Inf came from: the step, the sentence, the operation, where it spread."""
    if o.raised_in is not None or (not o.found and o.ended_by is not None):  # no recorded result holds it: the
        # step whose own NaN check raised before it returned, or an exception that ended the run speaking of one
        where = o.raised_in
        title = "First non-finite value: made inside a step that raised" if where is not None else \
            "First non-finite value: the run ended by it, outside the recorded steps"
        rows = [("raised in", step_ref(where) if where is not None else None), ("cause", o.cause),
                *(_operation(o) if where is not None else []), ("run ended by", o.ended_by)]
        calls = [f"replayer.replay(rec, {where.index})", f'replayer.bundle(rec, {where.index}, "failure.pdbg", '
                 'verify=True)'] if where is not None else ["replayer.first_nonfinite(rec)"]
        return block(join([title, " ", badge("nonfinite")]), fields(rows), hint(*calls))
    if not o.found:
        return block(join(["No non-finite value found ", badge("ok")]), tag("div", o.cause, _MUTED))
    s = o.step
    rows = [("origin", step_ref(s) if s is not None else None),
            ("entered at", step_ref(o.entered) if o.entered is not None else None),
            ("description", s.paper.get("description") if s is not None else None),
            ("module path", code(s.module_path) if s is not None and s.module_path else None),
            ("cause", o.cause), ("rank", o.rank if o.others else None), *_operation(o),
            ("mask's Inf from", step_ref(o.source) if o.source is not None else None),
            ("made by", code(o.source_op.where()) if o.source_op is not None else None)]
    others = [f"rank {r}: {x.cause}" for r, x in sorted(o.others.items())]
    title = "First non-finite value: origin" if o.step is not None else \
        "First non-finite value: it came from outside every recorded step"
    first = o.step or o.entered
    return block(join([title, " ", badge("nonfinite")]), fields(rows), _steps("spread to", o.spread, "steps"),
                 listing("other ranks", others),
                 hint(f"replayer.replay(rec, {first.index if first else 'STEP'})", "origin.spread",
                      f'replayer.bundle(rec, {first.index if first else "STEP"}, "failure.pdbg", verify=True)'))


def _operation(o: Origin) -> list[tuple[str, Any]]:
    """The aten operation inside the origin step (``ops=True``), or how to ask for it."""
    op = o.op
    if op is None and o.op_note:  # asked for, and not found: why
        return [("operation", o.op_note)]
    if op is None:
        return [("operation", muted("replayer.first_nonfinite(rec, ops=True) names it"))] if o.step else []
    return [("operation", code(op.name)), ("inside", code(op.within) if op.within else None),
            ("autograd node", op.node),
            ("at", location(op.file, op.line) if op.file else muted("no user source line found")),
            ("code", code(op.code) if op.code else None),
            ("its forward", location(op.forward["file"], op.forward.get("line")) if op.forward and
             op.forward.get("file") else None), ("how", op.how()),
            ("replay", o.op_note if o.op_note and o.op_note != op.how() else None)]  # (code drift, a replay unlike it)


def divergence(d: Divergence) -> str:
    """Where two runs part: the root cause in each run, the sentence, the steps that only followed."""
    if d.step is None:
        title = join(["No divergence ", badge("match")]) if d.first_difference is None else \
            join(["The runs differ, with no root cause recorded ", badge("mismatch")])
    else:
        title = join(["The runs part ", badge("mismatch")])
    rows = [("root cause (run A)", step_ref(d.step, False) if d.step is not None else None),
            ("same step in run B", step_ref(d.other, False) if d.other is not None else None), ("cause", d.cause),
            ("first difference", step_ref(d.first_difference, False) if d.first_difference is not None else None),
            (f"ran in run {'B' if d.unpaired_other else 'A'} only",
             step_ref(d.unpaired, False) if d.unpaired is not None else None),
            ("steps compared", f"{d.compared:,}")]
    return block(title, fields(rows), _steps("followed (different inputs or parameters only)", d.followed,
                                             "steps"),
                 hint("div.step", "div.followed", "replayer.replay(rec_a, div.step)") if d.step is not None
                 else hint("div.first_difference", "div.followed", "replayer.replay(rec_a, div.first_difference)")
                 if d.first_difference is not None else None)


def bundle_info(b: BundleInfo) -> str:
    """The file written, its size, steps and main step, and how it was verified."""
    verified = {True: badge(f"verified: {b.verdict}", "match"), False: badge("verified: mismatch", "mismatch"),
                None: badge("not verified")}[b.verified]
    from .bundles import environment_text

    rows = [("path", code(b.path)), ("size", f"{b.bytes:,} bytes"), ("steps", b.steps), ("main step", b.main_step),
            ("verified with", environment_text(b.verified_with, {}) if b.verified_with else None),
            ("script", code(b.script) if b.script else None)]
    return block(join(["Bundle ", code(b.path.name), " ", verified]), fields(rows),
                 hint("replayer.replay(replayer.open(info.path))", f"pdbg info {b.path.name}",
                      *([f"python {b.script.name}"] if b.script else [])))
