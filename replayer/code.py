"""Finding a recorded step's code again: import references, the script run as ``__main__``, drift.

A reference is ``"module:QualName"``. Code of an importable module is imported (with the recorded
working directory and script directory on the path, as the run had them). Code defined in the
script that ran as ``__main__`` is found through the script's recorded path: the script is loaded
as a fresh module *without* its ``if __name__ == "__main__":`` block, so nothing trains; a script
without such a guard is loaded with its definitions only (imports, functions, classes, constants).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import linecache
import os
import platform
import socket
import sys
import sysconfig
import threading
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recorder.annotate import is_main_guard, source_lines
from recorder.errors import ReplayError
from recorder.run import ipython_shell

from . import state

# The training script's module: ``__main__``, or ``__mp_main__`` in a process that multiprocessing's spawn
# (``torch.multiprocessing.spawn``) started, where the script is imported again under that name.
MAIN_NAMES = ("__main__", "__mp_main__")
_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _is_definition(node: ast.stmt) -> bool:
    """A top-level statement that only defines something (kept from a script without a main guard)."""
    if isinstance(node, _DEFINITIONS):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)  # a docstring
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        value = node.value
        return value is None or not any(isinstance(n, (ast.Call, ast.Await, ast.Yield)) for n in ast.walk(value))
    if isinstance(node, ast.Try):  # try: import fast / except ImportError: import slow
        return all(_is_definition(n) for n in [*node.body, *node.orelse, *node.finalbody,
                                               *(s for h in node.handlers for s in h.body)])
    if isinstance(node, ast.If):  # if TYPE_CHECKING: / if sys.version_info >= ...:
        return all(_is_definition(n) for n in [*node.body, *node.orelse])
    return False


def _loaded_now(node: ast.stmt) -> set[str]:
    """The names a top-level statement reads when it runs: everything but the bodies of the
    functions it defines (their decorators, defaults and annotations are read at once)."""
    names: set[str] = set()
    stack: list[ast.AST] = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            stack += [*n.decorator_list, *a.defaults, *(d for d in a.kw_defaults if d is not None)]
            stack += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                      if x is not None and x.annotation is not None]
            stack += [n.returns] if n.returns is not None else []
        elif isinstance(n, ast.Lambda):
            stack += [*n.args.defaults, *(d for d in n.args.kw_defaults if d is not None)]
        else:
            stack.extend(ast.iter_child_nodes(n))
    return names


def _sets(node: ast.stmt) -> list[str]:
    """The top-level names a statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AnnAssign, ast.AugAssign)) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


class Skipped(frozenset):
    """The names that top-level statements of an unguarded script left out by its loading would have set,
    and, in ``why``, per name, which statement was left out and why ("set at line 6 (LABEL = normalize(…)),
    a statement left out as it calls a function"): a replay's error names it (``CodeLoader.resolve``)."""

    why: dict[str, str]

    def __new__(cls, names: Any = (), why: dict[str, str] | None = None) -> Skipped:
        made = super().__new__(cls, names)
        made.why = {k: v for k, v in (why or {}).items() if k in made}
        return made


def _statement_text(source: str, node: ast.stmt) -> str:
    """A top-level statement as its first line reads ("def mélange(x):", "LABEL = normalize(...)"), cut short."""
    line = (ast.get_source_segment(source, node) or "").splitlines()[:1]
    text = line[0].strip() if line else type(node).__name__
    return text if len(text) <= 60 else text[:59] + "…"


def _left_out(source: str, node: ast.stmt, unset: set[str], why: dict[str, str]) -> str:
    """Why an unguarded script's loading leaves out a top-level statement, said of a name it sets: "set at
    line 6 (LABEL = normalize(…)), a statement left out as it calls a function", or, for a definition that
    reads a name a statement left out sets (``why`` says of that one), "set at line 9 (def f(x):), left out
    as it reads LABEL as it runs, set at line 6 (...), ..." """
    made = "defined" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else "set"
    where = f"{made} at line {node.lineno} ({_statement_text(source, node)})"
    reads = sorted(_loaded_now(node) & unset)
    if reads and _is_definition(node):
        first = reads[0]
        return f"{where}, left out as it reads {first} as it runs, {why.get(first, 'set by a statement left out')}"
    calls = any(isinstance(n, (ast.Call, ast.Await, ast.Yield)) for n in ast.walk(node))
    return f"{where}, a statement left out as it {'calls a function' if calls else 'is no definition'}"


def script_module(path: str | os.PathLike[str], text: str | None = None, main_module: str | None = None,
                  argv: list[str] | None = None) -> tuple[types.ModuleType, str, Skipped]:
    """Load a training script's definitions as a module named ``__main__`` (its classes and
    functions keep the ``__main__:QualName`` references they were recorded under). Returns the
    module, a note on what was left out, and the names that statements left out would have set
    (``Skipped``: with why each was left out).
    ``text``: the script's source, instead of reading it. ``main_module``: the module the script
    was run as (``python -m pkg.train``): loaded in its package, so that its relative imports work,
    with the package's directory on the path rather than the script's."""
    file = Path(path)
    try:
        source = file.read_text(encoding="utf-8") if text is None else text
        tree = ast.parse(source, filename=str(file))
    except OSError as exc:
        raise ReplayError(f"cannot read the training script {file} ({exc.strerror or exc}); pass its "
                          "current path with --script (replayer.replay(..., script=...))") from None
    except SyntaxError as exc:
        if text is not None:  # the copy a bundle carries, written for the Python that recorded it
            raise ReplayError(f"the bundle's copy of the training script {file} does not parse with this Python "
                              f"({platform.python_version()}; line {exc.lineno}: {exc.msg}); replay it with the "
                              "Python version it was recorded with (pdbg info names it)") from None
        raise ReplayError(f"the training script {file} does not parse now (line {exc.lineno}: {exc.msg}); "
                          "fix it or pass another copy with --script") from None
    body = [n for n in tree.body if not is_main_guard(n)]
    skipped: frozenset[str] = frozenset()  # names set by top-level statements left out
    why: dict[str, str] = {}  # name -> the statement left out that sets it, and why
    guarded = len(body) != len(tree.body)
    if guarded:
        note = "loaded without its if __name__ == '__main__' block"
    else:
        kept = [n for n in body if _is_definition(n)]
        names = list(dict.fromkeys(name for n in body if n not in kept for name in _sets(n)))
        unset = set(names) - {name for n in kept for name in _sets(n)}
        for n in body:
            if n not in kept:
                for name in _sets(n):
                    why.setdefault(name, _left_out(source, n, set(), why))
        while unset:  # a definition that reads a name only a skipped statement sets would fail: skipped too
            reading = [n for n in kept if _loaded_now(n) & unset]
            if not reading:
                break
            for n in reading:
                for name in _sets(n):
                    why.setdefault(name, _left_out(source, n, unset, why))
            kept = [n for n in kept if n not in reading]
            more = [name for n in reading for name in _sets(n) if name not in names]
            names += more
            unset = set(more) - {name for n in kept for name in _sets(n)}
        note = (f"the script has no if __name__ == '__main__' guard: loaded only its definitions "
                f"({len(body) - len(kept)} top-level statements skipped" + (
                    f"; names they set are not defined: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                    if names else "") + ")")
        body = kept
        skipped = frozenset(names)
    if str(path) == SESSION_SCRIPT:  # on no disk: its lines for inspect (drift) and tracebacks
        linecache.cache[SESSION_SCRIPT] = (len(source), None, source.splitlines(True), SESSION_SCRIPT)
    module = types.ModuleType("__main__", ast.get_docstring(tree))
    module.__file__ = str(file)
    module.__dict__["__builtins__"] = __builtins__
    where = str(file.resolve().parent)
    if main_module and all(part.isidentifier() for part in main_module.split(".")) and "." in main_module:
        module.__package__ = main_module.rpartition(".")[0]
        where = str(package_root(main_module, file.resolve()))
    # A guarded script's top level runs whole; an unguarded one's definitions one by one: one that
    # fails there (``out = sys.argv[1]``: the replaying process has other arguments) is left out
    # and named, with what reads what it would have set.
    parts = [body] if guarded else [[n] for n in body]
    failed: list[str] = []
    unset: set[str] = set()
    saved_main, saved_argv = sys.modules.get("__main__"), sys.argv
    sys.modules["__main__"] = module  # dataclasses and typing look the defining module up by name
    # The script's top level sees the arguments it was recorded with (``ITERS = int(sys.argv[1])``, an
    # argparse parser at module level), not the replaying program's (pdbg's own: "replay", a path).
    sys.argv = [str(file), *(str(a) for a in (argv or [])[1:])]
    try:
        with extra_path([where]), state.kept(), operators_again(str(file)):
            for part in parts:
                if not guarded and _loaded_now(part[0]) & unset:
                    for name in _sets(part[0]):
                        why.setdefault(name, _left_out(source, part[0], unset, why))
                    unset.update(_sets(part[0]))
                    continue
                code = compile(ast.Module(body=part, type_ignores=[]), str(file), "exec")
                try:
                    exec(code, module.__dict__)  # noqa: S102 - the user's own script, as they asked
                except (Exception, SystemExit) as exc:  # (sys.exit or argparse's error at its top level)
                    if guarded:
                        raise
                    failed.append(f"line {part[0].lineno}: {type(exc).__name__}: {exc}")
                    for name in _sets(part[0]):
                        why.setdefault(name, f"set at line {part[0].lineno} ({_statement_text(source, part[0])}), "
                                             f"which failed when loaded ({type(exc).__name__}: {exc})")
                    unset.update(_sets(part[0]))
                else:
                    unset.difference_update(() if guarded else _sets(part[0]))  # set again, later: defined
    except (Exception, SystemExit) as exc:
        again = isinstance(exc, RuntimeError) and any(t in str(exc) for t in ("TORCH_LIBRARY", "multiple times"))
        raise ReplayError(f"loading the definitions of {file} failed: {type(exc).__name__}: {exc}" + (
            "; an operator it defines with torch.library is in this process already with another schema (the "
            "training code that ran here, before the script was edited): replay in a new process (pdbg replay)"
            if again else "")) from None
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
    if failed:
        note += (f"; {len(failed)} of its definitions failed when loaded and were left out ({failed[0]}"
                 f"{'; ...' if len(failed) > 1 else ''}), and what reads them; names not defined: "
                 f"{', '.join(sorted(unset)[:8])}{' ...' if len(unset) > 8 else ''}")
        skipped = skipped | frozenset(unset)
    linecache.checkcache(str(file))
    return module, note, Skipped(skipped, why)


def package_root(name: str, file: str | os.PathLike[str]) -> Path:
    """The directory module ``name`` is imported from, given its file (``src`` for ``mypkg.train``
    at ``src/mypkg/train.py``, or for ``mypkg`` at ``src/mypkg/__init__.py``)."""
    root = Path(file).parent
    for _ in range(name.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent
    return root


@contextlib.contextmanager
def extra_path(dirs: list[str]) -> Iterator[None]:
    """Directories at the front of ``sys.path`` for the duration of an import."""
    saved = sys.path[:]
    sys.path[:0] = [d for d in dirs if d and d not in sys.path]
    try:
        yield
    finally:
        sys.path[:] = saved


# The torch.library Libraries the latest load of each file of the training code made (by the file name
# its code is compiled under), and the loads in progress, innermost last: (file, the Libraries it makes).
_LIBRARIES: dict[str, list[Any]] = {}
_LOADING: list[tuple[str, list[Any]]] = []
_LOADING_LOCK = threading.RLock()


@contextlib.contextmanager
def operators_again(file: str) -> Iterator[None]:
    """While ``file`` of the training code runs again (a script's definitions, a bundled module, loaded for a
    replay), the operators it defines with ``torch.library`` (a ``Library(ns, "DEF")`` or ``"FRAGMENT"``,
    ``torch.library.define``) are registered again as its code is now, where torch would refuse a second
    registration: what the file's latest load registered is taken back first (as ``torch.library.custom_op``
    replaces its own), and what the process registered otherwise (the training code that ran in this very
    process before it replays) stays: a ``DEF`` namespace is taken as a fragment, an operator of the same
    schema is not defined twice, and an implementation is registered over the one there for as long as this
    load's registrations last. Without it only the first replay in a process could load such a file (torch
    allows one ``DEF`` library per namespace)."""
    torch = sys.modules.get("torch")
    cls = getattr(getattr(torch, "library", None), "Library", None)
    if cls is None:  # torch is not even imported: nothing registered an operator
        yield
        return
    with _LOADING_LOCK:
        for lib in _LIBRARIES.pop(file, []):
            with contextlib.suppress(Exception):  # (one torch took back already: custom_op's)
                lib._destroy()
        made: list[Any] = []
        _LOADING.append((file, made))
        if len(_LOADING) == 1:
            _patch_library(torch, cls)
        try:
            with warnings.catch_warnings():  # torch's warning that a kernel is registered over another
                warnings.filterwarnings("ignore", message="Warning only once for all operators")
                yield
        finally:
            _LOADING.pop()
            if not _LOADING:
                for name, method in _ORIGINAL.items():
                    setattr(cls, name, method)
            _LIBRARIES[file] = made


_ORIGINAL: dict[str, Any] = {}  # torch.library.Library's methods while operators_again replaces them


def _patch_library(torch: Any, cls: Any) -> None:
    """``torch.library.Library``'s constructor, ``define`` and ``impl`` as ``operators_again`` needs them while
    a file loads. A Library made by other code than the loading file's (a module it imports for the first
    time) is left as torch makes it."""
    _ORIGINAL.update({name: cls.__dict__[name] for name in ("__init__", "define", "impl")})
    init, define, impl = _ORIGINAL["__init__"], _ORIGINAL["define"], _ORIGINAL["impl"]
    library = torch.library
    torch_dir, stdlib = os.path.dirname(torch.__file__) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep

    def passing(file: str) -> bool:  # torch's frames and the standard library's: torch.library.define's own
        return file.startswith(torch_dir) or (file.startswith(stdlib) and "-packages" + os.sep not in file)

    def making() -> list[Any] | None:
        """The Libraries of the load whose file's code makes this one."""
        frame = sys._getframe(2)
        while frame is not None and passing(frame.f_code.co_filename):
            frame = frame.f_back
        name = frame.f_code.co_filename if frame is not None else None
        return next((made for file, made in reversed(_LOADING) if file == name), None)

    def loaded(lib: Any) -> bool:
        return any(lib is other for _, made in _LOADING for other in made)

    def __init__(self: Any, ns: str, kind: str, dispatch_key: str = "") -> None:
        made = making()
        init(self, ns, "FRAGMENT" if made is not None and kind == "DEF" else kind, dispatch_key)
        if made is not None:
            made.append(self)

    def define_again(self: Any, schema: Any, *args: Any, **kwargs: Any) -> Any:
        if loaded(self) and isinstance(schema, str):
            name = schema.split("(")[0].strip()
            base, _, overload = name.partition(".")
            try:
                there = str(torch._C._get_schema(f"{self.ns}::{base}", overload))
            except RuntimeError:  # not defined
                there = None
            if there is not None and there == str(torch._C.parse_schema(f"{self.ns}::{schema}")):
                return base  # (what torch's define returns: the name without its overload)
        return define(self, schema, *args, **kwargs)

    def impl_again(self: Any, op_name: Any, fn: Any, dispatch_key: str = "", *args: Any, **kwargs: Any) -> Any:
        registered = getattr(library, "_impls", None)
        if loaded(self) and isinstance(op_name, str) and isinstance(registered, set):
            # (older torch refuses a kernel over one registered from Python, with no allow_override)
            registered.discard(f"{self.ns}/{op_name.split('::')[-1]}/{dispatch_key or self.dispatch_key}")
        return impl(self, op_name, fn, dispatch_key, *args, **kwargs)

    cls.__init__, cls.define, cls.impl = __init__, define_again, impl_again


SESSION_SCRIPT = "notebook-session.py"  # a bundle's name for the cells of the interactive session that recorded it


def session_statement(name: str, why: str | None) -> str:
    """Why a bundle's replay of a notebook's cells has no ``name``: a statement of a cell sets it (``why``: which,
    at its line in the carried cells), and the replay runs only the cells' imports and definitions."""
    return (f"{name} is set in a cell of the notebook session by a statement"
            f"{f' ({why})' if why else ''}, and a bundle's replay runs only the cells' imports and definitions, never "
            f"their statements; set {name} without a call, or in a module, then record again and bundle from that "
            "notebook")


def location(file: Any, line: Any) -> str:
    """``file:line``, or for a cell of this kernel, whose file is a temporary name
    (``/tmp/ipykernel_4711/2890.py``), the cell as IPython's tracebacks name it: "Cell In[3], line 2"."""
    try:
        shell = ipython_shell()
        named = shell.compile.format_code_name(file) if shell is not None else None  # None: not a cell of it
    except Exception:  # (another IPython: the file it is)
        named = None
    if isinstance(named, tuple) and len(named) == 2 and all(isinstance(n, str) for n in named):
        return f"{named[0]} {named[1]}, line {line}"
    return f"{file}:{line}"


def made_here(run_info: dict[str, Any]) -> bool:
    """Was the recording made by this very process?"""
    return run_info.get("pid") == os.getpid() and run_info.get("hostname") == socket.gethostname()


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


class _BundleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports the modules a bundle carries from their bundled source (CodeLoader.bundle_imports);
    a package on the way to one whose ``__init__.py`` it does not carry is an empty namespace."""

    def __init__(self, loader: CodeLoader) -> None:
        self.loader = loader
        self.parents = {p for n in loader.bundled_names for p in _parents(n)}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        file = self.loader.bundled_names.get(fullname)
        if file is None and fullname not in self.parents:
            return None
        package = fullname in self.parents or (file is not None and file.endswith("__init__.py"))
        return importlib.util.spec_from_loader(fullname, self, origin=file, is_package=package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        file = self.loader.bundled_names.get(module.__name__)
        if file is None:  # a package the bundle has no __init__ of: nothing to run
            module.__path__ = []
            return
        module.__file__ = file
        if module.__spec__ is not None and module.__spec__.submodule_search_locations is not None:
            module.__path__ = [str(Path(file).parent)]
        with operators_again(file):
            exec(compile(self.loader.bundled[file], file, "exec"), module.__dict__)  # noqa: S102 - asked for


class CodeLoader:
    """Resolves ``module:QualName`` references of one recording. ``script`` overrides the path of
    the script that ran as ``__main__``."""

    def __init__(self, run_info: dict[str, Any], script: str | os.PathLike[str] | None = None,
                 bundled: dict[str, str] | None = None, live_main: bool = True,
                 spare: dict[str, str] | None = None, bundled_modules: dict[str, str] | None = None) -> None:
        self.run_info = run_info
        # module name -> file, for the bundled sources (a bundle's "modules"): imported from the bundle
        self.bundled_names = {k: v for k, v in (bundled_modules or {}).items()
                              if isinstance(k, str) and isinstance(v, str) and v in (bundled or {})}
        self.spare = spare or {}  # a bundle's sources, for a training script that is not on this machine
        self.live_main = live_main
        self.script = str(script) if script is not None else run_info.get("script")
        self.script_given = script is not None  # (a refusal then names the path given, not the recorded one)
        self._main: types.ModuleType | None = None
        self.bundled = bundled or {}  # file -> source: use these instead of the code installed here
        self._bundled_modules: dict[str, types.ModuleType] = {}
        self.notes: list[str] = []
        self.skipped: frozenset[str] = frozenset()  # names the training script's skipped statements set
        dirs = [os.getcwd(), run_info.get("cwd")]
        if self.script:
            dirs.append(str(Path(self.script).resolve().parent))
        self.dirs = [d for d in dirs if isinstance(d, str)]

    def main(self) -> types.ModuleType:
        if self._main is None:
            if self.script == SESSION_SCRIPT and SESSION_SCRIPT not in self.bundled:
                raise ReplayError("the step's code was defined in a notebook session, whose definitions this bundle "
                                  "carries: replay with --use-bundled-source (use_bundled_source=True in Python), "
                                  "which runs them")
            if not self.script:
                live = self._live_main()
                if live is None:
                    raise ReplayError("the step's code was defined in __main__ of an interactive session (a notebook "
                                      "or a REPL, no script), which only that session holds; replay it there (or "
                                      "bundle it there: replayer.bundle), or pass a file that defines it (--script, "
                                      "or script= in Python): a notebook saved as a script (jupyter nbconvert --to "
                                      "script) gives its definitions")
                return live
            text = self.bundled.get(self.script)
            if text is None and self.script in self.spare and not Path(self.script).is_file():
                raise ReplayError(f"the training script {self.script} is not on this machine; the bundle carries a "
                                  "copy, run only if you ask: replay with --use-bundled-source (use_bundled_source="
                                  "True in Python), which runs its definitions and its top-level statements outside "
                                  "`if __name__ == \"__main__\":`, or give the script with --script PATH")
            if text is None and self.script_given and not Path(self.script).is_file():
                recorded = self.run_info.get("script")
                raise ReplayError(f"the training script given with --script (script= in Python), {self.script}, is "
                                  f"not a file here; give the path the script recorded as {recorded} has now")
            with self.bundle_imports() if text is not None and text is self.bundled.get(self.script) \
                    else contextlib.nullcontext():
                main_module = self.run_info.get("main_module")
                argv = self.run_info.get("argv")
                self._main, note, self.skipped = script_module(
                    self.script, text, main_module if isinstance(main_module, str) else None,
                    argv if isinstance(argv, list) else None)
            if "no if __name__" in note and self.script != SESSION_SCRIPT and (
                    self.skipped or "(0 top-level statements skipped)" not in note):  # worth a warning: some left out
                self.notes.append(f"{self.script}: {note}")
        return self._main

    def file_of(self, name: str) -> str | None:
        """The file the code of module ``name`` was loaded from for this replay (its code's ``co_filename``),
        where it is loaded: the training script (``__main__``), a bundled module, an imported one."""
        if name in MAIN_NAMES:
            module: Any = self._main if self.script else self._live_main()
        else:
            module = self._bundled_modules.get(name) or sys.modules.get(name)
        file = getattr(module, "__file__", None)
        return file if isinstance(file, str) else None

    def _live_main(self) -> types.ModuleType | None:
        """This process's ``__main__``, when this process made the recording in an interactive session
        (a notebook's kernel, a REPL): the cells' definitions are there, the code the steps ran."""
        return sys.modules.get("__main__") if self.live_main and made_here(self.run_info) else None

    def module(self, name: str, file: str | None = None, *, needed_by: str = "the recording") -> types.ModuleType:
        """Import a module; ``file`` (where it was when recorded) adds the directory it was imported from;
        ``needed_by``: who asks, for the message when it cannot be imported."""
        if name in MAIN_NAMES:
            return self.main()
        if name in self._bundled_modules:
            return self._bundled_modules[name]
        if file and file in self.bundled:
            return self._from_bundle(name, file)
        dirs = list(self.dirs)
        if file:
            dirs.append(str(package_root(name, file)))
        try:
            with extra_path(dirs):
                return importlib.import_module(name)
        except ImportError as exc:
            if needed_by != "the recording":
                raise ReplayError(f"cannot import {name!r}, which {needed_by} names ({exc}); check the name, or run "
                                  "from the directory it is in (or put that directory on PYTHONPATH)") from None
            raise ReplayError(f"cannot import {name!r}, which the recording needs ({exc}); "
                              + self._where_to_find(name, file)) from None
        except Exception as exc:
            raise ReplayError(f"importing {name!r} failed: {type(exc).__name__}: {exc}") from None

    def _where_to_find(self, name: str, file: str | None) -> str:
        """What to do about a module the recording needs that cannot be imported here."""
        tail = name.replace(".", "/")
        if (file and file in self.spare) or any(f.replace("\\", "/").endswith((f"/{tail}.py", f"/{tail}/__init__.py"))
                                                for f in self.spare):
            return "this bundle carries its source: replay with --use-bundled-source (use_bundled_source=True)"
        cwd = self.run_info.get("cwd")
        top = name.partition(".")[0]
        if file and not os.path.exists(file):
            gone = f"its file when recorded, {file}, is not on this machine"
            return (f"{gone}: install the package, or put the directory that holds {top}/ (or {top}.py) on "
                    "PYTHONPATH" + (f" (git commit {self.run_info['git']['commit'][:12]} when recorded)"
                                    if isinstance(self.run_info.get("git"), dict)
                                    and isinstance(self.run_info["git"].get("commit"), str) else ""))
        here = f"run from the directory the run was recorded in ({cwd}), or " if isinstance(cwd, str) and \
            os.path.isdir(cwd) and os.path.realpath(cwd) != os.path.realpath(os.getcwd()) else ""
        return f"install it, or {here}put the directory that holds {top}/ (or {top}.py) on PYTHONPATH"

    @contextlib.contextmanager
    def bundle_imports(self) -> Iterator[None]:
        """While it lasts, ``import`` of a module the bundle carries (``bundled_names``) takes the
        bundle's source, before anything installed here; the modules it made are kept for the
        replay, and ``sys.modules`` is put back after."""
        if not self.bundled_names:
            yield
            return
        names = {*self.bundled_names, *(p for n in self.bundled_names for p in _parents(n))}
        saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
        sys.modules.update({n: m for n, m in self._bundled_modules.items() if n in names})
        finder = _BundleFinder(self)
        sys.meta_path.insert(0, finder)
        try:
            yield
        finally:
            sys.meta_path.remove(finder)
            for n in names:
                made = sys.modules.pop(n, None)
                if made is not None:
                    self._bundled_modules.setdefault(n, made)
            sys.modules.update(saved)

    def _from_bundle(self, name: str, file: str) -> types.ModuleType:
        """A module made from the source a bundle carries (only when the user asked for it)."""
        found = self._bundled_modules.get(name)
        if found is None and name in self.bundled_names:  # with the project modules it imports
            try:
                with self.bundle_imports():
                    found = importlib.import_module(name)
            except Exception as exc:
                raise ReplayError(f"the bundled source of {name} ({file}) failed to load: "
                                  f"{type(exc).__name__}: {exc}") from None
            self._bundled_modules[name] = found
        if found is None:
            found = types.ModuleType(name)
            found.__file__ = file
            saved = sys.modules.get(name)
            sys.modules[name] = found  # while it runs: dataclasses look their module up
            try:
                with operators_again(file):
                    exec(compile(self.bundled[file], file, "exec"), found.__dict__)  # noqa: S102 - asked for
            except Exception as exc:
                raise ReplayError(f"the bundled source of {name} ({file}) failed to load: "
                                  f"{type(exc).__name__}: {exc}") from None
            finally:
                if saved is not None:
                    sys.modules[name] = saved
                else:
                    del sys.modules[name]
            self._bundled_modules[name] = found
        return found

    def resolve(self, ref: str, file: str | None = None, *, needed_by: str = "the recording") -> Any:
        """The object a reference names (a class, or a function as decorated in the user's code);
        ``file``: the source file it was defined in when recorded, if known; ``needed_by``: who gave the
        reference (the recording, or a swap), for messages."""
        module_name, sep, qualname = ref.partition(":")
        if not sep or not module_name or not qualname:
            if needed_by != "the recording":
                raise ReplayError(f"{ref!r} is not an import reference: write MODULE:NAME, e.g. "
                                  "'mypkg.stable:smooth_relu'")
            raise ReplayError(f"malformed code reference {ref!r} in the recording")
        if "<locals>" in qualname:
            raise ReplayError(f"{qualname} (in {module_name}) was defined inside a function, so it cannot be "
                              "found again; define it at module level to replay it")
        if "<lambda>" in qualname:
            raise ReplayError(f"{qualname} (in {module_name}) is a lambda, which has no name to be found again by; "
                              "define it with def at module level to replay it")
        obj: Any = self.module(module_name, file, needed_by=needed_by)
        for part in qualname.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                left_out = getattr(self.skipped, "why", {}).get(part) if module_name == "__main__" and \
                    obj is self._main and self._main is not None else None
                if left_out is not None and self.script == SESSION_SCRIPT:
                    raise ReplayError(f"__main__ has no {qualname}: "
                                      f"{session_statement(part, left_out)}") from None
                if left_out is not None:  # the script's loading left it out, and said why in a note
                    raise ReplayError(
                        f"__main__ has no {qualname}: the training script {self.script} has no if __name__ == "
                        f"'__main__' guard, so a replay loads only its definitions, and left {part} out: {part} is "
                        f"{left_out}; put the script's training under if __name__ == '__main__': (the rest of its "
                        "top level then loads as it ran), or set what it reads without a call") from None
                if needed_by != "the recording":
                    raise ReplayError(f"{module_name} has no {qualname}; check the name") from None
                if module_name in MAIN_NAMES and obj is self._main and self.script == SESSION_SCRIPT:
                    raise ReplayError(f"the notebook session's cells that the bundle carries define no {qualname}: "
                                      "it was defined by a cell that does not parse as Python (a magic's, a shell "
                                      "command's), or by code a cell ran; define it in a plain cell or a module, "
                                      "record again and bundle from that notebook") from None
                if module_name in MAIN_NAMES and obj is self._main and self.script:  # which file was looked in
                    raise ReplayError(f"the training script {self.script} (__main__) has no {qualname} now: renamed "
                                      "or removed since the recording, or not the script recorded; give the one "
                                      "that defines it with --script (script= in Python)") from None
                raise ReplayError(f"{module_name} has no {qualname} now (renamed or removed since the "
                                  "recording?)") from None
        return obj

    @contextlib.contextmanager
    def sources(self) -> Iterator[None]:
        """Inside the block, the source lines of the files a bundle carries are what Python's
        ``linecache`` gives for them (``inspect``, tracebacks, an operation's code line): those it
        runs (``use_bundled_source``), and those not on this machine. What ``linecache`` held for
        them before comes back after."""
        files = {f: t for f, t in self.spare.items() if not Path(f).is_file()} | self.bundled
        saved = {f: linecache.cache.get(f) for f in files}
        for file, text in files.items():
            linecache.cache[file] = (len(text), None, text.splitlines(keepends=True), file)  # mtime None: kept
        try:
            yield
        finally:
            for file, entry in saved.items():
                if entry is None:
                    linecache.cache.pop(file, None)
                else:
                    linecache.cache[file] = entry

    @contextlib.contextmanager
    def _inspectable(self, obj: Any) -> Iterator[Any]:
        """``obj`` unwrapped, for ``inspect``: with the training script's module as ``__main__``
        while ``inspect`` looks a class of it up."""
        target = inspect.unwrap(obj) if callable(obj) and not isinstance(obj, type) else obj
        saved = sys.modules.get("__main__")
        swap = self._main is not None and getattr(target, "__module__", None) == "__main__"
        if swap:
            sys.modules["__main__"] = self._main  # type: ignore[assignment]
        try:
            yield target
        finally:
            if swap and saved is not None:
                sys.modules["__main__"] = saved

    def source_of(self, obj: Any) -> str | None:
        """The current source of a function or class, as the recorder computes it."""
        with self._inspectable(obj) as target:
            try:
                return "".join(source_lines(target)[0])
            except (OSError, TypeError):
                return None

    def drift(self, definition: dict[str, Any], obj: Any) -> str | None:
        """A sentence when the code now differs from the recorded code, else None."""
        recorded = definition.get("source_sha256")
        if not recorded:
            return None
        now = self.source_of(obj)
        where = location(definition.get("file"), definition.get("line"))
        name = definition.get("name") or definition.get("ref")
        if now is None:
            return f"source of {name} cannot be read now; it cannot be checked against the recording ({where})"
        if hashlib.sha256(now.encode()).hexdigest() != recorded:
            return f"code of {name} changed since recording ({self._where_now(obj, where)})"
        return None

    def submodule_drift(self, doc: Any, owner: str, module_path: str, classes: dict[str, Any]) -> list[str]:
        """A sentence for each class of the training code's own among a module step's submodules whose code
        now differs from the recorded code (the skeleton's ``submodule_code``, 1.17), or cannot be read;
        ``doc``: the step's module skeleton, ``owner``: the step's name, ``classes``: the rebuilt module's
        classes by reference (the code the replay runs: nothing else is imported)."""
        out = []
        for ref, entry, paths in submodule_entries(doc, module_path):
            cls = classes.get(ref)
            if cls is not None:
                drift = self.drift({**entry, "name": submodule_label(ref, owner, paths)}, cls)
                if drift:
                    out.append(drift)
        return out

    def _where_now(self, obj: Any, recorded: str) -> str:
        """``file:line`` of ``obj``'s code as loaded now, and where it was recorded when that differs
        (a script moved and given with --script)."""
        with self._inspectable(obj) as target:
            try:
                _, line, file = source_lines(target)
                now = location(file or inspect.getfile(target), line)
            except (OSError, TypeError):
                return recorded
        return now if now == recorded else f"{now}; recorded at {recorded}"


def submodule_entries(doc: Any, module_path: str = "") -> list[tuple[str, dict[str, Any], list[str]]]:
    """``(class reference, {"file", "line", "source_sha256"}, paths)`` for each class a module skeleton's
    ``submodule_code`` (1.17) holds the code of, with the paths (under ``module_path``) of the submodules
    of that class, in the skeleton's order; a reference no submodule has, or an entry of another form (a
    recording from someone else may hold anything), is left out."""
    code = doc.get("submodule_code") if isinstance(doc, dict) else None
    if not isinstance(code, dict) or not code:
        return []
    places: dict[str, list[str]] = {}
    stack: list[tuple[Any, str]] = [(doc, module_path)]
    while stack:
        node, path = stack.pop()
        children = node.get("children") if isinstance(node, dict) else None
        if not isinstance(children, dict):
            continue
        below = []
        for name, child in children.items():
            if isinstance(child, dict):
                where = f"{path}.{name}" if path else str(name)
                if isinstance(child.get("class"), str):
                    places.setdefault(child["class"], []).append(where)
                below.append((child, where))
        stack.extend(reversed(below))
    out = []
    for ref, entry in code.items():
        if ref in places and isinstance(entry, dict) and isinstance(entry.get("source_sha256"), str):
            file, line = entry.get("file"), entry.get("line")
            out.append((ref, {"file": file if isinstance(file, str) else None,
                              "line": line if isinstance(line, int) and not isinstance(line, bool) else None,
                              "source_sha256": entry["source_sha256"]}, places[ref]))
    return out


def submodule_place(owner: str, paths: list[str]) -> str:
    """``a submodule of Block: blocks.0.mlp``: where a submodule class is, as messages say it."""
    return f"a submodule of {owner}: " + ", ".join(paths[:2]) + (f" and {len(paths) - 2} more" if len(paths) > 2
                                                                 else "")


def submodule_label(ref: str, owner: str, paths: list[str]) -> str:
    """``MLP (a submodule of Block: blocks.0.mlp)``: a submodule class as messages name it."""
    return f"{ref.partition(':')[2] or ref} ({submodule_place(owner, paths)})"


def find_module_file(name: str, dirs: list[str]) -> Path | None:
    """Where module ``name`` would be imported from, found without importing anything."""
    parts = name.split(".")
    for base in [*dirs, *sys.path]:
        if not base or not os.path.isdir(base):
            continue
        root = Path(base).joinpath(*parts)
        for candidate in (root.with_suffix(".py"), root / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def projects(file: str) -> bool:
    """Whether a file is the training code's: outside the installed packages and the standard library."""
    parts = Path(file).parts
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "site-packages" not in parts and "dist-packages" not in parts and stdlib not in Path(file).parents


def late_imports(script: str, dirs: list[str], text: str) -> list[tuple[str, str, int]]:
    """``(module, function, line)`` for each ``import`` inside a function of the training script (``main()``'s
    ``import myops``, which loading the script for a replay does not run) of a module of the project, found in
    ``dirs`` or on the path, whose source holds ``text`` (an operator's namespace): read, never run."""
    try:
        tree = ast.parse(Path(script).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return []
    out = []
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for name in names:
                file = find_module_file(name, dirs)
                if file is None or not projects(str(file)):
                    continue
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    if text in file.read_text(encoding="utf-8") and name not in [m for m, _, _ in out]:
                        out.append((name, function.name, node.lineno))
                break
    return out


def static_source(file: str | os.PathLike[str], qualname: str) -> str | None:
    """The source of ``qualname`` in ``file`` as ``inspect`` would give it (decorators included),
    read with ``ast``: nothing is imported or run."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return source_in(text, qualname)


def source_in(text: str, qualname: str) -> str | None:
    """``static_source`` of the text of a file (a bundle's copy)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    nodes: list[ast.stmt] = tree.body
    node: ast.stmt | None = None
    for part in qualname.split("."):
        node = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            return None
        nodes = node.body  # type: ignore[attr-defined]
    assert node is not None
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    lines = text.splitlines(keepends=True)
    block = inspect.getblock(lines[first - 1:])
    return "".join(block)


def carried_drift(info: dict[str, Any], run_info: dict[str, Any], dirs: list[str]) -> list[dict[str, str]]:
    """For a bundle (``info``: its bundle.json), each source file it carries whose counterpart on this machine
    is not the bundled copy: ``{"file": carried path, "module": module name or "" for the script, "here": the
    file here}``; a file not here is left out (``drift_without_running`` says so of the steps' own code). A
    step's own definition can be unchanged while a helper it calls (a module of the project it imports) is not:
    ``pdbg info`` says which file, read, never run. The file here is the one a replay with the code here would
    import (``find_module_file``, the recorded file's root too), and for the script the recorded path."""
    sources, modules = info.get("sources") or {}, info.get("modules") or {}
    places: dict[str, tuple[str, Path | None]] = {}  # carried file -> (module, the file here, if any)
    for name, recorded in modules.items() if isinstance(modules, dict) else ():
        if isinstance(name, str) and isinstance(recorded, str) and isinstance(sources.get(recorded), str):
            extra = [str(package_root(name, recorded))] if name else []
            places[recorded] = (name, find_module_file(name, [*dirs, *extra]))
    script = run_info.get("script")
    if isinstance(script, str) and isinstance(sources.get(script), str) and script not in places:
        places[script] = ("", Path(script) if os.path.isfile(script) else None)
    out = []
    for carried, (module, here) in sorted(places.items()):
        if here is None:
            continue
        try:
            text = here.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError, ValueError):
            text = None
        if text != sources[carried]:
            out.append({"file": carried, "module": module, "here": str(here)})
    return out


def drift_without_running(definition: dict[str, Any], run_info: dict[str, Any], dirs: list[str]) -> str:
    """"unchanged", "changed since recording" or "not found here" for a definition's code, from
    the files on this machine alone (for ``pdbg info``, which must not run anything)."""
    ref = definition.get("ref") or ""
    module, _, qualname = ref.partition(":")
    if module in MAIN_NAMES:
        script = run_info.get("script")
        file = Path(script) if script and os.path.isfile(script) else None
    else:
        recorded = definition.get("file")  # where a replay looks too (CodeLoader.module): the recorded file's root
        extra = [str(package_root(module, recorded))] if isinstance(recorded, str) and module else []
        file = find_module_file(module, [*dirs, *extra])
    if file is None:
        return "not found here"
    now = static_source(file, qualname)
    if now is None:
        return f"not found in {file}"
    recorded = definition.get("source_sha256")
    if recorded and hashlib.sha256(now.encode()).hexdigest() != recorded:
        return f"changed since recording ({file})"
    return f"unchanged ({file})"
