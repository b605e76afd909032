"""Training launched as a package's module (``python -m mypkg.train``): its steps, defined in a
module whose relative imports need its package, replay (the recording names the module, and the
replay loads the script's definitions in its package); ``pdbg record -- -m mypkg.train`` records it
the same way."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli import pdbg, python

TRAIN = """
import os
import sys

import torch

import recorder
from .config import SCALE


@recorder.paper_step("Eq. 9", description="the loss, scaled by the config's factor")
def loss_fn(x):
    return (x * SCALE).square().mean()


def main():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    for _ in range(2):
        loss_fn(lin(torch.randn(3, 4))).backward()


if __name__ == "__main__":
    if os.environ.get("RECORD_TO"):
        with recorder.record(os.environ["RECORD_TO"]):
            main()
    else:
        main()
"""


def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    (root / "mypkg").mkdir(parents=True)
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "config.py").write_text("SCALE = 0.5\n")
    (root / "mypkg" / "train.py").write_text(TRAIN)
    return root


def test_steps_of_a_module_run_with_python_m_replay(tmp_path: Path, monkeypatch) -> None:
    """Every replay loaded train.py alone: "attempted relative import with no known parent package";
    pdbg record took -m for a file name."""
    root = project(tmp_path)
    monkeypatch.setenv("RECORD_TO", str(root / "in_code.zarr"))
    res = python("-m", "mypkg.train", cwd=root)
    assert res.returncode == 0, res.stderr
    monkeypatch.delenv("RECORD_TO")
    res = pdbg("record", "-o", "by_pdbg.zarr", "--", "-m", "mypkg.train", cwd=root)
    assert res.returncode == 0 and "(complete, 4 steps)" in res.stderr, res.stderr
    for run in ("in_code.zarr", "by_pdbg.zarr"):
        step = json.loads(pdbg("find", run, "loss_fn", "--json", cwd=root).stdout)["step"]
        assert step is not None and step["name"] == "loss_fn"
        verify = pdbg("verify", run, cwd=root)
        assert verify.returncode == 0 and "4 of 4 steps replayed bit for bit" in verify.stdout, verify.stdout
    import replayer

    for run in ("in_code.zarr", "by_pdbg.zarr"):
        with replayer.open(root / run) as rec:
            assert rec.step("loss_fn").definition["ref"] == "__main__:loss_fn"
            assert rec.run_info["main_module"] == "mypkg.train"
    for args, message in ((["-m", "nosuch.mod"], "pdbg: error: -m nosuch.mod: ModuleNotFoundError: No module named "
                                                 "'nosuch'"),
                          (["-m"], "pdbg: error: -m needs a module name, e.g. pdbg record -o run.zarr -- -m "
                                   "mypkg.train")):
        res = pdbg("record", "-o", "bad.zarr", "--", *args, cwd=root)
        assert res.returncode == 2 and res.stderr.strip() == message, res.stderr
        assert not (root / "bad.zarr").exists()
