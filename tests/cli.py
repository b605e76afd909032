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


def pdbg_here(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``pdbg`` run in this process (``tui.cli.main``), for the many one-line refusals of bad input: what a
    fresh process would print and return, without the second it takes to start one. SystemExit (argparse's
    refusals) is its exit code; any other exception propagates, failing the test as a traceback would."""
    import contextlib
    import io

    from tui.cli import main

    out, err = io.StringIO(), io.StringIO()
    before = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(before)
    return subprocess.CompletedProcess(["pdbg", *args], code, out.getvalue(), err.getvalue())
