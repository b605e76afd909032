"""``replayer.open``: a recording as a table of steps and, per step, everything that was captured.

    rec = replayer.open("run.zarr")
    len(rec.steps)                                   # committed steps
    rec.steps.filter(name="smooth_relu", phase="backward", iteration=17)
    rec.steps.column("iteration")                    # a numpy array
    step = rec.step("smooth_relu@iter=17#3")         # or an index
    step.tensor("output")                            # the exact recorded tensor

Opening reads the format header and the manifest only; columns are read when first asked for, and
names, paths and paper references are decoded once per distinct value, so a table of millions of
steps costs a few numpy arrays.
"""

from __future__ import annotations

import json
import operator
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as _field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from recorder import names, snapshot
from recorder.errors import FormatError, PdbgError, RecordingError, StepNotFoundError, StepPositionError
from recorder.items import OBJECTS_KEY
from recorder.monitors import parse_selector
from recorder.names import ESCAPES, printable  # noqa: F401 (where the replayer's callers find them)
from recorder.store import backend, layout
from recorder.store.reader import RankReader, RunReader, SparseParts, TensorRecord

BUNDLE_KEY = "bundle.json"  # a failure bundle's own description, at the store's root
BUNDLE_FORMAT = "paperdebugger.bundle"  # its "format"
_INT_COLUMNS = ("phase", "iteration", "call", "parent", "forward", "status", "tensor_start", "tensor_count")


def _same_place(a: Any, b: Any) -> bool:
    """Whether two recordings were opened from one path (a store object: the same object)."""
    if isinstance(a, (str, os.PathLike)) and isinstance(b, (str, os.PathLike)):
        return os.path.realpath(os.fspath(a)) == os.path.realpath(os.fspath(b))
    return a is b


def opened(rec: Recording | str | os.PathLike[str] | Any) -> Recording:
    """``rec`` where it is a Recording, else the recording at that path: every function of the API takes
    either, as ``replay`` does."""
    return rec if isinstance(rec, Recording) else open(rec)


def join_path(prefix: str, name: str) -> str:
    """A module path below another ("" is the outermost module)."""
    return f"{prefix}.{name}" if prefix and name else (prefix or name)


def skeleton_modules(doc: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(relative path, document) of a module skeleton and every module below it."""
    if isinstance(doc, dict):
        yield path, doc
        for name, child in (doc.get("children") or {}).items():
            yield from skeleton_modules(child, join_path(path, name))


def open(path: str | os.PathLike[str] | Any, rank: int = 0, *,  # noqa: A001 (the API's name)
         storage_options: dict[str, Any] | None = None) -> Recording:
    """Open a recording (a directory, a zip/bundle file, a URL or a zarr store) for inspection and replay.

    Args:
        path: where the recording is: ``run.zarr``, ``failure.pdbg``, ``s3://bucket/run.zarr``.
        rank: which process's steps (0 unless the run was distributed).
        storage_options: a URL's fsspec options (credentials, ``client_kwargs={"endpoint_url": ...}``);
            default ``$PDBG_STORAGE_OPTIONS``, else the filesystem's own environment (AWS_* for s3).

    Raises NotARecordingError, FormatError or SchemaVersionError with a one-line message.
    """
    _commit_own(path)
    return Recording(path, rank, storage_options=storage_options)


def _commit_own(path: Any) -> None:
    """Commit what this process has recorded so far into ``path`` when it is still recording there (a notebook's
    cell after the training cell that left its recording open): the writer commits only every
    ``flush_interval``, so a recording opened at once lacked its last second of steps, a short training's all,
    and bisect found no NaN in it."""
    recording = sys.modules.get("recorder.run")  # (not imported: nothing is recording)
    run = recording.active_run() if recording is not None else None
    if run is None or not isinstance(path, (str, os.PathLike)) or not isinstance(run.path, (str, os.PathLike)):
        return
    try:
        same = os.path.realpath(os.fspath(path)) == os.path.realpath(os.fspath(run.path))
    except (OSError, ValueError):
        return
    if same:
        run.flush()


class Recording:
    """A recording: run metadata, the step table and single steps."""

    def __init__(self, path: str | os.PathLike[str] | Any, rank: int = 0, *,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.reader = RunReader(path, storage_options=storage_options)
        self.rank: RankReader = self.reader.rank(rank)
        self.path = path
        self.storage_options = storage_options  # to open it again (a reload)
        self.known_origin: Any = None  # first_nonfinite's last answer here, for summaries that must not search

    def close(self) -> None:
        """Let go of the recording's files: a bundle (a zip) stays open while its Recording lives.
        ``with replayer.open(path) as rec:`` closes it at the end of the block."""
        self.reader.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    @property
    def status(self) -> str:
        return self.reader.status

    @property
    def run_info(self) -> dict[str, Any]:
        """Where and how this rank's process recorded: command line, versions, host, git commit, ..."""
        return self.rank.run_info

    @property
    def ended_by(self) -> str | None:
        """Why this rank's recording is not ``complete``, in a few words ("SystemExit: 3", "SIGTERM",
        the writer's failure...); None when it is, or while it records."""
        if self.rank.status == "recording":
            return None
        why = self._ended_by()
        torn = self.rank.torn  # what of the committed steps was lost (the recording's last writes)
        return why if not torn else f"{why}; {torn}" if why else torn

    def _ended_by(self) -> str | None:
        if self.rank.status in ("complete", "recording"):
            return None
        final = self.rank.final
        for key, what in (("writer_error", "the writer failed"), ("recorder_failure", "recording failed")):
            if final.get(key):
                return f"{what}: {str(final[key]).splitlines()[0][:300]}"
        exc = final.get("exception")
        if isinstance(exc, dict) and exc.get("type"):
            name = str(exc["type"]).rpartition(":")[2]
            message = _first_line(str(exc.get("message") or ""))[:300]
            said = f"{name}: {message}" if message else name
            during = final.get("raised_during")  # (a framework callback's: validation, which it does not record)
            return f"{said.rstrip('.')}, raised during {str(during)[:200]}" if during else said
        if final.get("signal"):  # (written since 1.14; before, only flight mode's ring writes named it)
            return str(final["signal"])[:40]
        signals = [d.get("reason") for d in (final.get("flight") or {}).get("dumps", [])
                   if d.get("reason") in ("SIGTERM", "SIGINT", "SIGHUP")]
        if signals:
            return signals[-1]
        if final.get("died"):  # a hard crash under pdbg record, its ring written by the supervisor
            return f"the process died ({str(final['died']).splitlines()[0][:300]})"
        return "the process ended without closing the recording (killed, or it died)" if not final else None

    @property
    def ranks(self) -> list[int]:
        """The ranks of the run with committed steps (one for a single process)."""
        return self.reader.ranks

    def of_rank(self, rank: int) -> Recording:
        """The same run seen from another rank (the store is not opened again)."""
        if rank == self.rank.rank:
            return self
        other = Recording.__new__(Recording)
        other.reader, other.path, other.storage_options = self.reader, self.path, self.storage_options
        other.rank = self.reader.rank(rank)
        other.known_origin = None
        return other

    def __len__(self) -> int:
        return len(self.rank)

    def __repr__(self) -> str:
        return printable(f"<Recording {self.reader.label}: {len(self)} step{'s' if len(self) != 1 else ''}, "
                         f"{self.status}>")

    def _repr_html_(self) -> str:
        from . import notebook

        return notebook.recording(self)

    @cached_property
    def bundle_info(self) -> dict[str, Any] | None:
        """For a failure bundle: its ``bundle.json`` (main step, origin, bundled sources, verification)."""
        raw = backend.get(self.reader.store, BUNDLE_KEY)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            raise FormatError(f"{self.reader.label}: {BUNDLE_KEY} is not valid JSON") from None
        if isinstance(doc, dict) and doc.get("format", BUNDLE_FORMAT) != BUNDLE_FORMAT:
            raise FormatError(f"{self.reader.label}: {BUNDLE_KEY} says it is a {str(doc['format'])[:60]!r}, which this "
                              f"PaperDebugger does not read (it reads {BUNDLE_FORMAT!r}); upgrade paperdebugger, or "
                              "open the recording the bundle was made from")
        if not isinstance(doc, dict) or not isinstance(doc.get("main_step"), int):
            raise FormatError(f"{self.reader.label}: {BUNDLE_KEY} names no main step")
        kinds = {"origin": dict, "verified": (dict, type(None)), "sources": dict, "modules": dict,
                 "created": (str, type(None))}
        wrong = [key for key, kind in kinds.items() if key in doc and not isinstance(doc[key], kind)]
        if wrong:
            raise FormatError(f"{self.reader.label}: {BUNDLE_KEY} holds {', '.join(wrong)} of the wrong type; the "
                              "bundle is damaged or was not made by PaperDebugger")
        return doc

    @property
    def scaler_skips(self) -> dict[str, Any] | None:
        """The optimizer steps mixed precision's GradScaler skipped, as the rank's end recorded them
        (``{"count", "iterations", "scales"}``: docs/FORMAT.md) or, for a run that never closed, as
        its last commit did; None (none, or a damaged record)."""
        doc = self.rank.final.get("grad_scaler_skipped", self.rank.committed_info.get("grad_scaler_skipped"))
        ok = isinstance(doc, dict) and isinstance(doc.get("count"), int) and isinstance(doc.get("iterations"), list)
        return doc if ok else None

    @property
    def main_step(self) -> Step | None:
        """A bundle's main step (what it was made to replay); None for a recording."""
        info = self.bundle_info
        return None if info is None else self.step(int(info["main_step"]))

    @cached_property
    def steps(self) -> StepTable:
        return StepTable(self, np.arange(len(self.rank), dtype=np.int64))

    def step(self, which: int | str | Step) -> Step:
        """One step by index or selector (``NAME[@iter=K][#CALL][:backward]``; the first match, and of
        backward steps the one of the first call), or a Step of this run given back (``replay`` and
        ``bundle`` take one: a step of another run is refused, not taken for this one's)."""
        if isinstance(which, Step):
            return self._own(which)
        if not isinstance(which, (str, bool, int)):
            try:  # numpy's integers, a 0-d integer tensor
                which = operator.index(which)
            except TypeError:
                raise RecordingError(f"a step is named by its index (an int) or a selector (a str: "
                                     f"NAME[@iter=K][#CALL][:backward]), not {type(which).__name__} {which!r:.40}"
                                     ) from None
        if isinstance(which, bool):
            raise RecordingError(f"a step is named by its index (an int) or a selector (a str), not the bool {which}")
        if isinstance(which, int):
            index = int(which)
            if not 0 <= index < len(self):
                raise StepNotFoundError(f"step {index} is out of range: {self.reader.label} has " + (
                    f"{len(self)} step{'s' if len(self) != 1 else ''} (0..{len(self) - 1})" if len(self) else
                    "no steps") + self._origin_hint(index))
            return Step(self, index)
        if isinstance(which, str) and which.strip().lstrip("-").isdecimal():
            return self.step(int(which))
        found = self.steps.select(which)
        if not len(found):
            labels = sorted({str(x) for x in self._labels if x is not None})
            raise StepNotFoundError(f"no step matches {which!r}; " + (self._nearest(which) or (
                f"names in this recording: {', '.join(names.shown(n) for n in sorted(set(self.steps.names))[:20])}"
                + (f"; paper labels: {', '.join(names.shown(lb) for lb in labels[:20])}" if labels else ""))))
        return self._picked(found)

    def _own(self, step: Step) -> Step:
        """``step``, where it is this run's (any rank of it; opened here or again from the same path);
        a step of another recording would be replayed or bundled from that one under this one's name."""
        if step.rec.reader is self.reader or _same_place(step.rec.path, self.path):
            return step
        raise StepNotFoundError(f"step {step.index} ({step.selector}) is a step of {step.rec.reader.label}, not of "
                                f"{self.reader.label}: give it with its own recording, or name this recording's "
                                f"step by index or selector ({step.selector!r})")

    def _origin_hint(self, index: int) -> str:
        """For a bundle asked for a step by the number it had in the recording the bundle was made from (what
        `pdbg bisect` named there): that a bundle numbers its steps anew, and which it is here."""
        try:
            info = self.bundle_info
        except PdbgError:  # (a damaged bundle.json: the refusal stands as it is)
            return ""
        origin = info.get("origin") if isinstance(info, dict) else None
        if not isinstance(origin, dict) or origin.get("index") != index:
            return ""
        return (f"; a bundle numbers its steps from 0: step {index} of the recording it was made from is its main "
                f"step, {info['main_step']} here (or leave STEP out)")

    def _picked(self, found: StepTable) -> Step:
        """The step a selector names among the steps it matches (``found``, not empty): the first, and of
        backward steps the backward of the first call, as #CALL counts (the last call's runs first)."""
        if found[0].phase == "backward":
            forward = np.asarray(self.rank.column("steps/forward"))[found.rows].astype(np.int64)
            return Step(self, int(found.rows[np.argmin(np.where(forward >= 0, forward, found.rows))]))
        return found[0]

    def _nearest(self, which: str) -> str | None:
        """For a selector that matches nothing, what its shorter forms match: the calls or iterations
        of a step that has them, or that a call has no backward step."""
        for cut, what in ((":backward", "backward"), ("#", "call"), ("@iter=", "iteration")):
            at = which.rfind(cut)
            if at <= 0:
                continue
            try:
                shorter = self.steps.select(which[:at])
            except PdbgError:
                continue
            if not len(shorter):
                continue
            if what == "backward":
                calls = [self.step(int(i)) for i in shorter.rows[:64]]
                if not any(call.grad_enabled for call in calls):
                    return (f"{which[:at]} has no backward step: it ran with gradients off (torch.no_grad or "
                            "inference_mode: an evaluation)")
                outputs = [r for call in calls for r in call.tensors("output")]
                if outputs and not any(r.requires_grad for r in outputs):
                    return (f"{which[:at]} has no backward step: its outputs needed no gradient (its parameters "
                            "are frozen, requires_grad=False, and its inputs need none either, so no backward "
                            "pass runs through it)")
                return (f"{which[:at]} has no backward step (no backward pass reached it: its output was not "
                        "used for the loss, or was detached, as truncated backpropagation does)")
            values = np.unique(shorter.column(what))
            gaps = values[-1] - values[0] + 1 != len(values)  # (calls 1 and 3 of blocks.1: not "1..3")
            span = (", ".join(str(v) for v in values[:3]) + (f", ..., {values[-1]}" if len(values) > 3 else "")
                    if gaps else f"{values[0]}..{values[-1]}") if len(values) > 1 else f"{values[0]}"
            asked = re.match(r"\d+", which[at + len(cut):])
            if len(values) > 2 and gaps and asked is not None:
                k = int(asked[0])  # inside the span, but not one of them (a step run every 10 iterations)
                near = [str(v) for v in (values[values < k][-1:].tolist() + values[values > k][:1].tolist())]
                return (f"{which[:at]} has {len(values)} {what}s ({span}); the nearest to {k}: "
                        f"{' and '.join(near)}")
            names = list(dict.fromkeys(str(n) for n in shorter.names))
            if what == "call" and len(names) > 1:  # a label several steps share: each counts its own calls
                listed = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                iteration = which[which.find("@iter="):at] if "@iter=" in which[:at] else ""
                return (f"{which[:at]} names {len(names)} steps ({listed}), each counting its own calls (calls "
                        f"{span} here); select one by its name, e.g. {names[0]}{iteration}#0")
            text = f"{which[:at]} has {what}s {span}" if len(values) > 1 else f"{which[:at]} has only {what} {span}"
            base = re.split(r"[@#:]", which, maxsplit=1)[0]
            if what == "call" and len(names) == 1 and base != names[0] and int(values[0]) > 0:
                # (a module path's calls are numbered among its step's: every module of the class, as they ran)
                text += (f" (calls are counted per step, {names[0]}, across every module of it in the order they "
                         f"ran: {int(values[0])} ran before {base}'s first call in that iteration)")
            return text
        return None

    # -- decoded documents, once per distinct id ---------------------------------------------------
    def _decode(self, column: str) -> np.ndarray:
        """A document-id column decoded to Python objects (one doc read per distinct id)."""
        ids = self.rank.column(f"steps/{column}")
        uniq, inverse = np.unique(ids, return_inverse=True)
        values = np.empty(len(uniq), dtype=object)
        for i, doc_id in enumerate(uniq):
            values[i] = self.rank.doc(int(doc_id))
        return values[inverse] if len(ids) else np.empty(0, dtype=object)

    @cached_property
    def _names(self) -> np.ndarray:
        return _texts(self._decode("name"))

    @cached_property
    def _paths(self) -> np.ndarray:
        return _texts(self._decode("module_path"))

    @cached_property
    def _papers(self) -> np.ndarray:
        defs = self._decode("definition")
        return np.array([paper_of(d) for d in defs], dtype=object)

    @cached_property
    def _object_places(self) -> dict[tuple[str, str], tuple[list[int], int]]:
        """Where several module objects ran as one step (a student and its EMA teacher, deep copies of
        one class: the same step name and module path): ``{(name, module path): (their instances in
        the order first called, how many)}``, from the run's ``module_objects`` (1.16; written as the
        run goes, so a run that never closed has them too). Empty for an older recording."""
        found = self.rank.final.get(OBJECTS_KEY, self.rank.committed_info.get(OBJECTS_KEY))
        places: dict[tuple[str, str], tuple[list[int], int]] = {}
        for entry in found if isinstance(found, list) else []:
            if not isinstance(entry, dict) or not isinstance(entry.get("instances"), list):
                continue  # (a damaged entry: that place is not told apart, the others are)
            instances = [i for i in entry["instances"] if isinstance(i, int) and not isinstance(i, bool)]
            count = entry.get("count")
            count = count if isinstance(count, int) and count >= len(instances) else len(instances)
            if count > 1:
                places[(str(entry.get("name")), str(entry.get("module_path") or ""))] = (instances, count)
        return places

    def objects_numbered(self) -> None:
        """Raise RecordingError where the recording cannot say which module object ran a step: one made
        before schema 1.16, which listed no places several objects ran at (``_object_places``)."""
        version = self.reader.schema_version
        if layout.parse_version(version) < (1, 16) and not self._object_places:
            raise RecordingError(f"{self.reader.label} was recorded with schema {version}, which does not list the "
                                 "module objects that ran as one step (a model and its EMA copy): they are numbered "
                                 "in recordings of schema 1.16 and later; record it again with this version")

    @cached_property
    def _object_numbers(self) -> np.ndarray:
        """Per step, ``k`` of ``Step.module_object`` (0 where one module object ran as the step, or the
        object is past the listed ones): the module column, and one document per distinct module document."""
        if not self._object_places or not len(self):
            return np.zeros(len(self), dtype=np.int64)
        number = {i: k for instances, _ in self._object_places.values() for k, i in enumerate(instances, 1)}
        col = np.asarray(self.rank.column("steps/module"), dtype=np.int64)
        numbers = np.zeros(int(col.max()) + 2, dtype=np.int64)  # the last: -1, no module document
        for doc_id in np.unique(col[col >= 0]):
            doc = self.rank.doc(int(doc_id))
            numbers[doc_id] = number.get(doc.get("instance"), 0) if isinstance(doc, dict) else 0
        return numbers[col]

    @cached_property
    def _modules(self) -> np.ndarray:
        """Per step: whether it is a module's (its definition's kind), not a function's."""
        return np.array([isinstance(d, dict) and d.get("kind") == "module" for d in self._decode("definition")],
                        dtype=bool)

    @cached_property
    def _labels(self) -> np.ndarray:
        return np.array([p.get("label") for p in self._papers], dtype=object)

    @cached_property
    def _paper_groups(self) -> tuple[dict[tuple[str, str | None], tuple[int, list[int]]], np.ndarray]:
        """``({(step name, paper label): (its first step, its definition groups)}, each step's
        definition group)``, in the order steps first appear: steps of different classes or functions
        may share a name (two ``Attention`` classes, Eq. 3 and Eq. 5), told apart by their definitions."""
        if not len(self):
            return {}, np.zeros(0, np.int64)
        keys = np.stack([np.asarray(self.rank.column(f"steps/{c}")) for c in ("name", "definition")], axis=1)
        _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        members: dict[tuple[str, str | None], list[int]] = {}
        for g in np.argsort(first, kind="stable"):
            i = int(first[g])
            members.setdefault((str(self.step(i).name), self.step(i).paper.get("label")), []).append(int(g))
        return {key: (int(first[gs[0]]), gs) for key, gs in members.items()}, np.asarray(inverse).reshape(-1)

    def paper_steps(self) -> Iterator[tuple[tuple[str, str | None], int, np.ndarray]]:
        """Each paper step, in the order they first ran: ((step name, paper label), its first step, a
        mask of its steps). Steps of different classes or functions may share a name."""
        groups, inverse = self._paper_groups
        for key, (first, gs) in groups.items():
            yield key, first, np.isin(inverse, gs)

    def paper_step_mask(self, name: str, label: str | None) -> np.ndarray:
        """A mask of the steps of one paper step (see ``paper_steps``); all False if there is none."""
        groups, inverse = self._paper_groups
        found = groups.get((name, label))
        return np.isin(inverse, found[1]) if found else np.zeros(len(inverse), dtype=bool)

    def check_payloads(self, progress: Callable[[int, int], None] | None = None) -> ChecksumReport:
        """Read every payload of every rank of the run and check its bytes against their recorded
        checksum (``pdbg info --check``): what a replay of every step would find corrupted, without
        replaying. Each stored payload is read once, whatever number of tensor records share it, and
        one blob chunk is held at a time.

        Args:
            progress: called as ``progress(done, total)`` after each payload.

        Raises FormatError where the tables that say where the payloads are cannot be read.
        """
        ranks = [self.of_rank(r) for r in self.ranks]
        total, done, nbytes = sum(r.rank.lengths["payloads"] for r in ranks), 0, 0
        damaged = []
        # the tables first: a step's or tensor record's chunk lost is damage a replay or bisect meets too
        tables = [(rec.rank.rank, problem) for rec in ranks for problem in rec.rank.check_tables()]
        for rec in ranks:
            holders: tuple[np.ndarray, np.ndarray] | None = None  # (payload column sorted, its rows): at first damage
            for found in rec.rank.check_payloads():
                done, nbytes = done + 1, nbytes + found.nbytes
                if found.problem is not None:
                    if holders is None:
                        column = rec.rank.payload_column()
                        order = np.argsort(column, kind="stable")
                        holders = column[order], order
                    damaged.append(DamagedPayload(rec.rank.rank, found.payload, found.problem,
                                                  rec._users(found.payload, *holders)))
                if progress is not None:
                    progress(done, total)
        return ChecksumReport(done, nbytes, damaged, tables)

    def _users(self, payload: int, sorted_payloads: np.ndarray, rows: np.ndarray) -> list[tuple[int, str | None, str]]:
        """The tensor records of this rank that hold ``payload`` (found in its records' payload column, sorted, and
        the rows in that order), by step: (step index, step name, record name), the step's name None where its
        step was not committed (a record is written before its step)."""
        lo, hi = np.searchsorted(sorted_payloads, [payload, payload + 1])
        out = []
        for row in rows[lo:hi].tolist():
            record = self.rank.tensor_record(row)
            out.append((record.step, self.step(record.step).name if record.step < len(self) else None, record.name))
        return sorted(out, key=lambda user: user[0])


@dataclass(frozen=True)
class DamagedPayload:
    """A payload whose bytes are not the bytes recorded, or cannot be read (``Recording.check_payloads``)."""

    rank: int
    payload: int  # its row in the rank's payloads/ table
    problem: str  # what is wrong and where: "payload 5, rank0/blobs/u4[40:80]: payload checksum mismatch"
    used_by: list[tuple[int, str | None, str]]  # (step index, step name, record name) of each tensor record holding it

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "payload": self.payload, "problem": self.problem,
                "used_by": [{"step": i, "name": name, "record": record} for i, name, record in self.used_by]}


@dataclass(frozen=True)
class ChecksumReport:
    """What ``Recording.check_payloads`` found: how many payloads it read, their bytes, and the damaged ones."""

    payloads: int
    nbytes: int
    damaged: list[DamagedPayload]
    # (rank, what is wrong) per column of the step, tensor, payload or document tables that cannot be read whole
    damaged_tables: list[tuple[int, str]] = _field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.damaged and not self.damaged_tables

    def to_json(self) -> dict[str, Any]:
        return {"payloads": self.payloads, "bytes": self.nbytes, "damaged": [d.to_json() for d in self.damaged],
                "damaged_tables": [{"rank": rank, "problem": problem} for rank, problem in self.damaged_tables]}


_CONTAINER_KINDS = {"a tensor", "a list", "a dict", "a tuple", "a namedtuple", "a dataclass", "a mapping", "a object",
                    "a set", "a frozenset"}  # (what a container holds is named on its own: args.0.1)


def value_kind(doc: Any) -> str | None:
    """What an encoded value is, in words: "a numpy float64 array of shape [4]", "a numpy float32",
    "a tensor", "an int", "a numpy:ndarray not recorded as data"; None for a missing one (no output)."""
    if doc is None:
        return None
    if isinstance(doc, dict) and len(doc) == 1:
        tag, payload = next(iter(doc.items()))
        if tag in ("$tensor", "$tensor_meta"):
            return "a tensor"
        if tag == "$ndarray" and isinstance(payload, dict):
            return f"a numpy {payload.get('dtype')} array of shape {payload.get('shape')}"
        if tag == "$npscalar" and isinstance(payload, dict):
            return f"a numpy {payload.get('dtype')}"
        if tag == "$opaque" and isinstance(payload, dict):
            return f"a {payload.get('type')} not recorded as data"
        if tag == "$float":
            return "a float"
        if isinstance(tag, str) and tag.startswith("$"):
            return f"a {tag[1:]}"
    name = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(type(doc), "value")
    return f"{'an' if name == 'int' else 'a'} {name}"


_PAPER_KEYS = ("label", "algorithm", "step", "equation", "description")
_DEFINITION_TYPES: dict[str, type | tuple[type, ...]] = {
    "kind": str, "ref": str, "file": str, "line": int, "source": str, "source_sha256": str, "name": str,
    "paper": dict, "globals": dict}


def paper_of(definition: Any) -> dict[str, Any]:
    """A definition's paper reference, its values text or numbers (or None) whatever the document holds."""
    paper = definition.get("paper") if isinstance(definition, dict) else None
    if not isinstance(paper, dict):
        return {}
    return {k: v if v is None or isinstance(v, (str, int, float)) and not isinstance(v, bool) else str(v)
            for k, v in paper.items() if k in _PAPER_KEYS}  # ("Algorithm 1", step 5)


def paper_reference(paper: dict[str, Any]) -> str:
    """A step's paper reference, as every listing and message writes it: "Algorithm 1, step 5
    (Eq. 7)"; "" for a step without one. The algorithm is named where the label does not name it,
    the step number where the label does not say it, the equation where it is not the label."""
    label = str(paper.get("label") or "")
    algorithm, step, equation = algorithm_of(paper), paper.get("step"), paper.get("equation")
    ref = label
    if algorithm and not mentions(label, algorithm):
        ref = f"{algorithm}, {label}" if label else algorithm
    if step is not None and not mentions(ref, f"step {step}"):
        ref += f", step {step}" if ref else f"step {step}"
    if equation and str(equation) != label and not mentions(ref, equation):
        equation = str(equation)
        ref += f" {equation}" if equation.startswith("(") else f" ({equation})"
    return ref


def algorithm_of(paper: dict[str, Any]) -> str | None:
    """The algorithm a paper reference names, as text ("Algorithm 1" for ``algorithm=1``), or None."""
    algorithm = paper.get("algorithm")
    if algorithm is None or algorithm == "":
        return None
    return f"Algorithm {algorithm}" if isinstance(algorithm, int) else str(algorithm)


def mentions(text: str, part: Any) -> bool:
    """Whether ``text`` says ``part`` as a whole (case aside): "Algorithm 1" says 1 and "step 5" says
    step 5; "Eq. 11" says neither 1 nor "Eq. 1", "step 50" not "step 5"."""
    part = str(part)
    return bool(part) and re.search(rf"(?<![\w.]){re.escape(part)}(?![\w])", text, re.IGNORECASE) is not None


def _texts(values: np.ndarray) -> np.ndarray:
    """A decoded name or path column as text (a damaged document may hold a list)."""
    if all(isinstance(v, str) for v in values):
        return values
    return np.array([v if isinstance(v, str) else "" if v is None else str(v) for v in values], dtype=object)


class StepTable:
    """A selection of steps, in execution order. ``len``, indexing (an int gives a Step, a slice
    or boolean mask a StepTable), ``filter``, ``select`` and numpy ``column``s."""

    COLUMNS = ("index", *_INT_COLUMNS, "t_start", "t_end", "name", "module_path", "label")

    def __init__(self, rec: Recording, rows: np.ndarray) -> None:
        self.rec, self.rows = rec, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Step]:
        return (Step(self.rec, int(i)) for i in self.rows)

    def __getitem__(self, key: int | slice | np.ndarray) -> Any:
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not -len(self) <= key < len(self):
                raise StepPositionError(f"position {key} is out of range: the table has {len(self)} step"
                                        f"{'s' if len(self) != 1 else ''}; a step by its index: rec.step({key})")
            return Step(self.rec, int(self.rows[key]))
        if not isinstance(key, (slice, np.ndarray, list)):
            raise RecordingError(f"a step table is indexed by position (an int), a slice or an array, not "
                                 f"{type(key).__name__} {key!r:.40}; steps by name: .select(SELECTOR), .filter(...)")
        return StepTable(self.rec, self.rows[key])

    def __repr__(self) -> str:
        return f"<StepTable: {len(self)} step{'s' if len(self) != 1 else ''}>"

    def _repr_html_(self) -> str:
        from . import notebook

        return notebook.step_table(self)

    def column(self, name: str) -> np.ndarray:
        """One column for these steps: index, phase (0/1), iteration, call, parent, forward, status
        (index into STATUSES), t_start, t_end, tensor_start, tensor_count, name, module_path, label."""
        if name == "index":
            return self.rows.copy()
        if name in ("name", "module_path", "label"):
            source = {"name": self.rec._names, "module_path": self.rec._paths, "label": self.rec._labels}[name]
            return source[self.rows]
        if name in (*_INT_COLUMNS, "t_start", "t_end"):
            return np.asarray(self.rec.rank.column(f"steps/{name}"))[self.rows]
        raise RecordingError(f"unknown step column {name!r}: use one of {', '.join(self.COLUMNS)}")

    @property
    def names(self) -> np.ndarray:
        return self.column("name")

    def filter(self, *, name: str | None = None, label: str | None = None, phase: str | None = None,
               iteration: int | None = None, call: int | None = None, status: str | None = None,
               module_path: str | None = None, object: int | None = None) -> StepTable:
        """The steps matching every given field (``phase`` "forward"/"backward", ``status`` as in
        docs/FORMAT.md: ok, alert, nonfinite, exception; ``object`` k: the calls of the k-th module
        object of the steps several module objects ran as, ``Step.module_object``)."""
        for field, number in (("iteration", iteration), ("call", call), ("object", object)):
            if number is not None and (isinstance(number, bool) or not isinstance(number, (int, np.integer))):
                raise RecordingError(f"filter {field}={number!r:.40}: give an integer (a {type(number).__name__} "
                                     "matches no step)")
        mask = np.ones(len(self.rows), dtype=bool)
        for col, value in (("name", name), ("label", label), ("module_path", module_path)):
            if value is not None:
                mask &= self._named(col, value)
        if phase is not None:
            mask &= self.column("phase") == _index_of(layout.PHASES, phase, "phase")
        if status is not None:
            mask &= self.column("status") == _index_of(layout.STATUSES, status, "status")
        for col, value in (("iteration", iteration), ("call", call)):
            if value is not None:
                mask &= self.column(col) == value
        if object is not None:
            self.rec.objects_numbered()
            mask &= self.rec._object_numbers[self.rows] == object
        return StepTable(self.rec, self.rows[mask])

    def _named(self, column: str, value: str) -> np.ndarray:
        """Per step, whether its name, paper label or module path (``column``) is ``value``, under Unicode
        normalisation (``names.same``): asked once per distinct document."""
        ids = np.asarray(self.rec.rank.column(f"steps/{'definition' if column == 'label' else column}"))[self.rows]
        if not len(ids):
            return np.zeros(0, dtype=bool)
        _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        texts = self.column(column)[first]
        hits = np.array([names.same(value, None if t is None else str(t)) for t in texts], dtype=bool)
        return hits[inverse.reshape(-1)]

    def select(self, selector: str) -> StepTable:
        """The steps a selector ``NAME[@iter=K][#CALL][:backward]`` names (NAME: step name, paper
        label or module-path glob; ``.`` the root module). A selector that is, whole, a step's name,
        paper label or module path names those steps, though it holds ``@``, ``#``, ``:`` or glob
        characters (a step named "block#1", a module path "blocks.x[0]")."""
        if any(c in selector for c in "@#:[]*?"):
            for name, iteration, call, phase in _readings(selector):  # the longest NAME first
                exact = self._exactly(name)
                if len(exact):
                    return exact._picked(phase or "forward", iteration, call)
        sel = parse_selector(selector)
        table = self._picked(sel.phase, sel.iteration, sel.call)
        if sel.name == ".":  # the root module: not a function step called outside every module (its path is "" too)
            table = StepTable(self.rec, table.rows[self.rec._modules[table.rows]])
        found = table._where_named(sel.matches_name)
        return found if len(found) else table._where_named(sel.matches_name, references=True)

    def _picked(self, phase: str | None, iteration: int | None, call: int | None) -> StepTable:
        """The steps of a selector's phase, iteration and call. A backward step is picked by its forward
        call's (``Block@iter=0#2:backward``: the backward of ``Block@iter=0#2``), whichever iteration
        its pass ran in: a graph kept across optimizer steps (a replay buffer's tensors) is
        backpropagated in a later one, where another backward of the same call number may run too."""
        if phase != "backward" or iteration is None:
            return self.filter(phase=phase, iteration=iteration, call=call)
        back = self.filter(phase="backward", call=call)
        forward = np.asarray(self.rec.rank.column("steps/forward"))[back.rows].astype(np.int64)
        iterations = np.asarray(self.rec.rank.column("steps/iteration"))
        known = forward >= 0
        of_call = np.where(known, iterations[np.where(known, forward, 0)], back.column("iteration"))
        return StepTable(self.rec, back.rows[of_call == iteration])

    def _exactly(self, text: str) -> StepTable:
        """The steps whose name, paper label or module path is ``text`` (else: another of its paper
        references, ``_references``), under Unicode normalisation (``names.same``)."""
        found = self._where_named(lambda name, label, path: any(names.same(text, x) for x in (name, label, path)))
        return found if len(found) else self._where_named(lambda name, label, path: names.same(text, label),
                                                          references=True)

    def _where_named(self, test: Callable[[str, str | None, str], bool], references: bool = False) -> StepTable:
        """The steps for which ``test(name, paper label, module path)`` holds, asked once per distinct
        (name, definition, module path), not once per step. ``references``: asked with each of the
        step's other paper references (its algorithm, equation, whole reference) as the label, where
        no step's own name, label or path matched (so that a selector never changes what it names)."""
        if not len(self):
            return self
        rank = self.rec.rank
        keys = np.stack([np.asarray(rank.column(f"steps/{c}"))[self.rows]
                         for c in ("name", "definition", "module_path")], axis=1)
        _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
        names, labels, paths = (self.column(c)[first] for c in ("name", "label", "module_path"))
        papers = self.rec._papers[self.rows[first]]
        hits = np.array([any(test(str(n), ref, str(p)) for ref in (_references(lb, paper)[1:] if references else [lb]))
                         for n, lb, p, paper in zip(names, labels, paths, papers)], dtype=bool)
        return StepTable(self.rec, self.rows[hits[inverse.reshape(-1)]])


def alert_text(alert: Any, step: Step | None = None) -> str:
    """One line for an alert a step holds: a broken ``watch()`` expectation ("watch h: range expected
    [0, 1], got [-0.2, 3.1] (Eq. 4)"), or what a ``register_check`` or ``breakpoint`` said ("check
    'output small': output absmax 0.892 > 0.1"). With the ``step`` that holds it: a watch of a complex
    tensor checked its range and mean on magnitudes, as its statistics are, and says so ("range of |z|")."""
    if not isinstance(alert, dict):
        return str(alert)
    if "watch" in alert:
        ref = f" ({alert['reference']})" if alert.get("reference") else ""
        bad = f" and {alert['nonfinite']} NaN/Inf" if alert.get("nonfinite") else ""
        check = alert.get("check")
        if check in ("range", "mean") and step is not None and any(
                r.role == "watch" and r.name == alert.get("watch") and r.dtype.startswith("complex")
                for r in step.records):
            check = f"{check} of |z|"
        return (f"watch {alert.get('watch')}: {check} expected {alert.get('expected')}, "
                f"got {alert.get('actual')}{bad}{ref}")
    message = str(alert.get("message") or "")
    kind, name = alert.get("kind"), alert.get("check")
    if kind in ("check", "breakpoint") and name is not None:
        said = f"{kind} {name!r}"
        return message if message.startswith(said) else f"{said}: {message}" if message else said
    return message or str(alert)


def magnitudes_note(names: list[str]) -> str | None:
    """What the statistics shown of complex tensors (``names``) are: of their magnitudes |z|, as the
    recorder computes them (docs/FORMAT.md); None without any."""
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return f"the statistics of complex {shown} are of magnitudes |z|"


def compiled_unrecorded_note(final: dict[str, Any]) -> str | None:
    """What ran inside code compiled with ``fullgraph=True`` and so was not recorded (a rank's final
    ``compiled_unrecorded``, docs/FORMAT.md), as one sentence; None where nothing was, or the
    recording predates the key."""
    doc = final.get("compiled_unrecorded")
    if not isinstance(doc, dict) or not doc.get("count"):
        return None
    what = [str(w) for w in doc.get("what") or []]
    named = ", ".join(what[:4]) + (f" and {len(what) - 4} more" if len(what) > 4 else "")
    return (f"not recorded: {named or 'calls'} inside code torch.compile traced with fullgraph=True (or "
            "error_on_graph_break), which cannot leave the graph to be recorded; compile without fullgraph=True "
            "to record them")


def _references(label: str | None, paper: dict[str, Any]) -> list[str | None]:
    """What a step's paper reference may be selected by: its label, its algorithm, its equation, and
    the whole reference as listings write it ("Algorithm 1, step 5 (Eq. 7)", and without the equation)."""
    refs = [label]
    whole = paper_reference(paper)
    shorter = whole.rsplit(" (", 1)[0] if whole.endswith(")") else None  # without the equation
    for ref in (algorithm_of(paper), paper.get("equation"), whole, shorter):
        if isinstance(ref, str) and ref and ref not in refs:
            refs.append(ref)
    return refs


def _readings(selector: str) -> list[tuple[str, int | None, int | None, str | None]]:
    """(NAME, iteration, call, phase) for the selector taken whole as NAME, then with each suffix
    ``:forward``/``:backward``, ``#CALL``, ``@iter=K`` taken off its end in turn: a NAME may hold
    those characters itself (``block#1@iter=2:backward``, as ``Step.selector`` writes it)."""
    out = [(selector, None, None, None)]
    rest, iteration, call, phase = selector, None, None, None
    for pattern in (r":(forward|backward)$", r"#(\d+)$", r"@iter=(\d+)$"):
        m = re.search(pattern, rest)
        if m is None:
            continue
        rest = rest[:m.start()]
        if pattern.startswith(":"):
            phase = m[1]
        elif pattern.startswith("#"):
            call = int(m[1])
        else:
            iteration = int(m[1])
        if rest:
            out.append((rest, iteration, call, phase))
    return out


def _index_of(values: tuple[str, ...], value: str, what: str) -> int:
    if value not in values:
        raise RecordingError(f"unknown {what} {value!r}: use one of {', '.join(values)}")
    return values.index(value)


@dataclass(frozen=True)
class Step:
    """One recorded step: where it is, what it saw, and how to get its tensors back."""

    rec: Recording
    index: int

    def _col(self, name: str) -> Any:
        return self.rec.rank.rows(f"steps/{name}", self.index, self.index + 1)[0]

    def _decoded(self, table: str, column: str) -> Any:
        """This step's value of a document column: from the table's decoded column when that was
        read already, else its own document (one step out of millions needs no whole column)."""
        cached = self.rec.__dict__.get(table)
        return cached[self.index] if cached is not None else self._doc(column)

    @property
    def name(self) -> str:
        return str(self._decoded("_names", "name"))

    @property
    def paper(self) -> dict[str, Any]:
        cached = self.rec.__dict__.get("_papers")
        paper = dict(cached[self.index]) if cached is not None else paper_of(self._doc("definition"))
        return {k: paper.get(k) for k in _PAPER_KEYS}

    @property
    def phase(self) -> str:
        return layout.PHASES[int(self._col("phase"))]

    @property
    def phase_text(self) -> str:
        """The phase as a listing says it: "forward (no grad)" for a call with autograd off (an evaluation)."""
        return f"{self.phase} (no grad)" if self.phase == "forward" and not self.grad_enabled else self.phase

    @property
    def iteration(self) -> int:
        return int(self._col("iteration"))

    @property
    def call(self) -> int:
        return int(self._col("call"))

    @property
    def module_path(self) -> str:
        return str(self._decoded("_paths", "module_path"))

    @property
    def module_object(self) -> tuple[int, int] | None:
        """Where several module objects ran as this step (a student and its EMA teacher: one class, one
        step name and module path), which of them ran this call and how many there were: ``(k, n)``,
        k from 1 in the order they were first called (0: one past the first 256, not numbered); None
        where one object ran as this step, for a function step, and in recordings older than 1.16."""
        places = self.rec._object_places
        if not places:
            return None
        found = places.get((self.name, self.module_path))
        module = self._doc("module") if found else None
        if found is None or not isinstance(module, dict):
            return None
        instances, count = found
        instance = module.get("instance")
        return (instances.index(instance) + 1 if instance in instances else 0), count

    @property
    def object_text(self) -> str:
        """ "object 2 of 2" where several module objects ran as this step (``module_object``), else ""."""
        found = self.module_object
        return "" if not found else f"object {found[0]} of {found[1]}" if found[0] else f"one of {found[1]} objects"

    @property
    def where(self) -> str:
        """Where the step ran, as a listing appends it to its name: " at h.1", " at h.1 (object 2 of 2)",
        " (object 2 of 2)" or ""."""
        obj = self.object_text
        return (f" at {names.shown(self.module_path)}" if self.module_path else "") + (f" ({obj})" if obj else "")

    @property
    def status(self) -> str:
        return layout.STATUSES[int(self._col("status"))]

    @property
    def parent(self) -> int | None:
        parent = int(self._col("parent"))
        return None if parent == layout.NO_REF else parent

    @property
    def forward(self) -> int | None:
        """For a backward step, the index of its forward call."""
        fwd = int(self._col("forward"))
        return None if fwd == layout.NO_REF else fwd

    @property
    def duration(self) -> float:
        return float(self._col("t_end")) - float(self._col("t_start"))

    @property
    def started_unix(self) -> float:
        """When the step began, in seconds since the epoch (comparable across the ranks of a run)."""
        return float(self.rec.run_info.get("started_unix") or 0.0) + float(self._col("t_start"))

    @cached_property
    def records(self) -> list[TensorRecord]:
        """Every tensor record: role, name, shape, dtype, device, statistics, payload reference."""
        return self.rec.rank.tensor_records(self.index)

    @cached_property
    def frozen(self) -> list[str]:
        """The names of the module's parameters that were frozen at this call (``requires_grad=False``:
        a frozen backbone, an embedding, what LoRA adapters leave alone), which get no gradient: no
        ``param_grad`` record. A backward step's are those of its forward call. Empty for recordings
        before schema 1.2, which did not keep the flag."""
        if layout.parse_version(self.rec.rank.run.schema_version) < layout.REQUIRES_GRAD_SINCE:
            return []
        call = self if self.phase != "backward" else self.rec.step(self.forward) if self.forward is not None else None
        return [] if call is None else [r.name for r in call.records if r.role == "param" and not r.requires_grad]

    def tensors(self, role: str | None = None) -> list[TensorRecord]:
        """The records with one role (input, output, param, buffer, grad_output, grad_input,
        param_grad, watch, collective, component, network_grad: ``layout.ROLES``), or all."""
        if role is not None and role not in layout.ROLES:
            raise RecordingError(f"unknown role {role!r}: use one of {', '.join(layout.ROLES)}")
        return [r for r in self.records if role is None or r.role == role]

    def tensor(self, name: str, role: str | None = None) -> torch.Tensor:
        """A recorded tensor's exact value by record name (``args.0``, ``output``, ``fc.weight``), or by
        ``ROLE:NAME`` (``param_grad:fc.weight``), as the refusal below lists them and a replay's ``values``
        key a backward step's parameter grads; a sparse one's made again from its parts, where they were
        kept (1.19)."""
        return self.rec.rank.tensor(self.record(name, role))

    def record(self, name: str, role: str | None = None) -> TensorRecord:
        """The tensor record ``tensor`` reads, by the same name: its shape, dtype and statistics."""
        def names() -> str:
            return ", ".join(f"{r.role}:{r.name}" for r in self.records) or "no tensors"

        if not isinstance(name, str) or not isinstance(role, (str, type(None))):
            raise StepNotFoundError(f"a tensor of step {self.index} is named by its record name, a str (it has "
                                    f"{names()}), not {type(name if not isinstance(name, str) else role).__name__}")
        found = [r for r in self.records if r.name == name and (role is None or r.role == role)]
        head, _, rest = name.partition(":")
        if not found and role is None and head in layout.ROLES:  # (a record name may hold ':', "after:bn.x")
            found = [r for r in self.records if r.name == rest and r.role == head]
        if not found:
            raise StepNotFoundError(f"step {self.index} has no tensor {name!r}; it has {names()}{self.others_text()}")
        return found[0]

    def non_tensors(self) -> dict[str, str]:
        """The call's arguments and output that are not tensors, by name (``args.0``, ``kwargs.w``,
        ``output``; a container's are not looked into), each as what it is ("a numpy float64 array of
        shape [4]", "an int", "a numpy:ndarray not recorded as data"): what a message naming a step's
        tensors says it has besides. A backward step's: its forward's."""
        call = self if self.phase != "backward" else self.rec.step(self.forward) if self.forward is not None else None
        if call is None:
            return {}
        doc = call.arguments if isinstance(call.arguments, dict) else {}
        args = doc.get("args") if isinstance(doc.get("args"), list) else []
        kwargs = doc.get("kwargs") if isinstance(doc.get("kwargs"), dict) else {}
        out = {f"args.{i}": value_kind(v) for i, v in enumerate(args)}
        out.update({f"kwargs.{k}": value_kind(v) for k, v in kwargs.items()})
        out["output"] = value_kind(call.output_structure)
        return {k: v for k, v in out.items() if v is not None and v not in _CONTAINER_KINDS}

    def others_text(self) -> str:
        """`` (and args.0, a numpy float64 array of shape [4], which is not a tensor)``, or ""."""
        others = self.non_tensors()
        if not others:
            return ""
        shown = "; ".join(f"{k}, {v}" for k, v in list(others.items())[:8]) + ("; ..." if len(others) > 8 else "")
        return f" (and {shown}, which {'is not a tensor' if len(others) == 1 else 'are not tensors'})"

    def _doc(self, column: str) -> Any:
        return self.rec.rank.doc(int(self._col(column)))

    @property
    def arguments(self) -> Any:
        """The call's arguments as tagged JSON (``{"args": [...], "kwargs": {...}}``; tensors by record name)."""
        return self._doc("args")

    @property
    def output_structure(self) -> Any:
        return self._doc("output")

    @property
    def settings(self) -> dict[str, Any]:
        """Numerics settings at step entry (determinism flags, TF32, threads, CPU capability, ...)."""
        doc = self._doc("settings")
        return doc if isinstance(doc, dict) else {}

    @property
    def grad_enabled(self) -> bool:
        """Whether autograd was on when the step was entered (off: torch.no_grad, inference_mode, an
        evaluation); always for a backward step (its forward ran with it on; the pass itself runs
        with it off)."""
        settings = self.settings  # (inference mode makes no graph, with grad mode on too)
        return self.phase == "backward" or (settings.get("grad_enabled") is not False
                                            and not settings.get("inference_mode"))

    @property
    def rng(self) -> dict[str, Any]:
        """Generator states at step entry, decoded: {"torch": uint8 tensor, "numpy": state tuple, ...}."""
        ids = self._doc("rng") or {}
        if not isinstance(ids, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids.values()):
            raise FormatError(f"{self.rec.path}: the RNG states of step {self.index} are not a map of generators to "
                              "documents; the recording is damaged")
        out = {}
        for part, doc_id in ids.items():
            doc = self.rec.rank.doc(int(doc_id))
            try:
                out[part] = snapshot.decode_rng_part(part, doc)
            except (KeyError, TypeError, ValueError) as exc:  # binascii.Error is a ValueError
                raise FormatError(f"{self.rec.path}: the {part} RNG state of step {self.index} (document "
                                  f"{doc_id}) cannot be decoded ({type(exc).__name__}: {exc}); the recording is "
                                  "damaged") from None
        return out

    @property
    def definition(self) -> dict[str, Any]:
        """The step's code: kind, import reference, file, line, source and its SHA-256 (fields of
        another type than these are left out: a recording from someone else may hold anything)."""
        doc = self._doc("definition")
        if not isinstance(doc, dict):
            return {}
        return {k: v for k, v in doc.items() if k not in _DEFINITION_TYPES or isinstance(v, _DEFINITION_TYPES[k])
                and not isinstance(v, bool)}

    @property
    def source(self) -> str | None:
        return self.definition.get("source")

    @property
    def extra(self) -> dict[str, Any]:
        """Exception, alerts, watch expectations and notes, where there were any."""
        doc = self._doc("extra")
        return doc if isinstance(doc, dict) else {}

    def noted(self, note: str) -> frozenset[str]:
        """The record names the step's notes ``"<name>[, <name>...]: " + note`` list (as the recorder
        wrote them: control characters escaped)."""
        suffix = f": {note}"
        return frozenset(name for n in self.extra.get("notes", ()) if isinstance(n, str) and n.endswith(suffix)
                         for name in n.removesuffix(suffix).split(", "))

    @property
    def uninitialized(self) -> frozenset[str]:
        """Names of the records of a lazy module's parameters and buffers that were uninitialized
        when the call began (``nn.LazyLinear`` before the call that gave them their shapes): shape ()
        and no payload, and a replay leaves them uninitialized for the call to initialize."""
        return self.noted(layout.UNINITIALIZED_NOTE)

    def why_statistics_only(self, record: TensorRecord | str) -> str:
        """Why one of this step's tensor records (or the one a name gives, as ``tensor`` takes it) has
        statistics and no payload (RankReader's answer; of a bundle's step other than its main step and that
        step's forward call, that a bundle keeps those as statistics, not the recording's reason)."""
        record = record if isinstance(record, TensorRecord) else self.record(record)
        info = self.rec.bundle_info
        if info is not None and not info.get("iteration"):
            main = self.rec.step(info["main_step"])
            if self.index not in (main.index, main.forward):
                return (f"a bundle keeps the tensors of its steps other than its main step {main.index} ({main.name}) "
                        "as statistics only, where that step does not share them: bundle this step itself from "
                        "the recording to replay it")
        return self.rec.rank.why_statistics_only(record)

    def kept_only(self, record: TensorRecord) -> str:
        """What the recording kept of a record without payload, and why, for a refusal to replay:
        ``statistics only for input args.0 (...)``, or, where not even those were kept (a tensor the
        recorder could not read, a meta tensor), ``only the shape and dtype of input args.0 (...)``."""
        why = self.why_statistics_only(record)
        what = f"{record.role} {record.name}"
        if "without statistics" in why or why.endswith(layout.METADATA_NOTE):
            return f"only the shape and dtype of {what}, no values or statistics ({why})"
        return f"statistics only for {what} ({why})"

    def sparse(self, record: TensorRecord) -> tuple[str, int | None] | None:
        """A record that was a sparse tensor: its layout (``"sparse_coo"``) and how many values it stored
        (None where the recording does not say); None for any other."""
        return self.rec.rank.sparse_of(record)

    def sparse_parts(self, record: TensorRecord) -> SparseParts | None:
        """The records a sparse record's tensor is made of (1.19: ``<record>:indices``, ``<record>:values``
        ...), where the recording kept every one's bytes; None for any other record, or where they were
        not kept (stats mode, flight mode outside its ring, a recording before 1.19)."""
        return self.rec.rank.sparse_parts(record)

    def holds_values(self, record: TensorRecord) -> bool:
        """Whether the recording holds a record's values, not only its statistics: its payload, or (1.19)
        the parts a sparse tensor is made of, from which ``tensor`` makes it again."""
        return record.has_payload or self.sparse_parts(record) is not None

    def sparse_text(self, record: TensorRecord) -> str | None:
        """A sparse record in words, "a sparse_csr tensor of 31 stored values"; None for any other."""
        found = self.sparse(record)
        if found is None:
            return None
        kind, count = found
        return f"a {kind} tensor" + (f" of {count} stored value{'s' if count != 1 else ''}" if count is not None
                                     else "")

    def dtensor_text(self, record: TensorRecord) -> str | None:
        """A record whose tensor was a DTensor (the step's extra ``dtensors``, 1.31), whose shape and
        statistics are this rank's local shard's, in words: "local shard of 12×8 (Shard(dim=0))", the whole
        tensor's shape and its placements; None for any other record."""
        dtensors = self.extra.get("dtensors")
        doc = dtensors.get(record.name) if isinstance(dtensors, dict) else None
        if not isinstance(doc, dict):
            return None
        shape = doc.get("shape")
        whole = ("×".join(map(str, shape)) or "scalar") if isinstance(shape, list) else "a DTensor"
        placements = ", ".join(map(str, doc.get("placements") or ()))
        return f"local shard of {whole}" + (f" ({placements})" if placements else "")

    def dtensor_refusal(self) -> str | None:
        """Why a step whose tensors were DTensors (a tensor-parallel layer's sharded weights, a DTensor
        argument: the step's extra ``dtensors``, 1.31) cannot be replayed, and what to do, for a message;
        None for any other step. Its records hold this rank's local shards; the DTensor operations of the
        call computed with the other ranks' through collectives the recording does not hold (a row-wise
        layer's all-reduce of its partial sums), so a replay in one process cannot compute them again."""
        dtensors = self.extra.get("dtensors")
        if not isinstance(dtensors, dict) or not dtensors:
            return None
        order = {"input": 0, "param": 1, "buffer": 2}
        records = sorted((r for r in self.records if r.name in dtensors), key=lambda r: order.get(r.role, 3))
        if not records:
            return None
        r = records[0]
        doc = dtensors[r.name] if isinstance(dtensors[r.name], dict) else {}
        placements = ", ".join(map(str, doc.get("placements") or ())) or "unknown placements"
        mesh = "x".join(map(str, doc.get("mesh") or ())) or "?"
        shape = tuple(doc.get("shape") or ())
        role = {"param": "parameter", "param_grad": "parameter gradient"}.get(r.role, r.role)
        more = len(records) - 1
        others = f" (and {more} other DTensor record{'s' if more != 1 else ''})" if more else ""
        return (f"its {role} {r.name} was a DTensor{others}, {placements} over a device mesh of {mesh} ranks, of "
                f"which the recording holds this rank's shard {tuple(r.shape)} of {shape}; a DTensor's operations "
                "compute with the other ranks' shards through collectives the recording does not hold, so one "
                "process cannot compute the call again; replay the steps inside it that are given plain tensors, "
                "or make the paper step a function of local tensors (DTensor.to_local()) and record again")

    def sparse_refusal(self, record: TensorRecord, to: str = "replay it") -> str:
        """Why a step given a sparse tensor whose parts the recording did not keep cannot be replayed or
        bundled, and what to do (``to``: the end of it, "replay it"), for a message; the same for each step
        given such a tensor there."""
        kind = (self.sparse(record) or ("sparse",))[0]
        what = f"its {record.role} {record.name} is a {kind} tensor"
        if layout.parse_version(self.rec.rank.run.schema_version) < layout.SPARSE_PARTS_SINCE:
            how = ("keep its indices and values as dense buffers and build it in forward" if record.role in (
                "param", "buffer") else "build the sparse tensor inside the step from dense indices and values (an "
                "edge_index)")
            return (f"{what}, which recordings before schema {'.'.join(map(str, layout.SPARSE_PARTS_SINCE))} keep as "
                    "statistics of its stored values only (no payload; its indices are not recorded); record again "
                    f"with this version (mode full, or flight), or {how}, to {to}")
        return (f"{what}, of which the recording kept statistics of its stored values only, not its indices and "
                f"values ({self.rec.rank.why_no_parts(record)}); record the step with payloads (mode full, or a "
                f"flight dump) to {to}")

    @property
    def environment(self) -> dict[str, Any]:
        return self.rec.run_info

    @property
    def selector(self) -> str:
        """A selector naming this step (``smooth_relu@iter=17#3``, ``...:backward``), as ``rec.step``
        and ``pdbg replay`` take it; the index where the name cannot be one."""
        name = self.name
        if name[:1] in ("", "@", "#", ":") or name != name.strip():
            return str(self.index)
        if self.phase != "backward":
            return f"{name}@iter={self.iteration}#{self.call}"
        forward = self.forward  # (a backward is named by its forward call: see StepTable._picked)
        iteration = self.iteration if forward is None else self.rec.step(forward).iteration
        return f"{name}@iter={iteration}#{self.call}:backward"

    def to_json(self) -> dict[str, Any]:
        """The step object of the JSON output (README, "Command line")."""
        found = self.module_object
        return {"index": self.index, "rank": self.rec.rank.rank, "name": self.name, "phase": self.phase,
                "iteration": self.iteration, "call": self.call, "module_path": self.module_path,
                "paper": self.paper, "status": self.status, "grad_enabled": self.grad_enabled,
                "object": None if found is None else found[0], "objects": None if found is None else found[1]}

    def __repr__(self) -> str:
        ref, name = names.shown(paper_reference(self.paper)), names.shown(self.name)
        who = f"{ref} ({name})" if ref else name
        where = f" at {names.shown(self.module_path)}" if self.module_path else ""
        obj = f", {self.object_text}," if self.object_text else ""
        return printable(f"<Step {self.index}: {who}{where}{obj} {self.phase_text}, iteration {self.iteration}, call "
                         f"{self.call}, {self.status}>")

    def _repr_html_(self) -> str:
        from . import notebook

        return notebook.step(self)


def _first_line(message: str) -> str:
    """An exception's message in one line. One re-raised by torch from a DataLoader worker (or another of its
    ``ExceptionWrapper``'s processes and threads) says only where it was caught on its first line ("Caught
    RuntimeError in DataLoader worker process 1."): the worker's own error ends the traceback that follows."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    if len(lines) > 2 and lines[1].startswith("Original Traceback"):
        return f"{lines[0]} ({lines[-1]})"
    return lines[0]
