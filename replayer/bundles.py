"""Failure bundles: one small file that replays the failing step on another machine.

    info = replayer.bundle(rec, origin.step, "failure.pdbg", verify=True, repro=True)
    # elsewhere:  pdbg replay failure.pdbg   |   python repro.py

A bundle is a finished recording (the same format) holding only what replaying its main step needs:
that step (a backward step with its forward call), the steps inside it, their RNG states, settings,
module skeletons and arguments, the payloads the main step reads and writes (inner steps keep
statistics, and payloads they share with it), the run's environment, the source of the code
involved and the recording's recipes. It is packed into a zip with stored (not deflated) members:
the chunks are compressed already. ``bundle.json`` at its root says which step is the main one.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import sysconfig
import tempfile
import textwrap
import zipfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from recorder import jsonval
from recorder.annotate import source_lines
from recorder.errors import NotOnThisMachine, PdbgError, ReplayError
from recorder.items import OBJECTS_KEY
from recorder.store import backend, codecs, layout
from recorder.store.writer import StoreWriter

from . import recipes as recipes_mod
from . import state
from .bisect import step_flags, subtree
from .code import SESSION_SCRIPT, made_here, package_root, source_in, static_source, submodule_entries, submodule_label
from .compare import BY_STATISTICS
from .recording import BUNDLE_FORMAT, BUNDLE_KEY, Recording, Step, opened

FORMAT = BUNDLE_FORMAT
_DOC_COLUMNS = ("name", "definition", "module_path", "module", "settings", "args", "output", "extra")


class BundleError(PdbgError, ValueError):
    """A bundle that cannot be made as asked."""


@dataclass
class BundleInfo:
    """What ``bundle`` wrote."""

    path: Path
    bytes: int
    steps: int
    main_step: int  # the main step's index in the bundle (as ``replayer.open(bundle).main_step``)
    verified: bool | None
    script: Path | None = None
    sources: list[str] = field(default_factory=list)  # the source files it carries (bundle.json's "sources")
    not_verified: str | None = None  # verify asked, the step could not be replayed here: why (a GPU step, no GPU)
    unreplayable: str | None = None  # not verified, and its documents tell a replay is refused: why
    verified_with: dict[str, Any] | None = None  # what the verifying replay ran with (bundle.json's, FORMAT.md)
    # code not as recorded: what the verifying replay found changed, and carried copies of submodule classes that
    # changed since recording (a replay with the bundled source runs them)
    code_notes: list[str] = field(default_factory=list)
    # verified: the tensors that matched by statistics only, not bit for bit (a sparse result whose parts were not
    # kept: ReplayResult's)
    by_statistics: list[str] = field(default_factory=list)
    # the parts of the main step's output not recorded as data, which the verifying replay did not compare
    not_compared: list[str] = field(default_factory=list)
    # the inputs the verifying replay changed through .data where the recording could not see a change
    # (ReplayResult.unseen_writes): not compared as the call left them
    unseen_writes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """The verification in words: "bitwise match", "match by statistics only for output" (not bit for
        bit), "MISMATCH" or "not verified"."""
        if self.verified and self.by_statistics:
            return f"match by statistics only for {', '.join(self.by_statistics[:3])}, not bit for bit"
        return {True: "bitwise match", False: "MISMATCH", None: "not verified"}[self.verified]

    @property
    def main(self) -> int:
        """``main_step`` (its earlier name)."""
        return self.main_step

    def to_json(self) -> dict[str, Any]:
        """``pdbg bundle --json``: {"path", "bytes", "steps", "verified", "main_step", "script", "sources",
        "not_verified", "unreplayable", "verified_with", "code_notes", "by_statistics",
        "not_compared", "unseen_writes"}."""
        return {"path": str(self.path), "bytes": self.bytes, "steps": self.steps, "verified": self.verified,
                "main_step": self.main_step, "script": str(self.script) if self.script else None,
                "sources": self.sources, "not_verified": self.not_verified, "unreplayable": self.unreplayable,
                "verified_with": self.verified_with, "code_notes": self.code_notes,
                "by_statistics": self.by_statistics,
                "not_compared": self.not_compared, "unseen_writes": self.unseen_writes}

    def __repr__(self) -> str:
        verified = f"verified: {self.verdict}" if self.verified is not None else self.verdict
        return (f"<BundleInfo {self.path}: {self.steps} step{'s' if self.steps != 1 else ''}, main step "
                f"{self.main_step}, {self.bytes} bytes, {verified}>")

    def _repr_html_(self) -> str:
        from . import notebook

        return notebook.bundle_info(self)


def _selection(rec: Recording, step: Step, iteration: bool) -> tuple[list[int], set[int], set[int]]:
    """The steps to bundle (original indices, in order), those whose payloads all come along, and those
    whose buffers' payloads come along: the next call of a bundled forward call's module, which found in
    its buffers what that call left there (a BatchNorm's running statistics, compared by a replay)."""
    if iteration:
        rows = [int(i) for i in rec.steps.filter(iteration=step.iteration).rows]
        full = set(rows)
        chosen = set(rows)
    else:
        full = {step.index}
        if step.phase == "backward" and step.forward is not None:
            full.add(step.forward)
        chosen = set(full)
        for index in list(full):
            chosen.update(subtree(rec, index))
    following = _following(rec, full)
    return sorted(chosen | following), full, following - full


def _following(rec: Recording, full: set[int]) -> set[int]:
    """The next calls of the modules of the forward steps in ``full`` that hold buffers."""
    from .replay import next_call

    found = set()
    for index in sorted(full):
        step = rec.step(index)
        if step.phase == "forward" and any(r.role == "buffer" and r.has_payload for r in step.records):
            after = next_call(rec, step)
            if after is not None:
                found.add(after.index)
    return found


# What a bundle carries of the code, at most: bundle.json is metadata, which a reader takes up to
# zipcheck.MAX_METADATA_BYTES (1 MiB).
_SOURCE_FILES, _SOURCE_BYTES = 200, 768 << 10
_OWN_PACKAGES = frozenset(("recorder", "replayer", "tui"))  # PaperDebugger's: where a bundle replays, it is there


def _sources(rec: Recording, steps: list[Step], script: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """The text of every file the bundled steps' code came from, of the script that ran, and of the
    modules of the same project they import (``from mylib.util import raw`` beside the step's
    ``mylib/acts.py``: found by reading their imports, never by running them), and which module each
    such file is (``{"mylib.acts": file}``), so that a replay with the bundled source imports them
    from the bundle. A project's files are those beside the step's module (in its package, or its
    directory when it has none), not those of installed packages (torch's modules), within
    ``_SOURCE_BYTES``: the step's own files and the script first."""
    seeds = [(str(s.definition.get("ref", "")).partition(":")[0], s.definition.get("file"), s.definition.get("source"))
             for s in steps]
    for s in steps:  # the files of its submodules' classes (1.17) that hold the class as recorded (by its hash: a
        for ref, entry, _ in submodule_entries(s._doc("module")):  # recording from someone else may name any file)
            name, _, qualname = ref.partition(":")
            file = entry["file"]
            if name == "__main__" or not isinstance(file, str) or not file.endswith(".py") or installed(file) or \
                    any(seed[1] == file for seed in seeds):
                continue
            now = static_source(file, qualname)
            if now is not None and hashlib.sha256(now.encode()).hexdigest() == entry["source_sha256"]:
                seeds.append((name, file, None))
    if _needs_main(steps) or _patched(steps):  # the script only where the steps name code it defined (not a
        seeds.append(("__main__", script, None))  # launcher's settings), or where it may patch a step in
    cwd = rec.run_info.get("cwd")
    sources: dict[str, str] = {}
    modules: dict[str, str] = {}
    size = 0
    todo = [(name, file, code) for name, file, code in seeds if name and isinstance(file, str) and not installed(file)]
    while todo and len(sources) < _SOURCE_FILES:
        name, file, code = todo.pop(0)
        if file in sources or not file.endswith(".py"):  # Python files only: a recording names the files
            continue  # its code came from, and one from someone else may name any (~/.aws/credentials)
        try:
            if not os.path.isfile(file) or size + os.path.getsize(file) > _SOURCE_BYTES:
                continue
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if isinstance(code, str) and not _holds_definition(text, code):
            continue  # not the file the step's code came from (any more): its code is in the bundle anyway
        sources[file], size = text, size + len(text.encode("utf-8"))
        if name != "__main__":
            modules[name] = file
        todo += [(*found, None) for found in _project_imports(name, file, text, cwd if isinstance(cwd, str) else None)
                 if found[1] not in sources]
    return sources, modules


# Installed packages a bundle never carries: every machine that replays one has them (torch and numpy
# themselves, the frameworks whose callbacks record), and a bundled copy of one of their files would
# shadow the installed package while the bundled code loads. A project installed into site-packages
# (pip install .) is carried as any other.
_NEVER_CARRIED = frozenset({"torch", "torchvision", "torchaudio", "functorch", "numpy", "transformers", "lightning",
                            "pytorch_lightning", "lightning_fabric", "accelerate"})


def installed(file: str) -> bool:
    """Whether a file belongs to Python's standard library or to one of ``_NEVER_CARRIED`` (torch's
    ``nn/modules/linear.py``), on this machine or, by its path, on the one that recorded."""
    parts = Path(file).parts
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):
            return parts[i + 1].removesuffix(".py") in _NEVER_CARRIED
    stdlib = [Path(p) for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")} if p]
    return any(root in Path(file).parents for root in stdlib)


def _holds_definition(text: str, code: str) -> bool:
    """Whether a file's text holds a step's recorded source: a whole function or class definition
    (a recording from someone else could name a file of secrets with a line of it as "source")."""
    try:
        body = ast.parse(textwrap.dedent(code)).body
    except (SyntaxError, ValueError, RecursionError):
        return False
    whole = len(body) == 1 and isinstance(body[0], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    return whole and code.strip() in text


def _project_imports(name: str, file: str, text: str, cwd: str | None = None) -> list[tuple[str, str]]:
    """The modules of the same project that a module's source imports (with the packages on the way
    to them): (module name, file), where a file for the name lies beside it; for the script, also in
    the directories above it up to the one it ran in (``cwd``): a script in ``scripts/`` that puts
    its parent on ``sys.path`` to import ``common``."""
    path = Path(file)
    init = path.name == "__init__.py"
    root = path.parent if name == "__main__" else package_root(name, path)
    roots = [root]
    if name == "__main__" and cwd is not None and Path(cwd) in root.parents:
        roots += [p for p in root.parents if p == Path(cwd) or Path(cwd) in p.parents]
    package = name if init else name.rpartition(".")[0]
    if name == "__main__":
        package = ""
    if any(part in ("site-packages", "dist-packages") for part in root.parts) or name.partition(".")[0] in \
            _OWN_PACKAGES:
        return []  # an installed package's (torch's nn.Linear): where it replays, that package is installed
    try:
        tree = ast.parse(text, filename=file)
    except SyntaxError:
        return []
    wanted: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base:
                wanted += [base, *(f"{base}.{a.name}" for a in node.names if a.name != "*")]
    found: list[tuple[str, str]] = []
    for target in dict.fromkeys(wanted):
        parts = target.split(".")
        if parts[0] in _OWN_PACKAGES:
            continue
        for base in roots:  # the first directory that holds the import's top-level module, as sys.path would
            if not any(c.is_file() for c in (base / parts[0] / "__init__.py", base / f"{parts[0]}.py")):
                continue
            for k in range(1, len(parts) + 1):
                stem = base.joinpath(*parts[:k])
                for candidate in (stem / "__init__.py", stem.with_suffix(".py")):
                    if candidate.is_file():
                        found.append((".".join(parts[:k]), str(candidate)))
                        break
            break
    return found


def _needs_main(steps: list[Step]) -> bool:
    """Does any of these steps name code defined in ``__main__``: its own, a module class inside it,
    a type or function in its arguments, its modules' attributes or constructor arguments?"""
    return any(isinstance(v, str) and v.startswith("__main__:")
               for s in steps for name in _DOC_COLUMNS for v in jsonval.walk(s._doc(name)))


def _check_moved_script(steps: list[Step], script: str, text: str, recorded: Any) -> None:
    """Refuse a script given as the training script's path now (``--script``) that does not define a step's
    code the script defined when recorded: the bundle would carry it, and every replay of it be refused. Read,
    never run; a name the file does not hold anywhere, not just no def or class of it (one made under an ``if``
    at its top level still counts), so that no script a replay could use is refused."""
    for s in steps:
        module, _, qualname = str(s.definition.get("ref", "")).partition(":")
        if module != "__main__" or not qualname or source_in(text, qualname) is not None:
            continue
        if re.search(rf"(?<![\w.]){re.escape(qualname.split('.')[0])}\b", text):
            continue
        was = f" (recorded in {recorded})" if isinstance(recorded, str) and recorded != script else ""
        raise BundleError(f"step {s.index}'s code is {qualname}, defined in the training script{was}, but --script "
                          f"{script} does not define it: give the path of the script that does now (script= in "
                          "Python)")


def _patched(steps: list[Step]) -> bool:
    """Does any of these steps run a function of torch's (an installed package a bundle never carries, or the
    standard library) as a paper step: one made at run time by a patch (``adam._single_tensor_adam =
    paper_step(...)(...)``), which a replay finds where the training script's top level makes it again?"""
    return any(s.definition.get("kind") == "function" and isinstance(s.definition.get("file"), str) and
               installed(s.definition["file"]) for s in steps)


def _session_source(rec: Recording) -> str | None:
    """The cells of the IPython session (a notebook's kernel) that recorded ``rec``, when this is
    that session: the only place where code it defined in ``__main__`` lives. Cells that do not
    parse are left out; a replay loads only the definitions of the rest (code.script_module)."""
    if not made_here(rec.run_info):
        return None
    cells = getattr(sys.modules.get("__main__"), "In", None)  # IPython's input history
    if not isinstance(cells, list):
        return None
    kept = []
    for cell in cells:
        code = _cell_code(cell) if isinstance(cell, str) and cell.strip() else None
        if code is not None:
            kept.append(code.rstrip("\n") + "\n")
    return "\n".join(kept) or None


# Cell magics that run their cell as Python in the session's namespace: what it defines is defined there.
_PYTHON_CELL_MAGICS = frozenset({"time", "capture", "prun", "debug"})


def _cell_code(cell: str) -> str | None:
    """A cell's Python as a replay loads it: None where it does not parse; the body of a cell magic that runs
    it as Python (``%%time``: IPython keeps ``get_ipython().run_cell_magic('time', '', BODY)``, a statement the
    replay would leave out with the definitions in BODY)."""
    for _ in range(8):  # (%%capture over %%time ...)
        try:
            tree = ast.parse(cell)
        except SyntaxError:
            return None
        call = tree.body[0].value if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and
                call.func.attr == "run_cell_magic" and isinstance(call.func.value, ast.Call) and
                isinstance(call.func.value.func, ast.Name) and call.func.value.func.id == "get_ipython" and
                len(call.args) == 3 and all(isinstance(a, ast.Constant) and isinstance(a.value, str)
                                            for a in call.args) and call.args[0].value in _PYTHON_CELL_MAGICS):
            return cell
        cell = call.args[2].value
    return None


def _as_recorded(steps: list[Step]) -> str:
    """The recorded source of each step's code that a later cell of the session redefined (a fix
    being tried) or deleted, to follow the session's cells: a bundle replays the code the steps ran
    (the cells alone would give it the last definition)."""
    main = sys.modules.get("__main__")
    added: dict[str, str] = {}
    for step in steps:
        ref, source = step.definition.get("ref") or "", step.source
        module, _, name = ref.partition(":")
        if module != "__main__" or not name.isidentifier() or not source or name in added:
            continue
        try:
            now = "".join(source_lines(getattr(main, name))[0])
        except (AttributeError, OSError, TypeError):
            now = None
        if now != source:
            added[name] = source
    return "".join(f"\n# {name} as recorded (redefined or deleted after the recording)\n{text.rstrip()}\n"
                   for name, text in added.items())


def bundle(rec: Recording | str | os.PathLike[str], step: int | str | Step, path: str | os.PathLike[str], *,
           iteration: bool = False, verify: bool = False, script: bool | str | os.PathLike[str] = False,
           overwrite: bool = False, repro: bool = False) -> BundleInfo:
    """Write a failure bundle for one step (or, with ``iteration``, its whole iteration).

    Args:
        rec: the recording (a Recording, or its path).
        step: the main step: an index, a selector or a Step of ``rec``.
        path: the bundle file to write (``failure.pdbg``).
        iteration: bundle every step of the main step's iteration, with all payloads.
        verify: replay the main step from the bundle before sealing it, and record the outcome.
        script: where the training script is now, if it moved since recording (the steps' code it
            defined is carried from there); ``True``: ``repro`` (what it meant before).
        overwrite: replace an existing file at ``path`` (and ``repro.py`` with ``repro``).
        repro: also write ``repro.py`` next to the bundle: replays it with only paperdebugger installed.
    """
    repro_too = repro or script is True
    moved = os.fspath(script) if isinstance(script, (str, os.PathLike)) else None
    rec = opened(rec)
    main = rec.step(step)
    out = Path(path)
    if out.is_dir():  # (a recording is a directory too: never replaced by a bundle)
        raise BundleError(f"{out} is a directory; give the path of the bundle file to write, such as "
                          f"{out / 'failure.pdbg'}")
    if out.exists() and not overwrite:
        raise BundleError(f"{out} already exists; choose another path, or replace it with --force "
                          "(overwrite=True)")
    repro_file = out.with_name("repro.py")
    if repro_too and repro_file.exists() and not overwrite:  # before anything is written
        raise BundleError(f"{repro_file} already exists; write the bundle into another directory, or delete it "
                          "(or overwrite=True, --force)")
    if not out.parent.exists():
        raise BundleError(f"cannot write {out}: directory {out.parent} does not exist")
    rows, full, buffers_of = _selection(rec, main, iteration)
    steps = [rec.step(i) for i in rows]
    fwd = rec.step(main.forward) if main.forward is not None else main
    sharded = fwd.dtensor_refusal()
    if sharded is not None:  # (a bundle is for replaying it elsewhere: it could not be, there or here)
        raise BundleError(f"step {main.index} cannot be bundled: {sharded}")
    for r in [*(main.records if main.phase == "forward" else []),
              *(fwd.records if main.forward is not None else []),
              *(main.records if main.phase == "backward" else [])]:
        if r.role in ("input", "param", "buffer", "grad_output") and not main.holds_values(r) and \
                r.name not in fwd.uninitialized:
            owner = main if any(x is r for x in main.records) else fwd
            if owner.sparse(r) is not None:  # (its parts not kept: a bundle of this step could not keep them either)
                raise BundleError(f"step {main.index} cannot be bundled: "
                                  f"{owner.sparse_refusal(r, 'bundle and replay it')}")
            raise BundleError(f"step {main.index} kept {main.kept_only(r)}: there is nothing to replay; bundle a "
                              "step recorded with payloads (mode full, or a flight dump)")
    script_now = str(Path(moved).resolve()) if moved is not None else rec.run_info.get("script")
    sources, modules = _sources(rec, steps, script_now)
    if isinstance(script_now, str) and _needs_main(steps) and script_now not in sources:
        why = "is not there" if not os.path.isfile(script_now) else "could not be read or is too large"
        if moved is not None:  # (the path given is the one not there: say so, not to give one)
            raise BundleError(f"step {main.index}'s code was defined in the training script, which the bundle must "
                              f"carry, but {script_now}, given with --script (script= in Python), {why}: give the "
                              f"path the script recorded as {rec.run_info.get('script')} has now")
        raise BundleError(f"step {main.index}'s code was defined in the training script {script_now}, which the "
                          f"bundle must carry, but it {why}: give the script's path now with --script PATH "
                          "(script= in Python)")
    if moved is not None and isinstance(script_now, str) and script_now in sources:
        _check_moved_script(steps, script_now, sources[script_now], rec.run_info.get("script"))
    session = None
    if not rec.run_info.get("script") and _needs_main(steps):
        session = _session_source(rec)
        if session is None:
            raise BundleError(f"step {main.index}'s code was defined in an interactive session, whose code this "
                              "process cannot read: bundle it from the notebook (IPython) that recorded it, or "
                              "define the code in a module and record again")
        session += _as_recorded(steps)
        sources[SESSION_SCRIPT] = session
    try:
        work = Path(tempfile.mkdtemp(prefix="pdbg-bundle-", dir=out.parent))
    except OSError as exc:
        raise BundleError(f"cannot write {out}: {exc.strerror or exc} in {out.parent.resolve()}; give a path in a "
                          "writable directory (-o PATH)") from None
    try:
        store_dir = work / "store"
        new_main = _write_store(rec, store_dir, rows, full, main, SESSION_SCRIPT if session else
                                script_now if moved is not None else None, buffers_of)
        meta = {"format": FORMAT, "main_step": new_main, "created": datetime.now(UTC).isoformat(),
                "iteration": iteration, "origin": {"path": str(rec.path), "index": main.index, "step": main.to_json(),
                                                   "status": rec.status},
                "sources": sources, "modules": modules, "verified": None}
        carried = {}
        for name, recipe in recipes_mod.recipes(rec).items():  # those for bundled steps, renumbered
            index = (recipe.get("step") or {}).get("index")
            if index in rows:
                carried[name] = {**recipe, "step": {**recipe["step"], "index": rows.index(index)}}
        if carried:
            backend.put(backend.open_store(store_dir, mode="w"), recipes_mod.KEY,
                        json.dumps(carried, indent=1).encode())
        verified, not_verified, verified_with, by_statistics = None, None, None, []
        not_compared: list[str] = []
        unseen: list[str] = []
        notes = _steps_drift(steps, sources) + _carried_drift(steps, sources)
        if verify:
            backend.put(backend.open_store(store_dir, mode="w"), BUNDLE_KEY, json.dumps(meta).encode())
            from .replay import Replayer, about_code

            check = Recording(store_dir)
            # (a notebook's code is in the bundle only: verified as it replays elsewhere, from there)
            try:
                # (its inner steps compared too, as pdbg replay and repro.py compare them where it is sent)
                result = Replayer(check, use_bundled_source=session is not None).replay(check.step(new_main))
            except NotOnThisMachine as exc:  # a GPU step on a machine without one: written, unverified
                not_verified = _renumbered(str(exc), rows)
            except ReplayError as exc:  # named as the recording numbers its steps: the bundle is not written
                raise ReplayError(_renumbered(str(exc), rows)) from exc
            else:
                verified = bool(result.match) if result.compared else None  # nothing compared: nothing verified
                by_statistics = result.by_statistics if verified else []
                verified_with = _verifying_environment(check.step(new_main))
                meta["verified"] = {"match": verified, "at": datetime.now(UTC).isoformat(),
                                    "outputs": [d.summary() for d in result.outputs], "warnings": result.warnings,
                                    "environment": verified_with}
                not_compared, unseen = result.not_compared, result.unseen_writes
                if not_compared:  # (a match of what was compared: the rest is said, never a match)
                    meta["verified"]["not_compared"] = not_compared
                if by_statistics:  # (an inner step's too: the output summaries name the main step's only)
                    meta["verified"]["by_statistics"] = by_statistics
                notes = [w for w in result.warnings if about_code(w)] + notes
        backend.put(backend.open_store(store_dir, mode="w"), BUNDLE_KEY, json.dumps(meta, indent=1).encode())
        partial = work / "bundle.zip"
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED) as archive:
            for file in sorted(p for p in store_dir.rglob("*") if p.is_file()):
                archive.write(file, file.relative_to(store_dir).as_posix())
        os.replace(partial, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    repro = _write_script(out) if repro_too else None
    from .replay import known_refusal

    refusal = None if verify else known_refusal(main)
    return BundleInfo(out, out.stat().st_size, len(rows), new_main, verified, repro, sorted(sources), not_verified,
                      refusal, verified_with, notes, by_statistics, not_compared, unseen)


def _verifying_environment(step: Step) -> dict[str, Any]:
    """What a bundle's verifying replay of ``step`` ran with: this machine's software and CPU (the
    keys of a run's information, ``state.this_machine``), its host, the devices of the step's
    tensors and, where one is a GPU, the GPUs (as a run's ``cuda``)."""
    steps = [step, *([step.rec.step(step.forward)] if step.forward is not None else [])]
    devices = sorted({r.device for s in steps for r in s.records})
    return {**state.this_machine(), "hostname": socket.gethostname(), "devices": devices,
            "cuda": state.gpus() if any(d.startswith("cuda") for d in devices) else None}


_TEXT_KEYS = ("paperdebugger", "torch", "torch_cuda", "numpy", "python", "machine", "platform", "cpu_capability",
              "hostname")


def verified_environment(verified: Any) -> dict[str, Any] | None:
    """What verified a bundle (its ``verified["environment"]``), as far as it is text (a bundle comes
    from elsewhere); None where it was not verified, or was verified before bundles recorded with what."""
    env = verified.get("environment") if isinstance(verified, dict) else None
    if not isinstance(env, dict):
        return None
    out: dict[str, Any] = {k: env[k] for k in _TEXT_KEYS if isinstance(env.get(k), str)}
    devices = env.get("devices")
    out["devices"] = [d for d in devices if isinstance(d, str)] if isinstance(devices, list) else []
    cuda = env.get("cuda")
    out["cuda"] = [{"name": str(g.get("name")), "sm_count": g.get("sm_count")} for g in cuda if isinstance(g, dict)] \
        if isinstance(cuda, list) else None
    return out


def environment_text(env: dict[str, Any], run_info: dict[str, Any]) -> str:
    """What verified a bundle, on one line: its versions, machine and CPU capability, the devices
    its tensors were on, and its host, said to be the recording's or another (``run_info``: the
    recording's)."""
    parts = [f"{what.removesuffix(' version')} {value}" for what, value in state.machine_facts(env)
             if value is not None]
    gpus = env.get("cuda") or []
    on = []
    for device in env.get("devices") or []:
        kind, _, number = device.partition(":")
        index = int(number) if number.isdigit() else 0
        on.append(f"{device} ({gpus[index]['name']})" if kind == "cuda" and index < len(gpus) else device)
    if on:
        parts.append("tensors on " + ", ".join(on))
    host, recorded_on = env.get("hostname"), run_info.get("hostname")
    if host is not None:
        parts.append(f"host {host}" + (" (the machine that recorded it)" if host == recorded_on else
                                       f" (not the machine that recorded it, {recorded_on})" if recorded_on else ""))
    return ", ".join(parts)


def verification_verdict(verified: dict[str, Any]) -> str:
    """A bundle's ``verified`` record as its verdict: "bitwise match", "match by statistics only for
    ... , not bit for bit" (a sparse result, the main step's or an inner step's), "nothing compared" or
    "MISMATCH", and what a match did not compare."""
    verdict = {True: "bitwise match", None: "nothing compared"}.get(verified.get("match"), "MISMATCH")
    by_statistics = verified.get("by_statistics")
    if not isinstance(by_statistics, list):  # (made before bundles kept it: the main step's output summaries)
        outputs = verified.get("outputs") if isinstance(verified.get("outputs"), list) else []
        by_statistics = [o.split(": ", 1)[0] for o in outputs if isinstance(o, str) and f": {BY_STATISTICS}" in o]
    if verified.get("match") is True and by_statistics:  # (a sparse result: its statistics are all there is)
        verdict = f"match by statistics only for {', '.join(map(str, by_statistics[:3]))}, not bit for bit"
    unseen = verified.get("not_compared")
    if verified.get("match") is True and isinstance(unseen, list) and unseen:
        verdict += f" of what was compared (not recorded as data, not compared: {', '.join(map(str, unseen))})"
    return verdict


def verification_note(rec: Recording) -> str | None:
    """For a bundle verified when made, one line: its verdict, what verified it and what here differs
    from that (``state.environment_differences``); None for a recording, or a bundle not verified.
    A bundle made before bundles recorded what verified them says so."""
    info = rec.bundle_info
    verified = info.get("verified") if info is not None else None
    if not isinstance(verified, dict):
        return None
    verdict = verification_verdict(verified)
    env = verified_environment(verified)
    if env is None:
        return (f"bundle verified when made: {verdict} (with what PaperDebugger, torch and machine is not recorded: "
                "made before bundles recorded it)")
    differences = state.environment_differences(env, verified=True)
    return (f"bundle verified when made: {verdict}, with {environment_text(env, rec.run_info)}; here "
            + ("the same" if not differences else "differs: " + "; ".join(differences)))


def _steps_drift(steps: list[Step], sources: dict[str, str]) -> list[str]:
    """A sentence for each file a bundled step's own code came from that no longer holds that code as
    recorded: carried (the script, which the steps need), a replay with ``--use-bundled-source`` runs the
    code changed since; not carried, none does, and a replay elsewhere finds the code nowhere unless that
    machine has the file. Said when the bundle is made, where the file can still be put back."""
    out, seen = [], set()
    for s in steps:
        file, code = s.definition.get("file"), s.definition.get("source")
        if not isinstance(file, str) or not isinstance(code, str) or (file, s.name) in seen or \
                not file.endswith(".py") or installed(file):
            continue
        seen.add((file, s.name))
        text = sources.get(file)
        if text is None:
            try:
                text = Path(file).read_text(encoding="utf-8") if os.path.isfile(file) else None
            except (OSError, UnicodeDecodeError):
                text = None
            if text is not None and _as_recorded_in(text, s.definition) is False:
                out.append(f"{file} is not carried: the code of {s.name} there changed since recording, so the "
                           "bundle holds no file with it as recorded (a replay of the bundle, with "
                           "--use-bundled-source too, imports the code of the machine it runs on); restore the "
                           "file as it was recorded and bundle again to carry it")
        elif _as_recorded_in(text, s.definition) is False:
            out.append(f"the carried {file} holds {s.name} changed since recording: a replay with "
                       "--use-bundled-source runs that code")
    return out


def _as_recorded_in(text: str, definition: dict[str, Any]) -> bool | None:
    """Whether a file's text defines a step's code as recorded, by its hash (a line added at the end of
    the recorded source still holds it as text); None where that cannot be told: code defined inside a
    function, or a recording without the hash."""
    qualname, digest = str(definition.get("ref", "")).partition(":")[2], definition.get("source_sha256")
    if not qualname or "<" in qualname or not isinstance(digest, str):
        return None
    copy = source_in(text, qualname)
    return copy is not None and hashlib.sha256(copy.encode()).hexdigest() == digest


def _carried_drift(steps: list[Step], sources: dict[str, str]) -> list[str]:
    """A sentence for each class of the steps' submodules (1.17) whose copy in a carried file is not the
    recorded code: a replay with ``--use-bundled-source`` runs that copy."""
    out, seen = [], set()
    for s in steps:
        for ref, entry, paths in submodule_entries(s._doc("module"), s.module_path):
            text = sources.get(entry["file"]) if isinstance(entry["file"], str) else None
            if ref in seen or text is None:
                continue
            seen.add(ref)
            copy = source_in(text, ref.partition(":")[2])
            if copy is None or hashlib.sha256(copy.encode()).hexdigest() != entry["source_sha256"]:
                label = submodule_label(ref, s.name, paths)
                out.append(f"the carried {entry['file']} holds {label} changed since recording: a replay with "
                           "--use-bundled-source runs that code" if copy is not None else
                           f"the carried {entry['file']} no longer defines {label}: a replay with "
                           "--use-bundled-source cannot rebuild it")
    return out


def _renumbered(message: str, rows: list[int]) -> str:
    """A replay's message about a bundle's steps, with each "step N" the recording's number (``rows``:
    the recording's index of each bundled step)."""
    return re.sub(r"\bstep (\d+)\b", lambda m: f"step {rows[int(m[1])]}" if int(m[1]) < len(rows) else m[0],
                  message)


def _write_store(rec: Recording, where: Path, rows: list[int], full: set[int], main: Step,
                 script: str | None, buffers_of: set[int] | None = None) -> int:
    """Copy the chosen steps into a new store; returns the main step's new index. ``script``: the
    script to name in its run information instead of the recording's (a notebook session's cells, a
    script that moved since recording). ``buffers_of``: steps whose buffers' payloads come along too."""
    rank = rec.rank
    run_attrs = {**rec.run_info, "bundle_of": str(rec.path)}
    if script is not None:
        run_attrs["script"] = script
    # The recording's own schema version: what its documents hold is what that version recorded (a 1.12
    # recording's dict subclasses are plain dicts), and a reader must read the bundle's as it reads the recording's.
    writer = StoreWriter(backend.open_store(where, mode="w"), run_attrs=run_attrs, compression=codecs.parse(None),
                         schema_version=rec.reader.schema_version)
    writer.create()
    new = {old: i for i, old in enumerate(rows)}
    cols = {name: np.asarray(rank.column(f"steps/{name}")) for name in
            ("phase", "iteration", "call", "parent", "forward", "status", "t_start", "t_end")}
    flags = step_flags(rec)
    hashes = np.asarray(rank.column("payloads/hash")) if rank.lengths.get("payloads") else None
    kept: set[int] = set()  # payload rows copied (dedup: inner steps keep those they share)
    full_payloads = {r.payload for old in full for r in rec.step(old).records if r.has_payload}
    full_payloads |= {r.payload for old in buffers_of or () for r in rec.step(old).records
                      if r.role == "buffer" and r.has_payload}
    # The results of the steps inside the bundled ones (an inner forward's output, an inner backward's grad
    # inputs and parameter grads): what a replay of the main step compares them by, bit for bit, as a replay of
    # the recording does (with statistics alone, a bundle that replays exactly said "by statistics only").
    inside = set(rows) - set(buffers_of or ()) - full
    full_payloads |= {r.payload for old in inside for r in rec.step(old).records
                      if r.has_payload and r.role in ("output", *layout.GRAD_ROLES)}
    rng_ids: dict[int, int] = {}
    for old in rows:
        step = rec.step(old)
        row: dict[str, Any] = {k: cols[k][old].item() for k in cols}
        row["parent"] = new.get(int(row["parent"]), layout.NO_REF)
        row["forward"] = new.get(int(row["forward"]), layout.NO_REF)
        row["flags"] = int(flags[old])
        for name in _DOC_COLUMNS:
            doc = step._doc(name)
            row[name] = layout.NO_REF if doc is None else writer.doc(doc)
        rng_doc = step._doc("rng")
        if isinstance(rng_doc, dict):
            parts = {}
            for part, doc_id in rng_doc.items():
                if int(doc_id) not in rng_ids:
                    rng_ids[int(doc_id)] = writer.doc(rank.doc(int(doc_id)))
                parts[part] = rng_ids[int(doc_id)]
            row["rng"] = writer.doc(parts)
        else:
            row["rng"] = layout.NO_REF
        columns: dict[str, list[Any]] = {n: [] for n in layout.TENSOR_COLUMNS if n not in ("step", "dims_start")}
        dims: list[int] = []
        for r in step.records:
            pid = layout.NO_REF
            if r.has_payload and hashes is not None and (old in full or r.payload in full_payloads):
                units, unit = rank.payload_units(r.payload)
                hi, lo = (int(v) for v in hashes[r.payload])
                pid = writer.payload((hi, lo, unit), np.asarray(units))
                kept.add(r.payload)
            columns["role"].append(layout.role_value(r.role))
            columns["name"].append(writer.doc(r.name))
            columns["dtype"].append(writer.doc(r.dtype))
            columns["device"].append(writer.doc(r.device))
            columns["requires_grad"].append(r.requires_grad)
            columns["ndim"].append(len(r.shape))
            columns["stats"].append(tuple(r.stats[k] for k in layout.STAT_NAMES))
            columns["payload"].append(pid)
            dims += list(r.shape)
            dims += list(r.stride) if len(r.stride) == len(r.shape) else [-1] * len(r.shape)
        row["tensor_start"] = writer.tensors_of_step(new[old], columns, dims)
        row["tensor_count"] = len(step.records)
        writer.step(new[old], row)
    objects = rec.rank.final.get(OBJECTS_KEY, rec.rank.committed_info.get(OBJECTS_KEY))  # (which object ran a step)
    writer.close("complete", {"bundle": True, **({OBJECTS_KEY: objects} if objects else {})})
    return new[main.index]


_REPRO = '''"""Replays the failing step in {bundle_doc} and compares it, bit for bit, with what was recorded.

    python repro.py [BUNDLE] [--use-bundled-source]

Needs only paperdebugger (and the code the step uses, importable; --use-bundled-source: the code
the bundle carries instead, which it then runs). Exit status: 0 when the replay matches the
recording, 1 when it does not, 2 when the bundle cannot be read or replayed; a reader that left
(`python repro.py | head -3`) ends the output, not the answer.
"""

import os
import sys
from pathlib import Path

import replayer
from recorder.errors import PdbgError
from replayer import bundles


class _Stdout:
    """stdout, where a reader that left (a closed pipe) ends the output and not the script, whose exit
    status is still its answer."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._reader_left()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._reader_left()

    def _reader_left(self):
        try:  # what the stream still buffers goes nowhere at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
        except (OSError, ValueError):
            pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


sys.stdout = _Stdout(sys.stdout)
given = [a for a in sys.argv[1:] if a != "--use-bundled-source"]
bundle = Path(given[0]) if given else Path(__file__).with_name({bundle!r})
try:
    rec = replayer.open(bundle)
    result = replayer.replay(rec, rec.main_step, use_bundled_source="--use-bundled-source" in sys.argv[1:])
except PdbgError as exc:
    print(f"repro: {{exc}}", file=sys.stderr)
    sys.exit(2)
print(f"step {{result.step.index}} ({{result.step.name}}, {{result.step.phase}}): "
      + ("nothing compared" if not result.compared else "MISMATCH" if not result.match
         else ("match, by statistics only for " + ", ".join(result.by_statistics[:3])
               if getattr(result, "by_statistics", None) else "bitwise match")
         + ("" if not getattr(result, "not_compared", None) else
            ", in what was compared; not recorded as data, not compared: " + ", ".join(result.not_compared))
         + ("" if not getattr(result, "unseen_writes", None) else  # (an older paperdebugger has none)
            (", in what was compared" if not getattr(result, "not_compared", None) else "")
            + "; not compared: " + result.unseen_text)))
for diff in result.outputs:
    print(f"  {{diff.summary()}}")
changed = [s for s in result.inner if not s.match]
if changed:
    first = changed[0]
    print(f"  inner steps: {{len(changed)}} of {{len(result.inner)}} differ; the first: step {{first.step.index}} "
          f"({{first.step.name}}): {{first.reason or first.change}}")
extra = getattr(result, "unrecorded_inner", None)  # (an older paperdebugger has none)
if extra is not None:
    print(f"  {{extra.text}}")
if getattr(result, "bundled_source", None):  # (an older paperdebugger has none)
    print(f"  note: ran the copy of the code this bundle carries, not the code here: "
          f"{{', '.join(result.bundled_source)}}")
for line in result.warnings + result.environment_differences:
    print(f"  note: {{line}}")
verified = getattr(bundles, "verification_note", lambda rec: None)(rec)  # (an older paperdebugger has none)
if verified:
    print(f"  note: {{verified}}")
sys.exit(0 if result.match else 1)
'''


def _write_script(bundle_path: Path) -> Path:
    """repro.py beside the bundle. Its name goes into the script's code as a literal (``repr``), and into
    its docstring as it is where printable, else as that literal, with every backslash and quote escaped:
    any name the file system allows (``eq\\x3.pdbg``, ``a\"\"\"b.pdbg``, a newline) gives a script that runs."""
    script = bundle_path.with_name("repro.py")
    name = bundle_path.name
    shown = name if name.isprintable() else repr(name)
    script.write_text(_REPRO.format(bundle=name, bundle_doc=shown.replace("\\", "\\\\").replace('"', '\\"')),
                      encoding="utf-8")
    return script
