"""Running ``pdbg`` and Python scripts in fresh processes, the way a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"


def env() -> dict[str, str]:
    out = dict(os.environ)
    out.pop("COLUMNS", None)  # what pdbg prints to a pipe does not follow the terminal the tests run in
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    return out


def pdbg(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tui.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False, env=env())


def pdbg_as_a_user(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``pdbg`` with file permissions enforced: as root, without the capabilities that override them
    (util-linux's setpriv), as a user receiving someone else's files would run it."""
    drop = "-dac_override,-dac_read_search,-fowner"
    prefix = ["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}"] if os.geteuid() == 0 else []
    return subprocess.run([*prefix, sys.executable, "-m", "tui.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False, env=env())


def python(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False, env=env())


def pdbg_here(*args: str, cwd: Path, columns: int | None = None) -> subprocess.CompletedProcess[str]:
    """``pdbg`` run in this process (``tui.cli.main``): what a fresh process would print and return, without
    the seconds it takes to start one (torch's import). SystemExit (argparse's refusals) is its exit code; any
    other exception propagates, failing the test as a traceback would. Modules it imported from outside the
    installed packages and this project (the recording's own code, the user's helpers) are forgotten after, as
    they would be with the process: the next test's ``train.py`` or ``helpers.py`` is imported anew. Tests of
    what a fresh process does (a first replay, a bundle on another machine, code edited after this process
    imported it, signals) use ``pdbg``. ``columns``: the width of a terminal it writes to (COLUMNS), else a pipe's."""
    import contextlib
    import io

    from tui.cli import main

    out, err = io.StringIO(), io.StringIO()
    before, modules = os.getcwd(), set(sys.modules)
    # Its streams are pipes, not this process's terminal: no size to read (shutil.get_terminal_size asks
    # sys.__stdout__), and COLUMNS as given, else left out as env() leaves it out of a fresh process's environment.
    streams, outer = (sys.__stdout__, sys.__stderr__), os.environ.pop("COLUMNS", None)
    if columns is not None:
        os.environ["COLUMNS"] = str(columns)
    sys.__stdout__, sys.__stderr__ = out, err  # type: ignore[misc]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(before)
        sys.__stdout__, sys.__stderr__ = streams  # type: ignore[misc]
        os.environ.pop("COLUMNS", None)
        if outer is not None:
            os.environ["COLUMNS"] = outer
        for name in set(sys.modules) - modules:
            if _users(sys.modules[name]):
                del sys.modules[name]
    return subprocess.CompletedProcess(["pdbg", *args], code, out.getvalue(), err.getvalue())


def _users(module: object) -> bool:
    """Whether ``module`` is a user's (a script or helper of a test's), not an installed package's or this
    project's: a torch submodule imported lazily must stay imported (imported twice, it registers twice)."""
    file = getattr(module, "__file__", None)
    if not file:
        return False
    path = Path(file).resolve()
    if path.is_relative_to(SCRIPTS):
        return True
    homes = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)]
    homes += [ROOT / package for package in ("recorder", "replayer", "tui", "tests")]
    return not any(path.is_relative_to(home) for home in homes)
