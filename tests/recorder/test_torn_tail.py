"""A recording whose last chunk files were lost after their commit (a power cut: the manifest is synced, the
small chunk files before it are not) opens with the steps before them, says what was lost, and never reads
as complete. Before, every reader refused the whole run (`pdbg info`, bisect and replay exited 2 on the
truncated chunk, the TUI died with a traceback), though thousands of steps before it were intact."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import replayer
from tests.cli import ROOT, env, pdbg_here

CHILD = "tests.recorder.torn_child"
PER_CHUNK = 32  # rows per chunk of a step column in the child (8192 // 256)


def record(path: Path, *, close: bool = False) -> Path:
    """30 iterations of 4 steps (120: chunks 0..3 of a step column), a NaN at iteration 25 (step 100); then
    committed and SIGKILLed, or closed."""
    proc = subprocess.run([sys.executable, "-m", CHILD, str(path), "30", "25", *(["--close"] if close else [])],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == (0 if close else -9), proc.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record(tmp_path_factory.mktemp("torn") / "killed.zarr")


def torn(source: Path, tmp_path: Path, column: str = "steps/phase", chunk: str = "3", size: int = 0) -> Path:
    path = tmp_path / "torn.zarr"
    shutil.copytree(source, path)
    with open(path / "rank0" / column / "c" / chunk, "r+b") as f:
        f.truncate(size)
    return path


def test_a_torn_last_chunk_leaves_the_steps_before_it_readable_and_bit_exact(killed: Path, tmp_path: Path) -> None:
    """The last chunk of a step column emptied: the 96 steps before it open, crashed, every tensor as it was."""
    rec, whole = replayer.open(torn(killed, tmp_path)), replayer.open(killed)
    assert len(whole) == 120 and len(rec) == 3 * PER_CHUNK
    assert rec.status == "crashed"
    assert "rank0/steps/phase/c/3" in rec.rank.torn and f"{3 * PER_CHUNK} of its 120 committed steps" in rec.rank.torn
    assert rec.rank.torn in rec.ended_by
    for index in (0, len(rec) - 1):
        records, originals = rec.rank.tensor_records(index), whole.rank.tensor_records(index)
        assert [r.name for r in records] == [r.name for r in originals] and records
        for r, o in zip(records, originals):
            if o.has_payload:
                a, b = rec.rank.tensor(r), whole.rank.tensor(o)
                assert a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_bisect_does_not_call_a_torn_run_clean(killed: Path, tmp_path: Path) -> None:
    """The NaN of step 100 is in the lost steps: bisect says they were not looked at, not "no non-finite values"."""
    path = torn(killed, tmp_path)
    origin = replayer.first_nonfinite(replayer.open(path))
    assert origin.step is None and "not looked at" in origin.cause and "96 of its 120" in origin.cause
    out = pdbg_here("bisect", str(path), "--json", cwd=tmp_path)
    assert out.returncode in (0, 1) and "not looked at" in json.loads(out.stdout)["cause"], out.stderr


def test_pdbg_info_says_what_is_lost(killed: Path, tmp_path: Path) -> None:
    """`pdbg info` on a torn run: exit 0, the readable steps, and what was lost."""
    path = torn(killed, tmp_path, "steps/flags", size=5)
    out = pdbg_here("info", str(path), cwd=tmp_path)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert "crashed, 96 steps" in out.stdout and "96 of its 120 committed steps can be read" in out.stdout


def test_a_torn_tensor_chunk_cuts_the_steps_whose_records_are_in_it(killed: Path, tmp_path: Path) -> None:
    """Tensor records lost: the steps that point at them are cut, the ones before stay."""
    rec = replayer.open(killed)
    per = rec.rank._array("tensors/step").chunks[0]
    last = (rec.rank.lengths["tensors"] - 1) // per
    rec = replayer.open(torn(killed, tmp_path, "tensors/stats", f"{last}/0"))
    starts = rec.rank.column("steps/tensor_start") + rec.rank.column("steps/tensor_count")
    assert 0 < len(rec) < 120 and starts.max() <= last * per
    assert rec.rank.tensor_records(len(rec) - 1)


def test_a_complete_run_torn_is_not_complete(tmp_path: Path) -> None:
    """A closed run whose last chunk was lost reads incomplete, never complete."""
    path = torn(record(tmp_path / "closed.zarr", close=True), tmp_path)
    rec = replayer.open(path)
    assert rec.status == "incomplete" and len(rec) == 3 * PER_CHUNK and "can be read" in rec.ended_by


def test_nothing_readable_is_a_one_line_error(killed: Path, tmp_path: Path) -> None:
    """Every chunk of a step column torn: nothing can be read, a one-line error naming the chunk (exit 2); the run
    is not cut to no step (damage from the first chunk on is no torn end: info --check names each damaged column)."""
    path = torn(killed, tmp_path, chunk="3")
    for chunk in "012":
        (path / "rank0" / "steps" / "phase" / "c" / chunk).write_bytes(b"")
    out = pdbg_here("info", str(path), cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "rank0/steps/phase/c/0" in out.stderr, out.stderr


def test_the_tui_opens_a_torn_run(killed: Path, tmp_path: Path) -> None:
    """The TUI opens on a torn run and draws its last readable step (before: a traceback while drawing)."""
    from tui.app import PdbgApp, open_app

    async def main() -> None:
        app = open_app(str(torn(killed, tmp_path)))
        assert isinstance(app, PdbgApp)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            await pilot.press("end")
            await pilot.pause()
            assert app.rec.rank.torn

    asyncio.run(main())


def test_bisect_of_a_killed_run_says_its_uncommitted_steps_were_not_looked_at(tmp_path: Path) -> None:
    """Killed (SIGKILL) after a NaN that came after its last commit: bisect said "no non-finite values recorded",
    exit 0, a clean run; it says the process died and its steps after the last commit were not looked at."""
    path = tmp_path / "killed.zarr"
    proc = subprocess.run([sys.executable, "-m", CHILD, str(path), "12", "11", "--commit-at", "9"], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -9, proc.stderr[-3000:]
    rec = replayer.open(path)
    assert rec.status == "crashed" and len(rec) == 40  # iterations 0..9 committed, 10 and 11 (the NaN) lost
    origin = replayer.first_nonfinite(rec)
    assert origin.step is None and origin.cause.startswith("no non-finite values recorded; "), origin.cause
    assert "after its last commit" in origin.cause and "not looked at" in origin.cause, origin.cause
    out = pdbg_here("bisect", str(path), cwd=tmp_path)
    assert out.returncode == 0 and "not looked at" in out.stdout, out.stdout + out.stderr


def test_bisect_of_a_live_run_says_it_is_still_being_recorded(tmp_path: Path) -> None:
    """Read while training goes on (the NaN not yet made): bisect said "no non-finite values recorded" as of a
    finished clean run; it says the run is still being recorded and what it records after was not looked at."""
    path = tmp_path / "live.zarr"
    child = subprocess.Popen([sys.executable, "-m", CHILD, str(path), "12", "11", "--close", "--pause-at", "4"],
                             cwd=ROOT, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "committed"
        rec = replayer.open(path)
        assert rec.status == "recording" and len(rec) == 20
        cause = replayer.first_nonfinite(rec).cause
        assert cause.startswith("no non-finite values recorded; the run is still being recorded (20 steps"), cause
        out = pdbg_here("bisect", str(path), cwd=tmp_path)
        assert out.returncode == 0 and "still being recorded" in out.stdout, out.stdout + out.stderr
        # verify and find said nothing of it either: their answers are of the steps committed when read
        out = pdbg_here("verify", str(path), "--sample", "3", cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.splitlines()[-1] == (
            "the run is still being recorded: these are the 20 steps committed when it was read; the steps it "
            "records after were not verified (verify it again later)"), out.stdout + out.stderr
        assert json.loads(pdbg_here("verify", str(path), "--sample", "3", "--json", cwd=tmp_path).stdout)[
            "still_recording"] == 20
        out = pdbg_here("find", str(path), "*", "--when", "output.nan > 0", cwd=tmp_path)
        assert out.returncode == 1 and out.stdout.strip() == (
            "no step matches (of the 20 steps committed when read: the run is still being recorded; search it "
            "again later)"), out.stdout + out.stderr
    finally:
        child.communicate("\n", timeout=300)
    assert child.returncode == 0
    origin = replayer.first_nonfinite(replayer.open(path))  # finished: the NaN of iteration 11 is found
    assert origin.found and (origin.step or origin.entered).iteration == 11


def test_a_run_killed_between_its_last_commit_and_its_final_metadata_reads_as_it_closed(tmp_path: Path) -> None:
    """A kill after the close committed the final manifest (status complete) and before the final metadata was
    written: the run read complete with none of what closing says (its iterations, its end); that is in the
    manifest, which now stands in for the metadata."""
    finals = []
    for kill in (True, False):
        path = tmp_path / f"{kill}.zarr"
        child = subprocess.run([sys.executable, "-m", "tests.recorder.close_kill_child", str(path)]
                               + ([] if kill else ["--no-kill"]), cwd=ROOT, env=env(), capture_output=True, text=True,
                               timeout=300, check=False)
        assert child.returncode == (-9 if kill else 0), child.stderr
        finals.append({k: v for k, v in replayer.open(path).rank.final.items() if not k.endswith("_unix")})
    assert finals[0] == finals[1] and finals[0]["status"] == "complete", finals
    rec = replayer.open(tmp_path / "True.zarr")
    assert rec.status == "complete" and rec.ended_by is None
    origin = replayer.first_nonfinite(rec)
    assert origin.found and (origin.step or origin.entered).iteration == 2 and "died" not in origin.cause, origin.cause
