"""View models: what the TUI shows, computed from a recording by plain functions (no widgets here).

The timeline holds a few numpy columns for every step and formats only the rows on screen, so a
million-step recording costs a few arrays. Everything else is computed for the step at the cursor.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from rich.cells import cell_len, set_cell_size

from recorder import jsonval, names
from recorder.errors import PdbgError
from recorder.store import layout
from replayer.arguments import unrecorded_outputs
from replayer.bisect import Condition, describe, meant_inf, with_alerts
from replayer.recording import Recording, Step, alert_text, algorithm_of, paper_of

STATUS_STYLE = {"ok": "green", "alert": "yellow", "nonfinite": "bold red", "exception": "bold magenta"}


def up_the_parents(parent: np.ndarray, first: np.ndarray, combine: Any) -> np.ndarray:
    """Per step, ``first`` (its value for its parent alone) combined over all its ancestors, by
    pointer doubling: log2(levels) passes (a recursion of steps 10,000 deep is 14, not 10,000).
    Parents come before their children (the reader refuses others), so every chain ends."""
    up = parent.astype(np.int64).copy()  # the ancestor 2**k levels up, or -1
    value = first  # over the ancestors up to ``up``
    while (up >= 0).any():
        has = up >= 0
        at = np.where(has, up, 0)
        value = np.where(has, combine(value, value[at]), value)
        up = np.where(has, up[at], -1)
    return value


def depths(parent: np.ndarray) -> np.ndarray:
    """Nesting depth of every step (0 at the top)."""
    return up_the_parents(parent, (parent >= 0).astype(np.int64), np.add).astype(np.int32)


def inside_another_of(mask: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """Per step: whether a step of ``mask`` encloses it (one of its ancestors)."""
    return up_the_parents(parent, (parent >= 0) & mask[np.where(parent >= 0, parent, 0)], np.logical_or)


class _StepColumn:
    """One numeric step column: whole once a filter or a search needs every step, until then read a
    chunk at a time for the rows drawn (the first screen of a million steps reads a few chunks)."""

    CHUNK = 8192  # rows per read: the store's own chunk of a step column

    def __init__(self, rec: Recording, name: str, n: int) -> None:
        self.rec, self.path, self.n = rec, f"steps/{name}", n
        self.array: np.ndarray | None = None if n else np.zeros(0, np.int64)

    def whole(self) -> np.ndarray:
        if self.array is None:
            self.array = np.asarray(self.rec.rank.column(self.path))
        return self.array

    def chunk(self, k: int) -> np.ndarray:
        """Rows ``k * CHUNK`` up to the next chunk (the reader keeps the chunks it decoded)."""
        if self.array is not None:
            return self.array[k * self.CHUNK:(k + 1) * self.CHUNK]
        return np.asarray(self.rec.rank.rows(self.path, k * self.CHUNK, min(self.n, (k + 1) * self.CHUNK)))

    def at(self, index: int) -> Any:
        if self.array is not None:
            return self.array[index]
        return self.chunk(index // self.CHUNK)[index % self.CHUNK]


class TimelineModel:
    """Every step of a recording as rows of the timeline, and the filters over them."""

    def __init__(self, rec: Recording) -> None:
        self.rec = rec
        self.n = len(rec.steps)
        self._cols = {name: _StepColumn(rec, name, self.n)
                      for name in ("iteration", "phase", "status", "t_start", "t_end", "parent",
                                   "name", "definition", "module_path")}  # the last three: document ids
        self._depth: np.ndarray | None = None if self.n else np.zeros(0, np.int32)
        self._names: np.ndarray | None = None
        self._paths: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self.rows = np.arange(self.n, dtype=np.int64)  # the visible steps, in order
        self.filter_text = ""
        self._spans: dict[int, float] = {}
        self._ids: np.ndarray | None = None
        self._texts: list[str] = []
        self._row_text: dict[tuple[int, int, int], tuple[str, str | None, str]] = {}

    # whole numeric columns, on first use (filters, searches, the paper view)
    @property
    def iteration(self) -> np.ndarray:
        return self._cols["iteration"].whole()

    @property
    def phase(self) -> np.ndarray:
        return self._cols["phase"].whole()

    @property
    def status(self) -> np.ndarray:
        return self._cols["status"].whole()

    @property
    def t_start(self) -> np.ndarray:
        return self._cols["t_start"].whole()

    @property
    def t_end(self) -> np.ndarray:
        return self._cols["t_end"].whole()

    @property
    def parent(self) -> np.ndarray:
        return self._cols["parent"].whole()

    @property
    def depth(self) -> np.ndarray:
        if self._depth is None:
            self._depth = depths(self._cols["parent"].whole())
        return self._depth

    def iteration_of(self, index: int) -> int:
        return int(self._cols["iteration"].at(index))

    def depth_of(self, index: int) -> int:
        """Nesting depth of one step, up its parents (a whole column only once it was read anyway)."""
        if self._depth is not None:
            return int(self._depth[index])
        parent, depth = self._cols["parent"], 0
        p = int(parent.at(index))
        while p >= 0 and depth <= self.n:
            depth += 1
            p = int(parent.at(p))
        return depth

    # decoded text columns, on first use (a name per distinct document, not per step)
    @property
    def names(self) -> np.ndarray:
        if self._names is None:
            self._names = self.rec.steps.column("name")
        return self._names

    @property
    def paths(self) -> np.ndarray:
        if self._paths is None:
            self._paths = self.rec.steps.column("module_path")
        return self._paths

    @property
    def labels(self) -> np.ndarray:
        if self._labels is None:
            self._labels = self.rec.steps.column("label")
        return self._labels

    def text_of(self, index: int) -> tuple[str, str | None, str]:
        """(name, paper label, module path) of one step, from its own documents (cached per document):
        drawing a screen of a million-step recording decodes only what is on it."""
        if self._names is not None and self._paths is not None and self._labels is not None:
            return str(self._names[index]), self._labels[index], str(self._paths[index])
        rank = self.rec.rank
        ids = tuple(int(self._cols[c].at(index)) for c in ("name", "definition", "module_path"))
        found = self._row_text.get(ids)
        if found is None:
            paper = paper_of(rank.doc(ids[1]))
            found = self._row_text[ids] = (str(rank.doc(ids[0])), paper.get("label"), str(rank.doc(ids[2]) or ""))
        return found

    def span(self, index: int) -> float:
        """Wall time of the iteration of step ``index`` (for the duration bars): from the chunks around
        it while the whole columns are not needed, as the steps of an iteration are contiguous."""
        iteration = self.iteration_of(index)
        if iteration in self._spans:
            return self._spans[iteration]
        col = self._cols["iteration"]
        if col.array is None:  # the run of the iteration's steps around this one, chunk by chunk
            k = index // col.CHUNK
            first, last = k, k
            while first > 0 and col.chunk(first)[0] == iteration:
                first -= 1
            while (last + 1) * col.CHUNK < self.n and col.chunk(last)[-1] == iteration:
                last += 1
            chunks = range(first, last + 1)
            its = np.concatenate([col.chunk(c) for c in chunks])
            here = index - first * col.CHUNK
            before = np.flatnonzero(its[:here] != iteration)
            after = np.flatnonzero(its[here:] != iteration)
            lo = int(before[-1]) + 1 if len(before) else 0
            hi = here + int(after[0]) if len(after) else len(its)
            starts = np.concatenate([self._cols["t_start"].chunk(c) for c in chunks])[lo:hi]
            ends = np.concatenate([self._cols["t_end"].chunk(c) for c in chunks])[lo:hi]
            self._spans[iteration] = float(ends.max() - starts.min())
            return self._spans[iteration]
        lo = np.searchsorted(self.iteration, iteration, side="left")
        hi = np.searchsorted(self.iteration, iteration, side="right")
        if hi <= lo:  # iterations are not sorted (several threads): fall back to a mask
            mask = self.iteration == iteration
            self._spans[iteration] = float(self.t_end[mask].max() - self.t_start[mask].min()) if mask.any() else 0
        else:
            self._spans[iteration] = float(self.t_end[lo:hi].max() - self.t_start[lo:hi].min())
        return self._spans[iteration]

    def row(self, index: int, bar_width: int = 6, width: int | None = None) -> list[tuple[str, str]]:
        """One timeline row as (text, style) pieces; in ``width`` columns, the module path's column
        narrows (to 8) so that the duration stays on screen."""
        cols = self._cols
        status = layout.STATUSES[int(cols["status"].at(index))]
        phase = int(cols["phase"].at(index))
        name, label, path = (None if x is None else names.shown(x) for x in self.text_of(index))  # (escaped)
        if self.rec._object_places:  # several module objects ran as a step (a model and its EMA copy): which one
            obj = self.rec.step(index).object_text
            path = f"{path} ({obj})" if path and obj else obj or path
        duration = float(cols["t_end"].at(index) - cols["t_start"].at(index))
        span = self.span(index) or 1.0
        filled = min(bar_width, max(0, round(bar_width * duration / span)))
        bar = "█" * filled + "·" * (bar_width - filled)
        mark = {"ok": " ", "alert": "!", "nonfinite": "✗", "exception": "E"}[status]
        depth = self.depth_of(index)  # two columns a level to 4 levels, then one, to 8: the name keeps room
        indent = "  " * min(depth, 4) + " " * min(max(depth - 4, 0), 4)
        # 26 columns for the label and name and 20 for the path in 78 (58 without the path); a wider
        # timeline gives them more, 3 to 2, up to 60 and 40; a narrower one narrows the path to 8.
        free = 46 if width is None else width - 26 - bar_width  # what the name and path columns share
        name_width = 26 + min(34, max(0, free - 46) * 3 // 5)
        path_width = max(8, min(40, free - name_width))
        who = name
        if label and label != name:
            who = f"{label} {name}"
            if cell_len(indent + who) > name_width:  # a long label gives way to the name, down to a third
                room = max(name_width - cell_len(indent) - cell_len(name) - 1, min(cell_len(label), 8),
                           (name_width - cell_len(indent)) // 3)
                who = f"{fit_cells(label, room).rstrip()} {name}"
        return [
            (f"{index:>6} ", "dim"),
            (f"{self.iteration_of(index):>4} ", "cyan"),
            ("→ " if phase == 0 else "← ", "blue" if phase == 0 else "magenta"),
            (f"{mark} ", STATUS_STYLE[status]),
            (fit_cells(indent + who, name_width), STATUS_STYLE[status] if status != "ok" else "bold"),
            (f" {fit_cells(path, path_width, keep_end=True)}", "dim"),
            (f" {bar} {fmt_seconds(duration):>7}", "dim"),
        ]

    @cached_property
    def meant(self) -> np.ndarray:
        """Per step: Inf the model means (a -inf mask made or passed on: ``meant_inf``): ``n`` passes over them."""
        return meant_inf(self.rec)

    # filters ---------------------------------------------------------------------------------
    def apply_filter(self, text: str) -> int:
        """Keep the steps whose name, paper label or module path contains ``text``, or which match
        ``phase:backward``, ``status:nonfinite``, ``iter:K``, ``object:K`` (the K-th module object of a
        step several ran as: Step.module_object), ``name:A,B`` (exact step names) terms
        (space-separated, all must hold); or, alone, ``name:["A", "B"]`` (exact step names as a JSON
        list, which may hold spaces and commas: the paper view's nodes).
        Returns how many remain. A term of a kind with a value it cannot have (``status:nan``,
        ``phase:fwd``, ``iter:abc``) is a PdbgError naming the values there are; the filter stays."""
        for term in text.split():
            key, sep, value = term.partition(":")
            known = {"phase": layout.PHASES, "status": layout.STATUSES}.get(key)
            if sep and known is not None and value not in known:
                raise PdbgError(f"filter {term!r}: {key} is one of {', '.join(known)}")
            if sep and key in ("iter", "iteration") and not value.isdecimal():
                raise PdbgError(f"filter {term!r}: {key} takes an iteration number, e.g. {key}:5")
            if sep and key == "object" and not value.isdecimal():
                raise PdbgError(f"filter {term!r}: object takes a module object's number, e.g. object:2 (a step "
                                "several module objects ran as, such as a model and its EMA copy, says which)")
            if sep and key == "object":
                self.rec.objects_numbered()  # (a recording before 1.16: says so, the filter stays)
        self.filter_text = text.strip()
        mask = np.ones(self.n, dtype=bool)
        listed = _json_names(self.filter_text)
        if listed is not None:
            kept = np.zeros(self.n, dtype=bool)
            for item in listed:  # a name, or [name, paper label]: steps of different classes may share a name
                kept |= self.rec.steps._named("name", item) if isinstance(item, str) else \
                    self.rec.paper_step_mask(item[0], item[1])
            self.rows = np.flatnonzero(kept)
            return len(self.rows)
        for term in self.filter_text.split():
            key, sep, value = term.partition(":")
            if sep and key == "phase":
                mask &= self.phase == layout.PHASES.index(value)
            elif sep and key == "status":
                mask &= self.status == layout.STATUSES.index(value)
            elif sep and key in ("iter", "iteration"):
                mask &= self.iteration == int(value)
            elif sep and key == "object":
                mask &= self.rec._object_numbers == int(value)
            elif sep and key == "name":  # exact step names, comma-separated (the paper view's nodes)
                mask &= np.logical_or.reduce([self.rec.steps._named("name", v) for v in value.split(",")])
            else:  # (under Unicode normalisation, and in the names as printed: names.search_text)
                needle = names.search_key(term)
                hit = np.array([needle in names.search_text(str(s)) for s in self._distinct_text()], dtype=bool)
                mask &= hit[self._text_ids()]
        self.rows = np.flatnonzero(mask)
        return len(self.rows)

    def _distinct_text(self) -> list[str]:
        self._text_ids()
        return self._texts

    def _text_ids(self) -> np.ndarray:
        """Per step, an id of its (name, definition, module path); the searchable text once per id."""
        if getattr(self, "_ids", None) is None:
            rank = self.rec.rank
            keys = np.stack([np.asarray(rank.column(f"steps/{c}")) for c in ("name", "definition", "module_path")],
                            axis=1) if self.n else np.zeros((0, 3), np.int64)
            _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
            self._texts = [f"{self.names[i]} {self.labels[i] or ''} {self.paths[i]}" for i in first]
            self._ids = np.asarray(inverse, dtype=np.int64).reshape(-1)
        return self._ids

    def position(self, index: int) -> int:
        """The visible row of a step (the nearest visible one at or after it)."""
        pos = int(np.searchsorted(self.rows, index))
        return min(pos, len(self.rows) - 1) if len(self.rows) else 0


def _json_names(text: str) -> list[Any] | None:
    """The items of a ``name:["A", ["B", "Eq. 5"]]`` filter (names, or [name, paper label] pairs), or
    None for any other filter."""
    if not (text.startswith("name:[") and text.endswith("]")):
        return None
    try:
        items = json.loads(text[len("name:"):])
    except ValueError:
        return None
    def valid(item: Any) -> bool:
        return isinstance(item, str) or (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                                         and (item[1] is None or isinstance(item[1], str)))
    return items if isinstance(items, list) and all(valid(i) for i in items) else None


# -- navigation (pure: index in, index out) ---------------------------------------------------------
def next_iteration(model: TimelineModel, index: int, step: int) -> int | None:
    """The first step shown (the filter's, if one is set) of the next (step=1) or previous (step=-1)
    iteration that has steps shown (a step recorded every other iteration is reached); None at the
    run's edge."""
    now, shown = int(model.iteration[index]), model.rows
    its = model.iteration[shown]
    others = its[its > now] if step > 0 else its[its < now]
    if not len(others):
        return None
    it = int(others.min()) if step > 0 else int(others.max())
    return int(shown[np.flatnonzero(its == it)[0]])


def next_anomaly(model: TimelineModel, index: int, step: int) -> int:
    """The next (or previous) step shown (the filter's, if one is set) whose status is not ok, but for
    Inf the model means (a -inf mask made or passed on: ``replayer.bisect.meant_inf``)."""
    shown = model.rows
    bad = shown[(model.status[shown] != 0) & ~model.meant[shown]]
    if step > 0:
        later = bad[bad > index]
        return int(later[0]) if len(later) else index
    earlier = bad[bad < index]
    return int(earlier[-1]) if len(earlier) else index


def find(model: TimelineModel, index: int, text: str, backward: bool) -> int | None:
    """The next (previous) step after (before) ``index``, among those the filter shows, that ``text``
    names: a condition on its statistics (``output.absmax > 1e3``), a step selector (``Head``,
    ``blocks.1:backward``), or both as ``pdbg find`` takes them (``Head when output.absmax > 0``)."""
    rec = model.rec
    where, sep, condition = text.partition(" when ")
    if not sep:  # a condition alone (it compares), or a selector alone
        where, condition = ("", text) if re.search(r"[<>]|[=!]=", text) else (text, None)  # (not @iter=K)
    mask = np.ones(len(rec), dtype=bool)
    if where.strip():
        rows = rec.steps.select(where.strip()).rows
        if not len(rows):
            rec.step(where.strip())  # names no step: raises, saying what the recording has (as pdbg find)
        mask[:] = False
        mask[rows] = True
    if condition is not None:
        mask &= Condition(condition).evaluate(rec)
    hits = np.intersect1d(np.flatnonzero(mask), model.rows)  # (the filter's steps only)
    pick = hits[hits < index][-1:] if backward else hits[hits > index][:1]
    return int(pick[0]) if len(pick) else None


# -- the step at the cursor -------------------------------------------------------------------------
@dataclass
class TensorRow:
    role: str
    name: str
    shape: str
    dtype: str
    stats: dict[str, float]
    nonfinite: bool
    record: Any
    frozen: bool = False  # a parameter with requires_grad=False at this call: it gets no gradient


@dataclass
class StepView:
    title: str  # "Eq. 2 · smooth_relu · h.1.mlp · forward · iteration 5 · call 1"
    description: str | None
    status: str
    source: str | None
    source_line: int | None
    source_file: str | None
    arguments: str
    tensors: list[TensorRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    frozen: str | None = None  # which parameters were frozen at the call (``frozen_text``)
    numpy: list[tuple[str, str, int]] = field(default_factory=list)  # (name, summary, NaN+Inf) per ``numpy_values``
    # the parts of the output not recorded as data, which a replay does not compare ("output.1 (a mypkg Handle)")
    unrecorded: list[str] = field(default_factory=list)
    # a forward step's output where it holds no tensor and no numpy value (the float a learning-rate schedule
    # returns: "inf"), and the NaN/Inf its numbers hold ("1 Inf"); None where the pane shows what it returned otherwise
    output: str | None = None
    output_nonfinite: str = ""
    # its DTensor records (1.31), whose shape and statistics are this rank's local shard's: "fc.weight: local shard
    # of 12×8 (Shard(dim=0))" each, said under its tensor table (whose shape column says "6×8 shard")
    shards: list[str] = field(default_factory=list)


def statistics_only(step: Step) -> str | None:
    """Where a step kept its tensors' statistics and none of their bytes (stats mode, flight mode outside
    the iterations its ring wrote out), so that it cannot be replayed: why, as its first record's reason
    says ("" where the recording cannot tell); None where it kept bytes, or has no tensors."""
    if not step.records or any(r.has_payload for r in step.records):
        return None
    try:
        return step.rec.rank.why_statistics_only(step.records[0])
    except Exception:  # noqa: BLE001 - a damaged document: the note says the rest
        return ""


def shard_text(step: Step, record: Any) -> str | None:
    """``Step.dtensor_text``: "local shard of 12×8 (Shard(dim=0))" for a DTensor's record; None for another,
    or where the step's document is damaged."""
    try:
        return step.dtensor_text(record)
    except Exception:  # noqa: BLE001 - a damaged document: the shape as recorded
        return None


def shape_text(step: Step, record: Any, *, short: bool = False) -> str:
    """A record's shape, "6×8"; a DTensor's local shard's says so, "6×8 local shard of 12×8 (Shard(dim=0))"
    (its statistics are the shard's too), or ``short``, "6×8 shard" (for the step pane's table, whose note
    under it says the rest: ``StepView.shards``)."""
    shape = "×".join(str(d) for d in record.shape) or "scalar"
    shard = shard_text(step, record)
    if not shard:
        return shape
    return f"{shape} shard" if short else f"{shape} {shard}"


def step_view(step: Step) -> StepView:
    definition = step.definition
    frozen = set(step.frozen)
    tensors = [TensorRow(r.role, r.name, shape_text(step, r, short=True), r.dtype, r.stats,
                         r.nonfinite, r, r.role == "param" and r.name in frozen)
               for r in sorted(step.records, key=lambda r: layout.role_value(r.role))]
    shards = [f"{t.name}: {shard}" for t in tensors for shard in [shard_text(step, t.record)] if shard]
    extra = step.extra
    notes = []
    exc = extra.get("exception")
    if isinstance(exc, dict):
        notes.append(f"exception: {exc.get('type')}: {exc.get('message')}")
    for alert in extra.get("alerts", []) or []:
        notes.append(alert_text(alert, step))
    for note in extra.get("notes", []) or []:
        notes.append(str(note))
    why = statistics_only(step)
    if why is not None:
        notes.append(f"statistics only, no tensor bytes: it cannot be replayed{f' ({why})' if why else ''}")
    numpy = numpy_values(step)
    listed = {name for name, _, _ in numpy}
    try:
        unrecorded = [] if step.phase == "backward" else [
            u for u in unrecorded_outputs(step.output_structure) if u.partition(" ")[0] not in listed]
    except Exception:  # noqa: BLE001 - a damaged document: nothing is said of it
        unrecorded = []
    output, bad = None, ""
    if step.phase != "backward" and not tensors and not numpy and step.output_structure is not None and \
            not any(u.partition(" ")[0] == "output" for u in unrecorded):
        output = output_text(step.output_structure)
        try:
            found = jsonval.nonfinite(step.output_structure, "output")
        except Exception:  # noqa: BLE001 - a damaged document: shown as it is, uncounted
            found = []
        nan, inf = sum(f.nan for f in found), sum(f.inf for f in found)
        bad = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "Inf")) if n)
    return StepView(describe(step).split(": ", 1)[1], step.paper.get("description"), step.status,
                    definition.get("source"), definition.get("line"), definition.get("file"),
                    arguments_text(step.arguments), tensors, notes, frozen_text(step), numpy, unrecorded,
                    output, bad, shards)


_FROZEN_LISTED = 6  # frozen parameters named in the step pane; more are counted


def frozen_text(step: Step) -> str | None:
    """Which of the module's parameters were frozen at the call (requires_grad=False), so that no
    gradient of theirs is recorded: "2 of 4 parameters frozen (...): emb.weight, ..."; a backward
    step's, those of its forward call; None where none was (or the recording does not say)."""
    frozen = step.frozen
    if not frozen:
        return None
    call = step if step.phase != "backward" or step.forward is None else step.rec.step(step.forward)
    total = sum(r.role == "param" for r in call.records)
    names = ", ".join(frozen[:_FROZEN_LISTED]) + (f" and {len(frozen) - _FROZEN_LISTED} more"
                                                  if len(frozen) > _FROZEN_LISTED else "")
    if step.phase == "backward":
        return (f"no gradient for {len(frozen)} of {total} parameters: frozen at the forward call "
                f"(requires_grad=False): {names}")
    return f"{len(frozen)} of {total} parameters frozen (requires_grad=False: they get no gradient): {names}"


_NUMPY_SHOWN = 4  # values of a numpy array shown
_NUMPY_LISTED = 12  # numpy values listed in the step pane


def numpy_summary(tag: str, payload: Any, full: bool = True) -> tuple[str, int]:
    """A recorded numpy value in words, and its count of NaN and Inf: ``float64[4] [0.2, 0.5, nan, 0.1]
    min 0.1 max 0.5, 1 NaN`` (``full`` False: dtype, shape, the first values and the non-finite ones
    only, as the arguments line shows them). A document it cannot read: its dtype alone."""
    dtype = str(payload.get("dtype")) if isinstance(payload, dict) else "?"
    try:
        value = np.asarray(jsonval.decode({tag: payload}))
    except (ValueError, TypeError):
        return f"{dtype} (unreadable)", 0
    shape = "" if tag == "$npscalar" else "[" + "×".join(str(d) for d in value.shape) + "]"
    flat, kind = value.reshape(-1), value.dtype.kind
    item = {"f": lambda v: _fmt_value(float(v)), "b": lambda v: str(bool(v)), "i": lambda v: str(int(v)),
            "u": lambda v: str(int(v))}.get(kind, str)
    shown = [item(v) for v in flat[:_NUMPY_SHOWN]]
    text = f"{dtype}{shape} " + (shown[0] if tag == "$npscalar" or value.ndim == 0 and shown else
                                 "[" + ", ".join(shown) + (", …" if flat.size > _NUMPY_SHOWN else "") + "]")
    if kind not in "iuf":
        return text, 0
    as_float = flat.astype(np.float64)
    nan, inf = (int(np.isnan(as_float).sum()), int(np.isinf(as_float).sum())) if kind == "f" else (0, 0)
    finite = as_float[np.isfinite(as_float)]
    if full and flat.size > 1 and finite.size:
        low, high = (finite.min(), finite.max()) if kind == "f" else (flat.min(), flat.max())
        text += f"  min {item(low)} max {item(high)}"
    if nan or inf:
        text += " (" + ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "Inf")) if n) + ")"
    return text, nan + inf


def numpy_values(step: Step) -> list[tuple[str, str, int]]:
    """The numpy values among the step's arguments and output (``args.5``, ``output.1``; nested ones
    by their path), as ``numpy_summary`` gives them: a step whose data is numpy shows what it was
    given and made, NaN included; an array too large to be recorded is named as not recorded."""
    out: list[tuple[str, str, int]] = []

    def walk(doc: Any, path: str, depth: int) -> None:
        if len(out) >= _NUMPY_LISTED or depth > _ARGUMENT_DEPTH:
            return
        if isinstance(doc, dict):
            if len(doc) == 1 and next(iter(doc)) in ("$ndarray", "$npscalar"):
                tag, payload = next(iter(doc.items()))
                out.append((path, *numpy_summary(tag, payload)))
                return
            if len(doc) == 1 and isinstance(doc.get("$opaque"), dict) and doc["$opaque"].get("type") == "numpy:ndarray":
                reason = jsonval.opaque_reason(jsonval.Opaque("numpy:ndarray", str(doc["$opaque"].get("repr"))))
                out.append((path, f"not recorded: {reason or 'not data'}", 0))
                return
            if len(doc) == 1 and isinstance(next(iter(doc)), str) and next(iter(doc)).startswith("$"):
                inner = next(iter(doc.values()))
                items = enumerate(inner) if isinstance(inner, list) else (
                    inner.get("fields", {}).items() if isinstance(inner, dict) and
                    isinstance(inner.get("fields"), dict) else ())
            else:
                items = doc.items()
        elif isinstance(doc, list):
            items = enumerate(doc)
        else:
            return
        for key, value in items:
            walk(value, f"{path}.{key}", depth + 1)

    doc = step.arguments if isinstance(step.arguments, dict) else {}
    for i, value in enumerate(doc.get("args") or []):
        walk(value, f"args.{i}", 0)
    for key, value in (doc.get("kwargs") or {}).items() if isinstance(doc.get("kwargs"), dict) else ():
        walk(value, f"kwargs.{key}", 0)
    if step.phase != "backward":
        walk(step.output_structure, "output", 0)
    return out


_ARGUMENT_DEPTH = 8  # levels of nesting shown
_ARGUMENT_ITEMS = 64  # items of one container shown (the text is cut at its limit anyway)


def arguments_text(doc: Any, limit: int = 300) -> str:
    """Arguments in a compact Python-like form: tensors by record name. Whatever the document holds
    (a recording from someone else), nesting past a few levels is shown as "…"."""
    if not isinstance(doc, dict):
        return ""
    args = doc.get("args") if isinstance(doc.get("args"), list) else []
    kwargs = doc.get("kwargs") if isinstance(doc.get("kwargs"), dict) else {}
    parts = [_shown(a, limit) for a in args[:_ARGUMENT_ITEMS]]
    parts += [f"{k}={_shown(v, limit)}" for k, v in list(kwargs.items())[:_ARGUMENT_ITEMS]]
    text = "(" + ", ".join(parts) + ")"
    return text if len(text) <= limit else text[:limit - 1] + "…"


def output_text(doc: Any, limit: int = 300) -> str:
    """A step's output in the compact form of ``arguments_text`` (``inf``, ``(0.5, <output.1>)``)."""
    text = _shown(doc, limit)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _shown(value: Any, limit: int, depth: int = 0) -> str:
    """A recorded value in the compact form of ``arguments_text``."""
    if depth > _ARGUMENT_DEPTH:
        return "…"
    if isinstance(value, dict):
        if "$tensor" in value and len(value) == 1:
            return f"<{value['$tensor']}>"
        if len(value) == 1 and str(next(iter(value))).startswith("$"):
            tag, payload = next(iter(value.items()))
            if tag == "$tuple" and isinstance(payload, list):
                return "(" + ", ".join(_shown(v, limit, depth + 1) for v in payload[:_ARGUMENT_ITEMS]) + (
                    "," if len(payload) == 1 else "") + ")"
            if tag == "$float":
                return str(payload)
            if tag in ("$dataclass", "$object", "$namedtuple", "$mapping") and isinstance(payload, dict):
                return f"{str(payload.get('type')).split(':')[-1]}(...)"
            if tag == "$ndarray" and isinstance(payload, dict):
                return "ndarray " + numpy_summary(tag, payload, full=False)[0]
            if tag == "$npscalar" and isinstance(payload, dict):  # np.float32(1.5)
                dtype, _, shown = numpy_summary(tag, payload, full=False)[0].partition(" ")
                return f"np.{dtype}({shown})"
            if tag == "$opaque" and isinstance(payload, dict):
                # a function by its qualified name (a lambda, one defined in main()): which it was
                function = jsonval.function_name(jsonval.Opaque(str(payload.get("type")), str(payload.get("repr"))))
                if function is not None and jsonval.function_why(
                        jsonval.Opaque("builtins:function", str(payload.get("repr")))) is not None:
                    return f"<{function.removeprefix('the ')}, not recorded>"
                return f"<{payload.get('type')}, not recorded>"
            if tag == "$function" and isinstance(payload, str):  # torch.nn.functional:silu -> silu
                return payload.rpartition(":")[2]
            if tag == "$generator" and isinstance(payload, dict):
                return f"Generator({payload.get('device')})"
            if tag == "$rng" and isinstance(payload, dict):  # numpy.random.Generator -> Generator(numpy)
                return f"{str(payload.get('kind')).rpartition('.')[2]}({str(payload.get('kind')).partition('.')[0]})"
            if tag in ("$dtype", "$device") and isinstance(payload, str):
                return f"torch.{payload}" if tag == "$dtype" else repr(payload)
            if tag == "$module" and isinstance(payload, dict) and isinstance(payload.get("skeleton"), dict):
                return f"{str(payload['skeleton'].get('class')).rpartition(':')[2]}(...)"  # a network it was given
            return f"{str(tag)[1:]}(...)"
        return "{" + ", ".join(f"{k}: {_shown(v, limit, depth + 1)}"
                               for k, v in list(value.items())[:_ARGUMENT_ITEMS]) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v, limit, depth + 1) for v in value[:_ARGUMENT_ITEMS]) + "]"
    return repr(value)[:limit]


def fmt_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f}ms"
    return f"{seconds * 1e6:.0f}µs"


def _fmt_value(x: float) -> str:
    """A tensor element: NaN as nan (``fmt_number`` shows a missing statistic as -)."""
    return "nan" if math.isnan(x) else fmt_number(x)


_EXACT_DIGITS = 10  # an integer element shown whole where it fits its column (value_width less the separator)


def _fmt_element(x: Any) -> str:
    """A tensor element; a complex one with its real and imaginary parts ("0.5-1.25j"); an integer one
    (a token id, an index) whole where it fits its column: 32767 and 32766 are not both 3.277e+04."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        whole = str(int(x))
        return whole if len(whole) <= _EXACT_DIGITS else fmt_number(float(x))
    if not isinstance(x, (complex, np.complexfloating)):
        return _fmt_value(float(x))
    negative = x.imag < 0 or (x.imag == 0 and math.copysign(1.0, x.imag) < 0)
    return f"{_fmt_value(float(x.real))}{'-' if negative else '+'}{_fmt_value(abs(float(x.imag)))}j"


def value_width(dtype: str) -> int:
    """Columns one element takes in the inspector's slice, its separator included: a complex one shows
    two numbers."""
    return 22 if dtype.startswith("complex") else 11


def fmt_number(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if abs(x) >= 1e4 or (abs(x) < 1e-3 and x != 0):
        return f"{x:.3e}"
    return f"{x:.4g}"


# -- the tensor inspector ---------------------------------------------------------------------------
@dataclass
class TensorView:
    title: str
    histogram: list[int]  # counts per bin over the finite values
    edges: tuple[float, float]
    values: list[str]  # the rows of the slice shown
    slice_text: str
    series: list[tuple[int, float]]  # (iteration, value) of the chosen statistic in the iterations around this one
    series_stat: str
    expected: tuple[float, float] | None  # the bounds the chosen statistic should keep, from a watch's range
    note: str | None = None
    start: int = 0  # the first element shown (the asked start, kept within the tensor)
    size: int = 0  # elements in the tensor (0 without a payload)
    series_at: int = -1  # this step's place in ``series``
    histogram_of: str = "finite values"  # what the histogram counts (a complex tensor's: magnitudes)
    # per value of ``series``: "" (drawn by its value), or what sparkline marks it as (NONFINITE, EMPTY, UNKNOWN)
    series_marks: list[str] = field(default_factory=list)
    nonfinite: str | None = None  # how many NaN and Inf it holds, and where the first is (``nonfinite_where``)
    statistics: list[str] = field(default_factory=list)  # its recorded statistics, "min -2.3", ... (stats_line)


STATISTICS = (("min", "min"), ("max", "max"), ("mean", "mean"), ("std", "std"), ("absmax", "absmax"),
              ("norm", "norm"), ("nan", "NaN"), ("inf", "Inf"))


def statistics_text(record: Any) -> list[str]:
    """A record's statistics as recorded, each "name value" ("std 1.025", "NaN 0"): what a tensor kept as
    statistics only has to show, and the std and norm that the step pane's table leaves out."""
    out = []
    for key, label in STATISTICS:
        value = record.stats.get(key)
        if value is None:
            continue
        out.append(f"{label} {int(value)}" if key in ("nan", "inf") else f"{label} {fmt_number(float(value))}")
    return out


def nonfinite_where(counted: np.ndarray, shape: tuple[int, ...]) -> str | None:
    """For values (flattened) holding NaN or Inf, how many and where the first is ("1 NaN of 256; the first
    at element 17 [1, 1]"), else None: the slice shown from element 0 may hold none of them."""
    if counted.dtype.kind != "f":
        return None
    bad = ~np.isfinite(counted)
    if not bad.any():
        return None
    nan = int(np.isnan(counted).sum())
    counts = " and ".join(f"{n} {kind}" for n, kind in ((nan, "NaN"), (int(bad.sum()) - nan, "Inf")) if n)
    first = int(np.argmax(bad))
    index = f" [{', '.join(str(int(i)) for i in np.unravel_index(first, shape))}]" if len(shape) > 1 else ""
    return f"{counts} of {len(counted)}; the first at element {first}{index} (o goes to an element)"


def tensor_view(step: Step, name: str, role: str, *, start: int = 0, rows: int = 8, stat: str = "absmax",
                bins: int = 24, per_row: int = 8) -> TensorView:
    """Histogram and a slice of one recorded tensor (``rows`` of ``per_row`` values), and its
    statistic across iterations."""
    rec = step.rec
    record = next(r for r in step.records if r.name == name and r.role == role)
    frozen = " (frozen: requires_grad=False)" if role == "param" and name in step.frozen else ""
    title = f"{role} {name}{frozen} · {shape_text(step, record)} {record.dtype} · step {step.index}"
    histogram: list[int] = []
    edges = (math.nan, math.nan)
    values: list[str] = []
    note = None
    begin = 0
    nonfinite = None
    complex_ = record.dtype.startswith("complex")
    if record.has_payload:
        flat = rec.rank.tensor(record).detach().reshape(-1)
        if flat.is_complex():  # (complex32 has no numpy dtype)
            data = flat.cdouble().numpy()
            # its histogram is of its magnitudes, as its statistics are: in its own precision, NaN and Inf left out
            counted = flat.abs().double().numpy()
        else:
            data = flat.double().numpy() if flat.is_floating_point() or flat.dtype == np.bool_ else flat.numpy()
            counted = data
        finite = counted[np.isfinite(counted)] if counted.dtype.kind == "f" else counted
        nonfinite = nonfinite_where(counted, tuple(record.shape))
        if len(finite):
            counts, e = np.histogram(finite, bins=bins)
            histogram, edges = counts.tolist(), (float(e[0]), float(e[-1]))
        width = max(1, per_row)
        column = value_width(record.dtype) - 1
        begin = max(0, min(start, len(data) - 1))  # past the end: the last element
        chunk = data[begin:begin + rows * width]
        for k in range(0, len(chunk), width):
            values.append(f"{begin + k:>8}: " + " ".join(f"{_fmt_element(v):>{column}}" for v in chunk[k:k + width]))
        slice_text = f"elements {begin}..{begin + len(chunk) - 1} of {len(data)} (flattened)" if len(data) else \
            "no elements"
        if len(data) and not len(finite):
            note = "no finite values: no histogram"
    elif step.sparse(record) is not None:
        parts = step.sparse_parts(record)  # (1.19, where the step kept payloads: its indices and values)
        slice_text = (f"{step.sparse_text(record)}: statistics of its stored values; its indices and values are the "
                      f"records {', '.join(r.name for r in parts.records.values())}" if parts is not None else
                      f"{step.sparse_text(record)}: statistics of its stored values only (its indices and values were "
                      f"not kept: {step.rec.rank.why_no_parts(record)})")
    else:
        slice_text = "statistics only (no payload recorded)"
    if complex_ and record.has_payload:  # what the numbers on this screen are of, as the step pane's and a watch's
        note = ("complex values: the histogram and the statistics are of their magnitudes |z|; the values shown "
                "are real and imaginary parts" + (f" ({note})" if note else ""))
    elif complex_:
        note = "complex values: the statistics are of their magnitudes |z|"
    series, series_at, marks = _series(rec, step, record, stat)
    expected = None
    for watch in step.extra.get("watches", []) or []:
        if watch.get("name") == name and watch.get("expected_range"):
            expected = _stat_bounds(stat, *watch["expected_range"])
    size = math.prod(record.shape) if record.has_payload else 0
    shown = f"{stat} of |z|" if complex_ and stat not in ("nan", "inf") else stat
    return TensorView(title, histogram, edges, values, slice_text, series, shown, expected, note, begin, size,
                      series_at, "the finite values' magnitudes |z|" if complex_ else "finite values", marks,
                      nonfinite, statistics_text(record))


def _stat_bounds(stat: str, lo: float, hi: float) -> tuple[float, float] | None:
    """What a watch's expected value range ``[lo, hi]`` says of a statistic: its values' min, max
    and mean lie in it, their absmax within the larger bound, and none is NaN or Inf; of the
    std and norm it says nothing."""
    if stat in ("min", "max", "mean"):
        return (lo, hi)
    if stat == "absmax":
        return (0.0, max(abs(lo), abs(hi)))
    if stat in ("nan", "inf"):
        return (0.0, 0.0)
    return None


def _series(rec: Recording, step: Step, record: Any, stat: str, width: int = 0,
            ) -> tuple[list[tuple[int, float]], int, list[str]]:
    """The statistic of the same tensor of the same call in the iterations around the step's own
    (``width`` of them, the step's among them; 0: SPARK_WIDTH), where the step's is in that list, and
    how sparkline marks each (``_mark``).
    The same call: the same step name, module path and phase, with autograd on or off as it was (an
    evaluation's calls are not the training's), and as many such calls before it in its iteration."""
    width = width or SPARK_WIDTH
    same = rec.steps.filter(name=step.name, module_path=step.module_path, phase=step.phase)
    rows = same.rows
    ids = np.asarray(rec.rank.column("steps/settings"))[rows]
    _, first_of, inverse = np.unique(ids, return_index=True, return_inverse=True)  # (one settings doc each)
    grad = np.array([rec.step(int(rows[k])).grad_enabled for k in first_of], dtype=bool)
    rows = rows[grad[inverse.reshape(-1)] == step.grad_enabled]
    iterations = same.column("iteration")[np.isin(same.rows, rows)]
    starts = np.r_[0, np.flatnonzero(np.diff(iterations)) + 1]  # each iteration's first such call
    ordinal = np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
    mine = int(ordinal[np.searchsorted(rows, step.index)])
    rows = rows[ordinal == mine]
    at = int(np.searchsorted(rows, step.index))
    first = max(0, min(at - width // 2, len(rows) - width))
    out, marks = [], []
    for index in rows[first:first + width]:
        other = rec.step(int(index))
        for r in other.records:
            if r.name == record.name and r.role == record.role:
                out.append((other.iteration, float(r.stats[stat])))
                marks.append(_mark(other, r, stat))
                break
        else:
            if other.index < step.index:
                at -= 1  # a call without this tensor: not drawn
    return out, at - first, marks


NONFINITE, EMPTY, UNKNOWN = "✗", "∅", "·"  # sparkline's marks: held NaN/Inf, no elements, no statistics
MARKS = {NONFINITE: "held NaN or Inf", EMPTY: "no elements", UNKNOWN: "no statistics recorded"}


def _mark(step: Step, record: Any, stat: str) -> str:
    """How sparkline draws a record's statistic ``stat``: "" by its value; NONFINITE where the tensor held
    NaN or Inf (its min, max, mean and absmax are over its finite values: a bar would look normal);
    EMPTY where it had no elements (a graph with no edges: no value to draw, NaN, but nothing went
    wrong); UNKNOWN where the recording has no statistics of it."""
    if record.stats["nan"] or record.stats["inf"]:
        return NONFINITE
    if math.isfinite(record.stats[stat]):
        return ""
    sparse = step.sparse(record)
    if math.prod(record.shape) == 0 or (sparse is not None and sparse[1] == 0):
        return EMPTY
    return UNKNOWN


SPARK = "▁▂▃▄▅▆▇█"


SPARK_WIDTH = 60  # characters of a sparkline: one value each


def sparkline(values: list[float], marks: list[str] | None = None) -> str:
    """The values, scaled between the least and the greatest finite one of them that is not marked;
    ``marks``: per value, "" or the character drawn for it instead (``_mark``: held NaN/Inf, no
    elements). A value that is not finite and has no mark is drawn NONFINITE."""
    marks = marks or [""] * len(values)
    finite = [v for v, m in zip(values, marks) if math.isfinite(v) and not m]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 0.0)
    out = []
    for v, m in zip(values, marks):
        if m or not math.isfinite(v):
            out.append(m or NONFINITE)
        else:
            out.append(SPARK[0 if hi == lo else int((v - lo) / (hi - lo) * (len(SPARK) - 1))])
    return "".join(out)


# -- alerts and the paper view -----------------------------------------------------------------------
@dataclass
class AlertRow:
    index: int
    kind: str  # "origin", "entered" (came in from outside the recorded steps or another rank), "exception", "alert"
    text: str


def alerts(rec: Recording, limit: int = 500) -> list[AlertRow]:
    """The run against the paper's expectations: the NaN origin, exceptions (the one that ended the run
    too, raised outside every recorded step), broken watches."""
    from replayer import first_nonfinite

    out: list[AlertRow] = []
    origin = first_nonfinite(rec, all_ranks=True)
    if origin.rank not in (None, rec.rank.rank):  # on another rank: say so, no row of this one to point at
        out.append(AlertRow(-1, "origin", f"{origin.cause} (open rank {origin.rank} with --rank {origin.rank})"))
        origin = first_nonfinite(rec)
    if origin.step is not None:
        out.append(AlertRow(origin.step.index, "origin", origin.cause))
    elif origin.entered is not None:  # no step of this rank made it: where it came in, not an origin
        out.append(AlertRow(origin.entered.index, "entered", origin.cause))
    status = rec.steps.column("status")
    exception = status == layout.STATUSES.index("exception")
    ended = _ended_outside_steps(rec, origin, exception)
    if ended is not None:
        out.append(ended)
    for index in np.flatnonzero(exception | with_alerts(rec))[:limit]:
        step = rec.step(int(index))
        if step.status == "exception":
            exc = step.extra.get("exception") or {}
            out.append(AlertRow(step.index, "exception", f"{describe(step)}: {exc.get('type')}: {exc.get('message')}"))
        for alert in step.extra.get("alerts", []) or []:
            out.append(AlertRow(step.index, "alert", f"{describe(step)}: {alert_text(alert, step)}"))
    return out


def _ended_outside_steps(rec: Recording, origin: Any, exception: np.ndarray) -> AlertRow | None:
    """The exception that ended the run, where no recorded step's row says it (raised outside every step),
    at the last recorded step: with the NaN/Inf it speaks of, where no recorded step held one."""
    why = rec.ended_by
    final = rec.rank.final.get("exception")
    if why is None or not isinstance(final, dict) or not len(rec):
        return None
    if origin.ended_by is not None:
        return AlertRow(len(rec) - 1, "exception", origin.cause)
    for index in np.flatnonzero(exception).tolist():  # the exception escaped a step, whose row says it
        exc = rec.step(int(index)).extra.get("exception") or {}
        if str(exc.get("message") or "").splitlines()[:1] == str(final.get("message") or "").splitlines()[:1]:
            return None
    last = rec.step(len(rec) - 1)
    return AlertRow(last.index, "exception", f"the run ended by {why}, raised after the last recorded step "
                                             f"({describe(last)}), outside every recorded step")


@dataclass
class PaperNode:
    label: str
    forward: int = 0
    backward: int = 0
    seconds: float = 0.0
    alerts: int = 0
    children: dict[str, PaperNode] = field(default_factory=dict)
    filter: str = ""  # the timeline filter of its steps: name:["A", "B"] (exactly the step names under it)
    names: set[tuple[str, str | None]] = field(default_factory=set)  # (step name, paper label)


def paper_tree(model: TimelineModel) -> PaperNode:
    """Algorithm → step → equation → step name, with calls, time and anomalies per node (not Inf the
    model means: a mask's, which ``n`` passes over too). A node's time is that of its calls not inside
    another of its calls (a recursion's once, as ``pdbg info`` counts it)."""
    root = PaperNode("paper")
    if not model.n:
        return root
    rec = model.rec
    papers = rec._papers
    held: dict[int, tuple[PaperNode, np.ndarray]] = {}  # per node: its steps
    for (name, label), first, mask in rec.paper_steps():
        paper = dict(papers[first])
        node = root
        path = _paper_path(paper) + [str(name)]
        for part in (p for p in path if p):
            node = node.children.setdefault(part, PaperNode(part))
        for n in [root, *_chain(root, [p for p in path if p])]:
            n.names.add((str(name), label))
            n.filter = "name:" + json.dumps(sorted(([a, b] for a, b in n.names), key=str), ensure_ascii=False)
            n.forward += int((mask & (model.phase == 0)).sum())
            n.backward += int((mask & (model.phase == 1)).sum())
            n.alerts += int((mask & (model.status != 0) & ~model.meant).sum())  # as n counts them
            steps = held.setdefault(id(n), (n, np.zeros(model.n, bool)))[1]
            steps |= mask
    spans, parent = model.t_end - model.t_start, model.parent
    for n, steps in held.values():
        n.seconds = float(spans[steps & ~inside_another_of(steps, parent)].sum())
    return root


def _paper_path(paper: dict[str, Any]) -> list[str]:
    """A reference's branches in the paper tree: algorithm, step number, then the label and equation
    where a branch above does not already say them ("Algorithm 1" → "step 5" → "Eq. 7")."""
    label, step, equation = str(paper.get("label") or ""), paper.get("step"), paper.get("equation")
    algorithm = algorithm_of(paper) or (label if step is not None else None)
    path = [p for p in (algorithm, step is not None and f"step {step}") if p]
    rest = label if label and label != algorithm and label.lower() != f"step {step}".lower() else ""
    if equation and str(equation) != label:
        equation = str(equation)
        rest = f"{rest} {equation}" if equation.startswith("(") else f"{rest} ({equation})" if rest else equation
    return [*path, rest] if rest else path


def _chain(root: PaperNode, parts: list[str]) -> list[PaperNode]:
    out, node = [], root
    for part in parts:
        node = node.children[part]
        out.append(node)
    return out


def cut_dotted(name: str, width: int) -> str:
    """A dotted name (a parameter's path) in at most ``width`` columns, cut in its middle: its start tells
    ``input_proj`` from ``output_proj``, its end ``weight`` from ``bias`` ("input_proje…long_name.weight").
    The end keeps its last part whole where it can, and three fifths of the room."""
    if cell_len(name) <= width:
        return name
    room = width - 1
    end = max(cell_len(name.rsplit(".", 1)[-1]) + 1, room * 3 // 5)
    if end >= room - 2:  # no room for a start worth reading
        return fit_cells(name, width, keep_end=True).rstrip()
    tail = fit_cells(name, end + 1, keep_end=True)[1:]
    return set_cell_size(name, room - cell_len(tail)) + "…" + tail


def shortened_path(path: str, width: int) -> str:
    """``path`` in at most ``width`` terminal columns: whole where it fits, else its last parts after
    "…/" (``…/runs/gpt2_nan.zarr``; the file's name is what tells recordings apart), else the name's end."""
    if cell_len(path) <= width:
        return path
    parts = path.rstrip("/").split("/")
    tail = parts[-1]
    for part in reversed(parts[:-1]):
        if cell_len(f"…/{part}/{tail}") > width:
            break
        tail = f"{part}/{tail}"
    return f"…/{tail}" if cell_len(f"…/{tail}") <= width else fit_cells(tail, width, keep_end=True)


def fit_cells(text: str, width: int, keep_end: bool = False) -> str:
    """``text`` in exactly ``width`` terminal columns (wide characters take two), padded, or with an
    ellipsis where it was cut (at its start with ``keep_end``: the end of a module path says most)."""
    if cell_len(text) <= width:
        return set_cell_size(text, width)
    if not keep_end:
        return set_cell_size(text, width - 1) + "…"
    tail = ""
    for ch in reversed(text):
        if cell_len(ch + tail) > width - 1:
            break
        tail = ch + tail
    return set_cell_size("…" + tail, width)
