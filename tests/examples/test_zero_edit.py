"""examples/zero_edit: a plain training script, recorded by `pdbg record --modules` and verified by replay."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import replayer
from tests.cli import ROOT, pdbg, python

SCRIPT = "examples/zero_edit/train.py"
ITERATIONS, BLOCKS = 3, 3


def imports(path: Path) -> set[str]:
    """Every module a script imports."""
    tree = ast.parse(path.read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_recorded_unedited_then_every_step_replays(tmp_path: Path) -> None:
    """Recording leaves the script's stdout as it is, gives one forward and one backward step per
    block call, and `pdbg verify --json` replays every step bit for bit."""
    assert imports(ROOT / SCRIPT) == {"__future__", "argparse", "torch", "torch.nn", "torch.nn.functional"}
    out = tmp_path / "run.zarr"
    plain = python(SCRIPT, str(ITERATIONS), cwd=ROOT)
    rec = pdbg("record", "-o", str(out), "--modules", "blocks.*", "--", SCRIPT, str(ITERATIONS), cwd=ROOT)
    assert plain.returncode == 0 and rec.returncode == 0, rec.stderr
    assert rec.stdout == plain.stdout
    assert plain.stdout.count(": loss ") == ITERATIONS
    assert f"pdbg: recording in {out} (complete, {2 * BLOCKS * ITERATIONS} steps)" in rec.stderr

    run = replayer.open(out)
    got = [(s.name, s.phase, s.iteration, s.module_path) for s in run.steps]
    assert got == [("Block", phase, it, f"blocks.{b}") for it in range(ITERATIONS) for phase, order in
                   (("forward", range(BLOCKS)), ("backward", reversed(range(BLOCKS)))) for b in order]
    for step in run.steps.filter(phase="backward"):
        assert run.step(step.forward).module_path == step.module_path

    verify = pdbg("verify", str(out), "--json", cwd=tmp_path)
    assert verify.returncode == 0, verify.stderr
    assert json.loads(verify.stdout) == {"replayed": len(got), "matched": len(got), "mismatches": [],
                                         "not_replayed": [], "environment_differences": []}
